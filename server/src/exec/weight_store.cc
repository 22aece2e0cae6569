#include "exec/weight_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "openssl/evp.h"
#include "device/device_manager.h"
#include "net/handle_socket.h"
#include "net/peer_credentials.h"
#include "safetensors.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/checkpoint.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {
namespace {

// How long Hold sleeps between looks at its caller's cancellation (gRPC's synchronous
// API has no wake-up for it).
constexpr absl::Duration kHoldPoll = absl::Milliseconds(50);

std::string ErrnoText(int err) { return std::strerror(err); }

std::string Sha256(const void* data, size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, size, digest, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), len);
}

// `rel` (relative to `root`) resolved, refusing every way out of the root: an absolute
// path, a `..` component, and symlinks whose target lies outside (the realpath check).
absl::StatusOr<std::string> ResolveInRoot(const std::string& root, const std::string& rel) {
  if (root.empty()) {
    return absl::PermissionDeniedError("loading weights from files is off: the daemon has no --weights-root");
  }
  if (rel.empty()) return absl::InvalidArgumentError("path is empty");
  if (rel[0] == '/') return absl::PermissionDeniedError(absl::StrCat("path '", rel, "' is absolute; give it relative to --weights-root"));
  for (absl::string_view part : absl::StrSplit(rel, '/')) {
    if (part == "..") return absl::PermissionDeniedError(absl::StrCat("path '", rel, "' climbs out of --weights-root ('..')"));
  }
  char real_root[PATH_MAX];
  if (realpath(root.c_str(), real_root) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("--weights-root ", root, ": ", ErrnoText(errno)));
  }
  const std::string joined = absl::StrCat(root, "/", rel);
  char real[PATH_MAX];
  if (realpath(joined.c_str(), real) == nullptr) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(absl::StrCat("'", rel, "': no such file under --weights-root"));
    return absl::InvalidArgumentError(absl::StrCat("'", rel, "': ", ErrnoText(err)));
  }
  const std::string prefix = absl::StrCat(real_root, std::string(real_root) == "/" ? "" : "/");
  const std::string resolved = real;
  if (resolved != real_root && resolved.rfind(prefix, 0) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("'", rel, "' resolves outside --weights-root (a symlink out)"));
  }
  return resolved;
}

