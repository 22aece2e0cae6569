// TLS and mutual TLS on the daemon's TCP listeners, with certificates the test makes
// (openssl): a CA, a server certificate for 127.0.0.1 and a client certificate.
#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/ssl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <future>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "golden.h"
#include "golden_rpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "net/tls_terminator.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A CA and two certificates it signed, in a fresh folder.
class Certificates {
 public:
  Certificates() {
    char tmpl[] = "/tmp/wprep-tls-XXXXXX";
    dir_ = mkdtemp(tmpl);
    const std::string d = dir_;
    ok_ = Run("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=wprep-test-ca -keyout " + d +
              "/ca.key -out " + d + "/ca.pem") &&
          Run("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=another-ca -keyout " + d +
              "/other.key -out " + d + "/other.pem") &&
          Issue("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost") &&
          Issue("client", "/CN=wprep-test-client", "extendedKeyUsage=clientAuth");
  }
  ~Certificates() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Pem(const std::string& name) const { return ReadText(Path(name)); }

 private:
  static bool Run(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }
  bool Issue(const std::string& who, const std::string& subject, const std::string& ext) {
    const std::string d = dir_;
    std::ofstream(d + "/" + who + ".ext") << ext << "\n";
    return Run("openssl req -newkey rsa:2048 -nodes -subj " + subject + " -keyout " + d + "/" + who + ".key -out " +
               d + "/" + who + ".csr") &&
           Run("openssl x509 -req -in " + d + "/" + who + ".csr -CA " + d + "/ca.pem -CAkey " + d +
               "/ca.key -CAcreateserial -days 2 -extfile " + d + "/" + who + ".ext -out " + d + "/" + who + ".pem");
  }
  std::string dir_;
  bool ok_ = false;
};

absl::Status ListDevicesOver(const std::string& target, std::shared_ptr<grpc::ChannelCredentials> creds) {
  auto stub = wprep::v1::WeightPrep::NewStub(grpc::CreateChannel(target, creds));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  wprep::v1::ListDevicesResponse resp;
  return wprep::client::FromGrpcStatus(stub->ListDevices(&ctx, wprep::v1::ListDevicesRequest(), &resp));
}

// A channel of its own connection (gRPC shares connections between channels of the same
// target and arguments otherwise), trusting the test CA.
std::shared_ptr<grpc::Channel> TlsChannel(const std::string& target, const Certificates& certs) {
  grpc::SslCredentialsOptions trust;
  trust.pem_root_certs = certs.Pem("ca.pem");
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(trust), args);
}

// A TCP connection to "127.0.0.1:PORT" that sends nothing (it never starts a handshake).
int ConnectTcp(const std::string& target) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(target.substr(target.rfind(':') + 1))));
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::unique_ptr<Daemon> StartTlsDaemon(const Certificates& certs, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--devices=cpu", "--tls-cert=" + certs.Path("server.pem"),
                                   "--tls-key=" + certs.Path("server.key")};
  args.insert(args.end(), extra.begin(), extra.end());
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(args, &error);
  EXPECT_NE(d, nullptr) << error;
  if (d != nullptr) {
    EXPECT_TRUE(d->WaitServing()) << d->Log();
  }
  return d;
}

// The daemon's count of refused connections, once it is above zero (it is published
// every few seconds), or 0 after 10 s.
double RefusedConnections(const Daemon& d) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  double v = 0;
  while ((v = MetricValue(HttpGet(d.metrics_address(), "/metrics"), "wprep_connections_refused_total").value_or(0)) <= 0 &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  return v;
}

ConversionSpec HopperSwizzle() { return HopperSpec(Direction::kSwizzle, -2, 3); }

