// How many blocks a conversion launch keeps resident, and whether that is what its
// kernel was built for. Host-only and CUDA-free so the decision can be tested anywhere.
#ifndef WPREP_KERNELS_SRC_OCCUPANCY_H_
#define WPREP_KERNELS_SRC_OCCUPANCY_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"

namespace wprep {

// One kernel on one device: the launch's grid is `blocks` (one wave of resident blocks,
// each looping over tiles). Any grid gives the same output; a short one only runs slower.
struct Residency {
  int64_t blocks = 1;     // blocks of one wave, >= 1
  int sms = 0;            // multiprocessors; 0: the query failed
  int per_sm = 0;         // resident blocks per multiprocessor; 0: the query failed
  int wanted_per_sm = 1;  // what the kernel's __launch_bounds__ were built for
  // Every multiprocessor holds the blocks the kernel was built for.
  bool full() const { return sms > 0 && per_sm >= wanted_per_sm; }
};

// From the device's multiprocessor count and the occupancy query's blocks per
// multiprocessor (each 0 where its query failed): a failed count is taken as one, so an
// unknown device still runs, on fewer blocks than it could hold.
inline Residency MakeResidency(int sms, int per_sm, int wanted_per_sm) {
  Residency r;
  r.sms = sms > 0 ? sms : 0;
  r.per_sm = per_sm > 0 ? per_sm : 0;
  r.wanted_per_sm = wanted_per_sm > 0 ? wanted_per_sm : 1;
  r.blocks = int64_t{sms > 0 ? sms : 1} * (per_sm > 0 ? per_sm : 1);
  return r;
}

// The warning a launch below full occupancy writes once per kernel and device.
inline std::string ResidencyWarning(const Residency& r, std::string_view kernel, int device) {
  std::string why;
  if (r.sms == 0) {
    why = "the multiprocessor count query failed";
  } else if (r.per_sm == 0) {
    why = "the occupancy query failed";
  } else {
    why = absl::StrFormat("the device admits %d resident blocks per multiprocessor, not %d",
                          r.per_sm, r.wanted_per_sm);
  }
  return absl::StrFormat(
      "wprep: CUDA kernel %s on device %d runs below full occupancy (%d blocks in flight): %s; "
      "results are unaffected, throughput is lower",
      kernel, device, r.blocks, why);
}

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_OCCUPANCY_H_
