// grpc.health.v1.Health for the daemon's services: "" (the daemon) and
// "wprep.v1.WeightPrep". gRPC's default health service marks every service a Watch ever
// asked for as SERVING with the others (gRPC 1.51), so an unknown service would turn
// SERVING; here an unknown service stays unknown: Check answers NOT_FOUND, Watch
// SERVICE_UNKNOWN and nothing after.
//
// Built on the callback API, so an open Watch holds no thread, and every status change
// (warm-up done, drain) is written to every open Watch at once. The methods take raw
// bytes and parse them here: gRPC 1.51's typed callback handler answers UNIMPLEMENTED to
// a body that does not parse, where the convention is INVALID_ARGUMENT. Open Watches are
// bounded by a WatchSlots shared by every HealthService of the daemon, so a flood of
// them cannot take the daemon's memory. Thread-safe.
#ifndef WPREP_SERVER_SRC_HEALTH_H_
#define WPREP_SERVER_SRC_HEALTH_H_

#include <cstdint>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/support/byte_buffer.h"

namespace wprep::server {

// The bound on open Watch calls, all HealthServices together (--max-watch-streams).
class WatchSlots {
 public:
  explicit WatchSlots(int64_t limit) : limit_(limit) {}
  // False when `limit` are taken.
  bool TryTake() {
    absl::MutexLock lock(&mu_);
    if (taken_ >= limit_) return false;
    ++taken_;
    return true;
  }
  void Give() {
    absl::MutexLock lock(&mu_);
    --taken_;
  }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  absl::Mutex mu_;
  int64_t taken_ ABSL_GUARDED_BY(mu_) = 0;
};

using HealthBase = grpc::health::v1::Health::WithRawCallbackMethod_Check<
    grpc::health::v1::Health::WithRawCallbackMethod_Watch<grpc::health::v1::Health::Service>>;

class HealthService final : public HealthBase {
 public:
  // `slots` outlives this service.
  explicit HealthService(WatchSlots* slots);
  ~HealthService() override;

  // Every known service at once (they share the daemon's one state); written to every
  // open Watch whose service's status it changes.
  void SetServing(bool serving);
  // Ends every open Watch (at shutdown, so the server can stop).
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Watch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req) override;

  class Watcher;

 private:
  friend class Watcher;
  grpc::health::v1::HealthCheckResponse::ServingStatus StatusOf(const std::string& service) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Forget(Watcher* w);

  WatchSlots* const slots_;
  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_HEALTH_H_
