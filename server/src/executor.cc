#include "wprep/server/executor.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"

namespace wprep::server {
namespace {

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// A finished conversion's kernel seconds (when known) and output bytes, into the engine's
// metrics `m` (if any). The daemon's own warm-up (counted == false) is not clients'
// traffic and stays out.
void RecordConversion(DeviceMetrics* m, bool counted, std::optional<double> kernel_seconds,
                      uint64_t output_bytes) {
  if (m == nullptr || !counted) return;
  if (kernel_seconds) m->kernel_seconds->Observe(*kernel_seconds);
  m->converted_bytes->Increment(static_cast<double>(output_bytes));
}

absl::Status CheckDeadline(absl::Time deadline) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed before the conversion started");
  }
  return absl::OkStatus();
}

// Counts a request as in flight on the CPU engine for the gauge.
class CpuInFlight {
 public:
  explicit CpuInFlight(DeviceMetrics* m) : m_(m) {
    if (m_ != nullptr) m_->in_flight->Increment();
  }
  ~CpuInFlight() {
    if (m_ != nullptr) m_->in_flight->Decrement();
  }

 private:
  DeviceMetrics* m_;
};

// Plans of slices of `b` whole matrices, cached by b (a stream needs at most two: the
// full slice and the last one).
class SlicePlans {
 public:
  SlicePlans(const ConversionSpec& spec, int64_t d0, int64_t d1) : spec_(spec), d0_(d0), d1_(d1) {}
  absl::StatusOr<const Plan*> Get(int64_t b) {
    auto it = plans_.find(b);
    if (it == plans_.end()) {
      absl::StatusOr<Plan> p = MakePlan(spec_, std::vector<int64_t>{b, d0_, d1_});
      if (!p.ok()) return p.status();
      it = plans_.emplace(b, *std::move(p)).first;
    }
    return &it->second;
  }

 private:
  ConversionSpec spec_;
  int64_t d0_, d1_;
  std::map<int64_t, Plan> plans_;
};

// Shared slicing logic of both stream engines.
class SlicedConverter : public StreamConverter {
 protected:
  // Sets up slicing by whole matrices; falls back to one slice when the layout's
  // per-matrix sizes do not add up (never expected, but never wrong).
  void InitSlicing(const Plan& plan, uint64_t target_slice_bytes) {
    plan_ = plan;
    const auto& s = plan.logical_shape;
    uint64_t e = 1;
    for (size_t i = 0; i + 2 < s.size(); ++i) e *= static_cast<uint64_t>(s[i]);
    slices_ = std::make_unique<SlicePlans>(plan.spec, s[s.size() - 2], s[s.size() - 1]);
    absl::StatusOr<const Plan*> one = e > 0 ? slices_->Get(1) : absl::StatusOr<const Plan*>(nullptr);
    if (e > 0 && one.ok() && (*one)->input_bytes > 0 &&
        (*one)->input_bytes * e == plan.input_bytes && (*one)->output_bytes * e == plan.output_bytes) {
      matrix_in_ = (*one)->input_bytes;
      matrix_out_ = (*one)->output_bytes;
      const uint64_t per = std::max<uint64_t>(1, target_slice_bytes / matrix_in_);
      slice_in_ = std::min<uint64_t>(per, e) * matrix_in_;
    } else {
      whole_ = true;
      matrix_in_ = plan.input_bytes;
      matrix_out_ = plan.output_bytes;
      slice_in_ = plan.input_bytes;
    }
  }

  // The plan of the slice `in_bytes` long, with its output size.
  absl::StatusOr<const Plan*> SlicePlan(uint64_t in_bytes) {
    if (whole_ || matrix_in_ == 0) {
      if (in_bytes != plan_.input_bytes) {
        return absl::InternalError("stream slice does not match the whole-tensor plan");
      }
      return &plan_;
    }
    if (in_bytes == 0 || in_bytes % matrix_in_ != 0 || in_bytes > slice_in_) {
      return absl::InternalError(absl::StrCat("stream slice of ", in_bytes,
                                              " bytes is not a whole number of matrices"));
    }
    return slices_->Get(static_cast<int64_t>(in_bytes / matrix_in_));
  }

