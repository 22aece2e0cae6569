// CUDA virtual-memory buffers (vmm_import.h) without a GPU: the checks of a VMM buffer's
// fields, pidfd_getfd of a real child process's descriptor, and the daemon in this
// process on a fake GPU that maps files (fake_runtime.h), on a real Unix socket and a
// loopback TCP port, with real client processes (wprep_vmm_client) whose memfds stand in
// for a cuMem allocation's chunks.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "fake_runtime.h"
#include "golden.h"
#include "golden_rpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "net/peer_credentials.h"
#include "rpc/vmm_import.h"
#include "safetensors_files.h"
#include "wprep/client/weights.h"
#include "wprep/server/daemon.h"
#include "wprep/server/options.h"
#include "wprep/v1/wprep.grpc.pb.h"

extern char** environ;

namespace wprep::testing {
namespace {

namespace v1 = wprep::v1;
namespace server = wprep::server;

constexpr uint64_t kGranularity = 4096;

uint64_t RoundUp(uint64_t n) { return (n + kGranularity - 1) / kGranularity * kGranularity; }

// Polls `cond` until true or a minute passes (a bound against hangs, not a timing check).
bool WaitFor(const std::function<bool()>& cond) {
  for (const absl::Time end = absl::Now() + absl::Seconds(60); absl::Now() < end;) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return cond();
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& data) { std::ofstream(path, std::ios::binary) << data; }

// A buffer of one POSIX-fd chunk per (fd, size), granularity kGranularity.
v1::CudaIpcBuffer VmmBuffer(int pid, const std::vector<std::pair<int, uint64_t>>& chunks, uint64_t offset,
                            uint64_t size, const std::string& uuid) {
  v1::CudaIpcBuffer b;
  b.set_offset(offset);
  b.set_size(size);
  b.set_device_uuid(uuid);
  v1::CudaVmmBuffer* v = b.mutable_vmm();
  v->set_handle_type(v1::VMM_HANDLE_TYPE_POSIX_FD);
  v->set_pid(pid);
  v->set_granularity(kGranularity);
  for (auto [fd, bytes] : chunks) {
    v1::VmmChunk* c = v->add_chunks();
    c->set_fd(fd);
    c->set_size(bytes);
  }
  return b;
}

// ---------------------------------------------------------------------------------------
// The fields of a VMM buffer.

TEST(VmmValidate, RefusesMalformedBuffersWithTheirField) {
  const std::string uuid(16, '\1');
  const v1::CudaIpcBuffer good = VmmBuffer(1234, {{3, 8192}, {4, 4096}}, 100, 12000, uuid);
  EXPECT_TRUE(server::VmmImporter::Validate(good, "source_ipc").ok());
  struct Case {
    const char* what;
    std::function<void(v1::CudaIpcBuffer*)> edit;
    const char* message_part;
  };
  const std::vector<Case> cases = {
      {"zero chunks", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->clear_chunks(); }, "chunks is empty"},
      {"size not a multiple of the granularity",
       [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->mutable_chunks(1)->set_size(4000); }, "chunks[1].size"},
      {"zero-sized chunk", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->mutable_chunks(0)->set_size(0); },
       "chunks[0].size"},
      {"offset past the end", [](v1::CudaIpcBuffer* b) { b->set_offset(12289); b->set_size(0); },
       "reaches beyond the VMM allocation"},
      {"range past the end", [](v1::CudaIpcBuffer* b) { b->set_size(12189); }, "reaches beyond the VMM allocation"},
      {"granularity not a power of two", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->set_granularity(3000); },
       "granularity"},
      {"granularity zero", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->set_granularity(0); }, "granularity"},
      {"negative fd", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->mutable_chunks(0)->set_fd(-1); }, "chunks[0].fd"},
      {"no pid", [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->set_pid(0); }, "pid"},
      {"no handle type",
       [](v1::CudaIpcBuffer* b) { b->mutable_vmm()->set_handle_type(v1::VMM_HANDLE_TYPE_UNSPECIFIED); },
       "handle_type"},
      {"legacy handle too", [](v1::CudaIpcBuffer* b) { b->set_handle(std::string(64, 'x')); }, "not both"},
      {"fabric handle of the wrong length",
       [](v1::CudaIpcBuffer* b) {
         b->mutable_vmm()->set_handle_type(v1::VMM_HANDLE_TYPE_FABRIC);
         b->mutable_vmm()->mutable_chunks(0)->set_fabric_handle("short");
       },
       "fabric_handle"},
  };
  for (const Case& c : cases) {
    v1::CudaIpcBuffer b = good;
    c.edit(&b);
    absl::Status s = server::VmmImporter::Validate(b, "source_ipc");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "source_ipc")) << c.what << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.message_part)) << c.what << ": " << s;
  }
}

