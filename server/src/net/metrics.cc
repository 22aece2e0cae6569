#include "net/metrics.h"

#include <exception>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "net/metrics_http.h"
#include "wprep/spec/spec.h"

#ifndef WPREP_VERSION
#define WPREP_VERSION "unknown"
#endif

namespace wprep::server {
namespace {

// 10 us .. 60 s in 1-2.5-5 steps. Built once: a request only copies them when it creates
// a series.
const prometheus::Histogram::BucketBoundaries& SecondsBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
      5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60};
  return b;
}

// 0 (its own bucket: IPC->IPC requests allocate nothing), then 1 KiB .. 64 GiB.
const prometheus::Histogram::BucketBoundaries& BytesBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = [] {
    prometheus::Histogram::BucketBoundaries v = {0};
    for (double x = 1024; x <= 64.0 * (1ull << 30); x *= 4) v.push_back(x);
    return v;
  }();
  return b;
}

std::string LayoutLabel(const std::optional<Layout>& l) { return l ? std::string(LayoutName(*l)) : "none"; }

std::string DirectionLabel(const std::optional<Direction>& d) {
  return d ? std::string(DirectionName(*d)) : "none";
}

// The labels of a request's wprep_requests_total series.
prometheus::Labels RequestLabels(const RequestRecord& r) {
  return {{"method", MethodName(r.method)},
          {"layout", LayoutLabel(r.layout)},
          {"direction", DirectionLabel(r.direction)},
          {"transport", TransportName(r.transport)},
          {"code", absl::StatusCodeToString(r.code)}};
}

}  // namespace

const char* MethodName(Method m) {
  switch (m) {
    case Method::kPlan: return "Plan";
    case Method::kConvert: return "Convert";
    case Method::kConvertStream: return "ConvertStream";
    case Method::kConvertBatch: return "ConvertBatch";
    case Method::kConvertBatches: return "ConvertBatches";
    case Method::kListDevices: return "ListDevices";
    case Method::kRegisterIpcHandles: return "RegisterIpcHandles";
    case Method::kReleaseIpcHandles: return "ReleaseIpcHandles";
  }
  return "unknown";
}

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kNone: return "none";
    case Transport::kBytesToBytes: return "bytes_to_bytes";
    case Transport::kBytesToIpc: return "bytes_to_ipc";
    case Transport::kIpcToBytes: return "ipc_to_bytes";
    case Transport::kIpcToIpc: return "ipc_to_ipc";
    case Transport::kStream: return "stream";
    case Transport::kBatch: return "batch";
  }
  return "none";
}

const char* BufferRefusalName(BufferRefusal why) {
  switch (why) {
    case BufferRefusal::kTimeout: return "timeout";
    case BufferRefusal::kTooLarge: return "too_large";
    case BufferRefusal::kQueueFull: return "queue_full";
    case BufferRefusal::kCancelled: return "cancelled";
  }
  return "timeout";
}

