// The cache of opened CUDA IPC mappings, keyed by (GPU ordinal, 64 handle bytes):
// bounded size, idle expiry, and reference counts for requests in flight. Every range a
// request uses is checked against the real allocation. Thread-safe.
#ifndef WPREP_SERVER_SRC_IPC_CACHE_H_
#define WPREP_SERVER_SRC_IPC_CACHE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "device/device_runtime.h"
#include "device/ipc_owner.h"
#include "net/metrics.h"

namespace wprep::server {

class IpcCache {
 public:
  // Mappings of `runtime`; at most `max_entries`, unused ones close after `idle_expiry`.
  // `metrics` may be null.
  IpcCache(DeviceRuntime* runtime, int max_entries, absl::Duration idle_expiry, Metrics* metrics);
  ~IpcCache();  // closes every mapping
  IpcCache(const IpcCache&) = delete;
  IpcCache& operator=(const IpcCache&) = delete;

  struct Entry;

  // A mapping held open for one request; the pointer is valid while the lease lives.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    ~Lease();
    // Base of the allocation + the requested offset, in the daemon's address space.
    uint8_t* ptr() const { return ptr_; }

   private:
    friend class IpcCache;
    IpcCache* cache_ = nullptr;
    std::shared_ptr<Entry> entry_;
    uint8_t* ptr_ = nullptr;
  };

  // Opens (or reuses) the allocation behind `handle` (kIpcHandleBytes) on GPU `ordinal`
  // and checks that [offset, offset + size) lies inside it and, where the owner map can
  // tell, that it lives on that GPU. InvalidArgument for a handle that cannot be opened,
  // belongs to another GPU, or a range outside the allocation; RESOURCE_EXHAUSTED when
  // every cached mapping is in use.
  absl::StatusOr<Lease> Acquire(int ordinal, absl::string_view handle, uint64_t offset, uint64_t size);

  // A CUDA virtual-memory allocation (vmm_import.h), cached under `key`, a 64-byte key of
  // the importer's (IsVmmKey) that later Acquire and Release calls take as the handle.
  // Opened with DeviceRuntime::OpenVmm from `spec` when new; an entry already cached under
  // `key` is used only if its chunks are the same files as spec's (SameFile) and its
  // owner still lives, else ABORTED (the importer retries under a fresh key). The entry
  // keeps duplicates of spec's descriptors (to compare later ones with) and takes
  // `owner_pidfd`, the client process: the mapping closes once that process has exited
  // (checked on every sweep). With Acquire's range check.
  absl::StatusOr<Lease> AcquireVmm(int ordinal, absl::string_view key, const VmmImportSpec& spec,
                                   int owner_pidfd, uint64_t offset, uint64_t size);
  // Whether `handle` is a key of AcquireVmm's (such a handle is never opened as a
  // cudaIpcMemHandle_t).
  static bool IsVmmKey(absl::string_view handle);
  // A fresh, unguessable key for AcquireVmm; empty when no random bytes could be had.
  static std::string NewVmmKey();
  // Whether an entry is cached under (ordinal, handle).
  bool Contains(int ordinal, absl::string_view handle) const;

  // Opens (or keeps) the mapping of `handle` on `ordinal` ahead of the requests that
  // will use it, with Acquire's checks but no range, and pays the GPU's first access to
  // it; it stays in the cache like any other.
  struct Registration {
    uint64_t allocation_bytes = 0;  // from the handle's base to the end of the allocation
    bool was_open = false;          // mapped already
  };
  absl::StatusOr<Registration> Register(int ordinal, absl::string_view handle);

  // Sets which GPU each handle's memory lives on (IpcOwnerMap::Calibrate); until then,
  // and when the map is off, a handle is opened on the GPU the request names.
  void SetOwnerMap(IpcOwnerMap map);

  // Closes the mapping of `handle` on `ordinal` now, or when its last lease ends.
  // Returns {closed now, deferred}; an unknown handle counts as neither.
  std::pair<int, int> Release(int ordinal, absl::string_view handle);

  // Closes mappings unused for the idle expiry (also done on every Acquire).
  void ExpireIdle();
  // Closes every mapping not in use (in-use ones close when their lease ends).
  void CloseAll();
  size_t size() const;

 private:
  using Key = std::pair<int, std::string>;
  // The cached entry of (ordinal, handle), opened if new, after the owner check, with one
  // more reference for the caller; its last use is now. mu_ is released while a new
  // mapping opens, so other requests go on; requests for the same handle wait for it.
  // `vmm`: how to open a VMM key's entry (nullptr: a legacy handle, or a VMM key that
  // must be cached already).
  struct VmmOpen {
    const VmmImportSpec* spec;
    int owner_pidfd;
  };
  absl::StatusOr<std::shared_ptr<Entry>> FindOrOpen(int ordinal, absl::string_view handle,
                                                    bool* was_open, const VmmOpen* vmm = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lease of [offset, offset + size) of `entry`, or InvalidArgument (unreferenced).
  absl::StatusOr<Lease> LeaseRange(std::shared_ptr<Entry> entry, uint64_t offset, uint64_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unref(const std::shared_ptr<Entry>& entry);
  void UnrefLocked(const std::shared_ptr<Entry>& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the mappings idle for idle_expiry_ (FindOrOpen runs it at most every
  // idle_expiry_ / 8, clamped to 1 ms - 1 s, so a mapping closes at most that late).
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseEntry(Entry& entry);
  void PublishSizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  DeviceRuntime* const runtime_;
  const size_t max_entries_;
  const absl::Duration idle_expiry_;
  Metrics* const metrics_;

  mutable absl::Mutex mu_;
  absl::CondVar opened_;  // an entry's opening ended
  IpcOwnerMap owner_map_ ABSL_GUARDED_BY(mu_) = IpcOwnerMap::Disabled("not calibrated yet");
  std::map<Key, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // of FindOrOpen
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_IPC_CACHE_H_
