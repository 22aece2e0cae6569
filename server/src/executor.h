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

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "device_manager.h"
#include "ipc_cache.h"
#include "metrics.h"
#include "stream_converter.h"
#include "wprep/kernels/plan.h"

namespace wprep::server {

// A region of a client's GPU memory, named by an IPC handle.
struct IpcRegion {
  std::string handle;  // kIpcHandleBytes of cudaIpcMemHandle_t
  uint64_t offset = 0;  // from the allocation's base
  uint64_t size = 0;    // bytes from offset the request may touch
  Uuid gpu{};           // the GPU holding the allocation
};

// One conversion, planned once at the edge (the plan's input binding is the source's).
struct ConvertJob {
  Plan plan;
  // The source: inline bytes (exactly plan.input_bytes), or IPC memory.
  absl::string_view source_bytes;
  std::optional<IpcRegion> source_ipc;
  // The destination: IPC memory, or unset for inline bytes.
  std::optional<IpcRegion> destination_ipc;
  // The GPU asked for a bytes -> bytes conversion; unset lets the executor pick.
  std::optional<Uuid> gpu;
};

// One conversion, planned once at the edge, may also read its source as a strided view
// of inline bytes (the plan's binding says so).

// What ran, for the reply and for the call's single exit (metrics, log).
struct ConvertOutcome {
  std::string engine;                    // "cpu" or "cuda:GPU-..."
  DeviceMetrics* engine_metrics = nullptr;
  std::optional<double> kernel_seconds;  // the conversion alone
  uint64_t peak_extra_device_bytes = 0;
};

class Executor {
 public:
  Executor(DeviceManager* devices, IpcCache* ipc, const StreamSlicing& slicing, absl::Duration memory_wait);

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
  absl::StatusOr<BatchOutcome> ConvertBatch(const std::vector<ConvertJob>& jobs,
                                            const std::vector<std::string*>& inline_outputs,
                                            absl::Time deadline);

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
  absl::Status RunBatchOnGpu(Gpu& gpu, const std::vector<ConvertJob>& jobs, const std::vector<size_t>& items,
                             std::vector<Mapped>& mapped, const std::vector<std::string*>& inline_outputs,
                             absl::Time deadline, BatchOutcome* out);
  absl::Time MemoryDeadline(absl::Time deadline) const;

  // Constant after construction.
  DeviceManager* const devices_;
  IpcCache* const ipc_;
  const StreamSlicing slicing_;
  const absl::Duration memory_wait_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXECUTOR_H_
