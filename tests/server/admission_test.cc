// Admission by need over a real wprepd on its Unix socket: requests that do not fit in
// --max-buffered-bytes wait in FIFO order (a large request is not passed by later small
// ones), up to --max-queue-wait, and leave the queue when cancelled; what can never fit,
// or finds the queue full, is refused at once; the queue's metrics move. And many small
// streams at once are all served, since each reserves what its tensor needs.
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "golden_rpc.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

constexpr int64_t kRows = 2048, kCols = 4096;  // one 4 MiB matrix

ConversionSpec Spec() { return HopperSpec(Direction::kSwizzle, -1, 3); }

std::unique_ptr<Daemon> StartCpuDaemon(std::vector<std::string> extra) {
  extra.push_back("--devices=cpu");
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(extra, &error);
  EXPECT_NE(d, nullptr) << error;
  if (d != nullptr) {
    EXPECT_TRUE(d->WaitServing()) << d->Log();
  }
  return d;
}

// Polls `pred` until true or `bound` passes (a bound on a wait, never a timed assertion).
bool WaitFor(const std::function<bool()>& pred, absl::Duration bound = absl::Seconds(30)) {
  const absl::Time until = absl::Now() + bound;
  while (!pred()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

double Metric(const Daemon& d, const std::string& name, const std::map<std::string, std::string>& labels = {}) {
  return MetricValue(HttpGet(d.metrics_address(), "/metrics"), name, labels).value_or(-1);
}
double Queued(const Daemon& d) { return Metric(d, "wprep_host_buffer_queued_requests"); }
double Refused(const Daemon& d, const std::string& reason) {
  return Metric(d, "wprep_host_buffer_refused_total", {{"reason", reason}});
}

uint64_t InlineCharge(const std::vector<int64_t>& shape) {
  absl::StatusOr<Plan> p = MakePlan(Spec(), shape);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->input_bytes + 2 * p->output_bytes : 0;
}

// A ConvertStream of `matrices` 4 MiB matrices on its own thread: sends its header, waits
// for the daemon's answer header (the daemon sends it once the stream has its host
// memory), then on Go() sends its input and checks every output byte.
class Stream {
 public:
  // `hold_reads`: after sending its input, read nothing until ReadOn().
  Stream(Client& c, int matrices, uint64_t seed, bool hold_reads = false)
      : hold_reads_(hold_reads),
        shape_({matrices, kRows, kCols}),
        input_(RandomBytes(static_cast<size_t>(matrices) * kRows * kCols / 2, seed)),
        expected_(CpuReference(Spec(), shape_, input_)),
        thread_([this, &c] { Run(c); }) {}
  ~Stream() {
    Cancel();
    Go();
    ReadOn();
    thread_.join();
  }
  void ReadOn() {  // the test's thread only
    if (!read_on_.HasBeenNotified()) read_on_.Notify();
  }
  // The input is sent (with hold_reads, nothing read yet).
  bool sent() const { return sent_.HasBeenNotified(); }
  bool granted() const { return granted_.HasBeenNotified(); }
  bool done() const { return done_.HasBeenNotified(); }
  void Go() {  // the test's thread only
    if (!go_.HasBeenNotified()) go_.Notify();
  }
  void Cancel() {
    if (!done()) ctx_.TryCancel();
  }
  // The final status once done, and whether the output was exact.
  grpc::Status status() {
    done_.WaitForNotification();
    return status_;
  }
  bool exact() {
    done_.WaitForNotification();
    return output_ == expected_;
  }

 private:
  void Run(Client& c) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto stream = c.stub().ConvertStream(&ctx_);
    v1::ConvertStreamRequest m;
    *m.mutable_header() = StreamHeaderFor(Spec(), shape_);
    v1::ConvertStreamResponse r;
    if (stream->Write(m) && stream->Read(&r) && r.has_header()) {
      granted_.Notify();
      go_.WaitForNotification();
      bool ok = true;
      for (uint64_t off = 0; ok && off < input_.size(); off += 1 << 20) {
        v1::ConvertStreamRequest ch;
        ch.mutable_chunk()->set_offset(off);
        ch.mutable_chunk()->set_data(input_.data() + off, std::min<uint64_t>(1 << 20, input_.size() - off));
        ok = stream->Write(ch);
      }
      stream->WritesDone();
      sent_.Notify();
      if (hold_reads_) read_on_.WaitForNotification();
      while (stream->Read(&r)) output_ += r.chunk().data();
    } else {
      stream->WritesDone();
    }
    status_ = stream->Finish();
    done_.Notify();
  }

  const bool hold_reads_;
  const std::vector<int64_t> shape_;
  const std::vector<uint8_t> input_;
  const std::string expected_;
  grpc::ClientContext ctx_;
  std::string output_;
  grpc::Status status_;
  absl::Notification granted_, go_, sent_, read_on_, done_;
  std::thread thread_;
};

// A unary Convert of one 4 MiB matrix on its own thread.
class Unary {
 public:
  Unary(Client& c, uint64_t seed)
      : input_(RandomBytes(kRows * kCols / 2, seed)), thread_([this, &c] {
          wprep::client::CallOptions o;
          o.timeout = std::chrono::seconds(120);
          result_.emplace(c.Convert(ConvertRequestFor(Spec(), {kRows, kCols}, input_), o));
          done_.Notify();
        }) {}
  ~Unary() { thread_.join(); }
  bool done() const { return done_.HasBeenNotified(); }
  absl::StatusOr<v1::ConvertResponse>& result() {
    done_.WaitForNotification();
    return *result_;
  }
  bool exact() {
    return result().ok() && result()->output_bytes_inline() == CpuReference(Spec(), {kRows, kCols}, input_);
  }

 private:
  const std::vector<uint8_t> input_;
  std::optional<absl::StatusOr<v1::ConvertResponse>> result_;
  absl::Notification done_;
  std::thread thread_;
};

// 32 MiB of host memory: a stream of one matrix, then one of two that does not fit beside
// it, then unary Converts that would fit beside the first but not beside the second. The
// two-matrix stream must be served before them, and they after it; one more than the
// queue holds is refused at once.
TEST(Admission, ALargeWaiterIsServedBeforeLaterSmallOnes) {
  constexpr uint64_t kLimit = 32ull << 20;
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--max-message-bytes=16M", "--max-buffered-bytes=32M",
                                              "--max-queue-wait=100s", "--max-queued-requests=4"});
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(Queued(*d), 0);
  for (const char* reason : {"timeout", "too_large", "queue_full", "cancelled"}) {
    EXPECT_EQ(Refused(*d, reason), 0) << reason;
  }
  Client c(MakeChannel(d->unix_target()));
  const uint64_t unary = InlineCharge({kRows, kCols});

  Stream holder(c, 1, 1);
  ASSERT_TRUE(WaitFor([&] { return holder.granted(); })) << d->Log();
  const double held = Metric(*d, "wprep_host_buffered_bytes");
  std::printf("a 4 MiB stream holds %.1f MiB; a 4 MiB unary Convert %.1f MiB\n", held / (1 << 20),
              static_cast<double>(unary) / (1 << 20));
  ASSERT_LE(held + static_cast<double>(unary), static_cast<double>(kLimit)) << "a unary Convert must fit beside it";

  Stream big(c, 2, 2);
  ASSERT_TRUE(WaitFor([&] { return Queued(*d) == 1; }));
  std::vector<std::unique_ptr<Unary>> small;
  for (int i = 0; i < 3; ++i) {
    small.push_back(std::make_unique<Unary>(c, 10 + i));
    ASSERT_TRUE(WaitFor([&] { return Queued(*d) == 2 + i; })) << "a small request that fits did not queue";
  }
  for (auto& u : small) EXPECT_FALSE(u->done()) << "a small request passed the waiting large one";
  EXPECT_FALSE(big.granted());

  // The queue holds four: a fifth is refused at once, naming the flag.
  {
    Unary fifth(c, 20);
    ASSERT_EQ(fifth.result().status().code(), absl::StatusCode::kResourceExhausted) << fifth.result().status();
    EXPECT_NE(fifth.result().status().message().find("--max-queued-requests"), std::string::npos)
        << fifth.result().status();
  }
  EXPECT_EQ(Refused(*d, "queue_full"), 1);

  holder.Go();
  ASSERT_TRUE(holder.status().ok()) << holder.status().error_message();
  EXPECT_TRUE(holder.exact());
  ASSERT_TRUE(WaitFor([&] { return big.granted(); })) << "the large request was not served when memory came back";
  ASSERT_TRUE(WaitFor([&] { return Queued(*d) == 3; }));
  const double big_held = Metric(*d, "wprep_host_buffered_bytes");
  ASSERT_GT(big_held + static_cast<double>(unary), static_cast<double>(kLimit))
      << "no unary Convert may fit beside the two-matrix stream, for this test to show the order";
  for (auto& u : small) EXPECT_FALSE(u->done()) << "a small request ran beside the large one";

  big.Go();
  ASSERT_TRUE(big.status().ok()) << big.status().error_message();
  EXPECT_TRUE(big.exact());
  for (auto& u : small) {
    ASSERT_TRUE(u->result().ok()) << u->result().status();
    EXPECT_TRUE(u->exact());
  }
  EXPECT_EQ(Queued(*d), 0);
  EXPECT_TRUE(WaitFor([&] { return Metric(*d, "wprep_host_buffered_bytes") == 0; }));
  // Every request that reached the budget was timed: 2 streams and 3 unary calls waited or
  // not; the fifth never queued.
  EXPECT_GE(Metric(*d, "wprep_host_buffer_wait_seconds_count"), 5);
  for (const char* reason : {"timeout", "too_large", "cancelled"}) EXPECT_EQ(Refused(*d, reason), 0) << reason;
}

