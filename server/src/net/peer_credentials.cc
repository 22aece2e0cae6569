#include "net/peer_credentials.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

// Syscall numbers, the same on every architecture since the unified table (Linux 5.3+),
// for a glibc without the wrappers.
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_kcmp
#define SYS_kcmp 312
#endif

namespace wprep::server {
namespace {

constexpr int kKcmpFile = 0;  // KCMP_FILE

std::string Errno(int err) {
  char buf[128];
  return strerror_r(err, buf, sizeof(buf));  // the GNU variant: returns the text
}

}  // namespace

uint64_t InodeOf(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

UnixPeers& UnixPeers::Global() {
  static UnixPeers* const peers = new UnixPeers();
  return *peers;
}

void AcceptedSockets::Add(int fd) {
  const uint64_t inode = InodeOf(fd);
  absl::MutexLock lock(&mu_);
  inode_by_fd_[fd] = inode;
}

bool AcceptedSockets::Holds(int fd) const {
  absl::MutexLock lock(&mu_);
  auto it = inode_by_fd_.find(fd);
  return it != inode_by_fd_.end() && it->second != 0 && it->second == InodeOf(fd);
}

void AcceptedSockets::ForEachOpen(const std::function<void(int fd)>& fn) {
  absl::MutexLock lock(&mu_);
  for (auto it = inode_by_fd_.begin(); it != inode_by_fd_.end();) {
    if (it->second == 0 || InodeOf(it->first) != it->second) {
      it = inode_by_fd_.erase(it);
    } else {
      fn(it->first);
      ++it;
    }
  }
}

std::optional<PeerCredentials> UnixPeers::Lookup(absl::string_view grpc_peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&grpc_peer, "fd:") || !absl::SimpleAtoi(grpc_peer, &fd) || fd < 0) {
    return std::nullopt;
  }
  // A descriptor recorded once and since reused for a TCP or TLS connection is another
  // socket, with another inode.
  if (!sockets_.Holds(fd)) return std::nullopt;
  return PeerCredentialsOf(fd);
}

std::optional<PeerCredentials> PeerCredentialsOf(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return std::nullopt;
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

bool InThreadGroup(pid_t tid, pid_t pid) {
  if (tid == pid) return true;
  if (tid <= 0 || pid <= 0) return false;
  struct stat st;
  return stat(absl::StrCat("/proc/", pid, "/task/", tid).c_str(), &st) == 0;
}

absl::StatusOr<int> OpenPidfd(pid_t pid) {
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) return static_cast<int>(fd);
  const int err = errno;
  if (err == ESRCH) return absl::NotFoundError(absl::StrCat("process ", pid, " does not exist"));
  if (err == ENOSYS) {
    return absl::FailedPreconditionError("the kernel lacks pidfd_open (Linux 5.6+ is needed for VMM handles)");
  }
  return absl::PermissionDeniedError(absl::StrCat("pidfd_open(", pid, "): ", Errno(err)));
}

absl::StatusOr<int> TakeFd(int pidfd, int fd) {
  const long got = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  if (got >= 0) {
    // pidfd_getfd sets close-on-exec itself; set it again for kernels that did not.
    fcntl(static_cast<int>(got), F_SETFD, FD_CLOEXEC);
    return static_cast<int>(got);
  }
  const int err = errno;
  switch (err) {
    case EBADF:
      return absl::InvalidArgumentError(absl::StrCat("descriptor ", fd, " is not open in the client process"));
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat(
          "pidfd_getfd: the daemon may not take descriptors of the client process (it needs the same "
          "user or CAP_SYS_PTRACE, and a yama ptrace_scope that allows it): ",
          Errno(err)));
    case ESRCH:
      return absl::NotFoundError("the client process has exited");
    case ENOSYS:
      return absl::FailedPreconditionError("the kernel lacks pidfd_getfd (Linux 5.6+ is needed for VMM handles)");
    default:
      return absl::InvalidArgumentError(absl::StrCat("pidfd_getfd of descriptor ", fd, ": ", Errno(err)));
  }
}

bool ProcessExited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

bool SameFile(int a, int b) {
  const pid_t self = getpid();
  const long r = syscall(SYS_kcmp, self, self, kKcmpFile, a, b);
  // Without kcmp nothing tells two exports apart (the driver's descriptors may share one
  // anonymous inode): never the same, so a mapping is imported afresh rather than reused.
  return r == 0;
}

}  // namespace wprep::server
