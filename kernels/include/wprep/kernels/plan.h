// The planner: validates a conversion before any memory is touched (CUTLASS's
// can_implement) and describes its input and output.
#ifndef WPREP_KERNELS_PLAN_H_
#define WPREP_KERNELS_PLAN_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/kernels/layout_math.h"
#include "wprep/spec/spec.h"

namespace wprep {

// How the caller's input buffer holds the input tensor. Shapes and strides are those of
// the input's storage form (canonical [..., D0, D1/2] for swizzle; the layout's storage
// shape for unswizzle and retile), in elements of one byte.
struct InputBinding {
  // Byte strides, one per dim of the input's storage shape. Empty: the layout's default
  // (dense) strides. The dim that is contiguous in the default strides must keep stride 1.
  std::vector<int64_t> strides;
  // Size of the caller's buffer in bytes. Unset: assume exactly what the view spans.
  // With default strides it must equal the dense byte count; with explicit strides the
  // view must lie inside it.
  std::optional<uint64_t> buffer_bytes;
};

// A validated conversion. Immutable; cheap to copy.
struct Plan {
  ConversionSpec spec;
  std::vector<int64_t> logical_shape;  // FP4 values

  std::vector<int64_t> input_shape;    // storage shape the input must have
  std::vector<int64_t> input_strides;  // byte strides of the input view
  uint64_t input_bytes = 0;            // bytes the input view spans (its dense size when dense)
  bool input_dense = true;             // input strides are the default ones

  std::vector<int64_t> output_shape;    // as the reference implementation reports it
  std::vector<int64_t> output_strides;  // as the reference implementation reports it
  uint64_t output_bytes = 0;            // output bytes, written contiguously (memory order)

  Geometry geometry;  // what the engines consume

  bool empty() const { return output_bytes == 0; }
};

// Validates spec + logical shape (+ input binding) and returns the plan, or
// InvalidArgument with a message naming the problem and the offending value.
absl::StatusOr<Plan> MakePlan(const ConversionSpec& spec, absl::Span<const int64_t> logical_shape,
                              const InputBinding& input = {});

// Torch's dense strides for `shape` (a dim of size 0 counts as 1), in elements.
std::vector<int64_t> DenseStrides(absl::Span<const int64_t> shape);

}  // namespace wprep

#endif  // WPREP_KERNELS_PLAN_H_
