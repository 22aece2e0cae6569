// Fault injection against a running daemon: clients that vanish, deadlines that expire in
// each phase of a request, shutdown signals under load, a crash and restart, device memory
// running out, IPC memory freed behind the daemon's back, and a client that reads its
// stream slowly. Each fault must end with a clear status for the client (never OK for
// work that did not finish, and every OK output exact), nothing held in the daemon
// afterwards, and a daemon that goes on serving.
//
// Two kinds of daemon: the real wprepd process on the CPU engine (daemon_harness.h), and,
// for the faults that need a GPU, the same daemon (wprep::server::Daemon, with its real
// listeners and gRPC server) run in this process on one fake GPU (fake_runtime.h) whose
// conversions can be held at a gate. Descriptor and thread limits are in
// hardening_test.cc.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "fake_runtime.h"
#include "golden.h"
#include "golden_rpc.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "shm_file.h"
#include "rpc/stream_pipeline.h"
#include "wprep/client/client.h"
#include "wprep/server/daemon.h"
#include "wprep/server/options.h"

extern char** environ;

namespace wprep::testing {
namespace {

using wprep::client::Client;

// The field of the google.rpc.BadRequest in a status's details; "" when it has none.
std::string FieldViolation(const grpc::Status& s) {
  google::rpc::Status details;
  google::rpc::BadRequest bad;
  if (!details.ParseFromString(s.error_details()) || details.details_size() != 1 ||
      !details.details(0).UnpackTo(&bad) || bad.field_violations_size() != 1) {
    return "";
  }
  EXPECT_EQ(bad.field_violations(0).description(), s.error_message());
  return bad.field_violations(0).field();
}
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

// Expected outputs: the reference vectors where a stored case fits the fault, else the
// CPU engine's output (CpuReference). The CPU engine is itself checked against the
// reference vectors (tests/kernels/golden_test.cc); what these tests examine is the
// daemon's transport and lifecycle around it.

ConversionSpec HopperSwizzleMx1() { return HopperSpec(Direction::kSwizzle, -1, 3); }

// Polls `pred` every 20 ms until it holds (true) or `bound` passes (false).
bool WaitFor(const std::function<bool()>& pred, absl::Duration bound = absl::Seconds(20)) {
  const absl::Time until = absl::Now() + bound;
  while (!pred()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

double Metric(const std::string& metrics_address, const std::string& name,
              const std::map<std::string, std::string>& labels = {}) {
  return MetricValue(HttpGet(metrics_address, "/metrics"), name, labels).value_or(-1);
}

// Nothing held for requests: no buffered bytes, no conversion in flight on `device`, no
// device bytes allocated (GPUs only).
bool Idle(const std::string& metrics_address, const std::string& device) {
  const std::string m = HttpGet(metrics_address, "/metrics");
  if (MetricValue(m, "wprep_host_buffered_bytes").value_or(-1) != 0) return false;
  if (MetricValue(m, "wprep_in_flight_requests", {{"device", device}}).value_or(-1) != 0) return false;
  return device == "cpu" || MetricValue(m, "wprep_device_allocated_bytes", {{"device", device}}).value_or(-1) == 0;
}

std::unique_ptr<Daemon> StartCpuDaemon(std::vector<std::string> extra = {}) {
  extra.push_back("--devices=cpu");
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(extra, &error);
  EXPECT_NE(d, nullptr) << error;
  if (d != nullptr && !d->WaitServing()) {
    ADD_FAILURE() << "not serving: " << d->Log();
    return nullptr;
  }
  return d;
}

// A small request the daemon at `target` must still answer exactly.
void ExpectServes(const std::string& target, const std::string& why) {
  Client c(MakeChannel(target));
  const std::vector<uint8_t> in = RandomBytes(256 * 64, 11);
  wprep::client::CallOptions o;
  o.timeout = std::chrono::seconds(20);
  absl::StatusOr<v1::ConvertResponse> r = c.Convert(ConvertRequestFor(HopperSwizzleMx1(), {256, 128}, in), o);
  ASSERT_TRUE(r.ok()) << why << ": " << r.status();
  EXPECT_EQ(r->output_bytes_inline(), CpuReference(HopperSwizzleMx1(), {256, 128}, in)) << why;
}

// Requests a daemon's log shows for `method` with final `code`.
int LoggedRequests(const std::string& log, const std::string& method, const std::string& code) {
  int n = 0;
  for (size_t at = 0; (at = log.find("event=request", at)) != std::string::npos; ++at) {
    const std::string line = log.substr(at, log.find('\n', at) - at);
    if (absl::StrContains(line, " method=" + method + " ") && absl::StrContains(line, " code=" + code + " ")) ++n;
  }
  return n;
}

// The lines of `log` that contain any of `needles`, for a failure's message.
std::string LogLinesWith(const std::string& log, const std::vector<std::string>& needles) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    for (const std::string& n : needles) {
      if (absl::StrContains(line, n)) {
        absl::StrAppend(&out, line, "\n");
        break;
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The real wprepd process on the CPU engine.

// A wprep_fault_client process (fault_client.cc) mid-stream.
class FaultClient {
 public:
  FaultClient(const std::string& mode, const std::string& target) {
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    // $WPREP_FAULT_CLIENT_PATH overrides the built path (the GPU bundle moves binaries).
    const char* env = std::getenv("WPREP_FAULT_CLIENT_PATH");
    std::string path = env != nullptr && *env != '\0' ? env : WPREP_FAULT_CLIENT_PATH, m = mode, t = target;
    char* argv[] = {path.data(), m.data(), t.data(), nullptr};
    if (posix_spawn(&pid_, path.c_str(), &actions, nullptr, argv, environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }
  ~FaultClient() {
    Kill();
    if (out_ != nullptr) fclose(out_);
  }
  // True once the client printed "admitted": the daemon accepted its stream.
  bool WaitAdmitted() {
    char line[64] = {};
    return pid_ > 0 && out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr &&
           std::string(line) == "admitted\n";
  }
  // True once the client has stopped itself (stop-then-read).
  bool WaitStopped() {
    int status = 0;
    return pid_ > 0 && waitpid(pid_, &status, WUNTRACED) == pid_ && WIFSTOPPED(status);
  }
  // Continues a stopped client and waits for it to exit: its exit code and the line it
  // printed, or -1 when it did not exit normally.
  int ContinueAndWait(std::string* printed) {
    if (pid_ <= 0) return -1;
    const std::optional<int> status = SignalAndReap(SIGCONT);
    char line[128] = {};
    if (out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr) *printed = line;
    return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  }
  void Kill() { SignalAndReap(SIGKILL); }

 private:
  // Sends `sig` and waits for the client to exit: its wait status, nullopt when there was
  // no client or waitpid failed.
  std::optional<int> SignalAndReap(int sig) {
    if (pid_ <= 0) return std::nullopt;
    kill(pid_, sig);
    int status = 0;
    const bool waited = waitpid(pid_, &status, 0) == pid_;
    pid_ = -1;
    return waited ? std::optional<int>(status) : std::nullopt;
  }

  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

// SIGTERM while a finished stream's answers and status still wait, unread, in its
// client's socket. gRPC closes a connection as soon as it has said goodbye, and a client
// that sends a flow-control update into the closed socket fails the finished call
// ("Broken pipe") when that write's error comes before it has parsed the status: a race
// this test cannot force. What it checks is the daemon's side: within its drain time the
// daemon waits until each client has read what was sent to it. The client here stops
// itself before reading; the daemon must still run 1.5 s into the drain (a daemon that
// only gave gRPC a second's grace was gone by then), and once the client is continued it
// reads OK and every byte, and the daemon exits 0.
TEST(Fault, SigtermWaitsForAStoppedClientToReadItsAnswers) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  FaultClient client("stop-then-read", d->unix_target());
  ASSERT_TRUE(client.WaitAdmitted()) << d->Log();
  ASSERT_TRUE(client.WaitStopped());
  ASSERT_TRUE(WaitFor([&] { return LoggedRequests(d->Log(), "ConvertStream", "OK") == 1; })) << d->Log();
  d->Signal(SIGTERM);
  ASSERT_TRUE(WaitFor([&] { return d->Log().find("event=draining") != std::string::npos; })) << d->Log();
  EXPECT_EQ(d->WaitExit(absl::Milliseconds(1500)), -1) << "exited with answers unread\n" << d->Log();
  std::string printed;
  EXPECT_EQ(client.ContinueAndWait(&printed), 0) << printed << d->Log();
  EXPECT_EQ(printed, "status 0 bytes 65536\n");
  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_NE(d->Log().find("calls_open=0 connections_unread=0"), std::string::npos) << d->Log();
  EXPECT_NE(d->Log().find("event=stopped drained=true"), std::string::npos) << d->Log();
}

// A client process killed with SIGKILL mid-stream (its connection drops with no cancel
// sent), while the daemon waits for its input and while the daemon waits to send it
// output: the daemon ends the call as CANCELLED and gives back its buffers.
TEST(Fault, ClientKilledMidStreamFreesWhatItHeld) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  int cancelled = 0;
  for (const char* mode : {"stall-send", "stall-read"}) {
    SCOPED_TRACE(mode);
    FaultClient client(mode, d->unix_target());
    ASSERT_TRUE(client.WaitAdmitted()) << d->Log();
    absl::SleepFor(absl::Milliseconds(500));  // it sends what it can
    EXPECT_GT(Metric(d->metrics_address(), "wprep_host_buffered_bytes"), 0) << "the stream held no buffers";
    client.Kill();
    EXPECT_TRUE(WaitFor([&] { return Idle(d->metrics_address(), "cpu"); }))
        << HttpGet(d->metrics_address(), "/metrics");
    EXPECT_TRUE(WaitFor([&] { return LoggedRequests(d->Log(), "ConvertStream", "CANCELLED") == cancelled + 1; }))
        << d->Log();
    cancelled = LoggedRequests(d->Log(), "ConvertStream", "CANCELLED");
    ExpectServes(d->unix_target(), std::string("after a client killed in ") + mode);
  }
}

// Deadline before admission: with one call per connection, a Convert queued behind an
// admitted stream on the same connection expires in the client's transport. It never
// reaches a handler (nothing counted, nothing logged), and the stream it waited behind
// finishes exactly.
TEST(Fault, DeadlineBeforeAdmissionNeverReachesAHandler) {
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--max-concurrent-streams=1"});
  ASSERT_NE(d, nullptr);
  Client client(MakeChannel(d->unix_target()));
  const std::vector<int64_t> shape = {2, 256, 128};
  const std::vector<uint8_t> in = RandomBytes(2 * 256 * 64, 4);
  grpc::ClientContext sctx;
  auto stream = client.stub().ConvertStream(&sctx);
  v1::ConvertStreamRequest m;
  *m.mutable_header() = StreamHeaderFor(HopperSwizzleMx1(), shape);
  ASSERT_TRUE(stream->Write(m));
  v1::ConvertStreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp) && resp.has_header());  // admitted: the connection's one stream

  const std::string metrics_before = HttpGet(d->metrics_address(), "/metrics");
  const int logged_before = LoggedRequests(d->Log(), "Convert", "DEADLINE_EXCEEDED");
  wprep::client::CallOptions o;
  o.timeout = std::chrono::milliseconds(300);
  const absl::Status s = client.Convert(ConvertRequestFor(HopperSwizzleMx1(), {256, 128}, RandomBytes(256 * 64, 1)), o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  const std::string metrics_after = HttpGet(d->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics_after, "wprep_requests_total", {{"method", "Convert"}}),
            MetricValue(metrics_before, "wprep_requests_total", {{"method", "Convert"}}));
  EXPECT_EQ(LoggedRequests(d->Log(), "Convert", "DEADLINE_EXCEEDED"), logged_before);

  m.mutable_chunk()->set_offset(0);
  m.mutable_chunk()->set_data(AsString(in));
  ASSERT_TRUE(stream->Write(m));
  stream->WritesDone();
  std::string out;
  while (stream->Read(&resp)) out += resp.chunk().data();
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(out == CpuReference(HopperSwizzleMx1(), shape, in));
  ExpectServes(d->unix_target(), "after the expired queued call");
}

// Deadline mid-stream, with the client stalled sending and with the client stalled
// reading: DEADLINE_EXCEEDED for the client and in the daemon's log, and the stream's
// buffers back in the daemon once the client has dropped the call. (A daemon blocked
// sending to a client that stopped reading is released by the client's stream going
// away, not by the deadline alone: gRPC 1.51 does not fail a server write that waits
// for flow control when the call's deadline passes. Clients drop a call when it ends, as
// the client library does; the host budget bounds what one that does not can hold.)
TEST(Fault, DeadlineMidStreamFreesTheStreamsBuffers) {
  // The client below sleeps in neither a read nor a write, so nothing of its own polls its
  // connection: the RST_STREAM its deadline produces would go out only at gRPC's next
  // backup poll (every 5 s), and the daemon, whose write waits on that client, learns of
  // the end only then. A live client polls; this one is made to, every 100 ms. (Read when
  // gRPC initializes in this process, which is at the daemon's start below.)
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", 1);
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  const std::vector<int64_t> shape = {16, 1024, 1024};  // 8 MiB in, 8 MiB out
  int expired = 0;
  for (bool stall_reading : {false, true}) {
    SCOPED_TRACE(stall_reading ? "stalled reading" : "stalled sending");
    Client client(MakeChannel(d->unix_target()));
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      auto stream = client.stub().ConvertStream(&ctx);
      v1::ConvertStreamRequest m;
      *m.mutable_header() = StreamHeaderFor(HopperSwizzleMx1(), shape);
      ASSERT_TRUE(stream->Write(m));
      v1::ConvertStreamResponse resp;
      ASSERT_TRUE(stream->Read(&resp) && resp.has_header());
      const uint64_t send = stall_reading ? 8u << 20 : 1u << 20;
      for (uint64_t off = 0; off < send; off += 1 << 20) {
        m.mutable_chunk()->set_offset(off);
        m.mutable_chunk()->set_data(std::string(1 << 20, '\x11'));
        if (!stream->Write(m)) break;
      }
      if (stall_reading) stream->WritesDone();
      absl::SleepFor(absl::Milliseconds(2500));  // past the deadline without reading
      EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    }
    const absl::Time ended = absl::Now();
    if (!WaitFor([&] { return Idle(d->metrics_address(), "cpu"); })) {
      const std::string metrics = HttpGet(d->metrics_address(), "/metrics");
      const bool later = WaitFor([&] { return Idle(d->metrics_address(), "cpu"); }, absl::Seconds(60));
      ADD_FAILURE() << "the stream's buffers were still held 20 s after its deadline ("
                    << (later ? absl::StrCat("freed after ", absl::FormatDuration(absl::Now() - ended))
                              : std::string("not freed in 80 s"))
                    << ")\n" << metrics << "\n" << d->Log();
    }
    ++expired;
    EXPECT_TRUE(WaitFor([&] { return LoggedRequests(d->Log(), "ConvertStream", "DEADLINE_EXCEEDED") == expired; }))
        << d->Log();
    ExpectServes(d->unix_target(), "after a stream's deadline");
  }
}

// The outcome of one request of the load below.
struct Outcome {
  absl::StatusCode code = absl::StatusCode::kOk;
  bool exact = true;   // an OK answer carried the expected bytes
  bool after_signal = false;  // the answer came after SIGTERM was sent
  std::string what;
};

// 64 clients, each on its own connection, send unary and streamed conversions until the
// daemon is gone. Every answer is recorded; OK answers are checked byte for byte. A
// quarter of them are 8 MiB streams, each of which holds 45 MiB of the daemon's host
// budget (its 4 MiB slices and 1 MiB output chunks, StreamPipeline::HostBytes), and
// streams last longest, so at times nearly every client is in one: the daemon runs with
// --max-buffered-bytes=4G (kBudgetFlag, above 64 x 45 MiB) so that none is refused for
// memory, which would hide the refusals this load looks for.
class Load {
 public:
  struct Case {
    ConversionSpec spec;
    std::vector<int64_t> shape;
    std::vector<uint8_t> input;
    std::string expected;
    bool stream;
  };

  explicit Load(const Daemon& d) {
    const std::vector<std::pair<ConversionSpec, std::vector<int64_t>>> mix = {
        {HopperSwizzleMx1(), {256, 128}},
        {HopperSpec(Direction::kSwizzle, -2, 2), {1024, 1024}},
        {HopperSpec(Direction::kUnswizzle, -1, 3), {2, 512, 512}},
        {HopperSwizzleMx1(), {8, 1024, 1024}},
    };
    for (size_t i = 0; i < mix.size(); ++i) {
      absl::StatusOr<Plan> p = MakePlan(mix[i].first, mix[i].second);
      EXPECT_TRUE(p.ok()) << p.status();
      Case c{mix[i].first, mix[i].second, RandomBytes(p->input_bytes, 50 + i), {}, i == 3};
      c.expected = CpuReference(c.spec, c.shape, c.input);
      cases_.push_back(std::move(c));
    }
    for (int t = 0; t < kClients; ++t) {
      clients_.push_back(std::make_unique<Client>(MakeChannel(t % 2 ? d.tcp_target() : d.unix_target(), 64 << 20, t)));
    }
  }

  static constexpr int kClients = 64;
  static constexpr char kBudgetFlag[] = "--max-buffered-bytes=4G";

  void Start() {
    for (int t = 0; t < kClients; ++t) threads_.emplace_back([this, t] { Run(t); });
  }
  void MarkSignal() { signalled_.store(true); }
  void Stop() {
    stop_.store(true);
    for (std::thread& t : threads_) t.join();
  }
  int ok() const { return ok_.load(); }
  std::vector<Outcome> outcomes() {
    absl::MutexLock lock(&mu_);
    return outcomes_;
  }

 private:
  void Run(int t) {
    Client& client = *clients_[t];
    for (int i = 0; !stop_.load(); ++i) {
      const Case& c = cases_[(t + i) % cases_.size()];
      Outcome o;
      o.what = absl::StrCat(c.stream ? "stream " : "convert ", Describe(c.spec));
      wprep::client::StreamOptions so;
      so.timeout = std::chrono::seconds(60);
      std::string out;
      absl::Status s;
      if (c.stream) {
        s = client.ConvertStream(StreamHeaderFor(c.spec, c.shape), c.input, &out, so).status();
      } else {
        absl::StatusOr<v1::ConvertResponse> r = client.Convert(ConvertRequestFor(c.spec, c.shape, c.input), so);
        s = r.status();
        if (r.ok()) out = r->output_bytes_inline();
      }
      o.code = s.code();
      o.after_signal = signalled_.load();
      if (s.ok()) {
        o.exact = out == c.expected;
        ok_.fetch_add(1);
      } else {
        o.what += ": " + s.ToString();
      }
      {
        absl::MutexLock lock(&mu_);
        outcomes_.push_back(o);
      }
      if (!s.ok()) absl::SleepFor(absl::Milliseconds(50));  // the daemon is going; do not spin
    }
  }

  std::vector<Case> cases_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false}, signalled_{false};
  std::atomic<int> ok_{0};
  absl::Mutex mu_;
  std::vector<Outcome> outcomes_ ABSL_GUARDED_BY(mu_);
};

// Checks the outcomes of a load interrupted by SIGTERM: every OK exact, every refusal
// one of `allowed`, nothing refused before the signal. Returns the number of OKs after it.
int CheckOutcomes(const std::vector<Outcome>& outcomes, const std::vector<absl::StatusCode>& allowed) {
  int ok_after = 0;
  std::map<std::string, int> codes;
  for (const Outcome& o : outcomes) {
    if (o.code == absl::StatusCode::kOk) {
      EXPECT_TRUE(o.exact) << "told OK with wrong bytes: " << o.what;
      ok_after += o.after_signal ? 1 : 0;
      continue;
    }
    EXPECT_TRUE(o.after_signal) << "refused before any signal: " << o.what;
    ++codes[absl::StatusCodeToString(o.code)];
    EXPECT_NE(std::find(allowed.begin(), allowed.end(), o.code), allowed.end()) << o.what;
  }
  std::printf("%zu answers:", outcomes.size());
  for (const auto& [code, n] : codes) std::printf(" %d %s,", n, code.c_str());
  std::printf(" %d OK after the signal\n", ok_after);
  return ok_after;
}

// SIGTERM under load: work in flight finishes exactly, and every request the daemon
// finished reached its client; new work is refused. Calls that arrive as the server shuts
// down, before any handler took them, are cancelled by gRPC (it drops calls it has not
// matched to a handler): those clients see CANCELLED for work that never started, and the
// daemon never logs them. One whose handler had started when the shutdown cut it was being
// refused, and is logged UNAVAILABLE. The daemon exits 0 having drained.
TEST(Fault, SigtermUnderLoadFinishesInFlightWorkAndRefusesTheRest) {
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--drain-timeout=60s", Load::kBudgetFlag});
  ASSERT_NE(d, nullptr);
  Load load(*d);
  load.Start();
  ASSERT_TRUE(WaitFor([&] { return load.ok() >= 2 * Load::kClients; }, absl::Seconds(60))) << load.ok();
  load.MarkSignal();
  d->Signal(SIGTERM);
  const int status = d->WaitExit(absl::Seconds(90));
  load.Stop();
  ASSERT_NE(status, -1) << "did not exit";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << d->Log();
  const std::string log = d->Log();
  EXPECT_NE(log.find("event=stopped drained=true"), std::string::npos) << log;
  CheckOutcomes(load.outcomes(), {absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled});
  // Nothing the daemon started was cancelled, and every OK it logged was received.
  EXPECT_EQ(LoggedRequests(log, "Convert", "CANCELLED") + LoggedRequests(log, "ConvertStream", "CANCELLED"), 0)
      << LogLinesWith(log, {"code=CANCELLED", "event=draining", "event=answers_delivered", "event=stopped"});
  EXPECT_EQ(LoggedRequests(log, "Convert", "OK") + LoggedRequests(log, "ConvertStream", "OK"), load.ok());
}

// SIGTERM with no time to drain: in-flight work is cancelled, and a client is never told
// OK for a conversion that did not finish (an OK stream carries every byte).
TEST(Fault, SigtermWithoutDrainTimeNeverReportsUnfinishedWorkOk) {
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--drain-timeout=0s", Load::kBudgetFlag});
  ASSERT_NE(d, nullptr);
  Load load(*d);
  load.Start();
  ASSERT_TRUE(WaitFor([&] { return load.ok() >= 2 * Load::kClients; }, absl::Seconds(60))) << load.ok();
  load.MarkSignal();
  d->Signal(SIGTERM);
  const int status = d->WaitExit(absl::Seconds(90));
  load.Stop();
  ASSERT_NE(status, -1) << "did not exit";
  EXPECT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << "\n" << d->Log();
  // DATA_LOSS is what the client library says for a stream that ended OK but short.
  CheckOutcomes(load.outcomes(), {absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled});
}

// SIGKILL leaves the Unix socket file behind; a new daemon on the same path and TCP port
// replaces the stale socket and serves.
TEST(Fault, SigkillThenRestartOnTheSameSocketAndPort) {
  std::unique_ptr<Daemon> first = StartCpuDaemon();
  ASSERT_NE(first, nullptr);
  ExpectServes(first->unix_target(), "first daemon");
  const std::string socket_path = first->unix_target().substr(7);
  first->Signal(SIGKILL);
  ASSERT_NE(first->WaitExit(), -1);
  ASSERT_TRUE(std::filesystem::exists(socket_path)) << "no stale socket left to test with";
  // Once the first daemon is gone its TCP port is free, and until the second binds it any
  // process here may take it as a connection's local port (ctest runs tests side by side): a
  // bind refused as in use is tried again, for up to 5 s; any other failure fails at once.
  std::unique_ptr<Daemon> second;
  std::string error;
  for (int attempt = 0; attempt < 10 && second == nullptr; ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(500));
    second = Daemon::Start({"--devices=cpu", "--listen=" + first->unix_target(), "--listen=" + first->tcp_target()},
                           &error);
    if (second == nullptr && !absl::StrContains(error, "Address already in use")) break;
  }
  ASSERT_NE(second, nullptr) << error;
  ASSERT_TRUE(second->WaitServing()) << second->Log();
  ExpectServes(first->unix_target(), "restarted daemon, same socket path");
  ExpectServes(first->tcp_target(), "restarted daemon, same TCP port");
}

// A client that reads its stream slowly: the daemon holds a bounded amount (the
// stream's slice buffers and gRPC's flow-control windows), whatever the tensor's size,
// and the output is exact once the client reads on.
TEST(Fault, SlowStreamReaderKeepsDaemonMemoryBounded) {
#if defined(WPREP_ASAN)
  // The daemon is built like this test. AddressSanitizer keeps what is freed resident (its
  // quarantine, 256 MiB), and resident memory is what this test measures: this daemon
  // runs without it.
  const char* asan = std::getenv("ASAN_OPTIONS");
  setenv("ASAN_OPTIONS", (std::string(asan != nullptr ? asan : "") + ":quarantine_size_mb=0").c_str(), 1);
#endif
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  ExpectServes(d->unix_target(), "warm");
  constexpr int kMatrices = 64;
  constexpr uint64_t kMatrixBytes = 2048 * 2048;  // [2048, 4096]: 4 MiB in and out, no padding
  const ConversionSpec spec = HopperSwizzleMx1();
  auto matrix = [](int k) { return RandomBytes(kMatrixBytes, 900 + k); };
  const uint64_t rss_before = d->RssBytes();
  Client client(MakeChannel(d->unix_target()));
  grpc::ClientContext ctx;
  auto stream = client.stub().ConvertStream(&ctx);
  std::thread writer([&] {
    v1::ConvertStreamRequest m;
    *m.mutable_header() = StreamHeaderFor(spec, {kMatrices, 2048, 4096});
    if (!stream->Write(m)) return;
    for (int k = 0; k < kMatrices; ++k) {
      const std::vector<uint8_t> in = matrix(k);
      for (uint64_t off = 0; off < kMatrixBytes; off += 1 << 20) {
        m.mutable_chunk()->set_offset(k * kMatrixBytes + off);
        m.mutable_chunk()->set_data(in.data() + off, 1 << 20);
        if (!stream->Write(m)) return;
      }
    }
    stream->WritesDone();
  });
  v1::ConvertStreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp) && resp.has_header());
  uint64_t rss_peak = 0;
  double buffered_peak = 0;
  for (int i = 0; i < 16; ++i) {  // 4 s without reading
    absl::SleepFor(absl::Milliseconds(250));
    rss_peak = std::max(rss_peak, d->RssBytes());
    buffered_peak = std::max(buffered_peak, Metric(d->metrics_address(), "wprep_host_buffered_bytes"));
  }
  std::string out;
  int checked = 0;
  bool exact = true;
  while (stream->Read(&resp)) {
    ASSERT_EQ(resp.chunk().offset(), checked * kMatrixBytes + out.size());
    out += resp.chunk().data();
    while (out.size() >= kMatrixBytes) {
      exact = exact && out.compare(0, kMatrixBytes, CpuReference(spec, {1, 2048, 4096}, matrix(checked))) == 0;
      out.erase(0, kMatrixBytes);
      ++checked;
    }
  }
  writer.join();
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(checked, kMatrices);
  EXPECT_TRUE(exact);
  // What the stream may hold: its slice buffers (4 MiB slices), which it charged to the
  // host budget, and the transport's windows, far below the 256 MiB it carries.
  const uint64_t charged = server::StreamPipeline::HostBytes(4 << 20) + (4 << 20);
  std::printf("slow reader: a %d MiB stream, daemon RSS %llu MiB before, %llu MiB at most while the reader "
              "stalled (%.0f MiB charged to the host budget)\n",
              kMatrices * 4, static_cast<unsigned long long>(rss_before >> 20),
              static_cast<unsigned long long>(rss_peak >> 20), buffered_peak / (1 << 20));
  EXPECT_LE(buffered_peak, static_cast<double>(charged));
  EXPECT_LT(rss_peak, rss_before + charged + (64ull << 20)) << "RSS grew with the unread output";
  EXPECT_TRUE(WaitFor([&] { return Idle(d->metrics_address(), "cpu"); }));
}

