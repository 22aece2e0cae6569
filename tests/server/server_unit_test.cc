// Unit tests of the daemon's small pieces: flags, the status translation, UUIDs, the
// accounting allocator's budget, the IPC owner map's calibration.
#include <sched.h>
#include <unistd.h>

#include <thread>

#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "absl/strings/str_cat.h"
#include "daemon_harness.h"
#include "absl/time/clock.h"
#include "device/device_allocator.h"
#include "device/device_manager.h"
#include "fake_runtime.h"
#include "net/idle_spinners.h"
#include "rpc/proto_translate.h"
#include "exec/ready_words.h"
#include "rpc/service.h"
#include "device/ipc_owner.h"
#include "wprep/server/daemon.h"
#include "wprep/server/options.h"
#include "rpc/rpc_warmup.h"
#include "rpc/status.h"

namespace wprep::server {
namespace {

TEST(Options, DefaultsAreLocalOnly) {
  absl::StatusOr<Options> o = ParseOptions({});
  ASSERT_TRUE(o.ok()) << o.status();
  // The Unix socket alone: its file mode decides who may convert (loopback TCP would
  // admit every local user).
  ASSERT_EQ(o->listen.size(), 1u);
  EXPECT_EQ(o->listen[0], "unix:///tmp/wprepd.sock");
  EXPECT_EQ(o->metrics_address, "127.0.0.1:9464");
  for (const std::string& a : o->listen) EXPECT_EQ(a.find("0.0.0.0"), std::string::npos);
}

TEST(Options, RepeatedListenReplacesTheDefaultsAndAccumulates) {
  absl::StatusOr<Options> o =
      ParseOptions({"--listen=unix:///run/w.sock", "--listen", "127.0.0.1:7000", "--devices=0,GPU-1",
                    "--max-device-bytes=8G", "--drain-timeout=5s", "--streams-per-device", "2"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->listen, (std::vector<std::string>{"unix:///run/w.sock", "127.0.0.1:7000"}));
  EXPECT_EQ(o->devices, (std::vector<std::string>{"0", "GPU-1"}));
  EXPECT_EQ(o->max_device_bytes, 8ull << 30);
  EXPECT_EQ(o->drain_timeout, absl::Seconds(5));
  EXPECT_EQ(o->streams_per_device, 2);
}

// Launchers append overrides to a base command line (the harnesses, a container's CMD plus
// its args): a later value replaces an earlier one, except for the accumulating flags.
TEST(Options, ALaterValueReplacesAnEarlierOne) {
  absl::StatusOr<Options> o = ParseOptions({"--drain-timeout=10s", "--cpu-threads=2", "--drain-timeout=60s",
                                            "--devices=0", "--devices=1"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->drain_timeout, absl::Seconds(60));
  EXPECT_EQ(o->cpu_threads, 2);
  EXPECT_EQ(o->devices, (std::vector<std::string>{"0", "1"}));
}

TEST(Options, HelpIsGeneratedFromEveryFlag) {
  const std::string u = Usage();
  for (const char* entry : {"  --listen ADDR ", "  --max-buffered-bytes N ", "  --drain-timeout D ",
                            "  --weights-shm-dir DIR "}) {
    EXPECT_NE(u.find(entry), std::string::npos) << entry;
  }
  EXPECT_NE(u.find("(default 1G)"), std::string::npos) << u;
  EXPECT_NE(u.find("(default unix:///tmp/wprepd.sock)"), std::string::npos) << u;
}

TEST(Options, TcpBeyondLoopbackNeedsTls) {
  for (const char* addr : {"0.0.0.0:7000", "10.1.2.3:7000", "[::]:7000", "gpu-node-3:7000"}) {
    absl::StatusOr<Options> o = ParseOptions({absl::StrCat("--listen=", addr)});
    ASSERT_FALSE(o.ok()) << addr;
    EXPECT_NE(o.status().message().find("--tls-cert"), absl::string_view::npos) << o.status();
    EXPECT_TRUE(ParseOptions({absl::StrCat("--listen=", addr), "--tls-cert=c.pem", "--tls-key=k.pem"}).ok()) << addr;
  }
  for (const char* addr : {"127.0.0.1:7000", "localhost:7000", "[::1]:7000", "unix:///run/w.sock"}) {
    EXPECT_TRUE(ParseOptions({absl::StrCat("--listen=", addr)}).ok()) << addr;
  }
  EXPECT_FALSE(ParseOptions({"--tls-cert=c.pem"}).ok());
  EXPECT_FALSE(ParseOptions({"--tls-client-ca=ca.pem"}).ok());
  EXPECT_FALSE(ParseOptions({"--health-listen=unix:///x"}).ok());
  EXPECT_TRUE(ParseOptions({"--health-listen=0.0.0.0:8081"}).ok());
}

TEST(Options, BadFlagsNameTheFlag) {
  struct Bad {
    std::vector<std::string> args;
    std::string part;
  };
  for (const Bad& b : std::vector<Bad>{{{"--nope=1"}, "--nope"},
                                       {{"--streams-per-device=0"}, "streams-per-device"},
                                       {{"--max-device-bytes=lots"}, "max-device-bytes"},
                                       {{"--drain-timeout=-3s"}, "drain-timeout"},
                                       {{"--listen=localhost"}, "localhost"},
                                       {{"--listen"}, "needs a value"},
                                       {{"stray"}, "stray"}}) {
    absl::StatusOr<Options> o = ParseOptions(b.args);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << b.args[0];
    EXPECT_NE(o.status().message().find(b.part), absl::string_view::npos) << o.status();
  }
}

TEST(Status, TranslationKeepsCodeAndMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError("block_k must be even, got 7"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "block_k must be even, got 7");
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  const absl::Status back = FromGrpc(grpc::Status(grpc::StatusCode::NOT_FOUND, "gone"));
  EXPECT_EQ(back.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(back.message(), "gone");
}

TEST(Service, ExceptionsInAHandlerBecomeStatusesAndErrorsAreBounded) {
  EXPECT_EQ(RunGuarded([]() -> absl::Status { throw std::bad_alloc(); }, 7).code(),
            absl::StatusCode::kResourceExhausted);
  const absl::Status s = RunGuarded([]() -> absl::Status { throw std::runtime_error("boom"); }, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("boom"), absl::string_view::npos);
  EXPECT_EQ(RunGuarded([]() -> absl::Status { throw 42; }, 9).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(RunGuarded([] { return absl::OkStatus(); }, 10).ok());
  const absl::Status big = BoundMessage(absl::InvalidArgumentError(std::string(100000, 'x')));
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LE(big.message().size(), kMaxErrorBytes);
  EXPECT_NE(big.message().find("more bytes"), absl::string_view::npos);
}

TEST(Uuid, FormatAndParseRoundTrip) {
  Uuid u{};
  for (int i = 0; i < 16; ++i) u[i] = static_cast<uint8_t>(i * 17);
  const std::string text = FormatUuid(u);
  EXPECT_EQ(text, "GPU-00112233-4455-6677-8899-aabbccddeeff");
  absl::StatusOr<Uuid> back = ParseUuid(text);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, u);
  EXPECT_FALSE(ParseUuid("GPU-0011").ok());
  EXPECT_FALSE(ParseUuid("GPU-zz112233-4455-6677-8899-aabbccddeeff").ok());
  EXPECT_EQ(UuidFromWire("short", "f").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceAllocator, BudgetRejectsWhatCanNeverFitAndTimesOutWhenFull) {
  wprep::testing::FakeRuntime runtime(1);
  DeviceAllocator a(&runtime, 0, 1000, nullptr);
  EXPECT_EQ(a.Reserve(1001, absl::InfiniteFuture()).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(a.Reserve(600, absl::InfiniteFuture()).ok());
  // 600 + 600 > 1000: waits, and with a past deadline gives up at once.
  const absl::Status s = a.Reserve(600, absl::Now() - absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("retry"), absl::string_view::npos);
  a.Unreserve(600);
  EXPECT_TRUE(a.Reserve(1000, absl::Now() - absl::Seconds(1)).ok());
}

// A synthetic handle shaped like those seen on driver 580: a per-process pointer in bytes
// 0-7, a per-process id in bytes 8-9, the GPU's id at byte 32, a per-allocation counter at
// byte 40.
std::string FakeHandle(uint8_t process, uint8_t gpu_id, uint8_t allocation) {
  std::string h(64, '\0');
  for (int i = 0; i < 6; ++i) h[i] = static_cast<char>(0x30 + 7 * process + i);
  h[8] = static_cast<char>(0x1c + process);
  h[9] = 0x28;
  h[32] = static_cast<char>(gpu_id);
  h[40] = static_cast<char>(allocation);
  return h;
}

TEST(IpcOwnerMap, FindsTheBytesThatNameTheGpuAcrossProcesses) {
  // Process 1 (the daemon) and process 2 (its child) each export two handles per GPU.
  std::vector<std::vector<std::string>> samples = {
      {FakeHandle(1, 6, 1), FakeHandle(1, 6, 2), FakeHandle(2, 6, 1), FakeHandle(2, 6, 2)},
      {FakeHandle(1, 7, 3), FakeHandle(1, 7, 4), FakeHandle(2, 7, 3), FakeHandle(2, 7, 4)}};
  IpcOwnerMap m = IpcOwnerMap::FromSamples({0, 1}, samples);
  ASSERT_TRUE(m.enabled()) << m.description();
  EXPECT_EQ(m.description(), "handle bytes [32] identify the exporting GPU");
  // A third process (a client) on either GPU, any allocation.
  EXPECT_EQ(m.Owner(FakeHandle(3, 6, 9)), 0);
  EXPECT_EQ(m.Owner(FakeHandle(3, 7, 9)), 1);
  EXPECT_EQ(m.Owner(FakeHandle(3, 5, 9)), std::nullopt);  // a GPU this daemon does not serve
  EXPECT_EQ(m.Owner("short"), std::nullopt);
}

TEST(IpcOwnerMap, StaysOffWhenNoByteNamesTheGpu) {
  // Per-process bytes differ between the GPUs of one process too (a context pointer):
  // with only one process they would look like a GPU id; two processes expose them.
  std::vector<std::vector<std::string>> samples = {
      {FakeHandle(1, 0, 1), FakeHandle(1, 0, 2), FakeHandle(3, 0, 1), FakeHandle(3, 0, 2)},
      {FakeHandle(2, 0, 3), FakeHandle(2, 0, 4), FakeHandle(4, 0, 3), FakeHandle(4, 0, 4)}};
  IpcOwnerMap m = IpcOwnerMap::FromSamples({0, 1}, samples);
  EXPECT_FALSE(m.enabled());
  EXPECT_NE(m.description().find("no byte"), std::string::npos) << m.description();
  EXPECT_EQ(m.Owner(FakeHandle(1, 0, 1)), std::nullopt);
}

TEST(IpcOwnerMap, OneGpuOrTooFewSamplesLeaveItOff) {
  EXPECT_FALSE(IpcOwnerMap::FromSamples({0}, {{FakeHandle(1, 6, 1), FakeHandle(2, 6, 1)}}).enabled());
  EXPECT_FALSE(IpcOwnerMap::FromSamples({0, 1}, {{FakeHandle(1, 6, 1)}, {FakeHandle(1, 7, 1)}}).enabled());
  wprep::testing::FakeRuntime runtime(1);
  EXPECT_FALSE(IpcOwnerMap::Calibrate(runtime, "/nonexistent", {0}).enabled());
}

TEST(RpcWarmup, TargetsReachTheBoundPortOverLoopback) {
  EXPECT_EQ(WarmupTarget("unix:///run/w.sock", 0), "unix:///run/w.sock");
  EXPECT_EQ(WarmupTarget("127.0.0.1:0", 41234), "127.0.0.1:41234");
  EXPECT_EQ(WarmupTarget("0.0.0.0:7000", 7000), "127.0.0.1:7000");
  EXPECT_EQ(WarmupTarget("[::]:0", 5000), "[::1]:5000");
  EXPECT_EQ(WarmupTarget("localhost:0", 5001), "localhost:5001");
}

TEST(RpcWarmup, TokensAre128RandomBits) {
  const std::string a = NewWarmupToken(), b = NewWarmupToken();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(Options, KeepCpusAwakeIsOffUnlessAsked) {
  absl::StatusOr<Options> o = ParseOptions({});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->keep_cpus_awake, absl::ZeroDuration());
  o = ParseOptions({"--keep-cpus-awake=50ms"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->keep_cpus_awake, absl::Milliseconds(50));
  EXPECT_FALSE(ParseOptions({"--keep-cpus-awake=-1s"}).ok());
  EXPECT_FALSE(ParseOptions({"--keep-cpus-awake=soon"}).ok());
}

// The warm-up gate is a test hook, not an option: ParseOptions refuses it, and
// TakeDaemonHooks takes it (either spelling) out of the flags it leaves to ParseOptions.
TEST(Options, TheWarmupGateIsAHookNotAnOption) {
  EXPECT_FALSE(ParseOptions({"--testing-warmup-gate=/tmp/gate"}).ok());
  std::vector<std::string> args = {"--devices=cpu", "--testing-warmup-gate=/tmp/a", "--testing-warmup-gate",
                                   "/tmp/b", "--cpu-threads=2"};
  DaemonHooks hooks;
  ASSERT_TRUE(TakeDaemonHooks(args, &hooks).ok());
  EXPECT_EQ(hooks.warmup_gate_file, "/tmp/b");
  EXPECT_EQ(args, (std::vector<std::string>{"--devices=cpu", "--cpu-threads=2"}));
  EXPECT_TRUE(ParseOptions(args).ok());
  std::vector<std::string> dangling = {"--testing-warmup-gate"};
  EXPECT_FALSE(TakeDaemonHooks(dangling, &hooks).ok());
}

int AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
}

int SchedIdleThreads() {
  int n = 0;
  for (const testing::ThreadStat& t : testing::ThreadsOf(getpid())) n += t.policy == SCHED_IDLE;
  return n;
}

// Polls `cond` until it holds or `bound` passes (spinners at idle priority may wait for a
// busy machine's CPUs).
template <class F>
bool Eventually(F cond, absl::Duration bound = absl::Seconds(30)) {
  for (const absl::Time end = absl::Now() + bound; absl::Now() < end;) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return cond();
}

TEST(IdleSpinners, OnePerCpuAtIdlePrioritySpinningOnlyForTheLingerAfterATouch) {
  const int cpus = AffinityCpus();
  ASSERT_GT(cpus, 0);
  const int idle_before = SchedIdleThreads();
  const absl::Duration linger = absl::Milliseconds(300);
  std::unique_ptr<IdleSpinners> s = IdleSpinners::Start(linger);
  ASSERT_EQ(s->threads(), cpus);
  // Nothing touched them yet: every spinner parks, at idle priority.
  ASSERT_TRUE(Eventually([&] { return s->parked() == cpus; })) << s->parked() << " of " << cpus << " parked";
  EXPECT_EQ(SchedIdleThreads() - idle_before, cpus);
  // A touch wakes every one of them, and they park again once the linger has passed.
  const absl::Time touched = absl::Now();
  s->Touch();
  ASSERT_TRUE(Eventually([&] { return s->parked() == 0; })) << s->parked() << " still parked";
  ASSERT_TRUE(Eventually([&] { return s->parked() == cpus; }));
  EXPECT_GE(absl::Now() - touched, linger - absl::Milliseconds(5));
  // Touches during the linger extend it: touched every 100 ms for 600 ms, none parks.
  s->Touch();
  ASSERT_TRUE(Eventually([&] { return s->parked() == 0; }));
  int most_parked = 0;
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    most_parked = std::max(most_parked, s->parked());
    s->Touch();
  }
  EXPECT_EQ(most_parked, 0);
  s.reset();  // joins them
  EXPECT_EQ(SchedIdleThreads(), idle_before);
}

TEST(IdleSpinners, ZeroLingerStartsNoThread) {
  std::unique_ptr<IdleSpinners> s = IdleSpinners::Start(absl::ZeroDuration());
  EXPECT_EQ(s->threads(), 0);
  s->Touch();
  EXPECT_EQ(s->parked(), 0);
}

// Ready words: a word the client writes (this value or a later one, wrapping) is let go
// untouched; one it never writes is written by the daemon once the timeout has passed, or at
// once when its owner's client is gone, and only that owner's.
TEST(ReadyWords, WritesOnlyWordsNotReachedAfterTheTimeoutOrForAGoneClient) {
  EXPECT_TRUE(ReadyWords::Reached(5, 5));
  EXPECT_TRUE(ReadyWords::Reached(7, 5));
  EXPECT_FALSE(ReadyWords::Reached(4, 5));
  EXPECT_TRUE(ReadyWords::Reached(2, 0xFFFFFFF0u));   // past the wrap
  EXPECT_FALSE(ReadyWords::Reached(0xFFFFFFF0u, 2));  // before it
  alignas(4) uint32_t words[6] = {0, 0, 0, 0, 0xFFFFFFF0u, 0};
  auto keep = std::make_shared<int>(0);
  {
    ReadyWords ready(absl::Milliseconds(300), absl::Milliseconds(5));
    prometheus::Registry registry;
    auto& released = prometheus::BuildCounter().Name("released_total").Register(registry);
    prometheus::Counter& timeout_count = released.Add({{"why", "timeout"}});
    prometheus::Counter& gone_count = released.Add({{"why", "client_gone"}});
    ready.CountIn(&timeout_count, &gone_count);
    ready.Watch(&words[0], 5, keep, /*owner=*/0, 1);       // never written: the timeout
    ready.Watch(&words[1], 6, keep, /*owner=*/0, 2);       // the client writes a later value
    ready.Watch(&words[2], 7, keep, /*owner=*/11, 3);      // owner 11 goes away
    ready.Watch(&words[3], 8, keep, /*owner=*/12, 4);      // owner 12 stays
    ready.Watch(&words[4], 3, keep, /*owner=*/11, 5);      // not reached across the wrap
    ready.Watch(&words[5], 9, keep, /*owner=*/11, 6);      // written by its client before it goes
    EXPECT_EQ(ready.watched(), 6u);
    EXPECT_GT(keep.use_count(), 1);
    __atomic_store_n(&words[1], 10u, __ATOMIC_SEQ_CST);
    __atomic_store_n(&words[5], 9u, __ATOMIC_SEQ_CST);
    ready.ReleaseOwner(11);
    EXPECT_EQ(words[2], 7u);
    EXPECT_EQ(words[4], 3u);
    EXPECT_EQ(words[5], 9u);
    EXPECT_EQ(words[0], 0u) << "written before its timeout";
    EXPECT_EQ(words[3], 0u) << "another owner's word written";
    EXPECT_EQ(ready.released_for_gone_clients(), 2u);
    ready.ReleaseOwner(0);  // no owner: nothing
    EXPECT_EQ(words[0], 0u);
    const absl::Time bound = absl::Now() + absl::Seconds(10);
    while (ready.watched() != 0 && absl::Now() < bound) absl::SleepFor(absl::Milliseconds(5));
    EXPECT_EQ(ready.watched(), 0u);
    EXPECT_EQ(words[0], 5u);
    EXPECT_EQ(words[1], 10u) << "a later value the client wrote was overwritten";
    EXPECT_EQ(words[3], 8u);
    EXPECT_EQ(ready.released_after_timeout(), 2u);
    EXPECT_EQ(ready.released_for_gone_clients(), 2u);
    EXPECT_EQ(timeout_count.Value(), 2);
    EXPECT_EQ(gone_count.Value(), 2);
    EXPECT_EQ(keep.use_count(), 1) << "a let-go word's mapping is still held";
  }
}

}  // namespace
}  // namespace wprep::server
