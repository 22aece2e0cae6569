// Who is on the other end of a connection, and taking a descriptor from another process.
//
// gRPC tells a handler its peer only as a string: for the connections the daemon accepts
// itself and hands over with AddInsecureChannelFromFd (listener.h) that string is
// "fd:N", N being the connection's descriptor in the daemon, and never the peer's pid.
// So the accept loop records every connection of a Unix listener here (its descriptor and
// the socket's inode), and a handler asks for the credentials of "fd:N": the kernel's
// SO_PEERCRED of that descriptor, provided it is still the very socket that was recorded.
// The descriptor cannot be reused while the handler runs: gRPC closes it only when the
// transport is destroyed, and every call in flight holds a reference to its transport.
// A TCP connection, and a TLS one (its plaintext side is a socket pair of the daemon's
// own, tls_terminator.h), is never recorded, so it has no credentials.
#ifndef WPREP_SERVER_SRC_PEER_CREDENTIALS_H_
#define WPREP_SERVER_SRC_PEER_CREDENTIALS_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace wprep::server {

struct PeerCredentials {
  pid_t pid = 0;  // the peer's process (thread group) id when it connected
  uid_t uid = 0;
  gid_t gid = 0;
};

// Descriptors of accepted connections, each with the inode of its socket when recorded. A
// descriptor gRPC has closed, and perhaps reused for another socket, no longer matches its
// record. A reused descriptor replaces its entry, so there are never more entries than the
// process has descriptors. Thread-safe.
class AcceptedSockets {
 public:
  void Add(int fd);
  // True when `fd` was recorded and is still that socket.
  bool Holds(int fd) const;
  // Calls `fn(fd)` under the lock for every recorded descriptor that is still its socket,
  // and forgets the others.
  void ForEachOpen(const std::function<void(int fd)>& fn);

 private:
  mutable absl::Mutex mu_;
  std::unordered_map<int, uint64_t> inode_by_fd_ ABSL_GUARDED_BY(mu_);
};

// The daemon's Unix-socket connections. Thread-safe.
class UnixPeers {
 public:
  // The process's registry (the daemon's accept loop records into it).
  static UnixPeers& Global();

  // Records `fd`, just accepted on a Unix listener, before gRPC gets it.
  void Record(int fd) { sockets_.Add(fd); }
  // The credentials of the peer behind gRPC's peer string (ServerContext::peer()), or
  // nullopt when it is not a recorded Unix connection (TCP, TLS, or unknown).
  std::optional<PeerCredentials> Lookup(absl::string_view grpc_peer) const;

 private:
  AcceptedSockets sockets_;
};

// The inode of what descriptor `fd` refers to, or 0 when it is not open. A descriptor
// closed and reused for another socket has another inode.
uint64_t InodeOf(int fd);

// SO_PEERCRED of connected Unix socket `fd`, or nullopt when the kernel gives none.
std::optional<PeerCredentials> PeerCredentialsOf(int fd);

// True when `tid` is `pid` or one of its threads.
bool InThreadGroup(pid_t tid, pid_t pid);

// pidfd_open(2) of `pid`: PERMISSION_DENIED or NOT_FOUND (no such process) with the reason.
absl::StatusOr<int> OpenPidfd(pid_t pid);
// pidfd_getfd(2): a duplicate, close-on-exec, of descriptor `fd` of the process behind
// `pidfd`. INVALID_ARGUMENT when `fd` is not open there; PERMISSION_DENIED when the
// daemon lacks ptrace access to the process (user, CAP_SYS_PTRACE, yama ptrace_scope).
absl::StatusOr<int> TakeFd(int pidfd, int fd);
// True once the process behind `pidfd` has exited.
bool ProcessExited(int pidfd);
// True when descriptors `a` and `b` of this process share one open file description
// (kcmp KCMP_FILE); false where kcmp is unavailable.
bool SameFile(int a, int b);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_PEER_CREDENTIALS_H_
