// wprepd as a real process on the CPU engine: every golden case through Convert (Unix
// socket and TCP) and ConvertStream, concurrent clients, health transitions, SIGTERM
// drain and metrics scraped over HTTP.
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <set>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon_harness.h"
#include "golden_rpc.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;

std::unique_ptr<Daemon> StartOrDie(const std::vector<std::string>& args = {}) {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(args, &error);
  EXPECT_NE(d, nullptr) << error;
  return d;
}

// The CPU-engine tests pin the daemon to the CPU (--devices=cpu) so they test the same
// thing on a GPU machine.
// Every reference case of every set (values, scales, checkpoint order) as a Convert,
// strided inputs with source_strides.
TEST(Daemon, EveryGoldenCaseThroughConvertOnUnixAndTcp) {
  auto d = StartOrDie({"--devices=cpu"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  ASSERT_FALSE(d->tcp_target().empty());
  Client unix_client(MakeChannel(d->unix_target()));
  Client tcp_client(MakeChannel(d->tcp_target()));
  int ok_cases = 0, error_cases = 0, strided = 0;
  for (GoldenSet set : {GoldenSet::kValues, GoldenSet::kScales, GoldenSet::kPacking}) {
    for (const GoldenCase& c : GoldenCases(set)) {
      SCOPED_TRACE(c.name);
      if (c.error) {
        wprep::v1::ConvertRequest r = ConvertRequestFor(c.spec, c.logical_shape, {});
        absl::StatusOr<wprep::v1::ConvertResponse> resp = unix_client.Convert(r);
        EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument) << resp.status();
        ++error_cases;
        continue;
      }
      const std::vector<uint8_t> in = GoldenInput(c);
      wprep::v1::ConvertRequest r = ConvertRequestFor(c.spec, c.logical_shape, in);
      for (int64_t st : c.input_strides) r.add_source_strides(st);
      strided += !c.input_strides.empty();
      for (Client* client : {&unix_client, &tcp_client}) {
        absl::StatusOr<wprep::v1::ConvertResponse> resp = client->Convert(r);
        ASSERT_TRUE(resp.ok()) << resp.status();
        EXPECT_TRUE(MatchesGolden(c, resp->output_bytes_inline()));
        EXPECT_EQ(resp->output_bytes(), c.output_bytes);
        EXPECT_EQ(std::vector<int64_t>(resp->output_shape().begin(), resp->output_shape().end()), c.output_shape);
        EXPECT_EQ(std::vector<int64_t>(resp->output_strides().begin(), resp->output_strides().end()),
                  ExpectedOutputStrides(c));
        EXPECT_EQ(resp->engine(), "cpu");
        EXPECT_EQ(resp->identity().layout(), LayoutIdentity(c.spec));
        EXPECT_EQ(resp->identity().contract_version(), static_cast<uint32_t>(kLayoutContractVersion));
      }
      ++ok_cases;
    }
  }
  EXPECT_GT(ok_cases, 200);
  EXPECT_GT(error_cases, 0);
  EXPECT_GT(strided, 10);
}

// The same through ConvertStream (dense inputs only: a stream carries the tensor in
// memory order).
TEST(Daemon, EveryGoldenCaseThroughConvertStream) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  int streamed = 0;
  for (GoldenSet set : {GoldenSet::kValues, GoldenSet::kScales, GoldenSet::kPacking}) {
    for (const GoldenCase& c : GoldenCases(set)) {
      SCOPED_TRACE(c.name);
      std::string out;
      if (c.error) {
        absl::StatusOr<wprep::v1::StreamResponseHeader> h =
            client.ConvertStream(StreamHeaderFor(c.spec, c.logical_shape), {}, &out);
        EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
        continue;
      }
      if (!c.input_strides.empty()) continue;
      const std::vector<uint8_t> in = GoldenInput(c);
      // Small chunks that do not line up with matrices exercise the daemon's slicing.
      wprep::client::StreamOptions opts;
      opts.chunk_bytes = 4093;
      absl::StatusOr<wprep::v1::StreamResponseHeader> h =
          client.ConvertStream(StreamHeaderFor(c.spec, c.logical_shape), in, &out, opts);
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_EQ(h->input_bytes(), c.input_bytes);
      EXPECT_EQ(h->output_bytes(), c.output_bytes);
      EXPECT_TRUE(MatchesGolden(c, out));
      EXPECT_EQ(h->identity().layout(), LayoutIdentity(c.spec));
      ++streamed;
    }
  }
  EXPECT_GT(streamed, 150);  // 199 dense cases in the three sets
}

