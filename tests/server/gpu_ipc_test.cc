// GPU tests (prefix Gpu; skipped without a GPU): a separate client process
// (wprep_ipc_client) allocates with cudaMalloc and sends CUDA IPC handles to a real
// wprepd; outputs are checked byte for byte against the reference vectors.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "golden_rpc.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cuda_engine.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;

#define SKIP_WITHOUT_GPUS(n)                                                        \
  do {                                                                              \
    if (CudaDeviceCount() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s)";      \
  } while (0)

// A running wprep_ipc_client with its stdout on a pipe.
struct Helper {
  pid_t pid = -1;
  FILE* out = nullptr;
};

Helper Spawn(const std::vector<std::string>& args) {
  int fds[2];
  Helper h;
  if (pipe(fds) != 0) return h;
  // $WPREP_IPC_CLIENT_PATH overrides the built path (the GPU bundle moves binaries).
  const char* env = std::getenv("WPREP_IPC_CLIENT_PATH");
  std::vector<std::string> all = {env != nullptr && *env != '\0' ? env : WPREP_IPC_CLIENT_PATH};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  h.pid = fork();
  if (h.pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  h.out = fdopen(fds[0], "r");
  return h;
}

// Reads the helper's output to the end and returns {exit status, output}.
std::pair<int, std::string> Finish(Helper& h) {
  std::string text;
  char buf[4096];
  size_t n;
  while (h.out != nullptr && (n = fread(buf, 1, sizeof(buf), h.out)) > 0) text.append(buf, n);
  if (h.out != nullptr) fclose(h.out);
  int status = 0;
  waitpid(h.pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
}

std::pair<int, std::string> RunHelper(const std::vector<std::string>& args) {
  Helper h = Spawn(args);
  return Finish(h);
}

std::unique_ptr<Daemon> StartGpuDaemon() {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({}, &error);
  EXPECT_NE(d, nullptr) << error;
  if (d != nullptr) {
    EXPECT_TRUE(d->WaitServing()) << d->Log();
  }
  return d;
}

std::string Metrics(const Daemon& d) { return HttpGet(d.metrics_address(), "/metrics"); }

TEST(GpuDaemon, WarmsEveryGpuAndListsIt) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  Client client(MakeChannel(d->unix_target()));
  absl::StatusOr<wprep::v1::ListDevicesResponse> r = client.ListDevices();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->cpu_engine());
  ASSERT_EQ(r->devices_size(), CudaDeviceCount());
  for (const auto& dev : r->devices()) {
    EXPECT_TRUE(dev.warm());
    EXPECT_EQ(dev.uuid().size(), 16u);
    EXPECT_GT(dev.total_memory_bytes(), 0u);
    EXPECT_EQ(MetricValue(Metrics(*d), "wprep_device_warm", {{"device", absl::StrCat("gpu", dev.ordinal())}}), 1.0);
  }
}

TEST(GpuDaemon, BytesRequestsRunOnTheGpuByteExact) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  Client client(MakeChannel(d->unix_target()));
  for (const GoldenCase& c : GoldenCases()) {
    if (c.error) continue;
    SCOPED_TRACE(c.name);
    absl::StatusOr<wprep::v1::ConvertResponse> r =
        client.Convert(ConvertRequestFor(c.spec, c.logical_shape, GoldenInput(c)));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(MatchesGolden(c, r->output_bytes_inline()));
    EXPECT_EQ(r->engine().rfind("cuda:GPU-", 0), 0u) << r->engine();
    std::string out;
    ASSERT_TRUE(client.ConvertStream(StreamHeaderFor(c.spec, c.logical_shape), GoldenInput(c), &out).ok());
    EXPECT_TRUE(MatchesGolden(c, out));
  }
}

TEST(GpuIpc, IpcToIpcByteExactWithZeroPeakExtraDeviceBytes) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  const std::string m = Metrics(*d);
  const std::optional<double> count =
      MetricValue(m, "wprep_request_peak_extra_device_bytes_count", {{"transport", "ipc_to_ipc"}});
  ASSERT_TRUE(count.has_value()) << m;
  EXPECT_GT(*count, 0);
  // Every IPC->IPC request is in the lowest bucket (le=0): nothing was allocated.
  std::optional<double> zero_bucket;
  for (const char* le : {"0", "0.000000", "0.0"}) {
    if (!zero_bucket) {
      zero_bucket = MetricValue(m, "wprep_request_peak_extra_device_bytes_bucket",
                                {{"transport", "ipc_to_ipc"}, {"le", le}});
    }
  }
  ASSERT_TRUE(zero_bucket.has_value()) << m;
  EXPECT_EQ(*zero_bucket, *count);
  EXPECT_EQ(MetricValue(m, "wprep_request_peak_extra_device_bytes_sum", {{"transport", "ipc_to_ipc"}}), 0.0);
  EXPECT_EQ(MetricValue(m, "wprep_requests_total", {{"transport", "ipc_to_ipc"}, {"code", "OK"}}), *count);
}

