// The devices that serve conversions: every GPU in use (its identity, a pool of streams
// that is also its concurrency limit, its accounting allocator and warm state), and the
// CPU engine that serves bytes requests when no GPU is in use.
#ifndef WPREP_SERVER_SRC_DEVICE_MANAGER_H_
#define WPREP_SERVER_SRC_DEVICE_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "device/device_allocator.h"
#include "device/device_runtime.h"
#include "net/metrics.h"

namespace wprep::server {

struct Options;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
std::string FormatUuid(const Uuid& uuid);
// Accepts the form above (the "GPU-" prefix optional). InvalidArgument otherwise.
absl::StatusOr<Uuid> ParseUuid(absl::string_view text);

// One GPU in use. Thread-safe.
class Gpu {
 public:
  Gpu(DeviceRuntime* runtime, GpuInfo info, uint64_t budget, DeviceMetrics* metrics);
  ~Gpu();
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;

  // Holds one stream of the pool (and one unit of the concurrency limit) until destroyed.
  class StreamLease {
   public:
    StreamLease(StreamLease&& o) noexcept : gpu_(std::exchange(o.gpu_, nullptr)), stream_(o.stream_) {}
    StreamLease& operator=(StreamLease&&) = delete;
    ~StreamLease();
    Stream stream() const { return stream_; }

   private:
    friend class Gpu;
    StreamLease(Gpu* gpu, Stream stream) : gpu_(gpu), stream_(stream) {}
    Gpu* gpu_;
    Stream stream_;
  };

  // Creates the streams and configures the allocator's pool.
  absl::Status Init(int streams);

  // Daemon events of this GPU (DeviceRuntime::CreateEvent), made on first need and reused:
  // give an event back once no wait for its last record can still be queued.
  absl::StatusOr<Event> TakeEvent();
  void GiveEvent(Event event);
  // Records each of `marks` after the work queued so far on every stream of `lanes`: the
  // other lanes join the first through events taken here and appended to `joins` (give
  // them back once the marks completed), and the first records them. (A separate join
  // stream, which would delay no later work of the first lane, made a client stream's
  // wait for the marks slower on an H200, by 4-6 ms for a 36-layer model batch.)
  absl::Status RecordAfter(const std::vector<Stream>& lanes, const std::vector<Event>& marks,
                           std::vector<Event>* joins);
  // Waits for a free stream until `deadline` (DEADLINE_EXCEEDED after it).
  absl::StatusOr<StreamLease> AcquireStream(absl::Time deadline);

  const GpuInfo& info() const { return info_; }
  int ordinal() const { return info_.ordinal; }
  // "cuda:GPU-...", the engine name requests report.
  const std::string& engine_name() const { return engine_name_; }
  DeviceRuntime& runtime() const { return *runtime_; }
  DeviceAllocator& allocator() { return allocator_; }
  DeviceMetrics* metrics() const { return metrics_; }
  int streams() const { return static_cast<int>(all_streams_.size()); }
  int in_flight() const { return in_flight_.load(); }
  bool warm() const { return warm_.load(); }
  void set_warm(bool warm);

 private:
  void Release(Stream stream);

  // Constant after Init.
  DeviceRuntime* const runtime_;
  const GpuInfo info_;
  const std::string engine_name_;
  DeviceMetrics* const metrics_;
  DeviceAllocator allocator_;
  std::vector<Stream> all_streams_;

  absl::Mutex mu_;
  std::vector<Stream> free_streams_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> free_events_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> in_flight_{0};
  std::atomic<bool> warm_{false};
};

class DeviceManager {
 public:
  // Finds the GPUs of `runtime` (all, or those --devices names), creates their streams
  // and pools. With no GPU (no driver, no device, no CUDA in the build, or
  // --devices=cpu) the CPU engine serves.
  static absl::StatusOr<std::unique_ptr<DeviceManager>> Create(const Options& options,
                                                               DeviceRuntime* runtime,
                                                               Metrics* metrics);

  // Runs `warm_one` (the kernel warm-up, exec/kernel_warmup.h: every kernel variant
  // against the CPU engine; it returns the number of variants) on every GPU at once and
  // marks each GPU warm. Call before reporting SERVING.
  using WarmOne = absl::FunctionRef<absl::StatusOr<int>(Gpu& gpu, PinnedHostPool& pinned)>;
  absl::Status WarmUp(WarmOne warm_one);

  size_t num_gpus() const { return gpus_.size(); }
  Gpu& gpu(size_t i) { return *gpus_[i]; }
  // The GPU with this UUID, or InvalidArgument naming the GPUs served.
  absl::StatusOr<Gpu*> FindByUuid(const Uuid& uuid);
  // The GPU with the fewest requests in flight, or nullptr when none is in use.
  Gpu* LeastLoaded();

  // Pinned host staging buffers shared by every GPU.
  PinnedHostPool& pinned() { return pinned_; }

  bool cpu_engine() const { return gpus_.empty(); }
  int cpu_threads() const { return cpu_threads_; }
  DeviceMetrics* cpu_metrics() const { return cpu_metrics_; }
  DeviceRuntime& runtime() const { return *runtime_; }

 private:
  DeviceManager(DeviceRuntime* runtime, int cpu_threads)
      : runtime_(runtime), pinned_(runtime, 512ull << 20), cpu_threads_(cpu_threads) {}

  // Constant after Create.
  DeviceRuntime* const runtime_;
  std::vector<std::unique_ptr<Gpu>> gpus_;
  PinnedHostPool pinned_;
  const int cpu_threads_;
  DeviceMetrics* cpu_metrics_ = nullptr;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_DEVICE_MANAGER_H_