// ---------------------------------------------------------------------------------------
// The daemon in this process, on one fake GPU.

// A fake GPU whose conversions can be held: Close() makes every Convert wait until
// Open(). Everything else is FakeRuntime's.
class GatedRuntime final : public server::DeviceRuntime {
 public:
  GatedRuntime() : fake_(1) {}
  FakeRuntime& fake() { return fake_; }

  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    closed_ = false;
  }
  // Waits until `n` conversions wait at the gate.
  bool WaitHeld(int n) {
    absl::MutexLock lock(&mu_);
    auto held = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&held), absl::Seconds(20));
  }

  bool compiled_in() const override { return true; }
  absl::StatusOr<std::vector<GpuInfo>> ListGpus() override { return fake_.ListGpus(); }
  absl::StatusOr<Stream> CreateStream(int gpu) override { return fake_.CreateStream(gpu); }
  void DestroyStream(int gpu, Stream s) override { fake_.DestroyStream(gpu, s); }
  absl::Status ConfigurePool(int gpu, uint64_t keep) override { return fake_.ConfigurePool(gpu, keep); }
  absl::StatusOr<void*> AllocateAsync(int gpu, uint64_t bytes, Stream s) override {
    return fake_.AllocateAsync(gpu, bytes, s);
  }
  absl::Status FreeAsync(int gpu, void* p, Stream s) override { return fake_.FreeAsync(gpu, p, s); }
  absl::Status CopyToDeviceAsync(int gpu, void* dst, const void* src, uint64_t n, Stream s) override {
    return fake_.CopyToDeviceAsync(gpu, dst, src, n, s);
  }
  absl::Status CopyToHostAsync(int gpu, void* dst, const void* src, uint64_t n, Stream s) override {
    return fake_.CopyToHostAsync(gpu, dst, src, n, s);
  }
  absl::Status Convert(int gpu, const Plan& plan, const void* in, void* out, Stream s) override {
    {
      absl::MutexLock lock(&mu_);
      ++held_;
      auto open = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !closed_; };
      mu_.Await(absl::Condition(&open));
      --held_;
    }
    absl::Status st = fake_.Convert(gpu, plan, in, out, s);
    absl::MutexLock lock(&mu_);  // for Sync
    return st;
  }
  // Orders every conversion that finished before the caller's next accesses. A client
  // reads its IPC destination once the answer came, through a socket, which
  // ThreadSanitizer does not see as an ordering; the fake GPU's memory is in this process.
  void Sync() { absl::MutexLock lock(&mu_); }
  absl::Status Synchronize(int gpu, Stream s) override { return fake_.Synchronize(gpu, s); }
  std::unique_ptr<server::DeviceTimer> NewTimer(int gpu) override { return fake_.NewTimer(gpu); }
  absl::StatusOr<server::Event> CreateEvent(int gpu) override { return fake_.CreateEvent(gpu); }
  absl::StatusOr<server::Event> OpenIpcEvent(int gpu, absl::string_view h) override {
    return fake_.OpenIpcEvent(gpu, h);
  }
  void DestroyEvent(int gpu, server::Event e) override { fake_.DestroyEvent(gpu, e); }
  absl::Status RecordEvent(int gpu, server::Event e, Stream s) override { return fake_.RecordEvent(gpu, e, s); }
  absl::Status StreamWaitEvent(int gpu, Stream s, server::Event e) override {
    return fake_.StreamWaitEvent(gpu, s, e);
  }
  absl::Status SynchronizeEvent(int gpu, server::Event e) override { return fake_.SynchronizeEvent(gpu, e); }
  absl::Status WriteValue32(int gpu, Stream s, void* p, uint32_t v) override { return fake_.WriteValue32(gpu, s, p, v); }
  absl::Status WaitValue32(int gpu, Stream s, void* p, uint32_t v) override { return fake_.WaitValue32(gpu, s, p, v); }
  absl::StatusOr<void*> RegisterHost(int gpu, void* p, uint64_t n) override { return fake_.RegisterHost(gpu, p, n); }
  void UnregisterHost(void* p) override { fake_.UnregisterHost(p); }
  absl::StatusOr<void*> HostDevicePointer(int gpu, void* p) override { return fake_.HostDevicePointer(gpu, p); }
  absl::StatusOr<void*> AllocatePinned(uint64_t bytes) override { return fake_.AllocatePinned(bytes); }
  void FreePinned(void* p) override { fake_.FreePinned(p); }
  absl::StatusOr<IpcMapping> OpenIpc(int gpu, absl::string_view h) override { return fake_.OpenIpc(gpu, h); }
  absl::Status CloseIpc(int gpu, void* base) override { return fake_.CloseIpc(gpu, base); }
  absl::Status Touch(int gpu, const void* p, uint64_t n) override { return fake_.Touch(gpu, p, n); }
  absl::StatusOr<std::vector<std::string>> ExportSampleHandles(int gpu, int count) override {
    return fake_.ExportSampleHandles(gpu, count);
  }

 private:
  FakeRuntime fake_;
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int held_ ABSL_GUARDED_BY(mu_) = 0;
};

