// Admission of requests by lifecycle state: nothing runs while warming up or draining,
// and the requests in flight are counted so shutdown can wait for them. Thread-safe.
#ifndef WPREP_SERVER_SRC_ADMISSION_H_
#define WPREP_SERVER_SRC_ADMISSION_H_

#include <cstdint>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wprep::server {

// Who sent a request: a client, or the daemon itself warming its RPC path.
enum class Caller { kClient, kSelfWarmup };

class Admission {
 public:
  enum class State { kWarming, kServing, kDraining };

  // Counts one admitted request until destroyed.
  class Ticket {
   public:
    explicit Ticket(Admission* a) : a_(a) {}
    Ticket(Ticket&& o) noexcept : a_(std::exchange(o.a_, nullptr)) {}
    Ticket& operator=(Ticket&&) = delete;
    ~Ticket() {
      if (a_ != nullptr) a_->Leave();
    }

   private:
    Admission* a_;
  };

  // Admits a request, or UNAVAILABLE while warming up or draining. The daemon's own
  // warm-up calls are in flight like any other, so draining waits for them, but stay out
  // of client_requests(): they are no traffic, and must not make the idle trim release
  // the heap and pinned buffers they have just warmed.
  absl::StatusOr<Ticket> Enter(Caller caller) {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kWarming) {
      return absl::UnavailableError(
          "wprepd is warming up its kernels (health NOT_SERVING); retry once health says SERVING");
    }
    if (state_ == State::kDraining) {
      return absl::UnavailableError(
          "wprepd is draining for shutdown and accepts no new work; retry on another instance");
    }
    ++in_flight_;
    if (caller == Caller::kClient) ++client_requests_;
    return Ticket(this);
  }

  void SetServing() {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kWarming) state_ = State::kServing;
  }
  void StartDraining() {
    absl::MutexLock lock(&mu_);
    state_ = State::kDraining;
  }
  // Waits until no admitted request is in flight; false when `deadline` came first.
  bool WaitIdle(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  int in_flight() const {
    absl::MutexLock lock(&mu_);
    return in_flight_;
  }
  // Client requests admitted since start (for the idle housekeeping).
  uint64_t client_requests() const {
    absl::MutexLock lock(&mu_);
    return client_requests_;
  }
  // True when nothing is in flight and nothing ended within `quiet`.
  bool IdleFor(absl::Duration quiet) const {
    absl::MutexLock lock(&mu_);
    return in_flight_ == 0 && absl::Now() - last_leave_ >= quiet;
  }

 private:
  void Leave() {
    absl::MutexLock lock(&mu_);
    last_leave_ = absl::Now();
    --in_flight_;
  }

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kWarming;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t client_requests_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_leave_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_ADMISSION_H_
