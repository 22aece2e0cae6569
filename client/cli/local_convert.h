// `wprep convert --local`: the conversion in this process, on the CPU or a local GPU.
#ifndef WPREP_CLIENT_CLI_LOCAL_CONVERT_H_
#define WPREP_CLIENT_CLI_LOCAL_CONVERT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "convert_args.h"

namespace wprep::cli {

// What a successful conversion reports.
struct ConvertResult {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t bytes = 0;
};

// Reads args.input, converts, writes args.output. On any error the output file is not
// created (the bytes go to a temporary file renamed into place only on success).
absl::StatusOr<ConvertResult> RunLocalConvert(const ConvertArgs& args);

absl::StatusOr<std::vector<uint8_t>> ReadWholeFile(const std::string& path);
absl::Status WriteFileAtomically(const std::string& path, const uint8_t* data, size_t size);

// "output_shape [a, b] output_strides [c, d] output_bytes N"
std::string FormatResult(const ConvertResult& r);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_LOCAL_CONVERT_H_
