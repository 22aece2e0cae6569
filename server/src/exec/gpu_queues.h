// The GPU work of one batch of multi-operand items (MoE, quantize), in place in client
// memory: one stream of each GPU the batch touches, every item queued on it in request
// order, and one wait per GPU at the end, instead of a wait after each item.
#ifndef WPREP_SERVER_SRC_EXEC_GPU_QUEUES_H_
#define WPREP_SERVER_SRC_EXEC_GPU_QUEUES_H_

#include <cstddef>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "device/device_manager.h"

namespace wprep::server {

class GpuQueues {
 public:
  explicit GpuQueues(absl::Time deadline) : deadline_(deadline), start_(absl::Now()) {}
  GpuQueues(const GpuQueues&) = delete;
  GpuQueues& operator=(const GpuQueues&) = delete;
  // Waits for whatever was queued, so no stream goes back to its pool with the batch's work.
  ~GpuQueues() { (void)WaitAll([](Gpu&, const std::vector<size_t>&, double) {}); }

  // The batch's stream of `gpu` (taken from its pool on first use, until the deadline).
  absl::StatusOr<Stream> StreamOf(Gpu& gpu);
  // Item `index` was queued on `gpu`'s stream.
  void Queued(Gpu& gpu, size_t index);
  // Waits for every GPU's stream, then calls done(gpu, items queued there, seconds since the
  // batch started) for each; gives the streams back. The first failure, after every wait.
  absl::Status WaitAll(absl::FunctionRef<void(Gpu&, const std::vector<size_t>&, double)> done);

 private:
  struct Queue {
    Gpu* gpu;
    Gpu::StreamLease stream;
    std::vector<size_t> items;
  };
  Queue* Find(Gpu& gpu);

  const absl::Time deadline_;
  const absl::Time start_;
  std::vector<Queue> queues_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_GPU_QUEUES_H_
