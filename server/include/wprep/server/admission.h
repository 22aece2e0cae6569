// Admission of requests by lifecycle state: nothing runs while warming up or draining,
// and the requests in flight are counted so shutdown can wait for them. Thread-safe.
#ifndef WPREP_SERVER_ADMISSION_H_
#define WPREP_SERVER_ADMISSION_H_

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wprep::server {

class Admission {
 public:
  enum class State { kWarming, kServing, kDraining };

  // Counts one admitted request until destroyed.
  class Ticket {
   public:
    explicit Ticket(Admission* a) : a_(a) {}
    Ticket(Ticket&& o) noexcept : a_(o.a_) { o.a_ = nullptr; }
    Ticket& operator=(Ticket&&) = delete;
    ~Ticket() {
      if (a_ != nullptr) a_->Leave();
    }

   private:
    Admission* a_;
  };

  // Admits a request, or UNAVAILABLE while warming up or draining. An uncounted request
  // (the daemon's own RPC warm-up) is in flight like any other, so draining waits for it,
  // but stays out of admitted(): it is no traffic, and must not make the janitor trim the
  // heap and pinned buffers it has just warmed.
  absl::StatusOr<Ticket> Enter(bool counted = true) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == State::kWarming) {
      return absl::UnavailableError(
          "wprepd is warming up its kernels (health NOT_SERVING); retry once health says SERVING");
    }
    if (state_ == State::kDraining) {
      return absl::UnavailableError(
          "wprepd is draining for shutdown and accepts no new work; retry on another instance");
    }
    ++in_flight_;
    if (counted) ++admitted_;
    return Ticket(this);
  }

  void SetServing() {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == State::kWarming) state_ = State::kServing;
  }
  void StartDraining() {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kDraining;
  }
  // Waits until no admitted request is in flight; false when `deadline` came first.
  bool WaitIdle(absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    while (in_flight_ > 0) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      idle_.wait_for(lock, absl::ToChronoNanoseconds(left));
    }
    return true;
  }
  int in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }
  // Counted requests admitted since start, and when the last one ended (for idle housekeeping).
  uint64_t admitted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return admitted_;
  }
  // True when nothing is in flight and nothing ended within `quiet`.
  bool IdleFor(absl::Duration quiet) const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_ == 0 && absl::Now() - last_leave_ >= quiet;
  }

 private:
  void Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    last_leave_ = absl::Now();
    if (--in_flight_ == 0) idle_.notify_all();
  }

  mutable std::mutex mu_;
  std::condition_variable idle_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kWarming;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t admitted_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_leave_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_ADMISSION_H_
