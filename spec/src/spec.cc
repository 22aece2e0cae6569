#include "wprep/spec/spec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace wprep {

std::string_view LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kHopperValue:
      return "hopper_value";
    case Layout::kBlackwellShuffledValue:
      return "blackwell_shuffled_value";
    case Layout::kBlackwellValue:
      return "blackwell_value";
    case Layout::kHopperScale:
      return "hopper_scale";
    case Layout::kBlackwellScale:
      return "blackwell_scale";
  }
  return "unknown_layout";
}

std::string_view DirectionName(Direction direction) {
  switch (direction) {
    case Direction::kSwizzle:
      return "swizzle";
    case Direction::kUnswizzle:
      return "unswizzle";
    case Direction::kRetile:
      return "retile";
  }
  return "unknown_direction";
}

std::vector<Layout> AllLayouts() {
  return {Layout::kHopperValue, Layout::kBlackwellShuffledValue, Layout::kBlackwellValue,
          Layout::kHopperScale, Layout::kBlackwellScale};
}

bool IsValueLayout(Layout layout) {
  return layout == Layout::kHopperValue || layout == Layout::kBlackwellShuffledValue ||
         layout == Layout::kBlackwellValue;
}

absl::StatusOr<Layout> ParseLayout(std::string_view name) {
  std::vector<std::string> names;
  for (Layout l : AllLayouts()) {
    if (name == LayoutName(l)) return l;
    names.emplace_back(LayoutName(l));
  }
  return absl::InvalidArgumentError("unknown layout '" + std::string(name) +
                                    "'; expected one of " + absl::StrJoin(names, ", "));
}

absl::StatusOr<Direction> ParseDirection(std::string_view name) {
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle, Direction::kRetile}) {
    if (name == DirectionName(d)) return d;
  }
  return absl::InvalidArgumentError("unknown direction '" + std::string(name) +
                                    "'; expected swizzle, unswizzle or retile");
}

std::vector<ConversionSpec> KernelVariantSpecs() {
  std::vector<ConversionSpec> specs;
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
    for (int32_t mx : {-1, -2}) {
      for (int32_t mma : {2, 3}) {
        ConversionSpec s;
        s.layout = Layout::kHopperValue;
        s.direction = d;
        s.hopper = {mx, mma};
        specs.push_back(s);
      }
    }
  }
  // block_k 6 gives tile_k 3: the per-byte tiles.
  for (BlackwellParams tiling : {BlackwellParams{128, 256}, BlackwellParams{6, 10}}) {
    for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle, Direction::kRetile}) {
      ConversionSpec s;
      s.layout = Layout::kBlackwellShuffledValue;
      s.direction = d;
      s.blackwell = tiling;
      s.blackwell_to = {256, 128};
      specs.push_back(s);
    }
  }
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
    for (int32_t packing : {-1, -2}) {
      ConversionSpec v;
      v.layout = Layout::kBlackwellValue;
      v.direction = d;
      v.packing_axis = packing;
      specs.push_back(v);
    }
    // Packing -2 of the other value layouts reuses their kernels on other geometries;
    // one spec each still checks them at start-up.
    ConversionSpec h;
    h.layout = Layout::kHopperValue;
    h.direction = d;
    h.packing_axis = -2;
    specs.push_back(h);
    ConversionSpec b;
    b.layout = Layout::kBlackwellShuffledValue;
    b.direction = d;
    b.packing_axis = -2;
    specs.push_back(b);
  }
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
    for (int32_t mx : {-1, -2}) {
      ConversionSpec s;
      s.layout = Layout::kHopperScale;
      s.direction = d;
      s.hopper_scale = {mx, 8, 2};
      specs.push_back(s);
    }
    ConversionSpec b;
    b.layout = Layout::kBlackwellScale;
    b.direction = d;
    specs.push_back(b);
  }
  ConversionSpec columns;
  columns.layout = Layout::kHopperScale;
  columns.direction = Direction::kUnswizzle;
  columns.hopper_scale = {-2, 16, 2};
  specs.push_back(columns);
  return specs;
}

