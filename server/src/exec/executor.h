// Routes planned conversions to an engine: the GPU that owns the request's IPC memory,
// the requested or least-loaded GPU for bytes, or the CPU engine when no GPU serves.
// Handlers call it with kernel-level types after the wire edge (proto_translate.h) has
// checked and planned the request. Thread-safe.
#ifndef WPREP_SERVER_SRC_EXECUTOR_H_
#define WPREP_SERVER_SRC_EXECUTOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "device/completions.h"
#include "device/device_manager.h"
#include "device/device_run.h"
#include "device/host_words.h"
#include "device/ipc_cache.h"
#include "exec/client_fence.h"
#include "exec/job.h"
#include "exec/ready_words.h"
#include "exec/stream_converter.h"
#include "net/metrics.h"
#include "wprep/kernels/plan.h"

namespace wprep::server {

class Executor {
 public:
  // `ready_timeout`: how long a batch's streams wait for a ready word of shared host memory
  // before the daemon writes it itself (ReadyWords).
  Executor(DeviceManager* devices, IpcCache* ipc, const StreamSlicing& slicing, absl::Duration memory_wait,
           absl::Duration ready_timeout = absl::Minutes(5));

  // Runs `job`; an inline output is written to `*inline_output` (resized to
  // plan.output_bytes). Errors about the job's source, destination or chosen GPU are
  // OperandErrors (operand_error.h).
  absl::StatusOr<ConvertOutcome> Convert(const ConvertJob& job, std::string* inline_output,
                                         absl::Time deadline);

  // Runs every job of a batch: jobs[i] writes an inline output to *inline_outputs[i].
  // Every job's GPU is chosen, every IPC buffer mapped and range-checked, and the fences
  // opened before any work starts, so one bad job fails the batch (an OperandError marked
  // with its index, operand_error.h) and nothing is written. The jobs of one GPU are
  // spread over its streams and finish together; GPUs work at once. Every stream waits for
  // `fences->wait` before its first job; with `fences->queued_answer` the call returns
  // once the work is queued and the signal fence after it (the outcomes' kernel_seconds
  // unset: fences->done gets them), and the mappings and fences->keep are held until the
  // work is done.
  struct BatchOutcome {
    std::vector<ConvertOutcome> outcomes;  // one per job, in job order
    uint64_t peak_extra_device_bytes = 0;
  };
  absl::StatusOr<BatchOutcome> ConvertBatch(const std::vector<ConvertJob>& jobs,
                                            const std::vector<std::string*>& inline_outputs, absl::Time deadline,
                                            BatchFences* fences = nullptr);

  // Batches answered early whose work is not done yet.
  size_t pending_completions() const { return completions_.pending(); }

  // The ready words (host words) of `owner`'s batches whose client is gone: written now.
  void ReleaseReadyWords(uint64_t owner) { ready_words_.ReleaseOwner(owner); }
  void CountReadyWordReleases(prometheus::Counter* timeout, prometheus::Counter* client_gone) {
    ready_words_.CountIn(timeout, client_gone);
  }
  const ReadyWords& ready_words() const { return ready_words_; }

  // How streams are sliced, the same on every engine (a stream's host memory is sized
  // from it before an engine is picked).
  const StreamSlicing& stream_slicing() const { return slicing_; }

  // Picks the engine of a streamed conversion (dense input) and starts it.
  absl::StatusOr<std::unique_ptr<StreamConverter>> StartStream(const Plan& plan,
                                                               const std::optional<Uuid>& gpu,
                                                               absl::Time deadline);

 private:
  // The GPU that runs `job`, or nullptr for the CPU engine.
  absl::StatusOr<Gpu*> PickGpu(const ConvertJob& job);
  absl::StatusOr<ConvertOutcome> RunOnGpu(Gpu& gpu, const ConvertJob& job, std::string* inline_output,
                                          absl::Time deadline);
  absl::StatusOr<ConvertOutcome> RunOnCpu(const ConvertJob& job, std::string* inline_output);
  // The IPC memory of a job, mapped: source and destination leases.
  struct Mapped {
    IpcCache::Lease source, destination;
  };
  absl::StatusOr<Mapped> MapIpc(Gpu& gpu, const ConvertJob& job);
  // Where a batch's jobs run: each job's GPU (nullptr: the CPU) and mappings, the jobs of
  // each GPU and of the CPU.
  struct Placement {
    std::vector<Gpu*> gpus;
    std::vector<Mapped> mapped;
    std::map<Gpu*, std::vector<size_t>> by_gpu;
    std::vector<size_t> on_cpu;
  };
  absl::StatusOr<Placement> Place(const std::vector<ConvertJob>& jobs);
  // The batch's jobs `on_gpu` of one GPU, over its streams, each waiting for `fence` first;
  // outcomes and the peak added to `out`. On the fence's queued GPU, queues the work and
  // hands it to completions_ (HandOff) instead of waiting for it.
  absl::Status RunBatchOnGpu(Gpu& gpu, const std::vector<ConvertJob>& jobs, const std::vector<size_t>& on_gpu,
                             std::vector<Mapped>& mapped, const std::vector<std::string*>& inline_outputs,
                             absl::Time deadline, BatchOutcome* out, ClientFence& fence, BatchFences* fences);
  // The jobs of every GPU, each GPU on its own thread, and of the CPU; waits for them all.
  absl::Status RunEverywhere(const std::vector<ConvertJob>& jobs, Placement& placed,
                             const std::vector<std::string*>& inline_outputs, absl::Time deadline, BatchOutcome* out,
                             ClientFence& fence);
  // RunBatchOnGpu's end for a queued answer: joins the lanes, signals the fence, hands the
  // leases and timers to completions_.
  absl::Status HandOff(Gpu& gpu, const std::vector<std::vector<size_t>>& lanes,
                       std::vector<std::unique_ptr<DeviceRun>>& runs, const std::vector<size_t>& on_gpu,
                       std::vector<Mapped>& mapped, ClientFence& fence, BatchFences* fences);
  absl::Time MemoryDeadline(absl::Time deadline) const;

  // Constant after construction.
  DeviceManager* const devices_;
  IpcCache* const ipc_;
  const StreamSlicing slicing_;
  const absl::Duration memory_wait_;
  HostWords host_words_;
  // Before completions_: while that drains, a wait word no client writes is still released.
  ReadyWords ready_words_;
  // Last: its destructor waits for the early answers' work, which holds leases of ipc_
  // and host_words_.
  Completions completions_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXECUTOR_H_
