#include "rpc/host_budget.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/call_lifetime.h"

namespace wprep::server {
namespace {

// How often a waiter looks whether its call was cancelled: a sync handler gets no
// notice, and a shorter period would make a full queue of sleepers a busy one.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

}  // namespace

HostBudget::HostBudget(uint64_t limit, Metrics* metrics, BudgetQueue queue)
    : limit_(limit), metrics_(metrics), queue_limits_(queue) {
  if (metrics_ != nullptr) metrics_->buffer_budget_bytes().Set(static_cast<double>(limit));
}

HostBudget::Charge& HostBudget::Charge::operator=(Charge&& o) noexcept {
  if (this != &o) {
    if (budget_ != nullptr) budget_->Give(bytes_);
    budget_ = std::exchange(o.budget_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

HostBudget::Charge::~Charge() {
  if (budget_ != nullptr) budget_->Give(bytes_);
}

absl::StatusOr<HostBudget::Charge> HostBudget::Take(uint64_t bytes, const char* what, absl::Time deadline,
                                                    const std::function<bool()>& cancelled) {
  if (bytes > limit_) {
    Refused(BufferRefusal::kTooLarge);
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", bytes, " bytes of host memory, more than the daemon's whole budget of ", limit_,
        " bytes (--max-buffered-bytes), so it could never fit; raise --max-buffered-bytes, send a smaller "
        "tensor, or send the tensor as CUDA IPC buffers"));
  }
  const absl::Time start = absl::Now();
  const bool by_deadline = deadline < start + queue_limits_.max_wait;
  const absl::Time until = by_deadline ? deadline : start + queue_limits_.max_wait;
  Waiter w;
  w.bytes = bytes;
  std::optional<BufferRefusal> refused;
  uint64_t held = 0;
  size_t queued = 0;
  {
    absl::MutexLock lock(&mu_);
    // Only when nobody waits: a request that fits must not pass an earlier, larger one.
    if (waiters_.empty() && bytes <= limit_ - used_) {
      used_ += bytes;
      held = used_;
    } else if (queue_limits_.max_wait <= absl::ZeroDuration()) {
      refused = BufferRefusal::kTimeout;
      held = used_;
    } else if (waiters_.size() >= queue_limits_.max_queued) {
      refused = BufferRefusal::kQueueFull;
      queued = waiters_.size();
    } else {
      auto it = waiters_.insert(waiters_.end(), &w);
      if (metrics_ != nullptr) metrics_->buffer_queue_requests().Set(static_cast<double>(waiters_.size()));
      while (!w.granted) {
        const absl::Time now = absl::Now();
        if (now >= until) {
          refused = BufferRefusal::kTimeout;
          break;
        }
        if (cancelled) {
          // Outside the lock: IsCancelled may drive gRPC's completion queue.
          mu_.Unlock();
          const bool gone = cancelled();
          mu_.Lock();
          if (gone && !w.granted) {
            refused = BufferRefusal::kCancelled;
            break;
          }
          if (w.granted) break;
        }
        w.cv.WaitWithDeadline(&mu_, std::min(until, now + kCancelPoll));
      }
      if (!w.granted) {
        waiters_.erase(it);
        GrantLocked();  // the head leaving may let the next one fit
        if (metrics_ != nullptr) metrics_->buffer_queue_requests().Set(static_cast<double>(waiters_.size()));
      }
      held = used_;
    }
  }
  // Every request that had its turn, granted or not; those refused before they could
  // queue (full queue) waited for nothing.
  if (metrics_ != nullptr && refused != BufferRefusal::kQueueFull) {
    metrics_->buffer_wait_seconds().Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }
  if (!refused) {
    if (metrics_ != nullptr) metrics_->buffered_bytes().Set(static_cast<double>(held));
    return Charge(this, bytes);
  }
  Refused(*refused);
  switch (*refused) {
    case BufferRefusal::kCancelled:
      return absl::CancelledError(
          absl::StrCat("the client cancelled while ", what, " waited for ", bytes, " bytes of host memory"));
    case BufferRefusal::kQueueFull:
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " needs ", bytes, " bytes of host memory, none are free now, and ", queued,
          " requests already wait for it (--max-queued-requests); retry later, read earlier answers, or send "
          "the tensor as CUDA IPC buffers"));
    default:
      break;
  }
  if (queue_limits_.max_wait <= absl::ZeroDuration()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", bytes, " bytes of host memory, and ", held, " of the daemon's ", limit_,
        " (--max-buffered-bytes) are held by calls in flight or answers not yet read (--max-queue-wait=0 "
        "refuses at once); retry later, read earlier answers, or send the tensor as CUDA IPC buffers"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " waited ", absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))), " for ",
      bytes, " bytes of host memory, until ",
      by_deadline ? std::string("the call's deadline was near")
                  : absl::StrCat("--max-queue-wait=", absl::FormatDuration(queue_limits_.max_wait)),
      ", while ", held, " of the daemon's ", limit_,
      " (--max-buffered-bytes) stayed held by calls in flight or answers not yet read; retry later, read "
      "earlier answers, or send the tensor as CUDA IPC buffers"));
}

void HostBudget::GrantLocked() {
  while (!waiters_.empty() && waiters_.front()->bytes <= limit_ - used_) {
    Waiter* w = waiters_.front();
    waiters_.pop_front();
    used_ += w->bytes;
    w->granted = true;
    w->cv.Signal();
  }
}

void HostBudget::Refused(BufferRefusal why) {
  if (metrics_ != nullptr) metrics_->buffer_refused(why).Increment();
}

void HostBudget::Give(uint64_t bytes) {
  uint64_t now = 0;
  {
    absl::MutexLock lock(&mu_);
    used_ -= std::min(bytes, used_);
    GrantLocked();
    now = used_;
    // Under the lock, so the gauge never shows an older depth after a newer one.
    if (metrics_ != nullptr) metrics_->buffer_queue_requests().Set(static_cast<double>(waiters_.size()));
  }
  if (metrics_ != nullptr) metrics_->buffered_bytes().Set(static_cast<double>(now));
}

size_t HostBudget::queued() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

void HostBudget::HoldUntilCallEnds(const void* ctx, Charge charge) {
  absl::MutexLock lock(&mu_);
  held_[ctx] = std::move(charge);
}

void HostBudget::CallEnded(const void* ctx) {
  Charge release;  // destroyed last, so it is given back outside the lock
  absl::MutexLock lock(&mu_);
  auto it = held_.find(ctx);
  if (it == held_.end()) return;
  release = std::move(it->second);
  held_.erase(it);
}

uint64_t HostBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> HostBudget::CallEndNotifier(HostBudget* budget) {
  return CallLifetimeHooks(nullptr, [budget](const void* ctx) { budget->CallEnded(ctx); });
}

}  // namespace wprep::server
