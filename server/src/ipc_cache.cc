#include "wprep/server/ipc_cache.h"

#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/server/log.h"

#if WPREP_HAVE_CUDA
#include <cuda.h>  // types only: libcuda is never linked, its entry points come at run time
#endif

namespace wprep::server {

struct IpcCache::Entry {
  int ordinal = 0;
  std::string handle;
  void* base = nullptr;      // the opened mapping (start of the exported allocation)
  uint64_t avail = 0;        // bytes from `base` to the end of the allocation
  int refs = 0;              // leases in flight
  absl::Time last_used;
  bool release_pending = false;
  bool closed = false;
  bool opening = false;      // one request is opening it outside the lock; others wait
};

namespace {

#if WPREP_HAVE_CUDA
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// cuMemGetAddressRange, resolved from the driver the runtime loaded (never linked).
GetAddressRangeFn AddressRangeFn() {
  static GetAddressRangeFn fn = []() -> GetAddressRangeFn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  return fn;
}
#endif

}  // namespace

IpcCache::IpcCache(int max_entries, absl::Duration idle_expiry, Metrics* metrics)
    : max_entries_(static_cast<size_t>(max_entries)), idle_expiry_(idle_expiry), metrics_(metrics) {
#if WPREP_HAVE_CUDA
  // Resolved now rather than inside the first request that opens a handle.
  (void)AddressRangeFn();
#endif
}

IpcCache::~IpcCache() { CloseAll(); }

IpcCache::Lease& IpcCache::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    if (cache_ != nullptr && entry_) cache_->Unref(entry_);
    cache_ = o.cache_;
    entry_ = std::move(o.entry_);
    ptr_ = o.ptr_;
    o.cache_ = nullptr;
    o.ptr_ = nullptr;
  }
  return *this;
}

IpcCache::Lease::~Lease() {
  if (cache_ != nullptr && entry_) cache_->Unref(entry_);
}

void IpcCache::CloseEntry(Entry& e) {
  if (e.closed) return;
  e.closed = true;
#if WPREP_HAVE_CUDA
  if (e.base != nullptr) {
    absl::Status s = WPREP_CUDA_STATUS(cudaSetDevice(e.ordinal));
    if (s.ok()) s = WPREP_CUDA_STATUS(cudaIpcCloseMemHandle(e.base));
    if (!s.ok()) LogLine(LogLevel::kWarning, "ipc_close_failed", LogQuote(s.message()));
  }
#endif
}

void IpcCache::PublishSizeLocked() {
  if (metrics_ != nullptr) metrics_->SetIpcCacheEntries(static_cast<double>(entries_.size()));
}

void IpcCache::ExpireLocked(absl::Time now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = *it->second;
    if (e.refs == 0 && now - e.last_used >= idle_expiry_) {
      CloseEntry(e);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

#if WPREP_HAVE_CUDA
absl::Status IpcCache::OpenMapping(Entry& entry, absl::string_view field) {
  // The daemon never relies on a current device: it names the GPU before each call.
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(entry.ordinal));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, entry.handle.data(), sizeof(h));
  void* base = nullptr;
  // The CUDA runtime requires cudaIpcMemLazyEnablePeerAccess here (0 is refused, seen on
  // an H200 pair), so a handle of another GPU's memory would open too, over the peer link.
  const cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it so later calls on this thread are clean
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".handle could not be opened on GPU ordinal ", entry.ordinal, ": ",
        cudaGetErrorName(err), " (", cudaGetErrorString(err),
        "). Send the 64 bytes cudaIpcGetMemHandle returned for a live cudaMalloc "
        "allocation of another process on the GPU named by ", field, ".device_uuid"));
  }
  entry.base = base;
  GetAddressRangeFn range_fn = AddressRangeFn();
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  if (range_fn == nullptr) {
    return absl::InternalError("cuMemGetAddressRange is not available from the CUDA driver");
  }
  if (CUresult r = range_fn(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
      r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", r));
  }
  entry.avail = range_base + range_size - reinterpret_cast<CUdeviceptr>(base);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<IpcCache::Entry>> IpcCache::FindOrOpen(
    std::unique_lock<std::mutex>& lock, int ordinal, absl::string_view handle,
    absl::string_view field, bool* was_open) {
  // The memory must live on the GPU the request names: an opened mapping cannot tell (see
  // ipc_owner.h), the handle's own bytes can.
  if (std::optional<int> owner = owner_map_.Owner(handle); owner && *owner != ordinal) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".handle was exported from memory on the daemon's GPU ordinal ", *owner,
        ", but ", field, ".device_uuid names the GPU at daemon ordinal ", ordinal,
        "; send the UUID of the GPU that holds the allocation (ListDevices maps ordinals to "
        "UUIDs)"));
  }
  ExpireLocked(absl::Now());
  const Key key(ordinal, std::string(handle));
  *was_open = false;
  for (;;) {
    auto it = entries_.find(key);
    if (it == entries_.end()) break;
    if (it->second->opening) {  // another request is opening this handle: use its mapping
      opened_.wait(lock);
      continue;  // look again: a failed open leaves no entry
    }
    std::shared_ptr<Entry> entry = it->second;
    *was_open = true;
    if (metrics_ != nullptr) metrics_->IpcCacheHit();
    entry->refs++;
    entry->last_used = absl::Now();
    return entry;
  }
  if (metrics_ != nullptr) metrics_->IpcCacheMiss();
  if (entries_.size() >= max_entries_) {
    // Evict the least recently used mapping that no request holds (entries being opened
    // are held by their opener).
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second->refs == 0 &&
          (victim == entries_.end() || it->second->last_used < victim->second->last_used)) {
        victim = it;
      }
    }
    if (victim == entries_.end()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "all ", max_entries_, " IPC mappings are in use by requests in flight; retry, or "
          "raise --ipc-cache-entries"));
    }
    CloseEntry(*victim->second);
    entries_.erase(victim);
  }
  // Opening takes 0.06-0.2 ms, or milliseconds for another GPU's memory: outside the
  // lock, so requests on other mappings go on. The opener's reference keeps the entry
  // from being evicted, expired or closed meanwhile.
  auto entry = std::make_shared<Entry>();
  entry->ordinal = ordinal;
  entry->handle = std::string(handle);
  entry->opening = true;
  entry->refs = 1;
  entries_.emplace(key, entry);
  PublishSizeLocked();
  const absl::Time open_start = absl::Now();
  lock.unlock();
  absl::Status s = OpenMapping(*entry, field);
  lock.lock();
  entry->opening = false;
  opened_.notify_all();
  if (!s.ok()) {
    CloseEntry(*entry);
    entries_.erase(key);
    PublishSizeLocked();
    return s;
  }
  LogLine(LogLevel::kInfo, "ipc_open",
          absl::StrCat("ordinal=", ordinal, " bytes=", entry->avail,
                       " seconds=", absl::ToDoubleSeconds(absl::Now() - open_start)));
  entry->last_used = absl::Now();
  return entry;
}
#endif

