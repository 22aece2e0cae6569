// `wprep bench`: latency and throughput of a running wprepd, per transport (unary bytes,
// streams, batches, CUDA IPC), layout, shape and concurrency.
#ifndef WPREP_CLIENT_CLI_BENCH_H_
#define WPREP_CLIENT_CLI_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

// One tensor a benchmark converts, with its input bytes.
struct BenchItem {
  std::string name;  // for the table: the shape ("4x2880x2880") or the tensor's name
  ConversionSpec spec;
  std::vector<int64_t> logical_shape;
  std::vector<int64_t> input_strides;  // empty: dense
  absl::Span<const uint8_t> input;
  uint64_t output_bytes = 0;
};

// Exit status: 0 done, 2 bad usage or an error (one line on stderr).
int BenchCommand(const std::vector<std::string>& args);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_BENCH_H_
