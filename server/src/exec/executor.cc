#include "exec/executor.h"

#include <algorithm>
#include <system_error>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "device/device_run.h"
#include "exec/operand_error.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

// Early answers whose work may wait at once: each holds its mappings' leases and a few
// events, and the GPU's progress frees them.
constexpr size_t kMaxPendingEarlyAnswers = 256;

Executor::Executor(DeviceManager* devices, IpcCache* ipc, const StreamSlicing& slicing, absl::Duration memory_wait,
                   absl::Duration ready_timeout)
    : devices_(devices),
      ipc_(ipc),
      slicing_(slicing),
      memory_wait_(memory_wait),
      ready_words_(ready_timeout),
      completions_(&devices->runtime(), kMaxPendingEarlyAnswers) {}

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
  return RunOnCpu(job, inline_output);
}

absl::StatusOr<ConvertOutcome> Executor::RunOnCpu(const ConvertJob& job, std::string* inline_output) {
  // No GPU is in use, so PickGpu admitted inline bytes on both sides only.
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

absl::StatusOr<Executor::Mapped> Executor::MapIpc(Gpu& gpu, const ConvertJob& job) {
  Mapped m;
  if (job.source_ipc) {
    const IpcRegion& r = *job.source_ipc;
    absl::StatusOr<IpcCache::Lease> l = ipc_->Acquire(gpu.ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) return OperandError(Operand::kSource, "", l.status());
    m.source = *std::move(l);
  }
  if (job.destination_ipc) {
    const IpcRegion& r = *job.destination_ipc;
    absl::StatusOr<IpcCache::Lease> l = ipc_->Acquire(gpu.ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) return OperandError(Operand::kDestination, "", l.status());
    m.destination = *std::move(l);
  }
  return m;
}

absl::StatusOr<ConvertOutcome> Executor::RunOnGpu(Gpu& gpu, const ConvertJob& job,
                                                  std::string* inline_output, absl::Time deadline) {
  const Plan& plan = job.plan;
  // Map the IPC buffers first: a bad handle fails before any stream or memory is held.
  WPREP_ASSIGN_OR_RETURN(Mapped mapped, MapIpc(gpu, job));
  IpcCache::Lease& src = mapped.source;
  IpcCache::Lease& dst = mapped.destination;
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

namespace {

// An operand error of batch job `i`, marked with its index (a batch-wide GPU is no item's).
absl::Status OfItem(size_t i, absl::Status s) {
  std::optional<OperandPath> path = OperandPathOf(s);
  if (path && path->operand == Operand::kDevice) return s;
  return ForItem(static_cast<int>(i), std::move(s));
}

}  // namespace

absl::StatusOr<Executor::Placement> Executor::Place(const std::vector<ConvertJob>& jobs) {
  // Every job's engine first, then every mapping: all checks before any work.
  Placement p;
  p.gpus.resize(jobs.size(), nullptr);
  for (size_t i = 0; i < jobs.size(); ++i) {
    absl::StatusOr<Gpu*> g = PickGpu(jobs[i]);
    if (!g.ok()) return OfItem(i, g.status());
    p.gpus[i] = *g;
  }
  p.mapped.resize(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (p.gpus[i] == nullptr) {
      p.on_cpu.push_back(i);
      continue;
    }
    absl::StatusOr<Mapped> m = MapIpc(*p.gpus[i], jobs[i]);
    if (!m.ok()) return OfItem(i, m.status());
    p.mapped[i] = *std::move(m);
    p.by_gpu[p.gpus[i]].push_back(i);
  }
  return p;
}

absl::StatusOr<Executor::BatchOutcome> Executor::ConvertBatch(const std::vector<ConvertJob>& jobs,
                                                              const std::vector<std::string*>& inline_outputs,
                                                              absl::Time deadline, BatchFences* fences) {
  // 1. Pick every job's GPU and map its IPC buffers.
  WPREP_ASSIGN_OR_RETURN(Placement placed, Place(jobs));
  // 2. Open the fences, with the other checks: a refused batch leaves nothing queued.
  std::vector<bool> has_ipc(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) has_ipc[i] = jobs[i].source_ipc || jobs[i].destination_ipc;
  WPREP_ASSIGN_OR_RETURN(ClientFence fence,
                         ClientFence::Open({devices_, ipc_, &host_words_, &ready_words_}, fences, placed.gpus, has_ipc));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed before the batch started");
  }
  BatchOutcome out;
  out.outcomes.resize(jobs.size());
  // 3 and 4. Run, and answer once queued (the fence's one GPU) or once everything is done.
  if (Gpu* queued = fence.queued_gpu(); queued != nullptr) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (!jobs[i].source_ipc || !jobs[i].destination_ipc) {
        return absl::InternalError(absl::StrCat("item ", i, " is not IPC -> IPC in a batch answered once queued"));
      }
    }
    WPREP_RETURN_IF_ERROR(RunBatchOnGpu(*queued, jobs, placed.by_gpu.begin()->second, placed.mapped, inline_outputs,
                                        deadline, &out, fence, fences));
    return out;
  }
  WPREP_RETURN_IF_ERROR(RunEverywhere(jobs, placed, inline_outputs, deadline, &out, fence));
  return out;
}