// A client with three connections stripes every tensor with a leading dim (the minimum
// size set to 0) into up to three concurrent streams: the output bytes and the header
// (shape and strides of the whole tensor, as the reference reports them) must be those
// of the unstriped conversion.
TEST(Daemon, StripedStreamsMatchEveryGoldenCase) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(d->unix_target(), 3);
  wprep::client::StreamOptions opts;
  opts.stripe_min_bytes = 0;
  opts.chunk_bytes = 4093;
  int striped = 0;
  for (const GoldenCase& c : GoldenCases()) {
    if (c.error || c.logical_shape.size() < 3) continue;
    SCOPED_TRACE(c.name);
    striped += c.logical_shape[0] >= 2;
    std::string out;
    absl::StatusOr<wprep::v1::StreamResponseHeader> h =
        client.ConvertStream(StreamHeaderFor(c.spec, c.logical_shape), GoldenInput(c), &out, opts);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_TRUE(MatchesGolden(c, out));
    EXPECT_EQ(std::vector<int64_t>(h->output_shape().begin(), h->output_shape().end()), c.output_shape);
    EXPECT_EQ(std::vector<int64_t>(h->output_strides().begin(), h->output_strides().end()),
              c.output_strides);
    EXPECT_EQ(h->output_bytes(), c.output_bytes);
    EXPECT_EQ(h->input_bytes(), c.input_bytes);
  }
  EXPECT_GT(striped, 5);  // the golden set has multi-matrix cases to stripe
  // A striped stream that the daemon refuses fails as a whole, with the daemon's status.
  std::string out;
  const std::vector<uint8_t> short_input(100, 0);
  absl::StatusOr<wprep::v1::StreamResponseHeader> bad = client.ConvertStream(
      StreamHeaderFor(HopperSpec(Direction::kSwizzle, -1, 3), {4, 64, 64}), short_input, &out, opts);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

// Tensors with many leading-dim matrices and slices of several MiB go through the
// daemon's slicing with whole-slice, partial and remainder pieces.
TEST(Daemon, StreamOfManyMatricesMatchesCpuEngine) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  struct Case {
    ConversionSpec spec;
    std::vector<int64_t> shape;
  };
  ConversionSpec bw;
  bw.layout = Layout::kBlackwellShuffledValue;
  bw.direction = Direction::kSwizzle;
  const std::vector<Case> cases = {
      {HopperSpec(Direction::kSwizzle, -2, 3), {3, 5, 512, 1024}},   // 15 x 256 KiB
      {HopperSpec(Direction::kSwizzle, -1, 2), {9, 2048, 4096}},      // 9 x 4 MiB
      {bw, {7, 300, 258}},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Plan> plan = MakePlan(c.spec, c.shape);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const std::vector<uint8_t> in = RandomBytes(plan->input_bytes, 77);
    for (uint64_t chunk : {uint64_t{1} << 20, uint64_t{4} << 20, uint64_t{777777}}) {
      std::string out;
      wprep::client::StreamOptions opts;
      opts.chunk_bytes = chunk;
      absl::StatusOr<wprep::v1::StreamResponseHeader> h =
          client.ConvertStream(StreamHeaderFor(c.spec, c.shape), in, &out, opts);
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_TRUE(out == CpuReference(c.spec, c.shape, in)) << Describe(c.spec) << " chunk " << chunk;
    }
  }
}

