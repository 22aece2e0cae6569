// trtllm-gen MoE weight preparation (FlashInfer's Blackwell fused-MoE path): the single
// steps and the prepare_w13 / prepare_w2 compositions of docs/TRTLLM_GEN.md, for MXFP4,
// NVFP4, MXFP8, FP8, block FP8 and BF16 experts. Every op moves whole elements (bytes,
// 16- or 32-bit words) or writes zeros; only fp8_block's scale clamp looks at a value.
//
// Usage: PlanMoe validates everything before any memory is touched (CUTLASS's
// can_implement) and fixes every input's and output's shape and size; RunMoeCpu or
// RunMoeCuda then writes each output tensor in one pass. No CUDA types in this header.
#ifndef WPREP_KERNELS_MOE_H_
#define WPREP_KERNELS_MOE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wprep {

// The version of the byte contract (docs/TRTLLM_GEN.md) the engine implements; it ends
// every MoePlan::identity.
inline constexpr int kMoeContractVersion = 1;

// The ops of the reference's run_op, spelled as it spells them (MoeOpName).
enum class MoeOp {
  kSwapPairs,             // "swap_pairs" {axis}
  kGatedActReorder,       // "gated_act_reorder" {}
  kRowShuffle,            // "row_shuffle" {epilogue_tile_m}
  kScaleRowShuffle,       // "scale_row_shuffle" {epilogue_tile_m, num_elts_per_sf}
  kBlockScaleInterleave,  // "block_scale_interleave" {}
  kShuffleSfA,            // "shuffle_sf_a" {epilogue_tile_m, num_elts_per_sf}
  kBiasShuffle,           // "bias_shuffle" {epilogue_tile_m}
  kSwapHalves,            // "swap_halves" {axis}
  kBlockLayout,           // "block_layout" {block_k}
  kPrepareW13,            // "prepare_w13" {format, ...} (see MoeParams)
  kPrepareW2,             // "prepare_w2" {format, ...}
};

// "row_shuffle" -> kRowShuffle; anything else is InvalidArgument naming the known ops.
absl::StatusOr<MoeOp> ParseMoeOp(std::string_view name);
std::string_view MoeOpName(MoeOp op);

// The weight format of prepare_w13 / prepare_w2 (contract sections 4 and 10).
enum class MoeFormat { kMxfp4, kNvfp4, kMxfp8, kFp8, kFp8Block, kBf16 };

// "mxfp4", "nvfp4", "mxfp8", "fp8", "fp8_block", "bf16".
absl::StatusOr<MoeFormat> ParseMoeFormat(std::string_view name);
std::string_view MoeFormatName(MoeFormat format);

// One bit per parameter: MoeParams::given records which ones the caller set, because
// the contract makes prepare_* of every format but mxfp4 take exactly its parameter set
// (section 10.1: none missing, none extra).
enum MoeParamBit : uint32_t {
  kMoeParamFormat = 1u << 0,
  kMoeParamGated = 1u << 1,
  kMoeParamAlign = 1u << 2,
  kMoeParamAlignH = 1u << 3,
  kMoeParamAlignI = 1u << 4,
  kMoeParamBlockK = 1u << 5,
  kMoeParamAxis = 1u << 6,
  kMoeParamEpilogueTileM = 1u << 7,
  kMoeParamNumEltsPerSf = 1u << 8,
};

// Every parameter of run_op. Defaults are the reference's where it has one (align 256,
// epilogue_tile_m 128, num_elts_per_sf 16, swap_halves' axis -2) and vLLM's value
// otherwise. Ranges are checked by PlanMoe, not here, so that a request's errors all
// come from one place.
struct MoeParams {
  MoeFormat format = MoeFormat::kMxfp4;
  bool gated = true;
  int64_t align = 256;    // mxfp4 prepare_*: a positive multiple of 128
  int64_t align_h = 256;  // nvfp4: H padded to a multiple of this
  int64_t align_i = 64;   // nvfp4, fp8, bf16: I padded to a multiple of this (1: none)
  int64_t block_k = 128;  // block_layout: elements of the input dtype per block
  int64_t axis = -2;      // swap_pairs, swap_halves: -2 (rows) or -1 (last dim)
  int64_t epilogue_tile_m = 128;
  int64_t num_elts_per_sf = 16;
  uint32_t given = 0;  // MoeParamBit of each parameter set through SetMoeParam
};

