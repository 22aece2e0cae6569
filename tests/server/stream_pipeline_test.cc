// Host-only tests of the ConvertStream data path: the input framing rules, and the
// converter and sender threads, with a fake converter and a writer that records what the
// client would receive.
#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "rpc/stream_pipeline.h"

namespace wprep::testing {
namespace {

using server::StreamInputFramer;
using server::StreamPipeline;
namespace v1 = wprep::v1;

// Collects framed slices.
class Slices final : public server::SliceSink {
 public:
  std::string TakeBuffer(uint64_t bytes) override {
    std::string b;
    b.reserve(bytes);
    return b;
  }
  absl::Status Push(std::string slice) override {
    if (!fail_.ok()) return fail_;
    slices.push_back(std::move(slice));
    return absl::OkStatus();
  }
  std::vector<std::string> slices;
  absl::Status fail_;
};

v1::ConvertStreamRequest Chunk(uint64_t offset, const std::string& data) {
  v1::ConvertStreamRequest m;
  m.mutable_chunk()->set_offset(offset);
  m.mutable_chunk()->set_data(data);
  return m;
}

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 7 + 3);
  return s;
}

TEST(StreamInputFramer, CutsAnyChunkingIntoTheSameSlices) {
  const std::string input = Pattern(1000);
  for (size_t chunk : {1u, 7u, 100u, 250u, 333u, 1000u}) {
    Slices sink;
    StreamInputFramer f(input.size(), 250, &sink);
    for (size_t off = 0; off < input.size(); off += chunk) {
      v1::ConvertStreamRequest m = Chunk(off, input.substr(off, chunk));
      ASSERT_TRUE(f.Add(m).ok()) << chunk;
    }
    ASSERT_TRUE(f.Finish().ok());
    ASSERT_EQ(sink.slices.size(), 4u) << chunk;
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(sink.slices[i], input.substr(250 * i, 250)) << chunk;
    EXPECT_EQ(f.received(), input.size());
  }
}

TEST(StreamInputFramer, TheLastSliceMayBeShorterAndEmptyChunksAreIgnored) {
  Slices sink;
  StreamInputFramer f(600, 250, &sink);
  v1::ConvertStreamRequest empty = Chunk(0, "");
  ASSERT_TRUE(f.Add(empty).ok());
  v1::ConvertStreamRequest all = Chunk(0, Pattern(600));
  ASSERT_TRUE(f.Add(all).ok());
  ASSERT_TRUE(f.Finish().ok());
  ASSERT_EQ(sink.slices.size(), 3u);
  EXPECT_EQ(sink.slices[2].size(), 100u);
}

TEST(StreamInputFramer, AnEmptyTensorMakesOneEmptySlice) {
  Slices sink;
  StreamInputFramer f(0, 0, &sink);
  ASSERT_TRUE(f.Finish().ok());
  ASSERT_EQ(sink.slices.size(), 1u);
  EXPECT_TRUE(sink.slices[0].empty());
}