TEST(VmmValidate, VmmKeysAreUnguessableAndNeverLegacyHandles) {
  const std::string a = server::IpcCache::NewVmmKey(), b = server::IpcCache::NewVmmKey();
  ASSERT_EQ(a.size(), server::kIpcHandleBytes);
  EXPECT_NE(a, b);
  EXPECT_TRUE(server::IpcCache::IsVmmKey(a));
  EXPECT_FALSE(server::IpcCache::IsVmmKey(std::string(64, '\0')));
}

// ---------------------------------------------------------------------------------------
// Child processes.

// A wprep_vmm_client process with pipes on its stdin and stdout.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    // $WPREP_VMM_CLIENT_PATH overrides the built path (the GPU bundle moves binaries).
    const char* env = std::getenv("WPREP_VMM_CLIENT_PATH");
    std::vector<std::string> all = {env != nullptr && *env != '\0' ? env : WPREP_VMM_CLIENT_PATH};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    out_ = fdopen(out[0], "r");
  }
  ~Child() {
    CloseStdin();
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      Wait();
    }
    if (out_ != nullptr) fclose(out_);
  }
  pid_t pid() const { return pid_; }
  // The next line it printed, without the newline; "" at its end.
  std::string Line() {
    char buf[4096];
    if (out_ == nullptr || fgets(buf, sizeof(buf), out_) == nullptr) return "";
    std::string s = buf;
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  // Its descriptor of memfd k, from the "memfd K FD" lines (read in order).
  int MemfdLine() {
    std::vector<std::string> parts = absl::StrSplit(Line(), ' ');
    int fd = -1;
    if (parts.size() != 3 || parts[0] != "memfd" || !absl::SimpleAtoi(parts[2], &fd)) return -1;
    return fd;
  }
  void CloseStdin() {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
  }
  int Wait() {
    int status = -1;
    if (pid_ > 0) waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  FILE* out_ = nullptr;
};

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/wprep-vmm-XXXXXX";
    path_ = mkdtemp(tmpl) != nullptr ? tmpl : "/tmp";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(VmmFdPassing, TakesAChildProcessMemfdWithPidfdGetfd) {
  TempDir dir;
  const std::string content = absl::StrCat("wprep vmm probe ", getpid());
  WriteAll(dir.File("content"), content);
  Child child({"--memfd=4096:" + dir.File("content"), "--hold"});
  ASSERT_GT(child.pid(), 0);
  const int child_fd = child.MemfdLine();
  ASSERT_GE(child_fd, 0);
  ASSERT_EQ(child.Line(), "holding");
  absl::StatusOr<int> pidfd = server::OpenPidfd(child.pid());
  if (pidfd.status().code() == absl::StatusCode::kFailedPrecondition) GTEST_SKIP() << pidfd.status();
  ASSERT_TRUE(pidfd.ok()) << pidfd.status();
  absl::StatusOr<int> fd = server::TakeFd(*pidfd, child_fd);
  if (fd.status().code() == absl::StatusCode::kPermissionDenied ||
      fd.status().code() == absl::StatusCode::kFailedPrecondition) {
    close(*pidfd);
    GTEST_SKIP() << "pidfd_getfd is not allowed here (needs ptrace access): " << fd.status();
  }
  ASSERT_TRUE(fd.ok()) << fd.status();
  // The same file: its contents, and its inode as the child's /proc entry shows it.
  std::string got(content.size(), '\0');
  ASSERT_EQ(pread(*fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
  EXPECT_EQ(got, content);
  struct stat mine, theirs;
  ASSERT_EQ(fstat(*fd, &mine), 0);
  ASSERT_EQ(stat(absl::StrCat("/proc/", child.pid(), "/fd/", child_fd).c_str(), &theirs), 0);
  EXPECT_EQ(mine.st_ino, theirs.st_ino);
  EXPECT_EQ(mine.st_dev, theirs.st_dev);
  // A number that is not open there is refused as such.
  EXPECT_EQ(server::TakeFd(*pidfd, 987).status().code(), absl::StatusCode::kInvalidArgument);
  // And the exit of the process shows on its pidfd.
  EXPECT_FALSE(server::ProcessExited(*pidfd));
  child.CloseStdin();
  child.Wait();
  EXPECT_TRUE(server::ProcessExited(*pidfd));
  close(*fd);
  close(*pidfd);
}

TEST(VmmFdPassing, SameFileTellsDuplicatesFromOtherFiles) {
  const int a = memfd_create("a", MFD_CLOEXEC), b = memfd_create("b", MFD_CLOEXEC);
  const int a2 = dup(a);
  EXPECT_TRUE(server::SameFile(a, a2));
  EXPECT_FALSE(server::SameFile(a, b));
  close(a);
  close(a2);
  close(b);
}

// ---------------------------------------------------------------------------------------
// The daemon in this process on one fake GPU that maps files.

class FakeGpuDaemon {
 public:
  explicit FakeGpuDaemon(const std::vector<std::string>& extra_flags = {}) {
    target_ = "unix://" + dir_.File("wprepd.sock");
    std::vector<std::string> flags = {"--listen=" + target_, "--listen=127.0.0.1:0",
                                      "--metrics-address=127.0.0.1:0", "--port-file=" + dir_.File("ports"),
                                      "--cpu-threads=2", "--drain-timeout=10s"};
    flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
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
      if (absl::Status s = daemon_->WarmUp(); s.ok()) daemon_->Serve();
      daemon_->Drain("test over");
    });
    std::ifstream ports(dir_.File("ports"));
    for (std::string kind, addr; ports >> kind >> addr;) {
      if (kind == "grpc" && !absl::StartsWith(addr, "unix:")) tcp_target_ = addr;
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
      daemon_->RequestStop();
      thread_.join();
      // Kept, as wprepd keeps its own at exit (fault_test.cc says why).
      static auto* const stopped =
          new std::vector<std::pair<std::unique_ptr<server::Daemon>, std::unique_ptr<FakeRuntime>>>();
      stopped->emplace_back(std::move(daemon_), std::move(runtime_));
    }
  }
  bool ok() const { return serving_; }
  const std::string& error() const { return error_; }
  const std::string& target() const { return target_; }
  std::string socket_path() const { return target_.substr(7); }  // after "unix://"
  const std::string& tcp_target() const { return tcp_target_; }
  FakeRuntime& fake() { return *runtime_; }
  const TempDir& dir() const { return dir_; }
  static std::string Uuid() {
    const server::Uuid u = FakeRuntime::FakeUuid(0);
    return std::string(reinterpret_cast<const char*>(u.data()), u.size());
  }

 private:
  TempDir dir_;
  std::unique_ptr<FakeRuntime> runtime_ = std::make_unique<FakeRuntime>(1);  // outlives the daemon
  std::string target_, tcp_target_, error_;
  std::unique_ptr<server::Daemon> daemon_;
  std::thread thread_;
  bool serving_ = false;
};

// A golden case with an input above one granule, so that it can span two chunks.
const GoldenCase& SpanningCase() {
  for (const GoldenCase& g : GoldenCases()) {
    if (!g.error && !g.output_file.empty() && g.input_bytes > kGranularity + 512) return g;
  }
  ADD_FAILURE() << "no golden case above 4.5 KiB";
  return GoldenCases().front();
}

v1::ConvertRequest VmmRequestFor(const GoldenCase& g, const v1::CudaIpcBuffer& src, const v1::CudaIpcBuffer& dst) {
  v1::ConvertRequest r = ConvertRequestFor(g.spec, g.logical_shape, {});
  r.clear_source_bytes();
  *r.mutable_source_ipc() = src;
  *r.mutable_destination_ipc() = dst;
  return r;
}

std::unique_ptr<v1::WeightPrep::Stub> Stub(const std::string& target) {
  return v1::WeightPrep::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

grpc::Status Convert(const std::string& target, const v1::ConvertRequest& req, v1::ConvertResponse* resp = nullptr) {
  v1::ConvertResponse ignored;
  grpc::ClientContext ctx;
  return Stub(target)->Convert(&ctx, req, resp != nullptr ? resp : &ignored);
}

// A memfd of this process of `size` bytes, holding `content` at `offset`.
int Memfd(uint64_t size, const std::string& content = "", uint64_t offset = 0) {
  const int fd = memfd_create("wprep-vmm-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  if (!content.empty()) {
    EXPECT_EQ(pwrite(fd, content.data(), content.size(), static_cast<off_t>(offset)),
              static_cast<ssize_t>(content.size()));
  }
  return fd;
}

std::string ReadMemfd(int fd, uint64_t bytes) {
  std::string out(bytes, '\0');
  EXPECT_EQ(pread(fd, out.data(), bytes, 0), static_cast<ssize_t>(bytes));
  return out;
}

// Whether this process may take its own descriptors with pidfd_getfd (what every
// in-process client below relies on); the reason when not.
std::string PidfdGetfdUnavailable() {
  absl::StatusOr<int> pidfd = server::OpenPidfd(getpid());
  if (!pidfd.ok()) return pidfd.status().ToString();
  absl::StatusOr<int> fd = server::TakeFd(*pidfd, 0);
  close(*pidfd);
  if (!fd.ok() && fd.status().code() != absl::StatusCode::kInvalidArgument) return fd.status().ToString();
  if (fd.ok()) close(*fd);
  return "";
}

#define SKIP_WITHOUT_PIDFD_GETFD()                                                          \
  if (const std::string why = PidfdGetfdUnavailable(); !why.empty()) {                        \
    GTEST_SKIP() << "pidfd_getfd cannot run here: " << why;                                    \
  }

TEST(VmmDaemon, ConvertsAChildProcessChunksAndReusesTheMappingUntilItExits) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  const GoldenCase& g = SpanningCase();
  const std::string input = AsString(GoldenInput(g));
  // The source starts 512 bytes before the end of its first chunk and runs into the
  // second: the chunks must map back to back.
  const uint64_t offset = kGranularity - 512;
  const uint64_t second = RoundUp(offset + input.size() - kGranularity);
  std::string whole(kGranularity + second, '\0');
  whole.replace(offset, input.size(), input);
  WriteAll(d.dir().File("chunk0"), whole.substr(0, kGranularity));
  WriteAll(d.dir().File("chunk1"), whole.substr(kGranularity));
  const uint64_t out_bytes = RoundUp(g.output_bytes);
  // pid 0 and fds -1, -2, -3: the client fills in its own pid and memfds.
  const v1::ConvertRequest req =
      VmmRequestFor(g, VmmBuffer(0, {{-1, kGranularity}, {-2, second}}, offset, input.size(), d.Uuid()),
                    VmmBuffer(0, {{-3, out_bytes}}, 0, g.output_bytes, d.Uuid()));
  WriteAll(d.dir().File("request"), req.SerializeAsString());
  Child child({"--target=" + d.target(), "--request=" + d.dir().File("request"),
               absl::StrCat("--memfd=", kGranularity, ":", d.dir().File("chunk0")),
               absl::StrCat("--memfd=", second, ":", d.dir().File("chunk1")), absl::StrCat("--memfd=", out_bytes),
               "--out=2:" + d.dir().File("out"), "--repeat=2", "--hold"});
  ASSERT_GT(child.pid(), 0);
  for (int k = 0; k < 3; ++k) ASSERT_GE(child.MemfdLine(), 0);
  EXPECT_EQ(child.Line(), "code=0 ");
  EXPECT_EQ(child.Line(), "code=0 ");
  ASSERT_EQ(child.Line(), "holding");
  const std::string out = ReadAll(d.dir().File("out"));
  ASSERT_GE(out.size(), g.output_bytes);
  EXPECT_TRUE(MatchesGolden(g, out.substr(0, g.output_bytes))) << g.name;
  // Two calls, one mapping each of source and destination.
  EXPECT_EQ(d.fake().totals().vmm_opens, 2);
  EXPECT_EQ(d.fake().totals().vmm_mapped_now, 2);
  // The client exits: its mappings close (the daemon's janitor sweeps every second).
  child.CloseStdin();
  child.Wait();
  EXPECT_TRUE(WaitFor([&] { return d.fake().totals().vmm_mapped_now == 0; }))
      << "mapped now: " << d.fake().totals().vmm_mapped_now;
  EXPECT_EQ(d.fake().totals().vmm_closes, 2);
}

TEST(VmmDaemon, RefusesAPidThatIsNotThePeerWithNothingMapped) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  const GoldenCase& g = SpanningCase();
  // Another process, whose memfds the daemon could take: this client names it.
  Child other({"--memfd=" + std::to_string(RoundUp(g.input_bytes)), "--memfd=" + std::to_string(RoundUp(g.output_bytes)),
               "--hold"});
  ASSERT_GT(other.pid(), 0);
  const int src_fd = other.MemfdLine(), dst_fd = other.MemfdLine();
  ASSERT_EQ(other.Line(), "holding");
  const FakeRuntime::Counts before = d.fake().totals();  // the warm-up's conversions
  const v1::ConvertRequest req =
      VmmRequestFor(g, VmmBuffer(other.pid(), {{src_fd, RoundUp(g.input_bytes)}}, 0, g.input_bytes, d.Uuid()),
                    VmmBuffer(other.pid(), {{dst_fd, RoundUp(g.output_bytes)}}, 0, g.output_bytes, d.Uuid()));
  grpc::Status s = Convert(d.target(), req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "source_ipc.vmm.pid")) << s.error_message();
  // A batch is refused the same way.
  v1::ConvertBatchRequest batch;
  v1::ConvertItem* item = batch.add_items()->mutable_convert();
  *item->mutable_spec() = req.spec();
  *item->mutable_logical_shape() = req.logical_shape();
  *item->mutable_source()->mutable_ipc() = req.source_ipc();
  *item->mutable_destination()->mutable_ipc() = req.destination_ipc();
  grpc::ClientContext ctx;
  v1::ConvertBatchResponse resp;
  s = Stub(d.target())->ConvertBatch(&ctx, batch, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "items[0].convert.source.ipc.vmm.pid")) << s.error_message();
  const FakeRuntime::Counts c = d.fake().totals();
  EXPECT_EQ(c.vmm_opens, 0);
  EXPECT_EQ(c.vmm_open_failures, 0);
  EXPECT_EQ(c.converts, before.converts);
}

