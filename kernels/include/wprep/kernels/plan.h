// The planner: validates a conversion before any memory is touched (CUTLASS's
// can_implement) and describes its input and output: shapes, strides, byte counts and
// the spec that names the layout. How the engines tile the work is private to them.
#ifndef WPREP_KERNELS_PLAN_H_
#define WPREP_KERNELS_PLAN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/spec/spec.h"

namespace wprep {

// The engines' description of a planned conversion (tilings, divisors, access paths).
// Defined in the engine library's private headers; callers never need it.
struct Geometry;

// How the caller's input buffer holds the input tensor. Shapes and strides are those of
// the input's storage form, in elements of one byte: for a value swizzle the canonical
// side in the order spec.packing_axis names ([..., D0, D1/2] or [..., D1, D0/2]); for a
// scale swizzle the scale tensor itself; for unswizzle and retile the layout's storage
// shape as Plan::output_shape reports it for the swizzle.
struct InputBinding {
  // Byte strides, one per dim of the input's storage shape. Empty: the layout's default
  // strides (those the layout's swizzle reports for its output, dense for canonical and
  // scale tensors). Strides must be >= 0; a stride of 0 repeats the same bytes (a
  // broadcast view), which is read as given. Scale tensors (the input of a scale
  // swizzle) take any strides, e.g. the transposed view [E, K/32, N] with strides
  // [N*K/32, 1, K/32] that loaders pass for a checkpoint's [E, N, K/32]. Every other
  // input keeps stride 1 on the dim that is contiguous in its default strides (the
  // packed bytes of a row); its other dims may take any strides.
  std::vector<int64_t> strides;
  // Size of the caller's buffer in bytes. Unset: assume exactly what the view spans.
  // With default strides it must equal the dense byte count; with explicit strides the
  // view must lie inside it.
  std::optional<uint64_t> buffer_bytes;
};

// A validated conversion. Immutable; cheap to copy.
struct Plan {
  ConversionSpec spec;
  std::vector<int64_t> logical_shape;  // FP4 values (value layouts) or scale bytes

  std::vector<int64_t> input_shape;    // storage shape the input must have
  std::vector<int64_t> input_strides;  // byte strides of the input view
  uint64_t input_bytes = 0;            // bytes the input view spans (its dense size when dense)
  bool input_dense = true;             // input strides are the default ones

  // The output tensor: output_bytes bytes, written contiguously, that output_shape with
  // output_strides describes exactly. The shape is the one the reference
  // implementation reports; so are the strides wherever its tensor is non-overlapping
  // and dense (torch's definition, size-1 dims ignored), e.g. Hopper mx_axis -2 storage
  // reported as its transpose. Where it is not (an unswizzle whose reference result is a
  // slice of a padded tensor), the output is that tensor's row-major copy, and the
  // strides are the row-major ones: the bytes torch's clone() of the reference gives.
  std::vector<int64_t> output_shape;
  std::vector<int64_t> output_strides;
  uint64_t output_bytes = 0;

  // What the engines run; set by MakePlan and shared by the plan's copies. A plan that
  // MakePlan did not make has none, and the engines refuse it unless it is empty.
  std::shared_ptr<const Geometry> geometry;

  bool empty() const { return output_bytes == 0; }
};

// Validates spec + logical shape (+ input binding) and returns the plan, or
// InvalidArgument with a message naming the problem and the offending value.
absl::StatusOr<Plan> MakePlan(const ConversionSpec& spec, absl::Span<const int64_t> logical_shape,
                              const InputBinding& input = {});

// The Blackwell shuffled tile: block_k even in [2, 4096], block_n in [1, 4096];
// INVALID_ARGUMENT naming the parameter (prefixed by `which`, e.g. "retile target ").
absl::Status CheckBlackwellParams(const BlackwellParams& p, const char* which = "");

// Torch's dense strides for `shape` (a dim of size 0 counts as 1), in elements.
std::vector<int64_t> DenseStrides(absl::Span<const int64_t> shape);

// Torch's is_non_overlapping_and_dense: the view covers a dense block of memory exactly
// once, in some order of its dims (dims of size 0 or 1 ignored).
bool NonOverlappingAndDense(absl::Span<const int64_t> shape, absl::Span<const int64_t> strides);

}  // namespace wprep

#endif  // WPREP_KERNELS_PLAN_H_
