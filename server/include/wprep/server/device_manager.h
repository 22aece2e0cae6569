// The devices that serve conversions: every GPU in use (its identity, a pool of streams
// that is also its concurrency limit, its accounting allocator and warm state), and the
// CPU engine that serves bytes requests when no GPU is in use.
#ifndef WPREP_SERVER_DEVICE_MANAGER_H_
#define WPREP_SERVER_DEVICE_MANAGER_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/server/device_allocator.h"
#include "wprep/server/metrics.h"
#include "wprep/server/options.h"

namespace wprep::server {

using Uuid = std::array<uint8_t, 16>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
std::string FormatUuid(const Uuid& uuid);
// Accepts the form above (the "GPU-" prefix optional). InvalidArgument otherwise.
absl::StatusOr<Uuid> ParseUuid(absl::string_view text);
// A 16-byte protobuf field -> Uuid; InvalidArgument naming `field` otherwise.
absl::StatusOr<Uuid> UuidFromBytes(absl::string_view bytes, absl::string_view field);

struct GpuInfo {
  int ordinal = 0;  // the daemon's CUDA ordinal
  Uuid uuid{};
  std::string name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_memory = 0;
};

// One GPU in use. Thread-safe.
class Gpu {
 public:
  Gpu(GpuInfo info, int metrics_slot, uint64_t budget, DeviceMetrics* metrics);
  ~Gpu();

  // Holds one stream of the pool (and one unit of the concurrency limit) until destroyed.
  class StreamLease {
   public:
    StreamLease(StreamLease&& o) noexcept : gpu_(o.gpu_), stream_(o.stream_) { o.gpu_ = nullptr; }
    StreamLease& operator=(StreamLease&&) = delete;
    ~StreamLease();
    CudaStream stream() const { return stream_; }

   private:
    friend class Gpu;
    StreamLease(Gpu* gpu, CudaStream stream) : gpu_(gpu), stream_(stream) {}
    Gpu* gpu_;
    CudaStream stream_;
  };

  // Creates the streams and the allocator's pool.
  absl::Status Init(int streams);
  // Waits for a free stream until `deadline` (DEADLINE_EXCEEDED after it).
  absl::StatusOr<StreamLease> AcquireStream(absl::Time deadline);

  const GpuInfo& info() const { return info_; }
  int metrics_slot() const { return metrics_slot_; }
  DeviceAllocator& allocator() { return allocator_; }
  DeviceMetrics* metrics() const { return metrics_; }
  int streams() const { return num_streams_; }
  int in_flight() const { return in_flight_.load(); }
  bool warm() const { return warm_.load(); }
  void set_warm(bool warm);

 private:
  // Constant after Init.
  const GpuInfo info_;
  const int metrics_slot_;
  DeviceMetrics* const metrics_;
  DeviceAllocator allocator_;
  int num_streams_ = 0;
  std::vector<CudaStream> all_streams_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<CudaStream> free_streams_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> in_flight_{0};
  std::atomic<bool> warm_{false};
};

class DeviceManager {
 public:
  // Finds the GPUs (all, or those --devices names), creates their streams and pools.
  // With no GPU (no driver, no device, or no CUDA in the build) the CPU engine serves.
  static absl::StatusOr<std::unique_ptr<DeviceManager>> Create(const Options& options,
                                                               Metrics* metrics);

  // Runs every kernel variant once per GPU on a small tensor and compares it byte for
  // byte with the CPU engine; marks each GPU warm. Call before reporting SERVING.
  absl::Status WarmUp();

  size_t num_gpus() const { return gpus_.size(); }
  Gpu& gpu(size_t i) { return *gpus_[i]; }
  // The GPU with this UUID, or InvalidArgument naming `field` and the GPUs served.
  absl::StatusOr<Gpu*> FindByUuid(const Uuid& uuid, absl::string_view field);
  // The GPU with the fewest requests in flight, or nullptr when none is in use.
  Gpu* LeastLoaded();

  // Pinned host staging buffers shared by every GPU.
  PinnedHostPool& pinned() { return pinned_; }

  bool cpu_engine() const { return gpus_.empty(); }
  int cpu_threads() const { return cpu_threads_; }
  DeviceMetrics* cpu_metrics() const { return cpu_metrics_; }

 private:
  DeviceManager() = default;
  // Constant after Create.
  std::vector<std::unique_ptr<Gpu>> gpus_;
  PinnedHostPool pinned_{512ull << 20};
  int cpu_threads_ = 0;
  DeviceMetrics* cpu_metrics_ = nullptr;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_DEVICE_MANAGER_H_
