#include "wprep/client/cuda_vmm.h"

#include <cuda.h>  // driver types only: libcuda is never linked
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace wprep::client {
namespace {

// The driver's calls, resolved once from the driver the runtime loaded.
struct Driver {
  CUresult (*range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*retain)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long) =
      nullptr;
  CUresult (*properties)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  bool ok = false;
};

template <typename Fn>
bool Resolve(Fn* fn, const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

const Driver& Drv() {
  static const Driver d = [] {
    Driver v;
    // Every one resolved (each tried, so that none is left unset by a short circuit).
    v.ok = true;
    v.ok = Resolve(&v.range, "cuMemGetAddressRange") && v.ok;
    v.ok = Resolve(&v.retain, "cuMemRetainAllocationHandle") && v.ok;
    v.ok = Resolve(&v.release, "cuMemRelease") && v.ok;
    v.ok = Resolve(&v.export_handle, "cuMemExportToShareableHandle") && v.ok;
    v.ok = Resolve(&v.properties, "cuMemGetAllocationPropertiesFromHandle") && v.ok;
    v.ok = Resolve(&v.granularity, "cuMemGetAllocationGranularity") && v.ok;
    return v;
  }();
  return d;
}

absl::Status DriverError(const char* call, CUresult r, const char* hint = "") {
  return absl::InvalidArgumentError(absl::StrCat(call, " failed with CUresult ", static_cast<int>(r), hint));
}

}  // namespace

VmmExporter::~VmmExporter() {
  absl::MutexLock lock(&mu_);
  for (auto& [base, c] : chunks_) close(c.fd);
}

void VmmExporter::Forget(const void* chunk_base) {
  absl::MutexLock lock(&mu_);
  auto it = chunks_.find(reinterpret_cast<uintptr_t>(chunk_base));
  if (it == chunks_.end()) return;
  close(it->second.fd);
  chunks_.erase(it);
}

absl::StatusOr<VmmExporter::Chunk> VmmExporter::ChunkAt(uintptr_t base, uint64_t bytes) {
  if (auto it = chunks_.find(base); it != chunks_.end() && it->second.bytes == bytes) return it->second;
  const Driver& d = Drv();
  CUmemGenericAllocationHandle h = 0;
  if (CUresult r = d.retain(&h, reinterpret_cast<void*>(base)); r != CUDA_SUCCESS) {
    return DriverError("cuMemRetainAllocationHandle", r, " (is the memory from cuMemCreate + cuMemMap?)");
  }
  Chunk c;
  c.bytes = bytes;
  CUmemAllocationProp prop{};
  size_t g = 0;
  CUresult r = d.properties(&prop, h);
  if (r == CUDA_SUCCESS) r = d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUDA_SUCCESS) r = d.export_handle(&c.fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d.release(h);
  if (r != CUDA_SUCCESS) {
    return DriverError("exporting the chunk", r,
                       " (was it created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes?)");
  }
  c.granularity = g;
  if (auto it = chunks_.find(base); it != chunks_.end()) close(it->second.fd);  // remapped since
  chunks_[base] = c;
  return c;
}

absl::StatusOr<wprep::v1::CudaIpcBuffer> VmmExporter::Export(const void* ptr, uint64_t bytes, int device) {
  const Driver& d = Drv();
  if (!d.ok) return absl::FailedPreconditionError("the CUDA driver lacks the virtual-memory API");
  cudaDeviceProp dp;
  if (cudaGetDeviceProperties(&dp, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("no CUDA device ", device));
  }
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("cannot make CUDA device ", device, " current"));
  }
  wprep::v1::CudaIpcBuffer b;
  b.set_device_uuid(std::string(dp.uuid.bytes, sizeof(dp.uuid.bytes)));
  b.set_size(bytes);
  wprep::v1::CudaVmmBuffer* v = b.mutable_vmm();
  v->set_handle_type(wprep::v1::VMM_HANDLE_TYPE_POSIX_FD);
  v->set_pid(getpid());
  const uintptr_t start = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t end = start + (bytes == 0 ? 1 : bytes);
  absl::MutexLock lock(&mu_);
  uint64_t granularity = 0;
  for (uintptr_t at = start; at < end;) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = d.range(&base, &size, static_cast<CUdeviceptr>(at)); r != CUDA_SUCCESS) {
      return DriverError("cuMemGetAddressRange", r, " (the range runs past mapped memory)");
    }
    if (at == start) b.set_offset(start - base);
    absl::StatusOr<Chunk> c = ChunkAt(base, size);
    if (!c.ok()) return c.status();
    wprep::v1::VmmChunk* chunk = v->add_chunks();
    chunk->set_fd(c->fd);
    chunk->set_size(c->bytes);
    if (granularity == 0 || c->granularity < granularity) granularity = c->granularity;
    at = base + size;
  }
  v->set_granularity(granularity);
  return b;
}

}  // namespace wprep::client
