// HostBudget's waiting queue, in this process: FIFO order (a large waiter is not passed by
// later small ones), refusals (too large, queue full, --max-queue-wait, cancelled) and
// their messages and metrics. The same over a real daemon: admission_test.cc.
#include "rpc/host_budget.h"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "net/metrics.h"
#include "rpc/stream_pipeline.h"

namespace wprep::server {
namespace {

// Polls `pred` until true or `bound` passes (a bound on a wait, never a timed assertion).
bool WaitFor(const std::function<bool()>& pred, absl::Duration bound = absl::Seconds(20)) {
  const absl::Time until = absl::Now() + bound;
  while (!pred()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// A Take on its own thread; its result once done.
class Taker {
 public:
  Taker(HostBudget& b, uint64_t bytes, std::function<bool()> cancelled = nullptr,
        absl::Time deadline = absl::InfiniteFuture())
      : thread_([this, &b, bytes, cancelled, deadline] {
          result_.emplace(b.Take(bytes, "this test's request", deadline, cancelled));
          done_.Notify();
        }) {}
  ~Taker() { thread_.join(); }
  bool done() const { return done_.HasBeenNotified(); }
  absl::StatusOr<HostBudget::Charge>& result() {
    done_.WaitForNotification();
    return *result_;
  }

 private:
  absl::Notification done_;
  std::optional<absl::StatusOr<HostBudget::Charge>> result_;
  std::thread thread_;
};

TEST(HostBudget, ALargeWaiterIsServedBeforeLaterSmallOnesThatWouldFit) {
  HostBudget b(100, nullptr, BudgetQueue{absl::Seconds(60), 16});
  absl::StatusOr<HostBudget::Charge> first = b.Take(30, "first");
  absl::StatusOr<HostBudget::Charge> second = b.Take(30, "second");
  ASSERT_TRUE(first.ok() && second.ok());
  Taker big(b, 50);  // 60 + 50 > 100: waits
  ASSERT_TRUE(WaitFor([&] { return b.queued() == 1; }));
  Taker small(b, 30);  // 60 + 30 fits, but the big one came first
  ASSERT_TRUE(WaitFor([&] { return b.queued() == 2; }));
  EXPECT_FALSE(small.done()) << "a later small request passed a waiting large one";
  *first = HostBudget::Charge();  // 30 held: the big one fits (80), the small one then does not
  ASSERT_TRUE(big.result().ok()) << big.result().status();
  EXPECT_EQ(b.queued(), 1u);
  EXPECT_EQ(b.used(), 80u);
  EXPECT_FALSE(small.done());
  *second = HostBudget::Charge();  // 50 held: the small one fits
  ASSERT_TRUE(small.result().ok()) << small.result().status();
  EXPECT_EQ(b.used(), 80u);
  EXPECT_EQ(b.queued(), 0u);
}

TEST(HostBudget, MoreThanTheWholeBudgetIsRefusedAtOnceNamingTheFlag) {
  std::unique_ptr<Metrics> m = *Metrics::Create("", false);
  HostBudget b(100, m.get(), BudgetQueue{absl::InfiniteDuration(), 16});
  absl::StatusOr<HostBudget::Charge> c = b.Take(101, "this request");
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max-buffered-bytes"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("never fit"), std::string::npos) << c.status();
  EXPECT_EQ(m->buffer_refused(BufferRefusal::kTooLarge).Value(), 1);
  EXPECT_EQ(b.used(), 0u);
}

TEST(HostBudget, AWaitEndsAtMaxQueueWaitWithResourceExhausted) {
  std::unique_ptr<Metrics> m = *Metrics::Create("", false);
  HostBudget b(100, m.get(), BudgetQueue{absl::Milliseconds(100), 16});
  absl::StatusOr<HostBudget::Charge> held = b.Take(90, "held");
  ASSERT_TRUE(held.ok());
  absl::StatusOr<HostBudget::Charge> c = b.Take(20, "this request");
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max-queue-wait"), std::string::npos) << c.status();
  EXPECT_EQ(m->buffer_refused(BufferRefusal::kTimeout).Value(), 1);
  EXPECT_EQ(m->buffer_queue_requests().Value(), 0);
  EXPECT_EQ(b.queued(), 0u);
  EXPECT_EQ(b.used(), 90u);
}

TEST(HostBudget, AWaitEndsAtTheCallDeadline) {
  HostBudget b(100, nullptr, BudgetQueue{absl::InfiniteDuration(), 16});
  absl::StatusOr<HostBudget::Charge> held = b.Take(90, "held");
  ASSERT_TRUE(held.ok());
  absl::StatusOr<HostBudget::Charge> c = b.Take(20, "this request", absl::Now() + absl::Milliseconds(100));
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("deadline"), std::string::npos) << c.status();
}

TEST(HostBudget, ZeroMaxQueueWaitRefusesAtOnceAsBefore) {
  HostBudget b(100, nullptr, BudgetQueue{absl::ZeroDuration(), 16});
  absl::StatusOr<HostBudget::Charge> held = b.Take(90, "held");
  ASSERT_TRUE(held.ok());
  absl::StatusOr<HostBudget::Charge> c = b.Take(20, "this request");
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max-queue-wait=0"), std::string::npos) << c.status();
}

TEST(HostBudget, AFullQueueRefusesTheNextAtOnce) {
  std::unique_ptr<Metrics> m = *Metrics::Create("", false);
  HostBudget b(100, m.get(), BudgetQueue{absl::InfiniteDuration(), 1});
  absl::StatusOr<HostBudget::Charge> held = b.Take(90, "held");
  ASSERT_TRUE(held.ok());
  std::atomic<bool> gone{false};
  Taker waiting(b, 20, [&] { return gone.load(); });
  ASSERT_TRUE(WaitFor([&] { return b.queued() == 1; }));
  EXPECT_EQ(m->buffer_queue_requests().Value(), 1);
  absl::StatusOr<HostBudget::Charge> c = b.Take(20, "this request");
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max-queued-requests"), std::string::npos) << c.status();
  EXPECT_EQ(m->buffer_refused(BufferRefusal::kQueueFull).Value(), 1);
  gone = true;
  EXPECT_EQ(waiting.result().status().code(), absl::StatusCode::kCancelled);
}

TEST(HostBudget, ACancelledWaiterLeavesAndLetsTheNextIn) {
  std::unique_ptr<Metrics> m = *Metrics::Create("", false);
  HostBudget b(100, m.get(), BudgetQueue{absl::InfiniteDuration(), 16});
  absl::StatusOr<HostBudget::Charge> held = b.Take(60, "held");
  ASSERT_TRUE(held.ok());
  std::atomic<bool> gone{false};
  Taker head(b, 50, [&] { return gone.load(); });  // waits: 60 + 50 > 100
  ASSERT_TRUE(WaitFor([&] { return b.queued() == 1; }));
  Taker next(b, 40);  // would fit, waits behind the head
  ASSERT_TRUE(WaitFor([&] { return b.queued() == 2; }));
  gone = true;
  EXPECT_EQ(head.result().status().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(next.result().ok()) << next.result().status();
  EXPECT_EQ(b.used(), 100u);
  EXPECT_EQ(m->buffer_refused(BufferRefusal::kCancelled).Value(), 1);
  EXPECT_EQ(m->buffer_queue_requests().Value(), 0);
  // One granted at once, two that waited (one granted, one cancelled).
  EXPECT_EQ(m->buffer_wait_seconds().Collect().histogram.sample_count, 3u);
}

// What a stream reserves follows its tensor: an 8 KiB tensor's stream holds tens of KiB,
// a large one no more than the fixed bound of its slice.
TEST(StreamPipeline, ASmallTensorsStreamReservesLittle) {
  const uint64_t small = StreamPipeline::HostBytes(8 << 10, 8 << 10, 8 << 10);
  EXPECT_GE(small, 3u * (8 << 10));  // its input slice, its output, one output chunk
  EXPECT_LE(small, 64u << 10);
  const uint64_t slice = 4 << 20;
  const uint64_t large = StreamPipeline::HostBytes(1ull << 30, slice, slice);
  EXPECT_EQ(large, StreamPipeline::HostBytes(slice) + slice);
  EXPECT_EQ(StreamPipeline::HostBytes(0, 0, 0), 0u);
  EXPECT_EQ(StreamPipeline::HostBytes(UINT64_MAX, UINT64_MAX / 2, UINT64_MAX / 2), UINT64_MAX);
}

}  // namespace
}  // namespace wprep::server