absl::Status Executor::RunEverywhere(const std::vector<ConvertJob>& jobs, Placement& placed,
                                     const std::vector<std::string*>& inline_outputs, absl::Time deadline,
                                     BatchOutcome* out, ClientFence& fence) {
  for (size_t i : placed.on_cpu) {
    absl::StatusOr<ConvertOutcome> r = RunOnCpu(jobs[i], inline_outputs[i]);
    if (!r.ok()) return OfItem(i, r.status());
    out->outcomes[i] = *std::move(r);
  }
  // Each GPU on its own thread (the calling thread takes the last); a GPU whose thread
  // cannot start runs on the calling thread too.
  std::vector<std::pair<Gpu*, const std::vector<size_t>*>> groups;
  groups.reserve(placed.by_gpu.size());
  for (const auto& [g, items] : placed.by_gpu) groups.emplace_back(g, &items);
  std::vector<BatchOutcome> partial(groups.size());
  std::vector<absl::Status> results(groups.size());
  auto run = [&](size_t k) {
    partial[k].outcomes.resize(jobs.size());
    results[k] = RunBatchOnGpu(*groups[k].first, jobs, *groups[k].second, placed.mapped, inline_outputs, deadline,
                               &partial[k], fence, nullptr);
  };
  std::vector<std::thread> threads;
  for (size_t k = 0; k + 1 < groups.size(); ++k) {
    try {
      threads.emplace_back(run, k);
    } catch (const std::system_error&) {
      run(k);
    }
  }
  if (!groups.empty()) run(groups.size() - 1);
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < groups.size(); ++k) {
    WPREP_RETURN_IF_ERROR(results[k]);
    for (size_t i : *groups[k].second) out->outcomes[i] = std::move(partial[k].outcomes[i]);
    out->peak_extra_device_bytes += partial[k].peak_extra_device_bytes;
  }
  return absl::OkStatus();
}

