// Private: turns CUDA runtime errors into absl::Status with the call, the CUDA error
// string, file and line. Only for .cc files built with WPREP_HAVE_CUDA.
#ifndef WPREP_SERVER_SRC_CUDA_CHECK_H_
#define WPREP_SERVER_SRC_CUDA_CHECK_H_

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wprep::server::internal {

inline absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line,
                               absl::StatusCode code = absl::StatusCode::kInternal) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::Status(code, absl::StrCat(call, " failed: ", cudaGetErrorName(err), " (",
                                         cudaGetErrorString(err), ") at ", file, ":", line));
}

}  // namespace wprep::server::internal

#define WPREP_CUDA_STATUS(call) \
  ::wprep::server::internal::CudaStatus((call), #call, __FILE__, __LINE__)

#define WPREP_CUDA_RETURN_IF_ERROR(call)                    \
  do {                                                      \
    ::absl::Status _wprep_s = WPREP_CUDA_STATUS(call);      \
    if (!_wprep_s.ok()) return _wprep_s;                    \
  } while (0)

#endif  // WPREP_HAVE_CUDA

#endif  // WPREP_SERVER_SRC_CUDA_CHECK_H_
