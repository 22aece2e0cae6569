#include "net/tls_terminator.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "net/log.h"

namespace wprep::server {

namespace {

// The most recent OpenSSL error, or `fallback`, as one line; the error queue is emptied.
std::string SslError(absl::string_view fallback) {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    out = buf;  // the last is the outermost
  }
  return out.empty() ? std::string(fallback) : out;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;

BioPtr MemBio(const std::string& pem) { return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// Every certificate of a PEM text, in order.
std::vector<X509*> ReadCertificates(const std::string& pem) {
  std::vector<X509*> out;
  BioPtr bio = MemBio(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.push_back(x);
  ERR_clear_error();  // the read past the last certificate
  return out;
}

// ALPN: gRPC clients ask for "h2" and refuse a server that does not select it.
int SelectH2(SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in, unsigned int inlen,
             void*) {
  static const unsigned char kH2[] = {2, 'h', '2'};
  unsigned char* selected = nullptr;
  if (SSL_select_next_proto(&selected, outlen, kH2, sizeof(kH2), in, inlen) != OPENSSL_NPN_NEGOTIATED) {
    return SSL_TLSEXT_ERR_ALERT_FATAL;
  }
  *out = selected;
  return SSL_TLSEXT_ERR_OK;
}

// Logs at most one line a second per kind of event, with the running total.
void LogThrottled(std::atomic<int64_t>& last, absl::string_view event, const std::string& error, uint64_t total) {
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  if (last.exchange(now) == now) return;
  LogLine(LogLevel::kWarning, event, absl::StrCat("error=", LogQuote(error), " total=", total));
}

// What an SSL call that did not complete waits for (SSL_ERROR_WANT_READ / WANT_WRITE: the
// socket readable or writable, in either direction of TLS), or 0 when it failed for good.
short PollEventsFor(int ssl_error) {
  switch (ssl_error) {
    case SSL_ERROR_WANT_READ:
      return POLLIN;
    case SSL_ERROR_WANT_WRITE:
      return POLLOUT;
    default:
      return 0;
  }
}

}  // namespace

struct TlsTerminator::Shared {
  SSL_CTX* ctx = nullptr;
  absl::Duration handshake_timeout;
  int max_connections = 0;
  std::atomic<int> active{0};
  std::atomic<int> relaying{0};  // handed off, not yet ended
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> handshake_failures{0};
  std::atomic<int64_t> last_refusal_log{0};
  std::atomic<int64_t> last_handshake_log{0};
  absl::Mutex mu;  // orders hand-offs with Stop
  bool stopped ABSL_GUARDED_BY(mu) = false;

  ~Shared() { SSL_CTX_free(ctx); }

  void Refuse(int fd, const std::string& why) {
    close(fd);
    LogThrottled(last_refusal_log, "tls_connection_refused", why, ++refused);
  }
  void Run(int fd, const std::function<void(int)>& hand_off);
  bool Handshake(SSL* ssl, int fd);
  void Relay(SSL* ssl, int tls_fd, int plain_fd);
};

absl::StatusOr<std::unique_ptr<TlsTerminator>> TlsTerminator::Create(const TlsConfig& config) {
  auto shared = std::make_shared<Shared>();
  shared->handshake_timeout = config.handshake_timeout;
  shared->max_connections = config.max_connections;
  ERR_clear_error();
  shared->ctx = SSL_CTX_new(TLS_server_method());
  if (shared->ctx == nullptr) return absl::InternalError(SslError("SSL_CTX_new failed"));
  SSL_CTX* ctx = shared->ctx;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_RELEASE_BUFFERS);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);

  std::vector<X509*> chain = ReadCertificates(config.cert_pem);
  if (chain.empty()) return absl::InvalidArgumentError("--tls-cert: no PEM certificate in the file");
  bool ok = SSL_CTX_use_certificate(ctx, chain[0]) == 1;
  X509_free(chain[0]);
  for (size_t i = 1; i < chain.size(); ++i) {
    // The context takes these on success; free them only where it did not.
    if (ok && SSL_CTX_add0_chain_cert(ctx, chain[i]) == 1) continue;
    ok = false;
    X509_free(chain[i]);
  }
  if (!ok) return absl::InvalidArgumentError(absl::StrCat("--tls-cert: ", SslError("cannot use the certificate")));

