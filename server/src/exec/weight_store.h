// Resident weight sets: checkpoints the daemon loaded once, with the tensors the rules
// name converted into the kernels' layouts, kept for engines that attach instead of
// loading and preparing.
//
// A set's sources are safetensors files under the operator's root (--weights-root);
// every path is resolved with realpath and must stay inside it, so `..`, absolute paths
// and symlinks that leave the root are refused. A load plans every tensor (checking the
// headers, the rules and the budget) before it allocates anything, so a refused load
// changes nothing. A set lives on one GPU or in host memory:
// - on a GPU, in one device allocation of its own that attached clients open: cudaMalloc
//   memory from its CUDA IPC handle, or (WeightPlacement::vmm) one cuMemCreate chunk from
//   a POSIX descriptor that the attached process fetches once with a token
//   (TakeVmmHandle, served on the handle socket). The checkpoint streams through pinned staging buffers
//   (read by several threads, copied while the next piece is read) and converts on the
//   GPU; the host never holds a converted tensor. Dropping the set frees the memory.
// - in host memory, in a shared-memory file of its own (/dev/shm) that attached clients
//   map read-only; the file is unlinked when the set is dropped, and mappings made before
//   stay valid.
// The budget applies to each GPU and to host memory apart.
//
// An attachment is held by a caller (the AttachWeights stream) for as long as it waits
// in Hold: until Detach, a forced Drop, Close, or the caller's own cancellation.
#ifndef WPREP_SERVER_SRC_EXEC_WEIGHT_STORE_H_
#define WPREP_SERVER_SRC_EXEC_WEIGHT_STORE_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "device/device_runtime.h"
#include "wprep/spec/spec.h"

namespace wprep::server {

// Elements [start, start + length) along `axis` of a stored tensor (negative axes count
// from the last).
struct WeightSliceSpec {
  int axis = 0;
  int64_t start = 0;
  int64_t length = 0;
};

// Tensors whose name matches `pattern` (fnmatch(3) glob) get `convert`, or are copied
// when it is unset; with `slice`, only that slice of the stored tensor is kept (and
// converted).
struct WeightRuleSpec {
  std::string pattern;
  std::optional<ConversionSpec> convert;
  std::optional<WeightSliceSpec> slice;
  // `convert` reads the tensor as an MXFP4 checkpoint stores it (CheckpointValues /
  // CheckpointScales of wprep/spec/checkpoint.h), not as the conversion's dense input.
  bool checkpoint = false;
};

// One tensor of a set.
struct WeightEntry {
  std::string name;
  std::string dtype;  // the safetensors name; "U8" for converted tensors
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements
  uint64_t bytes = 0;
  uint64_t offset = 0;  // in the set's memory; a multiple of kWeightAlignment
  std::optional<ConversionSpec> spec;  // the conversion applied, if any
  int rule = -1;  // the rule that matched, -1 for none
  std::optional<WeightSliceSpec> slice;  // the slice kept (axis non-negative), if any
};

inline constexpr uint64_t kWeightAlignment = 256;

struct WeightManifestData {
  std::string name;
  std::string path;
  std::optional<Uuid> gpu;  // the GPU holding the set; none for host memory
  bool vmm = false;          // a GPU set in CUDA virtual memory
  std::vector<WeightEntry> tensors;
  uint64_t total_bytes = 0;
  std::string source_checksum;  // 32 raw bytes (weight_store.cc says of what)
};

struct WeightLoadProgress {
  uint64_t tensors_done = 0, tensors_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;
};

// Where a set lives: GPU `gpu` (by UUID) or `gpu_index` (the daemon's ListDevices
// order), or host memory when neither is set.
struct WeightPlacement {
  std::optional<Uuid> gpu;
  std::optional<int> gpu_index;
  bool vmm = false;  // GPU sets: CUDA virtual memory instead of cudaMalloc
};

struct WeightSetSummary {
  std::shared_ptr<const WeightManifestData> manifest;
  uint32_t attachments = 0;
};

struct WeightAttachment {
  uint64_t id = 0;
  std::shared_ptr<const WeightManifestData> manifest;
  std::string shm_path;    // host sets
  std::string ipc_handle;  // GPU sets: kIpcHandleBytes of the set's allocation
  // VMM GPU sets: the token TakeVmmHandle takes (kHandleTokenBytes).
  std::string vmm_token;
};

// What the store reports as it works (all may be null); the daemon points them at its
// Prometheus metrics.
struct WeightStoreObserver {
  absl::AnyInvocable<void(const std::string& set, uint64_t bytes)> set_resident;  // 0 = gone
  absl::AnyInvocable<void(int64_t delta)> attachments;
  absl::AnyInvocable<void(double seconds)> loaded;
  absl::AnyInvocable<void()> load_failed;
};

class DeviceManager;

class WeightStore {
 public:
  // `root`: the directory sources must lie in (empty: loading from files is refused).
  // `budget_bytes`: the most the sets may hold on each GPU, and in host memory; 0 =
  // unlimited. `cpu_threads`: the CPU engine's threads per conversion (0 = one per core).
  // `shm_dir`: where host sets' files go. `devices`: the GPUs sets may live on (null or
  // without GPUs: host memory only); must outlive the store.
  WeightStore(std::string root, uint64_t budget_bytes, int cpu_threads, std::string shm_dir = "/dev/shm",
              WeightStoreObserver observer = {}, DeviceManager* devices = nullptr);
  ~WeightStore();
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // Loads `path` (relative to the root) into set `name`, applying `rules` (first match
  // wins), where `place` says. `progress` is called after planning and after each tensor;
  // returning false cancels the load (CANCELLED; nothing stays). FAILED_PRECONDITION for a
  // GPU where the daemon serves none, INVALID_ARGUMENT for a GPU it does not serve (or
  // both ways of naming one), RESOURCE_EXHAUSTED past the budget or the GPU's memory.
  absl::StatusOr<std::shared_ptr<const WeightManifestData>> Load(
      const std::string& name, const std::string& path, const std::vector<WeightRuleSpec>& rules,
      absl::FunctionRef<bool(const WeightLoadProgress&)> progress, const WeightPlacement& place = {});

