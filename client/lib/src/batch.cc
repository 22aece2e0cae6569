#include "wprep/client/batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "wprep/proto/spec_codec.h"

namespace wprep::client {


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
