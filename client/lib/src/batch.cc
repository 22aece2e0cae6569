#include "wprep/client/batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "wprep/proto/spec_codec.h"

namespace wprep::client {

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

wprep::v1::ConvertItem* BatchBuilder::Add(const TensorConversion& c) {
  wprep::v1::ConvertItem* item = request_.add_items()->mutable_convert();
  *item->mutable_spec() = SpecToProto(c.spec);
  for (int64_t d : c.logical_shape) item->add_logical_shape(d);
  return item;
}

int BatchBuilder::AddInline(const TensorConversion& c, absl::Span<const uint8_t> input) {
  wprep::v1::ConvertItem* item = Add(c);
  item->mutable_source()->set_inline_bytes(input.data(), input.size());
  for (int64_t s : c.input_strides) item->mutable_source()->add_inline_strides(s);
  inline_bytes_ += input.size();
  return size() - 1;
}

int BatchBuilder::AddIpc(const TensorConversion& c, const wprep::v1::CudaIpcBuffer& source,
                         const wprep::v1::CudaIpcBuffer* destination) {
  wprep::v1::ConvertItem* item = Add(c);
  wprep::v1::CudaIpcBuffer* src = item->mutable_source()->mutable_ipc();
  *src = source;
  if (!c.input_strides.empty()) {
    src->clear_strides();
    for (int64_t s : c.input_strides) src->add_strides(s);
  }
  if (destination != nullptr) *item->mutable_destination()->mutable_ipc() = *destination;
  return size() - 1;
}

wprep::v1::ConvertBatchRequest BatchBuilder::Take() {
  wprep::v1::ConvertBatchRequest r = std::move(request_);
  request_.Clear();
  inline_bytes_ = 0;
  return r;
}

}  // namespace wprep::client
