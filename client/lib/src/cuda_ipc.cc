#include "wprep/client/cuda_ipc.h"

#include <cuda.h>  // driver types only: libcuda is never linked
#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace wprep::client {
namespace {

absl::Status CudaError(cudaError_t err, const char* call) {
  cudaGetLastError();  // clear the sticky-free error state of the runtime for the next call
  return absl::InternalError(
      absl::StrCat(call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

#define WPREP_CLIENT_CUDA(call)                          \
  do {                                                   \
    const cudaError_t wprep_err_ = (call);               \
    if (wprep_err_ != cudaSuccess) return CudaError(wprep_err_, #call); \
  } while (0)

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// cuMemGetAddressRange from the driver the runtime loaded, resolved once at run time (as
// the daemon does), so neither this library nor its users link libcuda; nullptr when the
// driver lacks it.
GetAddressRangeFn AddressRangeFn() {
  static const GetAddressRangeFn fn = []() -> GetAddressRangeFn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  return fn;
}

// Makes `device` current for the life of the object and restores the caller's device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
    cudaGetLastError();
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = false;
};

}  // namespace

absl::StatusOr<CompletionEvent> CompletionEvent::Create(int device) {
  ScopedDevice on(device);
  if (!on.ok()) return absl::InvalidArgumentError(absl::StrCat("no CUDA device ", device, " in this process"));
  cudaDeviceProp prop;
  WPREP_CLIENT_CUDA(cudaGetDeviceProperties(&prop, device));
  CompletionEvent e;
  e.device_ = device;
  cudaEvent_t ev = nullptr;
  WPREP_CLIENT_CUDA(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  e.event_ = ev;
  cudaIpcEventHandle_t h;
  WPREP_CLIENT_CUDA(cudaIpcGetEventHandle(&h, ev));
  e.ref_.set_handle(std::string(h.reserved, sizeof(h.reserved)));
  e.ref_.set_device_uuid(std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes)));
  return e;
}

CompletionEvent::CompletionEvent(CompletionEvent&& o) noexcept { *this = std::move(o); }

CompletionEvent& CompletionEvent::operator=(CompletionEvent&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
    device_ = o.device_;
    ref_ = std::move(o.ref_);
  }
  return *this;
}

CompletionEvent::~CompletionEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
  cudaGetLastError();
}

void CompletionEvent::AttachTo(wprep::v1::ConvertBatchRequest* request) const {
  request->set_answer_when(wprep::v1::ANSWER_WHEN_QUEUED);
  for (wprep::v1::Fence& f : *request->mutable_signal_when_done()) {
    if (f.has_event()) {
      *f.mutable_event() = ref_;
      return;
    }
  }
  *request->add_signal_when_done()->mutable_event() = ref_;
}

absl::Status CompletionEvent::RecordReady(CUstream_st* stream, wprep::v1::ConvertBatchRequest* request) const {
  WPREP_CLIENT_CUDA(cudaEventRecord(event_, stream));
  *request->mutable_wait_for()->mutable_event() = ref_;
  return absl::OkStatus();
}

absl::Status CompletionEvent::StreamWait(CUstream_st* stream) const {
  WPREP_CLIENT_CUDA(cudaStreamWaitEvent(stream, event_, 0));
  return absl::OkStatus();
}

absl::Status CompletionEvent::Synchronize() const {
  WPREP_CLIENT_CUDA(cudaEventSynchronize(event_));
  return absl::OkStatus();
}

std::map<uintptr_t, IpcExporter::Allocation>::iterator IpcExporter::Find(uintptr_t p) {
  auto it = allocations_.upper_bound(p);
  if (it == allocations_.begin()) return allocations_.end();
  --it;
  return p - it->first < it->second.bytes ? it : allocations_.end();
}

