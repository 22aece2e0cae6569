// quantize_mxfp4's CUDA entry points in a build without CUDA: they say so.
#include "absl/status/status.h"
#include "wprep/kernels/quantize.h"

namespace wprep {

absl::Status QuantizeOnCuda(const QuantizePlan&, const void*, void*, void*, CudaStream) {
  return absl::UnimplementedError("quantize on CUDA: this build has no CUDA");
}

absl::Status QuantizeLayoutOnCuda(const QuantizePlan&, const QuantLayoutSpec&, const void*, void*, void*,
                                  CudaStream, const QuantBias&) {
  return absl::UnimplementedError("quantize on CUDA: this build has no CUDA");
}

absl::Status QuantizeHostBuffersOnCuda(const QuantizePlan&, const uint8_t*, size_t, uint8_t*,
                                       size_t, uint8_t*, size_t, int, const QuantLayoutSpec&, const QuantBias&) {
  return absl::UnimplementedError("quantize on CUDA: this build has no CUDA");
}

}  // namespace wprep
