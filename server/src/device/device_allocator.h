// The accounting device allocator: every device allocation of the daemon goes through
// one DeviceAllocator per GPU (the GPU's stream-ordered pool), which enforces the
// --max-device-bytes budget and measures each request's peak extra device bytes; and the
// pool of pinned host staging buffers.
#ifndef WPREP_SERVER_SRC_DEVICE_ALLOCATOR_H_
#define WPREP_SERVER_SRC_DEVICE_ALLOCATOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "device/device_runtime.h"
#include "net/metrics.h"

namespace wprep::server {

// Thread-safe.
class DeviceAllocator {
 public:
  // `budget` bytes (0 = unlimited) on GPU `ordinal` of `runtime`; `metrics` receives the
  // current and high-water gauges (may be null).
  DeviceAllocator(DeviceRuntime* runtime, int ordinal, uint64_t budget, DeviceMetrics* metrics);
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // Configures the GPU's pool to keep freed memory (up to the budget, at most 1 GiB).
  absl::Status Init();

  // Reserves `bytes` of the budget, waiting until they fit or `deadline` passes.
  // RESOURCE_EXHAUSTED when `bytes` exceeds the whole budget or the wait times out.
  absl::Status Reserve(uint64_t bytes, absl::Time deadline);
  void Unreserve(uint64_t bytes);

  // Stream-ordered allocation on this GPU (covered by a reservation). 0 bytes: nullptr.
  absl::StatusOr<void*> AllocateAsync(uint64_t bytes, Stream stream);
  absl::Status FreeAsync(void* ptr, uint64_t bytes, Stream stream);

  // Bytes allocated now and the most ever allocated at once.
  uint64_t allocated() const;
  uint64_t high_water() const;
  int ordinal() const { return ordinal_; }
  DeviceRuntime& runtime() const { return *runtime_; }

 private:
  // Constant after construction.
  DeviceRuntime* const runtime_;
  const int ordinal_;
  const uint64_t budget_;
  DeviceMetrics* const metrics_;

  mutable absl::Mutex mu_;
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t high_water_ ABSL_GUARDED_BY(mu_) = 0;
};

// The device memory of one request on one stream: a budget reservation, the buffers
// allocated under it and the peak of their sum. The destructor frees the buffers
// (stream-ordered), waits for the stream and returns the reservation. Not thread-safe.
class RequestMemory {
 public:
  RequestMemory(DeviceAllocator* allocator, Stream stream) : allocator_(allocator), stream_(stream) {}
  ~RequestMemory();
  RequestMemory(const RequestMemory&) = delete;
  RequestMemory& operator=(const RequestMemory&) = delete;

  // Reserves the request's whole need up front (see DeviceAllocator::Reserve).
  absl::Status Reserve(uint64_t bytes, absl::Time deadline);
  // Allocates within the reservation.
  absl::StatusOr<void*> Allocate(uint64_t bytes);
  // Extra device bytes held at the peak so far.
  uint64_t peak() const { return peak_; }

 private:
  DeviceAllocator* const allocator_;
  const Stream stream_;
  uint64_t reserved_ = 0;
  uint64_t current_ = 0;
  uint64_t peak_ = 0;
  std::vector<std::pair<void*, uint64_t>> buffers_;
};

// Pinned (page-locked, usable by every GPU) host staging buffers, pooled so copies
// between host and device run as DMA without an allocation per request. Buffers are
// rounded up to a power of two (at least 64 KiB); at most `max_cached_bytes` stay cached.
// Thread-safe.
class PinnedHostPool {
 public:
  PinnedHostPool(DeviceRuntime* runtime, uint64_t max_cached_bytes)
      : runtime_(runtime), max_cached_(max_cached_bytes) {}
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  // A pinned buffer of at least `bytes`, returned to the pool when destroyed.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& o) noexcept { *this = std::move(o); }
    Buffer& operator=(Buffer&& o) noexcept;
    ~Buffer();
    uint8_t* data() const { return data_; }
    uint64_t capacity() const { return capacity_; }

   private:
    friend class PinnedHostPool;
    PinnedHostPool* pool_ = nullptr;
    uint8_t* data_ = nullptr;
    uint64_t capacity_ = 0;
  };

  absl::StatusOr<Buffer> Get(uint64_t bytes);
  // Frees every cached buffer (buffers in use return to an empty pool later).
  void Trim();

 private:
  void Put(uint8_t* data, uint64_t capacity);

  DeviceRuntime* const runtime_;
  const uint64_t max_cached_;
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, uint8_t*>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_DEVICE_ALLOCATOR_H_