TEST(Daemon, ThirtyTwoConcurrentClientsWithMixedSizesAllExact) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  constexpr int kClients = 32;
  const std::vector<std::vector<int64_t>> shapes = {
      {256, 128}, {2, 512, 256}, {1024, 2048}, {130, 66}, {4, 1024, 1024}, {3, 300, 200}};
  std::vector<std::string> failures(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      // Half the clients share nothing (own channel over TCP), half use the Unix socket.
      Client client(MakeChannel(t % 2 == 0 ? d->unix_target() : d->tcp_target()));
      for (int i = 0; i < 3; ++i) {
        const auto& shape = shapes[(t + i) % shapes.size()];
        const ConversionSpec spec = HopperSpec(i == 1 ? Direction::kUnswizzle : Direction::kSwizzle,
                                               t % 2 == 0 ? -1 : -2, 2 + (t / 2) % 2);
        absl::StatusOr<Plan> plan = MakePlan(spec, shape);
        if (!plan.ok()) {
          failures[t] = plan.status().ToString();
          return;
        }
        const std::vector<uint8_t> in = RandomBytes(plan->input_bytes, 1000 + t * 10 + i);
        std::string out;
        if ((t + i) % 3 == 0) {
          absl::StatusOr<wprep::v1::StreamResponseHeader> h =
              client.ConvertStream(StreamHeaderFor(spec, shape), in, &out);
          if (!h.ok()) {
            failures[t] = h.status().ToString();
            return;
          }
        } else {
          absl::StatusOr<wprep::v1::ConvertResponse> r = client.Convert(ConvertRequestFor(spec, shape, in));
          if (!r.ok()) {
            failures[t] = r.status().ToString();
            return;
          }
          out = r->output_bytes_inline();
        }
        if (out != CpuReference(spec, shape, in)) {
          failures[t] = absl::StrCat("wrong bytes for ", Describe(spec), " request ", i);
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(failures[t], "") << "client " << t;
  EXPECT_EQ(d->Health(), 1);
}

TEST(Daemon, HealthIsNotServingUntilWarmThenServing) {
  auto d = StartOrDie({"--testing-warmup-gate=/tmp/wprepd-gate-placeholder"});
  ASSERT_NE(d, nullptr);
  // The gate file does not exist: the daemon listens but must not serve.
  EXPECT_EQ(d->Health(), 2);
  EXPECT_EQ(d->Health("wprep.v1.WeightPrep"), 2);
  Client client(MakeChannel(d->unix_target()));
  absl::StatusOr<wprep::v1::ListDevicesResponse> early = client.ListDevices();
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable) << early.status();
  EXPECT_NE(early.status().message().find("warming up"), std::string::npos) << early.status();
  d->Signal(SIGTERM);
  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Daemon, HealthGoesServingWhenWarmupGateOpens) {
  char tmpl[] = "/tmp/wprepd-gate-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string gate = std::string(tmpl) + "/open";
  auto d = StartOrDie({"--testing-warmup-gate=" + gate, "--devices=cpu"});
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->Health(), 2);
  { std::ofstream(gate) << "go"; }
  EXPECT_TRUE(d->WaitServing()) << d->Log();
  EXPECT_EQ(d->Health("wprep.v1.WeightPrep"), 1);
  Client client(MakeChannel(d->unix_target()));
  absl::StatusOr<wprep::v1::ListDevicesResponse> dev = client.ListDevices();
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_TRUE(dev->cpu_engine());
  std::remove(gate.c_str());
  rmdir(tmpl);
}

// SIGTERM while a stream is in flight: health turns NOT_SERVING, new work is refused
// with UNAVAILABLE, the in-flight stream completes byte-exact, and the process exits 0.
TEST(Daemon, SigtermDrainsInFlightStreamAndExitsZero) {
  auto d = StartOrDie({"--drain-timeout=120s"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  const ConversionSpec spec = HopperSpec(Direction::kSwizzle, -2, 3);
  const std::vector<int64_t> shape = {4, 1024, 1024};
  absl::StatusOr<Plan> plan = MakePlan(spec, shape);
  ASSERT_TRUE(plan.ok());
  const std::vector<uint8_t> in = RandomBytes(plan->input_bytes, 5);

  Client client(MakeChannel(d->unix_target()));
  grpc::ClientContext ctx;
  auto stream = client.stub().ConvertStream(&ctx);
  wprep::v1::ConvertStreamRequest msg;
  *msg.mutable_header() = StreamHeaderFor(spec, shape);
  ASSERT_TRUE(stream->Write(msg));
  wprep::v1::ConvertStreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp));  // the daemon admitted the stream and sent its header
  ASSERT_TRUE(resp.has_header());
  const uint64_t half = in.size() / 2;
  msg.mutable_chunk()->set_offset(0);
  msg.mutable_chunk()->set_data(in.data(), half);
  ASSERT_TRUE(stream->Write(msg));

  d->Signal(SIGTERM);
  ASSERT_TRUE(d->WaitHealth(2)) << d->Log();
  Client other(MakeChannel(d->unix_target()));
  absl::StatusOr<wprep::v1::ConvertResponse> refused =
      other.Convert(ConvertRequestFor(spec, {256, 128}, RandomBytes(256 * 64, 1)));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("draining"), std::string::npos) << refused.status();

  for (uint64_t off = half; off < in.size(); off += 1 << 20) {
    const uint64_t n = std::min<uint64_t>(1 << 20, in.size() - off);
    msg.mutable_chunk()->set_offset(off);
    msg.mutable_chunk()->set_data(in.data() + off, n);
    ASSERT_TRUE(stream->Write(msg));
  }
  stream->WritesDone();
  std::string out;
  while (stream->Read(&resp)) {
    ASSERT_TRUE(resp.has_chunk());
    ASSERT_EQ(resp.chunk().offset(), out.size());
    out += resp.chunk().data();
  }
  grpc::Status st = stream->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(out == CpuReference(spec, shape, in));

  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_NE(d->Log().find("event=stopped drained=true"), std::string::npos) << d->Log();
}

