// A CUDA driver API function, taken through the runtime (cudaGetDriverEntryPointByVersion), so
// a test calls the driver without linking libcuda. Include only where CUDA is built.
#ifndef WPREP_TESTS_SUPPORT_DRIVER_ENTRY_H_
#define WPREP_TESTS_SUPPORT_DRIVER_ENTRY_H_

#include <cuda_runtime.h>

namespace wprep::testing {

// `name` (e.g. "cuMemCreate") as a function of type Fn; nullptr where the driver lacks it.
template <typename Fn>
Fn DriverEntry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess) return nullptr;
  return reinterpret_cast<Fn>(p);
}

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SUPPORT_DRIVER_ENTRY_H_
