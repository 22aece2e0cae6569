// CUDA runtime errors as absl::Status naming the call, the CUDA error, file and line
// (house style: every CUDA call checked). For translation units built with CUDA only
// (WPREP_HAVE_CUDA); they include cuda_runtime.h themselves through this header.
#ifndef WPREP_KERNELS_CUDA_STATUS_H_
#define WPREP_KERNELS_CUDA_STATUS_H_

#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wprep {

// OK for cudaSuccess, else `code` with "<call> failed: <name> (<text>) at <file>:<line>".
inline absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line,
                               absl::StatusCode code = absl::StatusCode::kInternal) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::Status(code, absl::StrCat(call, " failed: ", cudaGetErrorName(err), " (",
                                         cudaGetErrorString(err), ") at ", file, ":", line));
}

}  // namespace wprep

#define WPREP_CUDA_STATUS(call) ::wprep::CudaStatus((call), #call, __FILE__, __LINE__)

#define WPREP_CUDA_RETURN_IF_ERROR(call)               \
  do {                                                 \
    ::absl::Status wprep_cuda_s_ = WPREP_CUDA_STATUS(call); \
    if (!wprep_cuda_s_.ok()) return wprep_cuda_s_;     \
  } while (0)

#endif  // WPREP_HAVE_CUDA

#endif  // WPREP_KERNELS_CUDA_STATUS_H_