TEST(Daemon, UnixSocketIsGroupOnlyAndRequestsAreLoggedWithIds) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  struct stat st;
  ASSERT_EQ(stat((d->dir() + "/wprepd.sock").c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  Client client(MakeChannel(d->unix_target()));
  grpc::ClientContext ctx;
  wprep::v1::ConvertRequest r = ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {256, 127}, {});
  wprep::v1::ConvertResponse resp;
  EXPECT_EQ(client.stub().Convert(&ctx, r, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The request id comes back as metadata and names the request's log line.
  auto it = ctx.GetServerInitialMetadata().find("x-wprep-request-id");
  ASSERT_NE(it, ctx.GetServerInitialMetadata().end());
  const std::string id(it->second.data(), it->second.size());
  const std::string log = d->Log();
  const size_t line = log.find("event=request id=" + id + " method=Convert");
  ASSERT_NE(line, std::string::npos) << log;
  const std::string text = log.substr(line, log.find('\n', line) - line);
  EXPECT_NE(text.find("code=INVALID_ARGUMENT"), std::string::npos) << text;
  EXPECT_NE(text.find("error="), std::string::npos) << text;
}

TEST(Daemon, SigintWithNothingInFlightExitsZero) {
  auto d = StartOrDie();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  d->Signal(SIGINT);
  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Daemon, MetricsServedOverHttpMoveWithTraffic) {
  auto d = StartOrDie({"--devices=cpu"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  ASSERT_FALSE(d->metrics_address().empty());
  const std::string before = HttpGet(d->metrics_address(), "/metrics");
  ASSERT_FALSE(before.empty());
  // The documented series exist from the start.
  for (const char* name : {"wprep_build_info", "wprep_device_warm", "wprep_ipc_cache_entries",
                           "wprep_ipc_cache_hits_total", "wprep_ipc_cache_misses_total",
                           "wprep_converted_bytes_total", "wprep_in_flight_requests",
                           "wprep_device_allocated_bytes", "wprep_device_allocated_high_water_bytes"}) {
    EXPECT_TRUE(MetricValue(before, name).has_value()) << name;
  }
  EXPECT_EQ(MetricValue(before, "wprep_build_info"), 1.0);
  // Every successful kind of request has its series, at zero, before any traffic.
  EXPECT_EQ(MetricValue(before, "wprep_requests_total",
                        {{"method", "Convert"},
                         {"layout", "blackwell_shuffled_value"},
                         {"direction", "retile"},
                         {"transport", "ipc_to_ipc"},
                         {"code", "OK"}}),
            0.0)
      << before;
  EXPECT_EQ(MetricValue(before, "wprep_requests_total", {{"method", "ReleaseIpcHandles"}, {"code", "OK"}}),
            0.0);
  EXPECT_EQ(MetricValue(before, "wprep_request_duration_seconds_count", {{"method", "ConvertStream"}}), 0.0);
  EXPECT_EQ(MetricValue(before, "wprep_request_peak_extra_device_bytes_count", {{"transport", "stream"}}), 0.0);
  EXPECT_EQ(MetricValue(before, "wprep_device_warm", {{"device", "cpu"}}), 1.0);
  EXPECT_EQ(MetricValue(before, "wprep_ipc_cache_entries"), 0.0);
  EXPECT_EQ(MetricValue(before, "wprep_in_flight_requests", {{"device", "cpu"}}), 0.0);

  Client client(MakeChannel(d->unix_target()));
  const ConversionSpec spec = HopperSpec(Direction::kSwizzle, -1, 2);
  constexpr int kConverts = 5;
  uint64_t out_bytes = 0;
  for (int i = 0; i < kConverts; ++i) {
    absl::StatusOr<wprep::v1::ConvertResponse> r =
        client.Convert(ConvertRequestFor(spec, {256, 128}, RandomBytes(256 * 64, i)));
    ASSERT_TRUE(r.ok()) << r.status();
    out_bytes += r->output_bytes();
  }
  std::string out;
  const std::vector<uint8_t> sin = RandomBytes(2 * 512 * 128, 9);
  ASSERT_TRUE(client.ConvertStream(StreamHeaderFor(spec, {2, 512, 256}), sin, &out).ok());
  out_bytes += out.size();
  absl::StatusOr<wprep::v1::ConvertResponse> bad =
      client.Convert(ConvertRequestFor(spec, {256, 127}, {}));
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);

  const std::string after = HttpGet(d->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(after, "wprep_requests_total",
                        {{"method", "Convert"}, {"layout", "hopper_value"}, {"direction", "swizzle"},
                         {"transport", "bytes_to_bytes"}, {"code", "OK"}}),
            double{kConverts});
  EXPECT_EQ(MetricValue(after, "wprep_requests_total",
                        {{"method", "ConvertStream"}, {"transport", "stream"}, {"code", "OK"}}),
            1.0);
  EXPECT_EQ(MetricValue(after, "wprep_requests_total",
                        {{"method", "Convert"}, {"code", "INVALID_ARGUMENT"}}),
            1.0);
  EXPECT_EQ(MetricValue(after, "wprep_request_duration_seconds_count", {{"method", "Convert"}}),
            double{kConverts + 1});
  // Every duration is below the top bucket (60 s) and above 0.
  EXPECT_EQ(MetricValue(after, "wprep_request_duration_seconds_bucket",
                        {{"method", "Convert"}, {"le", "60"}}),
            double{kConverts + 1});
  EXPECT_TRUE(MetricValue(after, "wprep_request_duration_seconds_bucket",
                          {{"method", "Convert"}, {"le", "1e-05"}})
                  .has_value());
  EXPECT_GT(*MetricValue(after, "wprep_request_duration_seconds_sum", {{"method", "Convert"}}), 0.0);
  EXPECT_EQ(MetricValue(after, "wprep_converted_bytes_total", {{"device", "cpu"}}),
            static_cast<double>(out_bytes));
  EXPECT_GE(*MetricValue(after, "wprep_kernel_duration_seconds_count", {{"device", "cpu"}}),
            double{kConverts + 1});
  // The CPU engine allocates no device memory: its peaks are all in the 0 bucket.
  EXPECT_EQ(MetricValue(after, "wprep_request_peak_extra_device_bytes_bucket",
                        {{"transport", "bytes_to_bytes"}, {"le", "0"}}),
            double{kConverts});
  EXPECT_EQ(MetricValue(after, "wprep_request_peak_extra_device_bytes_count",
                        {{"transport", "bytes_to_bytes"}}),
            double{kConverts});
}

// Before SERVING the daemon calls every method over each of its listeners (the self
// warm-up of the RPC path); those calls leave no trace in the request metrics, the
// device metrics or the request log, and take no request ids.
TEST(Daemon, SelfWarmupCallsEveryListenerWithoutCountingIt) {
  auto d = StartOrDie({"--devices=cpu"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  const std::string log = d->Log();
  EXPECT_EQ(log.find("rpc_warmup_failed"), std::string::npos) << log;
  EXPECT_EQ(log.find("event=request "), std::string::npos) << log;
  const size_t serving = log.find("event=serving");
  ASSERT_NE(serving, std::string::npos) << log;
  int lines = 0;
  for (size_t at = log.find("event=rpc_warmup "); at != std::string::npos;
       at = log.find("event=rpc_warmup ", at + 1)) {
    ++lines;
    EXPECT_LT(at, serving) << log;
  }
  EXPECT_EQ(lines, 2) << log;  // the harness listens on a Unix socket and on TCP
  // On the CPU engine: ListDevices, Plan, three Converts, a ConvertStream, Register and
  // Release.
  for (const std::string& target : {d->unix_target(), d->tcp_target()}) {
    EXPECT_NE(log.find("event=rpc_warmup address=" + target + " calls=8 seconds="), std::string::npos)
        << target << "\n" << log;
  }

  const std::string m = HttpGet(d->metrics_address(), "/metrics");
  ASSERT_FALSE(m.empty());
  // Counters are never negative, so a sum of 0 means no series moved.
  EXPECT_EQ(MetricValue(m, "wprep_requests_total").value_or(0), 0.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_request_duration_seconds_count").value_or(0), 0.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_converted_bytes_total", {{"device", "cpu"}}), 0.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_kernel_duration_seconds_count").value_or(0), 0.0) << m;

  // The first client request takes the first request id.
  Client client(MakeChannel(d->unix_target()));
  grpc::ClientContext ctx;
  wprep::v1::ListDevicesResponse resp;
  ASSERT_TRUE(client.stub().ListDevices(&ctx, wprep::v1::ListDevicesRequest(), &resp).ok());
  auto id = ctx.GetServerInitialMetadata().find("x-wprep-request-id");
  ASSERT_NE(id, ctx.GetServerInitialMetadata().end());
  EXPECT_EQ(std::string(id->second.data(), id->second.size()), "1");
}

// Only the daemon knows its warm-up token: a client sending x-wprep-warmup with any
// other value is an ordinary request, counted, logged and given an id.
TEST(Daemon, WarmupMetadataWithAWrongTokenIsCountedAndLogged) {
  auto d = StartOrDie({"--devices=cpu"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  wprep::client::CallOptions opts;
  opts.metadata = {{"x-wprep-warmup", std::string(32, '0')}};
  ASSERT_TRUE(client.ListDevices(opts).ok());
  const ConversionSpec spec = HopperSpec(Direction::kSwizzle, -1, 2);
  absl::StatusOr<wprep::v1::ConvertResponse> r =
      client.Convert(ConvertRequestFor(spec, {256, 128}, RandomBytes(256 * 64, 3)), opts);
  ASSERT_TRUE(r.ok()) << r.status();

  const std::string m = HttpGet(d->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(m, "wprep_requests_total", {{"method", "ListDevices"}, {"code", "OK"}}), 1.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_requests_total", {{"method", "Convert"}, {"code", "OK"}}), 1.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_requests_total"), 2.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_converted_bytes_total", {{"device", "cpu"}}),
            static_cast<double>(r->output_bytes()));
  const std::string log = d->Log();
  EXPECT_NE(log.find("event=request id=1 method=ListDevices"), std::string::npos) << log;
  EXPECT_NE(log.find("event=request id=2 method=Convert"), std::string::npos) << log;
}

}  // namespace
}  // namespace wprep::testing

namespace wprep::testing {
namespace {

namespace v1 = wprep::v1;

v1::BatchItem InlineItem(const GoldenCase& c, const std::vector<uint8_t>& in) {
  v1::BatchItem item;
  v1::ConvertItem* ci = item.mutable_convert();
  *ci->mutable_spec() = wprep::SpecToProto(c.spec);
  for (int64_t d : c.logical_shape) ci->add_logical_shape(d);
  ci->mutable_source()->set_inline_bytes(AsString(in));
  for (int64_t st : c.input_strides) ci->mutable_source()->add_inline_strides(st);
  return item;
}

// Small cases of every set (values, scales, checkpoint order), and of every layout.
std::vector<const GoldenCase*> MixedCases(size_t max_bytes) {
  std::vector<const GoldenCase*> out;
  for (GoldenSet set : {GoldenSet::kValues, GoldenSet::kScales, GoldenSet::kPacking}) {
    for (const GoldenCase& c : GoldenCases(set)) {
      if (!c.error && c.input_bytes <= max_bytes && c.output_bytes <= max_bytes) out.push_back(&c);
    }
  }
  return out;
}

// A batch of mixed layouts gives, item for item, the bytes, shapes, strides and layout
// identity of the same items converted one by one (and of the reference vectors).
TEST(Batch, MixedLayoutsEqualTheSameItemsOneByOne) {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  const std::vector<const GoldenCase*> cases = MixedCases(64 << 10);
  ASSERT_GT(cases.size(), 100u);
  v1::ConvertBatchRequest batch;
  std::vector<std::vector<uint8_t>> inputs;
  std::set<Layout> layouts;
  for (const GoldenCase* c : cases) {
    inputs.push_back(GoldenInput(*c));
    *batch.add_items() = InlineItem(*c, inputs.back());
    layouts.insert(c->spec.layout);
  }
  EXPECT_EQ(layouts.size(), AllLayouts().size());
  absl::StatusOr<v1::ConvertBatchResponse> r = client.ConvertBatch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->items_size(), static_cast<int>(cases.size()));
  EXPECT_EQ(r->peak_extra_device_bytes(), 0u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const GoldenCase& c = *cases[i];
    SCOPED_TRACE(c.name);
    const v1::BatchItemResult& item = r->items(static_cast<int>(i));
    ASSERT_EQ(item.outputs_size(), 1);
    const v1::TensorResult& t = item.outputs(0);
    EXPECT_TRUE(MatchesGolden(c, t.inline_bytes()));
    v1::ConvertRequest one = ConvertRequestFor(c.spec, c.logical_shape, inputs[i]);
    for (int64_t st : c.input_strides) one.add_source_strides(st);
    absl::StatusOr<v1::ConvertResponse> single = client.Convert(one);
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_EQ(t.inline_bytes(), single->output_bytes_inline());
    EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()),
              std::vector<int64_t>(single->output_shape().begin(), single->output_shape().end()));
    EXPECT_EQ(std::vector<int64_t>(t.strides().begin(), t.strides().end()),
              std::vector<int64_t>(single->output_strides().begin(), single->output_strides().end()));
    EXPECT_EQ(t.bytes(), c.output_bytes);
    EXPECT_EQ(t.identity().layout(), single->identity().layout());
    EXPECT_EQ(t.identity().conversion(), ConversionIdentity(c.spec));
    EXPECT_EQ(item.engine(), "cpu");
  }
  // Per item and per request in the metrics.
  const std::string metrics = HttpGet(d->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, "wprep_requests_total", {{"method", "ConvertBatch"}, {"code", "OK"}}), 1.0);
  EXPECT_EQ(MetricValue(metrics, "wprep_batch_items_total", {{"code", "OK"}}), static_cast<double>(cases.size()));
  EXPECT_EQ(MetricValue(metrics, "wprep_batch_items_total", {{"layout", "hopper_scale"}, {"code", "OK"}}),
            static_cast<double>(std::count_if(cases.begin(), cases.end(), [](const GoldenCase* c) {
              return c->spec.layout == Layout::kHopperScale;
            })));
}

// One bad item fails the whole batch with INVALID_ARGUMENT naming it and its field.
TEST(Batch, OneInvalidItemFailsTheBatchNamingTheItem) {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--max-batch-items=64"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  const std::vector<const GoldenCase*> cases = MixedCases(16 << 10);
  ASSERT_GT(cases.size(), 8u);
  auto good_batch = [&] {
    v1::ConvertBatchRequest b;
    for (size_t i = 0; i < 6; ++i) *b.add_items() = InlineItem(*cases[i], GoldenInput(*cases[i]));
    return b;
  };
  struct Bad {
    std::function<void(v1::ConvertBatchRequest&)> spoil;
    absl::StatusCode code;
    std::string part;
  };
  std::vector<Bad> bad = {
      {[](v1::ConvertBatchRequest& b) { b.mutable_items(3)->mutable_convert()->mutable_spec()->set_layout(static_cast<v1::Layout>(42)); },
       absl::StatusCode::kInvalidArgument, "items[3].convert.spec.layout"},
      {[](v1::ConvertBatchRequest& b) { b.mutable_items(4)->mutable_convert()->mutable_source()->set_inline_bytes("x"); },
       absl::StatusCode::kInvalidArgument, "items[4].convert"},
      {[](v1::ConvertBatchRequest& b) { b.mutable_items(2)->mutable_convert()->mutable_source()->Clear(); },
       absl::StatusCode::kInvalidArgument, "items[2].convert.source is not set"},
      {[](v1::ConvertBatchRequest& b) {
         b.mutable_items(5)->mutable_convert()->mutable_destination()->mutable_ipc()->set_handle(std::string(63, 'h'));
       },
       absl::StatusCode::kInvalidArgument, "items[5].convert.destination.ipc.handle"},
      {[](v1::ConvertBatchRequest& b) { b.mutable_items(1)->clear_kind(); }, absl::StatusCode::kInvalidArgument,
       "items[1].kind"},
      {[](v1::ConvertBatchRequest& b) {
         v1::BatchItem one = b.items(0);
         for (int i = 0; i < 64; ++i) *b.add_items() = one;
       },
       absl::StatusCode::kResourceExhausted, "--max-batch-items"},
      {[](v1::ConvertBatchRequest& b) { b.clear_items(); }, absl::StatusCode::kInvalidArgument, "items is empty"},
  };
  for (Bad& c : bad) {
    v1::ConvertBatchRequest b = good_batch();
    c.spoil(b);
    absl::StatusOr<v1::ConvertBatchResponse> r = client.ConvertBatch(b);
    EXPECT_EQ(r.status().code(), c.code) << c.part << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.part), std::string::npos) << r.status();
  }
  absl::StatusOr<v1::ConvertBatchResponse> ok = client.ConvertBatch(good_batch());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->items_size(), 6);
}