absl::Status Executor::RunBatchOnGpu(Gpu& gpu, const std::vector<ConvertJob>& jobs, const std::vector<size_t>& on_gpu,
                                     std::vector<Mapped>& mapped, const std::vector<std::string*>& inline_outputs,
                                     absl::Time deadline, BatchOutcome* out, ClientFence& fence,
                                     BatchFences* fences) {
  // The jobs go round-robin over up to all of the GPU's streams, each a DeviceRun staged
  // for the largest host-side item, so any item can run on any lane. Only the first lane
  // waits for a stream and memory; the others are taken only if free at once. A batch
  // never waits while it holds a stream, so concurrent batches cannot deadlock, each
  // holding some streams and waiting for more: with fewer lanes it runs on fewer streams.
  DeviceRun::Staging staging;
  for (size_t i : on_gpu) {
    if (!jobs[i].source_ipc) staging.input_bytes = std::max(staging.input_bytes, jobs[i].plan.input_bytes);
    if (!jobs[i].destination_ipc) staging.output_bytes = std::max(staging.output_bytes, jobs[i].plan.output_bytes);
  }
  const size_t want = std::min<size_t>(on_gpu.size(), static_cast<size_t>(std::max(1, gpu.streams())));
  std::vector<std::unique_ptr<DeviceRun>> runs;
  {
    WPREP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceRun> first,
                           DeviceRun::Begin(gpu, devices_->pinned(), staging, deadline, MemoryDeadline(deadline)));
    runs.push_back(std::move(first));
  }
  while (runs.size() < want) {
    const absl::Time now = absl::Now();  // a deadline already reached: take what is free, wait for nothing
    absl::StatusOr<std::unique_ptr<DeviceRun>> more = DeviceRun::Begin(gpu, devices_->pinned(), staging, now, now);
    if (!more.ok()) break;
    runs.push_back(*std::move(more));
  }
  const size_t k = runs.size();
  std::vector<Stream> streams;
  streams.reserve(k);
  for (const auto& run : runs) streams.push_back(run->stream());
  WPREP_RETURN_IF_ERROR(fence.WaitOn(gpu, streams));
  std::vector<std::vector<size_t>> lanes(k);
  for (size_t n = 0; n < on_gpu.size(); ++n) lanes[n % k].push_back(on_gpu[n]);
  for (size_t lane = 0; lane < k; ++lane) {
    for (size_t i : lanes[lane]) {
      const ConvertJob& job = jobs[i];
      ConvertOutcome& o = out->outcomes[i];
      o.engine = gpu.engine_name();
      o.engine_metrics = gpu.metrics();
      void* device_out = job.destination_ipc ? mapped[i].destination.ptr() : nullptr;
      if (job.source_ipc && job.destination_ipc) {
        absl::Status s = runs[lane]->Enqueue(job.plan, mapped[i].source.ptr(), device_out);
        if (!s.ok()) return ForItem(static_cast<int>(i), s);
        continue;
      }
      const RunInput in = job.source_ipc ? RunInput::Device(mapped[i].source.ptr())
                                         : RunInput::Host(reinterpret_cast<const uint8_t*>(job.source_bytes.data()));
      absl::StatusOr<DeviceRun::Result> r = runs[lane]->Convert(job.plan, in, device_out);
      if (!r.ok()) return ForItem(static_cast<int>(i), r.status());
      o.kernel_seconds = r->kernel_seconds;
      if (!job.destination_ipc) {
        inline_outputs[i]->assign(reinterpret_cast<const char*>(r->host_output.data()), r->host_output.size());
      }
    }
  }
  if (fences != nullptr) return HandOff(gpu, lanes, runs, on_gpu, mapped, fence, fences);
  // Every lane's launches, then their kernel times in launch order.
  for (size_t lane = 0; lane < k; ++lane) {
    WPREP_ASSIGN_OR_RETURN(std::vector<std::optional<double>> seconds, runs[lane]->Wait());
    size_t next = 0;
    for (size_t i : lanes[lane]) {
      if (jobs[i].source_ipc && jobs[i].destination_ipc && next < seconds.size()) {
        out->outcomes[i].kernel_seconds = seconds[next++];
      }
    }
    out->peak_extra_device_bytes += runs[lane]->peak_extra_device_bytes();
  }
  return absl::OkStatus();
}

absl::Status Executor::HandOff(Gpu& gpu, const std::vector<std::vector<size_t>>& lanes,
                               std::vector<std::unique_ptr<DeviceRun>>& runs, const std::vector<size_t>& on_gpu,
                               std::vector<Mapped>& mapped, ClientFence& fence, BatchFences* fences) {
  // What the work needs until it is done. The streams go back now: work queued on one
  // later runs after this.
  struct Held {
    std::vector<Mapped> mapped;
    ClientFence::Words words;
    std::vector<std::pair<size_t, std::unique_ptr<DeviceTimer>>> timers;  // job index, its timer
    std::vector<Event> events;  // the GPU's, back to it once done
    std::shared_ptr<void> keep;
  } held;
  auto give_back = [&gpu](std::vector<Event>& events) {
    for (Event e : events) gpu.GiveEvent(e);
    events.clear();
  };
  // The signal fence and the daemon's own event come after every job.
  WPREP_ASSIGN_OR_RETURN(Event done, gpu.TakeEvent());
  held.events.push_back(done);
  std::vector<Stream> streams;
  streams.reserve(runs.size());
  for (const auto& run : runs) streams.push_back(run->stream());
  absl::Status s = fence.SignalAfter(streams, done, &held.events);
  held.words = fence.TakeWords();
  if (!s.ok()) {
    give_back(held.events);
    return s;
  }
  for (size_t lane = 0; lane < runs.size(); ++lane) {
    std::vector<std::unique_ptr<DeviceTimer>> timers = runs[lane]->TakeTimers();
    for (size_t n = 0; n < lanes[lane].size() && n < timers.size(); ++n) {
      held.timers.emplace_back(lanes[lane][n], std::move(timers[n]));
    }
  }
  for (size_t i : on_gpu) held.mapped.push_back(std::move(mapped[i]));
  held.keep = std::move(fences->keep);
  completions_.Add({gpu.ordinal(), done,
                    [held = std::move(held), finish = std::move(fences->done), gpu = &gpu, give_back,
                     jobs = mapped.size()](const absl::Status& s) mutable {
                      std::vector<std::optional<double>> seconds(jobs);
                      if (s.ok()) {
                        for (auto& [i, timer] : held.timers) seconds[i] = timer->Seconds();
                      }
                      give_back(held.events);
                      if (finish) std::move(finish)(s, gpu->metrics(), seconds);
                    }});
  return absl::OkStatus();
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
