// The daemon's own listening sockets and their accept loop. gRPC's listener closes a
// port for good when accept fails with EMFILE (gRPC 1.51), and binds TCP ports with
// SO_REUSEPORT, so a second daemon on the same port takes half the connections. The
// daemon therefore binds its plaintext listeners itself (exclusively), accepts with
// descriptor exhaustion handled, and hands each connection to gRPC.
#ifndef WPREP_SERVER_SRC_LISTENER_H_
#define WPREP_SERVER_SRC_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "net/peer_credentials.h"

namespace wprep::server {

// True for a loopback host ("127.x.x.x", "localhost", "[::1]") of "HOST:PORT".
bool IsLoopbackAddress(const std::string& address);

// A listening socket, bound exclusively.
class ListeningSocket {
 public:
  // "unix:///path": refuses a path another live process listens on, removes a stale
  // socket file, holds "<path>.lock" while it lives, and gives the socket mode 0660.
  // "HOST:PORT" (port 0 picks one): no SO_REUSEPORT, so a port in use fails to bind.
  // UNAVAILABLE with a message naming the address when it cannot listen.
  static absl::StatusOr<std::unique_ptr<ListeningSocket>> Bind(const std::string& address);
  ~ListeningSocket();  // closes it; a Unix socket's file and lock go too
  ListeningSocket(const ListeningSocket&) = delete;
  ListeningSocket& operator=(const ListeningSocket&) = delete;

  int fd() const { return fd_; }
  bool is_unix() const { return !path_.empty(); }
  // The address as given, and as bound: "unix:///path", or "HOST:PORT" with the port.
  const std::string& address() const { return address_; }
  std::string bound_address() const;
  int port() const { return port_; }

 private:
  ListeningSocket() = default;
  int fd_ = -1;
  int lock_fd_ = -1;
  std::string address_;
  std::string host_;
  std::string path_;  // Unix sockets only
  int port_ = 0;
};

// Accepts a connection on `listen_fd` (non-blocking). Returns the new descriptor (set
// non-blocking, close-on-exec, TCP_NODELAY for TCP), or -1 when none is pending, one
// was refused, or accept failed. Descriptor exhaustion does not stall it: with EMFILE or
// ENFILE it frees its reserved descriptor, accepts the pending connection and closes it
// (the client sees a closed connection rather than a hang), and reserves again.
// Connections whose descriptor would be `max_fd` or above are refused the same way, so
// the daemon keeps descriptors for its own files. Thread-safe.
class ConnectionAcceptor {
 public:
  explicit ConnectionAcceptor(int max_fd);
  ~ConnectionAcceptor();
  int Accept(int listen_fd, bool tcp);
  // Connections closed unserved: refused at the limit, or shed while descriptors ran out.
  uint64_t refused() const { return refused_.load(); }

 private:
  void Reserve();
  const int max_fd_;
  std::atomic<int> reserve_fd_{-1};
  std::atomic<uint64_t> refused_{0};
};

// The descriptor above which a new connection is refused: RLIMIT_NOFILE's soft limit
// (raised to the hard limit first) less what the daemon keeps for itself, and at most
// `max_connections` above the descriptors open now.
int ConnectionFdLimit(int max_connections);

// One thread that polls `sockets` and hands every accepted connection to
// `on_connection(fd, index of its socket)`, which takes ownership of the descriptor.
class AcceptLoop {
 public:
  AcceptLoop(std::vector<const ListeningSocket*> sockets, ConnectionAcceptor* acceptor,
             std::function<void(int fd, size_t socket)> on_connection);
  ~AcceptLoop();  // stops
  // RESOURCE_EXHAUSTED when the thread cannot start.
  absl::Status Start();
  void Stop();

 private:
  void Run();
  const std::vector<const ListeningSocket*> sockets_;
  ConnectionAcceptor* const acceptor_;
  const std::function<void(int, size_t)> on_connection_;
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

// The connections handed to gRPC, so that shutdown can wait for their clients to read
// what was sent. gRPC's shutdown sends a GOAWAY and closes each connection as soon as its
// last call ends (gRPC 1.51 has no second, delayed GOAWAY). A client still
// reading the last answers and status then sends flow-control updates into a closed
// socket, and its transport fails the finished call with "Broken pipe" before it parses
// the status waiting in its receive buffer. Thread-safe.
class HandedConnections {
 public:
  // Records `fd`, just accepted, before gRPC gets it.
  void Add(int fd) { sockets_.Add(fd); }
  // Waits until the client of every recorded connection still open has read all that was
  // sent to it (SIOCOUTQ: for a Unix socket the bytes its peer has not read, for TCP the
  // bytes it has not acknowledged), or until `deadline`. Returns how many connections
  // still hold unread bytes then. It only looks: gRPC keeps serving them meanwhile.
  int WaitForClientsToRead(absl::Time deadline);

 private:
  AcceptedSockets sockets_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_LISTENER_H_
