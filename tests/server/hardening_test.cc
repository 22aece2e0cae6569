// The attacks that once crashed wprepd, grew it without bound or left it deaf, each
// against a real daemon process: every one must get a clear status, bounded memory, and a
// daemon that goes on serving.
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "golden_rpc.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

// The daemon under test is built like this test (make test-sanitize builds both).
#if defined(WPREP_ASAN)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif

std::unique_ptr<Daemon> StartCpuDaemon(std::vector<std::string> extra = {}, const Daemon::StartOptions& o = {}) {
  extra.push_back("--devices=cpu");
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start(extra, &error, absl::Seconds(60), o);
  EXPECT_NE(d, nullptr) << error;
  if (d != nullptr) {
    EXPECT_TRUE(d->WaitServing()) << d->Log();
  }
  return d;
}

ConversionSpec BlackwellSwizzle(int64_t block_k, int64_t block_n) {
  ConversionSpec s;
  s.layout = Layout::kBlackwellShuffledValue;
  s.direction = Direction::kSwizzle;
  s.blackwell.block_k = block_k;
  s.blackwell.block_n = block_n;
  return s;
}

ConversionSpec HopperSwizzle(int mx_axis) { return HopperSpec(Direction::kSwizzle, mx_axis, 3); }

// A small request the daemon must still answer correctly.
void ExpectServes(const Daemon& d, const std::string& why) {
  Client c(MakeChannel(d.unix_target()));
  const std::vector<uint8_t> in = RandomBytes(256 * 64, 11);
  wprep::client::CallOptions o;
  o.timeout = std::chrono::seconds(20);
  absl::StatusOr<v1::ConvertResponse> r = c.Convert(ConvertRequestFor(HopperSwizzle(-1), {256, 128}, in), o);
  ASSERT_TRUE(r.ok()) << why << ": " << r.status() << "\n" << d.Log();
  EXPECT_EQ(r->output_bytes_inline(), CpuReference(HopperSwizzle(-1), {256, 128}, in)) << why;
}

// Sends one header and `input` (in 1 MiB chunks, as far as the daemon takes them) and
// half-closes; the final status.
absl::Status StreamHeaderOnly(Client& c, const v1::StreamRequestHeader& h, uint64_t input = 0) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = c.stub().ConvertStream(&ctx);
  v1::ConvertStreamRequest m;
  *m.mutable_header() = h;
  bool ok = stream->Write(m);
  for (uint64_t off = 0; ok && off < input; off += 1 << 20) {
    v1::ConvertStreamRequest chunk;
    chunk.mutable_chunk()->set_offset(off);
    chunk.mutable_chunk()->set_data(std::string(std::min<uint64_t>(1 << 20, input - off), '\x5a'));
    ok = stream->Write(chunk);
  }
  stream->WritesDone();
  v1::ConvertStreamResponse resp;
  while (stream->Read(&resp)) {
  }
  return wprep::client::FromGrpcStatus(stream->Finish());
}

// Finding: one small ConvertStream request (a tiny tensor with huge tiles, terabytes of
// padded output) aborted the daemon with std::bad_alloc.
TEST(Hardening, TinyStreamWithTerabytesOfPaddedOutputIsRefused) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  Client c(MakeChannel(d->unix_target()));
  // 2x2 values per matrix, each padded to a 2048 x 4096-byte tile: 8 MiB out of 2 bytes in,
  // a million times.
  const absl::Status s =
      StreamHeaderOnly(c, StreamHeaderFor(BlackwellSwizzle(4096, 4096), {1 << 20, 2, 2}), 2ull << 20);
  EXPECT_TRUE(s.code() == absl::StatusCode::kResourceExhausted || s.code() == absl::StatusCode::kInvalidArgument) << s;
  ExpectServes(*d, "after the terabyte stream");
}

