#include "wprep/server/options.h"

#include <sys/stat.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "net/listener.h"
#include "wprep/flags/flags.h"

namespace wprep::server {
namespace {

absl::Status ValidateAddress(const std::string& addr) {
  if (absl::StartsWith(addr, "unix://")) {
    if (addr.size() <= 7) return absl::InvalidArgumentError("--listen unix:// needs a path");
    return absl::OkStatus();
  }
  const size_t colon = addr.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", addr, "' is not valid: expected unix:///path or HOST:PORT "
        "(e.g. 127.0.0.1:50051)"));
  }
  return absl::OkStatus();
}

constexpr char kHeader[] =
    "wprepd: the wprep weight conversion daemon (gRPC service wprep.v1.WeightPrep)\n"
    "usage: wprepd [flags]\n";

constexpr char kFooter[] =
    "Sizes take K, M, G, T suffixes (powers of 1024: 8G); durations are absl durations\n"
    "(50ms, 10s, 5m).\n";

// Every flag of wprepd, declared once: the parser and --help both come from here. The
// defaults are Options' own, so the struct stays the one place they are written.
flags::FlagSet DaemonFlags() {
  const Options d;
  flags::FlagSet fs("wprepd", kHeader);
  fs.String("listen", "ADDR", d.listen.front(),
            "unix:///path or HOST:PORT; repeatable. The socket file is mode 0660: its group may "
            "convert. Loopback TCP admits every local user; other TCP addresses need --tls-cert "
            "and --tls-key")
      .Repeatable();
  fs.String("health-listen", "H:P", d.health_listen,
            "plaintext listener serving only grpc.health.v1, for Kubernetes gRPC probes on the "
            "pod IP; none when not given");
  fs.String("metrics-address", "H:P", d.metrics_address,
            "Prometheus /metrics address; \"\" turns it off");
  fs.String("tls-cert", "PEM", d.tls_cert_file,
            "server certificate chain: TLS on every TCP --listen (the Unix socket stays plain); "
            "needs --tls-key");
  fs.String("tls-key", "PEM", d.tls_key_file, "the private key of --tls-cert");
  fs.String("tls-client-ca", "PEM", d.tls_client_ca_file,
            "mutual TLS: clients must present a certificate of this CA");
  fs.Duration("tls-handshake-timeout", "D", d.tls_handshake_timeout,
              "a TLS connection that has not completed its handshake by then is closed");
  fs.List("devices", "LIST", d.devices,
          "GPUs by ordinal or UUID, comma separated; \"cpu\" = use no GPU, the CPU engine serves "
          "every request; repeatable; all GPUs when not given")
      .Repeatable();
  fs.Int("streams-per-device", "N", d.streams_per_device,
         "CUDA streams (= concurrent requests) per GPU", 1, 64);
  fs.Int("cpu-threads", "N", d.cpu_threads, "CPU engine threads per request, 0 = one per core", 0,
         1024);
  fs.Bytes("max-device-bytes", "N", d.max_device_bytes,
           "device bytes budget per GPU, e.g. 8G; 0 = unlimited");
  fs.Duration("memory-wait", "D", d.memory_wait, "how long work waits for device memory");
  fs.Duration("ready-timeout", "D", d.ready_timeout,
              "how long a batch waits on the GPU for its client's ready word in /dev/shm before "
              "the daemon writes it; a ConvertBatches client that goes away has its words "
              "written at once");
  fs.Duration("drain-timeout", "D", d.drain_timeout, "time for in-flight work after SIGTERM");
  fs.Duration("keep-cpus-awake", "D", d.keep_cpus_awake,
              "while requests come, an idle-priority spinner per CPU keeps the CPUs from halting "
              "until D after the last one: faster round trips on VMs, at the cost of busy cores; "
              "0 = off");
  fs.Bytes("max-message-bytes", "N", static_cast<uint64_t>(d.max_message_bytes),
           "largest unary message", 1u << 10, 2047ull << 20);
  fs.Bytes("max-tensor-bytes", "N", d.max_tensor_bytes,
           "largest input or output of one conversion");
  fs.Bytes("max-stream-matrix-bytes", "N", d.max_stream_matrix_bytes,
           "largest matrix of a ConvertStream; a stream holds about 7 of them in "
           "--max-buffered-bytes");
  fs.Bytes("max-buffered-bytes", "N", d.max_buffered_bytes,
           "host memory for inline data and stream buffers");
  fs.Duration("max-queue-wait", "D", d.max_queue_wait,
              "how long a request waits, in FIFO order, for --max-buffered-bytes to have room "
              "before RESOURCE_EXHAUSTED; its deadline may end the wait sooner; 0 = refuse at "
              "once");
  fs.Int("max-queued-requests", "N", d.max_queued_requests,
         "requests waiting for host memory at once; more are refused RESOURCE_EXHAUSTED", 1,
         1 << 20);
  fs.Int("max-batch-items", "N", static_cast<int64_t>(d.max_batch_items),
         "items of one ConvertBatch", 1, 1 << 20);
  fs.Int("max-connections", "N", d.max_connections,
         "open connections, all listeners together; TLS connections are also held to N by "
         "themselves",
         1, 1 << 20);
  fs.Int("max-concurrent-streams", "N", d.max_concurrent_streams,
         "concurrent calls per connection (on --health-listen: --max-watch-streams)", 1, 1 << 16);
  fs.Int("max-watch-streams", "N", d.max_watch_streams,
         "open health Watch calls, all listeners together; more get RESOURCE_EXHAUSTED", 1,
         1 << 20);
  fs.Int("ipc-cache-entries", "N", d.ipc_cache_entries,
         "cached CUDA IPC mappings; also the most handles one request may use at once", 1,
         1 << 20);
  fs.Duration("ipc-idle-expiry", "D", d.ipc_idle_expiry,
              "unused IPC mappings close after this");
  fs.String("port-file", "PATH", d.port_file, "write the bound addresses here once listening");
  fs.String("weights-root", "DIR", d.weights_root,
            "the directory LoadWeights may read checkpoints from (paths outside it, '..' and "
            "symlinks out are refused); when not given, loading weight sets from files is off");
  fs.Bytes("weights-budget", "N", d.weights_budget,
           "bytes the resident weight sets may hold on each GPU, and in host memory, e.g. 40G; a "
           "load that would pass it is refused; 0 = unlimited");
  fs.String("weights-shm-dir", "DIR", d.weights_shm_dir,
            "where each host-memory weight set's shared-memory file goes; attaching clients open it "
            "there");
  fs.String("preload", "FILE", d.preload,
            "weight sets to load, one after another, once the daemon serves: a text-format "
            "wprep.v1.WeightPreload (LoadWeightsRequest entries); a malformed file stops the start, "
            "a set that fails to load is logged and counted");
  fs.Footer(kFooter);
  // Launchers (the tests' harnesses, a container's CMD plus its args) append overrides to a
  // base command line, so a later value replaces an earlier one.
  fs.LastWins();
  return fs;
}

}  // namespace

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  flags::FlagSet fs = DaemonFlags();
  if (absl::Status s = fs.Parse(args); !s.ok()) return s;
  Options o;
  o.listen = fs.GetList("listen");
  o.health_listen = fs.GetString("health-listen");
  o.metrics_address = fs.GetString("metrics-address");
  o.tls_cert_file = fs.GetString("tls-cert");
  o.tls_key_file = fs.GetString("tls-key");
  o.tls_client_ca_file = fs.GetString("tls-client-ca");
  o.tls_handshake_timeout = fs.GetDuration("tls-handshake-timeout");
  o.devices = fs.GetList("devices");
  o.streams_per_device = static_cast<int>(fs.GetInt("streams-per-device"));
  o.cpu_threads = static_cast<int>(fs.GetInt("cpu-threads"));
  o.max_device_bytes = fs.GetBytes("max-device-bytes");
  o.memory_wait = fs.GetDuration("memory-wait");
  o.ready_timeout = fs.GetDuration("ready-timeout");
  o.drain_timeout = fs.GetDuration("drain-timeout");
  o.keep_cpus_awake = fs.GetDuration("keep-cpus-awake");
  o.max_message_bytes = static_cast<int64_t>(fs.GetBytes("max-message-bytes"));
  o.max_tensor_bytes = fs.GetBytes("max-tensor-bytes");
  o.max_stream_matrix_bytes = fs.GetBytes("max-stream-matrix-bytes");
  o.max_buffered_bytes = fs.GetBytes("max-buffered-bytes");
  o.max_queue_wait = fs.GetDuration("max-queue-wait");
  o.max_queued_requests = static_cast<int>(fs.GetInt("max-queued-requests"));
  o.max_batch_items = static_cast<uint64_t>(fs.GetInt("max-batch-items"));
  o.max_connections = static_cast<int>(fs.GetInt("max-connections"));
  o.max_concurrent_streams = static_cast<int>(fs.GetInt("max-concurrent-streams"));
  o.max_watch_streams = static_cast<int>(fs.GetInt("max-watch-streams"));
  o.ipc_cache_entries = static_cast<int>(fs.GetInt("ipc-cache-entries"));
  o.ipc_idle_expiry = fs.GetDuration("ipc-idle-expiry");
  o.port_file = fs.GetString("port-file");
  o.weights_root = fs.GetString("weights-root");
  o.weights_budget = fs.GetBytes("weights-budget");
  o.weights_shm_dir = fs.GetString("weights-shm-dir");
  o.preload = fs.GetString("preload");
  if (absl::Status s = ValidateOptions(o); !s.ok()) return s;
  return o;
}