TEST(Admission, AWaitEndsAtMaxQueueWaitAndTooLargeIsRefusedAtOnce) {
  std::unique_ptr<Daemon> d =
      StartCpuDaemon({"--max-message-bytes=16M", "--max-buffered-bytes=32M", "--max-queue-wait=1s"});
  ASSERT_NE(d, nullptr);
  Client c(MakeChannel(d->unix_target()));
  Stream holder(c, 1, 1);
  ASSERT_TRUE(WaitFor([&] { return holder.granted(); })) << d->Log();
  {
    Stream waits(c, 2, 2);  // does not fit beside the holder, and nothing frees memory
    const grpc::Status s = waits.status();
    EXPECT_FALSE(waits.granted());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("--max-queue-wait=1s"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(Refused(*d, "timeout"), 1);
  {
    Stream huge(c, 5, 3);  // five 4 MiB slices: its buffers (45 MiB) exceed the whole 32 MiB budget
    const grpc::Status s = huge.status();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("never fit"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("--max-buffered-bytes"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(Refused(*d, "too_large"), 1);
  holder.Go();
  ASSERT_TRUE(holder.status().ok()) << holder.status().error_message();
  EXPECT_TRUE(holder.exact());
  EXPECT_EQ(Queued(*d), 0);
}

TEST(Admission, ACancelledWaiterLeavesTheQueueAndTheDaemonServesOn) {
  std::unique_ptr<Daemon> d =
      StartCpuDaemon({"--max-message-bytes=16M", "--max-buffered-bytes=32M", "--max-queue-wait=100s"});
  ASSERT_NE(d, nullptr);
  Client c(MakeChannel(d->unix_target()));
  Stream holder(c, 1, 1);
  ASSERT_TRUE(WaitFor([&] { return holder.granted(); })) << d->Log();
  {
    Stream waits(c, 2, 2);
    ASSERT_TRUE(WaitFor([&] { return Queued(*d) == 1; }));
    waits.Cancel();
    EXPECT_EQ(waits.status().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor([&] { return Queued(*d) == 0; })) << "the cancelled call stayed in the queue";
    EXPECT_TRUE(WaitFor([&] { return Refused(*d, "cancelled") == 1; }));
    EXPECT_FALSE(waits.granted());
  }
  // The memory it did not take is there for the next request.
  Unary next(c, 5);
  ASSERT_TRUE(next.result().ok()) << next.result().status();
  EXPECT_TRUE(next.exact());
  holder.Go();
  ASSERT_TRUE(holder.status().ok()) << holder.status().error_message();
  EXPECT_EQ(Refused(*d, "timeout"), 0);
}

// Every waiter holds a gRPC thread (the sync server has no thread bound: it adds pollers
// as its threads block). With 64 requests waiting, a stream whose client does not read
// holds its memory; once the client reads, the stream ends, its memory comes back, and
// every waiter is served in turn: the waiting threads do not stop gRPC from moving the
// reader's answer and ending its call.
TEST(Admission, AnswersAreReadAndReleasedWhileManyRequestsWait) {
  constexpr int kWaiters = 64;
  std::unique_ptr<Daemon> d = StartCpuDaemon(
      {"--max-message-bytes=16M", "--max-buffered-bytes=32M", "--max-queue-wait=100s", "--max-queued-requests=100"});
  ASSERT_NE(d, nullptr);
  // The holder's connection takes 64 KiB at a time and never grows its window, so the
  // daemon cannot send the stream's 8 MiB of output until the holder reads.
  grpc::ChannelArguments slow;
  slow.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  slow.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 65536);
  slow.SetMaxReceiveMessageSize(-1);
  slow.SetInt("wprep.test.holder", 1);
  Client holder_client(grpc::CreateCustomChannel(d->unix_target(), grpc::InsecureChannelCredentials(), slow));
  Client c(MakeChannel(d->unix_target()));
  Stream holder(holder_client, 2, 1, /*hold_reads=*/true);
  ASSERT_TRUE(WaitFor([&] { return holder.granted(); })) << d->Log();
  holder.Go();
  ASSERT_TRUE(WaitFor([&] { return holder.sent(); }));
  const uint64_t unary = InlineCharge({kRows, kCols});
  std::vector<std::unique_ptr<Unary>> waiters;
  for (int i = 0; i < kWaiters; ++i) waiters.push_back(std::make_unique<Unary>(c, 100 + i));
  ASSERT_TRUE(WaitFor([&] { return Queued(*d) == kWaiters; })) << "queued: " << Queued(*d);
  const double held = Metric(*d, "wprep_host_buffered_bytes");
  ASSERT_GT(held + static_cast<double>(unary), 32.0 * (1 << 20)) << "the holder must leave no room for a waiter";
  for (auto& w : waiters) EXPECT_FALSE(w->done()) << "a waiter ran while the holder held the memory";
  holder.ReadOn();
  ASSERT_TRUE(holder.status().ok()) << holder.status().error_message();
  EXPECT_TRUE(holder.exact());
  int exact = 0;
  for (auto& w : waiters) {
    ASSERT_TRUE(w->result().ok()) << w->result().status();
    exact += w->exact() ? 1 : 0;
  }
  EXPECT_EQ(exact, kWaiters);
  EXPECT_EQ(Queued(*d), 0);
  EXPECT_EQ(Refused(*d, "timeout") + Refused(*d, "queue_full") + Refused(*d, "cancelled"), 0);
}

// Finding: each stream reserved 17.9 MB whatever its size, so of 2,000 concurrent streams
// of an 8 KiB tensor 59 were served and the rest refused. Now all 2,000 are admitted at
// once (each holds its answer header before any sends input), under the daemon's default
// limits: 40 connections of at most 64 streams (--max-concurrent-streams) each.
TEST(Admission, TwoThousandConcurrentSmallStreamsAreAllServedExactly) {
  constexpr int kStreams = 2000, kConnections = 40, kInputs = 8;
  const std::vector<int64_t> shape = {128, 128};  // 8 KiB of MXFP4
  std::unique_ptr<Daemon> d = StartCpuDaemon({});
  ASSERT_NE(d, nullptr);
  std::vector<std::vector<uint8_t>> inputs;
  std::vector<std::string> expected;
  for (int i = 0; i < kInputs; ++i) {
    inputs.push_back(RandomBytes(128 * 128 / 2, 100 + i));
    expected.push_back(CpuReference(Spec(), shape, inputs.back()));
  }
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kConnections; ++i) {
    clients.push_back(std::make_unique<Client>(MakeChannel(d->unix_target(), 256 << 20, i)));
  }
  std::atomic<int> admitted{0}, exact{0};
  absl::Notification all_admitted;
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::thread> threads;
  threads.reserve(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      auto stream = clients[i % kConnections]->stub().ConvertStream(&ctx);
      v1::ConvertStreamRequest m;
      *m.mutable_header() = StreamHeaderFor(Spec(), shape);
      v1::ConvertStreamResponse r;
      if (stream->Write(m) && stream->Read(&r) && r.has_header()) {
        if (admitted.fetch_add(1) + 1 == kStreams) all_admitted.Notify();
        // Bounded, so that a stream that never gets in fails the test instead of hanging it.
        all_admitted.WaitForNotificationWithTimeout(absl::Seconds(90));
        const std::vector<uint8_t>& in = inputs[i % kInputs];
        v1::ConvertStreamRequest ch;
        ch.mutable_chunk()->set_offset(0);
        ch.mutable_chunk()->set_data(in.data(), in.size());
        stream->Write(ch);
        stream->WritesDone();
        std::string out;
        while (stream->Read(&r)) out += r.chunk().data();
        if (out == expected[i % kInputs]) exact.fetch_add(1);
      } else {
        stream->WritesDone();
      }
      status[i] = stream->Finish();
    });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0;
  for (const grpc::Status& s : status) ok += s.ok() ? 1 : 0;
  for (const grpc::Status& s : status) {
    if (!s.ok()) {
      ADD_FAILURE() << "first failure: " << s.error_code() << " " << s.error_message();
      break;
    }
  }
  std::printf("%d concurrent 8 KiB streams: %d admitted together, %d OK, %d byte-exact\n", kStreams,
              admitted.load(), ok, exact.load());
  EXPECT_EQ(admitted.load(), kStreams);
  EXPECT_EQ(ok, kStreams);
  EXPECT_EQ(exact.load(), kStreams);
  EXPECT_EQ(Refused(*d, "timeout") + Refused(*d, "too_large") + Refused(*d, "queue_full"), 0);
}

}  // namespace
}  // namespace wprep::testing