// A read-only descriptor, closed on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status ReadAt(int fd, uint64_t offset, uint8_t* out, uint64_t size, const std::string& file) {
  while (size > 0) {
    const ssize_t n = pread(fd, out, std::min<uint64_t>(size, 1ull << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(file, ": read failed at byte ", offset, ": ",
                                              n == 0 ? "unexpected end of file" : ErrnoText(errno)));
    }
    out += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// One safetensors file of a checkpoint, its header parsed and hashed.
struct Shard {
  std::string display;  // the path as the client knows it (relative to the root)
  std::string real;
  cli::SafetensorsHeader header;
  std::string header_sha256;
};

absl::StatusOr<Shard> ReadShard(const std::string& root, const std::string& rel) {
  Shard shard;
  shard.display = rel;
  WPREP_ASSIGN_OR_RETURN(shard.real, ResolveInRoot(root, rel));
  Fd fd(open(shard.real.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::InvalidArgumentError(absl::StrCat(rel, ": ", ErrnoText(errno)));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(rel, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t len_bytes[8] = {};
  uint64_t want = std::min<uint64_t>(size, 8);
  WPREP_RETURN_IF_ERROR(ReadAt(fd.get(), 0, len_bytes, want, rel));
  if (size >= 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
    want = std::min<uint64_t>(size, 8 + std::min<uint64_t>(n, cli::kMaxSafetensorsHeaderBytes));
  }
  std::vector<uint8_t> head(want);
  WPREP_RETURN_IF_ERROR(ReadAt(fd.get(), 0, head.data(), want, rel));
  absl::StatusOr<cli::SafetensorsHeader> header = cli::ParseSafetensorsHeader(head, size);
  if (!header.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(rel, ": ", header.status().message()));
  }
  shard.header = *std::move(header);
  shard.header_sha256 = Sha256(head.data(), 8 + shard.header.header_bytes);
  return shard;
}

std::string DirName(const std::string& rel) {
  const size_t slash = rel.rfind('/');
  return slash == std::string::npos ? "" : rel.substr(0, slash + 1);
}

// The files of checkpoint `rel`: itself, or a directory's index's shards (sorted), or
// its model.safetensors.
absl::StatusOr<std::vector<Shard>> ReadCheckpoint(const std::string& root, const std::string& rel) {
  WPREP_ASSIGN_OR_RETURN(const std::string real, ResolveInRoot(root, rel));
  struct stat st {};
  if (stat(real.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat(rel, ": ", ErrnoText(errno)));
  std::vector<Shard> shards;
  if (!S_ISDIR(st.st_mode)) {
    WPREP_ASSIGN_OR_RETURN(Shard one, ReadShard(root, rel));
    shards.push_back(std::move(one));
    return shards;
  }
  const std::string dir = rel.back() == '/' ? rel : rel + "/";
  const std::string index_rel = dir + "model.safetensors.index.json";
  absl::StatusOr<std::string> index_real = ResolveInRoot(root, index_rel);
  if (absl::IsNotFound(index_real.status())) {
    WPREP_ASSIGN_OR_RETURN(Shard one, ReadShard(root, dir + "model.safetensors"));
    shards.push_back(std::move(one));
    return shards;
  }
  WPREP_RETURN_IF_ERROR(index_real.status());
  Fd fd(open(index_real->c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0 || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(index_rel, ": not a readable file"));
  }
  if (static_cast<uint64_t>(st.st_size) > cli::kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(index_rel, ": ", st.st_size, " bytes is absurd for an index"));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  WPREP_RETURN_IF_ERROR(ReadAt(fd.get(), 0, reinterpret_cast<uint8_t*>(text.data()), text.size(), index_rel));
  const nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_rel, ": not JSON with a \"weight_map\" object"));
  }
  std::map<std::string, std::string> shard_of;  // tensor -> file
  std::set<std::string> files;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index_rel, ": weight_map[\"", tensor, "\"] is not a file name"));
    }
    shard_of[tensor] = file.get<std::string>();
    files.insert(file.get<std::string>());
  }
  if (files.empty()) return absl::InvalidArgumentError(absl::StrCat(index_rel, ": weight_map names no file"));
  std::map<std::string, size_t> shard_index;
  for (const std::string& file : files) {
    WPREP_ASSIGN_OR_RETURN(Shard shard, ReadShard(root, DirName(index_rel) + file));
    shard_index[file] = shards.size();
    shards.push_back(std::move(shard));
  }
  for (const auto& entry : shard_of) {
    const std::string& tensor = entry.first;
    const std::string& file = entry.second;
    const cli::SafetensorsHeader& h = shards[shard_index[file]].header;
    const bool held = std::any_of(h.tensors.begin(), h.tensors.end(),
                                  [&](const cli::SafetensorsTensor& t) { return t.name == tensor; });
    if (!held) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_rel, ": tensor '", tensor, "' is mapped to ", file, ", which does not hold it"));
    }
  }
  return shards;
}

// The logical shape of a swizzle whose dense canonical input is `storage`.
absl::StatusOr<std::vector<int64_t>> LogicalShape(const ConversionSpec& spec, const std::vector<int64_t>& storage) {
  std::vector<int64_t> logical = storage;
  if (!IsValueLayout(spec.layout)) return logical;
  if (storage.size() < 2) return absl::InvalidArgumentError("a value layout needs a tensor of rank >= 2");
  const size_t r = storage.size();
  if (spec.packing_axis == -2) {  // [..., D1, D0/2] -> [..., D0, D1]
    logical[r - 2] = storage[r - 1] * 2;
    logical[r - 1] = storage[r - 2];
  } else {  // [..., D0, D1/2] -> [..., D0, D1]
    logical[r - 1] = storage[r - 1] * 2;
  }
  return logical;
}

// What `rule`'s conversion reads a stored tensor of shape `stored` as: its dense canonical
// input, or with `checkpoint`, an MXFP4 checkpoint's blocks or scales.
absl::StatusOr<TensorConversion> ConversionOf(const WeightRuleSpec& rule, const std::vector<int64_t>& stored) {
  if (rule.checkpoint) {
    return IsValueLayout(rule.convert->layout) ? CheckpointValues(*rule.convert, stored)
                                               : CheckpointScales(*rule.convert, stored);
  }
  absl::StatusOr<std::vector<int64_t>> logical = LogicalShape(*rule.convert, stored);
  if (!logical.ok()) return logical.status();
  return TensorConversion{*rule.convert, *std::move(logical), {}};
}

uint64_t AlignUp(uint64_t n) { return (n + kWeightAlignment - 1) / kWeightAlignment * kWeightAlignment; }

// Where a tensor's bytes come from: `runs` runs of `run_bytes` each, the first at
// `file_offset` and each next `run_stride` bytes further (one run for a whole tensor; a
// slice along an axis is one run per index of the axes before it), read back to back.
struct Source {
  size_t shard = 0;
  uint64_t file_offset = 0;
  uint64_t bytes = 0;
  std::optional<Plan> plan;
  uint64_t runs = 1;
  uint64_t run_bytes = 0;
  uint64_t run_stride = 0;
};

