// wprep_ipc_probe: what opening CUDA IPC handles costs, and what an importer can learn
// about the GPU that owns the memory (a diagnostic program, not a test).
//
//   wprep_ipc_probe [--alloc-device=A] [--open-device=B] [--count=N] [--size=BYTES]
//
// A forked child allocates N buffers on GPU A and exports their handles through a pipe;
// the parent opens them on GPU B and prints one line per measurement:
//   - the time of each cudaIpcOpenMemHandle (the first one separately) and of closing;
//   - the owner that cudaPointerGetAttributes and cuPointerGetAttribute report;
//   - what the driver's cuIpcOpenMemHandle answers with flags 0 (no peer access);
//   - whether a failed open of the process's own handle first makes the next open cheaper.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "wprep/config.h"
#include "wprep/flags/flags.h"

#if WPREP_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#if WPREP_HAVE_CUDA
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

bool ReadAll(int fd, void* p, size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

template <typename Fn>
Fn Driver(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    std::printf("driver entry point %s: not found\n", name);
    return nullptr;
  }
  return reinterpret_cast<Fn>(p);
}

int Exporter(int alloc_device, int count, size_t size, int handle_fd, int done_fd) {
  if (cudaSetDevice(alloc_device) != cudaSuccess) return 1;
  std::vector<void*> bufs(count);
  for (int i = 0; i < count; ++i) {
    if (cudaMalloc(&bufs[i], size) != cudaSuccess) return 1;
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, bufs[i]) != cudaSuccess) return 1;
    if (write(handle_fd, &h, sizeof(h)) != static_cast<ssize_t>(sizeof(h))) return 1;
    if (i < 3) {
      std::string hex;
      for (int b = 0; b < 64; ++b) {
        char x[3];
        std::snprintf(x, sizeof(x), "%02x", static_cast<unsigned char>(h.reserved[b]));
        hex += x;
        if (b % 8 == 7) hex += ' ';
      }
      std::fprintf(stderr, "handle[%d] dev%d %s\n", i, alloc_device, hex.c_str());
    }
  }
  close(handle_fd);
  char c;
  while (read(done_fd, &c, 1) > 0) {
  }
  for (void* b : bufs) cudaFree(b);
  return 0;
}

// The physical location of a VMM-backed pointer, if the driver treats it as one.
void AllocationLocation(const char* what, void* p) {
  using RetainFn = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using PropsFn = CUresult (*)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
  using ReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
  static RetainFn retain = Driver<RetainFn>("cuMemRetainAllocationHandle");
  static PropsFn props = Driver<PropsFn>("cuMemGetAllocationPropertiesFromHandle");
  static ReleaseFn release = Driver<ReleaseFn>("cuMemRelease");
  if (retain == nullptr || props == nullptr || release == nullptr) return;
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = retain(&h, p);
  if (r != CUDA_SUCCESS) {
    std::printf("%s retain_allocation_handle CUresult=%d\n", what, static_cast<int>(r));
    return;
  }
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  const CUresult r2 = props(&prop, h);
  std::printf("%s allocation_location type=%d id=%d (CUresult %d)\n", what,
              static_cast<int>(prop.location.type), prop.location.id, static_cast<int>(r2));
  release(h);
}

void Attributes(const char* what, void* p) {
  AllocationLocation(what, p);
  using GetAttrFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static GetAttrFn get_attr = Driver<GetAttrFn>("cuPointerGetAttribute");
  cudaPointerAttributes a;
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  int ordinal = -1;
  CUresult r = CUDA_ERROR_NOT_FOUND;
  if (get_attr != nullptr) {
    r = get_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, reinterpret_cast<CUdeviceptr>(p));
  }
  std::printf("%s runtime_device=%d (%s) driver_device_ordinal=%d (CUresult %d)\n", what,
              e == cudaSuccess ? a.device : -1, cudaGetErrorName(e), ordinal, static_cast<int>(r));
}

