// The MoE CUDA engine in a build without nvcc: every call says so.
#include "wprep/kernels/moe.h"

namespace wprep {

absl::Status RunMoeCuda(const MoePlan&, absl::Span<const void* const>, absl::Span<void* const>,
                        void*) {
  return absl::UnimplementedError("this wprep build has no CUDA engine (built without nvcc)");
}

}  // namespace wprep