// The slice `slice` of stored tensor `t` (shape, dtype) as runs of `src`, and the sliced
// shape; INVALID_ARGUMENT (after `where`) when the slice does not fit the tensor.
absl::StatusOr<std::vector<int64_t>> SliceTensor(const cli::SafetensorsTensor& t, const WeightSliceSpec& slice,
                                                 const std::string& where, WeightSliceSpec* normalized, Source* src) {
  const int rank = static_cast<int>(t.shape.size());
  const int axis = slice.axis < 0 ? slice.axis + rank : slice.axis;
  if (axis < 0 || axis >= rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": slice axis ", slice.axis, " is outside a tensor of rank ", rank));
  }
  const int64_t dim = t.shape[static_cast<size_t>(axis)];
  if (slice.start < 0 || slice.length < 1 || slice.start > dim || slice.length > dim - slice.start) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": slice [", slice.start, ", ", slice.start, " + ",
                                                   slice.length, ") passes axis ", axis, " of size ", dim));
  }
  // The stored bytes are dense: the axes before `axis` make the runs, the axis and those
  // after it one run's bytes.
  uint64_t outer = 1;
  for (int i = 0; i < axis; ++i) outer *= static_cast<uint64_t>(t.shape[static_cast<size_t>(i)]);
  // The bytes of one index of the axis (everything after it).
  const uint64_t inner = outer == 0 ? 0 : t.bytes() / outer / static_cast<uint64_t>(dim);
  src->runs = outer;
  src->run_bytes = inner * static_cast<uint64_t>(slice.length);
  src->run_stride = inner * static_cast<uint64_t>(dim);
  src->file_offset += inner * static_cast<uint64_t>(slice.start);
  src->bytes = src->runs * src->run_bytes;
  *normalized = WeightSliceSpec{axis, slice.start, slice.length};
  std::vector<int64_t> shape = t.shape;
  shape[static_cast<size_t>(axis)] = slice.length;
  return shape;
}

// Every tensor of `shards` matched against `rules` and planned; `entries` and `sources`
// in order. INVALID_ARGUMENT naming the file and tensor.
absl::Status PlanTensors(const std::vector<Shard>& shards, const std::vector<WeightRuleSpec>& rules,
                         std::vector<WeightEntry>* entries, std::vector<Source>* sources, uint64_t* total) {
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    for (const cli::SafetensorsTensor& t : shards[s].header.tensors) {
      const std::string where = absl::StrCat(shards[s].display, ": tensor '", t.name, "'");
      if (!seen.insert(t.name).second) return absl::InvalidArgumentError(absl::StrCat(where, " appears in two shards"));
      WeightEntry e;
      e.name = t.name;
      Source src{s, shards[s].header.data_offset() + t.begin, t.bytes(), std::nullopt};
      src.run_bytes = src.run_stride = t.bytes();
      for (size_t r = 0; r < rules.size(); ++r) {
        if (fnmatch(rules[r].pattern.c_str(), t.name.c_str(), 0) == 0) {
          e.rule = static_cast<int>(r);
          break;
        }
      }
      const WeightRuleSpec* rule = e.rule >= 0 ? &rules[static_cast<size_t>(e.rule)] : nullptr;
      std::vector<int64_t> stored = t.shape;
      if (rule != nullptr && rule->slice.has_value()) {
        WeightSliceSpec kept;
        absl::StatusOr<std::vector<int64_t>> sliced =
            SliceTensor(t, *rule->slice, absl::StrCat(where, ", rule ", e.rule), &kept, &src);
        if (!sliced.ok()) return sliced.status();
        stored = *std::move(sliced);
        e.slice = kept;
      }
      if (rule != nullptr && rule->convert.has_value()) {
        if (t.dtype != cli::Dtype::kU8 && t.dtype != cli::Dtype::kF8E8M0) {
          return absl::InvalidArgumentError(absl::StrCat(where, " is ", cli::DtypeName(t.dtype), "; rule ", e.rule,
                                                         " converts packed bytes (U8 or F8_E8M0)"));
        }
        absl::StatusOr<TensorConversion> conv = ConversionOf(*rule, stored);
        absl::StatusOr<Plan> plan =
            conv.ok() ? MakePlan(conv->spec, conv->logical_shape, InputBinding{conv->input_strides, std::nullopt})
                      : absl::StatusOr<Plan>(conv.status());
        if (!plan.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ", rule ", e.rule, ": ", plan.status().message()));
        }
        if (plan->input_bytes != src.bytes) {
          return absl::InvalidArgumentError(absl::StrCat(where, ", rule ", e.rule, ": the conversion reads ",
                                                         plan->input_bytes, " bytes, the tensor has ", src.bytes));
        }
        e.dtype = "U8";
        e.shape = plan->output_shape;
        e.strides = plan->output_strides;
        e.bytes = plan->output_bytes;
        e.spec = conv->spec;
        src.plan = *std::move(plan);
      } else {
        e.dtype = std::string(cli::DtypeName(t.dtype));
        e.shape = stored;
        e.strides = DenseStrides(stored);
        e.bytes = src.bytes;
      }
      e.offset = offset;
      offset = AlignUp(offset + e.bytes);
      entries->push_back(std::move(e));
      sources->push_back(std::move(src));
    }
  }
  *total = offset;
  return absl::OkStatus();
}

