#include "remote_convert.h"

#include <string>
#include <vector>

#include "wprep/client/client.h"

namespace wprep::cli {

absl::StatusOr<ConvertResult> RunRemoteConvert(const ConvertArgs& args) {
  auto input = ReadWholeFile(args.input);
  if (!input.ok()) return input.status();

  wprep::v1::StreamRequestHeader header;
  *header.mutable_spec() = wprep::SpecToProto(args.spec);
  for (int64_t d : args.shape) header.add_logical_shape(d);

  wprep::client::TuneHeapForStreaming();  // this process exists to stream one tensor
  wprep::client::Client client(args.target);  // two connections: large tensors stripe
  std::string output;
  auto response = client.ConvertStream(header, *input, &output);
  if (!response.ok()) return response.status();
  if (output.size() != response->output_bytes()) {
    return absl::DataLossError("the daemon announced " + std::to_string(response->output_bytes()) +
                               " output bytes but sent " + std::to_string(output.size()));
  }
  if (auto s = WriteFileAtomically(args.output, reinterpret_cast<const uint8_t*>(output.data()),
                                   output.size());
      !s.ok()) {
    return s;
  }
  ConvertResult result;
  result.shape.assign(response->output_shape().begin(), response->output_shape().end());
  result.strides.assign(response->output_strides().begin(), response->output_strides().end());
  result.bytes = response->output_bytes();
  return result;
}

}  // namespace wprep::cli
