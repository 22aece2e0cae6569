// The closed set of conversions wprep performs (see LAYOUTS.md): which layout, which
// direction and the layout's parameters. Plain values; no validation happens here
// (MakePlan in plan.h validates).
#ifndef WPREP_SPEC_SPEC_H_
#define WPREP_SPEC_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace wprep {

enum class Layout : int32_t {
  kHopperValue = 0,             // "hopper_value"
  kBlackwellShuffledValue = 1,  // "blackwell_shuffled_value"
};

enum class Direction : int32_t {
  kSwizzle = 0,    // canonical -> storage
  kUnswizzle = 1,  // storage -> canonical
  kRetile = 2,     // storage (one Blackwell tiling) -> storage (another); Blackwell only
};

// Parameters of the Hopper value layout. mx_axis in {-1, -2}, mma_version in {2, 3}.
struct HopperValueParams {
  int32_t mx_axis = -2;
  int32_t mma_version = 3;
};

// Parameters of the Blackwell shuffled value layout, in FP4 values. block_k even.
struct BlackwellParams {
  int64_t block_k = 128;
  int64_t block_n = 256;
};

// One conversion. `blackwell` is the input tiling for unswizzle/retile and the output
// tiling for swizzle; `blackwell_to` is the output tiling of a retile.
struct ConversionSpec {
  Layout layout = Layout::kHopperValue;
  Direction direction = Direction::kSwizzle;
  HopperValueParams hopper;
  BlackwellParams blackwell;
  BlackwellParams blackwell_to;
};

// Names as used by the CLI, the RPC API and the reference vectors.
std::string_view LayoutName(Layout layout);
std::string_view DirectionName(Direction direction);
absl::StatusOr<Layout> ParseLayout(std::string_view name);
absl::StatusOr<Direction> ParseDirection(std::string_view name);

// One spec for each kernel the engines dispatch to (every Hopper mx_axis/mma/direction,
// and each Blackwell direction with a common tiling and with a tile_k that is not a
// multiple of 16, which takes the per-byte path). Warming these loads every kernel.
std::vector<ConversionSpec> KernelVariantSpecs();

// A one-line human-readable description, e.g. "hopper_value swizzle mx_axis=-2 mma=3".
std::string Describe(const ConversionSpec& spec);

}  // namespace wprep

#endif  // WPREP_SPEC_SPEC_H_
