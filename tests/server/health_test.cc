// grpc.health.v1 of a real wprepd process (CPU engine) over real sockets, as load
// balancers use it: many open Watch calls told of warm-up and of a drain, the bound on
// open Watches, and malformed requests.
//
// WPREP_HEALTH_WATCHES=N runs the many-Watch tests with N Watches instead of 1,000 and
// prints how long they took and the daemon's memory (docs/RELIABILITY.md, "Health").
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "golden_rpc.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr int kServing = HealthCheckResponse::SERVING;
constexpr int kNotServing = HealthCheckResponse::NOT_SERVING;
// Bound on every wait, so a daemon that never answers fails the test instead of hanging
// it; the figures come from the clock, the assertions never do.
constexpr absl::Duration kBound = absl::Seconds(120);

int WatchCount() {
  int n = 1000;
  if (const char* env = std::getenv("WPREP_HEALTH_WATCHES"); env != nullptr) {
    EXPECT_TRUE(absl::SimpleAtoi(env, &n) && n > 0) << "WPREP_HEALTH_WATCHES=" << env;
  }
  return n;
}

// A channel with its own connection: gRPC shares one connection among channels to the
// same target unless each has its own subchannel pool.
std::shared_ptr<grpc::Channel> OwnConnection(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// Open Watch calls and what each has been told. A watch is "served" once it has
// received SERVING, "drained" once it has received NOT_SERVING after that.
class Watches {
 public:
  ~Watches() {
    for (auto& w : watches_) w->ctx.TryCancel();
    absl::MutexLock lock(&mu_);
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ == opened_; };
    mu_.Await(absl::Condition(&all_done));
  }

  // Opens `count` Watches of `service` on `stub`.
  void Open(Health::Stub* stub, int count, const std::string& service = "") {
    for (int i = 0; i < count; ++i) {
      {
        absl::MutexLock lock(&mu_);
        ++opened_;
      }
      watches_.push_back(std::make_unique<Watcher>(this, stub, service));
    }
  }

  // Waits until `n` watches are served (drained), or kBound passes; returns how many are.
  int WaitServed(int n) { return WaitFor(&served_, n); }
  int WaitDrained(int n) { return WaitFor(&drained_, n); }
  // Waits until `n` watches have ended; returns how many have.
  int WaitDone(int n) { return WaitFor(&done_, n); }
  // Waits until `n` watches have received a status or ended; returns how many have.
  int WaitAnswered(int n) { return WaitFor(&answered_, n); }

  // The statuses watch `i` received, in order, and how it ended.
  std::vector<int> Seen(size_t i) {
    absl::MutexLock lock(&mu_);
    return watches_[i]->seen;
  }
  grpc::Status End(size_t i) {
    absl::MutexLock lock(&mu_);
    return watches_[i]->end;
  }
  void Cancel(size_t i) { watches_[i]->ctx.TryCancel(); }
  // How many have ended, now.
  int done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  size_t size() const { return watches_.size(); }

 private:
  class Watcher final : public grpc::ClientReadReactor<HealthCheckResponse> {
   public:
    Watcher(Watches* set, Health::Stub* stub, const std::string& service) : set_(set) {
      req_.set_service(service);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
      stub->async()->Watch(&ctx, &req_, this);
      StartRead(&resp_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;  // the call ends: OnDone follows
      set_->Record(this, resp_.status());
      StartRead(&resp_);
    }
    void OnDone(const grpc::Status& s) override { set_->Finished(this, s); }

    grpc::ClientContext ctx;
    std::vector<int> seen;  // guarded by the set's mu_
    grpc::Status end;       // guarded by the set's mu_
    bool ended = false;     // guarded by the set's mu_

   private:
    Watches* const set_;
    HealthCheckRequest req_;
    HealthCheckResponse resp_;
  };

  void Record(Watcher* w, int status) {
    absl::MutexLock lock(&mu_);
    const bool was_served = std::find(w->seen.begin(), w->seen.end(), kServing) != w->seen.end();
    const bool was_drained = was_served && w->seen.back() == kNotServing;
    if (w->seen.empty() && !w->ended) ++answered_;
    w->seen.push_back(status);
    if (!was_served && status == kServing) ++served_;
    if (was_served && !was_drained && status == kNotServing) ++drained_;
  }
  void Finished(Watcher* w, const grpc::Status& s) {
    absl::MutexLock lock(&mu_);
    if (w->seen.empty()) ++answered_;
    w->end = s;
    w->ended = true;
    ++done_;
  }
  int WaitFor(const int* counter, int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *counter >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&reached), kBound);
    return *counter;
  }

  absl::Mutex mu_;
  int opened_ ABSL_GUARDED_BY(mu_) = 0;
  int served_ ABSL_GUARDED_BY(mu_) = 0;
  int drained_ ABSL_GUARDED_BY(mu_) = 0;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  int answered_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Watcher>> watches_;  // appended before any callback of it
};

