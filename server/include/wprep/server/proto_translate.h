// The server's edge: protobuf messages of wprep.v1 -> kernel-level types, with
// InvalidArgument naming the offending field.
#ifndef WPREP_SERVER_PROTO_TRANSLATE_H_
#define WPREP_SERVER_PROTO_TRANSLATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "wprep/kernels/plan.h"
#include "wprep/server/executor.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// `field` prefixes messages ("spec", "header.spec").
absl::StatusOr<ConversionSpec> SpecFromProto(const wprep::v1::ConversionSpec& spec,
                                             absl::string_view field);
std::vector<int64_t> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& shape);
absl::StatusOr<IpcBufferRef> IpcFromProto(const wprep::v1::CudaIpcBuffer& buffer,
                                          absl::string_view field);
void PlanToProto(const Plan& plan, wprep::v1::PlanResponse* out);

}  // namespace wprep::server

#endif  // WPREP_SERVER_PROTO_TRANSLATE_H_
