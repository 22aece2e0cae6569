#include "host_budget.h"

#include "absl/strings/str_cat.h"

namespace wprep::server {
namespace {

// Lives as long as its call: gRPC destroys a call's interceptors with its server
// context, after the final status went out.
class CallEndInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallEndInterceptor(HostBudget* budget, const void* ctx) : budget_(budget), ctx_(ctx) {}
  ~CallEndInterceptor() override { budget_->CallEnded(ctx_); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  HostBudget* const budget_;
  const void* const ctx_;
};

class CallEndFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallEndFactory(HostBudget* budget) : budget_(budget) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new CallEndInterceptor(budget_, info->server_context());
  }

 private:
  HostBudget* const budget_;
};

}  // namespace

HostBudget::HostBudget(uint64_t limit, Metrics* metrics) : limit_(limit), metrics_(metrics) {
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

absl::StatusOr<HostBudget::Charge> HostBudget::Take(uint64_t bytes, const char* what) {
  uint64_t now = 0;
  {
    absl::MutexLock lock(&mu_);
    if (bytes > limit_ - used_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " needs ", bytes, " bytes of host memory, and ", used_, " of the daemon's ", limit_,
          " (--max-buffered-bytes) are held by calls in flight or answers not yet read; retry later, read "
          "earlier answers, or send the tensor as CUDA IPC buffers"));
    }
    used_ += bytes;
    now = used_;
  }
  if (metrics_ != nullptr) metrics_->buffered_bytes().Set(static_cast<double>(now));
  return Charge(this, bytes);
}

void HostBudget::Give(uint64_t bytes) {
  uint64_t now = 0;
  {
    absl::MutexLock lock(&mu_);
    used_ -= std::min(bytes, used_);
    now = used_;
  }
  if (metrics_ != nullptr) metrics_->buffered_bytes().Set(static_cast<double>(now));
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
  return std::make_unique<CallEndFactory>(budget);
}

}  // namespace wprep::server
