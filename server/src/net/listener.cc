#include "net/listener.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <linux/sockios.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "net/log.h"
#include "net/peer_credentials.h"

namespace wprep::server {
namespace {

// Descriptors kept for the daemon's own files, pipes, IPC and child process.
constexpr int kOwnDescriptors = 64;

// strerror_r, not std::generic_category().message(): clang's UBSan vptr check misreads
// that call into gcc's libstdc++ (its category type is private to the library) and halts.
std::string Errno(int err) {
  char buf[128];
  return strerror_r(err, buf, sizeof(buf));  // the GNU variant: returns the text
}

// "HOST:PORT" -> host (brackets of an IPv6 literal removed) and port.
bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return true;
}

}  // namespace

bool IsLoopbackAddress(const std::string& address) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) return false;
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::unique_ptr<ListeningSocket>> ListeningSocket::Bind(const std::string& address) {
  std::unique_ptr<ListeningSocket> s(new ListeningSocket());
  s->address_ = address;
  if (absl::StartsWith(address, "unix://")) {
    const std::string path = address.substr(7);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof(sa.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("--listen ", address, ": a Unix socket path needs 1 to ",
                                                     sizeof(sa.sun_path) - 1, " bytes"));
    }
    std::memcpy(sa.sun_path, path.data(), path.size());
    // The lock serializes daemons starting on the same path: only its holder may remove a
    // socket file or bind there.
    const std::string lock_path = path + ".lock";
    s->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (s->lock_fd_ < 0) {
      return absl::UnavailableError(absl::StrCat("--listen ", address, ": cannot create ", lock_path, ": ", Errno(errno)));
    }
    if (flock(s->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      return absl::UnavailableError(absl::StrCat("--listen ", address, ": another wprepd holds ", lock_path,
                                                 "; stop it or choose another socket path"));
    }
    struct stat st;
    if (lstat(path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return absl::UnavailableError(absl::StrCat("--listen ", address, ": ", path, " exists and is not a socket"));
      }
      // A live socket belongs to a process that did not take the lock (not a wprepd of
      // this version, or one started by hand): never unlink it.
      const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const bool live = probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
      if (probe >= 0) close(probe);
      if (live) {
        return absl::UnavailableError(absl::StrCat("--listen ", address, ": another process listens on ", path,
                                                   "; stop it or choose another socket path"));
      }
      unlink(path.c_str());  // stale: left by a process that died
    }
    s->fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s->fd_ < 0) return absl::UnavailableError(absl::StrCat("socket: ", Errno(errno)));
    // Mode 0660 from the start (umask), then chmod to be sure: only the owner's group
    // reaches the socket.
    const mode_t old_umask = umask(0117);
    const int rc = bind(s->fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    const int err = errno;
    umask(old_umask);
    if (rc != 0) return absl::UnavailableError(absl::StrCat("--listen ", address, ": bind: ", Errno(err)));
    s->path_ = path;
    chmod(path.c_str(), 0660);
  } else {
    std::string port;
    if (!SplitHostPort(address, &s->host_, &port)) {
      return absl::InvalidArgumentError(absl::StrCat("--listen ", address, ": expected HOST:PORT"));
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    if (int e = getaddrinfo(s->host_.c_str(), port.c_str(), &hints, &res); e != 0 || res == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--listen ", address, ": ", gai_strerror(e)));
    }
    s->fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s->fd_ < 0) {
      freeaddrinfo(res);
      return absl::UnavailableError(absl::StrCat("socket: ", Errno(errno)));
    }
    // SO_REUSEADDR lets a restarted daemon bind past TIME_WAIT; Linux still refuses a
    // second listener on the port (that would need SO_REUSEPORT, which is never set).
    const int one = 1;
    setsockopt(s->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const int rc = bind(s->fd_, res->ai_addr, res->ai_addrlen);
    const int err = errno;
    freeaddrinfo(res);
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("--listen ", address, ": bind: ", Errno(err),
                                                 err == EADDRINUSE ? " (another wprepd, or another program, listens there)" : ""));
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(s->fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  if (listen(s->fd_, 1024) != 0) {
    return absl::UnavailableError(absl::StrCat("--listen ", address, ": listen: ", Errno(errno)));
  }
  return s;
}

ListeningSocket::~ListeningSocket() {
  if (fd_ >= 0) close(fd_);
  if (!path_.empty()) {
    unlink(path_.c_str());
    unlink((path_ + ".lock").c_str());
  }
  if (lock_fd_ >= 0) close(lock_fd_);
}

std::string ListeningSocket::bound_address() const {
  if (is_unix()) return address_;
  const bool v6 = host_.find(':') != std::string::npos;
  return absl::StrCat(v6 ? "[" : "", host_, v6 ? "]" : "", ":", port_);
}

ConnectionAcceptor::ConnectionAcceptor(int max_fd) : max_fd_(max_fd) { Reserve(); }

ConnectionAcceptor::~ConnectionAcceptor() {
  const int r = reserve_fd_.exchange(-1);
  if (r >= 0) close(r);
}

void ConnectionAcceptor::Reserve() {
  if (reserve_fd_.load() >= 0) return;
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int expected = -1;
  if (fd >= 0 && !reserve_fd_.compare_exchange_strong(expected, fd)) close(fd);
}

int ConnectionAcceptor::Accept(int listen_fd, bool tcp) {
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err != EMFILE && err != ENFILE) return -1;  // EAGAIN, a connection reset, ...
    // Out of descriptors: shed the pending connection with the reserved one, so the
    // listener keeps draining its backlog instead of waking forever.
    const int r = reserve_fd_.exchange(-1);
    if (r >= 0) close(r);
    const int victim = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (victim >= 0) close(victim);
    refused_++;
    static std::atomic<int64_t> last_log{0};
    const int64_t now = absl::ToUnixSeconds(absl::Now());
    if (last_log.exchange(now) != now) {
      LogLine(LogLevel::kWarning, "accept_shed", absl::StrCat("error=", LogQuote(Errno(err)), " refused_total=", refused_.load()));
    }
    Reserve();
    return -1;
  }
  if (fd >= max_fd_) {
    close(fd);
    refused_++;
    return -1;
  }
  if (tcp) {
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

int ConnectionFdLimit(int max_connections) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) getrlimit(RLIMIT_NOFILE, &rl);
  }
  int open_now = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++open_now;
    closedir(d);
  }
  const int64_t soft = rl.rlim_cur == RLIM_INFINITY ? (1 << 20) : static_cast<int64_t>(rl.rlim_cur);
  return static_cast<int>(std::min<int64_t>(soft - kOwnDescriptors, open_now + int64_t{max_connections}));
}