// Sets one parameter from its text form: booleans `true` / `false`, integers in decimal
// (an optional leading '-'), formats as ParseMoeFormat spells them. An unknown key or a
// malformed value is InvalidArgument naming the key.
absl::Status SetMoeParam(MoeParams& params, std::string_view key, std::string_view value);

enum class MoeDType { kUint8, kFloat32, kBfloat16 };

// "uint8", "float32", "bfloat16".
absl::StatusOr<MoeDType> ParseMoeDType(std::string_view name);
std::string_view MoeDTypeName(MoeDType dtype);
int MoeDTypeSize(MoeDType dtype);  // bytes per element: 1, 4, 2

// A dense, row-major tensor: `name` is the manifests' (`x` for a single step's input,
// `y` for its output; `values`, `scales`, `bias` for the compositions').
struct MoeTensorDesc {
  std::string name;
  MoeDType dtype = MoeDType::kUint8;
  std::vector<int64_t> shape;
};

// A validated request. Immutable; cheap enough to copy.
struct MoePlan {
  MoeOp op = MoeOp::kSwapPairs;
  MoeParams params;
  // Inputs in the order RunMoe* takes their buffers: `x`; or `values`, then `scales`
  // where the format has them, then `bias` where given (mxfp4 only). PlanMoe accepts
  // them in any order and reorders them so.
  std::vector<MoeTensorDesc> inputs;
  // Outputs in the order RunMoe* takes their buffers: `y`; or `values`, `scales`
  // (where the format has them), `bias` (mxfp4 with a bias input).
  std::vector<MoeTensorDesc> outputs;
  std::vector<std::vector<int64_t>> output_strides;  // elements, row-major (the manifests')
  std::vector<uint64_t> input_bytes;   // per input, dense
  std::vector<uint64_t> output_bytes;  // per output, every byte written (padding included)
  // What the outputs are, for callers to report: op, the parameters that shape the bytes
  // and the contract version, e.g.
  // "trtllm_gen:prepare_w13 format=mxfp4 align=256 contract=1".
  std::string identity;
};

// Validates op, params and input descriptions (names, dtypes, shapes; the contract's
// error rules, sections 5, 10.5 and 11) with checked 64-bit arithmetic, and derives the
// outputs. Errors are InvalidArgument naming the operand ("scales: ...").
absl::StatusOr<MoePlan> PlanMoe(MoeOp op, const MoeParams& params,
                                std::vector<MoeTensorDesc> inputs);

// Host buffers, one span per plan input / output in plan order, each exactly
// input_bytes[i] / output_bytes[i] long (InvalidArgument otherwise). Outputs must not
// overlap inputs. Writes every output byte once. `threads` <= 0: hardware concurrency
// (small requests run on the calling thread). Thread-safe.
absl::Status RunMoeCpu(const MoePlan& plan, absl::Span<const absl::Span<const uint8_t>> inputs,
                       absl::Span<const absl::Span<uint8_t>> outputs, int threads = 0);

// Device pointers on one GPU, one per plan input / output in plan order, sized as the
// plan says; `cuda_stream` is a cudaStream_t (nullptr: the legacy default stream). One
// grid-stride kernel launch per output tensor on that stream; allocates nothing and
// never synchronizes. Unimplemented in a build without CUDA.
absl::Status RunMoeCuda(const MoePlan& plan, absl::Span<const void* const> inputs,
                        absl::Span<void* const> outputs, void* cuda_stream);

}  // namespace wprep

#endif  // WPREP_KERNELS_MOE_H_
