#include "health.h"

#include <optional>

namespace wprep::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

namespace {

// The services the daemon reports: itself and its API.
bool Known(const std::string& service) { return service.empty() || service == "wprep.v1.WeightPrep"; }

// A Watch refused at once (too many open, or shutting down).
class RefusedWatch final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  explicit RefusedWatch(grpc::Status s) { Finish(std::move(s)); }
  void OnDone() override { delete this; }
};

}  // namespace

// One open Watch: sends the service's status now and whenever it changes, one write at
// a time, newest status last.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* service, std::string name) : service_(service), name_(std::move(name)) {}

  // Called with the service's lock held, which keeps this watcher alive.
  void Send(HealthCheckResponse::ServingStatus status) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (writing_) {
      pending_ = status;
      return;
    }
    StartWriteLocked(status);
  }
  void End(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    EndLocked(std::move(status));
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      EndLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
    }
    last_sent_ = response_.status();
    if (end_) {
      EndLocked(*end_);
    } else if (pending_) {
      const HealthCheckResponse::ServingStatus next = *pending_;
      pending_.reset();
      StartWriteLocked(next);
    }
  }
  void OnCancel() override { End(grpc::Status::CANCELLED); }
  void OnDone() override {
    service_->Forget(this);
    delete this;
  }

 private:
  void StartWriteLocked(HealthCheckResponse::ServingStatus status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (last_sent_ && *last_sent_ == status) return;
    response_.set_status(status);
    writing_ = true;
    StartWrite(&response_);
  }
  // Finishing waits for a write in flight (a reactor finishes once, after its writes).
  void EndLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (writing_) {
      end_ = std::move(status);
      return;
    }
    finished_ = true;
    Finish(std::move(status));
  }

  HealthService* const service_;
  const std::string name_;
  absl::Mutex mu_;
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthCheckResponse::ServingStatus> last_sent_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthCheckResponse::ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  friend class HealthService;
};

HealthService::HealthService() = default;

HealthService::~HealthService() {
  Shutdown();
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return watchers_.empty(); };
  mu_.Await(absl::Condition(&none));
}

HealthCheckResponse::ServingStatus HealthService::StatusOf(const std::string& service) const {
  if (!Known(service)) return HealthCheckResponse::SERVICE_UNKNOWN;
  return serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  serving_ = serving;
  for (Watcher* w : watchers_) w->Send(StatusOf(w->name_));
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  for (Watcher* w : watchers_) w->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "wprepd is shutting down"));
}

void HealthService::Forget(Watcher* w) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(w);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx, const HealthCheckRequest* req,
                                               HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::ReaderMutexLock lock(&mu_);
  if (!Known(req->service())) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
  } else {
    resp->set_status(StatusOf(req->service()));
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                   const HealthCheckRequest* req) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return new RefusedWatch(grpc::Status(grpc::StatusCode::UNAVAILABLE, "wprepd is shutting down"));
  if (watchers_.size() >= kMaxWatches) {
    return new RefusedWatch(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                         "too many open health Watch calls; use Check, or retry later"));
  }
  auto* w = new Watcher(this, req->service());
  watchers_.insert(w);
  w->Send(StatusOf(req->service()));
  return w;
}

}  // namespace wprep::server