// Finding: a 32 GiB single-matrix stream header ended as UNKNOWN.
TEST(Hardening, StreamOfOneHugeMatrixIsResourceExhaustedNotUnknown) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  Client c(MakeChannel(d->unix_target()));
  const absl::Status s = StreamHeaderOnly(c, StreamHeaderFor(HopperSwizzle(-1), {1, 262144, 262144}));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("IPC"), std::string::npos) << s;
  ExpectServes(*d, "after the 32 GiB header");
}

// Finding: many tiny unary requests with large padded outputs whose answers the client
// never reads pinned 2 GiB and more. The client here is gRPC's core API with no receive
// operation at all, and a 64 KiB stream window.
TEST(Hardening, UnreadAnswersStayWithinTheBufferBudget) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();  // --max-buffered-bytes: 1 GiB by default
  ASSERT_NE(d, nullptr);
  ExpectServes(*d, "warm");
  const uint64_t rss_before = d->RssBytes();
  // 8 bytes in, 32 MiB out (4 matrices of one 8 MiB tile).
  v1::ConvertRequest req = ConvertRequestFor(BlackwellSwizzle(4096, 4096), {4, 2, 2}, RandomBytes(8, 3));
  const std::string wire = req.SerializeAsString();
  constexpr int kCalls = 128;  // 4 GiB of answers if each were held
  grpc_init();
  grpc_arg args[] = {
      {GRPC_ARG_INTEGER, const_cast<char*>(GRPC_ARG_HTTP2_BDP_PROBE), {.integer = 0}},
      {GRPC_ARG_INTEGER, const_cast<char*>(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES), {.integer = 65536}},
      {GRPC_ARG_INTEGER, const_cast<char*>(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), {.integer = -1}},
  };
  grpc_channel_args channel_args{3, args};
  grpc_channel_credentials* creds = grpc_insecure_credentials_create();
  grpc_channel* channel = grpc_channel_create(d->unix_target().c_str(), creds, &channel_args);
  grpc_completion_queue* cq = grpc_completion_queue_create_for_next(nullptr);
  std::vector<grpc_call*> calls;
  grpc_slice method = grpc_slice_from_static_string("/wprep.v1.WeightPrep/Convert");
  for (int i = 0; i < kCalls; ++i) {
    grpc_call* call = grpc_channel_create_call(channel, nullptr, GRPC_PROPAGATE_DEFAULTS, cq, method, nullptr,
                                               gpr_inf_future(GPR_CLOCK_REALTIME), nullptr);
    grpc_slice payload = grpc_slice_from_copied_buffer(wire.data(), wire.size());
    grpc_byte_buffer* bb = grpc_raw_byte_buffer_create(&payload, 1);
    grpc_slice_unref(payload);
    grpc_op ops[3] = {};
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ASSERT_EQ(grpc_call_start_batch(call, ops, 3, reinterpret_cast<void*>(static_cast<intptr_t>(i + 1)), nullptr),
              GRPC_CALL_OK);
    grpc_byte_buffer_destroy(bb);
    calls.push_back(call);
  }
  // Let the daemon convert what it admits; the answers stay unread.
  absl::SleepFor(absl::Seconds(8));
  const uint64_t rss_during = d->RssBytes();
  std::printf("unread answers: RSS %llu MiB before, %llu MiB with %d unread 32 MiB answers\n",
              static_cast<unsigned long long>(rss_before >> 20), static_cast<unsigned long long>(rss_during >> 20),
              kCalls);
  ExpectServes(*d, "while answers stay unread");
  EXPECT_LT(rss_during, rss_before + (1280ull << 20))
      << "RSS " << (rss_before >> 20) << " MiB -> " << (rss_during >> 20) << " MiB with " << kCalls
      << " unread 32 MiB answers";
  for (grpc_call* call : calls) {
    grpc_call_cancel(call, nullptr);
    grpc_call_unref(call);
  }
  grpc_channel_destroy(channel);
  grpc_channel_credentials_release(creds);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), nullptr).type != GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  grpc_shutdown();
  // Once the connection is gone, the memory goes back (the idle trim runs after 2 s).
  // Under AddressSanitizer freed memory waits in its quarantine first (256 MiB).
  const uint64_t slack = (kAddressSanitizer ? 320ull : 64ull) << 20;
  // The daemon learns of each cancellation on its own time (slowly under the sanitizers),
  // so both the RSS and the buffer gauge get until the same deadline to come down.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  uint64_t rss_after = d->RssBytes();
  std::string metrics = HttpGet(d->metrics_address(), "/metrics");
  while ((rss_after > rss_before + slack || MetricValue(metrics, "wprep_host_buffered_bytes") != 0.0) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(250));
    rss_after = d->RssBytes();
    metrics = HttpGet(d->metrics_address(), "/metrics");
  }
  EXPECT_LT(rss_after, rss_before + slack) << "RSS stayed at " << (rss_after >> 20) << " MiB";
  EXPECT_EQ(MetricValue(metrics, "wprep_host_buffered_bytes"), 0.0) << metrics;
}

