#include "device/ipc_cache.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "net/log.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

struct IpcCache::Entry {
  int ordinal = 0;
  std::string handle;
  IpcMapping mapping;  // base = start of the exported allocation
  int refs = 0;        // leases in flight (and an opener)
  absl::Time last_used;
  bool release_pending = false;
  bool closed = false;
  bool opening = false;  // one request is opening it outside the lock; others wait
};

IpcCache::IpcCache(DeviceRuntime* runtime, int max_entries, absl::Duration idle_expiry,
                   Metrics* metrics)
    : runtime_(runtime),
      max_entries_(static_cast<size_t>(max_entries)),
      idle_expiry_(idle_expiry),
      metrics_(metrics) {}

IpcCache::~IpcCache() { CloseAll(); }

IpcCache::Lease& IpcCache::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    if (cache_ != nullptr && entry_) cache_->Unref(entry_);
    cache_ = std::exchange(o.cache_, nullptr);
    entry_ = std::move(o.entry_);
    ptr_ = std::exchange(o.ptr_, nullptr);
  }
  return *this;
}

IpcCache::Lease::~Lease() {
  if (cache_ != nullptr && entry_) cache_->Unref(entry_);
}

void IpcCache::CloseEntry(Entry& e) {
  if (e.closed) return;
  e.closed = true;
  if (e.mapping.base != nullptr) {
    absl::Status s = runtime_->CloseIpc(e.ordinal, e.mapping.base);
    if (!s.ok()) LogLine(LogLevel::kWarning, "ipc_close_failed", LogQuote(s.message()));
  }
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

absl::StatusOr<std::shared_ptr<IpcCache::Entry>> IpcCache::FindOrOpen(int ordinal,
                                                                      absl::string_view handle,
                                                                      bool* was_open) {
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle must be the 64 bytes of a cudaIpcMemHandle_t, got ", handle.size(), " bytes"));
  }
  // The memory must live on the GPU the request names: an opened mapping cannot tell (see
  // ipc_owner.h), the handle's own bytes can.
  if (std::optional<int> owner = owner_map_.Owner(handle); owner && *owner != ordinal) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle was exported from memory on the daemon's GPU ordinal ", *owner,
        ", but its device_uuid names the GPU at daemon ordinal ", ordinal,
        "; send the UUID of the GPU that holds the allocation (ListDevices maps ordinals to "
        "UUIDs)"));
  }
  // Sweep for idle mappings now and then rather than on every lookup: a sweep visits
  // every entry, and a loader's batch looks up dozens of handles among hundreds.
  if (const absl::Time now = absl::Now(); now >= next_sweep_) {
    ExpireLocked(now);
    next_sweep_ = now + std::clamp(idle_expiry_ / 8, absl::Milliseconds(1), absl::Seconds(1));
  }
  const Key key(ordinal, std::string(handle));
  *was_open = false;
  for (;;) {
    auto it = entries_.find(key);
    if (it == entries_.end()) break;
    if (it->second->opening) {  // another request is opening this handle: use its mapping
      opened_.Wait(&mu_);
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
  mu_.Unlock();
  absl::StatusOr<IpcMapping> mapping = runtime_->OpenIpc(ordinal, handle);
  mu_.Lock();
  entry->opening = false;
  opened_.SignalAll();
  if (!mapping.ok()) {
    entries_.erase(key);
    PublishSizeLocked();
    return absl::Status(mapping.status().code(),
                        absl::StrCat("handle could not be opened on GPU ordinal ", ordinal, ": ",
                                     mapping.status().message(),
                                     ". Send the 64 bytes cudaIpcGetMemHandle returned for a live "
                                     "cudaMalloc allocation of another process on the GPU named by "
                                     "device_uuid"));
  }
  entry->mapping = *mapping;
  LogLine(LogLevel::kInfo, "ipc_open",
          absl::StrCat("ordinal=", ordinal, " bytes=", mapping->bytes,
                       " seconds=", absl::ToDoubleSeconds(absl::Now() - open_start)));
  entry->last_used = absl::Now();
  return entry;
}

absl::StatusOr<IpcCache::Lease> IpcCache::Acquire(int ordinal, absl::string_view handle,
                                                  uint64_t offset, uint64_t size) {
  absl::MutexLock lock(&mu_);
  bool was_open = false;
  WPREP_ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, FindOrOpen(ordinal, handle, &was_open));
  const uint64_t avail = entry->mapping.bytes;
  if (offset > avail || size > avail - offset) {
    UnrefLocked(entry);
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + size ", size,
                                                   " reaches beyond the allocation behind the "
                                                   "handle, which has ",
                                                   avail, " bytes"));
  }
  entry->release_pending = false;
  Lease lease;
  lease.cache_ = this;
  lease.ptr_ = static_cast<uint8_t*>(entry->mapping.base) + offset;
  lease.entry_ = std::move(entry);
  return lease;
}

absl::StatusOr<IpcCache::Registration> IpcCache::Register(int ordinal, absl::string_view handle) {
  absl::MutexLock lock(&mu_);
  Registration r;
  WPREP_ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, FindOrOpen(ordinal, handle, &r.was_open));
  absl::Status s;
  if (!r.was_open) {
    // The GPU's first access to a new mapping costs ~0.1 ms of the first kernel that uses
    // it (H200, driver 580): pay it here, outside the lock (the reference keeps the
    // mapping open).
    mu_.Unlock();
    s = runtime_->Touch(ordinal, entry->mapping.base, entry->mapping.bytes);
    mu_.Lock();
  }
  // A registration asks for the mapping to stay: a pending release no longer applies.
  if (s.ok()) entry->release_pending = false;
  r.allocation_bytes = entry->mapping.bytes;
  UnrefLocked(entry);
  if (!s.ok()) return s;
  return r;
}

void IpcCache::SetOwnerMap(IpcOwnerMap map) {
  absl::MutexLock lock(&mu_);
  owner_map_ = std::move(map);
}

void IpcCache::Unref(const std::shared_ptr<Entry>& entry) {
  absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&mu_);
  const size_t before = entries_.size();
  ExpireLocked(absl::Now());
  if (entries_.size() != before) PublishSizeLocked();
}

void IpcCache::CloseAll() {
  absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace wprep::server
