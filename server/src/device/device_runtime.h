// Everything the daemon asks of the GPU runtime, behind one interface. The CUDA
// implementation (cuda_runtime.cc) is the only code in server/ that calls CUDA; host-only
// tests drive the same daemon code through a fake on host memory
// (tests/server/fake_runtime.h).
//
// Every call names its GPU by the daemon's ordinal and never relies on the calling
// thread's current device. Implementations are thread-safe.
#ifndef WPREP_SERVER_SRC_DEVICE_RUNTIME_H_
#define WPREP_SERVER_SRC_DEVICE_RUNTIME_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/moe.h"
#include "wprep/kernels/plan.h"
#include "wprep/kernels/quantize.h"

struct CUevent_st;

namespace wprep::server {

using Stream = CudaStream;  // opaque to everything but the runtime
using Event = CUevent_st*;  // the same type as cudaEvent_t; opaque likewise
using Uuid = std::array<uint8_t, 16>;

// Bytes of a cudaIpcMemHandle_t, and of a cudaIpcEventHandle_t.
inline constexpr size_t kIpcHandleBytes = 64;
inline constexpr size_t kIpcEventHandleBytes = 64;

struct GpuInfo {
  int ordinal = 0;  // the daemon's ordinal
  Uuid uuid{};
  std::string name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_memory = 0;
};

// Times device work on one stream with a pair of events.
class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  virtual void Start(Stream stream) = 0;
  virtual void Stop(Stream stream) = 0;
  // After the stream was synchronized: seconds between Start and Stop; nullopt when the
  // events failed (the conversion itself is unaffected).
  virtual std::optional<double> Seconds() = 0;
};

// An opened IPC mapping: the start of the exported allocation in the daemon's address
// space, and its bytes from there to the allocation's end.
struct IpcMapping {
  void* base = nullptr;
  uint64_t bytes = 0;
};

// A client's cuMem allocation to map (vmm_import.h): its physical chunks in address
// order, each a descriptor of the daemon's (POSIX_FD; the caller keeps and closes it) or
// 64 bytes of a fabric handle, and the granularity every chunk size is a multiple of.
enum class VmmHandleKind { kPosixFd, kFabric };
struct VmmChunkHandle {
  int fd = -1;
  std::string fabric;
  uint64_t bytes = 0;
};
struct VmmImportSpec {
  VmmHandleKind kind = VmmHandleKind::kPosixFd;
  std::vector<VmmChunkHandle> chunks;
  uint64_t granularity = 0;
};
// The exported chunk of a daemon allocation (AllocateSharedVmm): a POSIX descriptor of the
// daemon's and the chunk's bytes.
struct VmmExport {
  int fd = -1;
  uint64_t bytes = 0;
};
// Which shareable handle types a GPU can import.
struct VmmSupport {
  bool posix_fd = false;
  bool fabric = false;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // "cuda" when the build has the CUDA engine; the value of wprep_build_info's cuda label.
  virtual bool compiled_in() const = 0;
  // The GPUs usable now (none without a driver or device).
  virtual absl::StatusOr<std::vector<GpuInfo>> ListGpus() = 0;

  virtual absl::StatusOr<Stream> CreateStream(int gpu) = 0;
  virtual void DestroyStream(int gpu, Stream stream) = 0;

  // Device memory, stream-ordered from the GPU's default pool, which keeps up to
  // `keep_bytes` cached between requests.
  virtual absl::Status ConfigurePool(int gpu, uint64_t keep_bytes) = 0;
  // RESOURCE_EXHAUSTED when the GPU has no room.
  virtual absl::StatusOr<void*> AllocateAsync(int gpu, uint64_t bytes, Stream stream) = 0;
  virtual absl::Status FreeAsync(int gpu, void* ptr, Stream stream) = 0;

