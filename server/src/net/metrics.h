// The daemon's Prometheus metrics: one Metrics object built at start-up holds every
// family; label values come from enums (never from request strings). Base units,
// `_total` counters. Thread-safe after RegisterDevices.
#ifndef WPREP_SERVER_SRC_METRICS_H_
#define WPREP_SERVER_SRC_METRICS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "wprep/spec/spec.h"

namespace wprep::server {

class MetricsHttpServer;

enum class Method {
  kPlan,
  kConvert,
  kConvertStream,
  kConvertBatch,
  kConvertBatches,  // one batch of a ConvertBatches stream
  kListDevices,
  kRegisterIpcHandles,
  kReleaseIpcHandles,
};
// How the bytes travel: inline protobuf bytes or CUDA IPC, source to destination.
// A batch as a whole is kBatch; its items have their own transports.
enum class Transport { kNone, kBytesToBytes, kBytesToIpc, kIpcToBytes, kIpcToIpc, kStream, kBatch };

// Why a request got no host memory (HostBudget): its wait ran out (deadline or
// --max-queue-wait, or at once with --max-queue-wait=0), it asked for more than the whole
// budget, the waiting queue was full, or its client cancelled while it waited.
enum class BufferRefusal { kTimeout, kTooLarge, kQueueFull, kCancelled };
inline constexpr int kBufferRefusals = 4;

const char* MethodName(Method method);
const char* TransportName(Transport transport);
const char* BufferRefusalName(BufferRefusal why);

// Metrics of one engine instance: the CPU engine or one GPU.
struct DeviceMetrics {
  prometheus::Histogram* kernel_seconds = nullptr;   // wprep_kernel_duration_seconds
  prometheus::Gauge* allocated_bytes = nullptr;      // wprep_device_allocated_bytes
  prometheus::Gauge* allocated_high_water_bytes = nullptr;  // ..._high_water_bytes
  prometheus::Gauge* in_flight = nullptr;            // wprep_in_flight_requests
  prometheus::Gauge* warm = nullptr;                 // wprep_device_warm (0/1)
  prometheus::Counter* converted_bytes = nullptr;    // wprep_converted_bytes_total
  prometheus::Gauge* budget_bytes = nullptr;         // wprep_device_budget_bytes (0 = none)
  prometheus::Gauge* memory_waiting = nullptr;       // wprep_device_memory_waiting_requests
  prometheus::Counter* memory_waits = nullptr;       // wprep_device_memory_waits_total
};

// Counts one conversion in an engine's in-flight gauge while alive (metrics may be null).
class InFlight {
 public:
  explicit InFlight(DeviceMetrics* m) : m_(m) {
    if (m_ != nullptr) m_->in_flight->Increment();
  }
  ~InFlight() {
    if (m_ != nullptr) m_->in_flight->Decrement();
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  DeviceMetrics* const m_;
};

// One finished RPC.
struct RequestRecord {
  Method method = Method::kPlan;
  std::optional<Layout> layout;        // unset when the request had no valid spec
  std::optional<Direction> direction;
  Transport transport = Transport::kNone;
  absl::StatusCode code = absl::StatusCode::kOk;
  double seconds = 0;
  // Extra device bytes at the request's peak; set for conversions that ran.
  std::optional<uint64_t> peak_extra_device_bytes;
};

class Metrics {
 public:
  // Builds the families and, when `address` is not empty, serves them at
  // http://address/metrics (port 0 picks a free port; see port()). `cuda`: whether the
  // build has the CUDA engine (wprep_build_info).
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& address, bool cuda);
  ~Metrics();

  // The bound HTTP port, or 0 when not serving.
  int port() const { return port_; }

  // Creates the per-device series; `labels` are "cpu" or "gpu<ordinal>" (a closed set
  // fixed at start-up). Call once, before serving. Index i of labels is device slot i.
  void RegisterDevices(const std::vector<std::string>& labels);
  DeviceMetrics& device(int slot) { return devices_[slot]; }

