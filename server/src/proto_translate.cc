#include "wprep/server/proto_translate.h"

#include "absl/strings/str_cat.h"
#include "wprep/server/ipc_cache.h"

namespace wprep::server {

absl::StatusOr<ConversionSpec> SpecFromProto(const wprep::v1::ConversionSpec& p,
                                             absl::string_view field) {
  ConversionSpec s;
  switch (p.layout()) {
    case wprep::v1::LAYOUT_HOPPER_VALUE: s.layout = Layout::kHopperValue; break;
    case wprep::v1::LAYOUT_BLACKWELL_SHUFFLED_VALUE: s.layout = Layout::kBlackwellShuffledValue; break;
    case wprep::v1::LAYOUT_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layout is not set; use LAYOUT_HOPPER_VALUE or LAYOUT_BLACKWELL_SHUFFLED_VALUE"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layout has unknown value ", static_cast<int>(p.layout()),
          "; use LAYOUT_HOPPER_VALUE (1) or LAYOUT_BLACKWELL_SHUFFLED_VALUE (2)"));
  }
  switch (p.direction()) {
    case wprep::v1::DIRECTION_SWIZZLE: s.direction = Direction::kSwizzle; break;
    case wprep::v1::DIRECTION_UNSWIZZLE: s.direction = Direction::kUnswizzle; break;
    case wprep::v1::DIRECTION_RETILE: s.direction = Direction::kRetile; break;
    case wprep::v1::DIRECTION_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".direction is not set; use DIRECTION_SWIZZLE, DIRECTION_UNSWIZZLE or DIRECTION_RETILE"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".direction has unknown value ", static_cast<int>(p.direction()),
          "; use DIRECTION_SWIZZLE (1), DIRECTION_UNSWIZZLE (2) or DIRECTION_RETILE (3)"));
  }
  if (p.hopper().has_mx_axis()) s.hopper.mx_axis = p.hopper().mx_axis();
  if (p.hopper().has_mma_version()) s.hopper.mma_version = p.hopper().mma_version();
  if (p.blackwell().has_block_k()) s.blackwell.block_k = p.blackwell().block_k();
  if (p.blackwell().has_block_n()) s.blackwell.block_n = p.blackwell().block_n();
  if (p.blackwell_to().has_block_k()) s.blackwell_to.block_k = p.blackwell_to().block_k();
  if (p.blackwell_to().has_block_n()) s.blackwell_to.block_n = p.blackwell_to().block_n();
  return s;
}

std::vector<int64_t> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin(), shape.end());
}

absl::StatusOr<IpcBufferRef> IpcFromProto(const wprep::v1::CudaIpcBuffer& b, absl::string_view field) {
  IpcBufferRef r;
  r.field = std::string(field);
  if (absl::Status s = IpcCache::CheckHandleSize(b.handle(), field); !s.ok()) return s;
  absl::StatusOr<Uuid> u = UuidFromBytes(b.device_uuid(), absl::StrCat(field, ".device_uuid"));
  if (!u.ok()) return u.status();
  r.handle = b.handle();
  r.offset = b.offset();
  r.size = b.size();
  r.uuid = *u;
  r.strides.assign(b.strides().begin(), b.strides().end());
  return r;
}

void PlanToProto(const Plan& plan, wprep::v1::PlanResponse* out) {
  for (int64_t d : plan.input_shape) out->add_input_shape(d);
  for (int64_t d : plan.input_strides) out->add_input_strides(d);
  out->set_input_bytes(plan.input_bytes);
  for (int64_t d : plan.output_shape) out->add_output_shape(d);
  for (int64_t d : plan.output_strides) out->add_output_strides(d);
  out->set_output_bytes(plan.output_bytes);
  out->set_description(Describe(plan.spec));
}

}  // namespace wprep::server
