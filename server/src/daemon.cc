#include "wprep/server/daemon.h"

#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <exception>
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
#include "exec/admission.h"
#include "device/device_manager.h"
#include "grpcpp/server_posix.h"
#include "rpc/health.h"
#include "rpc/reflection_v1.h"
#include "net/idle_spinners.h"
#include "rpc/host_budget.h"
#include "rpc/open_calls.h"
#include "net/handle_socket.h"
#include "net/listener.h"
#include "device/device_runtime.h"
#include "exec/executor.h"
#include "exec/kernel_warmup.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "device/ipc_cache.h"
#include "device/ipc_owner.h"
#include "net/log.h"
#include "net/metrics.h"
#include "rpc/rpc_warmup.h"
#include "rpc/service.h"
#include "rpc/weights_service.h"
#include "rpc/stream_pipeline.h"
#include "net/peer_credentials.h"
#include "net/tls_terminator.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {
namespace {

// Streams slice their input into pieces of this many bytes (whole matrices, at least one).
constexpr uint64_t kStreamSliceBytes = 4ull << 20;
// Bound on the self warm-up of one listener (milliseconds when healthy), so a stuck call
// cannot hold SERVING back for long.
constexpr absl::Duration kRpcWarmupBound = absl::Seconds(5);
// Housekeeping period, and the quiet time after which the heap is trimmed.
constexpr absl::Duration kJanitorPeriod = absl::Seconds(1);
// How long a drained daemon waits for the last calls' statuses to go out: handlers that
// returned send theirs in microseconds; a stream still open after this is cancelled.
constexpr absl::Duration kStatusGrace = absl::Seconds(1);
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

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream f(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.good() && !f.eof()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is empty or unreadable"));
  return text;
}

// TLS for the TCP listeners (tls_terminator.h), or nullptr when the options ask for none.
absl::StatusOr<std::unique_ptr<TlsTerminator>> MakeTlsTerminator(const Options& o) {
  if (o.tls_cert_file.empty()) return std::unique_ptr<TlsTerminator>();
  TlsConfig config;
  WPREP_ASSIGN_OR_RETURN(config.cert_pem, ReadPem(o.tls_cert_file, "tls-cert"));
  WPREP_ASSIGN_OR_RETURN(config.key_pem, ReadPem(o.tls_key_file, "tls-key"));
  if (!o.tls_client_ca_file.empty()) {
    WPREP_ASSIGN_OR_RETURN(config.client_ca_pem, ReadPem(o.tls_client_ca_file, "tls-client-ca"));
  }
  config.max_connections = o.max_connections;
  config.handshake_timeout = o.tls_handshake_timeout;
  return TlsTerminator::Create(config);
}

// Arguments every server of the daemon's shares; `max_streams` per connection.
void CommonArguments(int max_streams, grpc::ServerBuilder& b) {
  // Compressed requests are refused (UNIMPLEMENTED) before any byte is inflated: gRPC
  // checks the size limit only after decompressing, so a 1 MiB gzip body could cost a
  // GiB. Tensors do not compress anyway.
  b.AddChannelArgument(GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET, 1 << GRPC_COMPRESS_NONE);
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_streams);
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

// The weight store's reports, into the daemon's metrics.
WeightStoreObserver WeightMetrics(Metrics* m) {
  WeightStoreObserver o;
  o.set_resident = [m](const std::string& set, uint64_t bytes) { m->SetWeightSetBytes(set, bytes); };
  o.attachments = [m](int64_t delta) { m->weight_attachments().Increment(static_cast<double>(delta)); };
  o.loaded = [m](double seconds) { m->weight_load_seconds().Observe(seconds); };
  o.load_failed = [m] { m->weight_loads_failed().Increment(); };
  return o;
}

}  // namespace