  bool whole_ = false;
  std::unique_ptr<SlicePlans> slices_;
};

class CpuStreamConverter final : public SlicedConverter {
 public:
  CpuStreamConverter(const Plan& plan, uint64_t target, int threads, DeviceMetrics* metrics,
                     bool counted)
      : threads_(threads), metrics_(metrics), counted_(counted), in_flight_(metrics) {
    InitSlicing(plan, target);
    engine_ = "cpu";
  }
  absl::StatusOr<absl::Span<const uint8_t>> ConvertSlice(absl::Span<const uint8_t> in) override {
    absl::StatusOr<const Plan*> p = SlicePlan(in.size());
    if (!p.ok()) return p.status();
    out_.resize((*p)->output_bytes);
    const absl::Time start = absl::Now();
    absl::Status s = ConvertOnCpu(**p, in.data(), in.size(), out_.data(), out_.size(), CpuOptions{threads_});
    if (!s.ok()) return s;
    RecordConversion(metrics_, counted_, SecondsSince(start), out_.size());
    return absl::Span<const uint8_t>(out_);
  }

 private:
  std::vector<uint8_t> out_;
  int threads_;
  DeviceMetrics* metrics_;
  const bool counted_;
  CpuInFlight in_flight_;
};

#if WPREP_HAVE_CUDA
// Times one kernel on a stream with a pair of events.
class KernelTimer {
 public:
  explicit KernelTimer(cudaStream_t s) : stream_(s) {
    ok_ = cudaEventCreate(&start_) == cudaSuccess && cudaEventCreate(&stop_) == cudaSuccess;
    if (ok_) ok_ = cudaEventRecord(start_, stream_) == cudaSuccess;
  }
  void Stop() {
    if (ok_) ok_ = cudaEventRecord(stop_, stream_) == cudaSuccess;
  }
  // After the stream is synchronized: the kernel's seconds (nullopt when the events failed).
  std::optional<double> Seconds() {
    float ms = 0;
    if (!ok_ || cudaEventElapsedTime(&ms, start_, stop_) != cudaSuccess) return std::nullopt;
    return ms / 1e3;
  }
  ~KernelTimer() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    cudaGetLastError();
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  bool ok_ = false;
};

class GpuStreamConverter final : public SlicedConverter {
 public:
  GpuStreamConverter(Gpu& gpu, Gpu::StreamLease lease, PinnedHostPool* pinned, bool counted)
      : gpu_(gpu), counted_(counted), lease_(std::move(lease)), pool_(pinned) {}

