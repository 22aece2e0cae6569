#include "device/host_words.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"

namespace wprep::server {

struct HostWords::File {
  DeviceRuntime* runtime = nullptr;
  int fd = -1;
  void* base = nullptr;
  uint64_t bytes = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  bool registered = false;
  uint64_t last_use = 0;
  std::map<int, uint8_t*> device_base;  // GPU ordinal -> the mapping's device address there

  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (registered) runtime->UnregisterHost(base);
    if (base != nullptr) munmap(base, bytes);
    if (fd >= 0) close(fd);
  }
};

namespace {
constexpr absl::string_view kPrefix = "wprep-";
constexpr size_t kMaxNameChars = 200;

absl::Status FileError(absl::string_view field, absl::string_view dir, absl::string_view name,
                       absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, field.empty() ? "" : ": ", dir, "/", name, " ", what));
}

// `field`'s `sub` ("offset"), or `sub` alone for errors relative to the word (no field).
std::string Sub(absl::string_view field, absl::string_view sub) {
  return field.empty() ? std::string(sub) : absl::StrCat(field, ".", sub);
}
}  // namespace

HostWords::HostWords(std::string dir, size_t max_files) : dir_(std::move(dir)), max_files_(max_files) {}

HostWords::~HostWords() {
  absl::MutexLock lock(&mu_);
  files_.clear();
  if (dir_fd_ >= 0) close(dir_fd_);
}

absl::Status HostWords::CheckName(absl::string_view name, absl::string_view field) {
  absl::string_view rest = name;
  bool ok = absl::ConsumePrefix(&rest, kPrefix) && !rest.empty() && rest.size() <= kMaxNameChars;
  for (char c : rest) ok = ok && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        Sub(field, "name"), " must be a file name in /dev/shm made of \"wprep-\" and then 1 to ",
        kMaxNameChars, " of A-Z a-z 0-9 . _ -; got a name of ", name.size(), " bytes"));
  }
  return absl::OkStatus();
}

size_t HostWords::size() const {
  absl::MutexLock lock(&mu_);
  return files_.size();
}

absl::StatusOr<HostWords::Word> HostWords::Acquire(DeviceRuntime& runtime, int gpu, absl::string_view name,
                                                   uint64_t offset, absl::string_view field) {
  if (absl::Status s = CheckName(name, field); !s.ok()) return s;
  if (offset % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(Sub(field, "offset"), " must be a multiple of 4; got ", offset));
  }
  const std::string key(name);
  absl::MutexLock lock(&mu_);
  if (dir_fd_ < 0) {
    dir_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd_ < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, field.empty() ? "" : ": ", "the daemon cannot open ", dir_, " (", std::strerror(errno),
          "); give it the clients' /dev/shm, or name a word of GPU memory (buffer)"));
    }
  }
  struct stat st {};
  if (fstatat(dir_fd_, key.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return FileError(field, dir_, key, absl::StrCat("does not open for the daemon: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return FileError(field, dir_, key, "is not a regular file");
  std::shared_ptr<File> file;
  if (auto it = files_.find(key); it != files_.end() && it->second->dev == st.st_dev && it->second->ino == st.st_ino) {
    file = it->second;
  } else {
    if (it != files_.end()) files_.erase(it);  // another file at the name now
    absl::StatusOr<std::shared_ptr<File>> opened = Open(runtime, gpu, key, dir_fd_, field);
    if (!opened.ok()) return opened.status();
    MakeRoom();
    file = *opened;
    files_[key] = file;
  }
  file->last_use = ++uses_;
  if (offset > file->bytes - 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(Sub(field, "offset"), " ", offset, " is outside the file's ", file->bytes, " bytes"));
  }
  auto base = file->device_base.find(gpu);
  if (base == file->device_base.end()) {
    absl::StatusOr<void*> d = file->runtime->HostDevicePointer(gpu, file->base);
    if (!d.ok()) {
      return FileError(field, dir_, key, absl::StrCat("has no address on the GPU: ", d.status().message()));
    }
    base = file->device_base.emplace(gpu, static_cast<uint8_t*>(*d)).first;
  }
  return Word{base->second + offset, reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(file->base) + offset), file};
}

absl::StatusOr<std::shared_ptr<HostWords::File>> HostWords::Open(DeviceRuntime& runtime, int gpu,
                                                                 const std::string& name, int dir_fd,
                                                                 absl::string_view field) {
  auto file = std::make_shared<File>();
  file->runtime = &runtime;
  file->fd = openat(dir_fd, name.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (file->fd < 0) {
    return FileError(field, dir_, name, absl::StrCat("does not open for writing by the daemon: ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(file->fd, &st) != 0) return FileError(field, dir_, name, absl::StrCat("cannot be read: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return FileError(field, dir_, name, "is not a regular file");
  const auto bytes = static_cast<uint64_t>(st.st_size);
  if (bytes == 0 || bytes % kFileBytesUnit != 0 || bytes > kMaxFileBytes) {
    return FileError(field, dir_, name, absl::StrCat("has ", bytes, " bytes; it must have a positive multiple of ",
                                              kFileBytesUnit, " bytes, at most ", kMaxFileBytes));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file->fd, 0);
  if (base == MAP_FAILED) return FileError(field, dir_, name, absl::StrCat("does not map: ", std::strerror(errno)));
  file->base = base;
  file->bytes = bytes;
  file->dev = st.st_dev;
  file->ino = st.st_ino;
  absl::StatusOr<void*> d = runtime.RegisterHost(gpu, base, bytes);
  if (!d.ok()) return FileError(field, dir_, name, absl::StrCat("cannot be registered with the GPU: ", d.status().message()));
  file->registered = true;
  file->device_base.emplace(gpu, static_cast<uint8_t*>(*d));
  return file;
}

void HostWords::MakeRoom() {
  // Files the clients have unlinked go first; then the least recently used.
  for (auto it = files_.begin(); it != files_.end();) {
    struct stat st {};
    if (fstat(it->second->fd, &st) == 0 && st.st_nlink == 0) {
      it = files_.erase(it);
    } else {
      ++it;
    }
  }
  while (!files_.empty() && files_.size() >= max_files_) {
    auto oldest = files_.begin();
    for (auto it = files_.begin(); it != files_.end(); ++it) {
      if (it->second->last_use < oldest->second->last_use) oldest = it;
    }
    files_.erase(oldest);
  }
}

}  // namespace wprep::server
