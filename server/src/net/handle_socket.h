// The handle socket: where a client that attached a weight set held in CUDA virtual
// memory fetches the set's POSIX file descriptor, which gRPC cannot carry. It is a Unix
// socket next to each of the daemon's Unix API sockets ("<path>.handles", mode 0660 like
// the API socket), so a client in another container that mounts the socket's directory
// reaches it under the same name.
//
// One request per connection: the client writes a token of kHandleTokenBytes (from its
// AttachWeightsResponse.vmm) and reads one reply, a kHandleReplyBytes header (uint32
// status: 0 or a gRPC code; uint32 descriptors attached; uint64 chunk bytes; all
// little-endian) sent with the descriptor in SCM_RIGHTS, then on an error its message up
// to the end of the stream. The token is checked by the caller's `take`, with the
// connection's SO_PEERCRED credentials.
#ifndef WPREP_SERVER_SRC_NET_HANDLE_SOCKET_H_
#define WPREP_SERVER_SRC_NET_HANDLE_SOCKET_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "net/peer_credentials.h"

namespace wprep::server {

inline constexpr size_t kHandleTokenBytes = 16;
inline constexpr size_t kHandleReplyBytes = 16;
inline constexpr absl::string_view kHandleSocketSuffix = ".handles";

// A descriptor handed to a client: the caller's, closed by ServeHandleConnection once sent.
struct HandedFd {
  int fd = -1;
  uint64_t bytes = 0;
};

using TakeHandle = absl::FunctionRef<absl::StatusOr<HandedFd>(absl::string_view token, const PeerCredentials& peer)>;

// Serves one accepted connection of a handle socket and closes it. A client that sends no
// full token within `timeout`, or whose credentials cannot be read, gets an error reply
// (DEADLINE_EXCEEDED, PERMISSION_DENIED) and `take` is not called.
void ServeHandleConnection(int fd, TakeHandle take, absl::Duration timeout = absl::Seconds(2));

// A fresh random token of kHandleTokenBytes.
std::string NewHandleToken();

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_NET_HANDLE_SOCKET_H_
