#include "rpc/open_calls.h"

#include "rpc/call_lifetime.h"

namespace wprep::server {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> OpenCalls::Counter() {
  return CallLifetimeHooks([this](const void*) { Opened(); }, [this](const void*) { Closed(); });
}

int OpenCalls::WaitNone(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_ == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
  return open_;
}

void OpenCalls::Opened() {
  absl::MutexLock lock(&mu_);
  ++open_;
}

void OpenCalls::Closed() {
  absl::MutexLock lock(&mu_);
  --open_;
}

}  // namespace wprep::server
