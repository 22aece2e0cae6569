// The device a caller's CUDA stream belongs to, asked in a way that stream capture
// allows.
#ifndef WPREP_KERNELS_SRC_CUDA_STREAM_H_
#define WPREP_KERNELS_SRC_CUDA_STREAM_H_

#include <cuda_runtime.h>

namespace wprep {

// Whether `stream` is being captured into a CUDA graph (false for the legacy stream).
inline bool StreamIsCapturing(cudaStream_t stream) {
  if (stream == nullptr) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool capturing = cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                         capture != cudaStreamCaptureStatusNone;
  cudaGetLastError();
  return capturing;
}

// The device of `stream` into `*device`: -1 for the legacy stream and for a stream being
// captured, where cudaStreamGetDevice is not permitted (it would invalidate the capture)
// and the current device, the one launches into the captured stream need, stands for it.
inline cudaError_t StreamDevice(cudaStream_t stream, int* device) {
  *device = -1;
  if (stream == nullptr || StreamIsCapturing(stream)) return cudaSuccess;
  return cudaStreamGetDevice(stream, device);
}

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_CUDA_STREAM_H_
