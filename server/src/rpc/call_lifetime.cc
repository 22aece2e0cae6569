#include "rpc/call_lifetime.h"

#include <utility>

namespace wprep::server {
namespace {

class LifetimeInterceptor final : public grpc::experimental::Interceptor {
 public:
  LifetimeInterceptor(const CallHook* on_end, const void* ctx) : on_end_(on_end), ctx_(ctx) {}
  ~LifetimeInterceptor() override { (*on_end_)(ctx_); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  const CallHook* const on_end_;  // the factory's, which lives as long as the server
  const void* const ctx_;
};

class LifetimeFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  LifetimeFactory(CallHook on_start, CallHook on_end) : on_start_(std::move(on_start)), on_end_(std::move(on_end)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const void* ctx = info->server_context();
    if (on_start_) on_start_(ctx);
    return new LifetimeInterceptor(&on_end_, ctx);
  }

 private:
  const CallHook on_start_;
  const CallHook on_end_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallLifetimeHooks(CallHook on_start,
                                                                                          CallHook on_end) {
  return std::make_unique<LifetimeFactory>(std::move(on_start), std::move(on_end));
}

}  // namespace wprep::server