TEST(VmmDaemon, RefusesVmmBuffersOverTcp) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  ASSERT_FALSE(d.tcp_target().empty());
  const GoldenCase& g = SpanningCase();
  const int src = Memfd(RoundUp(g.input_bytes)), dst = Memfd(RoundUp(g.output_bytes));
  const v1::ConvertRequest req =
      VmmRequestFor(g, VmmBuffer(getpid(), {{src, RoundUp(g.input_bytes)}}, 0, g.input_bytes, d.Uuid()),
                    VmmBuffer(getpid(), {{dst, RoundUp(g.output_bytes)}}, 0, g.output_bytes, d.Uuid()));
  grpc::Status s = Convert(d.tcp_target(), req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "Unix socket")) << s.error_message();
  EXPECT_EQ(d.fake().totals().vmm_opens, 0);
  // The same request on the Unix socket, from this process: served.
  s = Convert(d.target(), req);
  EXPECT_TRUE(s.ok()) << s.error_message();
  close(src);
  close(dst);
}

TEST(VmmDaemon, MalformedBuffersGetTheirStatusAndTheDaemonKeepsServing) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  const GoldenCase& g = SpanningCase();
  const std::string input = AsString(GoldenInput(g));
  const uint64_t in_bytes = RoundUp(input.size()), out_bytes = RoundUp(g.output_bytes);
  const int src = Memfd(in_bytes, input), dst = Memfd(out_bytes);
  const int pid = getpid();
  auto good = [&] {
    return VmmRequestFor(g, VmmBuffer(pid, {{src, in_bytes}}, 0, input.size(), d.Uuid()),
                         VmmBuffer(pid, {{dst, out_bytes}}, 0, g.output_bytes, d.Uuid()));
  };
  struct Case {
    const char* what;
    std::function<void(v1::ConvertRequest*)> edit;
    grpc::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"a descriptor not open in the client",
       [](v1::ConvertRequest* r) { r->mutable_source_ipc()->mutable_vmm()->mutable_chunks(0)->set_fd(1000); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"a chunk larger than its allocation (wrong size)",
       [&](v1::ConvertRequest* r) { r->mutable_source_ipc()->mutable_vmm()->mutable_chunks(0)->set_size(in_bytes * 4); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"an offset past the end", [&](v1::ConvertRequest* r) { r->mutable_source_ipc()->set_offset(in_bytes + 1); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"a size that is not a multiple of the granularity",
       [&](v1::ConvertRequest* r) { r->mutable_destination_ipc()->mutable_vmm()->mutable_chunks(0)->set_size(out_bytes - 1); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"zero chunks", [](v1::ConvertRequest* r) { r->mutable_source_ipc()->mutable_vmm()->clear_chunks(); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"a GPU the daemon does not have",
       [](v1::ConvertRequest* r) { r->mutable_source_ipc()->set_device_uuid(std::string(16, '\x7f')); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"a fabric handle (not importable here)",
       [](v1::ConvertRequest* r) {
         v1::CudaVmmBuffer* v = r->mutable_source_ipc()->mutable_vmm();
         v->set_handle_type(v1::VMM_HANDLE_TYPE_FABRIC);
         v->mutable_chunks(0)->set_fabric_handle(std::string(64, 'f'));
       },
       grpc::StatusCode::FAILED_PRECONDITION},
      {"a pid that does not exist", [](v1::ConvertRequest* r) { r->mutable_source_ipc()->mutable_vmm()->set_pid(0x3fffffff); },
       grpc::StatusCode::PERMISSION_DENIED},
  };
  for (const Case& c : cases) {
    v1::ConvertRequest r = good();
    c.edit(&r);
    const FakeRuntime::Counts before = d.fake().totals();
    grpc::Status s = Convert(d.target(), r);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    // Nothing new stays mapped, and nothing was converted.
    EXPECT_EQ(d.fake().totals().vmm_mapped_now, before.vmm_mapped_now) << c.what;
    EXPECT_EQ(d.fake().totals().converts, before.converts) << c.what;
    // The daemon still serves a good request.
    ASSERT_EQ(pwrite(dst, std::string(g.output_bytes, '\xAB').data(), g.output_bytes, 0),
              static_cast<ssize_t>(g.output_bytes));
    s = Convert(d.target(), good());
    EXPECT_TRUE(s.ok()) << "after " << c.what << ": " << s.error_message();
    EXPECT_TRUE(MatchesGolden(g, ReadMemfd(dst, g.output_bytes))) << "after " << c.what;
  }
  // The good requests shared one mapping of each buffer.
  EXPECT_EQ(d.fake().totals().vmm_opens, 2);
  close(src);
  close(dst);
}

// RegisterIpcHandles and ReleaseIpcHandles take VMM allocations as they take legacy
// handles: register maps them ahead of the requests, which reuse the mappings, and release
// closes them, for the process that holds the descriptors only.
TEST(VmmDaemon, RegisterMapsVmmAllocationsAndReleaseClosesThem) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  const GoldenCase& g = SpanningCase();
  const std::string input = AsString(GoldenInput(g));
  const uint64_t in_bytes = RoundUp(input.size()), out_bytes = RoundUp(g.output_bytes);
  const int src = Memfd(in_bytes, input), dst = Memfd(out_bytes);
  const int pid = getpid();
  auto refs = [&](auto* req) {
    for (auto [fd, bytes] : {std::pair<int, uint64_t>{src, in_bytes}, {dst, out_bytes}}) {
      v1::IpcHandleRef* h = req->add_handles();
      h->set_device_uuid(d.Uuid());
      *h->mutable_vmm() = VmmBuffer(pid, {{fd, bytes}}, 0, 0, d.Uuid()).vmm();
    }
  };
  auto register_all = [&](v1::RegisterIpcHandlesResponse* resp) {
    v1::RegisterIpcHandlesRequest req;
    refs(&req);
    grpc::ClientContext ctx;
    return Stub(d.target())->RegisterIpcHandles(&ctx, req, resp);
  };
  auto release_all = [&](const std::string& target, v1::ReleaseIpcHandlesResponse* resp) {
    v1::ReleaseIpcHandlesRequest req;
    refs(&req);
    grpc::ClientContext ctx;
    return Stub(target)->ReleaseIpcHandles(&ctx, req, resp);
  };
  const FakeRuntime::Counts before = d.fake().totals();
  v1::RegisterIpcHandlesResponse reg;
  grpc::Status s = register_all(&reg);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(reg.allocation_bytes_size(), 2);
  EXPECT_EQ(reg.allocation_bytes(0), in_bytes);
  EXPECT_EQ(reg.allocation_bytes(1), out_bytes);
  EXPECT_EQ(reg.already_open(), 0u);
  EXPECT_EQ(d.fake().totals().vmm_opens, before.vmm_opens + 2);
  EXPECT_EQ(d.fake().totals().vmm_mapped_now, before.vmm_mapped_now + 2);
  s = register_all(&reg);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(reg.already_open(), 2u);
  // A conversion through the registered allocations opens nothing more.
  s = Convert(d.target(), VmmRequestFor(g, VmmBuffer(pid, {{src, in_bytes}}, 0, input.size(), d.Uuid()),
                                        VmmBuffer(pid, {{dst, out_bytes}}, 0, g.output_bytes, d.Uuid())));
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(MatchesGolden(g, ReadMemfd(dst, g.output_bytes)));
  EXPECT_EQ(d.fake().totals().vmm_opens, before.vmm_opens + 2);
  // Over TCP nobody may release them.
  v1::ReleaseIpcHandlesResponse rel;
  s = release_all(d.tcp_target(), &rel);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_EQ(d.fake().totals().vmm_mapped_now, before.vmm_mapped_now + 2);
  s = release_all(d.target(), &rel);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(rel.released(), 2u);
  EXPECT_EQ(d.fake().totals().vmm_mapped_now, before.vmm_mapped_now);
  s = release_all(d.target(), &rel);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(rel.released(), 0u);
  close(src);
  close(dst);
}

// Quantize items name their source and outputs with the same buffers as conversions: the
// daemon maps VMM ones there too, and refuses them there as everywhere.
TEST(VmmDaemon, QuantizeItemsReadAndWriteVmmBuffers) {
  SKIP_WITHOUT_PIDFD_GETFD();
  FakeGpuDaemon d;
  ASSERT_TRUE(d.ok()) << d.error();
  std::vector<float> x(4 * 64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 13) - 6) * 0.37f;
  const std::string input(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  v1::ConvertBatchRequest inline_req;
  v1::QuantizeItem* q = inline_req.add_items()->mutable_quantize();
  q->set_dtype(v1::QUANTIZE_DTYPE_FLOAT32);
  q->add_shape(4);
  q->add_shape(64);
  q->mutable_source()->set_inline_bytes(input);
  v1::ConvertBatchResponse want;
  {
    grpc::ClientContext ctx;
    grpc::Status s = Stub(d.target())->ConvertBatch(&ctx, inline_req, &want);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_EQ(want.items_size(), 1);
  ASSERT_EQ(want.items(0).outputs_size(), 2);
  const std::string& values = want.items(0).outputs(0).inline_bytes();
  const std::string& scales = want.items(0).outputs(1).inline_bytes();
  ASSERT_FALSE(values.empty());
  ASSERT_FALSE(scales.empty());

  const uint64_t in_bytes = RoundUp(input.size());
  const int src = Memfd(in_bytes, input), vals = Memfd(kGranularity), scl = Memfd(kGranularity);
  v1::ConvertBatchRequest req = inline_req;
  q = req.mutable_items(0)->mutable_quantize();
  *q->mutable_source()->mutable_ipc() = VmmBuffer(getpid(), {{src, in_bytes}}, 0, input.size(), d.Uuid());
  *q->mutable_values()->mutable_ipc() = VmmBuffer(getpid(), {{vals, kGranularity}}, 0, values.size(), d.Uuid());
  *q->mutable_scales()->mutable_ipc() = VmmBuffer(getpid(), {{scl, kGranularity}}, 0, scales.size(), d.Uuid());
  const FakeRuntime::Counts before = d.fake().totals();
  {
    grpc::ClientContext ctx;
    v1::ConvertBatchResponse resp;
    grpc::Status s = Stub(d.target())->ConvertBatch(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(ReadMemfd(vals, values.size()), values);
  EXPECT_EQ(ReadMemfd(scl, scales.size()), scales);
  EXPECT_EQ(d.fake().totals().vmm_opens, before.vmm_opens + 3);

  // Another process's pid: refused with the quantize item's field, nothing more mapped.
  q->mutable_values()->mutable_ipc()->mutable_vmm()->set_pid(getppid());
  grpc::ClientContext ctx;
  v1::ConvertBatchResponse resp;
  grpc::Status s = Stub(d.target())->ConvertBatch(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "items[0].quantize.values.ipc.vmm.pid")) << s.error_message();
  EXPECT_EQ(d.fake().totals().vmm_opens, before.vmm_opens + 3);
  close(src);
  close(vals);
  close(scl);
}

// ---------------------------------------------------------------------------------------
// Weight sets in CUDA virtual memory: the descriptor goes over the handle socket.

// The status code a child process gets for `token` on the handle socket at `path`: the
// child speaks the protocol with raw system calls only (it is forked from a process with
// threads) and exits with the reply's code.
int ChildFetchCode(const std::string& path, const std::string& token) {
  const pid_t child = fork();
  if (child == 0) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    uint8_t header[16] = {};
    if (sock < 0 || connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        write(sock, token.data(), token.size()) != static_cast<ssize_t>(token.size()) ||
        recv(sock, header, sizeof(header), MSG_WAITALL) != static_cast<ssize_t>(sizeof(header))) {
      _exit(100);
    }
    _exit(header[0]);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class WeightSetVmm : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(root_.path() + "/ck");
    WriteSafetensors(root_.path() + "/ck/model.safetensors", tensors_);
  }
  v1::LoadWeightsRequest LoadRequest(const std::string& name, bool vmm) const {
    v1::LoadWeightsRequest r;
    r.set_name(name);
    r.set_path("ck");
    r.set_device_uuid(FakeGpuDaemon::Uuid());
    r.set_vmm(vmm);
    return r;
  }

  TempDir root_;
  std::vector<Tensor> tensors_ = {{"big", "U8", {3, 5000}, Pattern(15000, 3)},
                                  {"embed", "BF16", {16, 8}, Pattern(16 * 8 * 2, 4)}};
};

TEST_F(WeightSetVmm, TheAttachingProcessFetchesTheDescriptorOnceAndMapsTheSetsBytes) {
  FakeGpuDaemon d({"--weights-root=" + root_.path()});
  ASSERT_TRUE(d.ok()) << d.error();
  client::WeightSets sets(d.target());
  absl::StatusOr<v1::LoadWeightsResponse> loaded = sets.Load(LoadRequest("v", true));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const v1::WeightManifest& m = loaded->manifest();
  EXPECT_TRUE(m.vmm());
  EXPECT_EQ(d.fake().vmm_shared_now(), 1);

  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> a = sets.Attach("v");
  ASSERT_TRUE(a.ok()) << a.status();
  const v1::AttachWeightsResponse& info = (*a)->info();
  EXPECT_TRUE(info.ipc_handle().empty());
  ASSERT_EQ(info.vmm().token().size(), 16u);

  absl::StatusOr<client::VmmDescriptor> got = client::FetchVmmDescriptor(d.socket_path(), info.vmm().token());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GE(got->chunk_bytes, m.total_bytes());
  EXPECT_EQ(got->chunk_bytes % (2u << 20), 0u);  // the fake's granularity
  void* base = mmap(nullptr, got->chunk_bytes, PROT_READ, MAP_SHARED, got->fd, 0);
  ASSERT_NE(base, MAP_FAILED);
  close(got->fd);
  ASSERT_EQ(m.tensors_size(), 2);
  for (const v1::WeightTensor& t : m.tensors()) {
    const Tensor& want = t.name() == "big" ? tensors_[0] : tensors_[1];
    ASSERT_EQ(t.bytes(), want.bytes.size()) << t.name();
    EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(base) + t.offset(), want.bytes.data(), want.bytes.size()), 0)
        << t.name();
  }

  // Once: the same token again, a made-up one, and this attachment's token from another
  // process are all refused alike.
  absl::StatusOr<client::VmmDescriptor> again = client::FetchVmmDescriptor(d.socket_path(), info.vmm().token());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied) << again.status();
  EXPECT_TRUE(absl::StrContains(again.status().message(), "serves once")) << again.status();
  EXPECT_EQ(client::FetchVmmDescriptor(d.socket_path(), std::string(16, 'x')).status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> b = sets.Attach("v");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(ChildFetchCode(d.socket_path() + ".handles", (*b)->info().vmm().token()),
            static_cast<int>(absl::StatusCode::kPermissionDenied));
  // ... and a detached attachment's token.
  const std::string b_token = (*b)->info().vmm().token();
  ASSERT_TRUE((*b)->Detach().ok());
  EXPECT_EQ(client::FetchVmmDescriptor(d.socket_path(), b_token).status().code(),
            absl::StatusCode::kPermissionDenied);
  // A short token, then silence: the daemon answers DEADLINE_EXCEEDED and serves on.
  EXPECT_EQ(ChildFetchCode(d.socket_path() + ".handles", "short"),
            static_cast<int>(absl::StatusCode::kDeadlineExceeded));

  // Dropping frees the daemon's chunk; the mapping made from the descriptor stays valid.
  ASSERT_TRUE((*a)->Detach().ok());
  absl::StatusOr<uint64_t> freed = sets.Drop("v");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(d.fake().vmm_shared_now(), 0);
  EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(base) + m.tensors(0).offset(), tensors_[0].bytes.data(), 64), 0);
  munmap(base, got->chunk_bytes);
}