// Bytes [pos, pos + n) of the tensor `src` reads (its runs back to back) into `to`.
absl::Status ReadRange(int fd, const Source& src, uint64_t pos, uint64_t n, uint8_t* to, const std::string& file) {
  while (n > 0) {
    const uint64_t run = pos / src.run_bytes, off = pos - run * src.run_bytes;
    const uint64_t take = std::min(n, src.run_bytes - off);
    WPREP_RETURN_IF_ERROR(ReadAt(fd, src.file_offset + run * src.run_stride + off, to, take, file));
    pos += take;
    to += take;
    n -= take;
  }
  return absl::OkStatus();
}

// A GPU set's checkpoint goes through two pinned buffers of kStagingBytes: while one is
// copied to the GPU, kReaders threads read the next piece into the other (one thread
// reading from the page cache moves a fraction of what a host-to-device copy does).
constexpr uint64_t kStagingBytes = 64ull << 20;
constexpr int kReaders = 4;

// ReadRange split across up to kReaders threads (pieces of at least 4 MiB).
absl::Status ReadRangeParallel(int fd, const Source& src, uint64_t pos, uint64_t n, uint8_t* to,
                               const std::string& file) {
  const uint64_t part = std::max<uint64_t>((n + kReaders - 1) / kReaders, 4ull << 20);
  std::vector<absl::Status> status(kReaders);
  std::vector<std::thread> helpers;
  int k = 1;
  uint64_t unstarted = n;  // parts from here on have no thread: this one reads them
  for (uint64_t at = part; at < n; at += part, ++k) {
    try {
      helpers.emplace_back(
          [&, at, k] { status[k] = ReadRange(fd, src, pos + at, std::min(part, n - at), to + at, file); });
    } catch (const std::system_error&) {
      unstarted = at;  // no thread to be had (a process or cgroup limit)
      break;
    }
  }
  status[0] = ReadRange(fd, src, pos, std::min(part, n), to, file);
  absl::Status rest;
  if (unstarted < n) rest = ReadRange(fd, src, pos + unstarted, n - unstarted, to + unstarted, file);
  for (std::thread& t : helpers) t.join();
  WPREP_RETURN_IF_ERROR(rest);
  for (const absl::Status& s : status) WPREP_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Fills a GPU set's memory at `base` (on `gpu` of `rt`) with the tensors of `sources`:
// copies straight into place, converted tensors through one device scratch buffer (the
// largest such input) and the GPU's conversion. Everything runs on a stream of its own;
// returns once the GPU has finished (or, failing, once nothing queued can still run).
absl::Status FillOnGpu(DeviceRuntime& rt, int gpu, PinnedHostPool& pinned, uint8_t* base,
                       const WeightManifestData& manifest, const std::vector<Source>& sources,
                       const std::vector<int>& fds, const std::vector<std::string>& files, WeightLoadProgress& p,
                       absl::FunctionRef<bool(const WeightLoadProgress&)> progress) {
  uint64_t scratch_bytes = 0;
  for (const Source& src : sources) {
    if (src.plan.has_value()) scratch_bytes = std::max(scratch_bytes, src.bytes);
  }
  struct Stage {
    PinnedHostPool::Buffer buffer;
    Event copied = nullptr;
    bool busy = false;
  };
  Stage stages[2];
  WPREP_ASSIGN_OR_RETURN(Stream stream, rt.CreateStream(gpu));
  void* scratch = nullptr;
  // Runs before `stages` go: the buffers and the scratch are in use until the stream is idle.
  absl::Cleanup done = [&] {
    (void)rt.Synchronize(gpu, stream);
    if (scratch != nullptr) (void)rt.FreeAsync(gpu, scratch, stream);
    (void)rt.Synchronize(gpu, stream);
    for (Stage& st : stages) {
      if (st.copied != nullptr) rt.DestroyEvent(gpu, st.copied);
    }
    rt.DestroyStream(gpu, stream);
  };
  for (Stage& st : stages) {
    WPREP_ASSIGN_OR_RETURN(st.buffer, pinned.Get(kStagingBytes));
    WPREP_ASSIGN_OR_RETURN(st.copied, rt.CreateEvent(gpu));
  }
  if (scratch_bytes > 0) {
    WPREP_ASSIGN_OR_RETURN(scratch, rt.AllocateAsync(gpu, scratch_bytes, stream));
  }
  int next = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const Source& src = sources[i];
    const WeightEntry& e = manifest.tensors[i];
    uint8_t* dst = src.plan.has_value() ? static_cast<uint8_t*>(scratch) : base + e.offset;
    for (uint64_t pos = 0; pos < src.bytes;) {
      const uint64_t n = std::min(kStagingBytes, src.bytes - pos);
      Stage& st = stages[next];
      next ^= 1;
      if (st.busy) WPREP_RETURN_IF_ERROR(rt.SynchronizeEvent(gpu, st.copied));
      WPREP_RETURN_IF_ERROR(ReadRangeParallel(fds[src.shard], src, pos, n, st.buffer.data(), files[src.shard]));
      WPREP_RETURN_IF_ERROR(rt.CopyToDeviceAsync(gpu, dst + pos, st.buffer.data(), n, stream));
      WPREP_RETURN_IF_ERROR(rt.RecordEvent(gpu, st.copied, stream));
      st.busy = true;
      pos += n;
    }
    if (src.plan.has_value()) {
      absl::Status converted = rt.Convert(gpu, *src.plan, scratch, base + e.offset, stream);
      if (!converted.ok()) {
        return absl::Status(converted.code(),
                            absl::StrCat(files[src.shard], ": tensor '", e.name, "': ", converted.message()));
      }
    }
    ++p.tensors_done;
    p.bytes_done = AlignUp(e.offset + e.bytes);
    if (!progress(p)) return absl::CancelledError("the load was cancelled");
  }
  return rt.Synchronize(gpu, stream);
}

