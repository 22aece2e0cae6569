#include "wprep/server/options.h"

#include <sys/stat.h>

#include <functional>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "net/listener.h"

namespace wprep::server {
namespace {

absl::Status BadValue(const std::string& flag, const std::string& value, const char* want) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", value, " is not valid: expected ", want));
}

absl::Status ParseInt(const std::string& flag, const std::string& v, int64_t lo, int64_t hi,
                      int64_t* out) {
  int64_t x = 0;
  if (!absl::SimpleAtoi(v, &x) || x < lo || x > hi) {
    return BadValue(flag, v, absl::StrCat("an integer in [", lo, ", ", hi, "]").c_str());
  }
  *out = x;
  return absl::OkStatus();
}

// Sizes accept a K/M/G/T suffix (binary units): "512M", "80G".
absl::Status ParseBytes(const std::string& flag, const std::string& v, uint64_t* out) {
  std::string digits = v;
  uint64_t mult = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': mult = 1ull << 10; break;
      case 'M': case 'm': mult = 1ull << 20; break;
      case 'G': case 'g': mult = 1ull << 30; break;
      case 'T': case 't': mult = 1ull << 40; break;
      default: break;
    }
    if (mult != 1) digits.pop_back();
  }
  uint64_t x = 0;
  if (!absl::SimpleAtoi(digits, &x) || x > (~0ull) / mult) {
    return BadValue(flag, v, "a byte count such as 1073741824, 512M or 80G");
  }
  *out = x * mult;
  return absl::OkStatus();
}

absl::Status ParseDuration(const std::string& flag, const std::string& v, absl::Duration* out) {
  absl::Duration d;
  if (!absl::ParseDuration(v, &d) || d < absl::ZeroDuration()) {
    return BadValue(flag, v, "a non-negative duration such as 30s or 500ms");
  }
  *out = d;
  return absl::OkStatus();
}

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

}  // namespace

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  Options o;
  bool listen_seen = false, devices_seen = false;
  using Setter = std::function<absl::Status(const std::string&)>;
  const std::map<std::string, Setter> setters = {
      {"listen", [&](const std::string& v) {
         if (!listen_seen) o.listen.clear();
         listen_seen = true;
         o.listen.push_back(v);
         return absl::OkStatus();
       }},
      {"metrics-address", [&](const std::string& v) { o.metrics_address = v; return absl::OkStatus(); }},
      {"health-listen", [&](const std::string& v) { o.health_listen = v; return absl::OkStatus(); }},
      {"tls-cert", [&](const std::string& v) { o.tls_cert_file = v; return absl::OkStatus(); }},
      {"tls-key", [&](const std::string& v) { o.tls_key_file = v; return absl::OkStatus(); }},
      {"tls-client-ca", [&](const std::string& v) { o.tls_client_ca_file = v; return absl::OkStatus(); }},
      {"max-tensor-bytes", [&](const std::string& v) { return ParseBytes("max-tensor-bytes", v, &o.max_tensor_bytes); }},
      {"max-stream-matrix-bytes", [&](const std::string& v) {
         return ParseBytes("max-stream-matrix-bytes", v, &o.max_stream_matrix_bytes);
       }},
      {"max-buffered-bytes", [&](const std::string& v) { return ParseBytes("max-buffered-bytes", v, &o.max_buffered_bytes); }},
      {"max-queue-wait", [&](const std::string& v) { return ParseDuration("max-queue-wait", v, &o.max_queue_wait); }},
      {"max-queued-requests", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("max-queued-requests", v, 1, 1 << 20, &x);
         o.max_queued_requests = static_cast<int>(x);
         return s;
       }},
      {"max-batch-items", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("max-batch-items", v, 1, 1 << 20, &x);
         o.max_batch_items = static_cast<uint64_t>(x);
         return s;
       }},
      {"max-connections", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("max-connections", v, 1, 1 << 20, &x);
         o.max_connections = static_cast<int>(x);
         return s;
       }},
      {"max-concurrent-streams", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("max-concurrent-streams", v, 1, 1 << 16, &x);
         o.max_concurrent_streams = static_cast<int>(x);
         return s;
       }},
      {"max-watch-streams", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("max-watch-streams", v, 1, 1 << 20, &x);
         o.max_watch_streams = static_cast<int>(x);
         return s;
       }},
      {"devices", [&](const std::string& v) {
         if (!devices_seen) o.devices.clear();
         devices_seen = true;
         for (absl::string_view d : absl::StrSplit(v, ',', absl::SkipEmpty())) {
           o.devices.emplace_back(d);
         }
         return absl::OkStatus();
       }},
      {"streams-per-device", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("streams-per-device", v, 1, 64, &x);
         o.streams_per_device = static_cast<int>(x);
         return s;
       }},
      {"cpu-threads", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("cpu-threads", v, 0, 1024, &x);
         o.cpu_threads = static_cast<int>(x);
         return s;
       }},
      {"max-device-bytes", [&](const std::string& v) { return ParseBytes("max-device-bytes", v, &o.max_device_bytes); }},
      {"memory-wait", [&](const std::string& v) { return ParseDuration("memory-wait", v, &o.memory_wait); }},
      {"ready-timeout", [&](const std::string& v) { return ParseDuration("ready-timeout", v, &o.ready_timeout); }},
      {"drain-timeout", [&](const std::string& v) { return ParseDuration("drain-timeout", v, &o.drain_timeout); }},
      {"keep-cpus-awake", [&](const std::string& v) { return ParseDuration("keep-cpus-awake", v, &o.keep_cpus_awake); }},
      {"tls-handshake-timeout",
       [&](const std::string& v) { return ParseDuration("tls-handshake-timeout", v, &o.tls_handshake_timeout); }},
      {"max-message-bytes", [&](const std::string& v) {
         uint64_t x;
         auto s = ParseBytes("max-message-bytes", v, &x);
         if (s.ok() && (x < (1u << 10) || x > (2047ull << 20))) {
           return BadValue("max-message-bytes", v, "a size between 1K and 2047M");
         }
         o.max_message_bytes = static_cast<int64_t>(x);
         return s;
       }},
      {"ipc-cache-entries", [&](const std::string& v) {
         int64_t x;
         auto s = ParseInt("ipc-cache-entries", v, 1, 1 << 20, &x);
         o.ipc_cache_entries = static_cast<int>(x);
         return s;
       }},
      {"ipc-idle-expiry", [&](const std::string& v) { return ParseDuration("ipc-idle-expiry", v, &o.ipc_idle_expiry); }},
      {"port-file", [&](const std::string& v) { o.port_file = v; return absl::OkStatus(); }},
      {"weights-root", [&](const std::string& v) { o.weights_root = v; return absl::OkStatus(); }},
      {"weights-budget", [&](const std::string& v) { return ParseBytes("weights-budget", v, &o.weights_budget); }},
      {"weights-shm-dir", [&](const std::string& v) { o.weights_shm_dir = v; return absl::OkStatus(); }},
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!absl::StartsWith(a, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "' (see --help)"));
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    } else {
      auto it = setters.find(name);
      if (it == setters.end()) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
      }
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
      value = args[++i];
    }
    auto it = setters.find(name);
    if (it == setters.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (absl::Status s = it->second(value); !s.ok()) return s;
  }
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

