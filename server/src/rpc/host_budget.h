// The bound on host memory held for inline data (--max-buffered-bytes): a unary
// request's inline input and output from the handler until gRPC has sent the answer and
// ended the call (a client that does not read its answers keeps them in memory), and a
// stream's slice buffers while it runs. A request that does not fit now waits in a FIFO
// queue until enough is given back (a large request is not passed by later small ones,
// which would starve it), up to its deadline or --max-queue-wait; it gets
// RESOURCE_EXHAUSTED at once only when it could never fit (more than the whole bound) or
// the queue is full, since a fleet loader would retry blindly what fits a moment later.
// Thread-safe.
#ifndef WPREP_SERVER_SRC_HOST_BUDGET_H_
#define WPREP_SERVER_SRC_HOST_BUDGET_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "net/metrics.h"

namespace wprep::server {

// How requests wait for the budget (--max-queue-wait, --max-queued-requests).
struct BudgetQueue {
  // The longest a request waits (its gRPC deadline may end it sooner); zero refuses at once.
  absl::Duration max_wait = absl::Seconds(10);
  // The most requests waiting at once: each waiter holds a gRPC thread, so the bound keeps
  // the queue from growing threads (and memory) without end.
  size_t max_queued = 1024;
};

class HostBudget {
 public:
  // `limit` bytes in all; `metrics` (may be null) shows what is held and who waits.
  HostBudget(uint64_t limit, Metrics* metrics, BudgetQueue queue = {});

  // Bytes taken until destroyed (or handed to HoldUntilCallEnds).
  class Charge {
   public:
    Charge() = default;
    Charge(Charge&& o) noexcept : budget_(std::exchange(o.budget_, nullptr)), bytes_(o.bytes_) {}
    Charge& operator=(Charge&& o) noexcept;
    ~Charge();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class HostBudget;
    Charge(HostBudget* b, uint64_t bytes) : budget_(b), bytes_(bytes) {}
    HostBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // Takes `bytes`, waiting behind earlier waiters until they fit. RESOURCE_EXHAUSTED
  // (naming `what` and the flag to change) when `bytes` exceed the whole limit, when the
  // queue is full, or when `deadline` or --max-queue-wait passes first; CANCELLED soon
  // after `cancelled()` turns true (it is polled, since a sync gRPC handler is not told).
  absl::StatusOr<Charge> Take(uint64_t bytes, const char* what, absl::Time deadline = absl::InfiniteFuture(),
                              const std::function<bool()>& cancelled = nullptr);

  // Keeps `charge` until the call of `ctx` ends (CallEndNotifier's interceptor reports it).
  void HoldUntilCallEnds(const void* ctx, Charge charge);
  void CallEnded(const void* ctx);

  uint64_t used() const;
  uint64_t limit() const { return limit_; }
  // Requests waiting now.
  size_t queued() const;

  // Installs the interceptor that tells a budget when each call ends.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallEndNotifier(HostBudget* budget);

 private:
  struct Waiter {
    uint64_t bytes = 0;
    bool granted = false;
    absl::CondVar cv;
  };
  void Give(uint64_t bytes);
  // Grants waiters from the front while the front one fits (strict FIFO).
  void GrantLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refused(BufferRefusal why);

  const uint64_t limit_;
  Metrics* const metrics_;
  const BudgetQueue queue_limits_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);  // FIFO; each lives on its Take's stack
  std::map<const void*, Charge> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_HOST_BUDGET_H_