// wprep::server::Daemon on a GatedRuntime, through its phases (WarmUp, Serve, Drain) on
// a thread of this process, listening on a Unix socket in a fresh folder.
class FakeGpuDaemon {
 public:
  explicit FakeGpuDaemon(std::vector<std::string> flags) {
    char tmpl[] = "/tmp/wprep-fault-XXXXXX";
    dir_ = mkdtemp(tmpl) != nullptr ? tmpl : "/tmp";
    target_ = "unix://" + dir_ + "/wprepd.sock";
    flags.insert(flags.begin(), {"--listen=" + target_, "--metrics-address=127.0.0.1:0", "--port-file=" + dir_ + "/ports",
                                 "--cpu-threads=2", "--drain-timeout=10s"});
    absl::StatusOr<server::Options> o = server::ParseOptions(flags);
    if (!o.ok()) {
      error_ = o.status().ToString();
      return;
    }
    absl::StatusOr<std::unique_ptr<server::Daemon>> d = server::Daemon::Start(*o, runtime_.get());
    if (!d.ok()) {
      error_ = d.status().ToString();
      return;
    }
    daemon_ = *std::move(d);
    thread_ = std::thread([this] {
      if (absl::Status s = daemon_->WarmUp(); s.ok()) {
        daemon_->Serve();
      } else {
        std::fprintf(stderr, "fake-GPU daemon warm-up: %s\n", s.ToString().c_str());
      }
      daemon_->Drain("test over");
      drained_ = true;
    });
    std::ifstream ports(dir_ + "/ports");
    for (std::string kind, addr; ports >> kind >> addr;) {
      if (kind == "metrics") metrics_ = addr;
    }
    auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
    serving_ = WaitFor([&] {
      grpc::ClientContext ctx;
      grpc::health::v1::HealthCheckRequest req;
      grpc::health::v1::HealthCheckResponse resp;
      return health->Check(&ctx, req, &resp).ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    });
  }
  ~FakeGpuDaemon() {
    if (daemon_ != nullptr) {
      runtime_->Open();
      runtime_->fake().HoldEventWaits(false);
      daemon_->RequestStop();
      thread_.join();
      // Kept, as wprepd keeps its own at exit: a stopped grpc::Server's destructor waits
      // up to 10 s for clients' connections, which gRPC closes in the background after
      // their channels are gone.
      static auto* const stopped = new std::vector<std::pair<std::unique_ptr<server::Daemon>, std::unique_ptr<GatedRuntime>>>();
      stopped->emplace_back(std::move(daemon_), std::move(runtime_));
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Starts the drain a signal would; drained() once it has finished.
  void RequestStop() { daemon_->RequestStop(); }
  bool drained() const { return drained_; }
  bool ok() const { return serving_; }
  const std::string& error() const { return error_; }
  const std::string& target() const { return target_; }
  const std::string& metrics() const { return metrics_; }
  GatedRuntime& runtime() { return *runtime_; }
  std::string Uuid() const {
    const server::Uuid u = FakeRuntime::FakeUuid(0);
    return std::string(reinterpret_cast<const char*>(u.data()), u.size());
  }

 private:
  std::unique_ptr<GatedRuntime> runtime_ = std::make_unique<GatedRuntime>();  // outlives the daemon
  std::string dir_, target_, metrics_, error_;
  std::unique_ptr<server::Daemon> daemon_;
  std::thread thread_;
  std::atomic<bool> drained_{false};
  bool serving_ = false;
};

#define ASSERT_SERVING(d) ASSERT_TRUE((d).ok()) << (d).error()

// A bytes request that needs 4 MiB of device memory (2 MiB staged in, 2 MiB out),
// more than any warm-up conversion.
struct BigCase {
  BigCase() : shape{4, 1024, 1024}, input(RandomBytes(2 << 20, 8)), expected(CpuReference(HopperSwizzleMx1(), shape, input)) {}
  v1::ConvertRequest Request() const { return ConvertRequestFor(HopperSwizzleMx1(), shape, input); }
  static constexpr uint64_t kDeviceBytes = 4 << 20;
  std::vector<int64_t> shape;
  std::vector<uint8_t> input;
  std::string expected;
};

// Runs `fn` on a thread; Join returns its result.
template <typename T>
class Async {
 public:
  explicit Async(std::function<T()> fn) : thread_([this, fn] { result_ = fn(); }) {}
  T Join() {
    thread_.join();
    return std::move(result_);
  }

 private:
  T result_ = T(absl::UnknownError("not run"));
  std::thread thread_;
};

absl::StatusOr<std::string> ConvertBytes(const std::string& target, const v1::ConvertRequest& r,
                                         std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
  Client c(MakeChannel(target));
  wprep::client::CallOptions o;
  o.timeout = timeout;
  absl::StatusOr<v1::ConvertResponse> resp = c.Convert(r, o);
  if (!resp.ok()) return resp.status();
  return resp->output_bytes_inline();
}

// Deadline while waiting for a stream: the GPU's one stream is busy, the waiting request
// gets DEADLINE_EXCEEDED without converting, the busy one finishes exactly.
TEST(FaultFakeGpu, DeadlineWhileWaitingForAStream) {
  FakeGpuDaemon d({"--streams-per-device=1"});
  ASSERT_SERVING(d);
  const BigCase c;
  d.runtime().Close();
  Async<absl::StatusOr<std::string>> holder([&] { return ConvertBytes(d.target(), c.Request()); });
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  const int converts = d.runtime().fake().totals().converts;
  absl::StatusOr<std::string> waiter = ConvertBytes(d.target(), c.Request(), std::chrono::milliseconds(300));
  EXPECT_EQ(waiter.status().code(), absl::StatusCode::kDeadlineExceeded) << waiter.status();
  // The daemon's copy of the deadline is a little later than the client's (the timeout
  // travels): free the stream once that has passed too.
  absl::SleepFor(absl::Milliseconds(200));
  d.runtime().Open();
  absl::StatusOr<std::string> held = holder.Join();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(*held == c.expected);
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
  EXPECT_EQ(d.runtime().fake().totals().converts, converts + 1) << "the expired request converted";
}

// A batch never waits for a second stream while it holds one: with one of the GPU's two
// streams held by a conversion at the gate, a two-item batch runs both items on the
// stream it got (it reaches the gate) instead of holding that stream while it waits for
// the other. Batches that each held some streams and waited for more deadlocked.
TEST(FaultFakeGpu, BatchTakesOnlyFreeStreamsBeyondItsFirst) {
  FakeGpuDaemon d({"--streams-per-device=2"});
  ASSERT_SERVING(d);
  const BigCase c;
  d.runtime().Close();
  Async<absl::StatusOr<std::string>> holder([&] { return ConvertBytes(d.target(), c.Request()); });
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  v1::ConvertBatchRequest batch;
  for (int i = 0; i < 2; ++i) {
    v1::ConvertItem* item = batch.add_items()->mutable_convert();
    *item->mutable_spec() = SpecToProto(HopperSwizzleMx1());
    for (int64_t dim : c.shape) item->add_logical_shape(dim);
    item->mutable_source()->set_inline_bytes(AsString(c.input));
  }
  Async<absl::StatusOr<v1::ConvertBatchResponse>> batcher([&] {
    Client client(MakeChannel(d.target()));
    wprep::client::CallOptions o;
    o.timeout = std::chrono::seconds(60);
    return client.ConvertBatch(batch, o);
  });
  EXPECT_TRUE(d.runtime().WaitHeld(2)) << "the batch waits for the held stream instead of running on its own";
  d.runtime().Open();
  absl::StatusOr<std::string> held = holder.Join();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(*held == c.expected);
  absl::StatusOr<v1::ConvertBatchResponse> r = batcher.Join();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->items_size(), 2);
  for (const v1::BatchItemResult& item : r->items()) {
    ASSERT_EQ(item.outputs_size(), 1);
    EXPECT_TRUE(item.outputs(0).inline_bytes() == c.expected);
  }
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
}

// Deadline while waiting for device memory: the budget is held by a request in
// conversion; the waiter gets DEADLINE_EXCEEDED (long before --memory-wait), is counted as
// having waited, and leaves the budget whole.
TEST(FaultFakeGpu, DeadlineWhileWaitingForDeviceMemory) {
  FakeGpuDaemon d({"--streams-per-device=2", "--max-device-bytes=" + std::to_string(BigCase::kDeviceBytes),
                   "--memory-wait=60s"});
  ASSERT_SERVING(d);
  const BigCase c;
  d.runtime().Close();
  Async<absl::StatusOr<std::string>> holder([&] { return ConvertBytes(d.target(), c.Request()); });
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  const double waits = Metric(d.metrics(), "wprep_device_memory_waits_total");
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::string> waiter = ConvertBytes(d.target(), c.Request(), std::chrono::milliseconds(500));
  EXPECT_EQ(waiter.status().code(), absl::StatusCode::kDeadlineExceeded) << waiter.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_EQ(Metric(d.metrics(), "wprep_device_memory_waits_total"), waits + 1);
  EXPECT_TRUE(WaitFor([&] { return Metric(d.metrics(), "wprep_device_memory_waiting_requests") == 0; }));
  d.runtime().Open();
  absl::StatusOr<std::string> held = holder.Join();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(*held == c.expected);
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
  absl::StatusOr<std::string> again = ConvertBytes(d.target(), c.Request());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == c.expected);
}

