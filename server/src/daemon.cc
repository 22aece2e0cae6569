#include "wprep/server/daemon.h"

#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "admission.h"
#include "device_manager.h"
#include "device_runtime.h"
#include "executor.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "ipc_cache.h"
#include "ipc_owner.h"
#include "log.h"
#include "metrics.h"
#include "rpc_warmup.h"
#include "service.h"
#include "stream_pipeline.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {
namespace {

constexpr char kServiceName[] = "wprep.v1.WeightPrep";
// Streams slice their input into pieces of this many bytes (whole matrices, at least one).
constexpr uint64_t kStreamSliceBytes = 4ull << 20;
// Bound on the self warm-up of one listener (milliseconds when healthy), so a stuck call
// cannot hold SERVING back for long.
constexpr absl::Duration kRpcWarmupBound = absl::Seconds(5);
// Housekeeping period, and the quiet time after which the heap is trimmed.
constexpr absl::Duration kJanitorPeriod = absl::Seconds(1);
constexpr absl::Duration kIdleBeforeTrim = absl::Seconds(2);

// Streams allocate and free many 1-4 MiB buffers (messages, slices). glibc's defaults
// mmap each one and return it on free, so every chunk pays page faults on first touch;
// keep them in the heap instead. Serve trims the heap once traffic stops, and one arena
// lets it: malloc_trim never releases the top of glibc's per-thread arenas, which held
// ~240 MiB after 10,000 requests (wprep_memory_soak), while the allocation rate here is
// a few calls per MiB moved, too low to contend on one lock.
void TuneHeap() {
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

std::string SocketPath(const std::string& address) {
  return absl::StartsWith(address, "unix://") ? address.substr(7) : std::string();
}

// A stale socket file from an earlier run would make bind fail; remove only sockets.
void RemoveStaleSocket(const std::string& path) {
  struct stat st;
  if (!path.empty() && lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
}

absl::Status WritePortFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!(f << text)) return absl::UnavailableError(absl::StrCat("cannot write --port-file ", path));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write --port-file ", path));
  }
  return absl::OkStatus();
}

}  // namespace

// Everything the phases share. Declared in the order of construction; destroyed in
// reverse, so each part outlives those that borrow it.
struct DaemonParts {
  Options options;
  DeviceRuntime* runtime = nullptr;
  absl::Time start;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<DeviceManager> devices;
  std::unique_ptr<IpcCache> ipc;
  std::unique_ptr<Executor> executor;
  Admission admission;
  std::string warmup_token;
  std::unique_ptr<WeightPrepService> service;
  std::unique_ptr<grpc::Server> server;
  std::vector<std::string> warmup_targets;

  absl::Mutex mu;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> stop_flag{false};  // the same, for the RPC warm-up's checks

  grpc::HealthCheckServiceInterface* health() { return server->GetHealthCheckService(); }
  void SetHealth(bool serving) {
    health()->SetServingStatus(kServiceName, serving);
    health()->SetServingStatus(serving);
  }
  bool Stopping() {
    absl::MutexLock lock(&mu);
    return stop;
  }
};

Daemon::Daemon(std::unique_ptr<DaemonParts> parts) : parts_(std::move(parts)) {}
Daemon::~Daemon() = default;

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const Options& options, DeviceRuntime* runtime) {
  auto p = std::make_unique<DaemonParts>();
  p->options = options;
  p->runtime = runtime;
  p->start = absl::Now();
  WPREP_ASSIGN_OR_RETURN(p->metrics, Metrics::Create(options.metrics_address, runtime->compiled_in()));
  WPREP_ASSIGN_OR_RETURN(p->devices, DeviceManager::Create(options, runtime, p->metrics.get()));
  p->ipc = std::make_unique<IpcCache>(runtime, options.ipc_cache_entries, options.ipc_idle_expiry,
                                      p->metrics.get());
  p->executor = std::make_unique<Executor>(p->devices.get(), p->ipc.get(), kStreamSliceBytes,
                                           options.memory_wait);
  p->warmup_token = NewWarmupToken();
  p->service = std::make_unique<WeightPrepService>(&p->admission, p->devices.get(), p->ipc.get(),
                                                   p->executor.get(), p->metrics.get(),
                                                   options.max_message_bytes, p->warmup_token);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<int> ports(options.listen.size(), 0);
  for (size_t i = 0; i < options.listen.size(); ++i) {
    RemoveStaleSocket(SocketPath(options.listen[i]));
    builder.AddListeningPort(options.listen[i], grpc::InsecureServerCredentials(), &ports[i]);
  }
  // Streams carry 4 MiB chunks plus framing whatever --max-message-bytes says; unary
  // handlers enforce --max-message-bytes themselves.
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::max<int64_t>(options.max_message_bytes, kMaxChunkBytes + (64 << 10))));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes + (64 << 10)));
  builder.RegisterService(p->service.get());
  // Socket files get mode 0660: set the umask while binding, then chmod to be sure.
  const mode_t old_umask = umask(0117);
  p->server = builder.BuildAndStart();
  umask(old_umask);
  if (p->server == nullptr) {
    return absl::UnavailableError("could not listen on every --listen address (in use, or not permitted)");
  }
  p->SetHealth(false);

  std::string port_text;
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& addr = options.listen[i];
    p->warmup_targets.push_back(WarmupTarget(addr, ports[i]));
    if (const std::string path = SocketPath(addr); !path.empty()) {
      chmod(path.c_str(), 0660);
      absl::StrAppend(&port_text, "grpc ", addr, "\n");
    } else if (ports[i] == 0) {
      p->server->Shutdown();
      return absl::UnavailableError(absl::StrCat("could not bind ", addr));
    } else {
      absl::StrAppend(&port_text, "grpc ", addr.substr(0, addr.rfind(':')), ":", ports[i], "\n");
    }
  }
  if (p->metrics->port() != 0) {
    const std::string& m = options.metrics_address;
    absl::StrAppend(&port_text, "metrics ", m.substr(0, m.rfind(':')), ":", p->metrics->port(), "\n");
  }
  if (!options.port_file.empty()) {
    if (absl::Status s = WritePortFile(options.port_file, port_text); !s.ok()) {
      p->server->Shutdown();
      return s;
    }
  }
  LogLine(LogLevel::kInfo, "listening",
          absl::StrCat("addresses=", LogQuote(port_text), " gpus=", p->devices->num_gpus()));
  return std::unique_ptr<Daemon>(new Daemon(std::move(p)));
}

