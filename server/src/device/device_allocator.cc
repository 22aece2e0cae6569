#include "device/device_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "net/log.h"

namespace wprep::server {

DeviceAllocator::DeviceAllocator(DeviceRuntime* runtime, int ordinal, uint64_t budget,
                                 DeviceMetrics* metrics)
    : runtime_(runtime), ordinal_(ordinal), budget_(budget), metrics_(metrics) {}

absl::Status DeviceAllocator::Init() {
  // Freed memory stays cached between requests instead of going back to the driver at
  // every synchronization: repeated requests then allocate at pool speed.
  if (metrics_ != nullptr) metrics_->budget_bytes->Set(static_cast<double>(budget_));
  const uint64_t keep = budget_ == 0 ? (1ull << 30) : std::min<uint64_t>(budget_, 1ull << 30);
  return runtime_->ConfigurePool(ordinal_, keep);
}

absl::Status DeviceAllocator::Reserve(uint64_t bytes, absl::Time deadline) {
  if (bytes == 0) return absl::OkStatus();
  if (budget_ != 0 && bytes > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", bytes, " device bytes on GPU ", ordinal_, " but --max-device-bytes is ",
        budget_, "; use ConvertStream (bounded memory) or IPC buffers on both sides"));
  }
  absl::MutexLock lock(&mu_);
  auto fits = [this, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return budget_ == 0 || reserved_ + bytes <= budget_;
  };
  bool got = fits();
  if (!got && deadline > absl::Now()) {
    // Counted as waiting (and as one wait) while other requests hold the budget. A deadline
    // already past only asks whether it fits now (a batch's extra lane): no wait to count.
    if (metrics_ != nullptr) {
      metrics_->memory_waits->Increment();
      metrics_->memory_waiting->Increment();
    }
    got = mu_.AwaitWithDeadline(absl::Condition(&fits), deadline);
    if (metrics_ != nullptr) metrics_->memory_waiting->Decrement();
  }
  if (!got) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "timed out waiting for ", bytes, " device bytes on GPU ", ordinal_, " (", reserved_,
        " of ", budget_, " reserved by other requests); retry later"));
  }
  reserved_ += bytes;
  return absl::OkStatus();
}

void DeviceAllocator::Unreserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ -= std::min(bytes, reserved_);
}

absl::StatusOr<void*> DeviceAllocator::AllocateAsync(uint64_t bytes, Stream stream) {
  if (bytes == 0) return nullptr;
  absl::StatusOr<void*> ptr = runtime_->AllocateAsync(ordinal_, bytes, stream);
  if (!ptr.ok()) return ptr.status();
  uint64_t now = 0, hw = 0;
  {
    absl::MutexLock lock(&mu_);
    allocated_ += bytes;
    high_water_ = std::max(high_water_, allocated_);
    now = allocated_;
    hw = high_water_;
  }
  if (metrics_ != nullptr) {
    metrics_->allocated_bytes->Set(static_cast<double>(now));
    metrics_->allocated_high_water_bytes->Set(static_cast<double>(hw));
  }
  return ptr;
}

absl::Status DeviceAllocator::FreeAsync(void* ptr, uint64_t bytes, Stream stream) {
  if (ptr == nullptr) return absl::OkStatus();
  absl::Status s = runtime_->FreeAsync(ordinal_, ptr, stream);
  uint64_t now = 0;
  {
    absl::MutexLock lock(&mu_);
    allocated_ -= std::min(bytes, allocated_);
    now = allocated_;
  }
  if (metrics_ != nullptr) metrics_->allocated_bytes->Set(static_cast<double>(now));
  return s;
}

uint64_t DeviceAllocator::allocated() const {
  absl::MutexLock lock(&mu_);
  return allocated_;
}

uint64_t DeviceAllocator::high_water() const {
  absl::MutexLock lock(&mu_);
  return high_water_;
}

RequestMemory::~RequestMemory() {
  for (auto& [ptr, bytes] : buffers_) {
    absl::Status s = allocator_->FreeAsync(ptr, bytes, stream_);
    if (!s.ok()) LogLine(LogLevel::kError, "device_free_failed", LogQuote(s.message()));
  }
  // The reservation is returned only once the frees are ordered and the work is done.
  if (!buffers_.empty()) {
    absl::Status s = allocator_->runtime().Synchronize(allocator_->ordinal(), stream_);
    if (!s.ok()) LogLine(LogLevel::kError, "device_sync_failed", LogQuote(s.message()));
  }
  allocator_->Unreserve(reserved_);
}

absl::Status RequestMemory::Reserve(uint64_t bytes, absl::Time deadline) {
  absl::Status s = allocator_->Reserve(bytes, deadline);
  if (s.ok()) reserved_ += bytes;
  return s;
}

absl::StatusOr<void*> RequestMemory::Allocate(uint64_t bytes) {
  if (current_ + bytes > reserved_) {
    return absl::InternalError(
        absl::StrCat("allocation of ", bytes, " bytes outside the request's reservation"));
  }
  absl::StatusOr<void*> p = allocator_->AllocateAsync(bytes, stream_);
  if (!p.ok()) return p.status();
  if (*p != nullptr) buffers_.emplace_back(*p, bytes);
  current_ += bytes;
  peak_ = std::max(peak_, current_);
  return p;
}

PinnedHostPool::~PinnedHostPool() { Trim(); }

PinnedHostPool::Buffer& PinnedHostPool::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (pool_ != nullptr && data_ != nullptr) pool_->Put(data_, capacity_);
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    capacity_ = std::exchange(o.capacity_, 0);
  }
  return *this;
}

PinnedHostPool::Buffer::~Buffer() {
  if (pool_ != nullptr && data_ != nullptr) pool_->Put(data_, capacity_);
}

absl::StatusOr<PinnedHostPool::Buffer> PinnedHostPool::Get(uint64_t bytes) {
  uint64_t cap = 64 << 10;
  while (cap < bytes) cap <<= 1;
  Buffer b;
  b.capacity_ = cap;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].first == cap) {
        b.pool_ = this;
        b.data_ = free_[i].second;
        cached_ -= cap;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
  }
  absl::StatusOr<void*> p = runtime_->AllocatePinned(cap);
  if (!p.ok()) return p.status();
  b.pool_ = this;
  b.data_ = static_cast<uint8_t*>(*p);
  return b;
}

void PinnedHostPool::Put(uint8_t* data, uint64_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    if (cached_ + capacity <= max_cached_) {
      free_.emplace_back(capacity, data);
      cached_ += capacity;
      return;
    }
  }
  runtime_->FreePinned(data);
}

void PinnedHostPool::Trim() {
  std::vector<std::pair<uint64_t, uint8_t*>> drop;
  {
    absl::MutexLock lock(&mu_);
    drop.swap(free_);
    cached_ = 0;
  }
  for (auto& [cap, p] : drop) runtime_->FreePinned(p);
}

}  // namespace wprep::server
