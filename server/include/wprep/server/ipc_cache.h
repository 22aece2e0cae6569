// The cache of opened CUDA IPC mappings, keyed by (GPU ordinal, 64 handle bytes):
// bounded size, idle expiry, and reference counts for requests in flight. Every range a
// request uses is checked against the real allocation (cuMemGetAddressRange, resolved
// from the driver at run time). Thread-safe.
#ifndef WPREP_SERVER_IPC_CACHE_H_
#define WPREP_SERVER_IPC_CACHE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "wprep/server/ipc_owner.h"
#include "wprep/server/metrics.h"

namespace wprep::server {

class IpcCache {
 public:
  // At most `max_entries` mappings; unused ones close after `idle_expiry`. `metrics` may
  // be null.
  IpcCache(int max_entries, absl::Duration idle_expiry, Metrics* metrics);
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
    // base of the allocation + the requested offset, in the daemon's address space.
    uint8_t* ptr() const { return ptr_; }

   private:
    friend class IpcCache;
    IpcCache* cache_ = nullptr;
    std::shared_ptr<Entry> entry_;
    uint8_t* ptr_ = nullptr;
  };

  // InvalidArgument naming `field` unless `handle` has the 64 bytes of a
  // cudaIpcMemHandle_t (every handle a request carries is checked with this).
  static absl::Status CheckHandleSize(absl::string_view handle, absl::string_view field);

  // Opens (or reuses) the allocation behind `handle` (the 64 bytes of a cudaIpcMemHandle_t)
  // on GPU `ordinal` and checks that [offset, offset + size) lies inside it and, where the
  // owner map can tell, that it lives on that GPU. InvalidArgument, naming `field`, for a handle that cannot be
  // opened, belongs to another GPU, or a range outside the allocation.
  absl::StatusOr<Lease> Acquire(int ordinal, absl::string_view handle, uint64_t offset,
                                uint64_t size, absl::string_view field);

  // Opens (or keeps) the mapping of `handle` on `ordinal` ahead of the requests that will
  // use it, with Acquire's checks but no range; it stays in the cache like any other.
  struct Registration {
    uint64_t allocation_bytes = 0;  // from the handle's base to the end of the allocation
    bool was_open = false;          // mapped already
  };
  absl::StatusOr<Registration> Register(int ordinal, absl::string_view handle,
                                        absl::string_view field);

  // Sets which GPU each handle's memory lives on (from IpcOwnerMap::Calibrate); until
  // then, and when the map is off, a handle is opened on the GPU the request names.
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
  // The cached entry of (ordinal, handle), opened (and range-probed) if new, after the
  // owner check, with one more reference for the caller; its last use is now. `lock`
  // holds mu_; it is released while a new mapping opens, so other requests go on, and
  // requests for the same handle wait for that open.
  absl::StatusOr<std::shared_ptr<Entry>> FindOrOpen(std::unique_lock<std::mutex>& lock,
                                                    int ordinal, absl::string_view handle,
                                                    absl::string_view field, bool* was_open);
  // Opens entry.handle on entry.ordinal and measures the allocation behind it (no lock).
  static absl::Status OpenMapping(Entry& entry, absl::string_view field);
  void Unref(const std::shared_ptr<Entry>& entry);
  void UnrefLocked(const std::shared_ptr<Entry>& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseEntry(Entry& entry);
  void PublishSizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const size_t max_entries_;
  const absl::Duration idle_expiry_;
  Metrics* const metrics_;

  mutable std::mutex mu_;
  std::condition_variable opened_;  // an entry's opening ended
  IpcOwnerMap owner_map_ ABSL_GUARDED_BY(mu_) = IpcOwnerMap::Disabled("not calibrated yet");
  std::map<Key, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_IPC_CACHE_H_