int Importer(int open_device, int count, const std::vector<cudaIpcMemHandle_t>& handles) {
  const auto t0 = Clock::now();
  if (cudaSetDevice(open_device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return 1;
  std::printf("context_init_ms %.3f\n", Ms(Clock::now() - t0));
  int can = 0;
  int n = 0;
  cudaGetDeviceCount(&n);
  for (int d = 0; d < n; ++d) {
    if (d == open_device) continue;
    cudaDeviceCanAccessPeer(&can, open_device, d);
    std::printf("can_access_peer %d->%d %d\n", open_device, d, can);
  }

  // The driver's open without CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, on handle 0.
  using OpenFn = CUresult (*)(CUdeviceptr*, CUipcMemHandle, unsigned int);
  using CloseFn = CUresult (*)(CUdeviceptr);
  OpenFn drv_open = Driver<OpenFn>("cuIpcOpenMemHandle");
  CloseFn drv_close = Driver<CloseFn>("cuIpcCloseMemHandle");
  if (drv_open != nullptr && drv_close != nullptr) {
    CUipcMemHandle h;
    std::memcpy(&h, &handles[0], sizeof(h));
    CUdeviceptr p = 0;
    const auto t = Clock::now();
    const CUresult r = drv_open(&p, h, 0);
    std::printf("driver_open_flags0 CUresult=%d ms=%.3f\n", static_cast<int>(r), Ms(Clock::now() - t));
    if (r == CUDA_SUCCESS) {
      Attributes("driver_open_flags0", reinterpret_cast<void*>(p));
      drv_close(p);
    }
  }
  {
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, handles[0], 0);
    std::printf("runtime_open_flags0 %s\n", cudaGetErrorName(e));
    if (e == cudaSuccess) cudaIpcCloseMemHandle(p);
    cudaGetLastError();
  }

  // Opens with the lazy peer flag, one at a time.
  std::vector<void*> ptrs(count, nullptr);
  std::vector<double> open_ms;
  for (int i = 0; i < count; ++i) {
    const auto t = Clock::now();
    const cudaError_t e = cudaIpcOpenMemHandle(&ptrs[i], handles[i], cudaIpcMemLazyEnablePeerAccess);
    open_ms.push_back(Ms(Clock::now() - t));
    if (e != cudaSuccess) {
      std::printf("open %d failed: %s\n", i, cudaGetErrorName(e));
      return 1;
    }
  }
  Attributes("lazy_open", ptrs[0]);
  for (int i = 0; i < count; ++i) std::printf("open_ms[%d] %.3f\n", i, open_ms[i]);
  if (n > 1) {
    for (int d = 0; d < n; ++d) {
      if (d == open_device) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
      std::printf("enable_peer_after_open %d->%d %s\n", open_device, d, cudaGetErrorName(e));
      if (e == cudaSuccess) cudaDeviceDisablePeerAccess(d);
      cudaGetLastError();
    }
  }
  std::vector<double> close_ms;
  for (int i = 0; i < count; ++i) {
    const auto t = Clock::now();
    cudaIpcCloseMemHandle(ptrs[i]);
    close_ms.push_back(Ms(Clock::now() - t));
  }
  for (int i = 0; i < count; ++i) std::printf("close_ms[%d] %.3f\n", i, close_ms[i]);
  // Reopening a closed handle: is the cost per handle or per first sight?
  {
    void* p = nullptr;
    const auto t = Clock::now();
    const cudaError_t e = cudaIpcOpenMemHandle(&p, handles[0], cudaIpcMemLazyEnablePeerAccess);
    std::printf("reopen_ms %.3f %s\n", Ms(Clock::now() - t), cudaGetErrorName(e));
    if (e == cudaSuccess) cudaIpcCloseMemHandle(p);
  }
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  wprep::flags::FlagSet fs("wprep_ipc_probe",
                           "usage: wprep_ipc_probe [flags]\n"
                           "What opening CUDA IPC handles costs, and what an importer learns about their owner.\n");
  fs.Int("alloc-device", "A", 0, "the GPU the owner process allocates on", 0, 1024);
  fs.Int("open-device", "B", 0, "the GPU the importing process opens the handles on", 0, 1024);
  fs.Int("count", "N", 8, "allocations (handles) to export", 1, 1 << 20);
  fs.Bytes("size", "BYTES", 1 << 20, "bytes of each allocation", 1);
  fs.Switch("prewarm", "create the importer's CUDA context before timing the opens");
  if (absl::Status s = fs.Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_ipc_probe: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
#if !WPREP_HAVE_CUDA
  std::printf("built without CUDA\n");
  return 3;
#else
  const int alloc_device = static_cast<int>(fs.GetInt("alloc-device"));
  const int open_device = static_cast<int>(fs.GetInt("open-device"));
  const int count = static_cast<int>(fs.GetInt("count"));
  const size_t size = fs.GetBytes("size");
  const bool prewarm = fs.GetSwitch("prewarm");
  int handle_pipe[2], done_pipe[2];
  if (pipe(handle_pipe) != 0 || pipe(done_pipe) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    close(handle_pipe[0]);
    close(done_pipe[1]);
    _exit(Exporter(alloc_device, count, size, handle_pipe[1], done_pipe[0]));
  }
  close(handle_pipe[1]);
  close(done_pipe[0]);
  std::vector<cudaIpcMemHandle_t> handles(count);
  for (int i = 0; i < count; ++i) {
    if (!ReadAll(handle_pipe[0], &handles[i], sizeof(handles[i]))) {
      std::printf("exporter failed\n");
      return 1;
    }
  }
  std::printf("alloc_device %d open_device %d count %d size %zu prewarm %d\n", alloc_device,
              open_device, count, size, prewarm ? 1 : 0);
  if (prewarm) {
    // A failed open of this process's own handle: does it set up what the first real
    // open would otherwise pay for?
    cudaSetDevice(open_device);
    void* own = nullptr;
    cudaMalloc(&own, 1 << 20);
    cudaIpcMemHandle_t h;
    cudaIpcGetMemHandle(&h, own);
    void* p = nullptr;
    const auto t = Clock::now();
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    std::printf("prewarm_own_open %s ms=%.3f\n", cudaGetErrorName(e), Ms(Clock::now() - t));
    cudaGetLastError();
    cudaFree(own);
  }
  const int rc = Importer(open_device, count, handles);
  close(done_pipe[1]);
  int status = 0;
  waitpid(child, &status, 0);
  return rc;
#endif
}
