// grpc.health.v1.Health for the daemon's services: "" (the daemon) and
// "wprep.v1.WeightPrep". gRPC's default health service marks every service a Watch ever
// asked for as SERVING with the others (gRPC 1.51), so an unknown service would turn
// SERVING; here an unknown service stays unknown: Check answers NOT_FOUND, Watch
// SERVICE_UNKNOWN and nothing after. Built on the callback API, so an open Watch holds no
// thread; at most kMaxWatches run at once. Thread-safe.
#ifndef WPREP_SERVER_SRC_HEALTH_H_
#define WPREP_SERVER_SRC_HEALTH_H_

#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace wprep::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  static constexpr int kMaxWatches = 1024;

  HealthService();
  ~HealthService() override;

  // Every known service at once (they share the daemon's one state).
  void SetServing(bool serving);
  // Ends every open Watch (at shutdown, so the server can stop).
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

  class Watcher;

 private:
  friend class Watcher;
  grpc::health::v1::HealthCheckResponse::ServingStatus StatusOf(const std::string& service) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Forget(Watcher* w);

  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_HEALTH_H_
