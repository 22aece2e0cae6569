// The kernel warm-up: before the daemon serves, every kernel variant of the engine runs
// once on each GPU through a DeviceRun, and its output is compared byte for byte with
// the CPU engine's. It is work the executor's way (a DeviceRun per conversion), so it
// lives here; the device layer only runs it on every GPU at once
// (DeviceManager::WarmUp).
#ifndef WPREP_SERVER_SRC_EXEC_KERNEL_WARMUP_H_
#define WPREP_SERVER_SRC_EXEC_KERNEL_WARMUP_H_

#include "absl/status/statusor.h"
#include "device/device_manager.h"

namespace wprep::server {

// Runs every kernel variant of the engine (KernelVariantSpecs) once on `gpu` and checks
// each against the CPU engine. Returns the number of variants.
absl::StatusOr<int> WarmUpKernels(Gpu& gpu, PinnedHostPool& pinned);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_KERNEL_WARMUP_H_