TEST(Tls, TcpListenersSpeakTlsAndTheUnixSocketStaysPlain) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(
      {"--devices=cpu", "--tls-cert=" + certs.Path("server.pem"), "--tls-key=" + certs.Path("server.key")}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  grpc::SslCredentialsOptions trust;
  trust.pem_root_certs = certs.Pem("ca.pem");
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials(trust)).ok());
  EXPECT_FALSE(ListDevicesOver(d->tcp_target(), grpc::InsecureChannelCredentials()).ok())
      << "a plaintext client reached the TLS listener";
  grpc::SslCredentialsOptions wrong_ca;
  wrong_ca.pem_root_certs = certs.Pem("other.pem");  // not the issuer
  EXPECT_FALSE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials(wrong_ca)).ok());
  EXPECT_TRUE(ListDevicesOver(d->unix_target(), grpc::InsecureChannelCredentials()).ok());
}

TEST(Tls, MutualTlsRefusesClientsWithoutACertificateOfTheCa) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--tls-cert=" + certs.Path("server.pem"),
                                             "--tls-key=" + certs.Path("server.key"),
                                             "--tls-client-ca=" + certs.Path("ca.pem")},
                                            &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  grpc::SslCredentialsOptions anonymous;
  anonymous.pem_root_certs = certs.Pem("ca.pem");
  EXPECT_FALSE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials(anonymous)).ok());
  grpc::SslCredentialsOptions with_cert = anonymous;
  with_cert.pem_private_key = certs.Pem("client.key");
  with_cert.pem_cert_chain = certs.Pem("client.pem");
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials(with_cert)).ok());
  grpc::SslCredentialsOptions server_cert_as_client = anonymous;  // signed by the CA, but a server certificate
  server_cert_as_client.pem_private_key = certs.Pem("server.key");
  server_cert_as_client.pem_cert_chain = certs.Pem("server.pem");
  // A chain to the CA is what mutual TLS asks for; the key usage is the CA's policy.
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials(server_cert_as_client)).ok());
}

TEST(Tls, AnOpenAddressIsAllowedWithTlsAndABadKeyStopsTheStart) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--listen=0.0.0.0:0", "--tls-cert=" + certs.Path("server.pem"),
                                             "--tls-key=" + certs.Path("server.key")},
                                            &error);
  ASSERT_NE(d, nullptr) << error;
  EXPECT_TRUE(d->WaitServing()) << d->Log();
  std::unique_ptr<Daemon> bad = Daemon::Start({"--devices=cpu", "--tls-cert=" + certs.Path("server.pem"),
                                               "--tls-key=" + certs.Path("missing.key")},
                                              &error, absl::Seconds(30));
  if (bad != nullptr) {
    const int status = bad->WaitExit(absl::Seconds(30));
    ASSERT_NE(status, -1) << "started with a missing key";
    EXPECT_NE(WEXITSTATUS(status), 0);
    error = bad->Log();
  }
  EXPECT_NE(error.find("--tls-key"), std::string::npos) << error;
}

// The relay moves large messages both ways: a 16 MiB unary conversion and a 48 MiB
// stream, byte for byte, on one TLS connection.
TEST(Tls, LargeConversionsOverTlsAreByteExact) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::unique_ptr<Daemon> d = StartTlsDaemon(certs);
  ASSERT_NE(d, nullptr);
  wprep::client::Client c(TlsChannel(d->tcp_target(), certs));
  const std::vector<int64_t> unary_shape = {8, 2048, 2048};  // 16 MiB
  const std::vector<uint8_t> in = RandomBytes(16u << 20, 11);
  absl::StatusOr<v1::ConvertResponse> r = c.Convert(ConvertRequestFor(HopperSwizzle(), unary_shape, in));
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << d->Log();
  EXPECT_EQ(r->output_bytes_inline(), CpuReference(HopperSwizzle(), unary_shape, in));

  const std::vector<int64_t> stream_shape = {24, 2048, 2048};  // 48 MiB
  const std::vector<uint8_t> big = RandomBytes(48u << 20, 12);
  std::string out;
  absl::StatusOr<v1::StreamResponseHeader> h = c.ConvertStream(StreamHeaderFor(HopperSwizzle(), stream_shape), big, &out);
  ASSERT_TRUE(h.ok()) << h.status() << "\n" << d->Log();
  EXPECT_TRUE(out == CpuReference(HopperSwizzle(), stream_shape, big)) << "the streamed output differs";
}

