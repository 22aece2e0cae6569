// The CPU engine: performs a planned conversion with host threads.
#ifndef WPREP_KERNELS_CPU_ENGINE_H_
#define WPREP_KERNELS_CPU_ENGINE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "wprep/kernels/plan.h"

namespace wprep {

struct CpuOptions {
  // Worker threads; 0 = std::thread::hardware_concurrency(). Small conversions run on
  // the calling thread whatever this says.
  int threads = 0;
};

// Converts `in` (plan.input_bytes spanned, laid out as plan.input_strides) into `out`
// (plan.output_bytes, written in full, padding included). Buffers must not overlap.
// Reads each input byte once and writes each output byte once. Thread-safe: concurrent
// calls share nothing.
absl::Status ConvertOnCpu(const Plan& plan, const uint8_t* in, size_t in_size, uint8_t* out,
                          size_t out_size, const CpuOptions& options = {});

}  // namespace wprep

#endif  // WPREP_KERNELS_CPU_ENGINE_H_
