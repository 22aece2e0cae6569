// Which of the daemon's GPUs holds the memory behind a CUDA IPC handle.
//
// CUDA has no public query for it. cudaIpcOpenMemHandle must be given
// cudaIpcMemLazyEnablePeerAccess (0 is refused), so a handle of another GPU's memory opens
// on the GPU a request names, over the peer link, and every pointer attribute of the
// mapping (runtime device, driver device ordinal) then reports the importing GPU
// (measured on an H200 pair with wprep_ipc_probe; docs/PERFORMANCE.md). The 64 handle
// bytes do carry a field that identifies the exporting GPU (one byte on driver 580), but
// their format is undocumented. So the daemon does not assume a format: at start it
// exports two handles per GPU itself and has a child process (wprepd in its
// --export-ipc-handles mode) export two more, and keeps the byte positions whose values
// agree across every handle of a GPU, in both processes, and differ between every pair of
// GPUs. Those bytes are each GPU's signature. With no such position (one GPU, or a driver
// whose handles do not identify their GPU) the check is off and says why.
#ifndef WPREP_SERVER_SRC_IPC_OWNER_H_
#define WPREP_SERVER_SRC_IPC_OWNER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "device/device_runtime.h"

namespace wprep::server {

class IpcOwnerMap {
 public:
  // A map that never names an owner; `why` says why it is off.
  static IpcOwnerMap Disabled(std::string why);
  // From samples: samples[g] holds handles (64 bytes each) of GPU ordinals[g], exported
  // by at least two processes. Pure; the calibration's decision in one place.
  static IpcOwnerMap FromSamples(const std::vector<int>& ordinals,
                                 const std::vector<std::vector<std::string>>& samples);
  // Exports handles on `ordinals` in this process and in a child (`self_exe`
  // --export-ipc-handles=...) and calls FromSamples. Needs two GPUs or more.
  static IpcOwnerMap Calibrate(DeviceRuntime& runtime, const std::string& self_exe,
                               const std::vector<int>& ordinals);

  bool enabled() const { return !positions_.empty(); }
  // Why the check is off, or which byte positions identify the GPU when it is on.
  const std::string& description() const { return description_; }
  // The ordinal whose signature `handle` carries; nullopt when it carries none of them
  // (the check is off, or the memory is on a GPU this daemon does not serve).
  std::optional<int> Owner(absl::string_view handle) const;

 private:
  std::vector<int> positions_;
  std::vector<int> ordinals_;
  std::vector<std::string> signatures_;  // per ordinal: its bytes at positions_
  std::string description_;
};

// The child's side of the calibration: exports two handles on each ordinal and prints one
// line per GPU, "ORDINAL HEX HEX", to stdout. Returns the process exit status.
int ExportIpcHandlesMain(DeviceRuntime& runtime, const std::vector<int>& ordinals);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_IPC_OWNER_H_