// ConvertBatches: every batch sent before any answer is read, good and bad mixed. Each
// gets one answer, in order, with its index, its own status (a bad one names its item,
// the stream goes on) and the results ConvertBatch gives for it; each is its own request
// in the log and the metrics. The inline data of the stream's batches adds up to more
// than --max-buffered-bytes: a batch's charge is freed once its answer is written.
TEST(Batch, ConvertBatchesAnswersEachBatchInOrderAndGoesOnAfterABadOne) {
  std::string error;
  std::unique_ptr<Daemon> d =
      Daemon::Start({"--devices=cpu", "--max-message-bytes=1M", "--max-buffered-bytes=1M"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  std::shared_ptr<grpc::Channel> channel = MakeChannel(d->unix_target());
  Client client(channel);
  const std::vector<const GoldenCase*> cases = MixedCases(16 << 10);
  ASSERT_GT(cases.size(), 40u);
  constexpr int kBatches = 40;
  constexpr int kItems = 4;
  std::vector<v1::ConvertBatchRequest> batches(kBatches);
  uint64_t inline_bytes = 0;
  for (int b = 0; b < kBatches; ++b) {
    for (int i = 0; i < kItems; ++i) {
      const GoldenCase& c = *cases[(b * kItems + i) % cases.size()];
      *batches[b].add_items() = InlineItem(c, GoldenInput(c));
      inline_bytes += c.input_bytes + 2 * c.output_bytes;
    }
  }
  // One batch in seven names an unknown layout in its item 2.
  auto bad = [](int b) { return b % 7 == 3; };
  for (int b = 0; b < kBatches; ++b) {
    if (bad(b)) batches[b].mutable_items(2)->mutable_convert()->mutable_spec()->set_layout(static_cast<v1::Layout>(42));
  }
  // Enough items for the test to mean something: more inline data than the budget.
  ASSERT_GT(inline_bytes, uint64_t{1} << 20);

  std::unique_ptr<v1::WeightPrep::Stub> stub = v1::WeightPrep::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->ConvertBatches(&ctx);
  for (const v1::ConvertBatchRequest& b : batches) ASSERT_TRUE(stream->Write(b));
  ASSERT_TRUE(stream->WritesDone());
  std::vector<v1::ConvertBatchesResponse> answers;
  for (v1::ConvertBatchesResponse a; stream->Read(&a);) answers.push_back(a);
  const grpc::Status end = stream->Finish();
  ASSERT_TRUE(end.ok()) << end.error_message();
  ASSERT_EQ(answers.size(), static_cast<size_t>(kBatches));
  std::set<uint64_t> ids;
  int good = 0;
  for (int b = 0; b < kBatches; ++b) {
    SCOPED_TRACE(b);
    const v1::ConvertBatchesResponse& a = answers[b];
    EXPECT_EQ(a.index(), static_cast<uint64_t>(b));
    EXPECT_GT(a.request_id(), 0u);
    ids.insert(a.request_id());
    if (bad(b)) {
      EXPECT_EQ(a.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      EXPECT_NE(a.message().find("items[2].convert.spec.layout"), std::string::npos) << a.message();
      EXPECT_FALSE(a.has_batch());
      continue;
    }
    ++good;
    ASSERT_EQ(a.code(), 0) << a.message();
    ASSERT_EQ(a.batch().items_size(), kItems);
    for (int i = 0; i < kItems; ++i) {
      const GoldenCase& c = *cases[(b * kItems + i) % cases.size()];
      EXPECT_TRUE(MatchesGolden(c, a.batch().items(i).outputs(0).inline_bytes())) << c.name;
      EXPECT_EQ(a.batch().items(i).outputs(0).bytes(), c.output_bytes) << c.name;
    }
    // The same batch through ConvertBatch: the same answer, but for the engine's times.
    absl::StatusOr<v1::ConvertBatchResponse> one = client.ConvertBatch(batches[b]);
    ASSERT_TRUE(one.ok()) << one.status();
    v1::ConvertBatchResponse streamed = a.batch();
    for (int i = 0; i < kItems; ++i) {
      EXPECT_GT(streamed.items(i).kernel_seconds(), 0) << i;
      streamed.mutable_items(i)->clear_kernel_seconds();
      one->mutable_items(i)->clear_kernel_seconds();
    }
    EXPECT_EQ(one->SerializeAsString(), streamed.SerializeAsString());
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kBatches));
  EXPECT_EQ(RequestSpans(d->Log(), "ConvertBatches").size(), static_cast<size_t>(kBatches));
  const std::string metrics = HttpGet(d->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, "wprep_requests_total", {{"method", "ConvertBatches"}, {"code", "OK"}}), good);
  EXPECT_EQ(MetricValue(metrics, "wprep_requests_total", {{"method", "ConvertBatches"}, {"code", "INVALID_ARGUMENT"}}),
            kBatches - good);
  EXPECT_EQ(MetricValue(metrics, "wprep_requests_total", {{"method", "ConvertBatch"}, {"code", "OK"}}), good);
}

// The CPU ticks of the daemon's SCHED_IDLE threads (its --keep-cpus-awake spinners), and
// how many there are.
std::pair<int, uint64_t> SpinnerTicks(pid_t pid) {
  int n = 0;
  uint64_t ticks = 0;
  for (const ThreadStat& t : ThreadsOf(pid)) {
    if (t.policy != SCHED_IDLE) continue;
    ++n;
    ticks += t.ticks;
  }
  return {n, ticks};
}

TEST(Daemon, KeepCpusAwakeRunsOneIdlePrioritySpinnerPerCpuThatSleepsBetweenBursts) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::string error;
  auto d = Daemon::Start({"--devices=cpu", "--keep-cpus-awake=200ms"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing());
  EXPECT_NE(d->Log().find(absl::StrCat("event=keep_cpus_awake spinners=", CPU_COUNT(&set))), std::string::npos)
      << d->Log();
  EXPECT_EQ(SpinnerTicks(d->pid()).first, CPU_COUNT(&set));
  // A request, then quiet: past the linger the spinners use no CPU at all.
  Client c(MakeChannel(d->unix_target()));
  ASSERT_TRUE(c.ListDevices().ok());
  absl::SleepFor(absl::Milliseconds(600));
  const uint64_t quiet = SpinnerTicks(d->pid()).second;
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(SpinnerTicks(d->pid()).second, quiet) << "spinners ran with no request for 1 s";
  // Without the flag there are none.
  auto plain = Daemon::Start({"--devices=cpu"}, &error);
  ASSERT_NE(plain, nullptr) << error;
  ASSERT_TRUE(plain->WaitServing());
  EXPECT_EQ(SpinnerTicks(plain->pid()).first, 0);
}

}  // namespace
}  // namespace wprep::testing
