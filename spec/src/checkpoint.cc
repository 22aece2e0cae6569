#include "wprep/spec/checkpoint.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wprep {

absl::StatusOr<TensorConversion> CheckpointValues(ConversionSpec values,
                                                  absl::Span<const int64_t> blocks_shape) {
  if (!IsValueLayout(values.layout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint values convert to a value layout, not ", std::string(LayoutName(values.layout))));
  }
  const size_t r = blocks_shape.size();
  if (r < 3 || blocks_shape[r - 1] != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("MXFP4 blocks have the shape [..., N, K/32, 16], got [",
                     absl::StrJoin(blocks_shape, ", "), "]"));
  }
  TensorConversion c;
  values.direction = Direction::kSwizzle;
  values.packing_axis = -2;
  c.spec = values;
  c.logical_shape.assign(blocks_shape.begin(), blocks_shape.end() - 3);
  c.logical_shape.push_back(blocks_shape[r - 2] * 32);  // K
  c.logical_shape.push_back(blocks_shape[r - 3]);       // N
  return c;
}

absl::StatusOr<TensorConversion> CheckpointScales(ConversionSpec scales,
                                                  absl::Span<const int64_t> scales_shape) {
  if (IsValueLayout(scales.layout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint scales convert to a scale layout, not ", std::string(LayoutName(scales.layout))));
  }
  const size_t r = scales_shape.size();
  if (r < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MXFP4 scales have the shape [..., N, K/32], got [", absl::StrJoin(scales_shape, ", "), "]"));
  }
  TensorConversion c;
  scales.direction = Direction::kSwizzle;
  scales.packing_axis = -1;
  c.spec = scales;
  const int64_t n = scales_shape[r - 2], g = scales_shape[r - 1];
  c.logical_shape.assign(scales_shape.begin(), scales_shape.end() - 2);
  c.logical_shape.push_back(g);
  c.logical_shape.push_back(n);
  // Dense strides of the storage [..., N, G] for the leading dims; the last two swap.
  c.input_strides.assign(r, 0);
  int64_t stride = n * g;
  for (size_t i = r - 2; i-- > 0;) {
    c.input_strides[i] = stride;
    stride *= scales_shape[i];
  }
  c.input_strides[r - 2] = 1;
  c.input_strides[r - 1] = g;
  return c;
}

}  // namespace wprep