// Everything the phases share. Declared in the order of construction; destroyed in
// reverse, so each part outlives those that borrow it.
struct DaemonParts {
  Options options;
  DaemonHooks hooks;
  DeviceRuntime* runtime = nullptr;
  absl::Time start;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<HostBudget> buffers;
  // What a drain waits for; they outlive the servers, the accept loops and the TLS relays
  // that report to them.
  HandedConnections connections;  // the connections of both servers, plain and TLS
  OpenCalls open_calls;            // both servers' calls, until their status went out
  std::vector<std::unique_ptr<ListeningSocket>> sockets;  // API listeners, plaintext then TLS
  size_t plain_sockets = 0;                                // how many of them are plaintext
  std::unique_ptr<TlsTerminator> tls;                      // for the TLS ones
  std::unique_ptr<ListeningSocket> health_socket;
  std::unique_ptr<ConnectionAcceptor> acceptor;
  // Outlives the executor: work answered before it finished holds a ticket until done.
  Admission admission;
  std::unique_ptr<DeviceManager> devices;
  std::unique_ptr<IpcCache> ipc;
  std::unique_ptr<Executor> executor;
  std::string warmup_token;
  std::unique_ptr<IdleSpinners> spinners;  // outlives the service and the servers
  std::unique_ptr<WeightPrepService> service;
  std::unique_ptr<WeightStore> weights;
  std::unique_ptr<WeightSetsService> weights_service;
  std::vector<PreloadSet> preload;  // --preload's sets, loaded by preload_thread once serving
  std::thread preload_thread;
  std::unique_ptr<WatchSlots> watch_slots;      // both health services' Watch bound
  std::unique_ptr<HealthService> health;        // on the API listeners
  std::unique_ptr<HealthService> probe_health;  // on --health-listen
  std::unique_ptr<ReflectionV1Service> reflection_v1;  // v1alpha comes from libgrpc++_reflection
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::Server> health_server;
  std::unique_ptr<AcceptLoop> accept_loop;
  std::unique_ptr<AcceptLoop> health_accept_loop;
  // Where clients fetch the descriptors of weight sets in CUDA virtual memory: one Unix
  // socket "<path>.handles" next to each Unix API socket (handle_socket.h), when GPUs are
  // served.
  std::vector<std::unique_ptr<ListeningSocket>> handle_sockets;
  std::unique_ptr<AcceptLoop> handle_accept_loop;
  std::vector<std::string> warmup_targets;
  uint64_t refused_reported = 0;  // Serve's thread only

  absl::Mutex mu;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> stop_flag{false};  // the same, for the RPC warm-up's checks

  void SetHealth(bool serving) {
    health->SetServing(serving);
    probe_health->SetServing(serving);
    metrics->health_serving().Set(serving ? 1 : 0);
  }
  bool Stopping() {
    absl::MutexLock lock(&mu);
    return stop;
  }
};

Daemon::Daemon(std::unique_ptr<DaemonParts> parts) : parts_(std::move(parts)) {}
Daemon::~Daemon() {
  if (parts_ != nullptr && parts_->preload_thread.joinable()) {
    RequestStop();
    parts_->preload_thread.join();
  }
}