  BioPtr key_bio = MemBio(config.key_pem);
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", SslError("no PEM private key in the file")));
  }
  ok = SSL_CTX_use_PrivateKey(ctx, key) == 1;
  EVP_PKEY_free(key);
  if (!ok || SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", SslError("the key does not match the certificate of --tls-cert")));
  }

  if (!config.client_ca_pem.empty()) {
    std::vector<X509*> cas = ReadCertificates(config.client_ca_pem);
    if (cas.empty()) return absl::InvalidArgumentError("--tls-client-ca: no PEM certificate in the file");
    X509_STORE* store = SSL_CTX_get_cert_store(ctx);
    STACK_OF(X509_NAME)* names = sk_X509_NAME_new_null();
    for (X509* ca : cas) {
      ok = ok && X509_STORE_add_cert(store, ca) == 1;
      if (X509_NAME* n = X509_NAME_dup(X509_get_subject_name(ca))) sk_X509_NAME_push(names, n);
      X509_free(ca);
    }
    SSL_CTX_set_client_CA_list(ctx, names);  // takes `names`
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("--tls-client-ca: ", SslError("cannot use the CA")));
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  SSL_CTX_set_alpn_select_cb(ctx, SelectH2, nullptr);
  return std::unique_ptr<TlsTerminator>(new TlsTerminator(std::move(shared)));
}

TlsTerminator::~TlsTerminator() { Stop(); }

void TlsTerminator::Stop() {
  absl::MutexLock lock(&shared_->mu);
  shared_->stopped = true;
}

int TlsTerminator::WaitForRelays(absl::Time deadline) {
  for (;;) {
    const int n = shared_->relaying.load();
    if (n == 0 || absl::Now() >= deadline) return n;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

int TlsTerminator::active() const { return shared_->active.load(); }
uint64_t TlsTerminator::refused() const { return shared_->refused.load(); }
uint64_t TlsTerminator::handshake_failures() const { return shared_->handshake_failures.load(); }

void TlsTerminator::Serve(int fd, std::function<void(int)> hand_off) {
  if (shared_->active.fetch_add(1) >= shared_->max_connections) {
    shared_->active.fetch_sub(1);
    shared_->Refuse(fd, absl::StrCat("--max-connections (", shared_->max_connections, " TLS connections) reached"));
    return;
  }
  try {
    std::thread([s = shared_, fd, hand_off = std::move(hand_off)] {
      s->Run(fd, hand_off);
      s->active.fetch_sub(1);
    }).detach();
  } catch (const std::system_error& e) {
    shared_->active.fetch_sub(1);
    shared_->Refuse(fd, absl::StrCat("cannot start a TLS connection thread (", e.what(), ")"));
  }
}

void TlsTerminator::Shared::Run(int fd, const std::function<void(int)>& hand_off) {
  SSL* ssl = SSL_new(ctx);
  if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1) {
    SSL_free(ssl);
    Refuse(fd, SslError("SSL_new failed"));
    return;
  }
  SSL_set_accept_state(ssl);
  if (!Handshake(ssl, fd)) {
    SSL_free(ssl);
    close(fd);
    return;
  }
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) != 0) {
    const int err = errno;
    SSL_free(ssl);
    Refuse(fd, absl::StrCat("socketpair: ", std::strerror(err)));
    return;
  }
  {
    absl::MutexLock lock(&mu);
    if (stopped) {
      close(pair[0]);
      close(pair[1]);
      SSL_free(ssl);
      close(fd);
      return;
    }
    relaying.fetch_add(1);
    hand_off(pair[0]);
  }
  Relay(ssl, fd, pair[1]);
  SSL_free(ssl);
  close(pair[1]);
  close(fd);
  relaying.fetch_sub(1);
}

