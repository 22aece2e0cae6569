#include "net/metrics_http.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "prometheus/text_serializer.h"

namespace wprep::server {
namespace {

struct Connection {
  int fd = -1;
  std::string in;
  std::string out;
  size_t sent = 0;
  bool responding = false;
  absl::Time deadline;
  absl::Time opened;
};

std::string HttpResponse(const char* status, const std::string& content_type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->registry_ = std::move(registry);
  absl::StatusOr<std::unique_ptr<ListeningSocket>> sock = ListeningSocket::Bind(address);
  if (!sock.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on --metrics-address=", address, ": ",
                                               sock.status().message()));
  }
  s->socket_ = *std::move(sock);
  s->acceptor_ = std::make_unique<ConnectionAcceptor>(ConnectionFdLimit(kMaxConnections));
  if (pipe2(s->wake_, O_CLOEXEC | O_NONBLOCK) != 0) return absl::ResourceExhaustedError("pipe failed");
  try {
    s->thread_ = std::thread([p = s.get()] { p->Run(); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot start the metrics thread: ", e.what()));
  }
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    const char c = 1;
    (void)!write(wake_[1], &c, 1);
    thread_.join();
  }
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

std::string MetricsHttpServer::Respond(const std::string& request) const {
  const size_t line_end = request.find("\r\n");
  const std::string line = request.substr(0, line_end);
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    return HttpResponse("400 Bad Request", "text/plain", "bad request line\n");
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  if (method != "GET") return HttpResponse("405 Method Not Allowed", "text/plain", "only GET\n");
  if (path != "/metrics") return HttpResponse("404 Not Found", "text/plain", "metrics are at /metrics\n");
  std::ostringstream body;
  prometheus::TextSerializer().Serialize(body, registry_->Collect());
  return HttpResponse("200 OK", "text/plain; version=0.0.4; charset=utf-8", body.str());
}

void MetricsHttpServer::Run() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({socket_->fd(), POLLIN, 0});
    absl::Time next = absl::InfiniteFuture();
    for (const Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.responding ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        next == absl::InfiniteFuture() ? -1 : static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1));
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (fds[0].revents != 0) break;
    const absl::Time now = absl::Now();
    std::vector<Connection> keep;
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      const short ev = fds[i + 2].revents;
      bool done = now >= c.deadline;
      if (!done && !c.responding && (ev & (POLLIN | POLLHUP | POLLERR))) {
        char buf[4096];
        const ssize_t n = read(c.fd, buf, sizeof(buf));
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) {
          done = true;
        } else if (n > 0) {
          c.in.append(buf, static_cast<size_t>(n));
          if (c.in.find("\r\n\r\n") != std::string::npos) {
            c.out = Respond(c.in);
            c.responding = true;
            c.deadline = now + kResponseTimeout;
          } else if (c.in.size() > kMaxRequestBytes) {
            c.out = HttpResponse("431 Request Header Fields Too Large", "text/plain", "request too large\n");
            c.responding = true;
            c.deadline = now + kResponseTimeout;
          }
        }
      }
      if (!done && c.responding && (ev & (POLLOUT | POLLERR | POLLHUP))) {
        const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (n > 0) c.sent += static_cast<size_t>(n);
        if ((n < 0 && errno != EAGAIN && errno != EINTR) || c.sent == c.out.size()) done = true;
      }
      if (done) {
        close(c.fd);
      } else {
        keep.push_back(std::move(c));
      }
    }
    conns.swap(keep);
    if (fds[1].revents != 0) {
      for (int n = 0; n < 64; ++n) {
        const int fd = acceptor_->Accept(socket_->fd(), /*tcp=*/true);
        if (fd < 0) break;
        if (static_cast<int>(conns.size()) >= kMaxConnections) {
          // Make room: the oldest connection still sending its request goes first.
          auto victim = conns.end();
          for (auto it = conns.begin(); it != conns.end(); ++it) {
            if (!it->responding && (victim == conns.end() || it->opened < victim->opened)) victim = it;
          }
          if (victim == conns.end()) {
            close(fd);
            continue;
          }
          close(victim->fd);
          conns.erase(victim);
        }
        Connection c;
        c.fd = fd;
        c.opened = now;
        c.deadline = now + kRequestTimeout;
        conns.push_back(std::move(c));
      }
    }
  }
  for (Connection& c : conns) close(c.fd);
}

}  // namespace wprep::server