namespace {

// --preload's sets, one after another (a load stops between tensors once the daemon stops).
void Preload(DaemonParts* p) {
  for (const PreloadSet& set : p->preload) {
    if (p->Stopping()) return;
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<const WeightManifestData>> m =
        p->weights->Load(set.name, set.path, set.rules, [p](const WeightLoadProgress&) { return !p->Stopping(); },
                         set.place);
    if (m.ok()) {
      LogLine(LogLevel::kInfo, "weights_preloaded",
              absl::StrCat("set=", LogQuote(set.name), " path=", LogQuote(set.path), " tensors=",
                           (*m)->tensors.size(), " bytes=", (*m)->total_bytes,
                           " seconds=", absl::ToDoubleSeconds(absl::Now() - t0)));
    } else {
      LogLine(LogLevel::kError, "weights_preload_failed",
              absl::StrCat("set=", LogQuote(set.name), " path=", LogQuote(set.path),
                           " code=", absl::StatusCodeToString(m.status().code()),
                           " error=", LogQuote(m.status().message())));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const Options& options, DeviceRuntime* runtime,
                                                      const DaemonHooks& hooks) {
  auto p = std::make_unique<DaemonParts>();
  p->options = options;
  p->hooks = hooks;
  p->runtime = runtime;
  p->start = absl::Now();
  // Addresses first: a daemon that cannot listen fails before it touches a GPU.
  WPREP_ASSIGN_OR_RETURN(p->metrics, Metrics::Create(options.metrics_address, runtime->compiled_in()));
  WPREP_ASSIGN_OR_RETURN(p->tls, MakeTlsTerminator(options));
  // With TLS configured, every TCP listener speaks TLS; Unix sockets stay plaintext.
  // Plaintext listeners first, then TLS ones: the accept loop tells them apart by index.
  for (bool tls_pass : {false, true}) {
    for (const std::string& addr : options.listen) {
      if (tls_pass != (p->tls != nullptr && !absl::StartsWith(addr, "unix://"))) continue;
      WPREP_ASSIGN_OR_RETURN(std::unique_ptr<ListeningSocket> sock, ListeningSocket::Bind(addr));
      p->sockets.push_back(std::move(sock));
    }
    if (!tls_pass) p->plain_sockets = p->sockets.size();
  }
  if (!options.health_listen.empty()) {
    WPREP_ASSIGN_OR_RETURN(p->health_socket, ListeningSocket::Bind(options.health_listen));
  }
  // A TLS connection holds three descriptors (tls_terminator.h); the terminator itself
  // holds TLS connections to --max-connections.
  const bool any_tls = p->sockets.size() > p->plain_sockets;
  p->acceptor = std::make_unique<ConnectionAcceptor>(
      ConnectionFdLimit(any_tls ? 3 * options.max_connections : options.max_connections));
  p->buffers = std::make_unique<HostBudget>(
      options.max_buffered_bytes, p->metrics.get(),
      BudgetQueue{options.max_queue_wait, static_cast<size_t>(options.max_queued_requests)});

  WPREP_ASSIGN_OR_RETURN(p->devices, DeviceManager::Create(options, runtime, p->metrics.get()));
  p->ipc = std::make_unique<IpcCache>(runtime, options.ipc_cache_entries, options.ipc_idle_expiry,
                                      p->metrics.get());
  p->executor = std::make_unique<Executor>(p->devices.get(), p->ipc.get(),
                                           StreamSlicing{kStreamSliceBytes, options.max_stream_matrix_bytes},
                                           options.memory_wait, options.ready_timeout);
  p->executor->CountReadyWordReleases(&p->metrics->ready_words_released_timeout(),
                                      &p->metrics->ready_words_released_client_gone());
  p->warmup_token = NewWarmupToken();
  p->spinners = IdleSpinners::Start(options.keep_cpus_awake);
  p->service = std::make_unique<WeightPrepService>(
      &p->admission, p->devices.get(), p->ipc.get(), p->executor.get(), p->metrics.get(), p->buffers.get(),
      RequestLimits{options.max_message_bytes, options.max_tensor_bytes, options.max_batch_items}, p->warmup_token,
      p->spinners.get());

  p->weights = std::make_unique<WeightStore>(options.weights_root, options.weights_budget, options.cpu_threads,
                                             options.weights_shm_dir, WeightMetrics(p->metrics.get()),
                                             p->devices.get());
  p->weights->RemoveStaleFiles();
  p->weights_service = std::make_unique<WeightSetsService>(p->weights.get());
  if (!options.preload.empty()) {
    WPREP_ASSIGN_OR_RETURN(p->preload, ReadWeightPreload(options.preload));
  }

  p->watch_slots = std::make_unique<WatchSlots>(options.max_watch_streams);
  p->health = std::make_unique<HealthService>(p->watch_slots.get());
  p->probe_health = std::make_unique<HealthService>(p->watch_slots.get());
  grpc::EnableDefaultHealthCheckService(false);  // health.h says why
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  CommonArguments(options.max_concurrent_streams, builder);
  // Streams carry 4 MiB chunks plus framing whatever --max-message-bytes says; unary
  // handlers enforce --max-message-bytes themselves.
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::max<int64_t>(options.max_message_bytes, kMaxChunkBytes + (64 << 10))));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes + (64 << 10)));
  builder.RegisterService(p->service.get());
  builder.RegisterService(p->weights_service.get());
  builder.RegisterService(p->health.get());
  p->reflection_v1 = std::make_unique<ReflectionV1Service>(std::vector<std::string>{
      "wprep.v1.WeightPrep", "wprep.v1.WeightSets", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
      "grpc.reflection.v1alpha.ServerReflection"});
  builder.RegisterService(p->reflection_v1.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(HostBudget::CallEndNotifier(p->buffers.get()));
  interceptors.push_back(p->open_calls.Counter());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  p->server = builder.BuildAndStart();
  if (p->server == nullptr) return absl::UnavailableError("could not start the gRPC server");
  p->SetHealth(false);
  std::vector<const ListeningSocket*> listeners;
  for (const auto& sock : p->sockets) listeners.push_back(sock.get());
  grpc::Server* server = p->server.get();
  p->accept_loop = std::make_unique<AcceptLoop>(
      listeners, p->acceptor.get(),
      [server, listeners, tls = p->tls.get(), plain = p->plain_sockets, connections = &p->connections](
          int fd, size_t socket) {
        if (socket < plain) {
          // A Unix client's credentials, for the VMM buffers it may send (peer_credentials.h).
          if (listeners[socket]->is_unix()) UnixPeers::Global().Record(fd);
          connections->Add(fd);
          grpc::AddInsecureChannelFromFd(server, fd);
        } else {
          tls->Serve(fd, [server, connections](int plain_fd) {
            connections->Add(plain_fd);
            grpc::AddInsecureChannelFromFd(server, plain_fd);
          });
        }
      });
  WPREP_RETURN_IF_ERROR(p->accept_loop->Start());
  if (p->health_socket != nullptr) {
    grpc::ServerBuilder hb;
    // Only health is served here, and a Watch holds no thread, so one prober's
    // connection may hold every Watch the daemon allows (--max-watch-streams bounds them
    // all); the API listeners keep --max-concurrent-streams, Watches included.
    CommonArguments(options.max_watch_streams, hb);
    hb.RegisterService(p->probe_health.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counted;
    counted.push_back(p->open_calls.Counter());  // a drain lets the Watches' ends go out too
    hb.experimental().SetInterceptorCreators(std::move(counted));
    p->health_server = hb.BuildAndStart();
    if (p->health_server == nullptr) return absl::UnavailableError("could not start the health server");
    grpc::Server* hs = p->health_server.get();
    p->health_accept_loop = std::make_unique<AcceptLoop>(std::vector<const ListeningSocket*>{p->health_socket.get()},
                                                         p->acceptor.get(),
                                                         [hs, connections = &p->connections](int fd, size_t) {
                                                           connections->Add(fd);
                                                           grpc::AddInsecureChannelFromFd(hs, fd);
                                                         });
    WPREP_RETURN_IF_ERROR(p->health_accept_loop->Start());
  }

  if (!p->devices->cpu_engine()) {
    for (size_t i = 0; i < p->plain_sockets; ++i) {
      if (!p->sockets[i]->is_unix()) continue;
      WPREP_ASSIGN_OR_RETURN(std::unique_ptr<ListeningSocket> hs,
                             ListeningSocket::Bind(absl::StrCat(p->sockets[i]->address(), kHandleSocketSuffix)));
      p->handle_sockets.push_back(std::move(hs));
    }
  }
  if (!p->handle_sockets.empty()) {
    std::vector<const ListeningSocket*> hl;
    for (const auto& sock : p->handle_sockets) hl.push_back(sock.get());
    // One connection at a time, each bounded by ServeHandleConnection's timeout: a slow
    // client delays other descriptor fetches, never the API.
    p->handle_accept_loop = std::make_unique<AcceptLoop>(hl, p->acceptor.get(), [w = p->weights.get()](int fd, size_t) {
      ServeHandleConnection(fd, [w](absl::string_view token, const PeerCredentials& peer) -> absl::StatusOr<HandedFd> {
        WPREP_ASSIGN_OR_RETURN(VmmExport e, w->TakeVmmHandle(std::string(token), peer.pid));
        return HandedFd{e.fd, e.bytes};
      });
    });
    WPREP_RETURN_IF_ERROR(p->handle_accept_loop->Start());
  }

  std::string port_text;
  for (size_t i = 0; i < p->sockets.size(); ++i) {
    const ListeningSocket& sock = *p->sockets[i];
    // The warm-up speaks plaintext; a TLS listener's path differs only in the relay.
    if (i < p->plain_sockets) p->warmup_targets.push_back(WarmupTarget(sock.address(), sock.port()));
    absl::StrAppend(&port_text, "grpc ", sock.bound_address(), "\n");
  }
  if (p->health_socket != nullptr) absl::StrAppend(&port_text, "health ", p->health_socket->bound_address(), "\n");
  if (p->metrics->port() != 0) {
    const std::string& m = options.metrics_address;
    absl::StrAppend(&port_text, "metrics ", m.substr(0, m.rfind(':')), ":", p->metrics->port(), "\n");
  }
  if (!options.port_file.empty()) WPREP_RETURN_IF_ERROR(WritePortFile(options.port_file, port_text));
  LogLine(LogLevel::kInfo, "listening",
          absl::StrCat("addresses=", LogQuote(port_text), " gpus=", p->devices->num_gpus(),
                       " tls=", p->tls != nullptr ? "true" : "false"));
  return std::unique_ptr<Daemon>(new Daemon(std::move(p)));
}

absl::Status Daemon::WarmUp() {
  DaemonParts& p = *parts_;
  const std::string& gate = p.hooks.warmup_gate_file;
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
  absl::Status kernels = p.devices->WarmUp(WarmUpKernels);
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
  if (!p.preload.empty() && !p.preload_thread.joinable()) p.preload_thread = std::thread(Preload, &p);
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
    const uint64_t refused = p.acceptor->refused() + (p.tls ? p.tls->refused() : 0);
    p.metrics->connections_refused().Increment(static_cast<double>(refused - p.refused_reported));
    p.refused_reported = refused;
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
  const absl::Time deadline = absl::Now() + p.options.drain_timeout;
  const bool drained = p.admission.WaitIdle(deadline);
  if (!drained) {
    LogLine(LogLevel::kWarning, "drain_timeout", absl::StrCat("cancelling=", p.admission.in_flight()));
  }
  // No new connections from here; the sockets close (and the Unix socket file goes).
  p.accept_loop->Stop();
  if (p.tls) p.tls->Stop();
  if (p.health_accept_loop) p.health_accept_loop->Stop();
  if (p.handle_accept_loop) p.handle_accept_loop->Stop();
  p.sockets.clear();
  p.health_socket.reset();
  p.handle_sockets.clear();
  p.health->Shutdown();
  p.probe_health->Shutdown();
  if (p.preload_thread.joinable()) {
    RequestStop();  // a load in progress stops after its current tensor
    p.preload_thread.join();
  }
  p.weights->Close();  // attachments hold their handlers until they end
  if (drained) {
    // gRPC closes each connection as soon as it has said goodbye (HandedConnections), so
    // first let the handlers that returned send their statuses, and the clients read
    // them, within the drain time.
    const absl::Time t0 = absl::Now();
    const int open = p.open_calls.WaitNone(std::min(deadline, t0 + kStatusGrace));
    const int unread = p.connections.WaitForClientsToRead(deadline);
    LogLine(open == 0 && unread == 0 ? LogLevel::kInfo : LogLevel::kWarning, "answers_delivered",
            absl::StrCat("seconds=", absl::ToDoubleSeconds(absl::Now() - t0), " calls_open=", open,
                         " connections_unread=", unread));
  }
  // Every answer is out (or the drain time is): calls still open, such as a reflection
  // stream, are cancelled, and connections close without waiting for their clients.
  const auto now = absl::ToChronoTime(absl::Now());
  p.server->Shutdown(now);
  if (p.health_server) p.health_server->Shutdown(now);
  p.server->Wait();
  if (p.tls) {
    // gRPC has closed its ends of the TLS relays: each sends what it still holds, then ends.
    const int relays = p.tls->WaitForRelays(drained ? deadline : absl::Now());
    if (relays > 0) LogLine(LogLevel::kWarning, "tls_relays_cut", absl::StrCat("relays=", relays));
  }
  p.ipc->CloseAll();
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

int RunDaemon(const Options& options, const DaemonHooks& hooks) {
  // No request path may reach std::terminate; should one ever, it leaves a trace.
  std::set_terminate([] {
    std::string what = "no exception";
    if (std::exception_ptr e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      } catch (...) {
        what = "an unknown exception";
      }
    }
    LogLine(LogLevel::kError, "terminate", absl::StrCat("what=", LogQuote(what)));
    std::abort();
  });
  TuneHeap();
  sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread created below
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(options, &CudaRuntime(), hooks);
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

absl::Status TakeDaemonHooks(std::vector<std::string>& args, DaemonHooks* hooks) {
  constexpr absl::string_view kGate = "--testing-warmup-gate";
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (absl::StartsWith(a, absl::StrCat(kGate, "="))) {
      hooks->warmup_gate_file = a.substr(kGate.size() + 1);
    } else if (a == kGate) {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("flag ", kGate, " needs a value"));
      hooks->warmup_gate_file = args[++i];
    } else {
      rest.push_back(a);
    }
  }
  args = std::move(rest);
  return absl::OkStatus();
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
  std::vector<std::string> flags = args;
  DaemonHooks hooks;
  const absl::Status hooked = TakeDaemonHooks(flags, &hooks);
  absl::StatusOr<Options> options = hooked.ok() ? ParseOptions(flags) : absl::StatusOr<Options>(hooked);
  if (!options.ok()) {
    std::fprintf(stderr, "wprepd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  return RunDaemon(*options, hooks);
}

}  // namespace wprep::server