std::string Usage() {
  return R"(wprepd: the wprep weight conversion daemon (gRPC service wprep.v1.WeightPrep)

Flags (--name=value or --name value):
  --listen ADDR            unix:///path or HOST:PORT; repeatable (default:
                           unix:///tmp/wprepd.sock). The socket file is mode 0660:
                           its group may convert. Loopback TCP admits every local
                           user; other TCP addresses need --tls-cert and --tls-key
  --health-listen H:P      plaintext listener serving only grpc.health.v1, for
                           Kubernetes gRPC probes on the pod IP (default: none)
  --metrics-address H:P    Prometheus /metrics address (default 127.0.0.1:9464; "" = off)
  --tls-cert PEM --tls-key PEM
                           TLS on every TCP --listen (the Unix socket stays plain)
  --tls-client-ca PEM      mutual TLS: clients must present a certificate of this CA
  --tls-handshake-timeout D
                           a TLS connection that has not completed its handshake
                           by then is closed (default 10s)
  --devices LIST           GPUs by ordinal or UUID, comma separated (default: all);
                           "cpu" = use no GPU, the CPU engine serves every request
  --streams-per-device N   CUDA streams (= concurrent requests) per GPU (default 4)
  --cpu-threads N          CPU engine threads per request, 0 = one per core (default 0)
  --max-device-bytes N     device bytes budget per GPU, e.g. 8G; 0 = unlimited (default 0)
  --memory-wait D          how long work waits for device memory (default 10s)
  --ready-timeout D        how long a batch waits on the GPU for its client's ready word
                           in /dev/shm before the daemon writes it (default 5m); a
                           ConvertBatches client that goes away has its words written at once
  --drain-timeout D        time for in-flight work after SIGTERM (default 30s)
  --keep-cpus-awake D      while requests come, an idle-priority spinner per CPU keeps
                           the CPUs from halting until D after the last one: faster
                           round trips on VMs, at the cost of busy cores (default 0 = off)
  --max-message-bytes N    largest unary message (default 64M)
  --max-tensor-bytes N     largest input or output of one conversion (default 64G)
  --max-stream-matrix-bytes N
                           largest matrix of a ConvertStream (default 128M; a stream
                           holds about 7 of them in --max-buffered-bytes)
  --max-buffered-bytes N   host memory for inline data and stream buffers (default 1G)
  --max-queue-wait D       how long a request waits, in FIFO order, for --max-buffered-bytes
                           to have room before RESOURCE_EXHAUSTED; its deadline may end
                           the wait sooner (default 10s, as --memory-wait; 0 = refuse
                           at once)
  --max-queued-requests N  requests waiting for host memory at once; more are refused
                           RESOURCE_EXHAUSTED (default 1024)
  --max-batch-items N      items of one ConvertBatch (default 4096)
  --max-connections N      open connections, all listeners together (default 1024;
                           TLS connections are also held to N by themselves)
  --max-concurrent-streams N
                           concurrent calls per connection (default 64; on
                           --health-listen: --max-watch-streams)
  --max-watch-streams N    open health Watch calls, all listeners together; more
                           get RESOURCE_EXHAUSTED (default 16384)
  --ipc-cache-entries N    cached CUDA IPC mappings; also the most handles one
                           request may use at once (default 4096)
  --ipc-idle-expiry D      unused IPC mappings close after this (default 5m)
  --port-file PATH         write the bound addresses here once listening
  --weights-root DIR       the directory LoadWeights may read checkpoints from (paths
                           outside it, '..' and symlinks out are refused); default
                           none: loading weight sets from files is off
  --weights-budget N       bytes all resident weight sets may hold together, e.g.
                           40G; a load that would pass it is refused (default 0 =
                           unlimited)
  --weights-shm-dir DIR    where each weight set's shared-memory file goes; attaching
                           clients open it there (default /dev/shm)
)";
}

}  // namespace wprep::server