std::unique_ptr<Daemon> StartDaemon(std::vector<std::string> extra) {
  extra.push_back("--devices=cpu");
  extra.push_back("--cpu-threads=1");
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(extra, &error);
  EXPECT_NE(d, nullptr) << error;
  return d;
}

// Watches open while the daemon warms up hear NOT_SERVING, then SERVING when it is warm,
// then NOT_SERVING again the moment it starts to drain (SIGTERM): a load balancer that
// watches stops sending before the daemon stops. They cost the daemon no thread each.
// On the API listener each connection carries at most --max-concurrent-streams (64)
// calls, so the Watches are spread over connections of 50.
TEST(HealthWatch, EveryWatchHearsWarmupAndDrain) {
  const int n = WatchCount();
  char tmpl[] = "/tmp/wprepd-gate-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string gate = std::string(tmpl) + "/open";
  std::unique_ptr<Daemon> d = StartDaemon({"--testing-warmup-gate=" + gate});
  ASSERT_NE(d, nullptr);
  const size_t threads_before = ThreadsOf(d->pid()).size();
  const uint64_t rss_before = d->RssBytes();

  constexpr int kPerConnection = 50;
  std::vector<std::unique_ptr<Health::Stub>> stubs;
  Watches watches;
  const absl::Time start = absl::Now();
  for (int opened = 0; opened < n; opened += kPerConnection) {
    stubs.push_back(Health::NewStub(OwnConnection(d->unix_target())));
    watches.Open(stubs.back().get(), std::min(kPerConnection, n - opened));
  }
  // Not warm yet: every watch hears NOT_SERVING first, and nothing else.
  EXPECT_EQ(d->Health(), kNotServing);
  ASSERT_EQ(watches.WaitAnswered(n), n) << d->Log();
  const absl::Duration to_answered = absl::Now() - start;
  for (size_t i = 0; i < watches.size(); ++i) {
    ASSERT_EQ(watches.Seen(i), std::vector<int>{kNotServing}) << "watch " << i;
  }

  const absl::Time opened = absl::Now();
  { std::ofstream(gate) << "go"; }
  ASSERT_EQ(watches.WaitServed(n), n) << d->Log();
  const absl::Duration to_serving = absl::Now() - opened;
  const size_t threads_open = ThreadsOf(d->pid()).size();
  const uint64_t rss = d->RssBytes();
  // A Watch holding a thread would add n threads; gRPC's own pollers may add a few.
  EXPECT_LT(threads_open, threads_before + 32) << "threads before " << threads_before;

  const absl::Time term = absl::Now();
  d->Signal(SIGTERM);
  ASSERT_EQ(watches.WaitDrained(n), n) << d->Log();
  const absl::Duration to_drained = absl::Now() - term;
  // Then the daemon stops, ending every watch.
  ASSERT_EQ(watches.WaitDone(n), n);
  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
  for (size_t i = 0; i < watches.size(); ++i) {
    ASSERT_EQ(watches.Seen(i), (std::vector<int>{kNotServing, kServing, kNotServing})) << "watch " << i;
  }
  std::printf("[ figures  ] %d Watches on %zu connections: all answered (NOT_SERVING) %.3f s after "
              "opening, all SERVING %.3f s after warm-up, all NOT_SERVING %.3f s after SIGTERM; "
              "daemon RSS %.1f -> %.1f MiB, threads %zu -> %zu\n",
              n, stubs.size(), absl::ToDoubleSeconds(to_answered), absl::ToDoubleSeconds(to_serving),
              absl::ToDoubleSeconds(to_drained),
              static_cast<double>(rss_before) / (1 << 20), static_cast<double>(rss) / (1 << 20), threads_before,
              threads_open);
  std::remove(gate.c_str());
  rmdir(tmpl);
}