  absl::Status Init(const Plan& plan, uint64_t target, absl::Time memory_deadline) {
    InitSlicing(plan, target);
    engine_ = absl::StrCat("cuda:", FormatUuid(gpu_.info().uuid));
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu_.info().ordinal));
    const uint64_t slice_out = matrix_in_ == 0 ? matrix_out_ : slice_in_ / matrix_in_ * matrix_out_;
    absl::StatusOr<PinnedHostPool::Buffer> pin_in = pool_->Get(slice_in_);
    if (!pin_in.ok()) return pin_in.status();
    absl::StatusOr<PinnedHostPool::Buffer> pin_out = pool_->Get(slice_out);
    if (!pin_out.ok()) return pin_out.status();
    pinned_in_ = *std::move(pin_in);
    pinned_out_ = *std::move(pin_out);
    mem_ = std::make_unique<RequestMemory>(&gpu_.allocator(), lease_.stream());
    if (absl::Status s = mem_->Reserve(slice_in_ + slice_out, memory_deadline); !s.ok()) return s;
    absl::StatusOr<void*> a = mem_->Allocate(slice_in_);
    if (!a.ok()) return a.status();
    absl::StatusOr<void*> b = mem_->Allocate(slice_out);
    if (!b.ok()) return b.status();
    d_in_ = *a;
    d_out_ = *b;
    return absl::OkStatus();
  }

  absl::StatusOr<absl::Span<const uint8_t>> ConvertSlice(absl::Span<const uint8_t> in) override {
    absl::StatusOr<const Plan*> p = SlicePlan(in.size());
    if (!p.ok()) return p.status();
    const uint64_t out_bytes = (*p)->output_bytes;
    cudaStream_t st = lease_.stream();
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu_.info().ordinal));
    if (!in.empty()) {
      // Staged through pinned memory so the copy is DMA, not a driver-staged pageable copy.
      std::memcpy(pinned_in_.data(), in.data(), in.size());
      WPREP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(d_in_, pinned_in_.data(), in.size(), cudaMemcpyHostToDevice, st));
    }
    KernelTimer timer(st);
    if (absl::Status s = ConvertOnCuda(**p, d_in_, d_out_, st); !s.ok()) return s;
    timer.Stop();
    if (out_bytes > 0) {
      WPREP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(pinned_out_.data(), d_out_, out_bytes, cudaMemcpyDeviceToHost, st));
    }
    WPREP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    RecordConversion(gpu_.metrics(), counted_, timer.Seconds(), out_bytes);
    return absl::Span<const uint8_t>(pinned_out_.data(), out_bytes);
  }
  uint64_t peak_extra_device_bytes() const override { return mem_ ? mem_->peak() : 0; }

 private:
  Gpu& gpu_;
  const bool counted_;
  // Destroyed in reverse order: mem_ (frees, waits for the stream) before the pinned
  // buffers return to the pool and the stream returns to the GPU.
  Gpu::StreamLease lease_;
  PinnedHostPool* pool_;
  PinnedHostPool::Buffer pinned_in_, pinned_out_;
  std::unique_ptr<RequestMemory> mem_;
  void* d_in_ = nullptr;
  void* d_out_ = nullptr;
};
#endif

}  // namespace

Executor::Executor(DeviceManager* devices, IpcCache* ipc, Metrics* metrics,
                   uint64_t stream_slice_bytes, absl::Duration memory_wait)
    : devices_(devices),
      ipc_(ipc),
      metrics_(metrics),
      stream_slice_bytes_(stream_slice_bytes),
      memory_wait_(memory_wait) {}

absl::StatusOr<Gpu*> Executor::PickGpu(const ConvertInput& input, const ConvertOutput& output,
                                       const std::optional<Uuid>& preferred) {
  Gpu* in_gpu = nullptr;
  Gpu* out_gpu = nullptr;
  if (input.ipc) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(input.ipc->uuid, input.ipc->field + ".device_uuid");
    if (!g.ok()) return g.status();
    in_gpu = *g;
  }
  if (output.ipc) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(output.ipc->uuid, output.ipc->field + ".device_uuid");
    if (!g.ok()) return g.status();
    out_gpu = *g;
  }
  if (in_gpu != nullptr && out_gpu != nullptr && in_gpu != out_gpu) {
    return absl::InvalidArgumentError(
        "source_ipc and destination_ipc name different GPUs; both buffers must be on one GPU");
  }
  if (in_gpu != nullptr) return in_gpu;
  if (out_gpu != nullptr) return out_gpu;
  if (preferred) return devices_->FindByUuid(*preferred, "device_uuid");
  return devices_->LeastLoaded();
}

