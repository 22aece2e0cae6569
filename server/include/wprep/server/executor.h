// Runs planned conversions on the right engine, moving the bytes between the transports
// (inline bytes, CUDA IPC buffers, streamed slices) and the device. Handlers call it
// after translating protobuf into these kernel-level types. Thread-safe.
#ifndef WPREP_SERVER_EXECUTOR_H_
#define WPREP_SERVER_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "wprep/kernels/plan.h"
#include "wprep/server/device_manager.h"
#include "wprep/server/ipc_cache.h"
#include "wprep/server/metrics.h"

namespace wprep::server {

// A region of a client's GPU memory, named by an IPC handle.
struct IpcBufferRef {
  std::string handle;  // 64 bytes of cudaIpcMemHandle_t
  uint64_t offset = 0;
  uint64_t size = 0;
  Uuid uuid{};
  std::vector<int64_t> strides;  // source only; empty = dense
  std::string field;             // the request field, for messages ("source_ipc")
};

// Exactly one of `bytes` / `ipc` is set.
struct ConvertInput {
  const std::string* bytes = nullptr;
  std::optional<IpcBufferRef> ipc;
};
struct ConvertOutput {
  std::string* bytes = nullptr;  // resized to the output size and filled
  std::optional<IpcBufferRef> ipc;
};

struct ConvertOutcome {
  Plan plan;
  std::string engine;               // "cpu" or "cuda:GPU-..."
  uint64_t peak_extra_device_bytes = 0;
  std::optional<double> kernel_seconds;  // the GPU kernel alone (CUDA events), GPU work only
};

// Converts a streamed tensor slice by slice (groups of whole leading-dim matrices), so
// memory stays at one slice whatever the tensor size. Not thread-safe (one per stream).
class StreamConverter {
 public:
  virtual ~StreamConverter() = default;
  const Plan& plan() const { return plan_; }
  const std::string& engine() const { return engine_; }
  // Input bytes of a full slice; the last slice may be shorter. 0 when the input is empty.
  uint64_t slice_input_bytes() const { return slice_in_; }
  // Converts `in` (a full slice, or the last, shorter one). The output bytes stay valid
  // until the next call.
  virtual absl::StatusOr<absl::Span<const uint8_t>> ConvertSlice(absl::Span<const uint8_t> in) = 0;
  virtual uint64_t peak_extra_device_bytes() const { return 0; }

 protected:
  Plan plan_;
  std::string engine_;
  uint64_t slice_in_ = 0;
  uint64_t matrix_in_ = 0;   // input bytes of one matrix
  uint64_t matrix_out_ = 0;  // output bytes of one matrix
};

class Executor {
 public:
  Executor(DeviceManager* devices, IpcCache* ipc, Metrics* metrics, uint64_t stream_slice_bytes,
           absl::Duration memory_wait);

  // Plans and runs one conversion. `preferred` picks the GPU for bytes->bytes work.
  // Uncounted work (the daemon's own RPC warm-up) stays out of the kernel-time and
  // converted-bytes metrics, which describe clients' traffic.
  absl::StatusOr<ConvertOutcome> Convert(const ConversionSpec& spec,
                                         absl::Span<const int64_t> logical_shape,
                                         const ConvertInput& input, const ConvertOutput& output,
                                         const std::optional<Uuid>& preferred, absl::Time deadline,
                                         bool counted);

  // Plans a streamed conversion (dense input) and picks its engine; `counted` as above.
  absl::StatusOr<std::unique_ptr<StreamConverter>> StartStream(
      const ConversionSpec& spec, absl::Span<const int64_t> logical_shape,
      const std::optional<Uuid>& preferred, absl::Time deadline, bool counted);

 private:
  absl::StatusOr<Gpu*> PickGpu(const ConvertInput& input, const ConvertOutput& output,
                               const std::optional<Uuid>& preferred);
  absl::Status RunOnGpu(Gpu& gpu, const Plan& plan, const ConvertInput& input,
                        const ConvertOutput& output, absl::Time deadline, bool counted,
                        ConvertOutcome* outcome);

  // Constant after construction.
  DeviceManager* const devices_;
  IpcCache* const ipc_;
  Metrics* const metrics_;
  const uint64_t stream_slice_bytes_;
  const absl::Duration memory_wait_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_EXECUTOR_H_
