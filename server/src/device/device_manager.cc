#include "device/device_manager.h"

#include <algorithm>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "net/log.h"
#include "wprep/server/options.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

std::string FormatUuid(const Uuid& u) {
  std::string hex;
  for (uint8_t b : u) absl::StrAppendFormat(&hex, "%02x", b);
  return absl::StrCat("GPU-", hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4),
                      "-", hex.substr(16, 4), "-", hex.substr(20, 12));
}

absl::StatusOr<Uuid> ParseUuid(absl::string_view text) {
  absl::string_view t = text;
  if (t.substr(0, 4) == "GPU-") t.remove_prefix(4);
  std::string hex;
  bool bad = false;
  for (char c : t) {
    if (c == '-') continue;
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) bad = true;
    hex.push_back(c);
  }
  Uuid u{};
  if (bad || hex.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a GPU UUID; expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"));
  }
  for (int i = 0; i < 16; ++i) {
    int v = 0;
    if (!absl::SimpleHexAtoi(hex.substr(2 * i, 2), &v)) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a GPU UUID"));
    }
    u[i] = static_cast<uint8_t>(v);
  }
  return u;
}

Gpu::Gpu(DeviceRuntime* runtime, GpuInfo info, uint64_t budget, DeviceMetrics* metrics)
    : runtime_(runtime),
      info_(std::move(info)),
      engine_name_(absl::StrCat("cuda:", FormatUuid(info_.uuid))),
      metrics_(metrics),
      allocator_(runtime, info_.ordinal, budget, metrics) {}

Gpu::~Gpu() {
  for (Stream s : all_streams_) runtime_->DestroyStream(info_.ordinal, s);
  absl::MutexLock lock(&mu_);
  for (Event e : free_events_) runtime_->DestroyEvent(info_.ordinal, e);
}

absl::Status Gpu::Init(int streams) {
  for (int i = 0; i < streams; ++i) {
    WPREP_ASSIGN_OR_RETURN(Stream s, runtime_->CreateStream(info_.ordinal));
    all_streams_.push_back(s);
  }
  WPREP_RETURN_IF_ERROR(allocator_.Init());
  absl::MutexLock lock(&mu_);
  free_streams_ = all_streams_;
  return absl::OkStatus();
}

absl::StatusOr<Gpu::StreamLease> Gpu::AcquireStream(absl::Time deadline) {
  Stream s;
  {
    absl::MutexLock lock(&mu_);
    auto any_free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !free_streams_.empty(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&any_free), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "deadline passed while waiting for a free stream on ", FormatUuid(info_.uuid)));
    }
    s = free_streams_.back();
    free_streams_.pop_back();
  }
  const int n = in_flight_.fetch_add(1) + 1;
  if (metrics_ != nullptr) metrics_->in_flight->Set(n);
  return StreamLease(this, s);
}

void Gpu::Release(Stream s) {
  {
    absl::MutexLock lock(&mu_);
    free_streams_.push_back(s);
  }
  const int n = in_flight_.fetch_sub(1) - 1;
  if (metrics_ != nullptr) metrics_->in_flight->Set(n);
}

Gpu::StreamLease::~StreamLease() {
  if (gpu_ != nullptr) gpu_->Release(stream_);
}

