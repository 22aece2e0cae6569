// Routes planned conversions to an engine: the GPU that owns the request's IPC memory,
// the requested or least-loaded GPU for bytes, or the CPU engine when no GPU serves.
// Handlers call it with kernel-level types after the wire edge (proto_translate.h) has
// checked and planned the request. Thread-safe.
#ifndef WPREP_SERVER_SRC_EXECUTOR_H_
#define WPREP_SERVER_SRC_EXECUTOR_H_

#include <cstdint>
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
#include "exec/ready_words.h"
#include "device/ipc_cache.h"
#include "exec/job.h"
#include "net/metrics.h"
#include "exec/stream_converter.h"
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
  // Every job's GPU is chosen and every IPC buffer mapped and range-checked before any
  // work starts, so one bad job fails the batch (an OperandError marked with its index,
  // operand_error.h) and nothing is written. The jobs of one GPU are spread over its
  // streams and finish together; GPUs work at once.
  struct BatchOutcome {
    std::vector<ConvertOutcome> items;
    uint64_t peak_extra_device_bytes = 0;
  };
  //
  // With `early`, every job must be IPC -> IPC on the event's GPU; the event is opened
  // with the other checks, recorded after every job's work, and the call returns once the
  // work is queued (the outcomes' kernel_seconds unset; early->done gets them). The
  // mappings stay leased, and early->keep held, until the work is done.
  //
  // With `ready`, every job with IPC memory must be on the event's GPU; the event is
  // opened with the other checks (once, when it is early's event too), and every stream
  // of that GPU the batch uses waits for it before the batch's first work there.
  absl::StatusOr<BatchOutcome> ConvertBatch(const std::vector<ConvertJob>& jobs,
                                            const std::vector<std::string*>& inline_outputs,
                                            absl::Time deadline, EarlyAnswer* early = nullptr,
                                            const ReadyEvent* ready = nullptr);

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
  // The batch jobs `items` of one GPU, over its streams; outcomes and the peak added to `out`.
  // With `early` (and its opened `event`), queues the work and hands it to completions_.
  // With `wait`, every stream waits for it first.
  // A completion flag's word, mapped: `ptr` is its address on the GPU while the lease lives.
  struct MappedFlag {
    void* ptr = nullptr;
    IpcCache::Lease ipc;               // a word of GPU memory
    std::shared_ptr<const void> host;  // a word of shared host memory
    uint32_t* host_word = nullptr;     // its address in the daemon
  };
  struct BatchEvents {
    EarlyAnswer* early = nullptr;
    Event completion = nullptr;  // early's, opened
    Event wait = nullptr;        // the ready event, opened, on this GPU
    MappedFlag* flag = nullptr;  // early's completion flag, mapped
    MappedFlag* ready_word = nullptr;  // the ready flag, mapped, on this GPU
    const ReadyEvent* ready = nullptr;  // what ready_word came from (its owner and request id)
    uint32_t ready_value = 0;
  };
  absl::Status RunBatchOnGpu(Gpu& gpu, const std::vector<ConvertJob>& jobs, const std::vector<size_t>& items,
                             std::vector<Mapped>& mapped, const std::vector<std::string*>& inline_outputs,
                             absl::Time deadline, BatchOutcome* out, const BatchEvents& events);
  // RunBatchOnGpu's end with `events.early`: joins the lanes, records the events, writes
  // the flag, hands the leases and timers to completions_.
  absl::Status HandOff(Gpu& gpu, const std::vector<std::vector<size_t>>& lanes,
                       std::vector<std::unique_ptr<DeviceRun>>& runs, const std::vector<size_t>& items,
                       std::vector<Mapped>& mapped, const BatchEvents& events);
  // A client's word mapped on `gpu`: GPU memory of that GPU (`whose` says whose GPU it must
  // be, for the error), in range, aligned; or a word of shared host memory. Errors name
  // `field`.
  absl::StatusOr<MappedFlag> MapWord(Gpu& gpu, const ClientWord& word, absl::string_view field,
                                     absl::string_view whose);
  // A client event's checks: its GPU (`field`.device_uuid) is every IPC job's, and its
  // handle opens there. Sets *gpu to that GPU.
  absl::StatusOr<Event> OpenClientEvent(absl::string_view field, absl::string_view handle, const Uuid& uuid,
                                        const std::vector<Gpu*>& gpus, const std::vector<ConvertJob>& jobs,
                                        Gpu** gpu);
  absl::Time MemoryDeadline(absl::Time deadline) const;

  // Constant after construction.
  DeviceManager* const devices_;
  IpcCache* const ipc_;
  const StreamSlicing slicing_;
  const absl::Duration memory_wait_;
  HostWords host_words_;
  // Before completions_: while that drains, a ready word no client writes is still released.
  ReadyWords ready_words_;
  // Last: its destructor waits for the early answers' work, which holds leases of ipc_
  // and host_words_.
  Completions completions_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXECUTOR_H_