std::atomic<uint64_t> g_file_counter{0};

}  // namespace

bool ValidWeightSetName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

// A set's memory: a device allocation of its GPU's, or a shared-memory file mapped into
// the daemon.
struct WeightStore::Set {
  std::shared_ptr<const WeightManifestData> manifest;
  int where = kHost;  // the GPU's ordinal, or kHost
  uint64_t size = 0;
  // Host sets.
  std::string shm_path;
  uint8_t* base = nullptr;
  // GPU sets.
  DeviceRuntime* runtime = nullptr;
  void* device = nullptr;
  std::string ipc_handle;  // cudaMalloc sets
  bool vmm = false;        // cuMemCreate sets, exported per attachment (TakeVmmHandle)

  ~Set() {
    if (base != nullptr) munmap(base, size);
    if (!shm_path.empty()) unlink(shm_path.c_str());
    if (device != nullptr) runtime->FreeShared(where, device);
  }
};

WeightStore::WeightStore(std::string root, uint64_t budget_bytes, int cpu_threads, std::string shm_dir,
                         WeightStoreObserver observer, DeviceManager* devices)
    : root_(std::move(root)),
      budget_bytes_(budget_bytes),
      cpu_threads_(cpu_threads),
      shm_dir_(std::move(shm_dir)),
      observer_(std::move(observer)),
      devices_(devices) {}

WeightStore::~WeightStore() = default;

