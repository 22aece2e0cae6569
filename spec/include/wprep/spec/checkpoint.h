// The conversions of an MXFP4 checkpoint's tensor pair (gpt-oss's `*_blocks` and
// `*_scales`): how the stored bytes are read as the canonical input of a swizzle. Shared by
// the client library (convert-safetensors) and the daemon (resident weight sets).
#ifndef WPREP_SPEC_CHECKPOINT_H_
#define WPREP_SPEC_CHECKPOINT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/spec/spec.h"

namespace wprep {

// One conversion as a ConvertItem wants it: the spec, the logical shape and the byte
// strides of the input view (empty: dense).
struct TensorConversion {
  ConversionSpec spec;
  std::vector<int64_t> logical_shape;
  std::vector<int64_t> input_strides;
};

// The conversion of an MXFP4 checkpoint's values, `*_blocks` of storage shape
// [..., N, K/32, 16] (uint8): the packing -2 storage of the logical weight [..., K, N]
// (docs/LAYOUTS.md, "Checkpoint order"), read densely. `values` names the value layout and
// its parameters; its direction is set to swizzle and its packing axis to -2.
// InvalidArgument when the shape is not [..., N, G, 16] with rank >= 3, or `values` is
// not a value layout.
absl::StatusOr<TensorConversion> CheckpointValues(ConversionSpec values,
                                                  absl::Span<const int64_t> blocks_shape);

// The conversion of the matching `*_scales` of storage shape [..., N, K/32] (uint8 e8m0):
// read through the transposed view [..., K/32, N] with strides [..., 1, K/32], as loaders
// pass it. `scales` names the scale layout (hopper_scale, whose default mx_axis -2 is
// what matmul weights take, or blackwell_scale); direction swizzle, packing -1.
// InvalidArgument when the shape has rank < 2 or `scales` is not a scale layout.
absl::StatusOr<TensorConversion> CheckpointScales(ConversionSpec scales,
                                                  absl::Span<const int64_t> scales_shape);

}  // namespace wprep

#endif  // WPREP_SPEC_CHECKPOINT_H_