  std::vector<WeightSetSummary> List() const;
  uint64_t budget_bytes() const { return budget_bytes_; }
  // Bytes all sets hold, on every GPU and in host memory.
  uint64_t resident_bytes() const;

  // Opens an attachment to set `name` (NOT_FOUND if none) for the process `peer_pid` (the
  // Unix-socket client's; nullopt over TCP or TLS); the caller must then Hold it. A VMM
  // set needs `peer_pid` (FAILED_PRECONDITION without: its descriptor only travels over
  // the Unix handle socket).
  absl::StatusOr<WeightAttachment> Attach(const std::string& name, std::optional<pid_t> peer_pid = std::nullopt);
  // The descriptor of the VMM set behind attachment token `token`, for `peer_pid`: a fresh
  // export (the caller closes it). A token serves once, only while its attachment lasts,
  // and only the process that attached (or a thread of it): PERMISSION_DENIED otherwise,
  // without saying which, so that tokens cannot be probed.
  absl::StatusOr<VmmExport> TakeVmmHandle(const std::string& token, pid_t peer_pid);
  // Waits until the attachment ends and removes it: OK after Detach or when `cancelled`
  // (polled) turns true, ABORTED after a forced Drop of its set, UNAVAILABLE after Close.
  absl::Status Hold(uint64_t id, absl::FunctionRef<bool()> cancelled);
  // Ends attachment `id` (NOT_FOUND if unknown).
  absl::Status Detach(uint64_t id);
  // Frees set `name`: NOT_FOUND if none, FAILED_PRECONDITION while attached unless
  // `force` (its attachments then end ABORTED). Returns the bytes freed.
  absl::StatusOr<uint64_t> Drop(const std::string& name, bool force);
  // Removes the files a killed daemon of this pid left in shm_dir (a container's daemon
  // restarts with the pid it had); call before the first load. Files are named
  // wprep-weights-PID-N-SET.
  void RemoveStaleFiles();
  // Ends every attachment and frees every set (the daemon is stopping); loads and
  // attaches fail afterwards.
  void Close();

 private:
  struct Set;
  struct Held {
    std::string set;
    absl::Status end;  // set when the attachment has been ended
    bool ended = false;
    // VMM sets: the token (empty once taken) and the process that may take it.
    std::string vmm_token;
    pid_t pid = 0;
  };

  // `where`: a GPU's ordinal, or kHost.
  static constexpr int kHost = -1;
  absl::Status ReserveLocked(const std::string& name, int where, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string root_;
  const uint64_t budget_bytes_;
  const int cpu_threads_;
  const std::string shm_dir_;
  WeightStoreObserver observer_;
  DeviceManager* const devices_;

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Sets, and names reserved by loads in progress (null): bytes counted in reserved_,
  // per GPU ordinal (kHost: host memory).
  std::map<std::string, std::shared_ptr<Set>> sets_ ABSL_GUARDED_BY(mu_);
  std::map<int, uint64_t> reserved_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Held> held_ ABSL_GUARDED_BY(mu_);
};

// True when `name` is a valid set name: 1 to 64 of [A-Za-z0-9._-].
bool ValidWeightSetName(const std::string& name);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_WEIGHT_STORE_H_