Metrics::~Metrics() = default;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& address, bool cuda) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  auto& reg = *m->registry_;
  m->requests_ = &prometheus::BuildCounter()
                      .Name("wprep_requests_total")
                      .Help("Finished RPCs by method, layout, direction, transport and status code")
                      .Register(reg);
  m->batch_items_ = &prometheus::BuildCounter()
                         .Name("wprep_batch_items_total")
                         .Help("Items of finished ConvertBatch calls by layout, direction, transport and the call's code")
                         .Register(reg);
  m->request_seconds_ = &prometheus::BuildHistogram()
                             .Name("wprep_request_duration_seconds")
                             .Help("RPC duration from arrival to final status, seconds")
                             .Register(reg);
  m->peak_extra_bytes_ = &prometheus::BuildHistogram()
                              .Name("wprep_request_peak_extra_device_bytes")
                              .Help("Device bytes a conversion allocated at its peak, by transport")
                              .Register(reg);
  m->kernel_seconds_ = &prometheus::BuildHistogram()
                            .Name("wprep_kernel_duration_seconds")
                            .Help("Conversion engine time per request and device, seconds")
                            .Register(reg);
  m->allocated_ = &prometheus::BuildGauge()
                       .Name("wprep_device_allocated_bytes")
                       .Help("Device bytes the daemon's allocator holds for requests now")
                       .Register(reg);
  m->high_water_ = &prometheus::BuildGauge()
                        .Name("wprep_device_allocated_high_water_bytes")
                        .Help("Highest wprep_device_allocated_bytes since start")
                        .Register(reg);
  m->in_flight_ = &prometheus::BuildGauge()
                       .Name("wprep_in_flight_requests")
                       .Help("Conversions running now, per device")
                       .Register(reg);
  m->warm_ = &prometheus::BuildGauge()
                  .Name("wprep_device_warm")
                  .Help("1 once every kernel variant ran and was checked on the device")
                  .Register(reg);
  m->converted_ = &prometheus::BuildCounter()
                       .Name("wprep_converted_bytes_total")
                       .Help("Output bytes produced, per device")
                       .Register(reg);
  m->ipc_hits_ = &prometheus::BuildCounter()
                      .Name("wprep_ipc_cache_hits_total")
                      .Help("IPC handle lookups served by an open mapping")
                      .Register(reg)
                      .Add({});
  m->ipc_misses_ = &prometheus::BuildCounter()
                        .Name("wprep_ipc_cache_misses_total")
                        .Help("IPC handle lookups that opened a new mapping")
                        .Register(reg)
                        .Add({});
  m->ipc_entries_ = &prometheus::BuildGauge()
                         .Name("wprep_ipc_cache_entries")
                         .Help("Open IPC mappings in the cache")
                         .Register(reg)
                         .Add({});
  m->budget_ = &prometheus::BuildGauge()
                    .Name("wprep_device_budget_bytes")
                    .Help("Device bytes the daemon may hold for requests per device (--max-device-bytes); 0 = no budget")
                    .Register(reg);
  m->memory_waiting_ = &prometheus::BuildGauge()
                            .Name("wprep_device_memory_waiting_requests")
                            .Help("Requests waiting now for device memory within the budget")
                            .Register(reg);
  m->memory_waits_ = &prometheus::BuildCounter()
                          .Name("wprep_device_memory_waits_total")
                          .Help("Requests that had to wait for device memory within the budget")
                          .Register(reg);
  m->buffered_bytes_ = &prometheus::BuildGauge()
                            .Name("wprep_host_buffered_bytes")
                            .Help("Host bytes held for inline requests and responses and stream buffers")
                            .Register(reg)
                            .Add({});
  m->buffer_budget_bytes_ = &prometheus::BuildGauge()
                                 .Name("wprep_host_buffer_budget_bytes")
                                 .Help("The bound on wprep_host_buffered_bytes (--max-buffered-bytes)")
                                 .Register(reg)
                                 .Add({});
  m->buffer_queue_ = &prometheus::BuildGauge()
                         .Name("wprep_host_buffer_queued_requests")
                         .Help("Requests waiting for host memory within --max-buffered-bytes (FIFO)")
                         .Register(reg)
                         .Add({});
  m->buffer_wait_ = &prometheus::BuildHistogram()
                        .Name("wprep_host_buffer_wait_seconds")
                        .Help("How long requests waited for host memory, granted or refused (0 when it was free at once)")
                        .Register(reg)
                        .Add({}, SecondsBuckets());
  auto& buffer_refused = prometheus::BuildCounter()
                             .Name("wprep_host_buffer_refused_total")
                             .Help("Requests refused host memory (RESOURCE_EXHAUSTED, or CANCELLED while waiting): "
                                   "reason=timeout, too_large, queue_full or cancelled")
                             .Register(reg);
  for (BufferRefusal why : {BufferRefusal::kTimeout, BufferRefusal::kTooLarge, BufferRefusal::kQueueFull,
                            BufferRefusal::kCancelled}) {
    m->buffer_refused_[static_cast<int>(why)] = &buffer_refused.Add({{"reason", BufferRefusalName(why)}});
  }
  m->health_serving_ = &prometheus::BuildGauge()
                            .Name("wprep_health_serving")
                            .Help("1 while grpc.health.v1 answers SERVING (warm, not draining), else 0")
                            .Register(reg)
                            .Add({});
  m->weight_set_bytes_ = &prometheus::BuildGauge()
                              .Name("wprep_weight_set_resident_bytes")
                              .Help("Bytes a resident weight set holds, by set")
                              .Register(reg);
  m->weight_attachments_ = &prometheus::BuildGauge()
                                .Name("wprep_weight_attachments")
                                .Help("Open attachments to resident weight sets")
                                .Register(reg)
                                .Add({});
  m->weight_load_seconds_ = &prometheus::BuildHistogram()
                                 .Name("wprep_weight_load_seconds")
                                 .Help("How long successful LoadWeights calls took, planning to the last tensor")
                                 .Register(reg)
                                 .Add({}, SecondsBuckets());
  m->weight_loads_failed_ = &prometheus::BuildCounter()
                                 .Name("wprep_weight_loads_failed_total")
                                 .Help("LoadWeights calls refused or failed (bad request, checkpoint, path or budget)")
                                 .Register(reg)
                                 .Add({});
  m->connections_refused_ = &prometheus::BuildCounter()
                                 .Name("wprep_connections_refused_total")
                                 .Help("Connections closed unserved: over the limit, or shed while descriptors ran out")
                                 .Register(reg)
                                 .Add({});
  auto& ready_released = prometheus::BuildCounter()
                             .Name("wprep_ready_words_released_total")
                             .Help("Ready words of shared host memory the daemon wrote itself, so that its streams "
                                   "go on: why=timeout (--ready-timeout passed) or client_gone (a ConvertBatches "
                                   "stream ended cancelled)")
                             .Register(reg);
  m->ready_released_timeout_ = &ready_released.Add({{"why", "timeout"}});
  m->ready_released_gone_ = &ready_released.Add({{"why", "client_gone"}});
  prometheus::BuildGauge()
      .Name("wprep_build_info")
      .Help("Build information; the value is always 1")
      .Register(reg)
      .Add({{"version", WPREP_VERSION}, {"cuda", cuda ? "true" : "false"}})
      .Set(1);
  m->InitSuccessSeries();
  if (!address.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(address, m->registry_);
    if (!http.ok()) return http.status();
    m->http_ = *std::move(http);
    m->port_ = m->http_->port();
  }
  return m;
}

