// libFuzzer target: the ConvertStream framing state machine (StreamInputFramer) fed
// arbitrary sequences of ConvertStreamRequest messages, as the RPC's thread feeds it
// after the header.
//
// Input (ByteReader, fuzz_support.h): a mode byte; with bit 0 set, a StreamRequestHeader
// (varint length, wire bytes) planned and sliced as the daemon does it
// (StreamStartFromProto, then the CPU stream converter with a slice target of 1 + varint
// bytes), else a bare expected size and slice size (two varints); a varint k, the k-th
// push fails (0: none); then operations, each a byte (mod 7) and its arguments:
//   0 raw ConvertStreamRequest wire bytes (varint length, bytes)
//   1 the next in-order chunk (varint size)     2 a chunk at any offset (varint offset, size)
//   3 a second header (varint dim)              4 a message with neither field
//   5 a chunk above the 4 MiB limit             6 or the end of input: the client half-closes
// The sink records every slice. The harness keeps its own model of the framing rules and
// checks:
// - each Add is accepted exactly when the model says the message is valid; refusals are
//   INVALID_ARGUMENT, and a failed push is passed back unchanged;
// - slices arrive in order: their concatenation is always a prefix of the accepted data,
//   every slice but the last has exactly the slice size, buffers are asked for that size;
// - Finish succeeds exactly when all expected bytes came, and then the slices hold
//   exactly the data sent (one empty slice for an empty tensor);
// - with a planned header, the slices converted one by one by the stream converter give
//   the bytes the CPU engine gives for the whole tensor at once;
// - a planned header too large to convert here (above 256 KiB) is still sliced as the
//   daemon slices it (its slice target from the input, 0 for the daemon's 4 MiB): the
//   converter is built or refused RESOURCE_EXHAUSTED, its slices cover the input, their
//   outputs add up to the plan's (in 128-bit arithmetic), and a full and the last slice
//   each plan to their own sizes (issue 26's SIGFPE was one such header).
// The custom mutator (below) edits the header as a message (proto_mutator.h).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "proto_mutator.h"
#include "rpc/proto_translate.h"
#include "exec/stream_converter.h"
#include "rpc/stream_pipeline.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/proto/spec_codec.h"

namespace {

namespace v1 = wprep::v1;
using wprep::server::kMaxChunkBytes;

// Streams planned from a header are kept to this many input and output bytes.
constexpr uint64_t kMaxStreamBytes = 256 << 10;

// The data a chunk at `offset` carries: a function of the offset, so any chunking of
// the tensor carries the same bytes.
std::string Data(uint64_t offset, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((offset + i) * 131 + 7);
  return s;
}

class RecordingSink final : public wprep::server::SliceSink {
 public:
  RecordingSink(uint64_t slice, wprep::server::StreamConverter* conv, int fail_at)
      : slice_(slice), conv_(conv), fail_at_(fail_at) {}

  std::string TakeBuffer(uint64_t bytes) override {
    WPREP_FUZZ_CHECK(bytes == slice_, "a buffer of %llu bytes asked for slices of %llu",
                     static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(slice_));
    std::string b;
    b.reserve(bytes);
    return b;
  }
  absl::Status Push(std::string slice) override {
    if (pushes_++ == fail_at_) return absl::CancelledError("injected: the converter stopped");
    WPREP_FUZZ_CHECK(!finished_, "a slice after the last, shorter one");
    WPREP_FUZZ_CHECK(slice.size() <= slice_, "a slice of %zu bytes, slices are %llu", slice.size(),
                     static_cast<unsigned long long>(slice_));
    if (slice.size() < slice_) finished_ = true;  // only the last slice may be shorter
    if (conv_ != nullptr) {
      absl::StatusOr<absl::Span<const uint8_t>> out =
          conv_->ConvertSlice(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(slice.data()), slice.size()));
      WPREP_FUZZ_CHECK(out.ok(), "the stream converter refused a framed slice of %zu bytes: %s", slice.size(),
                       out.status().ToString().c_str());
      WPREP_FUZZ_CHECK(out->size() == conv_->SliceOutputBytes(slice.size()), "slice output size");
      output_.append(reinterpret_cast<const char*>(out->data()), out->size());
    }
    data_ += slice;
    ++slices_;
    return absl::OkStatus();
  }