absl::StatusOr<ConvertOutcome> Executor::Convert(const ConversionSpec& spec,
                                                 absl::Span<const int64_t> logical_shape,
                                                 const ConvertInput& input,
                                                 const ConvertOutput& output,
                                                 const std::optional<Uuid>& preferred,
                                                 absl::Time deadline, bool counted) {
  InputBinding binding;
  if (input.ipc) {
    binding.strides = input.ipc->strides;
    binding.buffer_bytes = input.ipc->size;
  } else {
    binding.buffer_bytes = input.bytes->size();
  }
  absl::StatusOr<Plan> plan = MakePlan(spec, logical_shape, binding);
  if (!plan.ok()) return plan.status();
  if (output.ipc) {
    if (!output.ipc->strides.empty()) {
      return absl::InvalidArgumentError(
          "destination_ipc.strides must be empty: outputs are always written densely");
    }
    if (output.ipc->size < plan->output_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination_ipc.size is ", output.ipc->size, " bytes but the output needs ",
          plan->output_bytes, " (see Plan)"));
    }
  }
  absl::StatusOr<Gpu*> gpu = PickGpu(input, output, preferred);
  if (!gpu.ok()) return gpu.status();
  if (absl::Status s = CheckDeadline(deadline); !s.ok()) return s;

  ConvertOutcome outcome;
  outcome.plan = *plan;
  if (*gpu != nullptr) {
    if (absl::Status s = RunOnGpu(**gpu, *plan, input, output, deadline, counted, &outcome); !s.ok()) {
      return s;
    }
    return outcome;
  }
  // The CPU engine (no GPU in use; IPC requests were rejected above).
  DeviceMetrics* m = devices_->cpu_metrics();
  CpuInFlight in_flight(m);
  outcome.engine = "cpu";
  output.bytes->resize(plan->output_bytes);
  const absl::Time start = absl::Now();
  absl::Status s = ConvertOnCpu(*plan, reinterpret_cast<const uint8_t*>(input.bytes->data()),
                                input.bytes->size(), reinterpret_cast<uint8_t*>(output.bytes->data()),
                                output.bytes->size(), CpuOptions{devices_->cpu_threads()});
  if (!s.ok()) return s;
  RecordConversion(m, counted, SecondsSince(start), plan->output_bytes);
  return outcome;
}

