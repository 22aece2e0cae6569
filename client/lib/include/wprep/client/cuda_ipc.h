// Device pointers -> CudaIpcBuffers (CMake target wprep::client_cuda, built only with
// CUDA; the header itself needs no CUDA headers). A loader hands the daemon its tensors
// by pointer; the exporter finds each pointer's allocation, exports the allocation's
// handle once and names the tensor by its offset in it.
#ifndef WPREP_CLIENT_CUDA_IPC_H_
#define WPREP_CLIENT_CUDA_IPC_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "wprep/client/client.h"
#include "wprep/v1/wprep.pb.h"

struct CUevent_st;   // cudaEvent_t
struct CUstream_st;  // cudaStream_t

namespace wprep::client {

// An interprocess CUDA event as a fence of ConvertBatchRequest: AttachTo makes it the
// batch's signal_when_done fence and asks for ANSWER_WHEN_QUEUED, so the batch is answered
// as soon as its work is queued on the GPU, and the event marks the work's end. After the
// answer, StreamWait orders a stream's later work after the batch (the outputs' consumers
// go there) and Synchronize waits on the host. Before the call, RecordReady makes it the
// batch's wait_for fence too, so the daemon's work also waits on the GPU for the work that
// produced the sources, and no host waits. One event
// serves one batch in flight at a time; reuse it once its wait is queued. After a call that
// ended without an answer (a deadline, a cancel) the daemon may still record it: keep it
// alive a while, and use another. Move-only.
class CompletionEvent {
 public:
  // An event made with cudaEventInterprocess | cudaEventDisableTiming on `device` (a CUDA
  // ordinal of this process), exported with cudaIpcGetEventHandle.
  static absl::StatusOr<CompletionEvent> Create(int device);
  CompletionEvent(CompletionEvent&& o) noexcept;
  CompletionEvent& operator=(CompletionEvent&& o) noexcept;
  ~CompletionEvent();

  // The request field: the event's handle and its GPU's UUID.
  const wprep::v1::IpcEventRef& ref() const { return ref_; }
  // Attaching again (to a copy of an attached request) replaces the request's event fence.
  void AttachTo(wprep::v1::ConvertBatchRequest* request) const;
  // Before sending: records the event on `stream` after the work queued there so far (the
  // sources' producers, the destinations' earlier readers) and names it the request's
  // wait_for fence, so the daemon's streams wait for it instead of the host synchronizing
  // `stream`. With AttachTo, this one event serves both ends.
  absl::Status RecordReady(CUstream_st* stream, wprep::v1::ConvertBatchRequest* request) const;
  // After the answer: work queued on `stream` from now on runs after the batch's work.
  absl::Status StreamWait(CUstream_st* stream) const;
  // After the answer: returns once the batch's work is done.
  absl::Status Synchronize() const;

 private:
  CompletionEvent() = default;
  CUevent_st* event_ = nullptr;
  int device_ = 0;
  wprep::v1::IpcEventRef ref_;
};

// Exports device memory of this process as CUDA IPC buffers, caching one entry per
// allocation (its base, size, handle and GPU UUID), so the driver is asked once per
// allocation, not once per tensor.
//
// The cache cannot see cudaFree: memory freed and allocated again at the same address
// is a new allocation with a new handle, but a cached entry would still name the old
// one. Before freeing memory that was exported, call Release (the daemon drops its
// mapping, this cache its entry) or at least Forget. Thread-safe.
class IpcExporter {
 public:
  IpcExporter() = default;
  IpcExporter(const IpcExporter&) = delete;
  IpcExporter& operator=(const IpcExporter&) = delete;

  // The buffer naming `size` bytes from `ptr`, device memory of this process from
  // cudaMalloc (or cudaMallocPitch, ...), possibly inside a larger allocation: `handle`
  // is the allocation's, exported with cudaIpcGetMemHandle at its base (found with
  // cuMemGetAddressRange), `offset` is `ptr` minus that base, `device_uuid` the GPU that
  // holds it. `strides` (byte strides of a source view, optional) are copied into the
  // buffer; `size` is then the bytes the view spans. InvalidArgument for host, managed or
  // unknown pointers and for a range that leaves the allocation; FailedPrecondition when
  // CUDA or the driver entry point is unavailable; the CUDA error otherwise (memory from
  // cudaMallocAsync pools or cuMemCreate cannot be exported with these handles).
  absl::StatusOr<wprep::v1::CudaIpcBuffer> Export(const void* ptr, uint64_t size,
                                                  absl::Span<const int64_t> strides = {});

  // Drops the cached entry of the allocation holding `ptr` and returns its reference
  // (handle and GPU UUID) for ReleaseIpcHandles; nullopt when nothing cached holds it.
  std::optional<wprep::v1::IpcHandleRef> Forget(const void* ptr);
  // Forget, then ReleaseIpcHandles of that handle in the daemon `client` talks to. OK
  // when nothing cached holds `ptr`.
  absl::Status Release(Client& client, const void* ptr, const CallOptions& options = {});
  // Drops every entry; returns their references (e.g. for one ReleaseIpcHandles).
  std::vector<wprep::v1::IpcHandleRef> ForgetAll();

  // Allocations cached now.
  size_t cached() const;

 private:
  struct Allocation {
    uint64_t bytes = 0;
    std::string handle;  // 64 bytes of cudaIpcMemHandle_t
    std::string uuid;    // 16 bytes
  };
  // The entry whose [base, base + bytes) holds `p`, or end().
  std::map<uintptr_t, Allocation>::iterator Find(uintptr_t p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<uintptr_t, Allocation> allocations_ ABSL_GUARDED_BY(mu_);  // by base address
  std::map<int, std::string> uuids_ ABSL_GUARDED_BY(mu_);             // by device ordinal
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_CUDA_IPC_H_