std::string Describe(const ConversionSpec& spec) {
  std::string out = std::string(LayoutName(spec.layout)) + " " +
                    std::string(DirectionName(spec.direction));
  switch (spec.layout) {
    case Layout::kHopperValue:
      absl::StrAppendFormat(&out, " mx_axis=%d mma=%d", spec.hopper.mx_axis,
                            spec.hopper.mma_version);
      break;
    case Layout::kBlackwellShuffledValue:
      absl::StrAppendFormat(&out, " block=%dx%d", spec.blackwell.block_k, spec.blackwell.block_n);
      if (spec.direction == Direction::kRetile) {
        absl::StrAppendFormat(&out, " -> %dx%d", spec.blackwell_to.block_k,
                              spec.blackwell_to.block_n);
      }
      break;
    case Layout::kHopperScale:
      absl::StrAppendFormat(&out, " mx_axis=%d num_warps=%d", spec.hopper_scale.mx_axis,
                            spec.hopper_scale.num_warps);
      if (spec.hopper_scale.align_k != 2) {
        absl::StrAppendFormat(&out, " align_k=%d", spec.hopper_scale.align_k);
      }
      break;
    case Layout::kBlackwellValue:
    case Layout::kBlackwellScale:
      break;
  }
  if (spec.packing_axis != -1) absl::StrAppendFormat(&out, " packing_axis=%d", spec.packing_axis);
  return out;
}

namespace {

std::string ShuffledIdentity(const BlackwellParams& p) {
  return absl::StrFormat("BlackwellMX4ValueShuffledLayout(block_k=%d, block_n=%d)", p.block_k,
                         p.block_n);
}

// The plain side of a scale layout: the scale tensor, with the zero groups a Hopper
// align_k above the layout's own 2 appends along the mx axis.
std::string ScaleSide(const ConversionSpec& spec) {
  if (spec.layout == Layout::kHopperScale && spec.hopper_scale.align_k != 2) {
    return absl::StrFormat("scales(align_k=%d)", spec.hopper_scale.align_k);
  }
  return "scales";
}

}  // namespace

std::string LayoutIdentity(const ConversionSpec& spec) {
  switch (spec.layout) {
    case Layout::kHopperValue:
      return absl::StrFormat("HopperMXValueLayout(mx_axis=%d, mma_version=%d)",
                             spec.hopper.mx_axis, spec.hopper.mma_version);
    case Layout::kBlackwellShuffledValue:
      return ShuffledIdentity(spec.direction == Direction::kRetile ? spec.blackwell_to
                                                                   : spec.blackwell);
    case Layout::kBlackwellValue:
      return "BlackwellMXValueLayout()";
    case Layout::kHopperScale:
      return absl::StrFormat("HopperMXScaleLayout(mx_axis=%d, num_warps=%d)",
                             spec.hopper_scale.mx_axis, spec.hopper_scale.num_warps);
    case Layout::kBlackwellScale:
      return "BlackwellMXScaleLayout()";
  }
  return "unknown_layout";
}

std::string ConversionIdentity(const ConversionSpec& spec) {
  const std::string storage = LayoutIdentity(spec);
  if (spec.direction == Direction::kRetile) {
    ConversionSpec from = spec;
    from.direction = Direction::kUnswizzle;
    return absl::StrCat(LayoutIdentity(from), " -> ", storage);
  }
  const std::string plain =
      IsValueLayout(spec.layout)
          ? absl::StrFormat("canonical(packing_axis=%d)", spec.packing_axis)
          : ScaleSide(spec);
  return spec.direction == Direction::kSwizzle ? absl::StrCat(plain, " -> ", storage)
                                               : absl::StrCat(storage, " -> ", plain);
}

}  // namespace wprep