// Finding: a failed std::thread in the CPU engine (a process limit) terminated the
// daemon. The daemon runs as an unprivileged user whose thread limit is then lowered
// to a few threads above what it runs.
TEST(Hardening, ThreadLimitInTheCpuEngineStillConverts) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the daemon as another user";
  // How many threads a serving daemon runs depends on the machine (gRPC sizes its pools by
  // cores): count them on one, then give a second four to spare, far fewer than the 64
  // the engine asks for.
  Daemon::StartOptions o;
  o.uid = 65534;
  int threads = 0;
  {
    std::unique_ptr<Daemon> probe = StartCpuDaemon({"--cpu-threads=64"}, o);
    ASSERT_NE(probe, nullptr);
    ExpectServes(*probe, "probe");
    for ([[maybe_unused]] const auto& e :
         std::filesystem::directory_iterator("/proc/" + std::to_string(probe->pid()) + "/task")) {
      ++threads;
    }
  }
  o.nproc_limit = threads + 4;
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--cpu-threads=64"}, o);
  ASSERT_NE(d, nullptr);
  ExpectServes(*d, "warm");
  // 2 MiB of output: above the engine's 1 MiB threshold, so it starts its threads.
  const std::vector<uint8_t> in = RandomBytes(2048 * 1024, 5);
  Client c(MakeChannel(d->unix_target()));
  absl::StatusOr<v1::ConvertResponse> r = c.Convert(ConvertRequestFor(HopperSwizzle(-2), {2048, 2048}, in));
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << d->Log();
  EXPECT_EQ(r->output_bytes_inline(), CpuReference(HopperSwizzle(-2), {2048, 2048}, in));
  EXPECT_EQ(d->Log().find("terminate"), std::string::npos) << d->Log();
  ExpectServes(*d, "after the thread limit");
}

int ConnectUnix(const std::string& target) {
  const std::string path = target.substr(7);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), std::min(path.size(), sizeof(sa.sun_path) - 1));
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Finding: once file descriptors ran out, the listeners accepted nothing again, even
// after the connections closed.
TEST(Hardening, ListenersRecoverAfterDescriptorExhaustion) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  ExpectServes(*d, "warm");
  DescriptorLimit limit(d->pid(), 8);
  ASSERT_TRUE(limit.ok());
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectUnix(d->unix_target());
    if (fd >= 0) idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(500));  // the daemon runs out of descriptors
  for (int fd : idle) close(fd);
  ASSERT_TRUE(limit.Restore());
  absl::SleepFor(absl::Milliseconds(500));
  ExpectServes(*d, "after descriptor exhaustion");
  EXPECT_EQ(d->Health(), 1);
}

// Finding: two idle connections to the metrics endpoint blocked every scrape.
TEST(Hardening, IdleMetricsConnectionsDoNotBlockScrapes) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  const std::string& addr = d->metrics_address();
  const int port = std::stoi(addr.substr(addr.rfind(':') + 1));
  std::vector<int> idle;
  for (int i = 0; i < 32; ++i) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    if (i % 2 == 1) (void)!write(fd, "GET /metr", 9);  // and some send half a request
    idle.push_back(fd);
  }
  const absl::Time t0 = absl::Now();
  const std::string body = HttpGet(addr, "/metrics", absl::Seconds(3));
  EXPECT_NE(body.find("wprep_build_info"), std::string::npos) << "scrape failed after "
                                                             << absl::FormatDuration(absl::Now() - t0);
  for (int fd : idle) close(fd);
}

