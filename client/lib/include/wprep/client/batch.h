// Building ConvertBatch requests: items from spec types and buffers, and the two
// conversions of an MXFP4 checkpoint's tensor pair (gpt-oss's `*_blocks` and `*_scales`).
#ifndef WPREP_CLIENT_BATCH_H_
#define WPREP_CLIENT_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wprep/spec/checkpoint.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::client {

// The conversions of an MXFP4 checkpoint's pair (wprep/spec/checkpoint.h), here too.
using wprep::CheckpointScales;
using wprep::CheckpointValues;
using wprep::TensorConversion;

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