absl::Status WeightStore::ReserveLocked(const std::string& name, int where, uint64_t bytes) {
  if (closed_) return absl::UnavailableError("the daemon is stopping");
  if (sets_.count(name) != 0) return absl::AlreadyExistsError(absl::StrCat("weight set '", name, "' exists"));
  uint64_t& reserved = reserved_[where];
  if (budget_bytes_ != 0 && (bytes > budget_bytes_ || reserved > budget_bytes_ - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("weight set '", name, "' needs ", bytes, " bytes; ", reserved,
                                                     " of --weights-budget ", budget_bytes_, " are held ",
                                                     where == kHost ? "in host memory" : "on that GPU"));
  }
  sets_[name] = nullptr;
  reserved += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const WeightManifestData>> WeightStore::Load(
    const std::string& name, const std::string& path, const std::vector<WeightRuleSpec>& rules,
    absl::FunctionRef<bool(const WeightLoadProgress&)> progress, const WeightPlacement& place) {
  const absl::Time start = absl::Now();
  bool counted = false;
  auto fail = [&](absl::Status status) {
    if (!counted && observer_.load_failed) observer_.load_failed();
    counted = true;
    return status;
  };
  if (!ValidWeightSetName(name)) {
    return fail(absl::InvalidArgumentError(absl::StrCat("name '", name.substr(0, 80),
                                                        "': a set name is 1 to 64 of [A-Za-z0-9._-]")));
  }
  Gpu* on = nullptr;
  if (place.gpu.has_value() || place.gpu_index.has_value()) {
    const char* field = place.gpu.has_value() ? "device_uuid" : "device_index";
    if (place.gpu.has_value() && place.gpu_index.has_value()) {
      return fail(absl::InvalidArgumentError("give device_uuid or device_index, not both"));
    }
    if (devices_ == nullptr || devices_->cpu_engine()) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          field, ": this daemon serves no GPU (it runs the CPU engine); leave it unset for a set in host memory")));
    }
    if (place.gpu.has_value()) {
      absl::StatusOr<Gpu*> found = devices_->FindByUuid(*place.gpu);
      if (!found.ok()) return fail(absl::Status(found.status().code(), absl::StrCat(field, ": ", found.status().message())));
      on = *found;
    } else {
      const int index = *place.gpu_index;
      if (index < 0 || static_cast<size_t>(index) >= devices_->num_gpus()) {
        return fail(absl::InvalidArgumentError(absl::StrCat(field, ": ", index, " is not a GPU of this daemon's (it serves ",
                                                            devices_->num_gpus(), ")")));
      }
      on = &devices_->gpu(static_cast<size_t>(index));
    }
  }
  if (place.vmm && on == nullptr) {
    return fail(absl::InvalidArgumentError(
        "vmm: CUDA virtual memory is for a set on a GPU; give device_uuid or device_index, or leave vmm unset "
        "for a set in host memory"));
  }
  const int where = on != nullptr ? on->ordinal() : kHost;
  absl::StatusOr<std::vector<Shard>> shards = ReadCheckpoint(root_, path);
  if (!shards.ok()) return fail(shards.status());
  auto manifest = std::make_shared<WeightManifestData>();
  manifest->name = name;
  manifest->path = path;
  if (on != nullptr) manifest->gpu = on->info().uuid;
  manifest->vmm = place.vmm;
  std::vector<Source> sources;
  absl::Status planned = PlanTensors(*shards, rules, &manifest->tensors, &sources, &manifest->total_bytes);
  if (!planned.ok()) return fail(planned);
  std::string hashes;
  for (const Shard& s : *shards) hashes += s.header_sha256;
  manifest->source_checksum = Sha256(hashes.data(), hashes.size());

  {
    absl::MutexLock lock(&mu_);
    absl::Status reserved = ReserveLocked(name, where, manifest->total_bytes);
    if (!reserved.ok()) return fail(reserved);
  }
  bool done = false;
  absl::Cleanup release = [&] {
    if (done) return;
    absl::MutexLock lock(&mu_);
    sets_.erase(name);
    reserved_[where] -= manifest->total_bytes;
  };

  auto set = std::make_shared<Set>();
  set->size = manifest->total_bytes;
  set->where = where;
  if (on != nullptr) {
    set->runtime = &on->runtime();
    // One allocation even for an empty set, so that it has a handle to attach.
    set->vmm = place.vmm;
    const uint64_t bytes = std::max(set->size, kWeightAlignment);
    absl::StatusOr<void*> device =
        place.vmm ? set->runtime->AllocateSharedVmm(where, bytes) : set->runtime->AllocateShared(where, bytes);
    if (!device.ok()) {
      return fail(absl::Status(device.status().code(),
                               absl::StrCat("weight set '", name, "': ", device.status().message())));
    }
    set->device = *device;
  } else {
    set->shm_path = absl::StrCat(shm_dir_, "/wprep-weights-", getpid(), "-", g_file_counter.fetch_add(1), "-", name);
    const int shm_fd = open(set->shm_path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (shm_fd < 0) {
      const int err = errno;
      set->shm_path.clear();
      return fail(
          absl::ResourceExhaustedError(absl::StrCat("weight set '", name, "': ", shm_dir_, ": ", ErrnoText(err))));
    }
    Fd shm(shm_fd);
    if (set->size > 0) {
      if (ftruncate(shm.get(), static_cast<off_t>(set->size)) != 0) {
        return fail(absl::ResourceExhaustedError(absl::StrCat("weight set '", name, "': ", ErrnoText(errno))));
      }
      void* base = mmap(nullptr, set->size, PROT_READ | PROT_WRITE, MAP_SHARED, shm.get(), 0);
      if (base == MAP_FAILED) {
        return fail(
            absl::ResourceExhaustedError(absl::StrCat("weight set '", name, "': mmap: ", ErrnoText(errno))));
      }
      set->base = static_cast<uint8_t*>(base);
    }
  }

  WeightLoadProgress p;
  p.tensors_total = manifest->tensors.size();
  p.bytes_total = manifest->total_bytes;
  if (!progress(p)) return fail(absl::CancelledError("the load was cancelled"));
  std::vector<std::unique_ptr<Fd>> files;
  std::vector<int> fds;
  std::vector<std::string> displays;
  for (const Shard& s : *shards) {
    files.push_back(std::make_unique<Fd>(open(s.real.c_str(), O_RDONLY | O_CLOEXEC)));
    if (files.back()->get() < 0) return fail(absl::DataLossError(absl::StrCat(s.display, ": ", ErrnoText(errno))));
    fds.push_back(files.back()->get());
    displays.push_back(s.display);
  }
  if (on != nullptr) {
    absl::Status filled = FillOnGpu(*set->runtime, where, devices_->pinned(), static_cast<uint8_t*>(set->device),
                                    *manifest, sources, fds, displays, p, progress);
    if (!filled.ok()) return fail(filled);
    if (!set->vmm) {
      absl::StatusOr<std::string> handle = set->runtime->ExportIpc(where, set->device);
      if (!handle.ok()) return fail(handle.status());
      set->ipc_handle = *std::move(handle);
    }
  } else {
    std::vector<uint8_t> staging;  // a converted tensor's input; one tensor at a time
    CpuOptions cpu;
    cpu.threads = cpu_threads_;
    for (size_t i = 0; i < sources.size(); ++i) {
      const Source& src = sources[i];
      const WeightEntry& e = manifest->tensors[i];
      const std::string& file = displays[src.shard];
      uint8_t* out = set->base + e.offset;
      if (!src.plan.has_value()) {
        absl::Status read = ReadRange(fds[src.shard], src, 0, src.bytes, out, file);
        if (!read.ok()) return fail(read);
      } else {
        staging.resize(src.bytes);
        absl::Status read = ReadRange(fds[src.shard], src, 0, src.bytes, staging.data(), file);
        if (!read.ok()) return fail(read);
        absl::Status converted = ConvertOnCpu(*src.plan, staging.data(), staging.size(), out, e.bytes, cpu);
        if (!converted.ok()) {
          return fail(
              absl::Status(converted.code(), absl::StrCat(file, ": tensor '", e.name, "': ", converted.message())));
        }
      }
      ++p.tensors_done;
      p.bytes_done = AlignUp(e.offset + e.bytes);
      if (!progress(p)) return fail(absl::CancelledError("the load was cancelled"));
    }
    if (set->base != nullptr) mprotect(set->base, set->size, PROT_READ);  // read-only from here on
  }
  set->manifest = manifest;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return fail(absl::UnavailableError("the daemon is stopping"));
    sets_[name] = set;
    done = true;
  }
  if (observer_.set_resident) observer_.set_resident(name, manifest->total_bytes);
  if (observer_.loaded) observer_.loaded(absl::ToDoubleSeconds(absl::Now() - start));
  return std::shared_ptr<const WeightManifestData>(manifest);
}

