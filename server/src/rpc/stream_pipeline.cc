#include "rpc/stream_pipeline.h"

#include <algorithm>

#include "absl/strings/string_view.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace v1 = wprep::v1;

StreamInputFramer::StreamInputFramer(uint64_t expected, uint64_t slice_bytes, SliceSink* sink)
    : expected_(expected), slice_(slice_bytes), sink_(sink) {
  pending_ = sink_->TakeBuffer(slice_);
}

absl::Status StreamInputFramer::Add(v1::ConvertStreamRequest& msg) {
  if (msg.has_header()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a second header arrived after ", received_, " input bytes; a stream carries one header"));
  }
  if (!msg.has_chunk()) {
    return absl::InvalidArgumentError("a stream message carries neither header nor chunk");
  }
  const v1::DataChunk& ch = msg.chunk();
  const std::string& data = ch.data();
  if (data.size() > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", data.size(), " bytes exceeds the ",
                                                   kMaxChunkBytes,
                                                   "-byte (4 MiB) chunk limit; split the input "
                                                   "into smaller chunks"));
  }
  if (ch.offset() != received_) {
    return absl::InvalidArgumentError(absl::StrCat("chunk at offset ", ch.offset(), " arrived after ",
                                                   received_, " bytes; send chunks in order without gaps"));
  }
  if (data.size() > expected_ - received_) {
    return absl::InvalidArgumentError(absl::StrCat("the stream carries more than the ", expected_,
                                                   " input bytes the plan expects (chunk at ",
                                                   received_, " has ", data.size(), " bytes)"));
  }
  if (data.empty()) return absl::OkStatus();  // ignored
  received_ += data.size();
  if (pending_.empty() && data.size() == slice_) {
    // A chunk that is exactly one slice moves through without a copy.
    return sink_->Push(std::move(*msg.mutable_chunk()->mutable_data()));
  }
  absl::string_view rest(data);
  while (!rest.empty()) {
    const size_t take = std::min<size_t>(rest.size(), slice_ - pending_.size());
    pending_.append(rest.data(), take);
    rest.remove_prefix(take);
    if (pending_.size() == slice_) {
      WPREP_RETURN_IF_ERROR(sink_->Push(std::move(pending_)));
      pending_ = sink_->TakeBuffer(slice_);
    }
  }
  return absl::OkStatus();
}

absl::Status StreamInputFramer::Finish() {
  if (received_ < expected_) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream ended after ", received_, " of ", expected_,
                     " input bytes (truncated); send the whole tensor before closing the stream"));
  }
  // An empty tensor still makes one (empty) slice, so its output header and size hold.
  if (!pending_.empty() || slice_ == 0) return sink_->Push(std::move(pending_));
  return absl::OkStatus();
}

uint64_t StreamPipeline::HostBytes(uint64_t input_bytes, uint64_t slice_input_bytes, uint64_t slice_output_bytes) {
  auto ceil_div = [](uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); };
  // An empty tensor still makes one (empty) slice (StreamInputFramer::Finish).
  const uint64_t slices =
      slice_input_bytes == 0 ? 1 : std::max<uint64_t>(1, ceil_div(input_bytes, slice_input_bytes));
  // Each slice's buffer, plus the one the framer takes after the last.
  const uint64_t in_buffers = std::min<uint64_t>(2 * kSlicesQueued + 2, slices + 1);
  constexpr uint64_t kMaxChunks = 2 * kChunksQueued + 1;
  const uint64_t chunks_per_slice = std::max<uint64_t>(1, ceil_div(slice_output_bytes, kOutputChunkBytes));
  const uint64_t chunks = slices >= kMaxChunks ? kMaxChunks : std::min(kMaxChunks, slices * chunks_per_slice);
  const uint64_t chunk = std::min(kOutputChunkBytes, slice_output_bytes);
  uint64_t in = 0, out = 0, sum = 0;
  if (__builtin_mul_overflow(in_buffers, slice_input_bytes, &in) || __builtin_mul_overflow(chunks, chunk, &out) ||
      __builtin_add_overflow(in, out, &sum) || __builtin_add_overflow(sum, slice_output_bytes, &sum)) {
    return UINT64_MAX;
  }
  return sum;
}

absl::StatusOr<std::unique_ptr<StreamPipeline>> StreamPipeline::Start(Convert convert, Write write) {
  std::unique_ptr<StreamPipeline> p(new StreamPipeline());
  StreamPipeline* self = p.get();
  WPREP_ASSIGN_OR_RETURN(
      p->sender_, WorkerQueue<v1::ConvertStreamResponse>::Start(
                      kChunksQueued, [self, write = std::move(write)](v1::ConvertStreamResponse& msg) {
                        if (!write(msg)) return absl::CancelledError("client went away mid-stream");
                        self->sent_ += msg.chunk().data().size();
                        return absl::OkStatus();
                      }));
  WPREP_ASSIGN_OR_RETURN(
      p->converter_,
      WorkerQueue<std::string>::Start(
          kSlicesQueued, [self, convert = std::move(convert)](std::string& in) -> absl::Status {
            WPREP_ASSIGN_OR_RETURN(absl::Span<const uint8_t> out, convert(in));
            for (uint64_t off = 0; off < out.size(); off += kOutputChunkBytes) {
              const uint64_t n = std::min<uint64_t>(kOutputChunkBytes, out.size() - off);
              v1::ConvertStreamResponse msg = self->sender_->TakeBuffer();
              v1::DataChunk* dc = msg.mutable_chunk();
              dc->set_offset(self->produced_);
              dc->set_data(out.data() + off, n);
              self->produced_ += n;
              WPREP_RETURN_IF_ERROR(self->sender_->Push(std::move(msg)));
            }
            return absl::OkStatus();
          }));
  return p;
}

std::string StreamPipeline::TakeBuffer(uint64_t bytes) {
  std::string b = converter_->TakeBuffer();
  b.clear();
  b.reserve(bytes);
  return b;
}

absl::Status StreamPipeline::Push(std::string slice) { return converter_->Push(std::move(slice)); }

absl::StatusOr<uint64_t> StreamPipeline::Finish() {
  absl::Status s = converter_->Finish();
  if (!s.ok()) return sender_->Abort(s);
  WPREP_RETURN_IF_ERROR(sender_->Finish());
  return sent_;
}

absl::Status StreamPipeline::Abort(absl::Status why) {
  absl::Status s = sender_->Abort(std::move(why));
  return converter_->Abort(std::move(s));
}

}  // namespace wprep::server
