#include "device/ipc_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "net/log.h"
#include "net/peer_credentials.h"
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
  // VMM entries (AcquireVmm): duplicates of the chunks' descriptors and the owner's pidfd,
  // closed with the mapping.
  bool vmm = false;
  std::vector<int> vmm_fds;
  int owner_pidfd = -1;
};

namespace {

// A VMM key: this prefix, then random bytes, 64 in all (the length of a legacy handle, so
// the buffer it replaces passes every handle check on its way to the cache).
constexpr absl::string_view kVmmKeyPrefix("\0wprep-vmm\0", 11);

}  // namespace

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
    absl::Status s = e.vmm ? runtime_->CloseVmm(e.ordinal, e.mapping.base) : runtime_->CloseIpc(e.ordinal, e.mapping.base);
    if (!s.ok()) LogLine(LogLevel::kWarning, "ipc_close_failed", LogQuote(s.message()));
  }
  for (int fd : e.vmm_fds) close(fd);
  e.vmm_fds.clear();
  if (e.owner_pidfd >= 0) close(e.owner_pidfd);
  e.owner_pidfd = -1;
}

namespace {

// Duplicates of the chunks' descriptors (none for fabric handles).
std::vector<int> DupChunkFds(const VmmImportSpec& spec) {
  std::vector<int> out;
  if (spec.kind != VmmHandleKind::kPosixFd) return out;
  for (const VmmChunkHandle& c : spec.chunks) out.push_back(fcntl(c.fd, F_DUPFD_CLOEXEC, 0));
  return out;
}

// True when the chunks of `e` are the files of `spec` and its owner lives.
bool SameAllocation(const IpcCache::Entry& e, const VmmImportSpec& spec) {
  if (e.owner_pidfd >= 0 && ProcessExited(e.owner_pidfd)) return false;
  if (spec.kind == VmmHandleKind::kFabric) return true;  // the key names the handle bytes
  if (e.vmm_fds.size() != spec.chunks.size()) return false;
  for (size_t i = 0; i < spec.chunks.size(); ++i) {
    if (!SameFile(e.vmm_fds[i], spec.chunks[i].fd)) return false;
  }
  return true;
}

}  // namespace

void IpcCache::PublishSizeLocked() {
  if (metrics_ != nullptr) metrics_->SetIpcCacheEntries(static_cast<double>(entries_.size()));
}

void IpcCache::ExpireLocked(absl::Time now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = *it->second;
    // A VMM allocation's client is gone: its memory is the daemon's alone to keep alive,
    // so the mapping goes as soon as no request uses it.
    const bool owner_gone = e.vmm && !e.opening && e.owner_pidfd >= 0 && ProcessExited(e.owner_pidfd);
    if (owner_gone && e.refs > 0) e.release_pending = true;
    if (e.refs == 0 && (owner_gone || now - e.last_used >= idle_expiry_)) {
      CloseEntry(e);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<std::shared_ptr<IpcCache::Entry>> IpcCache::FindOrOpen(int ordinal,
                                                                      absl::string_view handle,
                                                                      bool* was_open, const VmmOpen* vmm) {
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle must be the 64 bytes of a cudaIpcMemHandle_t, got ", handle.size(), " bytes"));
  }
  const bool vmm_key = IsVmmKey(handle);
  // The memory must live on the GPU the request names: an opened mapping cannot tell (see
  // ipc_owner.h), the handle's own bytes can. (A VMM import checks its chunks itself.)
  if (std::optional<int> owner = vmm_key ? std::nullopt : owner_map_.Owner(handle); owner && *owner != ordinal) {
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
    if (vmm != nullptr && !SameAllocation(*entry, *vmm->spec)) {
      return absl::AbortedError("the cached VMM mapping is of another allocation");
    }
    *was_open = true;
    if (metrics_ != nullptr) metrics_->IpcCacheHit();
    entry->refs++;
    entry->last_used = absl::Now();
    return entry;
  }
  if (vmm_key && vmm == nullptr) {
    return absl::InvalidArgumentError(
        "the VMM allocation's mapping was closed while the request was being prepared; retry");
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
  entry->vmm = vmm != nullptr;
  entries_.emplace(key, entry);
  PublishSizeLocked();
  const absl::Time open_start = absl::Now();
  mu_.Unlock();
  absl::StatusOr<IpcMapping> mapping =
      vmm != nullptr ? runtime_->OpenVmm(ordinal, *vmm->spec) : runtime_->OpenIpc(ordinal, handle);
  std::vector<int> fds;
  if (vmm != nullptr && mapping.ok()) fds = DupChunkFds(*vmm->spec);
  mu_.Lock();
  entry->opening = false;
  opened_.SignalAll();
  if (vmm != nullptr && mapping.ok()) {
    entry->vmm_fds = std::move(fds);
    entry->owner_pidfd = vmm->owner_pidfd >= 0 ? fcntl(vmm->owner_pidfd, F_DUPFD_CLOEXEC, 0) : -1;
  }
  if (!mapping.ok() && vmm != nullptr) {
    entries_.erase(key);
    PublishSizeLocked();
    return absl::Status(mapping.status().code(), absl::StrCat("the VMM allocation could not be mapped on GPU ordinal ",
                                                              ordinal, ": ", mapping.status().message()));
  }
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
  return LeaseRange(std::move(entry), offset, size);
}

absl::StatusOr<IpcCache::Lease> IpcCache::AcquireVmm(int ordinal, absl::string_view key, const VmmImportSpec& spec,
                                                     int owner_pidfd, uint64_t offset, uint64_t size) {
  if (!IsVmmKey(key)) return absl::InternalError("not a VMM key");
  absl::MutexLock lock(&mu_);
  bool was_open = false;
  const VmmOpen open{&spec, owner_pidfd};
  WPREP_ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, FindOrOpen(ordinal, key, &was_open, &open));
  return LeaseRange(std::move(entry), offset, size);
}

bool IpcCache::IsVmmKey(absl::string_view handle) {
  return handle.size() == kIpcHandleBytes && absl::StartsWith(handle, kVmmKeyPrefix);
}

std::string IpcCache::NewVmmKey() {
  std::string key(kVmmKeyPrefix);
  key.resize(kIpcHandleBytes);
  // 53 random bytes: a client cannot name another client's mapping by guessing its key.
  char* rest = key.data() + kVmmKeyPrefix.size();
  size_t want = kIpcHandleBytes - kVmmKeyPrefix.size();
  while (want > 0) {
    const ssize_t got = getrandom(rest, want, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      // getrandom exists since Linux 3.17; before it, the device.
      const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
      const ssize_t n = fd >= 0 ? read(fd, rest, want) : -1;
      if (fd >= 0) close(fd);
      if (n != static_cast<ssize_t>(want)) return "";
      break;
    }
    rest += got;
    want -= static_cast<size_t>(got);
  }
  return key;
}

bool IpcCache::Contains(int ordinal, absl::string_view handle) const {
  absl::MutexLock lock(&mu_);
  return entries_.count(Key(ordinal, std::string(handle))) != 0;
}

absl::StatusOr<IpcCache::Lease> IpcCache::LeaseRange(std::shared_ptr<Entry> entry, uint64_t offset, uint64_t size) {
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