std::vector<WeightSetSummary> WeightStore::List() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, uint32_t> attached;
  // An ended attachment (detached, or its set force-dropped) is not counted, as Drop does not
  // count it: its Hold call is only yet to return.
  for (const auto& [id, h] : held_) {
    if (!h.ended) ++attached[h.set];
  }
  std::vector<WeightSetSummary> out;
  for (const auto& [name, set] : sets_) {
    if (set == nullptr) continue;  // still loading
    out.push_back({set->manifest, attached[name]});
  }
  return out;
}

uint64_t WeightStore::resident_bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [name, set] : sets_) {
    if (set != nullptr) total += set->size;
  }
  return total;
}

absl::StatusOr<WeightAttachment> WeightStore::Attach(const std::string& name, std::optional<pid_t> peer_pid) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::UnavailableError("the daemon is stopping");
  auto it = sets_.find(name);
  if (it == sets_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("no weight set '", name.substr(0, 80), "'"));
  }
  const Set& set = *it->second;
  WeightAttachment a;
  if (set.vmm) {
    if (!peer_pid.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "weight set '", name, "' is in CUDA virtual memory, whose descriptor is passed over a Unix socket: "
          "attach over the daemon's Unix socket (unix:///path), not TCP or TLS"));
    }
    a.vmm_token = NewHandleToken();
  }
  a.id = next_id_++;
  a.manifest = set.manifest;
  a.shm_path = set.shm_path;
  a.ipc_handle = set.ipc_handle;
  held_[a.id] = Held{name, absl::OkStatus(), false, a.vmm_token, peer_pid.value_or(0)};
  if (observer_.attachments) observer_.attachments(1);
  return a;
}

