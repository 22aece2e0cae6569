#include "rpc/status.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace wprep::server {

namespace {
constexpr char kFieldPayload[] = "wprep.field_violation";
}  // namespace

absl::Status WithFieldViolation(absl::Status status, absl::string_view field) {
  if (!status.ok() && !field.empty()) status.SetPayload(kFieldPayload, absl::Cord(field));
  return status;
}

std::string FieldViolationOf(const absl::Status& status) {
  auto field = status.GetPayload(kFieldPayload);
  return field ? std::string(*field) : std::string();
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // absl has no code outside gRPC's 0..16; anything else would be a bug upstream.
  const grpc::StatusCode grpc_code =
      (code >= 0 && code <= 16) ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  const std::string field = FieldViolationOf(status);
  if (field.empty()) return grpc::Status(grpc_code, std::string(status.message()));
  google::rpc::BadRequest bad;
  google::rpc::BadRequest::FieldViolation* v = bad.add_field_violations();
  v->set_field(field);
  v->set_description(std::string(status.message()));
  google::rpc::Status details;
  details.set_code(code);
  details.set_message(std::string(status.message()));
  details.add_details()->PackFrom(bad);
  return grpc::Status(grpc_code, std::string(status.message()), details.SerializeAsString());
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace wprep::server