// Deadline during the conversion itself (unary and streamed): the client gets
// DEADLINE_EXCEEDED, never OK, and the daemon counts it so; once the conversion ends the
// daemon holds nothing.
TEST(FaultFakeGpu, DeadlineDuringConversionIsNeverOk) {
  FakeGpuDaemon d({});
  ASSERT_SERVING(d);
  const BigCase c;
  d.runtime().Close();
  Async<absl::StatusOr<std::string>> unary(
      [&] { return ConvertBytes(d.target(), c.Request(), std::chrono::milliseconds(500)); });
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  absl::StatusOr<std::string> r = unary.Join();  // returns at the deadline, the conversion still held
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  d.runtime().Open();
  // The daemon counts it as the client saw it, once the conversion it could not deliver ends.
  EXPECT_TRUE(WaitFor([&] {
    return Metric(d.metrics(), "wprep_requests_total", {{"method", "Convert"}, {"code", "DEADLINE_EXCEEDED"}}) == 1;
  })) << HttpGet(d.metrics(), "/metrics");
  EXPECT_EQ(Metric(d.metrics(), "wprep_requests_total", {{"method", "Convert"}, {"code", "OK"}}), 0);
  d.runtime().Close();

  // A stream of two slices whose first slice is held past the deadline.
  const std::vector<int64_t> shape = {16, 1024, 1024};
  const std::vector<uint8_t> in = RandomBytes(8 << 20, 21);
  Client client(MakeChannel(d.target()));
  wprep::client::StreamOptions so;
  so.timeout = std::chrono::milliseconds(1500);
  so.stripe_min_bytes = ~0ull;
  std::string out;
  const absl::Status s = client.ConvertStream(StreamHeaderFor(HopperSwizzleMx1(), shape), in, &out, so).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  d.runtime().Open();
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); })) << HttpGet(d.metrics(), "/metrics");
  EXPECT_TRUE(WaitFor([&] {
    return Metric(d.metrics(), "wprep_requests_total", {{"method", "ConvertStream"}, {"code", "DEADLINE_EXCEEDED"}}) == 1;
  })) << HttpGet(d.metrics(), "/metrics");
  EXPECT_EQ(d.runtime().fake().totals().device_bytes_now, 0u);
  so.timeout = std::chrono::seconds(30);
  ASSERT_TRUE(client.ConvertStream(StreamHeaderFor(HopperSwizzleMx1(), shape), in, &out, so).ok());
  EXPECT_TRUE(out == CpuReference(HopperSwizzleMx1(), shape, in));
}