absl::StatusOr<VmmExport> WeightStore::TakeVmmHandle(const std::string& token, pid_t peer_pid) {
  std::shared_ptr<Set> set;
  {
    absl::MutexLock lock(&mu_);
    Held* found = nullptr;
    if (token.size() == kHandleTokenBytes) {
      for (auto& [id, h] : held_) {
        if (!h.ended && !h.vmm_token.empty() && h.vmm_token == token) found = &h;
      }
    }
    if (found == nullptr || !InThreadGroup(peer_pid, found->pid)) {
      return absl::PermissionDeniedError(
          "no open attachment of this process has that token (a token serves once, only the process that "
          "attached, and only until it detaches)");
    }
    found->vmm_token.clear();  // once
    auto it = sets_.find(found->set);
    if (it == sets_.end() || it->second == nullptr) return absl::NotFoundError("the set is gone");
    set = it->second;  // kept while exporting, even if dropped meanwhile
  }
  return set->runtime->ExportVmm(set->where, set->device);
}

absl::Status WeightStore::Hold(uint64_t id, absl::FunctionRef<bool()> cancelled) {
  const bool* ended = nullptr;  // only Hold erases an attachment, so this stays valid
  {
    absl::MutexLock lock(&mu_);
    auto it = held_.find(id);
    if (it == held_.end()) return absl::NotFoundError(absl::StrCat("no attachment ", id));
    ended = &it->second.ended;
  }
  // The caller's cancellation wakes nobody, so it is polled between waits.
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(ended), kHoldPoll)) break;
    }
    if (cancelled()) break;
  }
  absl::MutexLock lock(&mu_);
  auto it = held_.find(id);
  absl::Status end = it->second.ended ? it->second.end : absl::OkStatus();
  held_.erase(it);
  if (observer_.attachments) observer_.attachments(-1);
  return end;
}

absl::Status WeightStore::Detach(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(id);
  if (it == held_.end() || it->second.ended) return absl::NotFoundError(absl::StrCat("no attachment ", id));
  it->second.ended = true;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> WeightStore::Drop(const std::string& name, bool force) {
  std::shared_ptr<Set> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = sets_.find(name);
    if (it == sets_.end()) return absl::NotFoundError(absl::StrCat("no weight set '", name.substr(0, 80), "'"));
    if (it->second == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("weight set '", name, "' is still loading"));
    }
    uint32_t attached = 0;
    for (const auto& [id, h] : held_) attached += (h.set == name && !h.ended) ? 1 : 0;
    if (attached > 0 && !force) {
      return absl::FailedPreconditionError(
          absl::StrCat("weight set '", name, "' has ", attached, " attachment(s); detach them or drop with force"));
    }
    for (auto& [id, h] : held_) {
      if (h.set == name && !h.ended) {
        h.ended = true;
        h.end = absl::AbortedError(absl::StrCat("weight set '", name, "' was dropped"));
      }
    }
    gone = std::move(it->second);
    sets_.erase(it);
    reserved_[gone->where] -= gone->size;
  }
  if (observer_.set_resident) observer_.set_resident(name, 0);
  return gone->size;  // the memory goes with `gone` (host sets: clients' mappings stay valid)
}

void WeightStore::RemoveStaleFiles() {
  DIR* dir = opendir(shm_dir_.c_str());
  if (dir == nullptr) return;
  const std::string mine = absl::StrCat("wprep-weights-", getpid(), "-");
  while (const dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind(mine, 0) == 0) unlinkat(dirfd(dir), name.c_str(), 0);
  }
  closedir(dir);
}

void WeightStore::Close() {
  std::vector<std::shared_ptr<Set>> gone;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    for (auto& [id, h] : held_) {
      if (!h.ended) {
        h.ended = true;
        h.end = absl::UnavailableError("the daemon is stopping");
      }
    }
    // The files go now, not at exit: a daemon that stops leaves nothing in shm_dir_.
    for (auto it = sets_.begin(); it != sets_.end();) {
      if (it->second == nullptr) {
        ++it;  // a load in progress; it finds closed_ and frees its own
        continue;
      }
      gone.push_back(std::move(it->second));
      reserved_[gone.back()->where] -= gone.back()->size;
      it = sets_.erase(it);
    }
  }
  for (const auto& set : gone) {
    if (observer_.set_resident) observer_.set_resident(set->manifest->name, 0);
  }
}

}  // namespace wprep::server
