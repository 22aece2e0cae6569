// A server interceptor that only marks its call's lifetime: gRPC creates it when the call
// starts and destroys it with the call's server context, after the final status went out.
// That end is later than a handler's return (when admission tickets end), which is what the
// host budget's held charges and the drain's count of open calls wait for.
#ifndef WPREP_SERVER_SRC_CALL_LIFETIME_H_
#define WPREP_SERVER_SRC_CALL_LIFETIME_H_

#include <functional>
#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace wprep::server {

// `on_start` (may be empty) and `on_end` run with the call's grpc::ServerContext address as
// its key, on gRPC's threads; they must be thread-safe and outlive the server.
using CallHook = std::function<void(const void* server_context)>;
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallLifetimeHooks(CallHook on_start,
                                                                                          CallHook on_end);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_CALL_LIFETIME_H_
