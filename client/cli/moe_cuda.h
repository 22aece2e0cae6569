// `wprep moe --local --device cuda:N`: host buffers through the CUDA engine (copied in,
// converted, copied out). Apart from moe.cc so that only a CUDA build links cudart.
#ifndef WPREP_CLIENT_CLI_MOE_CUDA_H_
#define WPREP_CLIENT_CLI_MOE_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "wprep/kernels/moe.h"

namespace wprep::cli {

// Allocates device buffers of the plan's sizes on GPU `device`, copies `inputs` in, runs
// RunMoeCuda, copies the outputs back into `outputs` and frees. Unimplemented in a build
// without CUDA.
absl::Status RunMoeHostBuffersOnCuda(const MoePlan& plan, absl::Span<const absl::Span<const uint8_t>> inputs,
                                     absl::Span<const absl::Span<uint8_t>> outputs, int device);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_MOE_CUDA_H_