// Device memory running out: beyond the budget while another request holds it, beyond
// the whole budget, and the GPU's own allocation failing. Each is RESOURCE_EXHAUSTED
// saying what to do, leaves nothing allocated, and the same request succeeds once memory
// is back.
TEST(FaultFakeGpu, DeviceMemoryExhaustionIsResourceExhaustedThenRecovers) {
  FakeGpuDaemon d({"--streams-per-device=4", "--max-device-bytes=" + std::to_string(BigCase::kDeviceBytes),
                   "--memory-wait=200ms"});
  ASSERT_SERVING(d);
  const BigCase c;
  d.runtime().Close();
  Async<absl::StatusOr<std::string>> holder([&] { return ConvertBytes(d.target(), c.Request()); });
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  absl::StatusOr<std::string> waiter = ConvertBytes(d.target(), c.Request());
  EXPECT_EQ(waiter.status().code(), absl::StatusCode::kResourceExhausted) << waiter.status();
  EXPECT_NE(waiter.status().message().find("retry later"), std::string::npos) << waiter.status();
  d.runtime().Open();
  ASSERT_TRUE(holder.Join().ok());

  // Twice the budget: refused at once, whatever is free.
  const std::vector<int64_t> twice = {8, 1024, 1024};
  absl::StatusOr<std::string> never = ConvertBytes(d.target(), ConvertRequestFor(HopperSwizzleMx1(), twice, RandomBytes(4 << 20, 2)));
  EXPECT_EQ(never.status().code(), absl::StatusCode::kResourceExhausted) << never.status();
  EXPECT_NE(never.status().message().find("--max-device-bytes"), std::string::npos) << never.status();

  // The GPU has less memory than the budget promised.
  d.runtime().fake().SetDeviceCapacity(0, 3 << 20);
  absl::StatusOr<std::string> short_gpu = ConvertBytes(d.target(), c.Request());
  EXPECT_EQ(short_gpu.status().code(), absl::StatusCode::kResourceExhausted) << short_gpu.status();
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
  EXPECT_EQ(d.runtime().fake().totals().device_bytes_now, 0u);
  d.runtime().fake().SetDeviceCapacity(0, 0);

  absl::StatusOr<std::string> again = ConvertBytes(d.target(), c.Request());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == c.expected);
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
}

