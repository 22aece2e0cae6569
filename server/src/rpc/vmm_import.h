// CUDA virtual-memory buffers (CudaIpcBuffer.vmm): a client's cuMem allocation, given as
// the shareable handles of its physical chunks, mapped by the daemon as one range.
//
// A POSIX-fd chunk is a descriptor number in the client's process; the daemon takes a
// duplicate with pidfd_open + pidfd_getfd (peer_credentials.h). That is a privilege, so a
// VMM buffer is served only on the daemon's Unix socket, and only when the request's pid
// is the connection's peer (SO_PEERCRED) or a thread of it: otherwise PERMISSION_DENIED,
// before anything is taken or mapped. Over TCP or TLS a VMM buffer is refused the same way.
//
// Before a request is translated, Resolve maps every VMM buffer it names (or finds its
// mapping in the IpcCache) and rewrites the buffer into a legacy one whose handle is the
// mapping's key, so the rest of the daemon (proto_translate, the executor) sees only
// handles. The mappings are held until the request's own leases have taken them.
#ifndef WPREP_SERVER_SRC_VMM_IMPORT_H_
#define WPREP_SERVER_SRC_VMM_IMPORT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "device/device_manager.h"
#include "device/ipc_cache.h"
#include "net/peer_credentials.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// Limits of one VMM buffer.
inline constexpr int kMaxVmmChunks = 1024;

// True when the request names a VMM buffer (no copy made).
bool HasVmm(const wprep::v1::ConvertRequest& req);
bool HasVmm(const wprep::v1::ConvertBatchRequest& req);

class VmmImporter {
 public:
  // Borrows both; they outlive it.
  VmmImporter(IpcCache* cache, DeviceManager* devices);

  // Maps every VMM buffer of `req`, sent by `peer` (nullopt: not a Unix-socket client),
  // rewrites it into a handle buffer, and keeps its mapping in `held`. Errors name the
  // field: PERMISSION_DENIED (no Unix peer, another pid, no ptrace access),
  // INVALID_ARGUMENT (a malformed buffer, a descriptor not open, a chunk the runtime
  // cannot import), FAILED_PRECONDITION (a handle type the GPU cannot import).
  absl::Status Resolve(const std::optional<PeerCredentials>& peer, wprep::v1::ConvertRequest* req,
                       std::vector<IpcCache::Lease>* held);
  absl::Status Resolve(const std::optional<PeerCredentials>& peer, wprep::v1::ConvertBatchRequest* req,
                       std::vector<IpcCache::Lease>* held);

  // Checks the fields of one VMM buffer, before anything is taken or mapped.
  static absl::Status Validate(const wprep::v1::CudaIpcBuffer& b, absl::string_view field);

  // RegisterIpcHandles of `ref.vmm()`: maps the whole allocation as Resolve maps a buffer
  // (or finds its mapping; *was_open says which) and returns its bytes. The mapping stays
  // cached like any other.
  absl::StatusOr<uint64_t> Register(const std::optional<PeerCredentials>& peer, const wprep::v1::IpcHandleRef& ref,
                                    const std::string& field, bool* was_open);
  // ReleaseIpcHandles of `ref.vmm()`: closes the mapping of exactly these chunks of the
  // peer's process (IpcCache::Release's (released, deferred)); (0, 0) when there is none.
  // Refused as Resolve refuses a buffer of another process or over TCP.
  absl::StatusOr<std::pair<int, int>> Release(const std::optional<PeerCredentials>& peer,
                                              const wprep::v1::IpcHandleRef& ref, const std::string& field);

 private:
  // The refusal of a VMM buffer that did not come on the Unix socket.
  static absl::Status NotOnUnixSocket(absl::string_view field);
  // The pid check of a VMM buffer from `peer`, then the ordinal of its GPU, which must be
  // able to import its handle type.
  absl::StatusOr<int> CheckedOrdinal(const PeerCredentials& peer, const wprep::v1::CudaIpcBuffer& b,
                                     const std::string& field);
  // A registered allocation's checks (vmm alone, well formed, on the Unix socket, the pid,
  // the GPU): its buffer spanning every chunk into *b, and its GPU's ordinal.
  absl::StatusOr<int> CheckedAllocation(const std::optional<PeerCredentials>& peer, const wprep::v1::IpcHandleRef& ref,
                                        const std::string& field, wprep::v1::CudaIpcBuffer* b);
  // What names a mapping of these chunks of the peer's process on `ordinal` (KeyFor's key).
  static std::string Identity(int ordinal, const wprep::v1::CudaVmmBuffer& v, int peer_pid);
  // The key an identity has now; empty when none.
  std::string ExistingKey(const std::string& identity);
  absl::Status ResolveBuffer(const std::optional<PeerCredentials>& peer, wprep::v1::CudaIpcBuffer* b,
                             const std::string& field, std::vector<IpcCache::Lease>* held);
  // ResolveBuffer after its checks: `b` (a VMM buffer of `peer`'s on GPU `ordinal`, already
  // validated) mapped, or its cached mapping found, and named by its cache key.
  absl::Status MapChecked(const PeerCredentials& peer, int ordinal, wprep::v1::CudaIpcBuffer* b,
                          const std::string& field, std::vector<IpcCache::Lease>* held);
  // The cache key of an allocation's identity (a fresh one the first time).
  std::string KeyFor(const std::string& identity);
  void ForgetKey(const std::string& identity, const std::string& key);

  IpcCache* const cache_;
  DeviceManager* const devices_;
  absl::Mutex mu_;
  // Identity (GPU, pid, handle type, chunk descriptors and sizes) -> cache key.
  std::map<std::string, std::string> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_VMM_IMPORT_H_