  virtual absl::Status CopyToDeviceAsync(int gpu, void* dst, const void* src, uint64_t bytes,
                                         Stream stream) = 0;
  virtual absl::Status CopyToHostAsync(int gpu, void* dst, const void* src, uint64_t bytes,
                                       Stream stream) = 0;
  // One planned conversion between device buffers of `gpu` (ConvertOnCuda).
  virtual absl::Status Convert(int gpu, const Plan& plan, const void* in, void* out,
                               Stream stream) = 0;
  virtual absl::Status Synchronize(int gpu, Stream stream) = 0;
  // One trtllm-gen MoE op between device buffers of `gpu` (RunMoeCuda: one launch per
  // output on `stream`, nothing allocated). Runtimes without a MoE engine say so.
  virtual absl::Status ConvertMoe(int gpu, const MoePlan& plan, absl::Span<const void* const> in,
                                  absl::Span<void* const> out, Stream stream) {
    (void)gpu, (void)plan, (void)in, (void)out, (void)stream;
    return absl::UnimplementedError("this device runtime has no trtllm-gen MoE engine");
  }
  // quantize_mxfp4 between device buffers of `gpu` into `layout` (QuantizeLayoutOnCuda:
  // launches on `stream`, nothing allocated).
  virtual absl::Status Quantize(int gpu, const QuantizePlan& plan, const QuantLayoutSpec& layout, const void* in,
                                void* values, void* scales, const QuantBias& bias, Stream stream) {
    (void)gpu, (void)plan, (void)layout, (void)in, (void)values, (void)scales, (void)bias, (void)stream;
    return absl::UnimplementedError("this device runtime has no quantization engine");
  }
  virtual std::unique_ptr<DeviceTimer> NewTimer(int gpu) = 0;

  // Events without timing: a fresh one of the daemon's, whose host waits sleep rather than
  // spin, or a client's interprocess one opened from its handle (kIpcEventHandleBytes;
  // InvalidArgument, with the runtime's reason, when it cannot be opened). Both end with
  // DestroyEvent, which may come before the work it was recorded after completes.
  virtual absl::StatusOr<Event> CreateEvent(int gpu) = 0;
  virtual absl::StatusOr<Event> OpenIpcEvent(int gpu, absl::string_view handle) = 0;
  virtual void DestroyEvent(int gpu, Event event) = 0;
  virtual absl::Status RecordEvent(int gpu, Event event, Stream stream) = 0;
  // Work queued on `stream` from now on waits for the event's last record.
  virtual absl::Status StreamWaitEvent(int gpu, Stream stream, Event event) = 0;
  // Blocks until the work before the event's last record is done.
  virtual absl::Status SynchronizeEvent(int gpu, Event event) = 0;
  // Writes `value` to the 4-byte aligned word at `ptr` (device memory of `gpu`, an IPC
  // mapping included) once the work queued on `stream` before it is done, with its writes
  // visible first (cuStreamWriteValue32): what a client's stream waiting on the word
  // (cuStreamWaitValue32) is released by.
  virtual absl::Status WriteValue32(int gpu, Stream stream, void* ptr, uint32_t value) = 0;
  // Makes the work queued on `stream` after this wait until the 4-byte aligned word at
  // `ptr` (as for WriteValue32, or registered host memory) holds `value` or beyond, as
  // cuStreamWaitValue32's wrapping "greater or equal": (int32_t)(*ptr - value) >= 0.
  virtual absl::Status WaitValue32(int gpu, Stream stream, void* ptr, uint32_t value) = 0;
  // Registers the page-aligned host mapping [ptr, ptr + bytes) with every GPU, mapped into
  // their address spaces (cudaHostRegister, portable and mapped), and gives its device
  // address on `gpu`: what WriteValue32 takes for a word of shared host memory.
  // Unregister before unmapping it.
  virtual absl::StatusOr<void*> RegisterHost(int gpu, void* ptr, uint64_t bytes) = 0;
  virtual void UnregisterHost(void* ptr) = 0;
  // The device address on `gpu` of host memory RegisterHost registered.
  virtual absl::StatusOr<void*> HostDevicePointer(int gpu, void* ptr) = 0;