void Metrics::RegisterDevices(const std::vector<std::string>& labels) {
  devices_.clear();
  for (const std::string& l : labels) {
    DeviceMetrics d;
    d.kernel_seconds = &kernel_seconds_->Add({{"device", l}}, SecondsBuckets());
    d.allocated_bytes = &allocated_->Add({{"device", l}});
    d.allocated_high_water_bytes = &high_water_->Add({{"device", l}});
    d.in_flight = &in_flight_->Add({{"device", l}});
    d.warm = &warm_->Add({{"device", l}});
    d.converted_bytes = &converted_->Add({{"device", l}});
    d.budget_bytes = &budget_->Add({{"device", l}});
    d.memory_waiting = &memory_waiting_->Add({{"device", l}});
    d.memory_waits = &memory_waits_->Add({{"device", l}});
    devices_.push_back(d);
  }
}

void Metrics::InitSuccessSeries() {
  // Every successful kind of request starts at zero, so rates and dashboards have a
  // series from the start (Prometheus' advice for known label values), and a request
  // never creates one on its way out. Error codes appear as they happen.
  const Method methods[] = {Method::kPlan,        Method::kConvert,
                            Method::kConvertStream, Method::kConvertBatch, Method::kConvertBatches,
                            Method::kListDevices, Method::kRegisterIpcHandles,
                            Method::kReleaseIpcHandles};
  for (Method m : methods) request_seconds_->Add({{"method", MethodName(m)}}, SecondsBuckets());
  // Each layout and direction the engines convert (the spec list their warm-up runs).
  std::set<std::pair<Layout, Direction>> kinds;
  for (const ConversionSpec& s : KernelVariantSpecs()) kinds.emplace(s.layout, s.direction);
  const Transport convert_transports[] = {Transport::kBytesToBytes, Transport::kBytesToIpc,
                                          Transport::kIpcToBytes, Transport::kIpcToIpc};
  auto ok = [this](Method m, std::optional<Layout> l, std::optional<Direction> d, Transport t) {
    RequestRecord r;
    r.method = m;
    r.layout = l;
    r.direction = d;
    r.transport = t;
    r.code = absl::StatusCode::kOk;
    requests_->Add(RequestLabels(r));
  };
  for (const auto& [layout, direction] : kinds) {
    ok(Method::kPlan, layout, direction, Transport::kNone);
    for (Transport t : convert_transports) ok(Method::kConvert, layout, direction, t);
    ok(Method::kConvertStream, layout, direction, Transport::kStream);
    for (Transport t : convert_transports) {
      batch_items_->Add({{"layout", LayoutLabel(layout)},
                         {"direction", DirectionLabel(direction)},
                         {"transport", TransportName(t)},
                         {"code", absl::StatusCodeToString(absl::StatusCode::kOk)}});
    }
  }
  ok(Method::kConvertBatch, std::nullopt, std::nullopt, Transport::kBatch);
  ok(Method::kConvertBatches, std::nullopt, std::nullopt, Transport::kBatch);
  for (Method m : {Method::kListDevices, Method::kRegisterIpcHandles, Method::kReleaseIpcHandles}) {
    ok(m, std::nullopt, std::nullopt, Transport::kNone);
  }
  for (Transport t : convert_transports) {
    peak_extra_bytes_->Add({{"transport", TransportName(t)}}, BytesBuckets());
  }
  peak_extra_bytes_->Add({{"transport", TransportName(Transport::kStream)}}, BytesBuckets());
  peak_extra_bytes_->Add({{"transport", TransportName(Transport::kBatch)}}, BytesBuckets());
}

