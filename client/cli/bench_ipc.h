// The CUDA IPC transport of `wprep bench`: each item's input and output in device memory
// of this process, converted IPC -> IPC. Built with CUDA only; elsewhere Make says so.
#ifndef WPREP_CLIENT_CLI_BENCH_IPC_H_
#define WPREP_CLIENT_CLI_BENCH_IPC_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "bench.h"
#include "wprep/client/client.h"

namespace wprep::cli {

// Device buffers for a set of items (one worker's): allocated, filled and exported once.
class IpcBench {
 public:
  virtual ~IpcBench() = default;
  // One Convert of item `i`, IPC -> IPC.
  virtual absl::Status Convert(client::Client& client, size_t i) = 0;
  // Lets the daemon drop its mappings; called before the buffers are freed.
  virtual void Release(client::Client& client) = 0;

  // Unimplemented without CUDA, FailedPrecondition without a GPU.
  static absl::StatusOr<std::unique_ptr<IpcBench>> Make(const std::vector<BenchItem>& items);
};

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_BENCH_IPC_H_
