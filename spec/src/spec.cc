#include "wprep/spec/spec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wprep {

std::string_view LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kHopperValue:
      return "hopper_value";
    case Layout::kBlackwellShuffledValue:
      return "blackwell_shuffled_value";
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

absl::StatusOr<Layout> ParseLayout(std::string_view name) {
  for (Layout l : {Layout::kHopperValue, Layout::kBlackwellShuffledValue}) {
    if (name == LayoutName(l)) return l;
  }
  return absl::InvalidArgumentError("unknown layout '" + std::string(name) +
                                    "'; expected hopper_value or blackwell_shuffled_value");
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
  return specs;
}

std::string Describe(const ConversionSpec& spec) {
  std::string out = std::string(LayoutName(spec.layout)) + " " +
                    std::string(DirectionName(spec.direction));
  if (spec.layout == Layout::kHopperValue) {
    absl::StrAppendFormat(&out, " mx_axis=%d mma=%d", spec.hopper.mx_axis,
                          spec.hopper.mma_version);
  } else {
    absl::StrAppendFormat(&out, " block=%dx%d", spec.blackwell.block_k, spec.blackwell.block_n);
    if (spec.direction == Direction::kRetile) {
      absl::StrAppendFormat(&out, " -> %dx%d", spec.blackwell_to.block_k,
                            spec.blackwell_to.block_n);
    }
  }
  return out;
}

}  // namespace wprep