absl::Status Executor::RunOnGpu(Gpu& gpu, const Plan& plan, const ConvertInput& input,
                                const ConvertOutput& output, absl::Time deadline, bool counted,
                                ConvertOutcome* outcome) {
#if WPREP_HAVE_CUDA
  outcome->engine = absl::StrCat("cuda:", FormatUuid(gpu.info().uuid));
  const int ordinal = gpu.info().ordinal;
  // Map the IPC buffers first: a bad handle fails before any stream or memory is held.
  IpcCache::Lease src_lease, dst_lease;
  if (input.ipc) {
    absl::StatusOr<IpcCache::Lease> l =
        ipc_->Acquire(ordinal, input.ipc->handle, input.ipc->offset, input.ipc->size, input.ipc->field);
    if (!l.ok()) return l.status();
    src_lease = *std::move(l);
  }
  if (output.ipc) {
    absl::StatusOr<IpcCache::Lease> l = ipc_->Acquire(ordinal, output.ipc->handle, output.ipc->offset,
                                                      output.ipc->size, output.ipc->field);
    if (!l.ok()) return l.status();
    dst_lease = *std::move(l);
  }
  absl::StatusOr<Gpu::StreamLease> lease = gpu.AcquireStream(deadline);
  if (!lease.ok()) return lease.status();
  cudaStream_t st = lease->stream();
  // Events and copies below belong to this GPU: name it rather than trust the thread's
  // current device (the daemon never relies on one).
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  // Pinned staging for the inline sides (declared before `mem`, whose destructor waits for
  // the stream, so no copy still reads them when they return to the pool). When pinned
  // memory is short the copies fall back to pageable memory.
  PinnedHostPool::Buffer pin_in, pin_out;
  if (!input.ipc && plan.input_bytes > 0) {
    absl::StatusOr<PinnedHostPool::Buffer> b = devices_->pinned().Get(plan.input_bytes);
    if (b.ok()) pin_in = *std::move(b);
  }
  if (!output.ipc && plan.output_bytes > 0) {
    absl::StatusOr<PinnedHostPool::Buffer> b = devices_->pinned().Get(plan.output_bytes);
    if (b.ok()) pin_out = *std::move(b);
  }
  RequestMemory mem(&gpu.allocator(), st);
  const uint64_t need = (input.ipc ? 0 : plan.input_bytes) + (output.ipc ? 0 : plan.output_bytes);
  if (absl::Status s = mem.Reserve(need, std::min(deadline, absl::Now() + memory_wait_)); !s.ok()) {
    return s;
  }
  const void* d_in = src_lease.ptr();
  void* d_out = dst_lease.ptr();
  if (!input.ipc) {
    absl::StatusOr<void*> p = mem.Allocate(plan.input_bytes);
    if (!p.ok()) return p.status();
    if (plan.input_bytes > 0) {
      const void* src = input.bytes->data();
      if (pin_in.data() != nullptr) {
        std::memcpy(pin_in.data(), input.bytes->data(), plan.input_bytes);
        src = pin_in.data();
      }
      WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(*p, src, plan.input_bytes, cudaMemcpyHostToDevice, st));
    }
    d_in = *p;
  }
  if (!output.ipc) {
    absl::StatusOr<void*> p = mem.Allocate(plan.output_bytes);
    if (!p.ok()) return p.status();
    d_out = *p;
  }
  KernelTimer timer(st);
  if (absl::Status s = ConvertOnCuda(plan, d_in, d_out, st); !s.ok()) return s;
  timer.Stop();
  if (!output.ipc && pin_out.data() == nullptr) output.bytes->resize(plan.output_bytes);
  if (!output.ipc && plan.output_bytes > 0) {
    void* dst = pin_out.data() != nullptr ? static_cast<void*>(pin_out.data()) : output.bytes->data();
    WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, d_out, plan.output_bytes, cudaMemcpyDeviceToHost, st));
  }
  // The client reads its IPC destination as soon as we answer: finish before replying.
  WPREP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  if (!output.ipc && pin_out.data() != nullptr) {
    output.bytes->assign(reinterpret_cast<const char*>(pin_out.data()), plan.output_bytes);
  }
  outcome->kernel_seconds = timer.Seconds();
  RecordConversion(gpu.metrics(), counted, outcome->kernel_seconds, plan.output_bytes);
  outcome->peak_extra_device_bytes = mem.peak();
  return absl::OkStatus();
#else
  (void)gpu, (void)plan, (void)input, (void)output, (void)deadline, (void)counted, (void)outcome;
  return absl::InternalError("GPU selected in a build without CUDA");
#endif
}

absl::StatusOr<std::unique_ptr<StreamConverter>> Executor::StartStream(
    const ConversionSpec& spec, absl::Span<const int64_t> logical_shape,
    const std::optional<Uuid>& preferred, absl::Time deadline, bool counted) {
  absl::StatusOr<Plan> plan = MakePlan(spec, logical_shape);
  if (!plan.ok()) return plan.status();
  Gpu* gpu = nullptr;
  if (preferred) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(*preferred, "header.device_uuid");
    if (!g.ok()) return g.status();
    gpu = *g;
  } else {
    gpu = devices_->LeastLoaded();
  }
  if (gpu == nullptr) {
    return std::unique_ptr<StreamConverter>(std::make_unique<CpuStreamConverter>(
        *plan, stream_slice_bytes_, devices_->cpu_threads(), devices_->cpu_metrics(), counted));
  }
#if WPREP_HAVE_CUDA
  absl::StatusOr<Gpu::StreamLease> lease = gpu->AcquireStream(deadline);
  if (!lease.ok()) return lease.status();
  auto conv =
      std::make_unique<GpuStreamConverter>(*gpu, *std::move(lease), &devices_->pinned(), counted);
  if (absl::Status s = conv->Init(*plan, stream_slice_bytes_, std::min(deadline, absl::Now() + memory_wait_));
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<StreamConverter>(std::move(conv));
#else
  (void)deadline;
  return absl::InternalError("GPU selected in a build without CUDA");
#endif
}

}  // namespace wprep::server