  // Device memory of `gpu` outside the pool, which other processes can open from the
  // handle ExportIpc gives (cudaMalloc; a pool's memory has no legacy IPC handle): what
  // resident weight sets live in. RESOURCE_EXHAUSTED when the GPU has no room.
  virtual absl::StatusOr<void*> AllocateShared(int gpu, uint64_t bytes) {
    (void)gpu, (void)bytes;
    return absl::FailedPreconditionError("this device runtime has no shareable device memory");
  }
  virtual void FreeShared(int gpu, void* ptr) { (void)gpu, (void)ptr; }
  // The kIpcHandleBytes handle of an allocation AllocateShared made (cudaIpcGetMemHandle).
  virtual absl::StatusOr<std::string> ExportIpc(int gpu, void* ptr) {
    (void)gpu, (void)ptr;
    return absl::FailedPreconditionError("this device runtime cannot export IPC handles");
  }
  // Device memory of `gpu` from the virtual-memory API instead (cuMemCreate of one
  // physical chunk, exportable as a POSIX file descriptor, mapped read-write on `gpu`),
  // rounded up to the allocation granularity. FreeShared frees it too.
  // FAILED_PRECONDITION where the GPU or driver cannot export such handles,
  // RESOURCE_EXHAUSTED when the GPU has no room.
  virtual absl::StatusOr<void*> AllocateSharedVmm(int gpu, uint64_t bytes) {
    (void)gpu, (void)bytes;
    return absl::FailedPreconditionError("this device runtime cannot export CUDA virtual-memory handles");
  }
  // A fresh descriptor (the caller closes it) of the chunk behind an AllocateSharedVmm
  // allocation (cuMemExportToShareableHandle), and the chunk's bytes.
  virtual absl::StatusOr<VmmExport> ExportVmm(int gpu, void* ptr) {
    (void)gpu, (void)ptr;
    return absl::FailedPreconditionError("this device runtime cannot export CUDA virtual-memory handles");
  }

  // Page-locked host memory, usable for DMA by every GPU.
  virtual absl::StatusOr<void*> AllocatePinned(uint64_t bytes) = 0;
  virtual void FreePinned(void* ptr) = 0;

  // Opens the allocation behind `handle` (kIpcHandleBytes) on `gpu`. InvalidArgument,
  // with the runtime's reason, when it cannot be opened.
  virtual absl::StatusOr<IpcMapping> OpenIpc(int gpu, absl::string_view handle) = 0;
  virtual absl::Status CloseIpc(int gpu, void* base) = 0;
  // Maps the chunks of `spec` back to back into one fresh range of the daemon's address
  // space on `gpu` (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
  // cuMemSetAccess): the mapping's base and total bytes. Nothing stays mapped when it
  // fails: InvalidArgument, with the runtime's reason, for a handle that cannot be
  // imported; FailedPrecondition where the runtime or driver cannot import this kind.
  virtual absl::StatusOr<IpcMapping> OpenVmm(int gpu, const VmmImportSpec& spec) {
    (void)gpu, (void)spec;
    return absl::FailedPreconditionError("this device runtime cannot import CUDA virtual-memory handles");
  }
  // Unmaps and frees a range OpenVmm returned.
  virtual absl::Status CloseVmm(int gpu, void* base) {
    (void)gpu, (void)base;
    return absl::FailedPreconditionError("this device runtime cannot import CUDA virtual-memory handles");
  }
  // What OpenVmm can import on `gpu`.
  virtual VmmSupport VmmImportSupport(int gpu) {
    (void)gpu;
    return {};
  }
  // Reads one byte of every 64 KiB of [ptr, ptr + bytes) on `gpu` and waits for it, so
  // the GPU's first access to a new mapping is paid before the request that uses it.
  virtual absl::Status Touch(int gpu, const void* ptr, uint64_t bytes) = 0;
  // Handles of `count` fresh allocations of this process on `gpu`, each freed again
  // before returning (their bytes are what the IPC owner calibration compares).
  virtual absl::StatusOr<std::vector<std::string>> ExportSampleHandles(int gpu, int count) = 0;
};

// The process's CUDA runtime. In a build without CUDA it lists no GPU, and every other
// call fails with FAILED_PRECONDITION.
DeviceRuntime& CudaRuntime();

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_DEVICE_RUNTIME_H_
