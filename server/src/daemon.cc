#include "wprep/server/daemon.h"

#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "wprep/client/client.h"
#include "wprep/server/admission.h"
#include "wprep/server/device_manager.h"
#include "wprep/server/executor.h"
#include "wprep/server/ipc_cache.h"
#include "wprep/server/ipc_owner.h"
#include "wprep/server/log.h"
#include "wprep/server/metrics.h"
#include "wprep/server/rpc_warmup.h"
#include "wprep/server/service.h"

namespace wprep::server {
namespace {

constexpr char kServiceName[] = "wprep.v1.WeightPrep";
// Streams slice their input into pieces of this many bytes (whole matrices, at least one).
constexpr uint64_t kStreamSliceBytes = 4ull << 20;
// Bound on the self warm-up of one listener (milliseconds when healthy), so a stuck call
// cannot hold SERVING back for long.
constexpr absl::Duration kRpcWarmupBound = absl::Seconds(5);

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// A stale socket file from an earlier run would make bind fail; remove only sockets.
void RemoveStaleSocket(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
}

bool WritePortFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!(f << text)) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int RunDaemon(const Options& options) {
  const absl::Time start = absl::Now();
  // Streams allocate and free many 1-4 MiB buffers (messages, slices). glibc's defaults
  // mmap each one and return it on free, so every chunk pays page faults on first touch;
  // keep them in the heap instead. The janitor below trims the heap once traffic stops,
  // and one arena lets it: malloc_trim never releases the top of glibc's per-thread
  // arenas, which held ~240 MiB after 10,000 requests (wprep_memory_soak), while the
  // allocation rate here is a few calls per MiB moved, too low to contend on one lock.
  mallopt(M_ARENA_MAX, 1);
  wprep::client::TuneHeapForStreaming();
  sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread created below
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Create(options.metrics_address);
  if (!metrics.ok()) {
    LogLine(LogLevel::kError, "start_failed", LogQuote(metrics.status().message()));
    return 1;
  }
  absl::StatusOr<std::unique_ptr<DeviceManager>> devices = DeviceManager::Create(options, metrics->get());
  if (!devices.ok()) {
    LogLine(LogLevel::kError, "start_failed", LogQuote(devices.status().message()));
    return 1;
  }
  IpcCache ipc(options.ipc_cache_entries, options.ipc_idle_expiry, metrics->get());
  Executor executor(devices->get(), &ipc, metrics->get(), kStreamSliceBytes, options.memory_wait);
  Admission admission;
  const std::string warmup_token = NewWarmupToken();
  WeightPrepService service(&admission, devices->get(), &ipc, &executor, metrics->get(),
                            options.max_message_bytes, warmup_token);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<int> ports(options.listen.size(), 0);
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& addr = options.listen[i];
    if (absl::StartsWith(addr, "unix://")) RemoveStaleSocket(addr.substr(7));
    builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &ports[i]);
  }
  // Streams carry 4 MiB chunks plus framing whatever --max-message-bytes says; unary
  // handlers enforce --max-message-bytes themselves.
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::max<int64_t>(options.max_message_bytes, kMaxChunkBytes + (64 << 10))));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes + (64 << 10)));
  builder.RegisterService(&service);
  // Socket files get mode 0660: set the umask while binding, then chmod to be sure.
  const mode_t old_umask = umask(0117);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(old_umask);
  if (server == nullptr) {
    LogLine(LogLevel::kError, "start_failed",
            "error=\"could not listen on every --listen address (in use, or not permitted)\"");
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(false);
  health->SetServingStatus(kServiceName, false);

  std::string port_text;
  std::vector<std::string> warmup_targets;
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& addr = options.listen[i];
    warmup_targets.push_back(WarmupTarget(addr, ports[i]));
    if (absl::StartsWith(addr, "unix://")) {
      chmod(addr.substr(7).c_str(), 0660);
      absl::StrAppend(&port_text, "grpc ", addr, "\n");
    } else if (ports[i] == 0) {
      LogLine(LogLevel::kError, "start_failed", absl::StrCat("error=\"could not bind ", addr, "\""));
      server->Shutdown();
      return 1;
    } else {
      absl::StrAppend(&port_text, "grpc ", addr.substr(0, addr.rfind(':')), ":", ports[i], "\n");
    }
  }
  if ((*metrics)->port() != 0) {
    const std::string& m = options.metrics_address;
    absl::StrAppend(&port_text, "metrics ", m.substr(0, m.rfind(':')), ":", (*metrics)->port(), "\n");
  }
  if (!options.port_file.empty() && !WritePortFile(options.port_file, port_text)) {
    LogLine(LogLevel::kError, "start_failed", absl::StrCat("error=\"cannot write --port-file ",
                                                           options.port_file, "\""));
    server->Shutdown();
    return 1;
  }
  LogLine(LogLevel::kInfo, "listening",
          absl::StrCat("addresses=", LogQuote(port_text), " gpus=", (*devices)->num_gpus()));

  // Warm-up runs beside the signal wait so a SIGTERM during it still shuts down cleanly.
  std::atomic<bool> stop{false};
  std::atomic<bool> warm_failed{false};
  std::thread warm([&] {
    if (!options.warmup_gate_file.empty()) {
      while (!stop.load() && access(options.warmup_gate_file.c_str(), F_OK) != 0) {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    if (stop.load()) return;
    // Learning which handle bytes name the exporting GPU (a child process, ~0.2 s) runs
    // beside the warm-up; both finish before SERVING.
    std::vector<int> ordinals;
    for (size_t i = 0; i < (*devices)->num_gpus(); ++i) {
      ordinals.push_back((*devices)->gpu(i).info().ordinal);
    }
    std::thread calibrate([&ipc, ordinals] {
      IpcOwnerMap map = IpcOwnerMap::Calibrate("/proc/self/exe", ordinals);
      LogLine(LogLevel::kInfo, "ipc_owner_check",
              absl::StrCat("enabled=", map.enabled() ? "true" : "false",
                           " detail=", LogQuote(map.description())));
      ipc.SetOwnerMap(std::move(map));
    });
    absl::Status s = (*devices)->WarmUp();
    calibrate.join();
    if (!s.ok()) {
      LogLine(LogLevel::kError, "warmup_failed", LogQuote(s.message()));
      warm_failed.store(true);
      kill(getpid(), SIGTERM);
      return;
    }
    if (stop.load()) return;
    // Requests are admitted from here so that the self warm-up gets in; a client that
    // calls before health says SERVING, a few milliseconds later, gets in too, which is
    // harmless: every kernel is warm already.
    admission.SetServing();
    // The first request through a cold gRPC server path costs several times a warm one
    // (rpc_warmup.h): call every method over every listener ourselves first. A failure is
    // logged but does not keep the daemon from serving, since the kernels proved warm.
    for (const std::string& target : warmup_targets) {
      const absl::Time t0 = absl::Now();
      absl::StatusOr<int> calls = WarmUpRpcPath(target, warmup_token, kRpcWarmupBound, stop);
      if (stop.load()) return;
      if (calls.ok()) {
        LogLine(LogLevel::kInfo, "rpc_warmup",
                absl::StrCat("address=", LogQuote(target), " calls=", *calls,
                             " seconds=", absl::ToDoubleSeconds(absl::Now() - t0)));
      } else {
        LogLine(LogLevel::kWarning, "rpc_warmup_failed",
                absl::StrCat("address=", LogQuote(target),
                             " code=", absl::StatusCodeToString(calls.status().code()),
                             " error=", LogQuote(calls.status().message())));
      }
    }
    health->SetServingStatus(kServiceName, true);
    health->SetServingStatus(true);
    LogLine(LogLevel::kInfo, "serving",
            absl::StrCat("seconds_since_start=", absl::ToDoubleSeconds(absl::Now() - start)));
  });

  // Housekeeping while serving: idle IPC mappings expire even without traffic, and once
  // requests stop for a while the heap is trimmed back to its idle size.
  std::mutex janitor_mu;
  std::condition_variable janitor_cv;
  std::thread janitor([&] {
    uint64_t trimmed_at = 0;
    std::unique_lock<std::mutex> lock(janitor_mu);
    while (!stop.load()) {
      janitor_cv.wait_for(lock, std::chrono::seconds(1));
      if (stop.load()) break;
      ipc.ExpireIdle();
      const uint64_t admitted = admission.admitted();
      if (admitted != trimmed_at && admission.IdleFor(absl::Seconds(2))) {
        (*devices)->pinned().Trim();
        const int released = malloc_trim(0);
        trimmed_at = admitted;
        LogLine(LogLevel::kInfo, "idle_trim", absl::StrCat("heap_released=", released != 0));
      }
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  {
    std::lock_guard<std::mutex> lock(janitor_mu);
    stop.store(true);
  }
  janitor_cv.notify_all();
  janitor.join();
  warm.join();
  admission.StartDraining();
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus(false);
  LogLine(LogLevel::kInfo, "draining",
          absl::StrCat("signal=", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                       " in_flight=", admission.in_flight(),
                       " drain_timeout_seconds=", absl::ToDoubleSeconds(options.drain_timeout)));
  const absl::Time drain_deadline = absl::Now() + options.drain_timeout;
  const bool drained = admission.WaitIdle(drain_deadline);
  if (!drained) {
    LogLine(LogLevel::kWarning, "drain_timeout",
            absl::StrCat("cancelling=", admission.in_flight()));
  }
  // A handler that returned has not necessarily sent its final status yet: give gRPC a
  // second to deliver those (it takes microseconds), then cancel whatever remains.
  server->Shutdown(absl::ToChronoTime(drained ? absl::Now() + absl::Seconds(1) : absl::Now()));
  server->Wait();
  ipc.CloseAll();
  for (const std::string& addr : options.listen) {
    if (absl::StartsWith(addr, "unix://")) RemoveStaleSocket(addr.substr(7));
  }
  LogLine(LogLevel::kInfo, "stopped", absl::StrCat("drained=", drained ? "true" : "false"));
  // Deliberately not destroyed: the stopped grpc::Server's destructor waits (about 10 s)
  // for peers to close their idle connections, and stopping the metrics HTTP server waits
  // for its 2 s poll. Neither holds anything that outlives the process, which exits next.
  (void)server.release();
  (void)metrics->release();
  return warm_failed.load() ? 1 : 0;
}

}  // namespace wprep::server