  void RecordRequest(const RequestRecord& record);
  // One item of a ConvertBatch (wprep_batch_items_total); `code` is the batch's.
  void RecordBatchItem(Layout layout, Direction direction, Transport transport, absl::StatusCode code);
  void IpcCacheHit() { ipc_hits_->Increment(); }
  void IpcCacheMiss() { ipc_misses_->Increment(); }
  void SetIpcCacheEntries(double n) { ipc_entries_->Set(n); }
  // Host bytes held for inline requests and responses and stream buffers, and the bound.
  prometheus::Gauge& buffered_bytes() { return *buffered_bytes_; }
  prometheus::Gauge& buffer_budget_bytes() { return *buffer_budget_bytes_; }
  // Requests waiting for host memory, how long each waited (granted or not), and those
  // refused, by why.
  prometheus::Gauge& buffer_queue_requests() { return *buffer_queue_; }
  prometheus::Histogram& buffer_wait_seconds() { return *buffer_wait_; }
  prometheus::Counter& buffer_refused(BufferRefusal why) { return *buffer_refused_[static_cast<int>(why)]; }
  // 1 while grpc.health.v1 answers SERVING, else 0.
  prometheus::Gauge& health_serving() { return *health_serving_; }
  // Connections closed unserved (over the limit, or shed while descriptors ran out).
  prometheus::Counter& connections_refused() { return *connections_refused_; }
  // Ready words the daemon wrote for their clients (ready_words.h): after --ready-timeout,
  // and for a ConvertBatches stream that ended cancelled.
  prometheus::Counter& ready_words_released_timeout() { return *ready_released_timeout_; }
  prometheus::Counter& ready_words_released_client_gone() { return *ready_released_gone_; }

  // Resident weight sets (exec/weight_store.h): bytes per set (the series goes when
  // the set is dropped; set names are bounded by the store's name rule and budget),
  // open attachments, load durations and failed loads.
  void SetWeightSetBytes(const std::string& set, uint64_t bytes);
  prometheus::Gauge& weight_attachments() { return *weight_attachments_; }
  prometheus::Histogram& weight_load_seconds() { return *weight_load_seconds_; }
  prometheus::Counter& weight_loads_failed() { return *weight_loads_failed_; }

  prometheus::Registry& registry() { return *registry_; }

 private:
  void InitSuccessSeries();
  Metrics() = default;
  // The family child `make()` returns (Family::Add), made once and then found by `key`
  // (its labels' enums packed): a request's metrics build no label maps and take one
  // short lock.
  template <class Make>
  auto Child(uint64_t key, Make make) -> decltype(make());

  // Constant after Create/RegisterDevices.
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  int port_ = 0;
  absl::Mutex children_mu_;
  std::unordered_map<uint64_t, void*> children_ ABSL_GUARDED_BY(children_mu_);  // key -> T*
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* batch_items_ = nullptr;
  prometheus::Family<prometheus::Histogram>* request_seconds_ = nullptr;
  prometheus::Family<prometheus::Histogram>* peak_extra_bytes_ = nullptr;
  prometheus::Family<prometheus::Histogram>* kernel_seconds_ = nullptr;
  prometheus::Family<prometheus::Gauge>* allocated_ = nullptr;
  prometheus::Family<prometheus::Gauge>* high_water_ = nullptr;
  prometheus::Family<prometheus::Gauge>* in_flight_ = nullptr;
  prometheus::Family<prometheus::Gauge>* warm_ = nullptr;
  prometheus::Family<prometheus::Counter>* converted_ = nullptr;
  prometheus::Counter* ipc_hits_ = nullptr;
  prometheus::Counter* ipc_misses_ = nullptr;
  prometheus::Gauge* ipc_entries_ = nullptr;
  prometheus::Family<prometheus::Gauge>* budget_ = nullptr;
  prometheus::Family<prometheus::Gauge>* memory_waiting_ = nullptr;
  prometheus::Family<prometheus::Counter>* memory_waits_ = nullptr;
  prometheus::Gauge* buffered_bytes_ = nullptr;
  prometheus::Gauge* buffer_budget_bytes_ = nullptr;
  prometheus::Gauge* buffer_queue_ = nullptr;
  prometheus::Histogram* buffer_wait_ = nullptr;
  prometheus::Counter* buffer_refused_[kBufferRefusals] = {};
  prometheus::Counter* connections_refused_ = nullptr;
  prometheus::Counter* ready_released_timeout_ = nullptr;
  prometheus::Counter* ready_released_gone_ = nullptr;
  prometheus::Gauge* health_serving_ = nullptr;
  prometheus::Family<prometheus::Gauge>* weight_set_bytes_ = nullptr;
  prometheus::Gauge* weight_attachments_ = nullptr;
  prometheus::Histogram* weight_load_seconds_ = nullptr;
  prometheus::Counter* weight_loads_failed_ = nullptr;
  std::vector<DeviceMetrics> devices_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_METRICS_H_