// Finding: a second wprepd on the same TCP port started and took half the connections,
// and one on the same Unix socket path replaced the first's socket.
TEST(Hardening, ASecondDaemonOnTheSameAddressRefusesToStart) {
  std::unique_ptr<Daemon> a = StartCpuDaemon();
  ASSERT_NE(a, nullptr);
  for (const std::string& addr : {a->unix_target(), a->tcp_target()}) {
    std::string error;
    std::unique_ptr<Daemon> b = Daemon::Start({"--devices=cpu", "--listen=" + addr}, &error, absl::Seconds(30));
    if (b != nullptr) {
      const int status = b->WaitExit(absl::Seconds(30));
      ASSERT_NE(status, -1) << "a second daemon on " << addr << " kept running:\n" << b->Log();
      EXPECT_NE(WEXITSTATUS(status), 0);
      error = b->Log();
    }
    EXPECT_NE(error.find(addr.substr(addr.find_last_of("/:") + 1)), std::string::npos) << error;
    EXPECT_TRUE(error.find("another") != std::string::npos || error.find("in use") != std::string::npos) << error;
  }
  ExpectServes(*a, "after two refused rivals");
  Client tcp(MakeChannel(a->tcp_target()));
  EXPECT_TRUE(tcp.ListDevices().ok());
}

// Finding: one malformed 3 MB request wrote 9 MB of log; and (finding) an error that
// echoed a 1,000-dim shape overflowed gRPC's trailer limit, so the client saw
// RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT.
TEST(Hardening, HugeBadRequestsGetBoundedErrorsAndLogLines) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  Client c(MakeChannel(d->unix_target(), 64 << 20));
  for (int dims : {1000, 375000}) {
    v1::PlanRequest p;
    *p.mutable_spec() = wprep::SpecToProto(HopperSwizzle(-1));
    for (int i = 0; i < dims; ++i) p.add_logical_shape(1000000007);
    const size_t log_before = d->Log().size();
    absl::StatusOr<v1::PlanResponse> r = c.Plan(p);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << dims << " dims: " << r.status();
    EXPECT_LE(r.status().message().size(), 1024u);
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_LT(d->Log().size() - log_before, 4096u) << dims << " dims";
  }
  ExpectServes(*d, "after huge bad requests");
}

