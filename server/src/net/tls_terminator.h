// TLS for the daemon's TCP listeners, terminated by the daemon itself. gRPC 1.51 takes
// an accepted connection from outside (grpc_server_add_channel_from_fd) only as
// plaintext, and its own TLS listeners close for good when accept fails with EMFILE and
// know no connection limit. So the daemon accepts TLS connections on its own sockets
// (listener.h), completes each handshake here with OpenSSL, and relays the decrypted
// bytes over a socket pair whose other end gRPC serves as a plaintext connection.
//
// One thread per connection: it handshakes (bounded by a timeout, so a client that never
// finishes one holds nothing for long), hands the plaintext end to gRPC, then copies
// both ways until either side closes. Each connection holds three descriptors (its
// socket and the pair) and 2 x kRelayBufferBytes of buffers.
#ifndef WPREP_SERVER_SRC_TLS_TERMINATOR_H_
#define WPREP_SERVER_SRC_TLS_TERMINATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace wprep::server {

inline constexpr size_t kRelayBufferBytes = 64 << 10;

struct TlsConfig {
  std::string cert_pem;       // the server's certificate chain
  std::string key_pem;        // its private key
  std::string client_ca_pem;  // non-empty: mutual TLS, clients must present a certificate of this CA
  absl::Duration handshake_timeout = absl::Seconds(10);
  int max_connections = 1024;  // TLS connections open at once; more are closed at once
};

class TlsTerminator {
 public:
  // INVALID_ARGUMENT naming what is wrong when the certificate, the key or the CA does
  // not load, or the key does not match the certificate.
  static absl::StatusOr<std::unique_ptr<TlsTerminator>> Create(const TlsConfig& config);
  ~TlsTerminator();
  TlsTerminator(const TlsTerminator&) = delete;
  TlsTerminator& operator=(const TlsTerminator&) = delete;

  // Takes `fd`, an accepted non-blocking TCP connection. After a good handshake,
  // `hand_off(plain_fd)` gets the plaintext end (and owns it); a failed handshake, the
  // connection limit, or no thread or socket pair to spare closes `fd` and counts it
  // refused. Never blocks.
  void Serve(int fd, std::function<void(int plain_fd)> hand_off);

  // No hand-off after this returns; handshakes under way close their connections.
  // Relays already handed off run on until gRPC or the client closes their side.
  void Stop();

  // Waits until every relay handed off has ended, or until `deadline`; returns how many
  // still run then. A relay ends once gRPC has closed its end and the bytes it wrote are
  // all sent through TLS (or either side failed), so after gRPC's shutdown this is the
  // wait for its last bytes to leave the process.
  int WaitForRelays(absl::Time deadline);

  int active() const;                  // connections being handshaken or relayed
  uint64_t refused() const;            // closed by the limit, a thread or descriptor shortage
  uint64_t handshake_failures() const; // bad, slow or refused handshakes

 private:
  struct Shared;
  explicit TlsTerminator(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  std::shared_ptr<Shared> shared_;  // outlives this object while relays run
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_TLS_TERMINATOR_H_