TEST(StreamInputFramer, FramingErrorsAreInvalidArgumentWithTheRule) {
  struct Bad {
    std::vector<v1::ConvertStreamRequest> msgs;
    std::string part;
  };
  v1::ConvertStreamRequest header;
  header.mutable_header();
  v1::ConvertStreamRequest neither;
  std::vector<Bad> bad = {
      {{Chunk(0, "ab"), Chunk(3, "cd")}, "in order without gaps"},
      {{Chunk(2, "ab")}, "in order without gaps"},
      {{Chunk(0, "ab"), header}, "second header"},
      {{neither}, "neither header nor chunk"},
      {{Chunk(0, std::string(server::kMaxChunkBytes + 1, 'x'))}, "chunk limit"},
      {{Chunk(0, std::string(11, 'x'))}, "more than the 10 input bytes"},
  };
  for (Bad& b : bad) {
    Slices sink;
    StreamInputFramer f(10, 4, &sink);
    absl::Status s;
    for (v1::ConvertStreamRequest& m : b.msgs) {
      s = f.Add(m);
      if (!s.ok()) break;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.part;
    EXPECT_NE(s.message().find(b.part), std::string::npos) << s;
  }
  Slices sink;
  StreamInputFramer f(10, 4, &sink);
  v1::ConvertStreamRequest some = Chunk(0, "abcdef");
  ASSERT_TRUE(f.Add(some).ok());
  absl::Status s = f.Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s;
}

// What the client receives.
struct Received {
  absl::Mutex mu;
  std::vector<v1::ConvertStreamResponse> msgs ABSL_GUARDED_BY(mu);
  std::atomic<bool> gone{false};
};

StreamPipeline::Write Recorder(Received* r) {
  return [r](const v1::ConvertStreamResponse& m) {
    if (r->gone.load()) return false;
    absl::MutexLock lock(&r->mu);
    r->msgs.push_back(m);
    return true;
  };
}

// A converter that doubles each slice (output twice the input's size), as a layout
// with padding might.
StreamPipeline::Convert Doubler(std::string* buffer) {
  return [buffer](const std::string& in) -> absl::StatusOr<absl::Span<const uint8_t>> {
    *buffer = in + in;
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(buffer->data()), buffer->size());
  };
}

TEST(StreamPipeline, OutputChunksArriveInOrderWithContiguousOffsets) {
  Received got;
  std::string buf;
  absl::StatusOr<std::unique_ptr<StreamPipeline>> p = StreamPipeline::Start(Doubler(&buf), Recorder(&got));
  ASSERT_TRUE(p.ok()) << p.status();
  std::string expected;
  for (int i = 0; i < 5; ++i) {
    const std::string slice = Pattern(700'000 + i);  // each output > one output chunk
    expected += slice + slice;
    std::string b = (*p)->TakeBuffer(slice.size());
    b = slice;
    ASSERT_TRUE((*p)->Push(std::move(b)).ok());
  }
  absl::StatusOr<uint64_t> sent = (*p)->Finish();
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, expected.size());
  std::string out;
  absl::MutexLock lock(&got.mu);
  for (const v1::ConvertStreamResponse& m : got.msgs) {
    ASSERT_TRUE(m.has_chunk());
    EXPECT_EQ(m.chunk().offset(), out.size());
    EXPECT_LE(m.chunk().data().size(), server::kOutputChunkBytes);
    out += m.chunk().data();
  }
  EXPECT_EQ(out, expected);
}

TEST(StreamPipeline, AConverterErrorReachesTheNextPushAndFinish) {
  Received got;
  int calls = 0;
  absl::StatusOr<std::unique_ptr<StreamPipeline>> p = StreamPipeline::Start(
      [&calls](const std::string&) -> absl::StatusOr<absl::Span<const uint8_t>> {
        ++calls;
        return absl::DataLossError("slice went bad");
      },
      Recorder(&got));
  ASSERT_TRUE(p.ok());
  absl::Status first = (*p)->Push("x");
  EXPECT_TRUE(first.ok());  // queued before the converter saw it
  absl::StatusOr<uint64_t> sent = (*p)->Finish();
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(calls, 1);
}

TEST(StreamPipeline, AClientThatWentAwayCancelsTheStream) {
  Received got;
  got.gone = true;
  std::string buf;
  absl::StatusOr<std::unique_ptr<StreamPipeline>> p = StreamPipeline::Start(Doubler(&buf), Recorder(&got));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->Push(Pattern(100)).ok());
  absl::StatusOr<uint64_t> sent = (*p)->Finish();
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kCancelled);
}

TEST(StreamPipeline, AbortStopsBothThreadsWithTheReason) {
  Received got;
  std::string buf;
  absl::StatusOr<std::unique_ptr<StreamPipeline>> p = StreamPipeline::Start(Doubler(&buf), Recorder(&got));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->Push(Pattern(100)).ok());
  absl::Status s = (*p)->Abort(absl::InvalidArgumentError("bad chunk"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*p)->Push("more").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wprep::testing
