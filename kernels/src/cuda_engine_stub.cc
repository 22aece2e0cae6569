// The CUDA engine in a build without nvcc: every call says so.
#include "wprep/kernels/cuda_engine.h"

namespace wprep {

bool CudaCompiledIn() { return false; }
uint64_t CudaReducedOccupancyLaunches() { return 0; }
int CudaDeviceCount() { return 0; }

absl::Status ConvertOnCuda(const Plan&, const void*, void*, CudaStream) {
  return absl::UnimplementedError("this wprep build has no CUDA engine (built without nvcc)");
}

absl::Status ConvertHostBuffersOnCuda(const Plan&, const uint8_t*, size_t, uint8_t*, size_t,
                                      int) {
  return absl::UnimplementedError("this wprep build has no CUDA engine (built without nvcc)");
}

absl::Status TouchOnCuda(const void*, uint64_t, CudaStream) {
  return absl::UnimplementedError("this wprep build has no CUDA engine (built without nvcc)");
}

absl::StatusOr<int> CudaDeviceOfPointer(const void*) {
  return absl::UnimplementedError("this wprep build has no CUDA engine (built without nvcc)");
}

}  // namespace wprep
