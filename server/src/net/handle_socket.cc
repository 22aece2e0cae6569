#include "net/handle_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace wprep::server {
namespace {

void PutLe(uint8_t* at, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) at[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Sends the header (with `fd` attached when >= 0), then the message; best effort: a
// client that went away loses nothing but its own reply.
void Reply(int sock, const absl::Status& status, int fd, uint64_t bytes) {
  uint8_t header[kHandleReplyBytes] = {};
  PutLe(header, static_cast<uint32_t>(status.code()), 4);
  PutLe(header + 4, fd >= 0 ? 1 : 0, 4);
  PutLe(header + 8, bytes, 8);
  iovec iov{header, sizeof(header)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  if (sendmsg(sock, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(header))) return;
  const std::string text(status.message());
  size_t sent = 0;
  while (sent < text.size()) {
    const ssize_t n = send(sock, text.data() + sent, text.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

void ServeHandleConnection(int fd, TakeHandle take, absl::Duration timeout) {
  // The accept loop hands descriptors over non-blocking; reads wait with poll.
  std::string token;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status status;
  while (token.size() < kHandleTokenBytes) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left_ms <= 0 || poll(&p, 1, static_cast<int>(left_ms)) <= 0) {
      status = absl::DeadlineExceededError(
          absl::StrCat("send the ", kHandleTokenBytes, "-byte token of AttachWeightsResponse.vmm within ",
                       absl::FormatDuration(timeout)));
      break;
    }
    char buf[kHandleTokenBytes];
    const ssize_t n = recv(fd, buf, kHandleTokenBytes - token.size(), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      close(fd);  // gone before the token: nobody to answer
      return;
    }
    token.append(buf, static_cast<size_t>(n));
  }
  HandedFd handed;
  if (status.ok()) {
    const std::optional<PeerCredentials> peer = PeerCredentialsOf(fd);
    if (!peer.has_value()) {
      status = absl::PermissionDeniedError("the handle socket cannot read its peer's credentials (SO_PEERCRED)");
    } else {
      absl::StatusOr<HandedFd> got = take(token, *peer);
      if (got.ok()) {
        handed = *got;
      } else {
        status = got.status();
      }
    }
  }
  // Blocking for the reply: it is 16 bytes and a message, well within the socket buffer.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  Reply(fd, status, handed.fd, handed.bytes);
  if (handed.fd >= 0) close(handed.fd);
  close(fd);
}

std::string NewHandleToken() {
  std::string token(kHandleTokenBytes, '\0');
  // getrandom(2) does not return short for 16 bytes; were it unavailable, random_device
  // is still unpredictable to other processes.
  if (getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    std::random_device rd;
    for (char& b : token) b = static_cast<char>(rd());
  }
  return token;
}

}  // namespace wprep::server
