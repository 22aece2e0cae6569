#include "wprep/server/device_manager.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/server/log.h"

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
    absl::SimpleHexAtoi(hex.substr(2 * i, 2), &v);
    u[i] = static_cast<uint8_t>(v);
  }
  return u;
}

absl::StatusOr<Uuid> UuidFromBytes(absl::string_view bytes, absl::string_view field) {
  if (bytes.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be the 16 bytes of cudaDeviceProp.uuid, got ", bytes.size(), " bytes"));
  }
  Uuid u{};
  std::memcpy(u.data(), bytes.data(), 16);
  return u;
}

Gpu::Gpu(GpuInfo info, int metrics_slot, uint64_t budget, DeviceMetrics* metrics)
    : info_(std::move(info)),
      metrics_slot_(metrics_slot),
      metrics_(metrics),
      allocator_(info_.ordinal, budget, metrics) {}

Gpu::~Gpu() {
#if WPREP_HAVE_CUDA
  if (!all_streams_.empty() && cudaSetDevice(info_.ordinal) == cudaSuccess) {
    for (CudaStream s : all_streams_) cudaStreamDestroy(s);
  }
#endif
}

absl::Status Gpu::Init(int streams) {
#if WPREP_HAVE_CUDA
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(info_.ordinal));
  for (int i = 0; i < streams; ++i) {
    cudaStream_t s = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    all_streams_.push_back(s);
  }
  if (absl::Status s = allocator_.Init(); !s.ok()) return s;
#endif
  num_streams_ = static_cast<int>(all_streams_.size());
  std::lock_guard<std::mutex> lock(mu_);
  free_streams_ = all_streams_;
  (void)streams;
  return absl::OkStatus();
}

absl::StatusOr<Gpu::StreamLease> Gpu::AcquireStream(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (free_streams_.empty()) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "deadline passed while waiting for a free stream on ", FormatUuid(info_.uuid)));
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Milliseconds(100))));
  }
  CudaStream s = free_streams_.back();
  free_streams_.pop_back();
  const int n = in_flight_.fetch_add(1) + 1;
  if (metrics_ != nullptr) metrics_->in_flight->Set(n);
  return StreamLease(this, s);
}

Gpu::StreamLease::~StreamLease() {
  if (gpu_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(gpu_->mu_);
    gpu_->free_streams_.push_back(stream_);
  }
  const int n = gpu_->in_flight_.fetch_sub(1) - 1;
  if (gpu_->metrics_ != nullptr) gpu_->metrics_->in_flight->Set(n);
  gpu_->cv_.notify_one();
}

void Gpu::set_warm(bool warm) {
  warm_.store(warm);
  if (metrics_ != nullptr) metrics_->warm->Set(warm ? 1 : 0);
}

absl::StatusOr<std::unique_ptr<DeviceManager>> DeviceManager::Create(const Options& options,
                                                                     Metrics* metrics) {
  std::unique_ptr<DeviceManager> dm(new DeviceManager());
  dm->cpu_threads_ = options.cpu_threads;
  std::vector<GpuInfo> infos;
#if WPREP_HAVE_CUDA
  const int count = CudaDeviceCount();
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    WPREP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
    GpuInfo info;
    info.ordinal = i;
    std::memcpy(info.uuid.data(), prop.uuid.bytes, 16);
    info.name = prop.name;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.total_memory = prop.totalGlobalMem;
    infos.push_back(std::move(info));
  }
#endif
  if (options.devices == std::vector<std::string>{"cpu"}) {
    infos.clear();  // --devices=cpu: the CPU engine serves everything
  } else if (!options.devices.empty()) {
    std::vector<GpuInfo> chosen;
    for (const std::string& d : options.devices) {
      int ordinal = -1;
      auto match = infos.end();
      if (absl::SimpleAtoi(d, &ordinal)) {
        match = std::find_if(infos.begin(), infos.end(),
                             [&](const GpuInfo& g) { return g.ordinal == ordinal; });
      } else {
        absl::StatusOr<Uuid> u = ParseUuid(d);
        if (!u.ok()) return absl::InvalidArgumentError(absl::StrCat("--devices: ", u.status().message()));
        match = std::find_if(infos.begin(), infos.end(),
                             [&](const GpuInfo& g) { return g.uuid == *u; });
      }
      if (match == infos.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--devices names '", d, "' but this machine has ", infos.size(), " usable GPU(s)"));
      }
      if (std::none_of(chosen.begin(), chosen.end(),
                       [&](const GpuInfo& g) { return g.ordinal == match->ordinal; })) {
        chosen.push_back(*match);
      }
    }
    infos = std::move(chosen);
  }
  std::vector<std::string> labels = {"cpu"};
  for (const GpuInfo& g : infos) labels.push_back(absl::StrCat("gpu", g.ordinal));
  metrics->RegisterDevices(labels);
  dm->cpu_metrics_ = &metrics->device(0);
  for (size_t i = 0; i < infos.size(); ++i) {
    const int slot = static_cast<int>(i) + 1;
    dm->gpus_.push_back(
        std::make_unique<Gpu>(infos[i], slot, options.max_device_bytes, &metrics->device(slot)));
  }
  // Contexts, streams and pools of all GPUs are created at once: start-up time does not
  // grow with the number of GPUs.
  std::vector<absl::Status> init(dm->gpus_.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < dm->gpus_.size(); ++i) {
      threads.emplace_back([&, i] { init[i] = dm->gpus_[i]->Init(options.streams_per_device); });
    }
    for (auto& t : threads) t.join();
  }
  for (size_t i = 0; i < infos.size(); ++i) {
    if (!init[i].ok()) return init[i];
    LogLine(LogLevel::kInfo, "gpu_found",
            absl::StrCat("ordinal=", infos[i].ordinal, " uuid=", FormatUuid(infos[i].uuid),
                         " name=", LogQuote(infos[i].name), " cc=", infos[i].cc_major, ".",
                         infos[i].cc_minor, " streams=", options.streams_per_device));
  }
  if (dm->gpus_.empty()) {
    LogLine(LogLevel::kInfo, "cpu_engine", absl::StrCat("threads=", options.cpu_threads));
  }
  return dm;
}

