#include "remote_convert.h"

#include <string>
#include <vector>

#include "wprep/client/client.h"

namespace wprep::cli {

absl::StatusOr<ConvertResult> RunRemoteConvert(const ConvertArgs& args) {
  auto input = ReadWholeFile(args.input);
  if (!input.ok()) return input.status();

  wprep::client::TuneHeapForStreaming();  // this process exists to move one tensor
  if (!args.input_strides.empty()) {
    // A strided view travels as it is, in one Convert (a stream carries dense memory order).
    wprep::v1::ConvertRequest req;
    *req.mutable_spec() = wprep::SpecToProto(args.spec);
    for (int64_t d : args.shape) req.add_logical_shape(d);
    for (int64_t s : args.input_strides) req.add_source_strides(s);
    req.set_source_bytes(input->data(), input->size());
    wprep::client::Client client(args.target, 1);
    auto response = client.Convert(req);
    if (!response.ok()) return response.status();
    const std::string& out = response->output_bytes_inline();
    if (auto s = WriteFileAtomically(args.output, reinterpret_cast<const uint8_t*>(out.data()), out.size()); !s.ok()) {
      return s;
    }
    return ConvertResult{std::vector<int64_t>(response->output_shape().begin(), response->output_shape().end()),
                         std::vector<int64_t>(response->output_strides().begin(), response->output_strides().end()),
                         response->output_bytes()};
  }
  wprep::v1::StreamRequestHeader header;
  *header.mutable_spec() = wprep::SpecToProto(args.spec);
  for (int64_t d : args.shape) header.add_logical_shape(d);

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