  // True when a push since the `before`-th one was the injected failure.
  bool FailedSince(int before) const { return fail_at_ >= before && fail_at_ < pushes_; }
  int pushes() const { return pushes_; }
  int slices() const { return slices_; }
  const std::string& data() const { return data_; }
  const std::string& output() const { return output_; }

 private:
  const uint64_t slice_;
  wprep::server::StreamConverter* const conv_;
  const int fail_at_;
  int pushes_ = 0;
  int slices_ = 0;
  bool finished_ = false;
  std::string data_;    // the slices, concatenated
  std::string output_;  // their conversions, concatenated
};

// A stream too large to convert here: the converter the daemon would build for it (any
// slice target, the daemon's 4 MiB or one from the input), its slice sizes and the plans
// of a full and of the last slice, checked without running them. The sizes are checked
// in 128-bit arithmetic, so a wrapped product in the converter shows.
void CheckSlicing(const wprep::Plan& plan, uint64_t target) {
  if (target == 0) target = 4ull << 20;  // the daemon's default (StreamSlicing)
  absl::StatusOr<std::unique_ptr<wprep::server::StreamConverter>> c =
      wprep::server::NewCpuStreamConverter(plan, {target, 256ull << 20}, 1, nullptr);
  if (!c.ok()) {
    WPREP_FUZZ_CHECK(c.status().code() == absl::StatusCode::kResourceExhausted, "stream converter refused with %s",
                     c.status().ToString().c_str());
    return;
  }
  wprep::server::StreamConverter& conv = **c;
  const uint64_t slice = conv.slice_input_bytes();
  const uint64_t total = plan.input_bytes;
  WPREP_FUZZ_CHECK((slice == 0) == (total == 0) && slice <= total, "slice %llu for %llu input bytes",
                   static_cast<unsigned long long>(slice), static_cast<unsigned long long>(total));
  if (slice == 0) return;
  const uint64_t full = total / slice, last = total % slice;
  unsigned __int128 out = static_cast<unsigned __int128>(conv.SliceOutputBytes(slice)) * full;
  if (last > 0) out += conv.SliceOutputBytes(last);
  WPREP_FUZZ_CHECK(out == plan.output_bytes, "slices give %llu output bytes, the plan %llu",
                   static_cast<unsigned long long>(out), static_cast<unsigned long long>(plan.output_bytes));
  for (uint64_t bytes : {slice, last}) {
    if (bytes == 0) continue;
    absl::StatusOr<const wprep::Plan*> p = conv.SlicePlan(bytes);
    WPREP_FUZZ_CHECK(p.ok(), "no plan for a slice of %llu bytes: %s", static_cast<unsigned long long>(bytes),
                     p.status().ToString().c_str());
    WPREP_FUZZ_CHECK((*p)->input_bytes == bytes && (*p)->output_bytes == conv.SliceOutputBytes(bytes),
                     "a slice of %llu bytes planned as %llu in, %llu out", static_cast<unsigned long long>(bytes),
                     static_cast<unsigned long long>((*p)->input_bytes),
                     static_cast<unsigned long long>((*p)->output_bytes));
  }
}

}  // namespace