// The drain's NOT_SERVING reaches every Watch while work is still in flight, not when the
// daemon stops: a stream held open keeps the drain going (--drain-timeout 120 s), and the
// Watches must hear NOT_SERVING and still be open.
TEST(HealthWatch, DrainIsToldWhileWorkIsInFlight) {
  std::unique_ptr<Daemon> d = StartDaemon({"--drain-timeout=120s", "--health-listen=127.0.0.1:0"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  auto api = Health::NewStub(OwnConnection(d->unix_target()));
  auto probe = Health::NewStub(OwnConnection(d->health_address()));
  Watches watches;
  watches.Open(api.get(), 50);
  watches.Open(probe.get(), 50);
  ASSERT_EQ(watches.WaitServed(100), 100) << d->Log();

  // A ConvertStream the daemon has admitted (it answered the header), left unfinished.
  wprep::client::Client client(wprep::client::MakeChannel(d->unix_target()));
  grpc::ClientContext stream_ctx;
  stream_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto stream = client.stub().ConvertStream(&stream_ctx);
  wprep::v1::ConvertStreamRequest msg;
  *msg.mutable_header() = StreamHeaderFor(HopperSpec(Direction::kSwizzle, -2, 3), {256, 128});
  ASSERT_TRUE(stream->Write(msg));
  wprep::v1::ConvertStreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp)) << d->Log();
  ASSERT_TRUE(resp.has_header());

  d->Signal(SIGTERM);
  ASSERT_EQ(watches.WaitDrained(100), 100) << d->Log();
  // Still draining: the stream holds it, so no Watch has ended yet.
  EXPECT_EQ(watches.done(), 0);
  EXPECT_EQ(d->Health(), kNotServing);

  // The stream goes; the drain ends, and with it every Watch and the daemon.
  stream_ctx.TryCancel();
  stream->Finish().IgnoreError();
  ASSERT_EQ(watches.WaitDone(100), 100);
  for (size_t i = 0; i < watches.size(); ++i) {
    EXPECT_EQ(watches.Seen(i), (std::vector<int>{kServing, kNotServing})) << "watch " << i;
    EXPECT_EQ(watches.End(i).error_code(), grpc::StatusCode::UNAVAILABLE) << watches.End(i).error_message();
  }
  const int status = d->WaitExit();
  ASSERT_TRUE(WIFEXITED(status)) << d->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// --health-listen serves only health, so one prober's connection may hold every Watch
// the daemon allows (--max-watch-streams), not just --max-concurrent-streams of them.
TEST(HealthWatch, OneProbeConnectionCarriesEveryWatch) {
  const int n = WatchCount();
  std::unique_ptr<Daemon> d = StartDaemon({"--health-listen=127.0.0.1:0"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  ASSERT_FALSE(d->health_address().empty());
  auto stub = Health::NewStub(OwnConnection(d->health_address()));
  Watches watches;
  const absl::Time start = absl::Now();
  watches.Open(stub.get(), n);
  ASSERT_EQ(watches.WaitServed(n), n) << d->Log();
  const absl::Duration to_serving = absl::Now() - start;
  const uint64_t rss = d->RssBytes();
  const absl::Time term = absl::Now();
  d->Signal(SIGTERM);
  ASSERT_EQ(watches.WaitDrained(n), n) << d->Log();
  const absl::Duration to_drained = absl::Now() - term;
  ASSERT_EQ(watches.WaitDone(n), n);
  EXPECT_NE(d->WaitExit(), -1);
  std::printf("[ figures  ] %d Watches on 1 --health-listen connection: all SERVING %.3f s after "
              "opening, all NOT_SERVING %.3f s after SIGTERM; daemon RSS %.1f MiB\n",
              n, absl::ToDoubleSeconds(to_serving), absl::ToDoubleSeconds(to_drained),
              static_cast<double>(rss) / (1 << 20));
}

// Open Watches are bounded, all listeners together, so a flood of them cannot take the
// daemon's memory; one more is refused at once, and a slot freed is taken again.
TEST(HealthWatch, WatchesBeyondTheBoundAreRefused) {
  std::unique_ptr<Daemon> d = StartDaemon({"--health-listen=127.0.0.1:0", "--max-watch-streams=8"});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  auto api = Health::NewStub(OwnConnection(d->unix_target()));
  auto probe = Health::NewStub(OwnConnection(d->health_address()));
  Watches held;
  held.Open(api.get(), 4);
  held.Open(probe.get(), 4);
  ASSERT_EQ(held.WaitServed(8), 8);
  for (Health::Stub* stub : {api.get(), probe.get()}) {
    Watches more;
    more.Open(stub, 1);
    ASSERT_EQ(more.WaitDone(1), 1);
    EXPECT_EQ(more.Seen(0), std::vector<int>{});
    EXPECT_EQ(more.End(0).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(more.End(0).error_message().find("--max-watch-streams"), std::string::npos)
        << more.End(0).error_message();
  }
  // Check still answers while every Watch slot is taken.
  EXPECT_EQ(d->Health(), kServing);

  // One watcher leaves; its slot is free once the daemon has seen it go, which the client
  // cannot observe, so a new Watch is tried until one is admitted (each refusal is quick).
  held.Cancel(0);
  ASSERT_EQ(held.WaitDone(1), 1);
  bool admitted = false;
  for (int attempt = 0; attempt < 1000 && !admitted; ++attempt) {
    Watches again;
    again.Open(api.get(), 1);
    ASSERT_EQ(again.WaitAnswered(1), 1);
    if (again.Seen(0) == std::vector<int>{kServing}) {
      admitted = true;
    } else {
      ASSERT_EQ(again.WaitDone(1), 1);
      ASSERT_EQ(again.End(0).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
  }
  EXPECT_TRUE(admitted) << "a freed Watch slot was never given again";
}

// --max-watch-streams must allow at least one Watch; the daemon refuses to start
// otherwise and names the flag.
TEST(HealthWatch, ZeroWatchStreamsIsRefusedAtStart) {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--max-watch-streams=0"}, &error);
  EXPECT_EQ(d, nullptr);
  EXPECT_NE(error.find("max-watch-streams"), std::string::npos) << error;
}

// gRPC 1.51's typed callback handler answers UNIMPLEMENTED to a body that does not parse;
// the convention (and a load balancer's logic) wants INVALID_ARGUMENT or INTERNAL, and the
// daemon serves on.
TEST(HealthCheck, MalformedBodyIsInvalidArgument) {
  std::unique_ptr<Daemon> d = StartDaemon({});
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  auto channel = OwnConnection(d->unix_target());
  grpc::GenericStub generic(channel);
  // Field 15, wire type 7: no such wire type, so no message parses from it.
  const char junk[] = {'\x7f', '\xff', '\xff'};
  grpc::Slice slice(junk, sizeof(junk));

  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("HealthCheckRequest"), std::string::npos) << s.error_message();
  }

  // The same body on Watch (server streaming), through a bidi call: one write, then
  // read to the end.
  class RawWatch final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    RawWatch(grpc::GenericStub* stub, const grpc::ByteBuffer& request) : request_(request) {
      ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      stub->PrepareBidiStreamingCall(&ctx_, "/grpc.health.v1.Health/Watch", grpc::StubOptions(), this);
      StartWriteLast(&request_, grpc::WriteOptions());
      StartRead(&response_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        ++messages;
        StartRead(&response_);
      }
    }
    void OnDone(const grpc::Status& s) override { done.set_value(s); }
    int messages = 0;  // read only after done
    std::promise<grpc::Status> done;

   private:
    grpc::ClientContext ctx_;
    grpc::ByteBuffer request_, response_;
  };
  RawWatch watch(&generic, grpc::ByteBuffer(&slice, 1));
  const grpc::Status s = watch.done.get_future().get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(watch.messages, 0);

  // An empty body is a valid request (service ""), and the daemon still serves.
  EXPECT_EQ(d->Health(), kServing);
}

}  // namespace
}  // namespace wprep::testing
