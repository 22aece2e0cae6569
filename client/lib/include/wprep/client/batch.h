// Building ConvertBatch requests: items from spec types and buffers, and the two
// conversions of an MXFP4 checkpoint's tensor pair (gpt-oss's `*_blocks` and `*_scales`).
#ifndef WPREP_CLIENT_BATCH_H_
#define WPREP_CLIENT_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::client {

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

// Collects the items of one ConvertBatchRequest and counts the inline bytes they carry,
// so a caller can cut batches below the daemon's --max-message-bytes. Not thread-safe.
class BatchBuilder {
 public:
  // An item converting `input` (copied into the request): dense, or the view that
  // `c.input_strides` describes. The output comes back inline. Returns the item's index.
  int AddInline(const TensorConversion& c, absl::Span<const uint8_t> input);
  // An item reading from the client's GPU memory (`source.strides` set from
  // `c.input_strides` when these are given) and writing into `destination`, or inline
  // when `destination` is null. Returns the item's index.
  int AddIpc(const TensorConversion& c, const wprep::v1::CudaIpcBuffer& source,
             const wprep::v1::CudaIpcBuffer* destination);

  int size() const { return request_.items_size(); }
  bool empty() const { return request_.items_size() == 0; }
  // Input bytes the items carry inline.
  uint64_t inline_bytes() const { return inline_bytes_; }
  const wprep::v1::ConvertBatchRequest& request() const { return request_; }
  // The request; the builder is empty again afterwards.
  wprep::v1::ConvertBatchRequest Take();

 private:
  wprep::v1::ConvertItem* Add(const TensorConversion& c);

  wprep::v1::ConvertBatchRequest request_;
  uint64_t inline_bytes_ = 0;
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_BATCH_H_
