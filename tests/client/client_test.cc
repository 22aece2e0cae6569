// wprep::client against a real wprepd on the CPU engine: retries on UNAVAILABLE, the
// deadline over them, stream progress, and the batch and checkpoint builders. Outputs are
// checked against the local engine (wprep::ConvertOnCpu on the same bytes; the engine
// itself is checked against the reference vectors in tests/kernels).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon_harness.h"
#include "shared_daemon.h"
#include "golden.h"
#include "wprep/client/batch.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

namespace v1 = wprep::v1;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> Expected(const client::TensorConversion& c, const std::vector<uint8_t>& in) {
  absl::StatusOr<Plan> plan = MakePlan(c.spec, c.logical_shape, InputBinding{c.input_strides, in.size()});
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  std::vector<uint8_t> out(plan->output_bytes);
  EXPECT_TRUE(ConvertOnCpu(*plan, in.data(), in.size(), out.data(), out.size()).ok());
  return out;
}

std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

class ClientTest : public testing::SharedDaemonTest<ClientTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--devices=cpu", "--cpu-threads=2"}); }
};

std::string NobodyTarget() {
  return "unix://" + (std::filesystem::temp_directory_path() / ("wprep-nobody-" + std::to_string(getpid()) + ".sock")).string();
}

TEST_F(ClientTest, UnavailableIsRetriedAsThePolicySays) {
  client::Client c(NobodyTarget(), 1);
  absl::StatusOr<v1::ListDevicesResponse> once = c.ListDevices();
  ASSERT_FALSE(once.ok());
  EXPECT_EQ(once.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(once.status().message()).find("attempts"), std::string::npos);

  client::CallOptions o;
  o.retry.max_attempts = 3;
  o.retry.initial_backoff = std::chrono::milliseconds(10);
  absl::StatusOr<v1::ListDevicesResponse> thrice = c.ListDevices(o);
  ASSERT_FALSE(thrice.ok());
  EXPECT_EQ(thrice.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(thrice.status().message()).find("(after 3 attempts)"), std::string::npos) << thrice.status();
}

// A client that starts before its daemon gets its answer once the daemon is up.
TEST_F(ClientTest, RetriesReachADaemonThatStartsLater) {
  const std::string target = NobodyTarget();
  std::unique_ptr<testing::Daemon> late;
  std::string error;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    late = testing::Daemon::Start({"--devices=cpu", "--cpu-threads=1", "--listen=" + target}, &error);
  });
  client::Client c(target, 1);
  client::CallOptions o;
  o.retry.max_attempts = 200;
  o.retry.initial_backoff = std::chrono::milliseconds(20);
  o.retry.max_backoff = std::chrono::milliseconds(200);
  o.timeout = std::chrono::seconds(60);
  v1::PlanRequest req;
  req.mutable_spec()->set_layout(v1::LAYOUT_BLACKWELL_VALUE);
  req.mutable_spec()->set_direction(v1::DIRECTION_SWIZZLE);
  for (int64_t d : {256, 256}) req.add_logical_shape(d);
  absl::StatusOr<v1::PlanResponse> plan = c.Plan(req, o);
  starter.join();
  ASSERT_NE(late, nullptr) << error;
  ASSERT_TRUE(plan.ok()) << plan.status() << "\n" << late->Log();
  EXPECT_EQ(plan->identity().layout(), "BlackwellMXValueLayout()");
}

// The deadline covers the retries and their waits.
TEST_F(ClientTest, TheDeadlineEndsRetries) {
  client::Client c(NobodyTarget(), 1);
  client::CallOptions o;
  o.retry.max_attempts = 1000000;
  o.retry.initial_backoff = std::chrono::milliseconds(50);
  o.timeout = std::chrono::milliseconds(300);
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<v1::ListDevicesResponse> r = c.ListDevices(o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().code() == absl::StatusCode::kUnavailable ||
              r.status().code() == absl::StatusCode::kDeadlineExceeded)
      << r.status();
  // Far below what a million attempts would take: the loop ended at the deadline.
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20));
}

