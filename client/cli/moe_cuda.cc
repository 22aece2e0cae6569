#include "moe_cuda.h"

#include <vector>

#include "absl/strings/str_cat.h"

#if defined(WPREP_CLI_MOE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace wprep::cli {

#if defined(WPREP_CLI_MOE_CUDA)
namespace {

absl::Status Check(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(e)));
}

// Device buffers freed on every path.
struct DeviceBuffers {
  std::vector<void*> ptrs;
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
  }
  absl::StatusOr<void*> Add(uint64_t bytes) {
    void* p = nullptr;
    // One byte at least: a zero-byte output still has an address to pass.
    if (absl::Status s = Check(cudaMalloc(&p, bytes > 0 ? bytes : 1), "cudaMalloc"); !s.ok()) return s;
    ptrs.push_back(p);
    return p;
  }
};

}  // namespace

absl::Status RunMoeHostBuffersOnCuda(const MoePlan& plan, absl::Span<const absl::Span<const uint8_t>> inputs,
                                     absl::Span<const absl::Span<uint8_t>> outputs, int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError("--device cuda:N: no CUDA GPU is visible to this process; use --device cpu");
  }
  if (device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("--device cuda:", device, ": this machine has ", count, " GPUs"));
  }
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  DeviceBuffers buffers;
  std::vector<const void*> in;
  std::vector<void*> out;
  for (const absl::Span<const uint8_t>& h : inputs) {
    absl::StatusOr<void*> d = buffers.Add(h.size());
    if (!d.ok()) return d.status();
    if (absl::Status s = Check(cudaMemcpy(*d, h.data(), h.size(), cudaMemcpyHostToDevice), "cudaMemcpy"); !s.ok()) {
      return s;
    }
    in.push_back(*d);
  }
  for (const absl::Span<uint8_t>& h : outputs) {
    absl::StatusOr<void*> d = buffers.Add(h.size());
    if (!d.ok()) return d.status();
    out.push_back(*d);
  }
  if (absl::Status s = RunMoeCuda(plan, in, out, nullptr); !s.ok()) return s;
  if (absl::Status s = Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !s.ok()) return s;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (absl::Status s = Check(cudaMemcpy(outputs[i].data(), out[i], outputs[i].size(), cudaMemcpyDeviceToHost),
                               "cudaMemcpy");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

#else

absl::Status RunMoeHostBuffersOnCuda(const MoePlan&, absl::Span<const absl::Span<const uint8_t>>,
                                     absl::Span<const absl::Span<uint8_t>>, int) {
  return absl::UnimplementedError("--device cuda:N: this wprep build has no CUDA engine (built without nvcc); "
                                  "use --device cpu");
}

#endif

}  // namespace wprep::cli