absl::Status Daemon::WarmUp() {
  DaemonParts& p = *parts_;
  const std::string& gate = p.options.warmup_gate_file;
  while (!gate.empty() && access(gate.c_str(), F_OK) != 0) {
    absl::MutexLock lock(&p.mu);
    if (p.mu.AwaitWithTimeout(absl::Condition(&p.stop), absl::Milliseconds(10))) {
      return absl::CancelledError("stopped while waiting for the warm-up gate");
    }
  }
  if (p.Stopping()) return absl::CancelledError("stopped before the warm-up");
  // Learning which handle bytes name the exporting GPU (a child process, ~0.2 s) runs
  // beside the kernel warm-up; both finish before SERVING.
  std::vector<int> ordinals;
  for (size_t i = 0; i < p.devices->num_gpus(); ++i) ordinals.push_back(p.devices->gpu(i).ordinal());
  std::thread calibrate([&p, ordinals] {
    IpcOwnerMap map = IpcOwnerMap::Calibrate(*p.runtime, "/proc/self/exe", ordinals);
    LogLine(LogLevel::kInfo, "ipc_owner_check",
            absl::StrCat("enabled=", map.enabled() ? "true" : "false", " detail=", LogQuote(map.description())));
    p.ipc->SetOwnerMap(std::move(map));
  });
  absl::Status kernels = p.devices->WarmUp();
  calibrate.join();
  WPREP_RETURN_IF_ERROR(kernels);
  if (p.Stopping()) return absl::CancelledError("stopped during the warm-up");
  // Requests are admitted from here so that the self warm-up gets in; a client that
  // calls before health says SERVING, a few milliseconds later, gets in too, which is
  // harmless: every kernel is warm already.
  p.admission.SetServing();
  // The first request through a cold gRPC server path costs several times a warm one
  // (rpc_warmup.h): call every method over every listener first. A failure is logged but
  // does not keep the daemon from serving, since the kernels proved warm.
  for (const std::string& target : p.warmup_targets) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<int> calls = WarmUpRpcPath(target, p.warmup_token, kRpcWarmupBound, p.stop_flag);
    if (p.Stopping()) return absl::CancelledError("stopped during the RPC warm-up");
    if (calls.ok()) {
      LogLine(LogLevel::kInfo, "rpc_warmup",
              absl::StrCat("address=", LogQuote(target), " calls=", *calls,
                           " seconds=", absl::ToDoubleSeconds(absl::Now() - t0)));
    } else {
      LogLine(LogLevel::kWarning, "rpc_warmup_failed",
              absl::StrCat("address=", LogQuote(target), " code=", absl::StatusCodeToString(calls.status().code()),
                           " error=", LogQuote(calls.status().message())));
    }
  }
  p.SetHealth(true);
  LogLine(LogLevel::kInfo, "serving",
          absl::StrCat("seconds_since_start=", absl::ToDoubleSeconds(absl::Now() - p.start)));
  return absl::OkStatus();
}

void Daemon::Serve() {
  DaemonParts& p = *parts_;
  uint64_t trimmed_at = 0;
  absl::MutexLock lock(&p.mu);
  while (!p.mu.AwaitWithTimeout(absl::Condition(&p.stop), kJanitorPeriod)) {
    p.mu.Unlock();
    // Idle IPC mappings expire even without traffic; once client requests stop for a
    // while, the heap and pinned buffers go back to their idle size.
    p.ipc->ExpireIdle();
    const uint64_t requests = p.admission.client_requests();
    if (requests != trimmed_at && p.admission.IdleFor(kIdleBeforeTrim)) {
      p.devices->pinned().Trim();
      const int released = malloc_trim(0);
      trimmed_at = requests;
      LogLine(LogLevel::kInfo, "idle_trim", absl::StrCat("heap_released=", released != 0));
    }
    p.mu.Lock();
  }
}