// Finding: a health Watch of an unknown service said SERVICE_UNKNOWN, then SERVING once
// the daemon was, and Check agreed.
TEST(Hardening, AnUnknownHealthServiceStaysUnknown) {
  char gate_dir[] = "/tmp/wprep-gate-XXXXXX";
  ASSERT_NE(mkdtemp(gate_dir), nullptr);
  const std::string gate = std::string(gate_dir) + "/open";
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--testing-warmup-gate=" + gate}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitHealth(2));  // NOT_SERVING: held at the gate
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(d->unix_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("no.such.Service");
  auto watch = stub->Watch(&ctx, req);
  std::vector<int> seen;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(watch->Read(&resp));
  seen.push_back(resp.status());
  std::ofstream(gate) << "open";  // the daemon warms up and goes SERVING
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  std::thread cancel([&] {
    absl::SleepFor(absl::Seconds(2));
    ctx.TryCancel();
  });
  while (watch->Read(&resp)) seen.push_back(resp.status());
  cancel.join();
  (void)watch->Finish();
  EXPECT_EQ(seen, std::vector<int>{grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN});
  EXPECT_EQ(d->Health("no.such.Service"), -1) << "Check must answer NOT_FOUND";
  EXPECT_EQ(d->Health("wprep.v1.WeightPrep"), 1);
  std::filesystem::remove_all(gate_dir);
}

// Finding: gRPC inflated a gzip body before checking the size limit (a 1 MiB body cost
// a GiB). Compressed requests are refused before any byte is inflated.
TEST(Hardening, CompressedRequestsAreRefusedWithoutInflating) {
  std::unique_ptr<Daemon> d = StartCpuDaemon();
  ASSERT_NE(d, nullptr);
  ExpectServes(*d, "warm");
  const uint64_t rss_before = d->RssBytes();
  v1::ConvertRequest req = ConvertRequestFor(HopperSwizzle(-1), {256, 128}, {});
  req.set_source_bytes(std::string(256 << 20, '\0'));  // compresses to about 256 KiB
  std::vector<std::thread> senders;
  std::vector<absl::Status> results(4);
  for (int i = 0; i < 4; ++i) {
    senders.emplace_back([&, i] {
      Client c(MakeChannel(d->unix_target(), 512 << 20, i));
      grpc::ClientContext ctx;
      ctx.set_compression_algorithm(GRPC_COMPRESS_GZIP);
      v1::ConvertResponse resp;
      results[i] = wprep::client::FromGrpcStatus(c.stub().Convert(&ctx, req, &resp));
    });
  }
  for (auto& t : senders) t.join();
  for (const absl::Status& s : results) EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_LT(d->RssBytes(), rss_before + (128ull << 20))
      << "RSS " << (rss_before >> 20) << " -> " << (d->RssBytes() >> 20) << " MiB";
  ExpectServes(*d, "after gzip bombs");
}

// Finding: any local user reached the conversion API over the default loopback TCP
// listener. The default is the Unix socket alone, and a TCP listener beyond loopback
// without TLS is refused at start.
TEST(Hardening, TheDefaultListensOnTheUnixSocketOnlyAndOpenTcpNeedsTls) {
  std::string error;
  std::unique_ptr<Daemon> d = Daemon::Start({"--devices=cpu", "--listen=0.0.0.0:0"}, &error, absl::Seconds(30));
  if (d != nullptr) {
    const int status = d->WaitExit(absl::Seconds(30));
    ASSERT_NE(status, -1) << "started on 0.0.0.0 without TLS";
    EXPECT_EQ(WEXITSTATUS(status), 2);
    error = d->Log();
  }
  EXPECT_NE(error.find("--tls-cert"), std::string::npos) << error;
}

// A user outside the socket's group cannot connect.
TEST(Hardening, OtherUsersCannotConnectToTheUnixSocket) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  std::unique_ptr<Daemon> d = StartCpuDaemon({}, Daemon::StartOptions{-1, true});
  ASSERT_NE(d, nullptr);
  chmod(d->dir().c_str(), 0755);  // the folder is open; the socket's mode must do the work
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    const int fd = ConnectUnix(d->unix_target());
    _exit(fd < 0 && errno == EACCES ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "another user connected (status " << status << ")";
}

}  // namespace
}  // namespace wprep::testing

namespace wprep::testing {
namespace {

// --health-listen serves grpc.health.v1 and nothing else: a probe on the pod IP cannot
// reach the conversion API.
TEST(Hardening, TheHealthListenerServesHealthAndNothingElse) {
  std::unique_ptr<Daemon> d = StartCpuDaemon({"--health-listen=127.0.0.1:0"});
  ASSERT_NE(d, nullptr);
  ASSERT_FALSE(d->health_address().empty()) << "no health line in the port file";
  auto channel = grpc::CreateChannel(d->health_address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "wprep.v1.WeightPrep"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok()) << service;
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  auto api = v1::WeightPrep::NewStub(channel);
  grpc::ClientContext ctx;
  v1::ListDevicesResponse resp;
  EXPECT_EQ(api->ListDevices(&ctx, v1::ListDevicesRequest(), &resp).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // Draining: the probe sees NOT_SERVING, or the listener is already gone.
  d->Signal(SIGTERM);
  ASSERT_NE(d->WaitExit(absl::Seconds(30)), -1);
}

}  // namespace
}  // namespace wprep::testing