int wprep::fuzz::FuzzStream(const uint8_t* bytes, size_t size) {
  wprep::fuzz::ByteReader in(bytes, size);
  uint64_t expected = 0, slice = 0;
  std::optional<wprep::Plan> plan;
  std::unique_ptr<wprep::server::StreamConverter> conv;
  if (in.Byte() & 1) {
    v1::StreamRequestHeader h;
    if (!h.ParseFromString(in.Bytes(in.Varint()))) return 0;
    absl::StatusOr<wprep::ConversionSpec> spec = wprep::SpecFromProto(h.spec(), "header.spec");
    if (!spec.ok()) return 0;
    absl::StatusOr<wprep::server::StreamStart> start = wprep::server::StreamStartFromProto(h, *spec);
    if (!start.ok()) return 0;
    if (start->plan.input_bytes > kMaxStreamBytes || start->plan.output_bytes > kMaxStreamBytes) {
      // Too large to convert here: sliced as the daemon slices it, with its own target.
      CheckSlicing(start->plan, in.Varint());
      return 0;
    }
    const uint64_t target = 1 + in.Varint() % (64 << 10);
    absl::StatusOr<std::unique_ptr<wprep::server::StreamConverter>> c =
        wprep::server::NewCpuStreamConverter(start->plan, {target, 256ull << 20}, 1, nullptr);
    WPREP_FUZZ_CHECK(c.ok(), "a small stream refused: %s", c.status().ToString().c_str());
    conv = *std::move(c);
    plan = start->plan;
    expected = plan->input_bytes;
    slice = conv->slice_input_bytes();
    // The framer's precondition, which the converter must meet: slices are empty only
    // for an empty tensor, and never larger than it.
    WPREP_FUZZ_CHECK((slice == 0) == (expected == 0) && slice <= expected, "slice %llu for %llu input bytes",
                     static_cast<unsigned long long>(slice), static_cast<unsigned long long>(expected));
  } else {
    expected = in.Varint() % ((1 << 16) + 1);
    slice = expected == 0 ? 0 : 1 + in.Varint() % expected;
  }
  // 0: every push succeeds; k: the k-th push fails.
  RecordingSink sink(slice, conv.get(), static_cast<int>(in.Varint() % 17) - 1);
  wprep::server::StreamInputFramer framer(expected, slice, &sink);

  std::string sent;  // every byte the framer accepted, in order
  absl::Status st;
  for (;;) {
    v1::ConvertStreamRequest m;
    const uint64_t at = framer.received();
    const int op = in.empty() ? 6 : in.Byte() % 7;
    if (op == 6) break;  // the client half-closes
    switch (op) {
      case 0:  // raw wire bytes, as a client may send them
        if (!m.ParseFromString(in.Bytes(in.Varint()))) continue;
        break;
      case 1:  // the next chunk, in order
        m.mutable_chunk()->set_offset(at);
        m.mutable_chunk()->set_data(Data(at, static_cast<size_t>(std::min<uint64_t>(in.Varint(), 1 << 17))));
        break;
      case 2:  // a chunk anywhere
        m.mutable_chunk()->set_offset(in.Varint());
        m.mutable_chunk()->set_data(Data(m.chunk().offset(), static_cast<size_t>(in.Varint() % 4096)));
        break;
      case 3:  // a second header
        m.mutable_header()->add_logical_shape(static_cast<int64_t>(in.Varint()));
        break;
      case 4:  // neither header nor chunk
        break;
      case 5:  // a chunk above the 4 MiB limit
        m.mutable_chunk()->set_offset(at);
        m.mutable_chunk()->set_data(std::string(kMaxChunkBytes + 1, 'x'));
        break;
    }
    const bool valid = !m.has_header() && m.has_chunk() && m.chunk().data().size() <= kMaxChunkBytes &&
                       m.chunk().offset() == at && m.chunk().data().size() <= expected - at;
    const std::string data = m.has_chunk() ? m.chunk().data() : std::string();
    const int pushes_before = sink.pushes();
    st = framer.Add(m);
    if (!valid) {
      WPREP_FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument, "an invalid message got %s",
                       st.ToString().c_str());
      WPREP_FUZZ_CHECK(framer.received() == at, "a refused message moved the stream");
      return 0;  // the daemon aborts the stream here
    }
    if (sink.FailedSince(pushes_before)) {
      WPREP_FUZZ_CHECK(st.code() == absl::StatusCode::kCancelled, "a failed push came back as %s",
                       st.ToString().c_str());
      return 0;
    }
    WPREP_FUZZ_CHECK(st.ok(), "a valid chunk of %zu bytes at %llu refused: %s", data.size(),
                     static_cast<unsigned long long>(at), st.ToString().c_str());
    WPREP_FUZZ_CHECK(framer.received() == at + data.size(), "received() did not count the chunk");
    sent += data;
    // In order, nothing lost or repeated: the slices so far are the whole slices of what
    // was sent.
    WPREP_FUZZ_CHECK(sink.data().size() == (slice == 0 ? 0 : sent.size() / slice * slice),
                     "%zu bytes in slices after %zu sent in slices of %llu", sink.data().size(), sent.size(),
                     static_cast<unsigned long long>(slice));
    WPREP_FUZZ_CHECK(sent.compare(0, sink.data().size(), sink.data()) == 0, "slices out of order");
  }

  const int pushes_before = sink.pushes();
  st = framer.Finish();
  if (sink.FailedSince(pushes_before)) {
    WPREP_FUZZ_CHECK(st.code() == absl::StatusCode::kCancelled, "a failed push came back as %s", st.ToString().c_str());
    return 0;
  }
  if (sent.size() < expected) {
    WPREP_FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument, "a truncated stream finished with %s",
                     st.ToString().c_str());
    return 0;
  }
  WPREP_FUZZ_CHECK(st.ok(), "a complete stream failed: %s", st.ToString().c_str());
  WPREP_FUZZ_CHECK(sent.size() == expected && sink.data() == sent, "slices hold %zu bytes of the %zu sent",
                   sink.data().size(), sent.size());
  const uint64_t want_slices = expected == 0 ? 1 : (expected + slice - 1) / slice;
  WPREP_FUZZ_CHECK(static_cast<uint64_t>(sink.slices()) == want_slices, "%d slices, expected %llu", sink.slices(),
                   static_cast<unsigned long long>(want_slices));
  if (plan) {
    std::string whole(plan->output_bytes, '\0');
    absl::Status s = wprep::ConvertOnCpu(*plan, reinterpret_cast<const uint8_t*>(sent.data()), sent.size(),
                                         reinterpret_cast<uint8_t*>(whole.data()), whole.size(), wprep::CpuOptions{1});
    WPREP_FUZZ_CHECK(s.ok(), "%s", s.ToString().c_str());
    WPREP_FUZZ_CHECK(sink.output() == whole, "%s: sliced output (%zu bytes) differs from the whole conversion",
                     wprep::Describe(plan->spec).c_str(), sink.output().size());
  }
  return 0;
}

