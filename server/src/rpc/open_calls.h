// The calls gRPC has open on a server, counted from their start until their final status
// went out. An admission ticket (admission.h) ends when the handler returns, before gRPC
// sends the status, so a drain that has seen the last ticket end waits for this count to
// reach zero before it tells gRPC to shut down. Thread-safe.
#ifndef WPREP_SERVER_SRC_OPEN_CALLS_H_
#define WPREP_SERVER_SRC_OPEN_CALLS_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"

namespace wprep::server {

class OpenCalls {
 public:
  // The interceptor that counts the server's calls; `this` must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Counter();
  // Waits until no call is open, or until `deadline`; returns how many are open then.
  int WaitNone(absl::Time deadline);

 private:
  void Opened();
  void Closed();

  absl::Mutex mu_;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_OPEN_CALLS_H_