absl::Status IpcCache::CheckHandleSize(absl::string_view handle, absl::string_view field) {
  if (handle.size() == 64) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".handle must be the 64 bytes of a cudaIpcMemHandle_t, got ", handle.size(),
      " bytes"));
}

absl::StatusOr<IpcCache::Lease> IpcCache::Acquire(int ordinal, absl::string_view handle,
                                                  uint64_t offset, uint64_t size,
                                                  absl::string_view field) {
  if (absl::Status s = CheckHandleSize(handle, field); !s.ok()) return s;
#if !WPREP_HAVE_CUDA
  (void)ordinal, (void)offset, (void)size;
  return absl::InvalidArgumentError(absl::StrCat(field, ": this wprepd was built without CUDA"));
#else
  std::unique_lock<std::mutex> lock(mu_);
  bool was_open = false;
  absl::StatusOr<std::shared_ptr<Entry>> found = FindOrOpen(lock, ordinal, handle, field, &was_open);
  if (!found.ok()) return found.status();
  std::shared_ptr<Entry> entry = *std::move(found);  // holds a reference
  if (offset > entry->avail || size > entry->avail - offset) {
    UnrefLocked(entry);
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset ", offset, " + size ", size, " reaches beyond the allocation behind ",
        field, ".handle, which has ", entry->avail, " bytes"));
  }
  entry->release_pending = false;
  Lease lease;
  lease.cache_ = this;
  lease.entry_ = entry;
  lease.ptr_ = static_cast<uint8_t*>(entry->base) + offset;
  return lease;
#endif
}

absl::StatusOr<IpcCache::Registration> IpcCache::Register(int ordinal, absl::string_view handle,
                                                          absl::string_view field) {
  if (absl::Status s = CheckHandleSize(handle, field); !s.ok()) return s;
#if !WPREP_HAVE_CUDA
  (void)ordinal;
  return absl::InvalidArgumentError(absl::StrCat(field, ": this wprepd was built without CUDA"));
#else
  std::unique_lock<std::mutex> lock(mu_);
  Registration r;
  absl::StatusOr<std::shared_ptr<Entry>> found = FindOrOpen(lock, ordinal, handle, field, &r.was_open);
  if (!found.ok()) return found.status();
  std::shared_ptr<Entry> entry = *std::move(found);  // holds a reference
  absl::Status s;
  if (!r.was_open) {
    // The GPU's first access to a new mapping costs ~0.1 ms of the first kernel that uses
    // it (H200, driver 580); pay it here, outside the lock (the reference keeps the
    // mapping open).
    lock.unlock();
    s = TouchOnCuda(entry->base, entry->avail, cudaStreamPerThread);
    if (s.ok()) s = WPREP_CUDA_STATUS(cudaStreamSynchronize(cudaStreamPerThread));
    lock.lock();
  }
  // A registration asks for the mapping to stay: a pending release no longer applies.
  if (s.ok()) entry->release_pending = false;
  r.allocation_bytes = entry->avail;
  UnrefLocked(entry);
  if (!s.ok()) return s;
  return r;
#endif
}

void IpcCache::SetOwnerMap(IpcOwnerMap map) {
  std::lock_guard<std::mutex> lock(mu_);
  owner_map_ = std::move(map);
}

void IpcCache::Unref(const std::shared_ptr<Entry>& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  UnrefLocked(entry);
}

void IpcCache::UnrefLocked(const std::shared_ptr<Entry>& entry) {
  entry->refs--;
  entry->last_used = absl::Now();
  if (entry->refs == 0 && entry->release_pending) {
    CloseEntry(*entry);
    entries_.erase(Key(entry->ordinal, entry->handle));
    PublishSizeLocked();
  }
}

std::pair<int, int> IpcCache::Release(int ordinal, absl::string_view handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key(ordinal, std::string(handle)));
  if (it == entries_.end()) return {0, 0};
  if (it->second->refs > 0) {
    it->second->release_pending = true;
    return {0, 1};
  }
  CloseEntry(*it->second);
  entries_.erase(it);
  PublishSizeLocked();
  return {1, 0};
}

void IpcCache::ExpireIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t before = entries_.size();
  ExpireLocked(absl::Now());
  if (entries_.size() != before) PublishSizeLocked();
}

void IpcCache::CloseAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second->refs == 0) {
      CloseEntry(*it->second);
      it = entries_.erase(it);
    } else {
      it->second->release_pending = true;
      ++it;
    }
  }
  PublishSizeLocked();
}

size_t IpcCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace wprep::server
