// Typed configuration of wprepd: one struct with defaults, filled from flags and validated
// once at start-up.
#ifndef WPREP_SERVER_OPTIONS_H_
#define WPREP_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wprep::server {

struct Options {
  // gRPC listening addresses: "unix:///path" or "HOST:PORT" (port 0 picks a free port).
  // The default is the Unix socket alone: its file mode decides who may convert. TCP is
  // opt-in; loopback TCP admits every local user, and a TCP address beyond loopback
  // needs TLS (tls_cert_file and tls_key_file).
  std::vector<std::string> listen = {"unix:///tmp/wprepd.sock"};
  // A plaintext gRPC listener serving grpc.health.v1 and nothing else (for Kubernetes'
  // gRPC probes on the pod IP); empty = none.
  std::string health_listen;
  // Prometheus exposition address, served at /metrics. Empty disables it.
  std::string metrics_address = "127.0.0.1:9464";
  // TLS for the TCP listeners (PEM files): server certificate chain and key, and, for
  // mutual TLS, the CA that client certificates must chain to.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  absl::Duration tls_handshake_timeout = absl::Seconds(10);
  // GPUs to use, by ordinal ("0") or UUID ("GPU-xxxxxxxx-..."); empty = every GPU.
  std::vector<std::string> devices;
  // CUDA streams per GPU; also the number of requests one GPU runs at once.
  int streams_per_device = 4;
  // Threads of the CPU engine per request; 0 = one per core.
  int cpu_threads = 0;
  // Budget of device bytes the daemon's allocator may hold per GPU; 0 = unlimited.
  uint64_t max_device_bytes = 0;
  // How long a request may wait for device memory before RESOURCE_EXHAUSTED.
  absl::Duration memory_wait = absl::Seconds(10);
  // How long a batch's streams wait for a client's ready word of shared host memory
  // (a wait fence's host word) before the daemon writes it itself (ready_words.h).
  absl::Duration ready_timeout = absl::Minutes(5);
  // While requests come, keep every CPU from halting until this long after the last one
  // (idle-priority spinners, idle_spinners.h); zero = off.
  absl::Duration keep_cpus_awake = absl::ZeroDuration();
  // Time given to in-flight requests after SIGTERM/SIGINT before they are cancelled.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Largest unary message accepted or sent, bytes (streams always accept 4 MiB chunks).
  int64_t max_message_bytes = 64ll << 20;
  // Bound on the input and on the output of any one conversion, whatever the transport.
  uint64_t max_tensor_bytes = 64ull << 30;
  // Bound on one matrix of a ConvertStream (input or output): a stream holds a few
  // matrices in host memory at a time. Larger matrices go through CUDA IPC.
  uint64_t max_stream_matrix_bytes = 128ull << 20;
  // Bound on host memory held for inline requests and responses (until each response
  // has been sent, which a client that does not read delays) and for stream buffers.
  uint64_t max_buffered_bytes = 1ull << 30;
  // How long a request that does not fit in max_buffered_bytes now waits for it (FIFO),
  // before RESOURCE_EXHAUSTED; zero refuses at once. Its deadline may end the wait sooner.
  absl::Duration max_queue_wait = absl::Seconds(10);
  // The most requests waiting for host memory at once (each holds a gRPC thread).
  int max_queued_requests = 1024;
  // Items of one ConvertBatch.
  uint64_t max_batch_items = 4096;
  // Open connections over all listeners (also kept under RLIMIT_NOFILE), and concurrent
  // calls per connection.
  int max_connections = 1024;
  int max_concurrent_streams = 64;
  // Open grpc.health.v1 Watch calls, all listeners together; more are refused
  // RESOURCE_EXHAUSTED. An open Watch holds no thread and about 19 KiB of memory
  // (docs/RELIABILITY.md, "Health"), so the default bounds them to about 300 MiB.
  int max_watch_streams = 16384;
  // Bound on cached IPC mappings and how long an unused one stays open. A request holds
  // its mappings while it runs, so one ConvertBatch can use at most this many handles
  // (a whole model's experts, one allocation per tensor, can take a few hundred).
  int ipc_cache_entries = 4096;
  absl::Duration ipc_idle_expiry = absl::Minutes(5);
  // When set, a file the daemon writes once it listens: one "grpc ADDR" line per
  // listening address (TCP ones with their bound port) and one "metrics HOST:PORT" line.
  std::string port_file;
  // Resident weight sets (WeightSets): the directory checkpoints are loaded from (empty =
  // loading from files is refused), and the bytes all sets may hold (0 = unlimited).
  std::string weights_root;
  uint64_t weights_budget = 0;
  // Where the sets' shared-memory files go (clients open them there): a tmpfs.
  std::string weights_shm_dir = "/dev/shm";
  // Weight sets to load once the daemon serves: a text-format wprep.v1.WeightPreload file.
  std::string preload;
};

// Parses flags ("--name=value" or "--name value"); args excludes argv[0]. A repeated
// --listen or --devices accumulates (the first one replaces the default). Returns
// InvalidArgument naming the flag for an unknown flag or a bad value.
absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args);

// Validates a filled Options (ranges, address syntax).
absl::Status ValidateOptions(const Options& options);

// The --help text, generated from the flag declarations (docs/OPERATIONS.md holds a copy
// that ctest flags_doc compares with it).
std::string Usage();

}  // namespace wprep::server

#endif  // WPREP_SERVER_OPTIONS_H_
