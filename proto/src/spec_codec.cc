#include "wprep/proto/spec_codec.h"

#include "absl/strings/str_cat.h"

namespace wprep {
namespace {

constexpr char kLayouts[] =
    "LAYOUT_HOPPER_VALUE (1), LAYOUT_BLACKWELL_SHUFFLED_VALUE (2), LAYOUT_BLACKWELL_VALUE (3), "
    "LAYOUT_HOPPER_SCALE (4), LAYOUT_BLACKWELL_SCALE (5)";

}  // namespace


v1::ConversionSpec SpecToProto(const ConversionSpec& spec) {
  v1::ConversionSpec p;
  switch (spec.layout) {
    case Layout::kHopperValue: p.set_layout(v1::LAYOUT_HOPPER_VALUE); break;
    case Layout::kBlackwellShuffledValue: p.set_layout(v1::LAYOUT_BLACKWELL_SHUFFLED_VALUE); break;
    case Layout::kBlackwellValue: p.set_layout(v1::LAYOUT_BLACKWELL_VALUE); break;
    case Layout::kHopperScale: p.set_layout(v1::LAYOUT_HOPPER_SCALE); break;
    case Layout::kBlackwellScale: p.set_layout(v1::LAYOUT_BLACKWELL_SCALE); break;
  }
  switch (spec.direction) {
    case Direction::kSwizzle: p.set_direction(v1::DIRECTION_SWIZZLE); break;
    case Direction::kUnswizzle: p.set_direction(v1::DIRECTION_UNSWIZZLE); break;
    case Direction::kRetile: p.set_direction(v1::DIRECTION_RETILE); break;
  }
  p.mutable_hopper()->set_mx_axis(spec.hopper.mx_axis);
  p.mutable_hopper()->set_mma_version(spec.hopper.mma_version);
  p.mutable_blackwell()->set_block_k(spec.blackwell.block_k);
  p.mutable_blackwell()->set_block_n(spec.blackwell.block_n);
  p.mutable_blackwell_to()->set_block_k(spec.blackwell_to.block_k);
  p.mutable_blackwell_to()->set_block_n(spec.blackwell_to.block_n);
  p.mutable_hopper_scale()->set_mx_axis(spec.hopper_scale.mx_axis);
  p.mutable_hopper_scale()->set_num_warps(spec.hopper_scale.num_warps);
  p.mutable_hopper_scale()->set_align_k(spec.hopper_scale.align_k);
  p.set_packing_axis(spec.packing_axis);
  return p;
}

absl::StatusOr<ConversionSpec> SpecFromProto(const v1::ConversionSpec& p, absl::string_view field) {
  ConversionSpec s;
  switch (p.layout()) {
    case v1::LAYOUT_HOPPER_VALUE: s.layout = Layout::kHopperValue; break;
    case v1::LAYOUT_BLACKWELL_SHUFFLED_VALUE: s.layout = Layout::kBlackwellShuffledValue; break;
    case v1::LAYOUT_BLACKWELL_VALUE: s.layout = Layout::kBlackwellValue; break;
    case v1::LAYOUT_HOPPER_SCALE: s.layout = Layout::kHopperScale; break;
    case v1::LAYOUT_BLACKWELL_SCALE: s.layout = Layout::kBlackwellScale; break;
    case v1::LAYOUT_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(field, ".layout is not set; use one of ", kLayouts));
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ".layout has unknown value ",
                                                     static_cast<int>(p.layout()), "; use one of ", kLayouts));
  }
  switch (p.direction()) {
    case v1::DIRECTION_SWIZZLE: s.direction = Direction::kSwizzle; break;
    case v1::DIRECTION_UNSWIZZLE: s.direction = Direction::kUnswizzle; break;
    case v1::DIRECTION_RETILE: s.direction = Direction::kRetile; break;
    case v1::DIRECTION_UNSPECIFIED:
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
  if (p.hopper_scale().has_mx_axis()) s.hopper_scale.mx_axis = p.hopper_scale().mx_axis();
  if (p.hopper_scale().has_num_warps()) s.hopper_scale.num_warps = p.hopper_scale().num_warps();
  if (p.hopper_scale().has_align_k()) s.hopper_scale.align_k = p.hopper_scale().align_k();
  if (p.has_packing_axis()) s.packing_axis = p.packing_axis();
  return s;
}

v1::LayoutIdentity IdentityToProto(const ConversionSpec& spec) {
  v1::LayoutIdentity id;
  id.set_layout(LayoutIdentity(spec));
  id.set_conversion(ConversionIdentity(spec));
  id.set_contract_version(kLayoutContractVersion);
  return id;
}

std::vector<int64_t> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin(), shape.end());
}

wprep::v1::MoeDType MoeDTypeToProto(MoeDType d) {
  switch (d) {
    case MoeDType::kUint8:
      return wprep::v1::MOE_DTYPE_UINT8;
    case MoeDType::kFloat32:
      return wprep::v1::MOE_DTYPE_FLOAT32;
    case MoeDType::kBfloat16:
      return wprep::v1::MOE_DTYPE_BFLOAT16;
  }
  return wprep::v1::MOE_DTYPE_UNSPECIFIED;
}

absl::StatusOr<MoeDType> MoeDTypeFromProto(wprep::v1::MoeDType d) {
  switch (d) {
    case wprep::v1::MOE_DTYPE_UINT8:
      return MoeDType::kUint8;
    case wprep::v1::MOE_DTYPE_FLOAT32:
      return MoeDType::kFloat32;
    case wprep::v1::MOE_DTYPE_BFLOAT16:
      return MoeDType::kBfloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "must be MOE_DTYPE_UINT8, MOE_DTYPE_FLOAT32 or MOE_DTYPE_BFLOAT16, got ", static_cast<int>(d)));
  }
}

}  // namespace wprep
