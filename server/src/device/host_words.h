// Words of the host's shared memory (/dev/shm) that clients' streams wait on
// (the fences' words of shared host memory, client_fence.h): each file is opened, mapped and
// registered with the GPUs once, and kept while the same file (device and inode) stays at
// its name. The daemon's CPU never reads or writes the mappings; only its GPUs write the
// words (DeviceRuntime::WriteValue32). Thread-safe.
#ifndef WPREP_SERVER_SRC_HOST_WORDS_H_
#define WPREP_SERVER_SRC_HOST_WORDS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "device/device_runtime.h"

namespace wprep::server {

class HostWords {
 public:
  // Files of `dir` (the daemon's /dev/shm); at most `max_files` kept mapped (and registered:
  // page-locked), so at most max_files x kMaxFileBytes of the host's memory.
  explicit HostWords(std::string dir = "/dev/shm", size_t max_files = 64);
  ~HostWords();
  HostWords(const HostWords&) = delete;
  HostWords& operator=(const HostWords&) = delete;

  // The largest file taken, and the unit of its size.
  static constexpr uint64_t kMaxFileBytes = 64 << 10;
  static constexpr uint64_t kFileBytesUnit = 4096;

  // A client's name for a file: "wprep-" and then 1 to 200 of A-Z a-z 0-9 . _ -. Errors
  // name `field` (the SharedHostWord's, as the edge names it; empty: errors relative to
  // the word, "offset 8 is ...").
  static absl::Status CheckName(absl::string_view name, absl::string_view field);

  struct Word {
    void* device_ptr = nullptr;        // the word's address on the GPU asked for
    uint32_t* host = nullptr;          // and in the daemon (only ReadyWords touches it)
    std::shared_ptr<const void> keep;  // the file's mapping, alive while held
  };
  // The 4-byte word at `offset` of file `name`, on `gpu` of `runtime`. InvalidArgument,
  // naming what to fix, for a bad name or offset, a file that does not open for writing,
  // is not a regular file (a symbolic link included), or whose size is not a positive
  // multiple of kFileBytesUnit up to kMaxFileBytes, or that the GPUs cannot register.
  absl::StatusOr<Word> Acquire(DeviceRuntime& runtime, int gpu, absl::string_view name, uint64_t offset,
                               absl::string_view field);

  // Files mapped now.
  size_t size() const;

 private:
  struct File;
  absl::StatusOr<std::shared_ptr<File>> Open(DeviceRuntime& runtime, int gpu, const std::string& name, int dir_fd,
                                             absl::string_view field) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MakeRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  const size_t max_files_;
  mutable absl::Mutex mu_;
  int dir_fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t uses_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<File>> files_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_HOST_WORDS_H_