absl::StatusOr<wprep::v1::CudaIpcBuffer> IpcExporter::Export(const void* ptr, uint64_t size,
                                                              absl::Span<const int64_t> strides) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  absl::MutexLock lock(&mu_);
  auto it = Find(p);
  if (it == allocations_.end()) {
    cudaPointerAttributes attr{};
    if (const cudaError_t e = cudaPointerGetAttributes(&attr, ptr); e != cudaSuccess) {
      if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        return absl::FailedPreconditionError(
            absl::StrCat("no CUDA device to export from: ", cudaGetErrorString(e)));
      }
      return CudaError(e, "cudaPointerGetAttributes(ptr)");
    }
    if (attr.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pointer 0x", absl::Hex(p), " is not device memory (cudaMemoryType ",
          static_cast<int>(attr.type), "); only cudaMalloc'd memory has CUDA IPC handles"));
    }
    GetAddressRangeFn range = AddressRangeFn();
    if (range == nullptr) {
      return absl::FailedPreconditionError(
          "the CUDA driver has no cuMemGetAddressRange (CUDA 12 or newer is needed)");
    }
    ScopedDevice on(attr.device);
    if (!on.ok()) return absl::InternalError(absl::StrCat("cudaSetDevice(", attr.device, ") failed"));
    CUdeviceptr base = 0;
    size_t bytes = 0;
    if (const CUresult r = range(&base, &bytes, static_cast<CUdeviceptr>(p)); r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(absl::StrCat("cuMemGetAddressRange(0x", absl::Hex(p),
                                                     ") failed with CUresult ", static_cast<int>(r)));
    }
    cudaIpcMemHandle_t handle;
    WPREP_CLIENT_CUDA(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)));
    auto uuid = uuids_.find(attr.device);
    if (uuid == uuids_.end()) {
      cudaDeviceProp prop;
      WPREP_CLIENT_CUDA(cudaGetDeviceProperties(&prop, attr.device));
      uuid = uuids_.emplace(attr.device, std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes))).first;
    }
    Allocation a;
    a.bytes = bytes;
    a.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    a.uuid = uuid->second;
    it = allocations_.insert_or_assign(static_cast<uintptr_t>(base), std::move(a)).first;
  }
  const uint64_t offset = p - it->first;
  if (size > it->second.bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        size, " bytes at offset ", offset, " leave the allocation of ", it->second.bytes, " bytes"));
  }
  wprep::v1::CudaIpcBuffer b;
  b.set_handle(it->second.handle);
  b.set_offset(offset);
  b.set_size(size);
  b.set_device_uuid(it->second.uuid);
  for (int64_t s : strides) b.add_strides(s);
  return b;
}

std::optional<wprep::v1::IpcHandleRef> IpcExporter::Forget(const void* ptr) {
  absl::MutexLock lock(&mu_);
  auto it = Find(reinterpret_cast<uintptr_t>(ptr));
  if (it == allocations_.end()) return std::nullopt;
  wprep::v1::IpcHandleRef ref;
  ref.set_handle(it->second.handle);
  ref.set_device_uuid(it->second.uuid);
  allocations_.erase(it);
  return ref;
}

absl::Status IpcExporter::Release(Client& client, const void* ptr, const CallOptions& options) {
  std::optional<wprep::v1::IpcHandleRef> ref = Forget(ptr);
  if (!ref) return absl::OkStatus();
  wprep::v1::ReleaseIpcHandlesRequest request;
  *request.add_handles() = *std::move(ref);
  return client.ReleaseIpcHandles(request, options).status();
}

std::vector<wprep::v1::IpcHandleRef> IpcExporter::ForgetAll() {
  absl::MutexLock lock(&mu_);
  std::vector<wprep::v1::IpcHandleRef> refs;
  for (const auto& [base, a] : allocations_) {
    wprep::v1::IpcHandleRef ref;
    ref.set_handle(a.handle);
    ref.set_device_uuid(a.uuid);
    refs.push_back(std::move(ref));
  }
  allocations_.clear();
  return refs;
}

size_t IpcExporter::cached() const {
  absl::MutexLock lock(&mu_);
  return allocations_.size();
}

}  // namespace wprep::client
