// The /metrics endpoint: a small HTTP/1.1 server on one thread that polls its
// connections, so idle or slow ones cost nothing (prometheus-cpp's embedded civetweb
// serves two connections at a time, and two silent clients stopped every scrape). Each
// connection gets one response and is closed; a request must arrive within
// kRequestTimeout and fit kMaxRequestBytes; at kMaxConnections the oldest connection
// still sending its request is dropped for the new one.
#ifndef WPREP_SERVER_SRC_METRICS_HTTP_H_
#define WPREP_SERVER_SRC_METRICS_HTTP_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "net/listener.h"
#include "prometheus/registry.h"

namespace wprep::server {

class MetricsHttpServer {
 public:
  static constexpr int kMaxConnections = 256;
  static constexpr size_t kMaxRequestBytes = 8 << 10;
  static constexpr absl::Duration kRequestTimeout = absl::Seconds(5);
  static constexpr absl::Duration kResponseTimeout = absl::Seconds(30);

  // Listens on `address` (HOST:PORT, port 0 picks one) and serves `registry` in the
  // Prometheus text format at GET /metrics.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  std::shared_ptr<prometheus::Registry> registry);
  ~MetricsHttpServer();  // stops and closes every connection
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return socket_->port(); }

 private:
  MetricsHttpServer() = default;
  void Run();
  // The whole response to one request.
  std::string Respond(const std::string& request) const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<ListeningSocket> socket_;
  std::unique_ptr<ConnectionAcceptor> acceptor_;
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_METRICS_HTTP_H_
