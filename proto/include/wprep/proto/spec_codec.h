// The one translation between the spec types (wprep/spec/spec.h) and their wprep.v1
// messages, used by the daemon's edge and by the client library alike.
#ifndef WPREP_PROTO_SPEC_CODEC_H_
#define WPREP_PROTO_SPEC_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "wprep/kernels/moe.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep {

// Every parameter set explicitly, so the daemon never applies a default the caller did
// not see.
wprep::v1::ConversionSpec SpecToProto(const ConversionSpec& spec);

// InvalidArgument naming the field, prefixed by `field` ("spec", "header.spec"), for an
// unset or unknown enum; unset parameters take the spec's defaults.
absl::StatusOr<ConversionSpec> SpecFromProto(const wprep::v1::ConversionSpec& spec,
                                             absl::string_view field);

// The upstream layout object `spec` produces (or consumes), with the contract version.
wprep::v1::LayoutIdentity IdentityToProto(const ConversionSpec& spec);

// MoE operand dtypes. FromProto: InvalidArgument for an unset or unknown value, with a
// message the caller prefixes with the field (the daemon) or rewrites (a client reading
// an answer).
wprep::v1::MoeDType MoeDTypeToProto(MoeDType d);
absl::StatusOr<MoeDType> MoeDTypeFromProto(wprep::v1::MoeDType d);

std::vector<int64_t> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& shape);

}  // namespace wprep

#endif  // WPREP_PROTO_SPEC_CODEC_H_