TEST(GpuIpc, BatchOfEveryCaseIpcToIpcIsByteExactAndABadItemWritesNothing) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=batch"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  auto [rc2, out2] = RunHelper({"--target=" + d->unix_target(), "--mode=batch-bad"});
  ASSERT_EQ(rc2, 0) << out2 << d->Log();
  const std::string m = Metrics(*d);
  EXPECT_EQ(MetricValue(m, "wprep_requests_total", {{"method", "ConvertBatch"}, {"code", "OK"}}), 1.0);
  EXPECT_EQ(MetricValue(m, "wprep_requests_total", {{"method", "ConvertBatch"}, {"code", "INVALID_ARGUMENT"}}), 1.0);
  EXPECT_EQ(MetricValue(m, "wprep_request_peak_extra_device_bytes_sum", {{"transport", "batch"}}), 0.0);
}

TEST(GpuIpc, BytesToIpcByteExact) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=bytes2ipc"});
  EXPECT_EQ(rc, 0) << out << d->Log();
}

TEST(GpuIpc, IpcToBytesByteExactOverTcp) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->tcp_target(), "--mode=ipc2bytes"});
  EXPECT_EQ(rc, 0) << out << d->Log();
}

TEST(GpuIpc, RepeatedHandlesHitTheCache) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc", "--repeat=3", "--no-release"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  const std::string m = Metrics(*d);
  const double misses = MetricValue(m, "wprep_ipc_cache_misses_total").value_or(-1);
  const double hits = MetricValue(m, "wprep_ipc_cache_hits_total").value_or(-1);
  // Each handle (one source, one destination per case) is opened once, then hit twice.
  EXPECT_GT(misses, 0);
  EXPECT_EQ(hits, 2 * misses) << m;
  EXPECT_EQ(MetricValue(m, "wprep_ipc_cache_entries"), misses);
}

TEST(GpuIpc, RegisteredHandlesOpenOnceAndEveryConvertHits) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc", "--register", "--no-release"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  EXPECT_NE(out.find("OK registered="), std::string::npos) << out;
  const std::string m = Metrics(*d);
  const double misses = MetricValue(m, "wprep_ipc_cache_misses_total").value_or(-1);
  // The first registration opens every handle; the second and the Converts only hit.
  EXPECT_GT(misses, 0);
  EXPECT_EQ(MetricValue(m, "wprep_ipc_cache_hits_total"), 2 * misses) << m;
  EXPECT_EQ(MetricValue(m, "wprep_ipc_cache_entries"), misses);
}

TEST(GpuIpc, ConcurrentFirstRequestsOpenASharedHandleOnce) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=shared-source", "--parallel=8"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  const std::string m = Metrics(*d);
  // One open for the shared source and one per destination; the other seven requests
  // found the source open (or waited while it opened).
  EXPECT_EQ(MetricValue(m, "wprep_ipc_cache_misses_total"), 9.0) << m;
  EXPECT_EQ(MetricValue(m, "wprep_ipc_cache_hits_total"), 7.0) << m;
  EXPECT_EQ(d->Health(), 1);
}

TEST(GpuIpc, ReleaseIpcHandlesEmptiesTheCache) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc"});
  ASSERT_EQ(rc, 0) << out << d->Log();
  EXPECT_NE(out.find("deferred=0"), std::string::npos) << out;
  EXPECT_EQ(MetricValue(Metrics(*d), "wprep_ipc_cache_entries"), 0.0);
}

TEST(GpuIpc, BadHandlesAndRangesAreInvalidArgument) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  for (const char* mode : {"--mode=bad-garbage", "--mode=bad-beyond"}) {
    auto [rc, out] = RunHelper({"--target=" + d->unix_target(), mode});
    EXPECT_EQ(rc, 0) << mode << "\n" << out << d->Log();
  }
  EXPECT_EQ(d->Health(), 1);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc"});
  EXPECT_EQ(rc, 0) << out;
}

TEST(GpuIpc, HandleWithTheUuidOfAnotherGpuIsInvalidArgument) {
  SKIP_WITHOUT_GPUS(2);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=bad-wrong-uuid"});
  EXPECT_EQ(rc, 0) << out << d->Log();
  EXPECT_EQ(d->Health(), 1);
}

