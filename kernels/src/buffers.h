// Buffer checks shared by the CPU and CUDA engines.
#ifndef WPREP_KERNELS_SRC_BUFFERS_H_
#define WPREP_KERNELS_SRC_BUFFERS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "wprep/kernels/plan.h"

namespace wprep {

// InvalidArgument when the plan's input span at `in` and output span at `out` overlap.
inline absl::Status CheckDisjoint(const Plan& plan, const void* in, const void* out) {
  const auto* a = static_cast<const uint8_t*>(in);
  const auto* b = static_cast<const uint8_t*>(out);
  const uint64_t na = plan.input_bytes, nb = plan.output_bytes;
  if (na > 0 && nb > 0 && a < b + nb && b < a + na) {
    return absl::InvalidArgumentError(
        "input and output buffers overlap; in-place conversion is not supported");
  }
  return absl::OkStatus();
}

// InvalidArgument for a non-empty plan without the geometry MakePlan attaches (a Plan
// assembled by hand): the engines have nothing to run it by.
inline absl::Status CheckPlanned(const Plan& plan) {
  if (!plan.empty() && plan.geometry == nullptr) {
    return absl::InvalidArgumentError(
        "plan has no engine geometry; plans must come from MakePlan");
  }
  return absl::OkStatus();
}

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_BUFFERS_H_
