// The device-run layer: one request's work on one GPU. A DeviceRun holds a stream of
// the GPU's pool, the request's device memory (inside the --max-device-bytes budget) and
// pinned staging for its host-side bytes, and runs every conversion with the same
// sequence: copy in -> convert (timed) -> copy out -> synchronize. Unary requests run
// one conversion, streams one per slice, the kernel warm-up one per variant.
#ifndef WPREP_SERVER_SRC_DEVICE_RUN_H_
#define WPREP_SERVER_SRC_DEVICE_RUN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "device/device_allocator.h"
#include "device/device_manager.h"
#include "wprep/kernels/plan.h"

namespace wprep::server {

// A conversion's input: plan.input_bytes in host memory (copied in through staging), or
// the view the plan describes in memory of the run's GPU.
struct RunInput {
  static RunInput Host(const uint8_t* bytes) { return {bytes, nullptr, true}; }
  static RunInput Device(const void* ptr) { return {nullptr, ptr, false}; }
  const uint8_t* host = nullptr;
  const void* device = nullptr;
  bool on_host = true;
};

class DeviceRun {
 public:
  // The most host-side bytes any one conversion of the run reads in and writes out (0
  // for a side that is always on the device): what the run stages and allocates.
  struct Staging {
    uint64_t input_bytes = 0;
    uint64_t output_bytes = 0;
  };

  // Leases a stream of `gpu` (waiting until `deadline`), then reserves and allocates the
  // device buffers for the host-side bytes (waiting for the budget until
  // `memory_deadline`). Host staging comes from `pinned`, or from ordinary memory when
  // pinned memory is short.
  static absl::StatusOr<std::unique_ptr<DeviceRun>> Begin(Gpu& gpu, PinnedHostPool& pinned,
                                                          const Staging& staging,
                                                          absl::Time deadline,
                                                          absl::Time memory_deadline);
  ~DeviceRun();
  DeviceRun(const DeviceRun&) = delete;
  DeviceRun& operator=(const DeviceRun&) = delete;

  // One planned conversion, finished when this returns (the caller answers next, and a
  // client reads its IPC destination as soon as it has the answer). A host output is
  // returned as a view of the run's staging, valid until the next Convert.
  // `device_out`: the output's memory on the run's GPU, or nullptr for a host output.
  struct Result {
    std::optional<double> kernel_seconds;  // the conversion alone, by device events
    absl::Span<const uint8_t> host_output;  // empty for a device output
  };
  absl::StatusOr<Result> Convert(const Plan& plan, RunInput in, void* device_out);

  // For batches: launches one conversion between memory of the run's GPU without
  // waiting for it. Conversions run in the order given, Convert's included; Wait
  // finishes them.
  absl::Status Enqueue(const Plan& plan, const void* device_in, void* device_out);
  // Waits for everything launched; the kernel seconds of each Enqueue, in order.
  absl::StatusOr<std::vector<std::optional<double>>> Wait();
  // Instead of Wait, for work answered before it finished: the timers of each Enqueue, in
  // order, to read once the work is done.
  std::vector<std::unique_ptr<DeviceTimer>> TakeTimers() { return std::exchange(enqueued_, {}); }
  // The stream the run's work is queued on.
  Stream stream() const { return lease_.stream(); }

  // Extra device bytes the run allocated (its staging buffers).
  uint64_t peak_extra_device_bytes() const { return memory_.peak(); }
  Gpu& gpu() const { return gpu_; }

 private:
  // Host staging: a pinned buffer, or ordinary memory when none could be had.
  class HostStage {
   public:
    absl::Status Get(PinnedHostPool& pool, uint64_t bytes);
    uint8_t* data() { return pinned_.data() != nullptr ? pinned_.data() : heap_.get(); }

   private:
    PinnedHostPool::Buffer pinned_;
    std::unique_ptr<uint8_t[]> heap_;
  };

  DeviceRun(Gpu& gpu, Gpu::StreamLease lease);

  Gpu& gpu_;
  Staging staging_;
  // Destroyed in reverse order: memory_ (frees, waits for the stream) before the staging
  // returns to its pool and the stream to the GPU.
  Gpu::StreamLease lease_;
  HostStage stage_in_, stage_out_;
  RequestMemory memory_;
  void* device_in_ = nullptr;   // the device copy of a host input
  void* device_out_ = nullptr;  // the device output before it is copied to the host
  std::vector<std::unique_ptr<DeviceTimer>> enqueued_;  // timers of Enqueue's launches
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_DEVICE_RUN_H_
