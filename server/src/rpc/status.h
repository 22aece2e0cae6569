// The one translation from absl::Status (library code) to grpc::Status (the wire).
#ifndef WPREP_SERVER_SRC_STATUS_H_
#define WPREP_SERVER_SRC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace wprep::server {

// Same code (absl and gRPC codes share their numbering) and message, and a status marked
// by WithFieldViolation carries a google.rpc.BadRequest in its details (a google.rpc.Status
// in the grpc-status-details-bin trailer) naming the field, its description the message.
// Every handler ends through this function.
grpc::Status ToGrpcStatus(const absl::Status& status);

// `status` marked as being about the request's field named `field` (a path, as the wire
// edge names it in messages). The edge marks what it names.
absl::Status WithFieldViolation(absl::Status status, absl::string_view field);
// The field a status is marked with; empty when none.
std::string FieldViolationOf(const absl::Status& status);

// The reverse, for the daemon's calls to itself (the RPC warm-up).
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_STATUS_H_
