// The one translation from absl::Status (library code) to grpc::Status (the wire).
#ifndef WPREP_SERVER_SRC_STATUS_H_
#define WPREP_SERVER_SRC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace wprep::server {

// Same code (absl and gRPC codes share their numbering) and message. Every handler ends
// through this function.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The reverse, for the daemon's calls to itself (the RPC warm-up).
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_STATUS_H_