// IPC memory its owner frees behind the daemon's back: a cached mapping keeps its memory
// (as CUDA keeps an opened allocation alive), so requests through it still convert; once
// released, the handle cannot be opened again (INVALID_ARGUMENT naming the field). A
// release while a request uses the mapping is deferred until that request ends.
TEST(FaultFakeGpu, IpcMemoryFreedByItsOwnerWhileCached) {
  FakeGpuDaemon d({"--streams-per-device=2"});
  ASSERT_SERVING(d);
  const GoldenCase* gc = nullptr;
  for (const GoldenCase& g : GoldenCases()) {
    if (!g.error && !g.output_file.empty() && g.input_bytes >= 4096) {
      gc = &g;
      break;
    }
  }
  ASSERT_NE(gc, nullptr);
  const std::vector<uint8_t> input = GoldenInput(*gc);
  FakeRuntime& fake = d.runtime().fake();
  FakeRuntime::Exported src = fake.ExportHandle(0, input.size());
  FakeRuntime::Exported dst = fake.ExportHandle(0, gc->output_bytes);
  std::copy(input.begin(), input.end(), src.ptr);
  auto request = [&] {
    v1::ConvertRequest r = ConvertRequestFor(gc->spec, gc->logical_shape, {});
    r.clear_source_bytes();
    for (auto [buf, handle, size] : {std::tuple{r.mutable_source_ipc(), src.handle, input.size()},
                                     std::tuple{r.mutable_destination_ipc(), dst.handle, gc->output_bytes}}) {
      buf->set_handle(handle);
      buf->set_size(size);
      buf->set_device_uuid(d.Uuid());
    }
    return r;
  };
  auto convert = [&]() -> absl::Status {
    std::fill(dst.ptr, dst.ptr + gc->output_bytes, 0xAB);
    Client c(MakeChannel(d.target()));
    absl::Status s = c.Convert(request()).status();
    d.runtime().Sync();
    if (s.ok() && !MatchesGolden(*gc, std::string(dst.ptr, dst.ptr + gc->output_bytes))) {
      return absl::DataLossError("output differs from the reference");
    }
    return s;
  };
  auto release = [&](const std::string& handle) {
    v1::ReleaseIpcHandlesRequest rel;
    rel.add_handles()->set_handle(handle);
    rel.mutable_handles(0)->set_device_uuid(d.Uuid());
    Client c(MakeChannel(d.target()));
    return c.ReleaseIpcHandles(rel);
  };
  ASSERT_TRUE(convert().ok());
  EXPECT_EQ(Metric(d.metrics(), "wprep_ipc_cache_entries"), 2);

  fake.FreeExported(src.handle);  // the owner frees the source without telling the daemon
  EXPECT_TRUE(convert().ok()) << "a cached mapping keeps its memory";

  // Released while a request holds the mapping: deferred, and that request finishes.
  d.runtime().Close();
  Async<absl::Status> in_flight(convert);
  ASSERT_TRUE(d.runtime().WaitHeld(1));
  absl::StatusOr<v1::ReleaseIpcHandlesResponse> rel = release(src.handle);
  ASSERT_TRUE(rel.ok()) << rel.status();
  EXPECT_EQ(rel->deferred(), 1u);
  d.runtime().Open();
  EXPECT_TRUE(in_flight.Join().ok());
  EXPECT_TRUE(WaitFor([&] { return Metric(d.metrics(), "wprep_ipc_cache_entries") == 1; }));

  const absl::Status gone = convert();
  EXPECT_EQ(gone.code(), absl::StatusCode::kInvalidArgument) << gone;
  EXPECT_NE(gone.message().find("source_ipc"), std::string::npos) << gone;
  EXPECT_TRUE(WaitFor([&] { return Idle(d.metrics(), "gpu0"); }));
  ExpectServes(d.target(), "after a freed IPC source");
}

