#include "rpc/health.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wprep::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

namespace {

// The services the daemon reports: itself and its API.
bool Known(const std::string& service) { return service.empty() || service == "wprep.v1.WeightPrep"; }

// The request, or INVALID_ARGUMENT naming what was expected.
grpc::Status ParseRequest(const grpc::ByteBuffer* bytes, HealthCheckRequest* req) {
  grpc::ByteBuffer copy(*bytes);  // shares the slices; Deserialize consumes its buffer
  if (!grpc::SerializationTraits<HealthCheckRequest>::Deserialize(&copy, req).ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the request body is not a grpc.health.v1.HealthCheckRequest");
  }
  return grpc::Status::OK;
}

grpc::ByteBuffer Serialized(HealthCheckResponse::ServingStatus status) {
  HealthCheckResponse resp;
  resp.set_status(status);
  grpc::ByteBuffer bytes;
  bool own = false;
  // Serializing a two-byte message into a fresh buffer does not fail.
  grpc::SerializationTraits<HealthCheckResponse>::Serialize(resp, &bytes, &own).IgnoreError();
  return bytes;
}

// A Watch refused at once (bad request, too many open, or shutting down).
class RefusedWatch final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedWatch(grpc::Status s) { Finish(std::move(s)); }
  void OnDone() override { delete this; }
};

}  // namespace

// One open Watch: sends the service's status now and whenever it changes, one write at
// a time, newest status last (a status that changes twice during a write is sent once).
class HealthService::Watcher final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
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
    last_sent_ = in_flight_;
    // A status that changed during the write goes out before the end: a drain's
    // NOT_SERVING, set just before shutdown ends every Watch, must reach the watcher.
    if (pending_) {
      const HealthCheckResponse::ServingStatus next = *pending_;
      pending_.reset();
      StartWriteLocked(next);
    }
    if (!writing_ && end_) EndLocked(*end_);
  }
  void OnCancel() override { End(grpc::Status::CANCELLED); }
  void OnDone() override {
    service_->Forget(this);
    delete this;
  }

 private:
  void StartWriteLocked(HealthCheckResponse::ServingStatus status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (last_sent_ && *last_sent_ == status) return;
    in_flight_ = status;
    response_ = Serialized(status);
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
  grpc::ByteBuffer response_ ABSL_GUARDED_BY(mu_);
  HealthCheckResponse::ServingStatus in_flight_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  std::optional<HealthCheckResponse::ServingStatus> last_sent_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthCheckResponse::ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  friend class HealthService;
};

HealthService::HealthService(WatchSlots* slots) : slots_(slots) {}

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
  slots_->Give();
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                               grpc::ByteBuffer* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  HealthCheckRequest req;
  if (grpc::Status parsed = ParseRequest(bytes, &req); !parsed.ok()) {
    reactor->Finish(parsed);
    return reactor;
  }
  absl::ReaderMutexLock lock(&mu_);
  if (!Known(req.service())) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
  } else {
    *resp = Serialized(StatusOf(req.service()));
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                const grpc::ByteBuffer* bytes) {
  HealthCheckRequest req;
  if (grpc::Status parsed = ParseRequest(bytes, &req); !parsed.ok()) return new RefusedWatch(parsed);
  absl::MutexLock lock(&mu_);
  if (shut_down_) return new RefusedWatch(grpc::Status(grpc::StatusCode::UNAVAILABLE, "wprepd is shutting down"));
  if (!slots_->TryTake()) {
    return new RefusedWatch(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(slots_->limit(),
                     " health Watch calls are open (--max-watch-streams); use Check, or retry later")));
  }
  auto* w = new Watcher(this, req.service());
  watchers_.insert(w);
  w->Send(StatusOf(req.service()));
  return w;
}

}  // namespace wprep::server
