// TLS and mutual TLS on the daemon's TCP listeners, with certificates the test makes
// (openssl): a CA, a server certificate for 127.0.0.1 and a client certificate.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon_harness.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
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

}  // namespace
}  // namespace wprep::testing
