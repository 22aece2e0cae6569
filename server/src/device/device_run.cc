#include "device/device_run.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/spec/spec.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

absl::Status DeviceRun::HostStage::Get(PinnedHostPool& pool, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  absl::StatusOr<PinnedHostPool::Buffer> b = pool.Get(bytes);
  if (b.ok()) {
    pinned_ = *std::move(b);
    return absl::OkStatus();
  }
  // Pinned memory is short: copies from ordinary memory work, staged by the driver.
  heap_.reset(new (std::nothrow) uint8_t[bytes]);
  if (heap_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no host memory for ", bytes, " bytes of staging; retry later"));
  }
  return absl::OkStatus();
}

DeviceRun::DeviceRun(Gpu& gpu, Gpu::StreamLease lease)
    : gpu_(gpu), lease_(std::move(lease)), memory_(&gpu.allocator(), lease_.stream()) {}

DeviceRun::~DeviceRun() = default;

absl::StatusOr<std::unique_ptr<DeviceRun>> DeviceRun::Begin(Gpu& gpu, PinnedHostPool& pinned,
                                                            const Staging& staging,
                                                            absl::Time deadline,
                                                            absl::Time memory_deadline) {
  WPREP_ASSIGN_OR_RETURN(Gpu::StreamLease lease, gpu.AcquireStream(deadline));
  std::unique_ptr<DeviceRun> run(new DeviceRun(gpu, std::move(lease)));
  run->staging_ = staging;
  WPREP_RETURN_IF_ERROR(run->stage_in_.Get(pinned, staging.input_bytes));
  WPREP_RETURN_IF_ERROR(run->stage_out_.Get(pinned, staging.output_bytes));
  absl::Status reserved = run->memory_.Reserve(staging.input_bytes + staging.output_bytes, memory_deadline);
  if (!reserved.ok() && absl::Now() >= deadline) {
    // The call's own deadline ended the wait, not --memory-wait: say so.
    return absl::DeadlineExceededError(absl::StrCat("deadline passed while waiting for device memory: ",
                                                    reserved.message()));
  }
  WPREP_RETURN_IF_ERROR(reserved);
  WPREP_ASSIGN_OR_RETURN(run->device_in_, run->memory_.Allocate(staging.input_bytes));
  WPREP_ASSIGN_OR_RETURN(run->device_out_, run->memory_.Allocate(staging.output_bytes));
  return run;
}

absl::StatusOr<DeviceRun::Result> DeviceRun::Convert(const Plan& plan, RunInput in, void* device_out) {
  if (in.on_host && plan.input_bytes > staging_.input_bytes) {
    return absl::InternalError(absl::StrCat("a ", plan.input_bytes, "-byte host input exceeds the run's ",
                                            staging_.input_bytes, "-byte staging"));
  }
  if (device_out == nullptr && plan.output_bytes > staging_.output_bytes) {
    return absl::InternalError(absl::StrCat("a ", plan.output_bytes, "-byte host output exceeds the run's ",
                                            staging_.output_bytes, "-byte staging"));
  }
  DeviceRuntime& rt = gpu_.runtime();
  const int ordinal = gpu_.ordinal();
  const Stream stream = lease_.stream();
  const void* src = in.device;
  if (in.on_host) {
    if (plan.input_bytes > 0) {
      // Through the staging buffer, so the copy is DMA rather than a driver-staged one.
      std::memcpy(stage_in_.data(), in.host, plan.input_bytes);
      WPREP_RETURN_IF_ERROR(
          rt.CopyToDeviceAsync(ordinal, device_in_, stage_in_.data(), plan.input_bytes, stream));
    }
    src = device_in_;
  }
  void* dst = device_out != nullptr ? device_out : device_out_;
  std::unique_ptr<DeviceTimer> timer = rt.NewTimer(ordinal);
  timer->Start(stream);
  WPREP_RETURN_IF_ERROR(rt.Convert(ordinal, plan, src, dst, stream));
  timer->Stop(stream);
  if (device_out == nullptr && plan.output_bytes > 0) {
    WPREP_RETURN_IF_ERROR(
        rt.CopyToHostAsync(ordinal, stage_out_.data(), device_out_, plan.output_bytes, stream));
  }
  WPREP_RETURN_IF_ERROR(rt.Synchronize(ordinal, stream));
  Result r;
  r.kernel_seconds = timer->Seconds();
  if (device_out == nullptr) r.host_output = absl::Span<const uint8_t>(stage_out_.data(), plan.output_bytes);
  return r;
}

absl::Status DeviceRun::Enqueue(const Plan& plan, const void* device_in, void* device_out) {
  DeviceRuntime& rt = gpu_.runtime();
  std::unique_ptr<DeviceTimer> timer = rt.NewTimer(gpu_.ordinal());
  timer->Start(lease_.stream());
  WPREP_RETURN_IF_ERROR(rt.Convert(gpu_.ordinal(), plan, device_in, device_out, lease_.stream()));
  timer->Stop(lease_.stream());
  enqueued_.push_back(std::move(timer));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::optional<double>>> DeviceRun::Wait() {
  WPREP_RETURN_IF_ERROR(gpu_.runtime().Synchronize(gpu_.ordinal(), lease_.stream()));
  std::vector<std::optional<double>> seconds;
  for (auto& t : enqueued_) seconds.push_back(t->Seconds());
  enqueued_.clear();
  return seconds;
}

}  // namespace wprep::server