bool Daemon::Drain(absl::string_view why) {
  DaemonParts& p = *parts_;
  p.admission.StartDraining();
  p.SetHealth(false);
  LogLine(LogLevel::kInfo, "draining",
          absl::StrCat("reason=", LogQuote(why), " in_flight=", p.admission.in_flight(),
                       " drain_timeout_seconds=", absl::ToDoubleSeconds(p.options.drain_timeout)));
  const bool drained = p.admission.WaitIdle(absl::Now() + p.options.drain_timeout);
  if (!drained) {
    LogLine(LogLevel::kWarning, "drain_timeout", absl::StrCat("cancelling=", p.admission.in_flight()));
  }
  // A handler that returned has not necessarily sent its final status yet: give gRPC a
  // second to deliver those (it takes microseconds), then cancel whatever remains.
  p.server->Shutdown(absl::ToChronoTime(drained ? absl::Now() + absl::Seconds(1) : absl::Now()));
  p.server->Wait();
  p.ipc->CloseAll();
  for (const std::string& addr : p.options.listen) RemoveStaleSocket(SocketPath(addr));
  LogLine(LogLevel::kInfo, "stopped", absl::StrCat("drained=", drained ? "true" : "false"));
  return drained;
}

void Daemon::RequestStop() {
  DaemonParts& p = *parts_;
  absl::MutexLock lock(&p.mu);
  p.stop = true;
  p.stop_flag.store(true);
}

namespace {

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// Waits for SIGTERM or SIGINT on its own thread and asks the daemon to stop; ends
// without a signal once Finish is called.
class ShutdownSignalWaiter {
 public:
  explicit ShutdownSignalWaiter(Daemon* daemon) : thread_([this, daemon] { Run(daemon); }) {}
  ~ShutdownSignalWaiter() { Finish(); }
  // The signal's name, or why the daemon stops without one.
  std::string Finish() {
    done_.store(true);
    if (thread_.joinable()) thread_.join();
    return reason_;
  }

 private:
  void Run(Daemon* daemon) {
    const sigset_t signals = ShutdownSignals();
    const timespec period{0, 100 * 1000 * 1000};
    while (!done_.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &period);
      if (sig == SIGTERM || sig == SIGINT) {
        reason_ = sig == SIGTERM ? "SIGTERM" : "SIGINT";
        daemon->RequestStop();
        return;
      }
    }
    reason_ = "warm-up failed";
  }

  std::atomic<bool> done_{false};
  std::string reason_;  // written by the thread, read after it ended
  std::thread thread_;
};

}  // namespace

int RunDaemon(const Options& options) {
  TuneHeap();
  sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread created below
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(options, &CudaRuntime());
  if (!daemon.ok()) {
    LogLine(LogLevel::kError, "start_failed", absl::StrCat("error=", LogQuote(daemon.status().message())));
    return 1;
  }
  int rc = 0;
  {
    ShutdownSignalWaiter waiter(daemon->get());
    // Warm-up runs beside the signal wait, so a SIGTERM during it still shuts down cleanly.
    if (absl::Status s = (*daemon)->WarmUp(); s.ok()) {
      (*daemon)->Serve();
    } else if (s.code() != absl::StatusCode::kCancelled) {
      LogLine(LogLevel::kError, "warmup_failed", absl::StrCat("error=", LogQuote(s.message())));
      rc = 1;
    }
    (*daemon)->Drain(waiter.Finish());
  }
  // Deliberately not destroyed: the stopped grpc::Server's destructor waits (about 10 s)
  // for peers to close their idle connections, and stopping the metrics HTTP server waits
  // for its 2 s poll. Neither holds anything that outlives the process, which exits next.
  (void)daemon->release();
  return rc;
}

int WprepdMain(const std::vector<std::string>& args) {
  // Internal: the daemon runs itself in this mode once at start (see ipc_owner.h).
  constexpr absl::string_view kExportFlag = "--export-ipc-handles=";
  if (args.size() == 1 && absl::StartsWith(args[0], kExportFlag)) {
    std::vector<int> ordinals;
    for (absl::string_view o : absl::StrSplit(absl::string_view(args[0]).substr(kExportFlag.size()), ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(o, &v)) return 2;
      ordinals.push_back(v);
    }
    return ExportIpcHandlesMain(CudaRuntime(), ordinals);
  }
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(Usage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<Options> options = ParseOptions(args);
  if (!options.ok()) {
    std::fprintf(stderr, "wprepd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  return RunDaemon(*options);
}

}  // namespace wprep::server