#ifndef WPREP_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return wprep::fuzz::FuzzStream(data, size); }

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Structure-aware, half the time: the header is parsed, edited field by field
// (proto_mutator.h) or its slice target set to an edge value, and the input written back
// with its operations unchanged; otherwise libFuzzer's byte mutations.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::minstd_rand rng(seed);
  if (rng() % 2 == 0) return LLVMFuzzerMutate(data, size, max_size);
  wprep::fuzz::ByteReader in(data, size);
  uint8_t mode = in.Byte();
  v1::StreamRequestHeader h;
  uint64_t target = 0;
  if (mode & 1) {
    if (!h.ParseFromString(in.Bytes(in.Varint()))) h.Clear();
    target = in.Varint();
  } else {
    mode |= 1;  // a bare stream becomes a planned one
    target = rng() % (64 << 10);
  }
  const std::string rest = in.Bytes(in.remaining());
  if (rng() % 4 == 0) {
    target = static_cast<uint64_t>(wprep::fuzz::ExtremeInt(rng));
  } else {
    wprep::fuzz::MutateMessage(&h, rng);
  }
  std::string out(1, static_cast<char>(mode));
  const std::string wire = h.SerializeAsString();
  wprep::fuzz::PutVarint(&out, wire.size());
  out += wire;
  wprep::fuzz::PutVarint(&out, target);
  out += rest;
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}
#endif
