#include "device/ipc_owner.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace wprep::server {
namespace {

constexpr size_t kHandleBytes = 64;
constexpr int kHandlesPerGpu = 2;
constexpr char kFewerThanTwoGpus[] =
    "fewer than two GPUs: no other served GPU a handle could be confused with";

// Handles of fresh allocations on `ordinal`; empty on failure. These are the daemon's
// only device allocations outside the accounting allocator: made and freed once at start,
// before SERVING, so no request's figures see them.
std::vector<std::string> ExportHandles(DeviceRuntime& runtime, int ordinal) {
  absl::StatusOr<std::vector<std::string>> h = runtime.ExportSampleHandles(ordinal, kHandlesPerGpu);
  if (!h.ok() || h->size() != static_cast<size_t>(kHandlesPerGpu)) return {};
  return *std::move(h);
}

// Runs `self_exe --export-ipc-handles=...` and parses its lines into samples per ordinal.
bool ChildHandles(const std::string& self_exe, const std::vector<int>& ordinals,
                  std::vector<std::vector<std::string>>* samples, std::string* error) {
  int fds[2];
  if (pipe(fds) != 0) {
    *error = "pipe failed";
    return false;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::string arg0 = self_exe;
  std::string arg1 = absl::StrCat("--export-ipc-handles=", absl::StrJoin(ordinals, ","));
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, self_exe.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    *error = absl::StrCat("could not start ", self_exe, " (errno ", rc, ")");
    return false;
  }
  std::string text;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  char buf[4096];
  for (;;) {
    const int left_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{fds[0], POLLIN, 0};
    if (left_ms <= 0 || poll(&p, 1, left_ms) <= 0) {
      kill(pid, SIGKILL);
      *error = "the handle-exporting child did not answer within 30 s";
      break;
    }
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!error->empty()) return false;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *error = absl::StrCat("the handle-exporting child failed (wait status ", status, ")");
    return false;
  }
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int ordinal = -1;
    if (f.size() != 1 + kHandlesPerGpu || !absl::SimpleAtoi(f[0], &ordinal)) continue;
    for (size_t g = 0; g < ordinals.size(); ++g) {
      if (ordinals[g] != ordinal) continue;
      for (size_t i = 1; i < f.size(); ++i) {
        if (f[i].size() == 2 * kHandleBytes) (*samples)[g].push_back(absl::HexStringToBytes(f[i]));
      }
    }
  }
  // Without the child's handles of a GPU, that GPU's samples would all come from this
  // process, and bytes that only name the process could pass for a GPU id.
  for (size_t g = 0; g < ordinals.size(); ++g) {
    if ((*samples)[g].size() != kHandlesPerGpu) {
      *error = absl::StrCat("the handle-exporting child gave ", (*samples)[g].size(), " of ",
                            kHandlesPerGpu, " handles for GPU ", ordinals[g]);
      return false;
    }
  }
  return true;
}

}  // namespace

IpcOwnerMap IpcOwnerMap::Disabled(std::string why) {
  IpcOwnerMap m;
  m.description_ = std::move(why);
  return m;
}

IpcOwnerMap IpcOwnerMap::FromSamples(const std::vector<int>& ordinals,
                                     const std::vector<std::vector<std::string>>& samples) {
  if (ordinals.size() < 2) return Disabled(kFewerThanTwoGpus);
  if (samples.size() != ordinals.size()) return Disabled("no handle samples");
  for (const std::vector<std::string>& s : samples) {
    if (s.size() < 2) return Disabled("too few handle samples of a GPU");
    for (const std::string& h : s) {
      if (h.size() != kHandleBytes) return Disabled("a handle sample is not 64 bytes");
    }
  }
  IpcOwnerMap m;
  m.ordinals_ = ordinals;
  m.signatures_.resize(ordinals.size());
  for (size_t p = 0; p < kHandleBytes; ++p) {
    std::string values;  // one byte per GPU
    bool stable = true;
    for (const std::vector<std::string>& s : samples) {
      for (const std::string& h : s) stable = stable && h[p] == s[0][p];
      values.push_back(s[0][p]);
    }
    bool distinct = stable;
    for (size_t a = 0; distinct && a < values.size(); ++a) {
      for (size_t b = a + 1; distinct && b < values.size(); ++b) distinct = values[a] != values[b];
    }
    if (!distinct) continue;
    m.positions_.push_back(static_cast<int>(p));
    for (size_t g = 0; g < values.size(); ++g) m.signatures_[g].push_back(values[g]);
  }
  if (m.positions_.empty()) {
    return Disabled("no byte of this driver's IPC handles identifies the exporting GPU");
  }
  m.description_ = absl::StrCat("handle bytes [", absl::StrJoin(m.positions_, ","),
                                "] identify the exporting GPU");
  return m;
}

IpcOwnerMap IpcOwnerMap::Calibrate(DeviceRuntime& runtime, const std::string& self_exe,
                                   const std::vector<int>& ordinals) {
  if (ordinals.size() < 2) return Disabled(kFewerThanTwoGpus);
  std::vector<std::vector<std::string>> samples(ordinals.size());
  std::string error;
  if (!ChildHandles(self_exe, ordinals, &samples, &error)) return Disabled(error);
  for (size_t g = 0; g < ordinals.size(); ++g) {
    std::vector<std::string> own = ExportHandles(runtime, ordinals[g]);
    if (own.empty()) return Disabled(absl::StrCat("could not export a handle on GPU ", ordinals[g]));
    samples[g].insert(samples[g].end(), own.begin(), own.end());
  }
  return FromSamples(ordinals, samples);
}

std::optional<int> IpcOwnerMap::Owner(absl::string_view handle) const {
  if (!enabled() || handle.size() != kHandleBytes) return std::nullopt;
  for (size_t g = 0; g < ordinals_.size(); ++g) {
    bool match = true;
    for (size_t i = 0; match && i < positions_.size(); ++i) {
      match = handle[static_cast<size_t>(positions_[i])] == signatures_[g][i];
    }
    if (match) return ordinals_[g];
  }
  return std::nullopt;
}

int ExportIpcHandlesMain(DeviceRuntime& runtime, const std::vector<int>& ordinals) {
  for (int o : ordinals) {
    std::vector<std::string> handles = ExportHandles(runtime, o);
    if (handles.empty()) return 1;
    std::printf("%d", o);
    for (const std::string& h : handles) std::printf(" %s", absl::BytesToHexString(h).c_str());
    std::printf("\n");
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace wprep::server
