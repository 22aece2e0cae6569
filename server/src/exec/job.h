// The executor's jobs: one conversion planned at the wire edge (ConvertJob), the memory
// it names, what a batch waits for and what it does once done, and what ran. The edge
// (rpc/proto_translate.h) builds and reads these without depending on the executor.
#ifndef WPREP_SERVER_SRC_EXEC_JOB_H_
#define WPREP_SERVER_SRC_EXEC_JOB_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "device/device_runtime.h"
#include "wprep/kernels/plan.h"

namespace wprep::server {

struct DeviceMetrics;  // net/metrics.h

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

// A 32-bit word of a client's and a value (IpcFlagRef): GPU memory (an IPC region of 4
// bytes) or a word of a file in /dev/shm; at most one of the two.
struct ClientWord {
  std::optional<IpcRegion> buffer;
  struct Shared {
    std::string name;
    uint64_t offset = 0;
  };
  std::optional<Shared> host;
  uint32_t value = 0;
  bool set() const { return buffer.has_value() || host.has_value(); }
};

// A batch answered as soon as its work is queued (ConvertBatchRequest.completion_event or
// completion_flag): the client's interprocess event to record after the work and/or its
// word to write then, what to keep until the work is done, and what to do then.
struct EarlyAnswer {
  std::string event_handle;  // kIpcEventHandleBytes of cudaIpcEventHandle_t; empty: none
  Uuid event_gpu{};          // the GPU the event was made on
  // ConvertBatchRequest.completion_flag, written with its value after the work and the
  // event's record (a GPU word must be on the items' GPU); unset when the request has none.
  ClientWord flag;
  std::shared_ptr<void> keep;  // released once the work is done (the admission ticket)
  // Runs on the completions thread once the work is done: the wait's status, the GPU's
  // metrics and each job's kernel seconds, in job order.
  absl::AnyInvocable<void(const absl::Status&, DeviceMetrics*, const std::vector<std::optional<double>>&) &&> done;
};

// What a batch's work waits for on the GPU, in place of the client's host waiting before
// the call: the client's interprocess event (ConvertBatchRequest.ready_event), or a word
// of the client's to hold a value (ready_flag), one of the two.
struct ReadyEvent {
  std::string handle;  // kIpcEventHandleBytes of cudaIpcEventHandle_t
  Uuid gpu{};          // the GPU the event was made on
  ClientWord flag;     // ready_flag instead, when set
  // For a host word: the ConvertBatches stream that sent the batch (0: none), whose end
  // cancelled releases the word (ReadyWords), and the request id the log names.
  uint64_t owner = 0;
  uint64_t request_id = 0;
};

// What ran, for the reply and for the call's single exit (metrics, log).
struct ConvertOutcome {
  std::string engine;                    // "cpu" or "cuda:GPU-..."
  DeviceMetrics* engine_metrics = nullptr;
  std::optional<double> kernel_seconds;  // the conversion alone
  uint64_t peak_extra_device_bytes = 0;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_JOB_H_
