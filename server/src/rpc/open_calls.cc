#include "rpc/open_calls.h"

namespace wprep::server {

// Lives as long as its call: gRPC destroys a call's interceptors with its server context,
// after the final status went out.
class OpenCallInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit OpenCallInterceptor(OpenCalls* calls) : calls_(calls) { calls_->Opened(); }
  ~OpenCallInterceptor() override { calls_->Closed(); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  OpenCalls* const calls_;
};

namespace {

class OpenCallFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit OpenCallFactory(OpenCalls* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new OpenCallInterceptor(calls_);
  }

 private:
  OpenCalls* const calls_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> OpenCalls::Counter() {
  return std::make_unique<OpenCallFactory>(this);
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
