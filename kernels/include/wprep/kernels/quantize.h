// Quantization of bf16/fp16/fp32 weights to MXFP4 (canonical values + e8m0 scales), per
// docs/LAYOUTS.md "Quantization to MXFP4". Planning validates everything before any byte is
// touched, so a bad request never produces partial output.
#ifndef WPREP_KERNELS_QUANTIZE_H_
#define WPREP_KERNELS_QUANTIZE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/kernels/cuda_engine.h"

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

// Fused quantize-and-lay-out for Blackwell (blackwell_value + blackwell_scale), on the CPU:
// a weight stored [..., N, K] quantizes along K into the checkpoint-order MXFP4 of the
// matmul's logical [..., K, N] (packing axis -2), and each output byte is written straight
// from its quantized group; no canonical copy is made. Byte-equal to QuantizeOnCpu followed
// by the blackwell_value swizzle (packing -2) and the blackwell_scale swizzle of the
// transposed scale view [..., K/32, N]. Needs rank >= 2 and an even K.
struct FusedBlackwellSizes {
  int64_t values_bytes = 0;  // [..., N, rup(K/2, 128)]
  int64_t scales_bytes = 0;  // per matrix rup(ceil(K/32), 8) * rup(N, 128)
};
absl::StatusOr<FusedBlackwellSizes> PlanQuantizeBlackwell(const QuantizePlan& plan);
absl::Status QuantizeBlackwellOnCpu(const QuantizePlan& plan, const uint8_t* in, size_t in_size,
                                    uint8_t* values, size_t values_size, uint8_t* scales,
                                    size_t scales_size);

// The same on the GPU: `in`, `values` and `scales` are device pointers on one GPU; one kernel
// launch on `stream`, no allocation, no synchronization; byte-equal to QuantizeOnCpu.
// Unimplemented in a build without CUDA.
absl::Status QuantizeOnCuda(const QuantizePlan& plan, const void* in, void* values, void* scales,
                            CudaStream stream);

// The fused Blackwell pair on the GPU (two launches on `stream`: values, then scales; no
// canonical buffer). Byte-equal to QuantizeBlackwellOnCpu.
absl::Status QuantizeBlackwellOnCuda(const QuantizePlan& plan, const void* in, void* values,
                                     void* scales, CudaStream stream);

// For tools and tests: host buffers in and out through device buffers of GPU `device`
// (allocated, freed, synchronized). Sizes must match the plan exactly.
absl::Status QuantizeHostBuffersOnCuda(const QuantizePlan& plan, const uint8_t* in,
                                       size_t in_size, uint8_t* values, size_t values_size,
                                       uint8_t* scales, size_t scales_size, int device);

}  // namespace wprep

#endif  // WPREP_KERNELS_QUANTIZE_H_