// Finding: gRPC's own TLS listener closed for good once accept failed with EMFILE. The
// daemon's TLS listener sheds connections while descriptors run out and serves again
// after.
TEST(Tls, TheTlsListenerRecoversAfterDescriptorExhaustion) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::unique_ptr<Daemon> d = StartTlsDaemon(certs);
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials({certs.Pem("ca.pem"), "", ""})).ok());
  DescriptorLimit limit(d->pid(), 8);
  ASSERT_TRUE(limit.ok());
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectTcp(d->tcp_target());
    if (fd >= 0) idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(500));  // the daemon runs out of descriptors
  EXPECT_FALSE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials({certs.Pem("ca.pem"), "", ""})).ok())
      << "served with no descriptor to spare";
  for (int fd : idle) close(fd);
  ASSERT_TRUE(limit.Restore());
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials({certs.Pem("ca.pem"), "", ""})).ok())
      << d->Log();
  EXPECT_GT(RefusedConnections(*d), 0);
}

// --max-connections holds TLS connections too: with 3 of them open (here, clients that
// never start a handshake), a fourth client is refused; once they close, it is served.
// A connection that never completes its handshake is closed after
// --tls-handshake-timeout.
TEST(Tls, MaxConnectionsAndTheHandshakeTimeoutHoldTlsConnections) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::unique_ptr<Daemon> d = StartTlsDaemon(certs, {"--max-connections=3", "--tls-handshake-timeout=3s"});
  ASSERT_NE(d, nullptr);
  const auto creds = grpc::SslCredentials({certs.Pem("ca.pem"), "", ""});
  std::vector<int> silent;
  silent.reserve(3);
  for (int i = 0; i < 3; ++i) silent.push_back(ConnectTcp(d->tcp_target()));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(ListDevicesOver(d->tcp_target(), creds).ok()) << "a fourth TLS connection was served";
  EXPECT_GT(RefusedConnections(*d), 0);
  EXPECT_TRUE(ListDevicesOver(d->unix_target(), grpc::InsecureChannelCredentials()).ok())
      << "the Unix socket is not held by the TLS connections";
  // The silent clients are closed by the daemon at the handshake timeout.
  for (int fd : silent) {
    ASSERT_GE(fd, 0);
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char b;
    const absl::Time t0 = absl::Now();
    EXPECT_EQ(recv(fd, &b, 1, 0), 0) << "not closed by the daemon within 10 s";
    EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
    close(fd);
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), creds).ok()) << d->Log();
  EXPECT_NE(d->Log().find("event=tls_handshake_failed"), std::string::npos) << d->Log();
}

// Bytes that are no TLS handshake (here, a plaintext HTTP/2 preface and garbage) end the
// connection, are counted and logged, and the daemon goes on serving TLS.
TEST(Tls, GarbageOnTheTlsPortIsAFailedHandshakeAndNothingMore) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::unique_ptr<Daemon> d = StartTlsDaemon(certs);
  ASSERT_NE(d, nullptr);
  for (const std::string& junk : {std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), std::string(4096, '\x16'),
                                  std::string("\x16\x03\x01\xff\xff") + std::string(70000, 'x')}) {
    const int fd = ConnectTcp(d->tcp_target());
    ASSERT_GE(fd, 0);
    (void)send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[256];
    ssize_t n = 0;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
    }  // a TLS alert at most, then the close
    // Closed with unread bytes in its buffer, the connection may end in a reset.
    EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << "not closed within 10 s: " << std::strerror(errno);
    close(fd);
  }
  EXPECT_TRUE(ListDevicesOver(d->tcp_target(), grpc::SslCredentials({certs.Pem("ca.pem"), "", ""})).ok())
      << d->Log();
  EXPECT_NE(d->Log().find("event=tls_handshake_failed"), std::string::npos) << d->Log();
}