TEST_F(WeightSetVmm, RefusalsNameTheReasonAndChangeNothing) {
  FakeGpuDaemon d({"--weights-root=" + root_.path()});
  ASSERT_TRUE(d.ok()) << d.error();
  client::WeightSets sets(d.target());
  // vmm for a host set.
  v1::LoadWeightsRequest host = LoadRequest("h", true);
  host.clear_device_uuid();
  absl::StatusOr<v1::LoadWeightsResponse> r = sets.Load(host);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "vmm:")) << r.status();
  // A VMM set attached over TCP: its descriptor cannot travel there.
  ASSERT_TRUE(sets.Load(LoadRequest("v", true)).ok());
  ASSERT_FALSE(d.tcp_target().empty());
  client::WeightSets tcp(d.tcp_target());
  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> a = tcp.Attach("v");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  EXPECT_TRUE(absl::StrContains(a.status().message(), "Unix socket")) << a.status();
  // A cudaMalloc set on the same daemon still attaches by its IPC handle, with no token.
  ASSERT_TRUE(sets.Load(LoadRequest("legacy", false)).ok());
  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> l = tcp.Attach("legacy");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->info().ipc_handle().size(), 64u);
  EXPECT_FALSE((*l)->info().has_vmm());
  EXPECT_FALSE((*l)->info().manifest().vmm());
  ASSERT_TRUE((*l)->Detach().ok());
  absl::StatusOr<v1::ListWeightsResponse> list = sets.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sets_size(), 2);
}

}  // namespace
}  // namespace wprep::testing
