// cuMem (CUDA virtual-memory) allocations -> CudaIpcBuffers with a CudaVmmBuffer (CMake
// target wprep::client_cuda; the header needs no CUDA headers). Memory made with
// cuMemCreate + cuMemMap (a cuMem pool, torch's expandable segments) cannot be exported
// with cudaIpcGetMemHandle; the daemon maps it instead from a POSIX file descriptor per
// physical chunk, taken from this process with pidfd_getfd. So the client must send it on
// the daemon's Unix socket, and the allocation must have been created with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requested handle types.
#ifndef WPREP_CLIENT_CUDA_VMM_H_
#define WPREP_CLIENT_CUDA_VMM_H_

#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::client {

// Thread-safe. Exports each chunk once (cuMemRetainAllocationHandle +
// cuMemExportToShareableHandle) and keeps its descriptor open, so that every request names
// the same descriptors and the daemon reuses its mapping; the destructor closes them.
class VmmExporter {
 public:
  VmmExporter() = default;
  ~VmmExporter();
  VmmExporter(const VmmExporter&) = delete;
  VmmExporter& operator=(const VmmExporter&) = delete;

  // The buffer of [ptr, ptr + bytes) on `device` (a CUDA ordinal of this process): the
  // chunks mapped there, back to back from the one holding ptr (cuMemGetAddressRange per
  // chunk), the offset of ptr in the first, and the device's UUID. InvalidArgument when a
  // byte of the range is not cuMem memory exportable as a POSIX file descriptor.
  absl::StatusOr<wprep::v1::CudaIpcBuffer> Export(const void* ptr, uint64_t bytes, int device);
  // Closes the descriptor of the chunk mapped at `chunk_base` (before unmapping it).
  void Forget(const void* chunk_base);

 private:
  struct Chunk {
    int fd = -1;
    uint64_t bytes = 0;
    uint64_t granularity = 0;
  };
  absl::StatusOr<Chunk> ChunkAt(uintptr_t base, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<uintptr_t, Chunk> chunks_ ABSL_GUARDED_BY(mu_);  // by base address
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_CUDA_VMM_H_
