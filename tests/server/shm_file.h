// A file of /dev/shm for a test, as a client makes one for ConvertBatchRequest.
// completion_flag.host_word: created empty with `bytes` bytes, mapped here to read what the
// daemon wrote, unlinked on destruction.
#ifndef WPREP_TESTS_SERVER_SHM_FILE_H_
#define WPREP_TESTS_SERVER_SHM_FILE_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace wprep::testing {

class ShmFile {
 public:
  explicit ShmFile(uint64_t bytes) : name_(NextName()), bytes_(bytes) {
    int fd = open(path().c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return;
    if (ftruncate(fd, static_cast<off_t>(bytes)) == 0 && bytes > 0) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) base_ = static_cast<uint8_t*>(p);
    }
    close(fd);
  }
  ~ShmFile() {
    if (base_ != nullptr) munmap(base_, bytes_);
    unlink(path().c_str());
  }
  ShmFile(const ShmFile&) = delete;
  ShmFile& operator=(const ShmFile&) = delete;

  static std::string NextName() {
    static std::atomic<int> n{0};
    return absl::StrCat("wprep-test-", getpid(), "-", n++);
  }
  bool ok() const { return base_ != nullptr || bytes_ == 0; }
  const std::string& name() const { return name_; }
  std::string path() const { return "/dev/shm/" + name_; }
  uint8_t* base() const { return base_; }
  uint32_t Word(uint64_t offset) const {
    uint32_t v = 0;
    std::memcpy(&v, base_ + offset, 4);
    return v;
  }

 private:
  std::string name_;
  uint64_t bytes_;
  uint8_t* base_ = nullptr;
};

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_SHM_FILE_H_