namespace {

// Children keys: which family (top byte), then the labels' enum values, a byte each
// (optional ones as value + 1, 0 for none).
enum ChildFamily : uint64_t { kRequests = 1, kBatchItems, kRequestSeconds, kPeakExtra };
template <class E>
uint64_t Byte(std::optional<E> e) {
  return e ? static_cast<uint64_t>(*e) + 1 : 0;
}
uint64_t Key(ChildFamily f, uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0, uint64_t e = 0) {
  return f << 56 | a << 32 | b << 24 | c << 16 | d << 8 | e;
}

}  // namespace

template <class Make>
auto Metrics::Child(uint64_t key, Make make) -> decltype(make()) {
  using T = std::remove_reference_t<decltype(make())>;
  {
    absl::MutexLock l(&children_mu_);
    auto it = children_.find(key);
    if (it != children_.end()) return *static_cast<T*>(it->second);
  }
  T& child = make();  // prometheus returns the same child for the same labels
  absl::MutexLock l(&children_mu_);
  children_.emplace(key, &child);
  return child;
}

void Metrics::RecordBatchItem(Layout layout, Direction direction, Transport transport, absl::StatusCode code) {
  Child(Key(kBatchItems, static_cast<uint64_t>(code), static_cast<uint64_t>(layout), static_cast<uint64_t>(direction),
            static_cast<uint64_t>(transport)),
        [&]() -> prometheus::Counter& {
          return batch_items_->Add({{"layout", LayoutLabel(layout)},
                                    {"direction", DirectionLabel(direction)},
                                    {"transport", TransportName(transport)},
                                    {"code", absl::StatusCodeToString(code)}});
        })
      .Increment();
}

void Metrics::RecordRequest(const RequestRecord& r) {
  Child(Key(kRequests, static_cast<uint64_t>(r.code), static_cast<uint64_t>(r.method), Byte(r.layout),
            Byte(r.direction), static_cast<uint64_t>(r.transport)),
        [&]() -> prometheus::Counter& { return requests_->Add(RequestLabels(r)); })
      .Increment();
  Child(Key(kRequestSeconds, static_cast<uint64_t>(r.method)),
        [&]() -> prometheus::Histogram& {
          return request_seconds_->Add({{"method", MethodName(r.method)}}, SecondsBuckets());
        })
      .Observe(r.seconds);
  if (r.peak_extra_device_bytes) {
    Child(Key(kPeakExtra, static_cast<uint64_t>(r.transport)),
          [&]() -> prometheus::Histogram& {
            return peak_extra_bytes_->Add({{"transport", TransportName(r.transport)}}, BytesBuckets());
          })
        .Observe(static_cast<double>(*r.peak_extra_device_bytes));
  }
}

void Metrics::SetWeightSetBytes(const std::string& set, uint64_t bytes) {
  prometheus::Gauge& g = weight_set_bytes_->Add({{"set", set}});
  if (bytes == 0) {
    weight_set_bytes_->Remove(&g);
  } else {
    g.Set(static_cast<double>(bytes));
  }
}

}  // namespace wprep::server
