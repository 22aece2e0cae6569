// The CUDA implementation of DeviceRuntime: the one place in server/ that calls CUDA.
// cudart is linked statically and libcuda is never linked (its one entry point the
// daemon needs, cuMemGetAddressRange, is resolved from the loaded driver at run time), so
// wprepd starts on machines without a driver and serves with the CPU engine there.
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "device/device_runtime.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda.h>  // types only
#include <cuda_runtime.h>

#include "wprep/kernels/cuda_status.h"
#include "wprep/kernels/quantize.h"
#include "wprep/spec/status_macros.h"
#endif

namespace wprep::server {
namespace {

#if WPREP_HAVE_CUDA

// `name` in its CUDA 12 form from the driver the runtime loaded; nullptr when unavailable.
void* DriverEntryPoint(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
// cuStreamWriteValue32 and cuStreamWaitValue32 share this signature.
using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// Resolved once each.
GetAddressRangeFn AddressRangeFn() {
  static const auto fn = reinterpret_cast<GetAddressRangeFn>(DriverEntryPoint("cuMemGetAddressRange"));
  return fn;
}
StreamValue32Fn WriteValueFn() {
  static const auto fn = reinterpret_cast<StreamValue32Fn>(DriverEntryPoint("cuStreamWriteValue32"));
  return fn;
}
StreamValue32Fn WaitValueFn() {
  static const auto fn = reinterpret_cast<StreamValue32Fn>(DriverEntryPoint("cuStreamWaitValue32"));
  return fn;
}

// A stream memory operation on the 32-bit word at `ptr` of `gpu`, with flags 0: for the
// write, after the stream's earlier work with a memory barrier first; for the wait,
// CU_STREAM_WAIT_VALUE_GEQ, the wrapping "greater or equal".
absl::Status StreamValue32(StreamValue32Fn fn, const char* name, int gpu, Stream stream, void* ptr,
                           uint32_t value) {
  if (fn == nullptr) return absl::InternalError(absl::StrCat(name, " is not available from the CUDA driver"));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
  if (CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(ptr), value, 0);
      r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(name, " failed with CUresult ", r));
  }
  return absl::OkStatus();
}

// The driver's virtual-memory calls, resolved once; `ok` when every one was found.
struct VmmDriver {
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*properties)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  bool ok = false;
  // The calls that allocate and export (AllocateSharedVmm); `export_ok` when found.
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  bool export_ok = false;
};

template <typename Fn>
bool Resolve(Fn* fn, const char* name) {
  *fn = reinterpret_cast<Fn>(DriverEntryPoint(name));
  return *fn != nullptr;
}

const VmmDriver& Vmm() {
  static const VmmDriver d = [] {
    VmmDriver v;
    // Every one resolved (each tried, so that none is left unset by a short circuit).
    v.ok = true;
    v.ok = Resolve(&v.import_handle, "cuMemImportFromShareableHandle") && v.ok;
    v.ok = Resolve(&v.reserve, "cuMemAddressReserve") && v.ok;
    v.ok = Resolve(&v.map, "cuMemMap") && v.ok;
    v.ok = Resolve(&v.set_access, "cuMemSetAccess") && v.ok;
    v.ok = Resolve(&v.unmap, "cuMemUnmap") && v.ok;
    v.ok = Resolve(&v.release, "cuMemRelease") && v.ok;
    v.ok = Resolve(&v.address_free, "cuMemAddressFree") && v.ok;
    v.ok = Resolve(&v.properties, "cuMemGetAllocationPropertiesFromHandle") && v.ok;
    v.ok = Resolve(&v.device_get, "cuDeviceGet") && v.ok;
    v.ok = Resolve(&v.attribute, "cuDeviceGetAttribute") && v.ok;
    v.export_ok = v.ok;
    v.export_ok = Resolve(&v.create, "cuMemCreate") && v.export_ok;
    v.export_ok = Resolve(&v.export_handle, "cuMemExportToShareableHandle") && v.export_ok;
    v.export_ok = Resolve(&v.granularity, "cuMemGetAllocationGranularity") && v.export_ok;
    return v;
  }();
  return d;
}

absl::Status VmmError(const char* call, CUresult r) {
  return absl::InvalidArgumentError(absl::StrCat(call, " failed with CUresult ", static_cast<int>(r)));
}