TEST_F(ClientTest, DeadlineExceededIsNotRetried) {
  client::Client c(daemon_->unix_target(), 1);
  client::StreamOptions o;
  o.timeout = std::chrono::milliseconds(1);
  o.retry.max_attempts = 5;
  v1::StreamRequestHeader h;
  h.mutable_spec()->set_layout(v1::LAYOUT_HOPPER_VALUE);
  h.mutable_spec()->set_direction(v1::DIRECTION_SWIZZLE);
  for (int64_t d : {64, 1024, 1024}) h.add_logical_shape(d);
  const std::vector<uint8_t> in(64u * 1024 * 512, 0x5A);
  std::string out;
  absl::StatusOr<v1::StreamResponseHeader> r = c.ConvertStream(h, in, &out, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_EQ(std::string(r.status().message()).find("attempts"), std::string::npos);
}

// Over two stripes and over one: the reports add up to every byte each way, never run
// backwards without a retry, and the output is the engine's.
TEST_F(ClientTest, StreamProgressCountsEveryByte) {
  client::TensorConversion conv;
  conv.spec.layout = Layout::kHopperValue;
  conv.spec.packing_axis = -2;
  conv.logical_shape = {6, 256, 384};
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(7, 6 * 384 * 128);
  const std::vector<uint8_t> want = Expected(conv, in);
  for (uint64_t stripe_min : {uint64_t{1}, UINT64_MAX}) {
    SCOPED_TRACE(stripe_min);
    client::Client c(daemon_->unix_target(), 2);
    std::vector<client::StreamProgress> reports;
    client::StreamOptions o;
    o.stripe_min_bytes = stripe_min;
    o.chunk_bytes = 16 << 10;
    o.progress = [&](const client::StreamProgress& p) { reports.push_back(p); };
    v1::StreamRequestHeader h;
    *h.mutable_spec() = SpecToProto(conv.spec);
    for (int64_t d : conv.logical_shape) h.add_logical_shape(d);
    std::string out;
    absl::StatusOr<v1::StreamResponseHeader> r = c.ConvertStream(h, in, &out, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(Bytes(out), want);
    EXPECT_EQ(r->identity().layout(), "HopperMXValueLayout(mx_axis=-2, mma_version=3)");
    ASSERT_FALSE(reports.empty());
    EXPECT_EQ(reports.back().bytes_sent, in.size());
    EXPECT_EQ(reports.back().bytes_received, want.size());
    EXPECT_EQ(reports.back().input_bytes, in.size());
    EXPECT_EQ(reports.back().output_bytes, want.size());
    EXPECT_GT(reports.size(), 8u);  // chunk by chunk, not once at the end
    for (size_t i = 1; i < reports.size(); ++i) {
      EXPECT_GE(reports[i].bytes_sent + reports[i].bytes_received,
                reports[i - 1].bytes_sent + reports[i - 1].bytes_received);
    }
  }
}

// A gpt-oss projection's values and scales in one ConvertBatch, built from the
// checkpoint's own shapes; the scales through the transposed view.
TEST_F(ClientTest, CheckpointPairConvertsInOneBatch) {
  const int64_t e = 3, n = 160, g = 3;  // K = 96
  ConversionSpec hv;
  hv.layout = Layout::kHopperValue;
  ConversionSpec hs;
  hs.layout = Layout::kHopperScale;
  absl::StatusOr<client::TensorConversion> values = client::CheckpointValues(hv, {e, n, g, 16});
  absl::StatusOr<client::TensorConversion> scales = client::CheckpointScales(hs, {e, n, g});
  ASSERT_TRUE(values.ok() && scales.ok());
  EXPECT_EQ(values->logical_shape, (std::vector<int64_t>{e, 96, n}));
  EXPECT_EQ(values->spec.packing_axis, -2);
  EXPECT_TRUE(values->input_strides.empty());
  EXPECT_EQ(scales->logical_shape, (std::vector<int64_t>{e, g, n}));
  EXPECT_EQ(scales->input_strides, (std::vector<int64_t>{n * g, 1, g}));
  EXPECT_FALSE(client::CheckpointValues(hv, {e, n, g}).ok());
  EXPECT_FALSE(client::CheckpointValues(hs, {e, n, g, 16}).ok());
  EXPECT_FALSE(client::CheckpointScales(hv, {e, n, g}).ok());

  const std::vector<uint8_t> vin = testing::SplitMix64Bytes(3, static_cast<uint64_t>(e * n * g * 16));
  const std::vector<uint8_t> sin = testing::SplitMix64Bytes(4, static_cast<uint64_t>(e * n * g));
  client::BatchBuilder b;
  EXPECT_EQ(b.AddInline(*values, vin), 0);
  EXPECT_EQ(b.AddInline(*scales, sin), 1);
  EXPECT_EQ(b.inline_bytes(), vin.size() + sin.size());
  client::Client c(daemon_->unix_target(), 1);
  absl::StatusOr<v1::ConvertBatchResponse> r = c.ConvertBatch(b.Take());
  EXPECT_TRUE(b.empty());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->items_size(), 2);
  EXPECT_EQ(Bytes(r->items(0).outputs(0).inline_bytes()), Expected(*values, vin));
  EXPECT_EQ(Bytes(r->items(1).outputs(0).inline_bytes()), Expected(*scales, sin));
  EXPECT_EQ(r->items(1).outputs(0).identity().layout(), "HopperMXScaleLayout(mx_axis=-2, num_warps=8)");
}

}  // namespace
}  // namespace wprep
