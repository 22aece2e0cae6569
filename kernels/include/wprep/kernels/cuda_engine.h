// The CUDA engine: performs a planned conversion as one fused kernel launch.
// Usable without CUDA headers; in a build without CUDA every call returns Unimplemented
// (and CudaDeviceCount() returns 0).
#ifndef WPREP_KERNELS_CUDA_ENGINE_H_
#define WPREP_KERNELS_CUDA_ENGINE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "wprep/kernels/plan.h"

struct CUstream_st;

namespace wprep {

using CudaStream = CUstream_st*;  // same type as cudaStream_t; nullptr = legacy default

// True when this build contains the CUDA kernels.
bool CudaCompiledIn();

// Conversion launches so far in this process that ran below the occupancy their kernel
// was built for: the device admits fewer resident blocks per multiprocessor than the
// kernel's launch bounds name (shared memory or registers short), or the occupancy query
// failed and the launch fell back to fewer blocks. The output is the same; only speed
// suffers. The first such launch of each kernel on a device also writes one warning line
// to stderr. 0 in a build without CUDA.
uint64_t CudaReducedOccupancyLaunches();

// Number of usable CUDA devices (0 without a driver, a device, or CUDA in the build).
int CudaDeviceCount();

// Converts `in` into `out`, both device pointers on the same GPU, with one kernel launch
// on `stream` (which must belong to that GPU). Runs on the device that owns the
// pointers whatever the caller's current device, and leaves the current device as it
// was. Allocates no device memory and does not synchronize: the output is ready when
// `stream` reaches this point. `in` spans plan.input_bytes laid out as
// plan.input_strides; `out` receives plan.output_bytes. Empty plans launch nothing.
absl::Status ConvertOnCuda(const Plan& plan, const void* in, void* out, CudaStream stream);

// Convenience for tools: copies host `in` to GPU `device`, converts there and copies the
// result into host `out`, on a stream of its own, and synchronizes it. Unlike ConvertOnCuda
// it allocates device buffers of the input and output sizes, from the device's default
// pool, which from the first call on keeps freed memory for the process's next calls, and
// copies through two 16 MiB pinned buffers that the calling thread keeps until it ends.
// Thread-safe: threads converting side by side overlap.
absl::Status ConvertHostBuffersOnCuda(const Plan& plan, const uint8_t* in, size_t in_size,
                                      uint8_t* out, size_t out_size, int device);

// Reads one byte of every 64 KiB of [ptr, ptr + bytes) on `stream`'s GPU (a kernel,
// nothing written), so that the GPU's first access to newly mapped memory (CUDA IPC) is
// paid here rather than by the first conversion. Does not synchronize.
absl::Status TouchOnCuda(const void* ptr, uint64_t bytes, CudaStream stream);

// The CUDA device ordinal that owns `ptr`, or InvalidArgument if it is not device memory.
absl::StatusOr<int> CudaDeviceOfPointer(const void* ptr);

}  // namespace wprep

#endif  // WPREP_KERNELS_CUDA_ENGINE_H_