// The ranges OpenVmm mapped, by base: each chunk's bytes, to unmap them one by one.
struct VmmRanges {
  absl::Mutex mu;
  std::map<CUdeviceptr, std::vector<uint64_t>> chunks ABSL_GUARDED_BY(mu);
};
VmmRanges& Ranges() {
  static VmmRanges* r = new VmmRanges();
  return *r;
}

// The daemon's own VMM allocations (AllocateSharedVmm), by base: the physical chunk,
// kept for exports, and its bytes.
struct OwnVmm {
  CUmemGenericAllocationHandle handle = 0;
  uint64_t bytes = 0;
};
struct OwnVmmAllocations {
  absl::Mutex mu;
  std::map<CUdeviceptr, OwnVmm> by_base ABSL_GUARDED_BY(mu);
};
OwnVmmAllocations& OwnAllocations() {
  static OwnVmmAllocations* a = new OwnVmmAllocations();
  return *a;
}

// Unmaps the first `mapped` chunks of the range at `base` and frees the range.
void UnmapVmm(CUdeviceptr base, const std::vector<uint64_t>& chunk_bytes, size_t mapped) {
  const VmmDriver& d = Vmm();
  uint64_t at = 0, total = 0;
  for (size_t i = 0; i < chunk_bytes.size(); ++i) {
    if (i < mapped) d.unmap(base + at, chunk_bytes[i]);
    at += chunk_bytes[i];
  }
  total = at;
  d.address_free(base, total);
}

class CudaTimer final : public DeviceTimer {
 public:
  explicit CudaTimer(int gpu) {
    ok_ = cudaSetDevice(gpu) == cudaSuccess && cudaEventCreate(&start_) == cudaSuccess &&
          cudaEventCreate(&stop_) == cudaSuccess;
    if (!ok_) cudaGetLastError();
  }
  ~CudaTimer() override {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    cudaGetLastError();
  }
  void Start(Stream s) override { ok_ = ok_ && cudaEventRecord(start_, s) == cudaSuccess; }
  void Stop(Stream s) override { ok_ = ok_ && cudaEventRecord(stop_, s) == cudaSuccess; }
  std::optional<double> Seconds() override {
    float ms = 0;
    if (!ok_ || cudaEventElapsedTime(&ms, start_, stop_) != cudaSuccess) {
      cudaGetLastError();
      return std::nullopt;
    }
    return ms / 1e3;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  bool ok_ = false;
};

class Cuda final : public DeviceRuntime {
 public:
  Cuda() { (void)AddressRangeFn(); }  // resolved at start, not inside a first request

  bool compiled_in() const override { return true; }

  absl::StatusOr<std::vector<GpuInfo>> ListGpus() override {
    std::vector<GpuInfo> out;
    const int count = CudaDeviceCount();
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp prop;
      WPREP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
      GpuInfo info;
      info.ordinal = i;
      std::memcpy(info.uuid.data(), prop.uuid.bytes, 16);
      info.name = prop.name;
      info.cc_major = prop.major;
      info.cc_minor = prop.minor;
      info.total_memory = prop.totalGlobalMem;
      out.push_back(std::move(info));
    }
    return out;
  }

