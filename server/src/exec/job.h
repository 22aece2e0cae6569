// The executor's jobs, as the wire edge (rpc/proto_translate.h) builds them without
// depending on the executor: one conversion planned at the edge (ConvertJob), the client
// memory it names (IpcRegion), a batch's ordering against its client's GPU work
// (BatchFences), and what ran (ConvertOutcome). Plain data: nothing here opens or maps.
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

// One side of a batch's ordering: a client's interprocess event and/or a 32-bit word of
// the client's (4 bytes of its GPU memory, or a word of a file in /dev/shm) with a value.
struct FenceRef {
  struct EventRef {
    std::string handle;  // kIpcEventHandleBytes of cudaIpcEventHandle_t
    Uuid gpu{};          // the GPU the event was made on
  };
  struct WordRef {
    std::optional<IpcRegion> gpu_memory;  // one of the two
    std::optional<std::string> host_file;
    uint64_t host_offset = 0;
    uint32_t value = 0;
  };
  std::optional<EventRef> event;
  std::optional<WordRef> word;
  bool empty() const { return !event && !word; }
};

// A batch's ordering as the edge checked it: `wait` is at most one of an event and a
// word; `signal` (an event, a word or both: the event is recorded first) only with
// `queued_answer`, which also needs every job IPC -> IPC.
struct BatchFences {
  FenceRef wait;
  FenceRef signal;
  bool queued_answer = false;
  // A wait for a host word: the ConvertBatches stream that sent it (0: none), whose end
  // cancelled releases the word, and the request id the log names.
  uint64_t owner = 0;
  uint64_t request_id = 0;
  // A queued answer: `keep` is released once the work is done, and `done` runs then on the
  // completions thread with the wait's status, the GPU's metrics and each job's kernel
  // seconds, in job order.
  std::shared_ptr<void> keep;
  absl::AnyInvocable<void(const absl::Status&, DeviceMetrics*, const std::vector<std::optional<double>>&) &&> done;
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

// What ran, for the reply and for the call's single exit (metrics, log).
struct ConvertOutcome {
  std::string engine;                    // "cpu" or "cuda:GPU-..."
  DeviceMetrics* engine_metrics = nullptr;
  std::optional<double> kernel_seconds;  // the conversion alone
  uint64_t peak_extra_device_bytes = 0;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_JOB_H_