// SIGTERM with TLS clients connected (one idle, one mid-way through a stream it stopped
// feeding) drains and exits 0: the relays end when gRPC closes its side.
TEST(Tls, SigtermWithTlsClientsConnectedDrainsAndExits) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  std::unique_ptr<Daemon> d = StartTlsDaemon(certs, {"--drain-timeout=2s"});
  ASSERT_NE(d, nullptr);
  std::shared_ptr<grpc::Channel> idle = TlsChannel(d->tcp_target(), certs);
  ASSERT_TRUE(idle->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  std::shared_ptr<grpc::Channel> busy = TlsChannel(d->tcp_target(), certs);
  auto stub = wprep::v1::WeightPrep::NewStub(busy);
  grpc::ClientContext ctx;
  auto stream = stub->ConvertStream(&ctx);
  v1::ConvertStreamRequest m;
  *m.mutable_header() = StreamHeaderFor(HopperSwizzle(), {4, 2048, 2048});
  ASSERT_TRUE(stream->Write(m));
  v1::ConvertStreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp) && resp.has_header()) << d->Log();
  d->Signal(SIGTERM);
  const int status = d->WaitExit(absl::Seconds(30));
  ASSERT_NE(status, -1) << "still running 30 s after SIGTERM\n" << d->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << d->Log();
  EXPECT_NE(stream->Finish().error_code(), grpc::StatusCode::OK);
}

// The daemon's drain waits for its TLS relays after gRPC's shutdown (WaitForRelays): a
// relay still holding bytes gRPC wrote keeps running until its client has them all. Here
// "gRPC" writes 32 MiB into a relay's plaintext end and closes it while the client reads
// nothing (more than the loopback connection's buffers take): the relay must still run;
// once the client reads, it gets every byte and TLS's close, and the relay ends.
TEST(Tls, ARelayEndsOnlyOnceItsClientHasWhatGrpcWrote) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  wprep::server::TlsConfig config;
  config.cert_pem = certs.Pem("server.pem");
  config.key_pem = certs.Pem("server.key");
  absl::StatusOr<std::unique_ptr<wprep::server::TlsTerminator>> tls = wprep::server::TlsTerminator::Create(config);
  ASSERT_TRUE(tls.ok()) << tls.status();

  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const int client_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(connect(client_fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  const int server_fd = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  close(listener);
  ASSERT_GE(server_fd, 0);
  std::promise<int> plain;
  (*tls)->Serve(server_fd, [&plain](int fd) { plain.set_value(fd); });

  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, client_fd);
  SSL_set_verify(ssl, SSL_VERIFY_NONE, nullptr);
  ASSERT_EQ(SSL_connect(ssl), 1);
  const int plain_fd = plain.get_future().get();
  ASSERT_EQ(fcntl(plain_fd, F_SETFL, 0), 0);  // blocking writes below

  constexpr size_t kBytes = 32 << 20;
  std::thread grpc_side([plain_fd] {
    const std::string piece(1 << 20, '\x5a');
    for (size_t sent = 0; sent < kBytes;) {
      const ssize_t n = send(plain_fd, piece.data(), std::min(piece.size(), kBytes - sent), MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    close(plain_fd);
  });
  EXPECT_EQ((*tls)->WaitForRelays(absl::Now() + absl::Milliseconds(300)), 1);

  std::vector<char> buf(1 << 16);
  size_t got = 0;
  bool clean_end = false;
  for (;;) {
    const int n = SSL_read(ssl, buf.data(), static_cast<int>(buf.size()));
    if (n > 0) {
      for (int i = 0; i < n; ++i) ASSERT_EQ(buf[i], '\x5a');
      got += static_cast<size_t>(n);
      continue;
    }
    clean_end = SSL_get_error(ssl, n) == SSL_ERROR_ZERO_RETURN;
    break;
  }
  grpc_side.join();
  EXPECT_EQ(got, kBytes);
  EXPECT_TRUE(clean_end) << "the relay ended without TLS's close_notify";
  EXPECT_EQ((*tls)->WaitForRelays(absl::Now() + absl::Seconds(10)), 0);
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  close(client_fd);
}

}  // namespace
}  // namespace wprep::testing