  absl::StatusOr<Stream> CreateStream(int gpu) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    cudaStream_t s = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }
  void DestroyStream(int gpu, Stream s) override {
    if (cudaSetDevice(gpu) == cudaSuccess) cudaStreamDestroy(s);
    cudaGetLastError();
  }

  absl::Status ConfigurePool(int gpu, uint64_t keep_bytes) override {
    cudaMemPool_t pool = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, gpu));
    return WPREP_CUDA_STATUS(
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_bytes));
  }
  absl::StatusOr<void*> AllocateAsync(int gpu, uint64_t bytes, Stream s) override {
    cudaMemPool_t pool = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, gpu));
    void* ptr = nullptr;
    const cudaError_t err = cudaMallocFromPoolAsync(&ptr, bytes, pool, s);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMallocFromPoolAsync of ", bytes, " bytes on GPU ", gpu, " failed: ",
                       cudaGetErrorName(err), "; lower the load or set --max-device-bytes"));
    }
    return ptr;
  }
  absl::Status FreeAsync(int gpu, void* ptr, Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaFreeAsync(ptr, s));
  }

  absl::Status CopyToDeviceAsync(int gpu, void* dst, const void* src, uint64_t bytes,
                                 Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  }
  absl::Status CopyToHostAsync(int gpu, void* dst, const void* src, uint64_t bytes,
                               Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  }
  absl::Status Convert(int, const Plan& plan, const void* in, void* out, Stream s) override {
    return ConvertOnCuda(plan, in, out, s);  // runs on the device owning the pointers
  }
  absl::Status ConvertMoe(int gpu, const MoePlan& plan, absl::Span<const void* const> in, absl::Span<void* const> out,
                          Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));  // RunMoeCuda launches on the current device
    return RunMoeCuda(plan, in, out, s);
  }
  absl::Status Quantize(int gpu, const QuantizePlan& plan, const QuantLayoutSpec& layout, const void* in,
                        void* values, void* scales, const QuantBias& bias, Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return QuantizeLayoutOnCuda(plan, layout, in, values, scales, s, bias);
  }
  absl::Status Synchronize(int gpu, Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaStreamSynchronize(s));
  }
  std::unique_ptr<DeviceTimer> NewTimer(int gpu) override { return std::make_unique<CudaTimer>(gpu); }

  absl::StatusOr<Event> CreateEvent(int gpu) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    cudaEvent_t e = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
    return e;
  }
  absl::StatusOr<Event> OpenIpcEvent(int gpu, absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError("an IPC event handle has 64 bytes");
    }
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t e = nullptr;
    const cudaError_t err = cudaIpcOpenEventHandle(&e, h);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
    }
    return e;
  }
  void DestroyEvent(int gpu, Event e) override {
    if (cudaSetDevice(gpu) == cudaSuccess) cudaEventDestroy(e);
    cudaGetLastError();
  }
  absl::Status RecordEvent(int gpu, Event e, Stream s) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaEventRecord(e, s));
  }
  absl::Status StreamWaitEvent(int gpu, Stream s, Event e) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaStreamWaitEvent(s, e, 0));
  }
  absl::Status SynchronizeEvent(int gpu, Event e) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaEventSynchronize(e));
  }

  absl::Status WriteValue32(int gpu, Stream stream, void* ptr, uint32_t value) override {
    return StreamValue32(WriteValueFn(), "cuStreamWriteValue32", gpu, stream, ptr, value);
  }
  absl::Status WaitValue32(int gpu, Stream stream, void* ptr, uint32_t value) override {
    return StreamValue32(WaitValueFn(), "cuStreamWaitValue32", gpu, stream, ptr, value);
  }

  absl::StatusOr<void*> RegisterHost(int gpu, void* ptr, uint64_t bytes) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    if (cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
        e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat("cudaHostRegister of ", bytes, " bytes failed: ", cudaGetErrorString(e)));
    }
    absl::StatusOr<void*> d = HostDevicePointer(gpu, ptr);
    if (!d.ok()) UnregisterHost(ptr);
    return d;
  }
  void UnregisterHost(void* ptr) override {
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
  }
  absl::StatusOr<void*> HostDevicePointer(int gpu, void* ptr) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    void* d = nullptr;
    WPREP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&d, ptr, 0));
    return d;
  }

  absl::StatusOr<void*> AllocateShared(int gpu, uint64_t bytes) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", gpu,
                                                       " failed: ", cudaGetErrorName(err)));
    }
    return p;
  }
  void FreeShared(int gpu, void* ptr) override {
    std::optional<OwnVmm> own;
    {
      OwnVmmAllocations& all = OwnAllocations();
      absl::MutexLock lock(&all.mu);
      auto it = all.by_base.find(reinterpret_cast<CUdeviceptr>(ptr));
      if (it != all.by_base.end()) {
        own = it->second;
        all.by_base.erase(it);
      }
    }
    if (own.has_value()) {
      const VmmDriver& d = Vmm();
      const auto base = reinterpret_cast<CUdeviceptr>(ptr);
      if (cudaSetDevice(gpu) == cudaSuccess) cudaDeviceSynchronize();  // no kernel still uses it
      d.unmap(base, own->bytes);
      d.address_free(base, own->bytes);
      d.release(own->handle);  // the memory goes once every importer has released it too
      cudaGetLastError();
      return;
    }
    if (cudaSetDevice(gpu) == cudaSuccess) cudaFree(ptr);
    cudaGetLastError();
  }
  absl::StatusOr<void*> AllocateSharedVmm(int gpu, uint64_t bytes) override {
    const VmmDriver& d = Vmm();
    if (!d.export_ok) return absl::FailedPreconditionError("the CUDA driver lacks the virtual-memory API");
    if (!VmmImportSupport(gpu).posix_fd) {
      return absl::FailedPreconditionError(
          absl::StrCat("GPU ", gpu, " does not support POSIX file descriptor handles of virtual memory"));
    }
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));  // the primary context is current
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (CUresult r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        r != CUDA_SUCCESS || granularity == 0) {
      return absl::InternalError(absl::StrCat("cuMemGetAllocationGranularity failed with CUresult ", r));
    }
    const uint64_t size = (std::max<uint64_t>(bytes, 1) + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle h = 0;
    if (CUresult r = d.create(&h, size, &prop, 0); r != CUDA_SUCCESS) {
      return absl::ResourceExhaustedError(absl::StrCat("cuMemCreate of ", size, " bytes on GPU ", gpu,
                                                       " failed with CUresult ", r));
    }
    CUdeviceptr base = 0;
    absl::Status s;
    bool reserved = false, mapped = false;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = gpu;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = d.reserve(&base, size, granularity, 0, 0);
    if (r != CUDA_SUCCESS) {
      s = absl::ResourceExhaustedError(absl::StrCat("cuMemAddressReserve failed with CUresult ", r));
    } else {
      reserved = true;
      r = d.map(base, size, 0, h, 0);
      if (r != CUDA_SUCCESS) {
        s = absl::InternalError(absl::StrCat("cuMemMap failed with CUresult ", r));
      } else {
        mapped = true;
        r = d.set_access(base, size, &access, 1);
        if (r != CUDA_SUCCESS) s = absl::InternalError(absl::StrCat("cuMemSetAccess failed with CUresult ", r));
      }
    }
    if (!s.ok()) {
      if (mapped) d.unmap(base, size);
      if (reserved) d.address_free(base, size);
      d.release(h);
      return s;
    }
    OwnVmmAllocations& all = OwnAllocations();
    absl::MutexLock lock(&all.mu);
    all.by_base[base] = OwnVmm{h, size};
    return reinterpret_cast<void*>(base);
  }
  absl::StatusOr<VmmExport> ExportVmm(int gpu, void* ptr) override {
    OwnVmm own;
    {
      OwnVmmAllocations& all = OwnAllocations();
      absl::MutexLock lock(&all.mu);
      auto it = all.by_base.find(reinterpret_cast<CUdeviceptr>(ptr));
      if (it == all.by_base.end()) return absl::NotFoundError("no VMM allocation of the daemon's at that address");
      own = it->second;
    }
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    int fd = -1;
    if (CUresult r = Vmm().export_handle(&fd, own.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuMemExportToShareableHandle failed with CUresult ", r));
    }
    return VmmExport{fd, own.bytes};
  }
  absl::StatusOr<std::string> ExportIpc(int gpu, void* ptr) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    cudaIpcMemHandle_t h;
    WPREP_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, ptr));
    return std::string(h.reserved, sizeof(h.reserved));
  }

  absl::StatusOr<void*> AllocatePinned(uint64_t bytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaHostAlloc of ", bytes, " pinned bytes failed: ", cudaGetErrorName(err)));
    }
    return p;
  }
  void FreePinned(void* p) override {
    cudaFreeHost(p);
    cudaGetLastError();
  }

  absl::StatusOr<IpcMapping> OpenIpc(int gpu, absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError("an IPC handle has 64 bytes");
    }
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* base = nullptr;
    // The runtime requires cudaIpcMemLazyEnablePeerAccess (0 is refused, seen on an H200
    // pair), so another GPU's handle opens too, over the peer link (ipc_owner.h).
    const cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it so later calls on this thread are clean
      return absl::InvalidArgumentError(
          absl::StrCat(cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
    }
    GetAddressRangeFn range_fn = AddressRangeFn();
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    absl::Status s;
    if (range_fn == nullptr) {
      s = absl::InternalError("cuMemGetAddressRange is not available from the CUDA driver");
    } else if (CUresult r = range_fn(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
               r != CUDA_SUCCESS) {
      s = absl::InternalError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", r));
    }
    if (!s.ok()) {
      cudaIpcCloseMemHandle(base);
      cudaGetLastError();
      return s;
    }
    return IpcMapping{base, range_base + range_size - reinterpret_cast<CUdeviceptr>(base)};
  }
  absl::Status CloseIpc(int gpu, void* base) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    return WPREP_CUDA_STATUS(cudaIpcCloseMemHandle(base));
  }
  absl::StatusOr<IpcMapping> OpenVmm(int gpu, const VmmImportSpec& spec) override {
    const VmmDriver& d = Vmm();
    if (!d.ok) return absl::FailedPreconditionError("the CUDA driver lacks the virtual-memory API");
    if (spec.chunks.empty()) return absl::InvalidArgumentError("no chunks to map");
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));  // the primary context is current
    uint64_t total = 0;
    std::vector<uint64_t> chunk_bytes;
    for (const VmmChunkHandle& c : spec.chunks) {
      total += c.bytes;
      chunk_bytes.push_back(c.bytes);
    }
    CUdeviceptr base = 0;
    if (CUresult r = d.reserve(&base, total, spec.granularity, 0, 0); r != CUDA_SUCCESS) {
      return VmmError("cuMemAddressReserve", r);
    }
    size_t mapped = 0;
    uint64_t at = 0;
    absl::Status s;
    for (const VmmChunkHandle& c : spec.chunks) {
      s = MapChunk(gpu, spec.kind, c, base + at);
      if (!s.ok()) break;
      ++mapped;
      at += c.bytes;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = gpu;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (s.ok()) {
      if (CUresult r = d.set_access(base, total, &access, 1); r != CUDA_SUCCESS) s = VmmError("cuMemSetAccess", r);
    }
    if (!s.ok()) {
      UnmapVmm(base, chunk_bytes, mapped);
      return s;
    }
    VmmRanges& ranges = Ranges();
    absl::MutexLock lock(&ranges.mu);
    ranges.chunks[base] = std::move(chunk_bytes);
    return IpcMapping{reinterpret_cast<void*>(base), total};
  }
  absl::Status CloseVmm(int gpu, void* base) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    std::vector<uint64_t> chunk_bytes;
    {
      VmmRanges& ranges = Ranges();
      absl::MutexLock lock(&ranges.mu);
      auto it = ranges.chunks.find(reinterpret_cast<CUdeviceptr>(base));
      if (it == ranges.chunks.end()) return absl::NotFoundError("no VMM range at that address");
      chunk_bytes = std::move(it->second);
      ranges.chunks.erase(it);
    }
    UnmapVmm(reinterpret_cast<CUdeviceptr>(base), chunk_bytes, chunk_bytes.size());
    return absl::OkStatus();
  }
  VmmSupport VmmImportSupport(int gpu) override {
    const VmmDriver& d = Vmm();
    VmmSupport out;
    CUdevice dev = 0;
    if (!d.ok || d.device_get(&dev, gpu) != CUDA_SUCCESS) return out;
    int v = 0;
    out.posix_fd = d.attribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) ==
                       CUDA_SUCCESS && v != 0;
    v = 0;
    out.fabric = d.attribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev) == CUDA_SUCCESS && v != 0;
    return out;
  }
  absl::Status Touch(int gpu, const void* ptr, uint64_t bytes) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    WPREP_RETURN_IF_ERROR(TouchOnCuda(ptr, bytes, cudaStreamPerThread));
    return WPREP_CUDA_STATUS(cudaStreamSynchronize(cudaStreamPerThread));
  }
  absl::StatusOr<std::vector<std::string>> ExportSampleHandles(int gpu, int count) override {
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu));
    std::vector<void*> bufs(static_cast<size_t>(count), nullptr);
    std::vector<std::string> out;
    absl::Status s;
    for (void*& b : bufs) {
      cudaIpcMemHandle_t h;
      // 2 MiB each: separate allocations, so the handles differ wherever the allocation shows.
      s = WPREP_CUDA_STATUS(cudaMalloc(&b, 2 << 20));
      if (s.ok()) s = WPREP_CUDA_STATUS(cudaIpcGetMemHandle(&h, b));
      if (!s.ok()) break;
      out.emplace_back(h.reserved, sizeof(h.reserved));
    }
    for (void* b : bufs) {
      if (b != nullptr) cudaFree(b);
    }
    cudaGetLastError();
    if (!s.ok()) return s;
    return out;
  }

 private:
  // Imports one chunk, checks it lives on `gpu`, and maps it at `at`; the imported handle
  // is released again either way (the mapping keeps the memory).
  static absl::Status MapChunk(int gpu, VmmHandleKind kind, const VmmChunkHandle& c, CUdeviceptr at) {
    const VmmDriver& d = Vmm();
    CUmemGenericAllocationHandle h = 0;
    CUresult r;
    if (kind == VmmHandleKind::kPosixFd) {
      r = d.import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(c.fd)),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    } else {
      CUmemFabricHandle fh{};
      if (c.fabric.size() != sizeof(fh.data)) return absl::InvalidArgumentError("a fabric handle has 64 bytes");
      std::memcpy(fh.data, c.fabric.data(), sizeof(fh.data));
      r = d.import_handle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
    }
    if (r != CUDA_SUCCESS) return VmmError("cuMemImportFromShareableHandle", r);
    absl::Status s;
    CUmemAllocationProp prop{};
    if (CUresult pr = d.properties(&prop, h); pr != CUDA_SUCCESS) {
      s = VmmError("cuMemGetAllocationPropertiesFromHandle", pr);
    } else if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != gpu) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "the chunk's memory is not on the daemon's GPU ordinal ", gpu, " (it is on location ",
          prop.location.id, "); send the device_uuid of the GPU that holds it"));
    } else if (CUresult mr = d.map(at, c.bytes, 0, h, 0); mr != CUDA_SUCCESS) {
      s = VmmError("cuMemMap", mr);
    }
    d.release(h);
    return s;
  }
};