AcceptLoop::AcceptLoop(std::vector<const ListeningSocket*> sockets, ConnectionAcceptor* acceptor,
                       std::function<void(int, size_t)> on_connection)
    : sockets_(std::move(sockets)), acceptor_(acceptor), on_connection_(std::move(on_connection)) {}

AcceptLoop::~AcceptLoop() {
  Stop();
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

absl::Status AcceptLoop::Start() {
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("pipe: ", Errno(errno)));
  }
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot start the accept thread: ", e.what()));
  }
  return absl::OkStatus();
}

void AcceptLoop::Stop() {
  if (!thread_.joinable()) return;
  const char c = 1;
  (void)!write(wake_[1], &c, 1);
  thread_.join();
}

void AcceptLoop::Run() {
  std::vector<pollfd> fds;
  for (const ListeningSocket* s : sockets_) fds.push_back({s->fd(), POLLIN, 0});
  fds.push_back({wake_[0], POLLIN, 0});
  for (;;) {
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) {
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (fds.back().revents != 0) return;
    for (size_t i = 0; i < sockets_.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const uint64_t refused_before = acceptor_->refused();
      // A bounded batch per wake-up, so one busy listener cannot starve the others.
      for (int n = 0; n < 64; ++n) {
        const int fd = acceptor_->Accept(sockets_[i]->fd(), !sockets_[i]->is_unix());
        if (fd < 0) break;
        on_connection_(fd, i);
      }
      // While descriptors are out and none is left in reserve, the backlog cannot be
      // shed: give the process a moment to free some rather than spin.
      if (acceptor_->refused() != refused_before) absl::SleepFor(absl::Milliseconds(5));
    }
  }
}

int HandedConnections::WaitForClientsToRead(absl::Time deadline) {
  for (;;) {
    int unread = 0;
    sockets_.ForEachOpen([&unread](int fd) {
      int queued = 0;
      if (ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0) ++unread;
    });
    if (unread == 0 || absl::Now() >= deadline) return unread;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

}  // namespace wprep::server
