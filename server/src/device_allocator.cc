#include "wprep/server/device_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/server/log.h"

namespace wprep::server {

DeviceAllocator::DeviceAllocator(int ordinal, uint64_t budget, DeviceMetrics* metrics)
    : ordinal_(ordinal), budget_(budget), metrics_(metrics) {}

absl::Status DeviceAllocator::Init() {
#if WPREP_HAVE_CUDA
  cudaMemPool_t pool = nullptr;
  WPREP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, ordinal_));
  // Keep up to the budget (or 1 GiB) cached between requests instead of returning it to
  // the driver at every synchronization: repeated requests then allocate at pool speed.
  uint64_t keep = budget_ == 0 ? (1ull << 30) : std::min<uint64_t>(budget_, 1ull << 30);
  WPREP_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
#endif
  return absl::OkStatus();
}

absl::Status DeviceAllocator::Reserve(uint64_t bytes, absl::Time deadline) {
  if (bytes == 0) return absl::OkStatus();
  std::unique_lock<std::mutex> lock(mu_);
  if (budget_ != 0 && bytes > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", bytes, " device bytes on GPU ", ordinal_, " but --max-device-bytes is ",
        budget_, "; use ConvertStream (bounded memory) or IPC buffers on both sides"));
  }
  while (budget_ != 0 && reserved_ + bytes > budget_) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "timed out waiting for ", bytes, " device bytes on GPU ", ordinal_, " (",
          reserved_, " of ", budget_, " reserved by other requests); retry later"));
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Milliseconds(100))));
  }
  reserved_ += bytes;
  return absl::OkStatus();
}

void DeviceAllocator::Unreserve(uint64_t bytes) {
  if (bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= std::min(bytes, reserved_);
  }
  cv_.notify_all();
}

absl::StatusOr<void*> DeviceAllocator::AllocateAsync(uint64_t bytes, CudaStream stream) {
  if (bytes == 0) return nullptr;
#if WPREP_HAVE_CUDA
  void* ptr = nullptr;
  cudaMemPool_t pool = nullptr;
  WPREP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, ordinal_));
  const cudaError_t err = cudaMallocFromPoolAsync(&ptr, bytes, pool, stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cudaMallocFromPoolAsync of ", bytes, " bytes on GPU ", ordinal_, " failed: ",
        cudaGetErrorName(err), "; lower the load or set --max-device-bytes"));
  }
  uint64_t now = 0, hw = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
#else
  (void)stream;
  return absl::FailedPreconditionError("no CUDA in this build");
#endif
}

absl::Status DeviceAllocator::FreeAsync(void* ptr, uint64_t bytes, CudaStream stream) {
  if (ptr == nullptr) return absl::OkStatus();
#if WPREP_HAVE_CUDA
  absl::Status s = WPREP_CUDA_STATUS(cudaFreeAsync(ptr, stream));
  uint64_t now = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    allocated_ -= std::min(bytes, allocated_);
    now = allocated_;
  }
  if (metrics_ != nullptr) metrics_->allocated_bytes->Set(static_cast<double>(now));
  return s;
#else
  (void)bytes;
  (void)stream;
  return absl::OkStatus();
#endif
}

uint64_t DeviceAllocator::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

uint64_t DeviceAllocator::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

RequestMemory::~RequestMemory() {
  for (auto& [ptr, bytes] : buffers_) {
    absl::Status s = allocator_->FreeAsync(ptr, bytes, stream_);
    if (!s.ok()) LogLine(LogLevel::kError, "device_free_failed", LogQuote(s.message()));
  }
#if WPREP_HAVE_CUDA
  // The reservation is returned only once the frees are ordered and the work is done.
  if (!buffers_.empty()) cudaStreamSynchronize(stream_);
#endif
  allocator_->Unreserve(reserved_);
}

absl::Status RequestMemory::Reserve(uint64_t bytes, absl::Time deadline) {
  absl::Status s = allocator_->Reserve(bytes, deadline);
  if (s.ok()) reserved_ += bytes;
  return s;
}

absl::StatusOr<void*> RequestMemory::Allocate(uint64_t bytes) {
  if (current_ + bytes > reserved_) {
    return absl::InternalError(absl::StrCat("allocation of ", bytes,
                                            " bytes outside the request's reservation"));
  }
  absl::StatusOr<void*> p = allocator_->AllocateAsync(bytes, stream_);
  if (!p.ok()) return p.status();
  if (*p != nullptr) buffers_.emplace_back(*p, bytes);
  current_ += bytes;
  peak_ = std::max(peak_, current_);
  return p;
}

}  // namespace wprep::server

namespace wprep::server {

PinnedHostPool::~PinnedHostPool() { Trim(); }

PinnedHostPool::Buffer& PinnedHostPool::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (pool_ != nullptr && data_ != nullptr) pool_->Put(data_, capacity_);
    pool_ = o.pool_;
    data_ = o.data_;
    capacity_ = o.capacity_;
    o.pool_ = nullptr;
    o.data_ = nullptr;
    o.capacity_ = 0;
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
  b.pool_ = this;
  b.capacity_ = cap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].first == cap) {
        b.data_ = free_[i].second;
        cached_ -= cap;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
  }
#if WPREP_HAVE_CUDA
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, cap, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cudaHostAlloc of ", cap,
                                                     " pinned bytes failed: ", cudaGetErrorName(err)));
  }
  b.data_ = static_cast<uint8_t*>(p);
  return b;
#else
  b.pool_ = nullptr;
  return absl::FailedPreconditionError("pinned host memory needs CUDA");
#endif
}

void PinnedHostPool::Put(uint8_t* data, uint64_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + capacity <= max_cached_) {
      free_.emplace_back(capacity, data);
      cached_ += capacity;
      return;
    }
  }
#if WPREP_HAVE_CUDA
  cudaFreeHost(data);
#endif
}

void PinnedHostPool::Trim() {
  std::vector<std::pair<uint64_t, uint8_t*>> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(free_);
    cached_ = 0;
  }
#if WPREP_HAVE_CUDA
  for (auto& [cap, p] : drop) cudaFreeHost(p);
#endif
}

}  // namespace wprep::server