#else  // !WPREP_HAVE_CUDA

absl::Status NoCuda() { return absl::FailedPreconditionError("this wprepd was built without CUDA"); }

class NoTimer final : public DeviceTimer {
 public:
  void Start(Stream) override {}
  void Stop(Stream) override {}
  std::optional<double> Seconds() override { return std::nullopt; }
};

class NoCudaRuntime final : public DeviceRuntime {
 public:
  bool compiled_in() const override { return false; }
  absl::StatusOr<std::vector<GpuInfo>> ListGpus() override { return std::vector<GpuInfo>{}; }
  absl::StatusOr<Stream> CreateStream(int) override { return NoCuda(); }
  void DestroyStream(int, Stream) override {}
  absl::Status ConfigurePool(int, uint64_t) override { return NoCuda(); }
  absl::StatusOr<void*> AllocateAsync(int, uint64_t, Stream) override { return NoCuda(); }
  absl::Status FreeAsync(int, void*, Stream) override { return NoCuda(); }
  absl::Status CopyToDeviceAsync(int, void*, const void*, uint64_t, Stream) override { return NoCuda(); }
  absl::Status CopyToHostAsync(int, void*, const void*, uint64_t, Stream) override { return NoCuda(); }
  absl::Status Convert(int, const Plan&, const void*, void*, Stream) override { return NoCuda(); }
  absl::Status Synchronize(int, Stream) override { return NoCuda(); }
  std::unique_ptr<DeviceTimer> NewTimer(int) override { return std::make_unique<NoTimer>(); }
  absl::StatusOr<Event> CreateEvent(int) override { return NoCuda(); }
  absl::StatusOr<Event> OpenIpcEvent(int, absl::string_view) override { return NoCuda(); }
  void DestroyEvent(int, Event) override {}
  absl::Status RecordEvent(int, Event, Stream) override { return NoCuda(); }
  absl::Status StreamWaitEvent(int, Stream, Event) override { return NoCuda(); }
  absl::Status SynchronizeEvent(int, Event) override { return NoCuda(); }
  absl::Status WriteValue32(int, Stream, void*, uint32_t) override { return NoCuda(); }
  absl::Status WaitValue32(int, Stream, void*, uint32_t) override { return NoCuda(); }
  absl::StatusOr<void*> RegisterHost(int, void*, uint64_t) override { return NoCuda(); }
  void UnregisterHost(void*) override {}
  absl::StatusOr<void*> HostDevicePointer(int, void*) override { return NoCuda(); }
  absl::StatusOr<void*> AllocatePinned(uint64_t) override { return NoCuda(); }
  void FreePinned(void*) override {}
  absl::StatusOr<IpcMapping> OpenIpc(int, absl::string_view) override { return NoCuda(); }
  absl::Status CloseIpc(int, void*) override { return NoCuda(); }
  absl::Status Touch(int, const void*, uint64_t) override { return NoCuda(); }
  absl::StatusOr<std::vector<std::string>> ExportSampleHandles(int, int) override { return NoCuda(); }
};

#endif

}  // namespace

DeviceRuntime& CudaRuntime() {
#if WPREP_HAVE_CUDA
  static Cuda* runtime = new Cuda();
#else
  static NoCudaRuntime* runtime = new NoCudaRuntime();
#endif
  return *runtime;
}

}  // namespace wprep::server
