// Quantization of bf16/fp16/fp32 weights to MXFP4 (canonical values + e8m0 scales), per
// docs/LAYOUTS.md "Quantization to MXFP4". Planning validates everything before any byte is
// touched, so a bad request never produces partial output.
#ifndef WPREP_KERNELS_QUANTIZE_H_
#define WPREP_KERNELS_QUANTIZE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/moe.h"
#include "wprep/spec/spec.h"

namespace wprep {

enum class QuantDtype { kBfloat16, kFloat16, kFloat32 };
enum class ScaleRounding { kUp, kDown };

// Parses "bfloat16"/"float16"/"float32" and "up"/"down"; INVALID_ARGUMENT names the operand.
absl::StatusOr<QuantDtype> ParseQuantDtype(const std::string& name);
absl::StatusOr<ScaleRounding> ParseScaleRounding(const std::string& name);
int QuantDtypeBytes(QuantDtype dtype);

struct QuantizePlan {
  QuantDtype dtype = QuantDtype::kBfloat16;
  ScaleRounding rounding = ScaleRounding::kUp;
  std::vector<int64_t> input_shape;   // [..., Q]
  std::vector<int64_t> values_shape;  // [..., ceil(Q/2)]
  std::vector<int64_t> scales_shape;  // [..., ceil(Q/32)]
  int64_t rows = 0;                   // product of the leading dims
  int64_t q = 0;                      // last dim
  int64_t input_bytes = 0;
  int64_t values_bytes = 0;
  int64_t scales_bytes = 0;
};

// Validates shape (rank >= 1, dims >= 0) and 64-bit sizes (checked products).
absl::StatusOr<QuantizePlan> MakeQuantizePlan(QuantDtype dtype, absl::Span<const int64_t> shape,
                                              ScaleRounding rounding = ScaleRounding::kUp);

// Quantizes `in` (plan.input_bytes, row-major, little-endian) into canonical values and
// scales, each written in full. Buffer sizes must match the plan exactly.
absl::Status QuantizeOnCpu(const QuantizePlan& plan, const uint8_t* in, size_t in_size,
                           uint8_t* values, size_t values_size, uint8_t* scales,
                           size_t scales_size);

// The same on the GPU: `in`, `values` and `scales` are device pointers on one GPU; one kernel
// launch on `stream`, no allocation, no synchronization; byte-equal to QuantizeOnCpu.
// Unimplemented in a build without CUDA.
absl::Status QuantizeOnCuda(const QuantizePlan& plan, const void* in, void* values, void* scales,
                            CudaStream stream);

// Where quantized values and scales go: canonical storage, or one of the fused pairs of a
// weight stored [..., N, K] (quantized along K into the checkpoint-order MXFP4 of the
// matmul's logical [..., K, N]).
enum class QuantLayout {
  kCanonical,  // values [..., ceil(Q/2)], scales [..., ceil(Q/32)]
  // blackwell_value of the logical [..., K, N] from packing -2 (the quantized rows padded to
  // rup(K/2, 128) bytes: [..., N, Kpad]) and blackwell_scale of its scales [..., ceil(K/32), N].
  kBlackwell,
  // blackwell_shuffled_value(block_k, block_n) of the logical [..., K, N] from packing -2 and
  // blackwell_scale of its scales: byte-equal to QuantizeOnCpu followed by those two swizzles.
  kBlackwellShuffled,
  // hopper_value(mx_axis=-2, mma_version) of the logical [..., K, N] from packing -2, and
  // hopper_scale(mx_axis=-2, num_warps, align_k) of its scales [..., ceil(K/32), N]:
  // byte-equal to QuantizeOnCpu followed by those two swizzles.
  kHopper,
  // The trtllm-gen MXFP4 preparation of expert weights [E, R, K] (K a multiple of 32):
  // values and scales (and an optional bias) exactly as quantize, then prepare_w13 (R = 2*I,
  // the gated w1/w3 rows) or prepare_w2 of docs/TRTLLM_GEN.md with `align`.
  kTrtllmW13,
  kTrtllmW2,
};

struct QuantLayoutSpec {
  QuantLayout layout = QuantLayout::kCanonical;
  // kHopper only: mma_version 2 or 3; num_warps a power of two in [1, 32]; align_k a power
  // of two in [2, 64] (the scale groups zero-padded to a multiple of it first).
  int mma_version = 3;
  int num_warps = 8;
  int align_k = 2;
  // kTrtllmW13 / kTrtllmW2 only: the load-time padding of H and I, a positive multiple of 128.
  int64_t align = 256;
  // kBlackwellShuffled only: block_k even in [2, 4096], block_n in [1, 4096] (FP4 values).
  int block_k = 128;
  int block_n = 256;
};

struct QuantOutputSizes {
  int64_t values_bytes = 0;
  int64_t scales_bytes = 0;
  // The outputs as they are reported (one-byte elements; strides in elements): canonical
  // [..., ceil(Q/2)] and [..., ceil(Q/32)]; blackwell_value [..., N, Kpad] and the Blackwell
  // pairs' scales [matrices, bytes of one]; the shuffled values, and both Hopper outputs, as
  // the equivalent swizzle reports them (QuantLayoutConversion); the trtllm layouts [E, rows,
  // kp/2] and [E, rows, kp/32], and their bias [E, rows] float32, prepared beside them when
  // given (QuantBias). Dense but for the Hopper views (transposed) and the shuffled values'
  // reported strides (docs/LAYOUTS.md).
  std::vector<int64_t> values_shape, scales_shape, bias_shape;
  std::vector<int64_t> values_strides, scales_strides;
  int64_t bias_bytes = 0;
  // The prepare plan the trtllm outputs equal (its identity, e.g. "trtllm_gen:prepare_w13
  // format=mxfp4 align=256 contract=1"); unset for the other layouts.
  std::optional<MoePlan> moe_plan;
};

// The optional bias [E, R] of a trtllm layout (float32, or bfloat16 widened to float32),
// prepared into [E, rows] float32 as prepare_w13 / prepare_w2 prepare it. Both pointers set,
// or neither.
struct QuantBias {
  const void* in = nullptr;
  bool bfloat16 = false;
  void* out = nullptr;
};

// The conversion a fused Hopper or Blackwell output equals (kHopper, kBlackwell,
// kBlackwellShuffled): the swizzle of the logical [..., K, N] from packing -2 (values) or of
// its scales [..., ceil(K/32), N]. Its identity names the output's layout.
ConversionSpec QuantLayoutConversion(const QuantLayoutSpec& spec, bool values);

// The byte sizes `spec` writes for `plan`; INVALID_ARGUMENT for a shape or parameter the
// layout cannot take (the fused pairs need rank >= 2 and an even K, the Blackwell ones N and
// K/2 below 2^31; the trtllm layouts rank 3, K a multiple of 32 and, for w13, an even R).
absl::StatusOr<QuantOutputSizes> PlanQuantizeLayout(const QuantizePlan& plan, const QuantLayoutSpec& spec);

// Quantizes into `spec`'s layout on the CPU. The fused layouts write each output byte from
// its group quantized on the fly (no canonical copy of the tensor); buffer sizes must be
// PlanQuantizeLayout's.
absl::Status QuantizeLayoutOnCpu(const QuantizePlan& plan, const QuantLayoutSpec& spec, const uint8_t* in,
                                 size_t in_size, uint8_t* values, size_t values_size, uint8_t* scales,
                                 size_t scales_size, const QuantBias& bias = {});

// The same on the GPU (device pointers on one GPU; launches on `stream`, no allocation, no
// synchronization). The Hopper pair and the trtllm values + scales are one launch each: a
// block quantizes a tile into shared memory and writes both outputs from it; the Blackwell
// pairs write each group's value word and scale byte in place, the padding in a second
// launch. Unimplemented in a build without CUDA.
absl::Status QuantizeLayoutOnCuda(const QuantizePlan& plan, const QuantLayoutSpec& spec, const void* in,
                                  void* values, void* scales, CudaStream stream, const QuantBias& bias = {});

// For tools and tests: host buffers in and out through device buffers of GPU `device`
// (allocated, freed, synchronized), in `spec`'s layout. Sizes must be PlanQuantizeLayout's;
// `bias` (host pointers here: [E, R] in, PlanQuantizeLayout's bias_bytes out) as for
// QuantizeLayoutOnCuda.
absl::Status QuantizeHostBuffersOnCuda(const QuantizePlan& plan, const uint8_t* in,
                                       size_t in_size, uint8_t* values, size_t values_size,
                                       uint8_t* scales, size_t scales_size, int device,
                                       const QuantLayoutSpec& spec = {}, const QuantBias& bias = {});

}  // namespace wprep

#endif  // WPREP_KERNELS_QUANTIZE_H_