bool TlsTerminator::Shared::Handshake(SSL* ssl, int fd) {
  const absl::Time deadline = absl::Now() + handshake_timeout;
  for (;;) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl);
    if (r == 1) return true;
    const short events = PollEventsFor(SSL_get_error(ssl, r));
    if (events == 0) {
      LogThrottled(last_handshake_log, "tls_handshake_failed", SslError("the client closed the connection"),
                   ++handshake_failures);
      return false;
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, events, 0};
    if (left_ms <= 0 || poll(&p, 1, static_cast<int>(left_ms)) <= 0) {
      LogThrottled(last_handshake_log, "tls_handshake_failed",
                   absl::StrCat("no handshake within ", absl::FormatDuration(handshake_timeout)),
                   ++handshake_failures);
      return false;
    }
  }
}

// Copies decrypted client bytes to gRPC's end and gRPC's bytes back through TLS, both
// ways at once, each through one buffer: a side that does not take bytes stops the other
// from sending more (flow control passes through). Ends when either side closes or fails.
void TlsTerminator::Shared::Relay(SSL* ssl, int tls_fd, int plain_fd) {
  std::vector<char> up(kRelayBufferBytes);    // client -> gRPC
  std::vector<char> down(kRelayBufferBytes);  // gRPC -> client
  size_t up_begin = 0, up_end = 0, down_begin = 0, down_end = 0;
  bool client_done = false;  // the client closed its side (close_notify)
  bool plain_shut = false;   // gRPC was told so
  bool grpc_done = false;    // gRPC closed its end; what it wrote still goes out
  for (;;) {
    short tls_events = 0, plain_events = 0;
    bool progress = true;
    while (progress) {
      progress = false;
      // Reads fill the buffer (a TLS record carries at most 16 KiB) before it goes on.
      if (!client_done && up_end < up.size()) {
        ERR_clear_error();
        const int n = SSL_read(ssl, up.data() + up_end, static_cast<int>(up.size() - up_end));
        if (n > 0) {
          up_end += static_cast<size_t>(n);
          progress = true;
        } else {
          const int err = SSL_get_error(ssl, n);
          if (err == SSL_ERROR_ZERO_RETURN) {
            client_done = true;
            progress = true;
          } else if (const short events = PollEventsFor(err); events != 0) {
            tls_events |= events;
          } else {
            return;  // reset, or a TLS error: both sides close
          }
        }
      }
      if (up_begin < up_end) {
        const ssize_t w = send(plain_fd, up.data() + up_begin, up_end - up_begin, MSG_NOSIGNAL);
        if (w > 0) {
          up_begin += static_cast<size_t>(w);
          if (up_begin == up_end) up_begin = up_end = 0;
          progress = true;
        } else if (errno == EAGAIN || errno == EINTR) {
          plain_events |= POLLOUT;
        } else {
          return;  // gRPC closed the connection
        }
      }
      if (client_done && up_begin == up_end && !plain_shut) {
        shutdown(plain_fd, SHUT_WR);
        plain_shut = true;
      }
      if (!grpc_done && down_end < down.size()) {
        const ssize_t r = recv(plain_fd, down.data() + down_end, down.size() - down_end, 0);
        if (r > 0) {
          down_end += static_cast<size_t>(r);
          progress = true;
        } else if (r == 0) {
          grpc_done = true;
          progress = true;
        } else if (errno == EAGAIN || errno == EINTR) {
          plain_events |= POLLIN;
        } else {
          return;
        }
      }
      if (down_begin < down_end) {
        ERR_clear_error();
        const int n = SSL_write(ssl, down.data() + down_begin, static_cast<int>(down_end - down_begin));
        if (n > 0) {
          down_begin += static_cast<size_t>(n);
          if (down_begin == down_end) down_begin = down_end = 0;
          progress = true;
        } else {
          const short events = PollEventsFor(SSL_get_error(ssl, n));
          if (events == 0) return;
          tls_events |= events;
        }
      }
      if (grpc_done && down_begin == down_end) {
        SSL_shutdown(ssl);  // gRPC is done with the connection: close_notify, best effort
        return;
      }
      if (progress) tls_events = plain_events = 0;  // retried below before any wait
    }
    pollfd fds[2] = {{tls_fd, tls_events, 0}, {plain_fd, plain_events, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR) return;
    // A hang-up or error shows in the next read or write.
  }
}

}  // namespace wprep::server