// A ConvertBatch answered once queued with a signal event, through gRPC: the answer comes while the fake
// GPU still holds the work (its event wait is held), with the outputs' bytes and the
// client's event recorded after every item; the kernel times reach the metrics only once
// the work is done; a drain waits for the work. Every invalid fence or combination, and
// inline items, are INVALID_ARGUMENT naming the field (a BadRequest field violation too),
// and write nothing.
TEST(FaultFakeGpu, CompletionEventAnswersOnceQueuedAndDrainWaitsForTheWork) {
  FakeGpuDaemon d({"--streams-per-device=2"});
  ASSERT_SERVING(d);
  FakeRuntime& fake = d.runtime().fake();
  std::vector<const GoldenCase*> cases;
  for (const GoldenCase& g : GoldenCases()) {
    if (!g.error && !g.output_file.empty() && g.input_bytes >= 4096 && g.input_bytes <= (64 << 10) && cases.size() < 3) {
      cases.push_back(&g);
    }
  }
  ASSERT_EQ(cases.size(), 3u);
  std::vector<FakeRuntime::Exported> outs;
  v1::ConvertBatchRequest batch;
  for (const GoldenCase* g : cases) {
    const std::vector<uint8_t> in = GoldenInput(*g);
    FakeRuntime::Exported src = fake.ExportHandle(0, in.size());
    std::copy(in.begin(), in.end(), src.ptr);
    FakeRuntime::Exported dst = fake.ExportHandle(0, g->output_bytes);
    std::fill(dst.ptr, dst.ptr + g->output_bytes, 0xAB);
    outs.push_back(dst);
    v1::ConvertItem* item = batch.add_items()->mutable_convert();
    *item->mutable_spec() = SpecToProto(g->spec);
    for (int64_t dim : g->logical_shape) item->add_logical_shape(dim);
    for (auto [buf, handle, size] : {std::tuple{item->mutable_source()->mutable_ipc(), src.handle, in.size()},
                                     std::tuple{item->mutable_destination()->mutable_ipc(), dst.handle, g->output_bytes}}) {
      buf->set_handle(handle);
      buf->set_size(size);
      buf->set_device_uuid(d.Uuid());
    }
  }
  Client client(MakeChannel(d.target()));
  wprep::client::CallOptions o;
  o.timeout = std::chrono::seconds(10);
  auto untouched = [&] {
    d.runtime().Sync();
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!std::all_of(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes, [](uint8_t b) { return b == 0xAB; })) return false;
    }
    return true;
  };
  // Every fence rule is checked at the edge: INVALID_ARGUMENT whose message names the
  // field, with a google.rpc.BadRequest field violation naming it too.
  auto expect_invalid = [&](const v1::ConvertBatchRequest& r, const std::string& field, const std::string& what = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ConvertBatchResponse resp;
    const grpc::Status s = client.stub().ConvertBatch(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(field + (what.empty() ? "" : what)), std::string::npos) << s.error_message();
    EXPECT_EQ(FieldViolation(s), field) << s.error_message();
  };
  const int records_before = fake.totals().ipc_event_records;
  {
    v1::ConvertBatchRequest r = batch;
    r.set_answer_when(v1::ANSWER_WHEN_QUEUED);
    v1::IpcEventRef* signal = r.add_signal_when_done()->mutable_event();
    signal->set_handle("short");
    signal->set_device_uuid(d.Uuid());
    expect_invalid(r, "signal_when_done[0].event.handle");
    signal->set_handle(fake.ExportEventHandle(0));
    signal->set_device_uuid("x");
    expect_invalid(r, "signal_when_done[0].event.device_uuid");
    signal->set_device_uuid(d.Uuid());
    r.mutable_wait_for()->mutable_event()->set_handle(std::string(63, 'x'));
    r.mutable_wait_for()->mutable_event()->set_device_uuid(d.Uuid());
    expect_invalid(r, "wait_for.event.handle");
    r.mutable_wait_for()->mutable_event()->set_handle(fake.ExportEventHandle(0));
    r.mutable_wait_for()->mutable_event()->set_device_uuid(std::string(15, 'u'));
    expect_invalid(r, "wait_for.event.device_uuid");
    r.mutable_wait_for()->Clear();
    expect_invalid(r, "wait_for", " must name its kind");
    r.clear_wait_for();
    FakeRuntime::Exported word = fake.ExportHandle(0, 8);
    auto flag_at = [&](uint64_t offset, uint64_t size) {
      v1::FenceWord f;
      f.mutable_buffer()->set_handle(word.handle);
      f.mutable_buffer()->set_device_uuid(d.Uuid());
      f.mutable_buffer()->set_offset(offset);
      f.mutable_buffer()->set_size(size);
      f.set_value(1);
      return f;
    };
    v1::FenceWord* flag = r.add_signal_when_done()->mutable_word();
    *flag = flag_at(2, 4);
    expect_invalid(r, "signal_when_done[1].word.buffer", " must name one 4-byte aligned 32-bit word");
    *flag = flag_at(0, 8);
    expect_invalid(r, "signal_when_done[1].word.buffer", " must name one 4-byte aligned 32-bit word");
    *flag = flag_at(8, 4);
    expect_invalid(r, "signal_when_done[1].word.buffer", ": ");  // past the allocation's end
    *flag = flag_at(0, 4);
    flag->mutable_buffer()->set_handle("h");
    expect_invalid(r, "signal_when_done[1].word.buffer.handle");
    flag->Clear();
    flag->set_value(1);
    expect_invalid(r, "signal_when_done[1].word", " must name its word");
    flag->mutable_host_word()->set_name("../etc/passwd");
    expect_invalid(r, "signal_when_done[1].word.host_word.name");
    flag->mutable_host_word()->set_name("wprep-" + std::string(201, 'a'));
    expect_invalid(r, "signal_when_done[1].word.host_word.name");
    flag->mutable_host_word()->set_name("wprep-absent-" + std::to_string(getpid()));
    expect_invalid(r, "signal_when_done[1].word.host_word", ": /dev/shm/wprep-absent-");
    flag->mutable_host_word()->set_offset(6);
    expect_invalid(r, "signal_when_done[1].word.host_word.offset", " must be a multiple of 4");
    {
      v1::ConvertBatchRequest two = r;  // at most one event and one word to signal
      *two.mutable_signal_when_done(1) = two.signal_when_done(0);
      expect_invalid(two, "signal_when_done[1]", " is a second event");
      *two.mutable_signal_when_done(0)->mutable_word() = flag_at(0, 4);
      *two.mutable_signal_when_done(1)->mutable_word() = flag_at(0, 4);
      expect_invalid(two, "signal_when_done[1]", " is a second word");
      two.mutable_signal_when_done(1)->Clear();
      expect_invalid(two, "signal_when_done[1]", " must name its kind");
    }
    r.mutable_signal_when_done()->RemoveLast();
    {
      v1::ConvertBatchRequest rf = r;
      rf.mutable_wait_for()->mutable_word()->set_value(1);
      expect_invalid(rf, "wait_for.word", " must name its word");
      rf.mutable_wait_for()->mutable_word()->mutable_host_word()->set_name("wprep-/x");
      expect_invalid(rf, "wait_for.word.host_word.name");
      *rf.mutable_wait_for()->mutable_word() = flag_at(0, 8);
      expect_invalid(rf, "wait_for.word.buffer", " must name one 4-byte aligned 32-bit word");
    }
    {
      // answer_when and signal_when_done go together.
      v1::ConvertBatchRequest unsignalled = batch;
      unsignalled.set_answer_when(v1::ANSWER_WHEN_QUEUED);
      expect_invalid(unsignalled, "answer_when", " = ANSWER_WHEN_QUEUED needs signal_when_done");
      v1::ConvertBatchRequest unqueued = r;
      unqueued.set_answer_when(v1::ANSWER_WHEN_DONE);
      expect_invalid(unqueued, "signal_when_done", " needs answer_when = ANSWER_WHEN_QUEUED");
      unqueued.set_answer_when(static_cast<v1::AnswerWhen>(7));
      expect_invalid(unqueued, "answer_when", " is 7");
    }
    v1::ConvertBatchRequest flag_alone = batch;  // answered once queued on a word alone: IPC -> IPC only
    flag_alone.set_answer_when(v1::ANSWER_WHEN_QUEUED);
    *flag_alone.add_signal_when_done()->mutable_word() = flag_at(0, 4);
    flag_alone.mutable_items(1)->mutable_convert()->mutable_destination()->clear_ipc();
    expect_invalid(flag_alone, "items[1].convert.destination.ipc", " is required with answer_when = ANSWER_WHEN_QUEUED");
    r.mutable_items(1)->mutable_convert()->mutable_destination()->clear_ipc();
    expect_invalid(r, "items[1].convert.destination.ipc");
    // Past the edge, the daemon's checks name the field too: an event of no GPU it has.
    v1::ConvertBatchRequest elsewhere = batch;
    elsewhere.set_answer_when(v1::ANSWER_WHEN_QUEUED);
    v1::IpcEventRef* e = elsewhere.add_signal_when_done()->mutable_event();
    e->set_handle(fake.ExportEventHandle(0));
    e->set_device_uuid(std::string(16, '\x5a'));
    absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(elsewhere, o);
    EXPECT_NE(resp.status().message().find("signal_when_done[0].event.device_uuid: "), std::string::npos)
        << resp.status();
    v1::ConvertBatchRequest forgotten = batch;
    const std::string handle = fake.ExportEventHandle(0);
    fake.ForgetEventHandle(handle);
    forgotten.mutable_wait_for()->mutable_event()->set_handle(handle);
    forgotten.mutable_wait_for()->mutable_event()->set_device_uuid(d.Uuid());
    expect_invalid(forgotten, "wait_for.event.handle", ": cannot be opened");
  }
  EXPECT_TRUE(untouched()) << "a refused batch wrote";
  EXPECT_EQ(fake.totals().ipc_event_records, records_before);

  v1::ConvertBatchRequest r = batch;
  r.set_answer_when(v1::ANSWER_WHEN_QUEUED);
  r.add_signal_when_done()->mutable_event()->set_handle(fake.ExportEventHandle(0));
  r.mutable_signal_when_done(0)->mutable_event()->set_device_uuid(d.Uuid());
  // Not held: the three kernel times reach the metrics once the work is done.
  const double kernels_first = Metric(d.metrics(), "wprep_kernel_duration_seconds_count", {{"device", "gpu0"}});
  ASSERT_GE(kernels_first, 0);
  {
    // With a completion flag: the word holds the value once the answer is in.
    FakeRuntime::Exported word = fake.ExportHandle(0, 4);
    std::fill(word.ptr, word.ptr + 4, 0);
    v1::ConvertBatchRequest flagged = r;
    v1::FenceWord* w = flagged.add_signal_when_done()->mutable_word();
    v1::CudaIpcBuffer* b = w->mutable_buffer();
    b->set_handle(word.handle);
    b->set_device_uuid(d.Uuid());
    b->set_size(4);
    w->set_value(0x8000002Au);
    const int writes_before = fake.totals().flag_writes;
    ASSERT_TRUE(client.ConvertBatch(flagged, o).ok());
    d.runtime().Sync();
    uint32_t v = 0;
    std::memcpy(&v, word.ptr, 4);
    EXPECT_EQ(v, 0x8000002Au);
    EXPECT_EQ(fake.totals().flag_writes, writes_before + 1);
    EXPECT_TRUE(WaitFor([&] {
      return Metric(d.metrics(), "wprep_kernel_duration_seconds_count", {{"device", "gpu0"}}) == kernels_first + 3;
    }));
  }
  {
    // A word of shared host memory: written the same way.
    ShmFile file(4096);
    ASSERT_TRUE(file.ok());
    v1::ConvertBatchRequest flagged = r;
    v1::FenceWord* w = flagged.add_signal_when_done()->mutable_word();
    w->mutable_host_word()->set_name(file.name());
    w->mutable_host_word()->set_offset(40);
    w->set_value(0x8000002Bu);
    // And a ready word of the same file, which the client's stream has written: every
    // stream of the batch waits for it before its first item.
    const uint32_t ready_value = 77;
    std::memcpy(file.base() + 44, &ready_value, 4);
    v1::FenceWord* ready = flagged.mutable_wait_for()->mutable_word();
    ready->mutable_host_word()->set_name(file.name());
    ready->mutable_host_word()->set_offset(44);
    ready->set_value(ready_value);
    const int value_waits = fake.totals().value_waits;
    ASSERT_TRUE(client.ConvertBatch(flagged, o).ok());
    d.runtime().Sync();
    EXPECT_EQ(file.Word(40), 0x8000002Bu);
    EXPECT_GT(fake.totals().value_waits, value_waits);
  }
  EXPECT_TRUE(WaitFor([&] {
    return Metric(d.metrics(), "wprep_kernel_duration_seconds_count", {{"device", "gpu0"}}) == kernels_first + 6;
  }));

  const double kernels_before = Metric(d.metrics(), "wprep_kernel_duration_seconds_count", {{"device", "gpu0"}});
  fake.HoldEventWaits(true);
  const int converts_before = fake.totals().converts;
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(r, o);
  ASSERT_TRUE(resp.ok()) << resp.status() << " (the daemon waited for the held work?)";
  ASSERT_TRUE(fake.WaitEventWaiters(1));
  d.runtime().Sync();
  ASSERT_EQ(resp->items_size(), 3);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(MatchesGolden(*cases[i], std::string(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes)))
        << cases[i]->name;
    EXPECT_EQ(resp->items(static_cast<int>(i)).kernel_seconds(), 0);
    EXPECT_EQ(resp->items(static_cast<int>(i)).outputs(0).bytes(), cases[i]->output_bytes);
  }
  EXPECT_EQ(fake.totals().ipc_event_records, records_before + 3);
  EXPECT_EQ(fake.counts(0).converts_at_ipc_event_record, converts_before + 3);
  EXPECT_EQ(Metric(d.metrics(), "wprep_kernel_duration_seconds_count", {{"device", "gpu0"}}), kernels_before)
      << "kernel times recorded before the work was done";
  EXPECT_EQ(Metric(d.metrics(), "wprep_requests_total", {{"method", "ConvertBatch"}, {"code", "OK"}}), 3);

  d.RequestStop();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(d.drained()) << "the drain did not wait for the work answered early";
  fake.HoldEventWaits(false);
  EXPECT_TRUE(WaitFor([&] { return d.drained(); }));
  EXPECT_EQ(fake.totals().ipc_events_alive, 0) << "a client's event was left open";
}

}  // namespace
}  // namespace wprep::testing