absl::Status ValidateOptions(const Options& o) {
  if (o.listen.empty()) return absl::InvalidArgumentError("at least one --listen address is needed");
  if (struct stat st {}; !o.weights_root.empty() && (stat(o.weights_root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    return absl::InvalidArgumentError(absl::StrCat("--weights-root ", o.weights_root, ": not a directory"));
  }
  // Only a daemon that can load sets needs the directory.
  if (struct stat st {}; !o.weights_root.empty() && (stat(o.weights_shm_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    return absl::InvalidArgumentError(absl::StrCat("--weights-shm-dir ", o.weights_shm_dir, ": not a directory"));
  }
  for (const std::string& a : o.listen) {
    if (absl::Status s = ValidateAddress(a); !s.ok()) return s;
  }
  if (!o.metrics_address.empty()) {
    if (absl::Status s = ValidateAddress(o.metrics_address); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-address: ", s.message()));
    }
    if (absl::StartsWith(o.metrics_address, "unix://")) {
      return absl::InvalidArgumentError("--metrics-address must be HOST:PORT");
    }
  }
  const bool tls = !o.tls_cert_file.empty() || !o.tls_key_file.empty();
  if (tls && (o.tls_cert_file.empty() || o.tls_key_file.empty())) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  if (!o.tls_client_ca_file.empty() && !tls) {
    return absl::InvalidArgumentError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key");
  }
  for (const std::string& a : o.listen) {
    if (!absl::StartsWith(a, "unix://") && !IsLoopbackAddress(a) && !tls) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen ", a, " would open the conversion API beyond this host without TLS; give "
          "--tls-cert and --tls-key, or listen on a Unix socket or loopback (probes: --health-listen)"));
    }
  }
  if (!o.health_listen.empty()) {
    if (absl::Status s = ValidateAddress(o.health_listen); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--health-listen: ", s.message()));
    }
    if (absl::StartsWith(o.health_listen, "unix://")) {
      return absl::InvalidArgumentError("--health-listen must be HOST:PORT (Kubernetes probes use TCP)");
    }
  }
  if (o.max_stream_matrix_bytes < (4u << 20)) {
    return absl::InvalidArgumentError("--max-stream-matrix-bytes must be at least 4M");
  }
  if (o.max_buffered_bytes < static_cast<uint64_t>(o.max_message_bytes)) {
    return absl::InvalidArgumentError("--max-buffered-bytes must be at least --max-message-bytes");
  }
  if (o.streams_per_device < 1) return absl::InvalidArgumentError("--streams-per-device must be >= 1");
  if (o.max_message_bytes < 1024) return absl::InvalidArgumentError("--max-message-bytes must be >= 1K");
  return absl::OkStatus();
}

std::string Usage() { return DaemonFlags().Usage(); }

}  // namespace wprep::server
