#include "executor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "device_run.h"
#include "operand_error.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

Executor::Executor(DeviceManager* devices, IpcCache* ipc, const StreamSlicing& slicing, absl::Duration memory_wait)
    : devices_(devices), ipc_(ipc), slicing_(slicing), memory_wait_(memory_wait) {}

absl::Time Executor::MemoryDeadline(absl::Time deadline) const {
  return std::min(deadline, absl::Now() + memory_wait_);
}

absl::StatusOr<Gpu*> Executor::PickGpu(const ConvertJob& job) {
  Gpu* src = nullptr;
  Gpu* dst = nullptr;
  if (job.source_ipc) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(job.source_ipc->gpu);
    if (!g.ok()) return OperandError(Operand::kSource, "device_uuid", g.status());
    src = *g;
  }
  if (job.destination_ipc) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(job.destination_ipc->gpu);
    if (!g.ok()) return OperandError(Operand::kDestination, "device_uuid", g.status());
    dst = *g;
  }
  if (src != nullptr && dst != nullptr && src != dst) {
    return OperandError(Operand::kDestination, "device_uuid",
                        absl::InvalidArgumentError(
                            "names another GPU than the source; both buffers must be on one GPU"));
  }
  if (src != nullptr) return src;
  if (dst != nullptr) return dst;
  if (job.gpu) {
    absl::StatusOr<Gpu*> g = devices_->FindByUuid(*job.gpu);
    if (!g.ok()) return OperandError(Operand::kDevice, "", g.status());
    return *g;
  }
  return devices_->LeastLoaded();
}

absl::StatusOr<ConvertOutcome> Executor::Convert(const ConvertJob& job, std::string* inline_output,
                                                 absl::Time deadline) {
  WPREP_ASSIGN_OR_RETURN(Gpu* gpu, PickGpu(job));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed before the conversion started");
  }
  if (gpu != nullptr) return RunOnGpu(*gpu, job, inline_output, deadline);
  // The CPU engine: no GPU is in use, so the edge admitted inline bytes on both sides.
  ConvertOutcome outcome;
  outcome.engine = "cpu";
  outcome.engine_metrics = devices_->cpu_metrics();
  const InFlight in_flight(outcome.engine_metrics);
  inline_output->resize(job.plan.output_bytes);
  const absl::Time start = absl::Now();
  WPREP_RETURN_IF_ERROR(ConvertOnCpu(job.plan, reinterpret_cast<const uint8_t*>(job.source_bytes.data()),
                                     job.source_bytes.size(), reinterpret_cast<uint8_t*>(inline_output->data()),
                                     inline_output->size(), CpuOptions{devices_->cpu_threads()}));
  outcome.kernel_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return outcome;
}

absl::StatusOr<ConvertOutcome> Executor::RunOnGpu(Gpu& gpu, const ConvertJob& job,
                                                  std::string* inline_output, absl::Time deadline) {
  const Plan& plan = job.plan;
  // Map the IPC buffers first: a bad handle fails before any stream or memory is held.
  IpcCache::Lease src, dst;
  if (job.source_ipc) {
    const IpcRegion& r = *job.source_ipc;
    absl::StatusOr<IpcCache::Lease> l = ipc_->Acquire(gpu.ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) return OperandError(Operand::kSource, "", l.status());
    src = *std::move(l);
  }
  if (job.destination_ipc) {
    const IpcRegion& r = *job.destination_ipc;
    absl::StatusOr<IpcCache::Lease> l = ipc_->Acquire(gpu.ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) return OperandError(Operand::kDestination, "", l.status());
    dst = *std::move(l);
  }
  const DeviceRun::Staging staging{job.source_ipc ? 0 : plan.input_bytes,
                                   job.destination_ipc ? 0 : plan.output_bytes};
  WPREP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceRun> run,
                         DeviceRun::Begin(gpu, devices_->pinned(), staging, deadline, MemoryDeadline(deadline)));
  const RunInput in = job.source_ipc ? RunInput::Device(src.ptr())
                                     : RunInput::Host(reinterpret_cast<const uint8_t*>(job.source_bytes.data()));
  WPREP_ASSIGN_OR_RETURN(DeviceRun::Result r, run->Convert(plan, in, job.destination_ipc ? dst.ptr() : nullptr));
  if (!job.destination_ipc) {
    inline_output->assign(reinterpret_cast<const char*>(r.host_output.data()), r.host_output.size());
  }
  ConvertOutcome outcome;
  outcome.engine = gpu.engine_name();
  outcome.engine_metrics = gpu.metrics();
  outcome.kernel_seconds = r.kernel_seconds;
  outcome.peak_extra_device_bytes = run->peak_extra_device_bytes();
  return outcome;
}

absl::StatusOr<std::unique_ptr<StreamConverter>> Executor::StartStream(const Plan& plan,
                                                                       const std::optional<Uuid>& gpu,
                                                                       absl::Time deadline) {
  Gpu* g = devices_->LeastLoaded();
  if (gpu) {
    absl::StatusOr<Gpu*> found = devices_->FindByUuid(*gpu);
    if (!found.ok()) return OperandError(Operand::kDevice, "", found.status());
    g = *found;
  }
  if (g == nullptr) {
    return NewCpuStreamConverter(plan, slicing_, devices_->cpu_threads(), devices_->cpu_metrics());
  }
  return NewGpuStreamConverter(plan, slicing_, *g, devices_->pinned(), deadline, MemoryDeadline(deadline));
}

}  // namespace wprep::server