absl::StatusOr<Gpu*> DeviceManager::FindByUuid(const Uuid& uuid, absl::string_view field) {
  for (auto& g : gpus_) {
    if (g->info().uuid == uuid) return g.get();
  }
  std::vector<std::string> served;
  for (auto& g : gpus_) served.push_back(FormatUuid(g->info().uuid));
  return absl::InvalidArgumentError(absl::StrCat(
      field, " names ", FormatUuid(uuid), ", which is not a GPU this daemon serves (",
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

namespace {

#if WPREP_HAVE_CUDA
absl::Status WarmOne(Gpu& gpu, const Plan& plan, const std::vector<uint8_t>& in) {
  absl::StatusOr<Gpu::StreamLease> lease = gpu.AcquireStream(absl::Now() + absl::Seconds(30));
  if (!lease.ok()) return lease.status();
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu.info().ordinal));
  std::vector<uint8_t> expected(plan.output_bytes), got(plan.output_bytes, 0xAB);
  if (absl::Status s = ConvertOnCpu(plan, in.data(), in.size(), expected.data(), expected.size());
      !s.ok()) {
    return s;
  }
  {
    RequestMemory mem(&gpu.allocator(), lease->stream());
    if (absl::Status s = mem.Reserve(plan.input_bytes + plan.output_bytes, absl::Now() + absl::Seconds(30));
        !s.ok()) {
      return s;
    }
    absl::StatusOr<void*> d_in = mem.Allocate(plan.input_bytes);
    if (!d_in.ok()) return d_in.status();
    absl::StatusOr<void*> d_out = mem.Allocate(plan.output_bytes);
    if (!d_out.ok()) return d_out.status();
    WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(*d_in, in.data(), in.size(), cudaMemcpyHostToDevice,
                                               lease->stream()));
    if (absl::Status s = ConvertOnCuda(plan, *d_in, *d_out, lease->stream()); !s.ok()) return s;
    WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(got.data(), *d_out, got.size(),
                                               cudaMemcpyDeviceToHost, lease->stream()));
    WPREP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lease->stream()));
  }
  if (got != expected) {
    return absl::InternalError(absl::StrCat("warm-up: GPU ", FormatUuid(gpu.info().uuid),
                                            " disagrees with the CPU engine on ", Describe(plan.spec)));
  }
  return absl::OkStatus();
}
#endif

}  // namespace

absl::Status DeviceManager::WarmUp() {
  auto warm_one_gpu = [](Gpu& g) -> absl::Status {
    const absl::Time start = absl::Now();
#if WPREP_HAVE_CUDA
    for (const ConversionSpec& spec : KernelVariantSpecs()) {
      absl::StatusOr<Plan> plan = MakePlan(spec, std::vector<int64_t>{2, 256, 256});
      if (!plan.ok()) return plan.status();
      std::vector<uint8_t> in(plan->input_bytes);
      uint64_t x = 0x9E3779B97F4A7C15ull;
      for (auto& b : in) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b = static_cast<uint8_t>(x);
      }
      if (absl::Status s = WarmOne(g, *plan, in); !s.ok()) return s;
    }
#endif
    g.set_warm(true);
    LogLine(LogLevel::kInfo, "gpu_warm",
            absl::StrCat("uuid=", FormatUuid(g.info().uuid), " variants=", KernelVariantSpecs().size(),
                         " seconds=", absl::ToDoubleSeconds(absl::Now() - start)));
    return absl::OkStatus();
  };
  // Every GPU warms at once, each on its own thread.
  std::vector<absl::Status> results(gpus_.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < gpus_.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = warm_one_gpu(*gpus_[i]); });
    }
    for (auto& t : threads) t.join();
  }
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  if (cpu_metrics_ != nullptr) cpu_metrics_->warm->Set(gpus_.empty() ? 1 : 0);
  return absl::OkStatus();
}

}  // namespace wprep::server