absl::StatusOr<Event> Gpu::TakeEvent() {
  {
    absl::MutexLock lock(&mu_);
    if (!free_events_.empty()) {
      const Event e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  return runtime_->CreateEvent(info_.ordinal);
}

void Gpu::GiveEvent(Event event) {
  absl::MutexLock lock(&mu_);
  free_events_.push_back(event);
}

absl::Status Gpu::RecordAfter(const std::vector<Stream>& lanes, const std::vector<Event>& marks,
                              std::vector<Event>* joins) {
  const int ordinal = info_.ordinal;
  for (size_t lane = 1; lane < lanes.size(); ++lane) {
    WPREP_ASSIGN_OR_RETURN(Event j, TakeEvent());
    joins->push_back(j);
    WPREP_RETURN_IF_ERROR(runtime_->RecordEvent(ordinal, j, lanes[lane]));
    WPREP_RETURN_IF_ERROR(runtime_->StreamWaitEvent(ordinal, lanes[0], j));
  }
  for (Event m : marks) WPREP_RETURN_IF_ERROR(runtime_->RecordEvent(ordinal, m, lanes[0]));
  return absl::OkStatus();
}

void Gpu::set_warm(bool warm) {
  warm_.store(warm);
  if (metrics_ != nullptr) metrics_->warm->Set(warm ? 1 : 0);
}

namespace {

// The GPUs --devices names, in its order, each once.
absl::StatusOr<std::vector<GpuInfo>> ChooseGpus(std::vector<GpuInfo> found,
                                                const std::vector<std::string>& devices) {
  if (devices == std::vector<std::string>{"cpu"}) return std::vector<GpuInfo>{};
  if (devices.empty()) return found;
  std::vector<GpuInfo> chosen;
  for (const std::string& d : devices) {
    int ordinal = -1;
    auto match = found.end();
    if (absl::SimpleAtoi(d, &ordinal)) {
      match = std::find_if(found.begin(), found.end(),
                           [&](const GpuInfo& g) { return g.ordinal == ordinal; });
    } else {
      absl::StatusOr<Uuid> u = ParseUuid(d);
      if (!u.ok()) return absl::InvalidArgumentError(absl::StrCat("--devices: ", u.status().message()));
      match = std::find_if(found.begin(), found.end(), [&](const GpuInfo& g) { return g.uuid == *u; });
    }
    if (match == found.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--devices names '", d, "' but this machine has ", found.size(), " usable GPU(s)"));
    }
    if (std::none_of(chosen.begin(), chosen.end(),
                     [&](const GpuInfo& g) { return g.ordinal == match->ordinal; })) {
      chosen.push_back(*match);
    }
  }
  return chosen;
}

// Runs fn(i) for i in [0, n) on n threads at once and returns the first failure.
template <class Fn>
absl::Status OnEachAtOnce(size_t n, Fn fn) {
  std::vector<absl::Status> results(n);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
    for (auto& t : threads) t.join();
  }
  for (const absl::Status& s : results) WPREP_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceManager>> DeviceManager::Create(const Options& options,
                                                                     DeviceRuntime* runtime,
                                                                     Metrics* metrics) {
  std::unique_ptr<DeviceManager> dm(new DeviceManager(runtime, options.cpu_threads));
  WPREP_ASSIGN_OR_RETURN(std::vector<GpuInfo> found, runtime->ListGpus());
  WPREP_ASSIGN_OR_RETURN(std::vector<GpuInfo> infos, ChooseGpus(std::move(found), options.devices));
  std::vector<std::string> labels = {"cpu"};
  for (const GpuInfo& g : infos) labels.push_back(absl::StrCat("gpu", g.ordinal));
  metrics->RegisterDevices(labels);
  dm->cpu_metrics_ = &metrics->device(0);
  for (size_t i = 0; i < infos.size(); ++i) {
    dm->gpus_.push_back(std::make_unique<Gpu>(runtime, infos[i], options.max_device_bytes,
                                              &metrics->device(static_cast<int>(i) + 1)));
  }
  // Contexts, streams and pools of all GPUs are created at once: start-up time does not
  // grow with the number of GPUs.
  WPREP_RETURN_IF_ERROR(OnEachAtOnce(dm->gpus_.size(), [&](size_t i) {
    return dm->gpus_[i]->Init(options.streams_per_device);
  }));
  for (const GpuInfo& g : infos) {
    LogLine(LogLevel::kInfo, "gpu_found",
            absl::StrCat("ordinal=", g.ordinal, " uuid=", FormatUuid(g.uuid), " name=", LogQuote(g.name),
                         " cc=", g.cc_major, ".", g.cc_minor, " streams=", options.streams_per_device));
  }
  if (dm->gpus_.empty()) {
    LogLine(LogLevel::kInfo, "cpu_engine", absl::StrCat("threads=", options.cpu_threads));
  }
  return dm;
}

absl::StatusOr<Gpu*> DeviceManager::FindByUuid(const Uuid& uuid) {
  for (auto& g : gpus_) {
    if (g->info().uuid == uuid) return g.get();
  }
  std::vector<std::string> served;
  for (auto& g : gpus_) served.push_back(FormatUuid(g->info().uuid));
  return absl::InvalidArgumentError(absl::StrCat(
      FormatUuid(uuid), " is not a GPU this daemon serves (",
      served.empty() ? std::string("it has no GPU") : absl::StrJoin(served, ", "),
      "); ListDevices lists them"));
}

Gpu* DeviceManager::LeastLoaded() {
  Gpu* best = nullptr;
  for (auto& g : gpus_) {
    if (best == nullptr || g->in_flight() < best->in_flight()) best = g.get();
  }
  return best;
}

absl::Status DeviceManager::WarmUp(WarmOne warm_one) {
  // Every GPU warms at once, each on its own thread.
  WPREP_RETURN_IF_ERROR(OnEachAtOnce(gpus_.size(), [&](size_t i) -> absl::Status {
    Gpu& g = *gpus_[i];
    const absl::Time start = absl::Now();
    WPREP_ASSIGN_OR_RETURN(int variants, warm_one(g, pinned_));
    g.set_warm(true);
    LogLine(LogLevel::kInfo, "gpu_warm",
            absl::StrCat("uuid=", FormatUuid(g.info().uuid), " variants=", variants,
                         " seconds=", absl::ToDoubleSeconds(absl::Now() - start)));
    return absl::OkStatus();
  }));
  if (cpu_metrics_ != nullptr) cpu_metrics_->warm->Set(gpus_.empty() ? 1 : 0);
  return absl::OkStatus();
}

}  // namespace wprep::server
