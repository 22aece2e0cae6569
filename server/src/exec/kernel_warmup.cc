#include "exec/kernel_warmup.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "device/device_run.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/spec.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

absl::StatusOr<int> WarmUpKernels(Gpu& gpu, PinnedHostPool& pinned) {
  const std::vector<ConversionSpec> specs = KernelVariantSpecs();
  for (const ConversionSpec& spec : specs) {
    WPREP_ASSIGN_OR_RETURN(Plan plan, MakePlan(spec, std::vector<int64_t>{2, 256, 256}));
    std::vector<uint8_t> in(plan.input_bytes);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (auto& b : in) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      b = static_cast<uint8_t>(x);
    }
    std::vector<uint8_t> expected(plan.output_bytes);
    WPREP_RETURN_IF_ERROR(ConvertOnCpu(plan, in.data(), in.size(), expected.data(), expected.size()));
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    WPREP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceRun> run,
                           DeviceRun::Begin(gpu, pinned, {plan.input_bytes, plan.output_bytes},
                                            deadline, deadline));
    WPREP_ASSIGN_OR_RETURN(DeviceRun::Result r, run->Convert(plan, RunInput::Host(in.data()), nullptr));
    if (!std::equal(r.host_output.begin(), r.host_output.end(), expected.begin(), expected.end())) {
      return absl::InternalError(absl::StrCat("warm-up: GPU ", FormatUuid(gpu.info().uuid),
                                              " disagrees with the CPU engine on ", Describe(spec)));
    }
  }
  return static_cast<int>(specs.size());
}

}  // namespace wprep::server
