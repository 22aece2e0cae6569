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

// Version of the byte-level contract the layouts below implement (LAYOUTS.md and the
// reference vectors in tests/data). It changes whenever any layout's bytes, shapes or
// reported strides change, so a client can tell whether stored outputs are still valid.
inline constexpr int32_t kLayoutContractVersion = 1;

enum class Layout : int32_t {
  kHopperValue = 0,             // "hopper_value": FP4 values for Hopper's MX matmul
  kBlackwellShuffledValue = 1,  // "blackwell_shuffled_value": FP4 values in TMA tiles
  kBlackwellValue = 2,          // "blackwell_value": FP4 values packed along K, K padded
  kHopperScale = 3,             // "hopper_scale": e8m0 scales for Hopper's MX matmul
  kBlackwellScale = 4,          // "blackwell_scale": e8m0 scales for Blackwell's MX matmul
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

// Parameters of the Hopper scale layout. mx_axis in {-1, -2}: the axis of the scale
// tensor [..., M, K] that walks the matmul's reduction axis; num_warps a power of two in
// [1, 32]. The defaults are what model loaders use for matmul weights (triton_kernels'
// make_default_matmul_mxfp4_w_scale_layout with the weight [E, K, N]: mx axis -2, 8 warps).
// align_k, a power of two in [2, 64]: the scale groups along the mx axis are zero-padded
// to a multiple of it before the layout. 2 is the layout's own padding; 4 is what vLLM
// passes on sm_90, where the matmul reads 4 groups per 128-wide K tile (gpt-oss's 90
// groups become 92).
struct HopperScaleParams {
  int32_t mx_axis = -2;
  int32_t num_warps = 8;
  int32_t align_k = 2;
};

// One conversion. `blackwell` is the input tiling for unswizzle/retile and the output
// tiling for swizzle; `blackwell_to` is the output tiling of a retile. Only the
// parameters of `layout` are read.
//
// `packing_axis` is how the canonical side of a value layout (the input of a swizzle, the
// output of an unswizzle) packs the logical tensor [..., D0, D1]: -1 (canonical storage
// [..., D0, D1/2], pairs along D1) or -2 (checkpoint order [..., D1, D0/2], pairs along
// D0). Scale layouts and retile have no packed canonical side: they take only -1.
struct ConversionSpec {
  Layout layout = Layout::kHopperValue;
  Direction direction = Direction::kSwizzle;
  HopperValueParams hopper;
  BlackwellParams blackwell;
  BlackwellParams blackwell_to;
  HopperScaleParams hopper_scale;
  int32_t packing_axis = -1;
};

// Names as used by the CLI, the RPC API and the reference vectors.
std::string_view LayoutName(Layout layout);
std::string_view DirectionName(Direction direction);
absl::StatusOr<Layout> ParseLayout(std::string_view name);
absl::StatusOr<Direction> ParseDirection(std::string_view name);

// Every layout, in enum order.
std::vector<Layout> AllLayouts();

// True for the layouts of FP4 values (they have a packing axis); false for scales.
bool IsValueLayout(Layout layout);

// One spec for each kernel the engines dispatch to, at the dense inputs and the shape
// [2, 256, 256] the daemon warms them with, plus each layout, direction and packing axis
// at least once (so each gets its metrics series and its start-up check against the CPU
// engine). Hopper values: every mx_axis/mma/direction; Blackwell shuffled: each direction
// with a common tiling and with a tile_k that is not a multiple of 16 (the per-byte
// tiles); packing -2 of each value layout; Hopper scales: both mx axes each way, and
// num_warps 16 for the mx_axis -2 unswizzle (at that shape its output is not the
// transposed view, which takes the column tile); Blackwell scales each way.
std::vector<ConversionSpec> KernelVariantSpecs();

// A one-line human-readable description, e.g. "hopper_value swizzle mx_axis=-2 mma=3".
std::string Describe(const ConversionSpec& spec);

// The upstream triton_kernels layout object (Python's repr of it) that the storage side
// of `spec` equals byte for byte under kLayoutContractVersion: the output of a swizzle or
// a retile (for retile, `blackwell_to`'s tiling), the input an unswizzle consumes. The
// other side is not a layout object: it is the canonical tensor in the order
// `spec.packing_axis` names (values) or the plain scale tensor (scales). Examples:
//   "HopperMXValueLayout(mx_axis=-2, mma_version=3)"
//   "BlackwellMX4ValueShuffledLayout(block_k=128, block_n=256)"
//   "BlackwellMXValueLayout()"
//   "HopperMXScaleLayout(mx_axis=-2, num_warps=8)"
//   "BlackwellMXScaleLayout()"
// A Hopper scale align_k above 2 is not part of the layout object: its bytes are the
// layout's of the scale tensor with zero groups appended, which ConversionIdentity names.
// Parameters are printed as given; the spec is not validated (MakePlan does that).
std::string LayoutIdentity(const ConversionSpec& spec);

// The whole conversion in one line, both sides named: the identity above and the
// canonical side, e.g. "canonical(packing_axis=-2) -> HopperMXValueLayout(mx_axis=-2,
// mma_version=3)" for a swizzle, "BlackwellMXScaleLayout() -> scales" for an unswizzle,
// "BlackwellMX4ValueShuffledLayout(...) -> BlackwellMX4ValueShuffledLayout(...)" for a
// retile. The plain scale side reads "scales", or "scales(align_k=4)" when the groups are
// padded beyond the layout's own 2.
std::string ConversionIdentity(const ConversionSpec& spec);

}  // namespace wprep

#endif  // WPREP_SPEC_SPEC_H_