TEST(GpuIpc, InputOnGpu1WhileTheClientsCurrentDeviceIs0) {
  SKIP_WITHOUT_GPUS(2);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc", "--alloc-device=1",
                              "--current-device=0"});
  EXPECT_EQ(rc, 0) << out << d->Log();
  EXPECT_GT(*MetricValue(Metrics(*d), "wprep_converted_bytes_total", {{"device", "gpu1"}}), 0);
}

TEST(GpuIpc, TwoGpusConvertAtOnce) {
  SKIP_WITHOUT_GPUS(2);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  Helper a = Spawn({"--target=" + d->unix_target(), "--mode=ipc2ipc", "--alloc-device=0", "--repeat=3"});
  Helper b = Spawn({"--target=" + d->unix_target(), "--mode=ipc2ipc", "--alloc-device=1", "--repeat=3"});
  auto [rca, outa] = Finish(a);
  auto [rcb, outb] = Finish(b);
  EXPECT_EQ(rca, 0) << outa;
  EXPECT_EQ(rcb, 0) << outb;
  const std::string m = Metrics(*d);
  EXPECT_GT(*MetricValue(m, "wprep_converted_bytes_total", {{"device", "gpu0"}}), 0);
  EXPECT_GT(*MetricValue(m, "wprep_converted_bytes_total", {{"device", "gpu1"}}), 0);
}

TEST(GpuDaemon, DeviceByteBudgetRefusesWhatCanNeverFit) {
  SKIP_WITHOUT_GPUS(1);
  std::string error;
  auto d = Daemon::Start({"--max-device-bytes=1M"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  const ConversionSpec spec = HopperSpec(Direction::kSwizzle, -1, 2);
  // bytes->bytes needs input + output on the device: 2 x 1 MiB > the 1 MiB budget.
  absl::StatusOr<wprep::v1::ConvertResponse> big =
      client.Convert(ConvertRequestFor(spec, {2048, 1024}, RandomBytes(1 << 20, 1)));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("--max-device-bytes"), std::string::npos) << big.status();
  // What fits still runs, and the peak is what it allocated.
  const std::vector<uint8_t> in = RandomBytes(256 * 64, 2);
  absl::StatusOr<wprep::v1::ConvertResponse> small = client.Convert(ConvertRequestFor(spec, {256, 128}, in));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(small->output_bytes_inline() == CpuReference(spec, {256, 128}, in));
  EXPECT_EQ(small->peak_extra_device_bytes(), 2u * 256 * 64);
  // A stream of the big tensor fits: it holds one leading-dim slice at a time.
  std::string out;
  const std::vector<uint8_t> sin = RandomBytes(8 * 256 * 64, 3);
  absl::StatusOr<wprep::v1::StreamResponseHeader> h =
      client.ConvertStream(StreamHeaderFor(spec, {8, 256, 128}), sin, &out);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(out == CpuReference(spec, {8, 256, 128}, sin));
  EXPECT_EQ(d->Health(), 1);
}

TEST(GpuIpc, ClientKilledMidRequestLeavesTheDaemonServing) {
  SKIP_WITHOUT_GPUS(1);
  auto d = StartGpuDaemon();
  ASSERT_NE(d, nullptr);
  Helper h = Spawn({"--target=" + d->unix_target(), "--mode=loop-big"});
  ASSERT_GT(h.pid, 0);
  char line[64] = {0};
  ASSERT_NE(fgets(line, sizeof(line), h.out), nullptr);
  ASSERT_EQ(std::string(line), "STARTED\n");
  // Kill it while a conversion of its buffers is in flight (seen in the gauge), or after
  // a bounded wait whatever the gauge said.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until &&
         MetricValue(Metrics(*d), "wprep_in_flight_requests", {{"device", "gpu0"}}).value_or(0) < 1) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  kill(h.pid, SIGKILL);
  Finish(h);
  EXPECT_EQ(d->Health(), 1) << d->Log();
  auto [rc, out] = RunHelper({"--target=" + d->unix_target(), "--mode=ipc2ipc"});
  EXPECT_EQ(rc, 0) << out << d->Log();
  // The dead client's request ended and nothing stays in flight.
  const absl::Time until2 = absl::Now() + absl::Seconds(60);
  while (absl::Now() < until2 &&
         MetricValue(Metrics(*d), "wprep_in_flight_requests", {{"device", "gpu0"}}).value_or(1) != 0) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(MetricValue(Metrics(*d), "wprep_in_flight_requests", {{"device", "gpu0"}}), 0.0);
  EXPECT_EQ(MetricValue(Metrics(*d), "wprep_device_allocated_bytes", {{"device", "gpu0"}}), 0.0);
}

}  // namespace
}  // namespace wprep::testing
