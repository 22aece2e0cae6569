// The bound on host memory held for inline data (--max-buffered-bytes): a unary
// request's inline input and output from the handler until gRPC has sent the answer and
// ended the call (a client that does not read its answers keeps them in memory), and a
// stream's slice buffers while it runs. A request that would pass the bound gets
// RESOURCE_EXHAUSTED at once instead of growing the daemon. Thread-safe.
#ifndef WPREP_SERVER_SRC_HOST_BUDGET_H_
#define WPREP_SERVER_SRC_HOST_BUDGET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_interceptor.h"
#include "metrics.h"

namespace wprep::server {

class HostBudget {
 public:
  // `limit` bytes in all; `metrics` (may be null) shows what is held.
  HostBudget(uint64_t limit, Metrics* metrics);

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

  // RESOURCE_EXHAUSTED, naming `what`, when `bytes` do not fit now.
  absl::StatusOr<Charge> Take(uint64_t bytes, const char* what);

  // Keeps `charge` until the call of `ctx` ends (CallEndInterceptor reports it).
  void HoldUntilCallEnds(const void* ctx, Charge charge);
  void CallEnded(const void* ctx);

  uint64_t used() const;
  uint64_t limit() const { return limit_; }

  // Installs the interceptor that tells a budget when each call ends.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallEndNotifier(HostBudget* budget);

 private:
  void Give(uint64_t bytes);

  const uint64_t limit_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<const void*, Charge> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_HOST_BUDGET_H_
