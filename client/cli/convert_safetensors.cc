#include "convert_safetensors.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "checkpoint.h"
#include "convert_args.h"
#include "flags.h"
#include "inspect.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"
#include "wprep/client/batch.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/proto/spec_codec.h"

namespace wprep::cli {

namespace {

namespace fs = std::filesystem;
namespace v1 = wprep::v1;
using client::TensorConversion;

absl::Status Bad(absl::string_view msg) { return absl::InvalidArgumentError(msg); }

// `s` with "what: " in front of its message, same code.
absl::Status Prefixed(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::Status Errno(int err, absl::string_view what) {
  return absl::Status(absl::ErrnoToStatusCode(err), absl::StrCat(what, ": ", std::strerror(err)));
}

// ---- Input files, mapped read-only: tensors are read where they lie.

class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    std::unique_ptr<MappedFile> f(new MappedFile());
    f->path_ = path;
    f->fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd_ < 0) return Errno(errno, absl::StrCat("cannot open '", path, "'"));
    struct stat st;
    if (fstat(f->fd_, &st) != 0) return Errno(errno, absl::StrCat("cannot stat '", path, "'"));
    if (!S_ISREG(st.st_mode)) return Bad(absl::StrCat("'", path, "' is not a regular file"));
    f->size_ = static_cast<uint64_t>(st.st_size);
    if (f->size_ > 0) {
      void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
      if (p == MAP_FAILED) return Errno(errno, absl::StrCat("cannot map '", path, "'"));
      f->data_ = static_cast<const uint8_t*>(p);
    }
    return f;
  }
  ~MappedFile() {
    if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) close(fd_);
  }
  absl::Span<const uint8_t> bytes() const { return {data_, size_}; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

struct InputFile {
  std::string name;  // file name, the same for the output (shards) or the path given
  std::unique_ptr<MappedFile> map;
  SafetensorsHeader header;

  absl::Span<const uint8_t> Data(const SafetensorsTensor& t) const {
    return map->bytes().subspan(header.data_offset() + t.begin, t.bytes());
  }
};

absl::StatusOr<InputFile> LoadInput(const std::string& path, std::string name) {
  InputFile in;
  in.name = std::move(name);
  absl::StatusOr<std::unique_ptr<MappedFile>> map = MappedFile::Open(path);
  if (!map.ok()) return map.status();
  in.map = *std::move(map);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(in.map->bytes(), in.map->bytes().size());
  if (!h.ok()) return Prefixed(h.status(), absl::StrCat("'", path, "' is not a valid safetensors file"));
  in.header = *std::move(h);
  for (const auto& [key, value] : in.header.metadata) {
    if (key == "wprep.contract_version") {
      return absl::FailedPreconditionError(absl::StrCat(
          "'", path, "' was converted by wprep already (its __metadata__ has wprep.contract_version)"));
    }
  }
  return in;
}

// What IN names: one file, or the shards of an index.
struct Inputs {
  bool sharded = false;
  std::string index_name;        // the index's file name
  nlohmann::ordered_json index;  // its document
  std::vector<InputFile> files;
};

absl::StatusOr<Inputs> LoadInputs(const std::string& in) {
  Inputs out;
  std::error_code ec;
  fs::path index_path;
  if (fs::is_directory(in, ec)) {
    for (const auto& e : fs::directory_iterator(in, ec)) {
      if (absl::EndsWith(e.path().filename().string(), ".safetensors.index.json")) {
        if (!index_path.empty()) {
          return Bad(absl::StrCat("'", in, "' holds two indexes (", index_path.filename().string(), ", ",
                                  e.path().filename().string(), "); name one"));
        }
        index_path = e.path();
      }
    }
    if (index_path.empty()) return Bad(absl::StrCat("'", in, "' is a folder without a *.safetensors.index.json"));
  } else if (absl::EndsWith(in, ".json")) {
    index_path = in;
  }
  if (index_path.empty()) {
    absl::StatusOr<InputFile> f = LoadInput(in, in);
    if (!f.ok()) return f.status();
    out.files.push_back(*std::move(f));
    return out;
  }

  out.sharded = true;
  out.index_name = index_path.filename().string();
  std::ifstream f(index_path);
  if (!f) return Errno(errno, absl::StrCat("cannot open '", index_path.string(), "'"));
  std::stringstream text;
  text << f.rdbuf();
  out.index = nlohmann::ordered_json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  const std::string where = absl::StrCat("index '", index_path.string(), "'");
  if (out.index.is_discarded() || !out.index.is_object()) return Bad(absl::StrCat(where, " is not a JSON object"));
  auto wm = out.index.find("weight_map");
  if (wm == out.index.end() || !wm->is_object() || wm->empty()) {
    return Bad(absl::StrCat(where, " has no weight_map of tensor names to files"));
  }
  auto meta = out.index.find("metadata");
  if (meta != out.index.end() && !meta->is_object()) return Bad(absl::StrCat(where, ": metadata is not an object"));
  std::map<std::string, int> shard_of;  // file name -> index in out.files
  std::vector<std::string> shards;
  for (const auto& [tensor, file] : wm->items()) {
    if (!file.is_string()) return Bad(absl::StrCat(where, ": weight_map['", tensor, "'] is not a file name"));
    const std::string name = file.get<std::string>();
    // Shards are named by file, in the index's folder; the outputs take the same names.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return Bad(absl::StrCat(where, " names the shard '", name, "'; shards must be file names in its folder"));
    }
    if (!shard_of.count(name)) {
      shard_of[name] = static_cast<int>(shards.size());
      shards.push_back(name);
    }
  }
  for (const std::string& name : shards) {
    absl::StatusOr<InputFile> shard = LoadInput((index_path.parent_path() / name).string(), name);
    if (!shard.ok()) return shard.status();
    out.files.push_back(*std::move(shard));
  }
  // The index and the shards must agree, tensor for tensor.
  size_t in_shards = 0;
  for (const InputFile& file : out.files) {
    for (const SafetensorsTensor& t : file.header.tensors) {
      auto it = wm->find(t.name);
      if (it == wm->end() || it->get<std::string>() != file.name) {
        return Bad(absl::StrCat(where, " does not list tensor '", t.name, "' of shard '", file.name, "'"));
      }
      ++in_shards;
    }
  }
  if (in_shards != wm->size()) {
    for (const auto& [tensor, file] : wm->items()) {
      const InputFile& shard = out.files[static_cast<size_t>(shard_of[file.get<std::string>()])];
      const std::string& want = tensor;  // a structured binding: not capturable before C++20's clang 16
      const bool found = std::any_of(shard.header.tensors.begin(), shard.header.tensors.end(),
                                     [&](const SafetensorsTensor& t) { return t.name == want; });
      if (!found) {
        return Bad(absl::StrCat(where, " maps '", tensor, "' to '", shard.name, "', which has no such tensor"));
      }
    }
  }
  return out;
}

// ---- What gets converted.

enum class Role { kValues, kScales };

struct Conversion {
  Role role = Role::kValues;
  int file = 0;
  const SafetensorsTensor* tensor = nullptr;
  TensorConversion whole;   // the whole tensor's conversion
  int64_t experts = 0;      // matrices: the product of the leading dims
  uint64_t in_per = 0;      // input bytes of one matrix
  uint64_t out_per = 0;     // output bytes of one matrix
  v1::PlanResponse plan;    // the daemon's answer for the whole tensor
  uint64_t out_begin = 0;   // offset of the output in its file's data section
};

std::string ShapeString(absl::Span<const int64_t> v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

// The conversion of experts [first, first + count) of `c` as its own request: the
// leading dims flattened into one (each matrix converts on its own, so the bytes are
// those of the same matrices in the whole tensor).
TensorConversion PieceOf(const Conversion& c, int64_t count) {
  TensorConversion p = c.whole;
  const size_t r = p.logical_shape.size();
  p.logical_shape = {count, p.logical_shape[r - 2], p.logical_shape[r - 1]};
  if (!p.input_strides.empty()) {
    // [..., N, G] storage read as [..., G, N]: [N*G, 1, G].
    const int64_t g = p.logical_shape[1], n = p.logical_shape[2];
    p.input_strides = {n * g, 1, g};
  }
  return p;
}

// The conversion back, for --verify: the layout's storage to what the checkpoint holds
// (values: checkpoint order; scales: the dense [count, G, N] tensor, compared with the
// transposed input).
TensorConversion BackOf(const TensorConversion& p) {
  TensorConversion b = p;
  b.spec.direction = Direction::kUnswizzle;
  b.input_strides.clear();
  return b;
}

bool ScalesRoundTrip(absl::Span<const uint8_t> checkpoint, absl::Span<const uint8_t> back, int64_t count,
                     int64_t g, int64_t n, uint64_t* at) {
  if (back.size() != checkpoint.size()) return false;
  for (int64_t e = 0; e < count; ++e) {
    for (int64_t gi = 0; gi < g; ++gi) {
      for (int64_t ni = 0; ni < n; ++ni) {
        const uint64_t b = static_cast<uint64_t>((e * g + gi) * n + ni);
        if (back[b] != checkpoint[static_cast<uint64_t>((e * n + ni) * g + gi)]) {
          *at = b;
          return false;
        }
      }
    }
  }
  return true;
}

// ---- The outputs.

struct OutTensor {
  const SafetensorsTensor* in = nullptr;
  int conversion = -1;    // index in the conversions, or -1
  int quantization = -1;  // index in the quantizations, or -1 (neither: copied)
  bool scales = false;    // a quantization's NAME_scales (else its NAME_blocks)
  SafetensorsTensor out;
};

struct OutFile {
  std::string final_path, tmp_path;
  std::vector<OutTensor> tensors;
  std::string header;  // length, JSON and padding
  uint64_t size = 0;
  int fd = -1;
  uint8_t* map = nullptr;  // the whole file, MAP_SHARED: outputs land in the page cache once
};

// Temporary outputs removed on SIGINT/SIGTERM too, so an interrupted run leaves nothing.
// Set before the handler is installed and not changed while it is.
std::vector<std::string>* g_cleanup_files = nullptr;
const char* g_cleanup_dir = nullptr;

extern "C" void RemoveTemporariesAndDie(int sig) {
  if (g_cleanup_files != nullptr) {
    for (const std::string& p : *g_cleanup_files) unlink(p.c_str());
  }
  if (g_cleanup_dir != nullptr) rmdir(g_cleanup_dir);
  signal(sig, SIG_DFL);
  raise(sig);
}

// Owns the temporary outputs: removes them unless Commit() renamed them into place.
class Temporaries {
 public:
  Temporaries(std::vector<std::string> files, std::string dir) : files_(std::move(files)), dir_(std::move(dir)) {
    g_cleanup_files = &files_;
    g_cleanup_dir = dir_.empty() ? nullptr : dir_.c_str();
    old_int_ = signal(SIGINT, RemoveTemporariesAndDie);
    old_term_ = signal(SIGTERM, RemoveTemporariesAndDie);
  }
  ~Temporaries() {
    signal(SIGINT, old_int_);
    signal(SIGTERM, old_term_);
    g_cleanup_files = nullptr;
    g_cleanup_dir = nullptr;
    if (committed_) return;
    for (const std::string& p : files_) unlink(p.c_str());
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  void Commit() { committed_ = true; }

 private:
  std::vector<std::string> files_;
  std::string dir_;
  bool committed_ = false;
  sighandler_t old_int_ = SIG_DFL, old_term_ = SIG_DFL;
};

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

// Maps the pages of [p, p + n) now, in one call, instead of one fault per page while a
// stream runs (Linux 5.14+; elsewhere the faults come as they come).
void Populate(const uint8_t* p, uint64_t n, int advice) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{4095};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  if (n > 0) madvise(reinterpret_cast<void*>(begin), end - begin, advice);
}

absl::Status WriteAll(int fd, const uint8_t* p, uint64_t n, uint64_t at, const std::string& path) {
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, std::min<uint64_t>(n, 1u << 30), static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Errno(w < 0 ? errno : EIO, absl::StrCat("cannot write '", path, "'"));
    p += w;
    n -= static_cast<uint64_t>(w);
    at += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

// Copies in the kernel where it can (copy_file_range), else from the mapping.
absl::Status CopyRange(const InputFile& in, const SafetensorsTensor& t, const OutFile& out, uint64_t out_at) {
  loff_t src = static_cast<loff_t>(in.header.data_offset() + t.begin);
  loff_t dst = static_cast<loff_t>(out_at);
  uint64_t left = t.bytes();
  while (left > 0) {
    const ssize_t n = copy_file_range(in.map->fd(), &src, out.fd, &dst, std::min<uint64_t>(left, 1u << 30), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // not supported here, or a short file: write the rest from the mapping
    left -= static_cast<uint64_t>(n);
  }
  if (left == 0) return absl::OkStatus();
  const uint64_t done = t.bytes() - left;
  std::memcpy(out.map + out_at + done, in.Data(t).data() + done, left);
  return absl::OkStatus();
}

// A unit of work: one ConvertStream, one ConvertBatch, one copy or one quantization.
struct Piece {
  int conversion = 0;
  int64_t first = 0, count = 0;
};
struct Job {
  enum class Kind { kStream, kBatch, kCopy, kQuantize } kind = Kind::kCopy;
  std::vector<Piece> pieces;
  int file = 0, tensor = 0;  // kCopy: the OutTensor; kQuantize: its NAME_blocks
};

// A --quantize'd tensor NAME [..., Q]: it becomes NAME_blocks U8 [..., Q/32, 16] and
// NAME_scales U8 [..., Q/32], exactly the pair a gpt-oss checkpoint holds and this command
// converts with --layout (the blocks' bytes are the canonical values [..., Q/2]).
// The pair a quantization writes straight into --layout's `values` / `scales`, where it can:
// blackwell_value or blackwell_shuffled_value with blackwell_scale, or hopper_value with
// hopper_scale, both at mx axis -2.
std::optional<QuantLayoutSpec> FusedQuantLayout(const ConversionSpec& values, const ConversionSpec& scales) {
  if (values.layout == Layout::kBlackwellValue && scales.layout == Layout::kBlackwellScale) {
    return QuantLayoutSpec{QuantLayout::kBlackwell};
  }
  if (values.layout == Layout::kBlackwellShuffledValue && scales.layout == Layout::kBlackwellScale) {
    QuantLayoutSpec spec{QuantLayout::kBlackwellShuffled};
    spec.block_k = values.blackwell.block_k;
    spec.block_n = values.blackwell.block_n;
    return spec;
  }
  if (values.layout == Layout::kHopperValue && scales.layout == Layout::kHopperScale && values.hopper.mx_axis == -2 &&
      scales.hopper_scale.mx_axis == -2) {
    return QuantLayoutSpec{QuantLayout::kHopper, values.hopper.mma_version, scales.hopper_scale.num_warps,
                           scales.hopper_scale.align_k};
  }
  return std::nullopt;
}

// With --layout too (fused), the pair is written already converted, exactly as --layout
// would convert it: `values` and `scales` are the pair's conversions and plans.
struct FusedPart {
  TensorConversion conversion;
  Plan plan;
};
struct Quantization {
  int file = 0;
  const SafetensorsTensor* tensor = nullptr;
  QuantizePlan plan;
  std::vector<int64_t> blocks_shape, scales_shape;
  uint64_t blocks_begin = 0, scales_begin = 0;  // offsets in the file's data section
  bool fused = false;
  QuantLayoutSpec layout;  // fused: the pair the quantizer writes
  FusedPart values, scales;
  uint64_t BlocksBytes() const { return fused ? values.plan.output_bytes : static_cast<uint64_t>(plan.values_bytes); }
  uint64_t ScalesBytes() const { return fused ? scales.plan.output_bytes : static_cast<uint64_t>(plan.scales_bytes); }
};

std::string BlocksName(const std::string& name) { return name + "_blocks"; }
std::string ScalesName(const std::string& name) { return name + "_scales"; }

absl::StatusOr<QuantDtype> QuantDtypeOf(Dtype d) {
  switch (d) {
    case Dtype::kBF16:
      return QuantDtype::kBfloat16;
    case Dtype::kF16:
      return QuantDtype::kFloat16;
    case Dtype::kF32:
      return QuantDtype::kFloat32;
    default:
      return Bad(absl::StrCat("is ", DtypeName(d), "; only BF16, F16 and F32 tensors quantize"));
  }
}

std::string ParamsJson(const ConversionSpec& s) {
  nlohmann::ordered_json j;
  j["layout"] = std::string(LayoutName(s.layout));
  switch (s.layout) {
    case Layout::kHopperValue:
      j["mx_axis"] = s.hopper.mx_axis;
      j["mma_version"] = s.hopper.mma_version;
      break;
    case Layout::kBlackwellShuffledValue:
      j["block_k"] = s.blackwell.block_k;
      j["block_n"] = s.blackwell.block_n;
      break;
    case Layout::kHopperScale:
      j["mx_axis"] = s.hopper_scale.mx_axis;
      j["num_warps"] = s.hopper_scale.num_warps;
      if (s.hopper_scale.align_k != ConversionSpec().hopper_scale.align_k) j["align_k"] = s.hopper_scale.align_k;
      break;
    case Layout::kBlackwellValue:
    case Layout::kBlackwellScale:
      break;
  }
  if (IsValueLayout(s.layout)) j["packing_axis"] = s.packing_axis;
  return j.dump();
}

// Everything one run holds: inputs, conversions, outputs, the jobs and their progress.
class Converter {
 public:
  explicit Converter(const ConvertSafetensorsArgs& args) : args_(args) {
    retry_.max_attempts = 3;
    retry_.initial_backoff = std::chrono::milliseconds(200);
  }

  absl::StatusOr<ConvertSafetensorsSummary> Run() {
    const absl::Time start = absl::Now();
    if (absl::Status s = CheckOutput(); !s.ok()) return s;
    absl::StatusOr<Inputs> inputs = LoadInputs(args_.input);
    if (!inputs.ok()) return inputs.status();
    inputs_ = *std::move(inputs);
    if (absl::Status s = FindQuantizations(); !s.ok()) return s;
    if (args_.convert) {
      if (absl::Status s = FindConversions(); !s.ok()) return s;
      if (absl::Status s = PlanConversions(); !s.ok()) return s;
    }
    LayOutOutputs();
    MakeJobs();

    std::vector<std::string> tmp_files;
    for (const OutFile& f : outs_) tmp_files.push_back(f.tmp_path);
    if (inputs_.sharded) tmp_files.push_back(tmp_dir_ + "/" + inputs_.index_name);
    Temporaries temporaries(tmp_files, tmp_dir_);
    if (inputs_.sharded && mkdir(tmp_dir_.c_str(), 0755) != 0) {
      return Errno(errno, absl::StrCat("cannot create '", tmp_dir_, "'"));
    }
    for (OutFile& f : outs_) {
      if (absl::Status s = Create(f); !s.ok()) return s;
    }
    absl::Status s = RunJobs();
    for (OutFile& f : outs_) {
      if (f.map != nullptr && munmap(f.map, f.size) != 0 && s.ok()) {
        s = Errno(errno, absl::StrCat("cannot write '", f.tmp_path, "'"));
      }
      f.map = nullptr;
      if (s.ok() && args_.fsync && fsync(f.fd) != 0) s = Errno(errno, absl::StrCat("cannot fsync '", f.tmp_path, "'"));
      if (close(f.fd) != 0 && s.ok()) s = Errno(errno, absl::StrCat("cannot write '", f.tmp_path, "'"));
      f.fd = -1;
    }
    if (!s.ok()) return s;
    if (inputs_.sharded) {
      if (s = WriteIndex(); !s.ok()) return s;
    }
    // Into place: the file, or the folder of shards and index in one rename.
    const std::string& from = inputs_.sharded ? tmp_dir_ : outs_.front().tmp_path;
    if (rename(from.c_str(), args_.output.c_str()) != 0) {
      return Errno(errno, absl::StrCat("cannot rename '", from, "' to '", args_.output, "'"));
    }
    temporaries.Commit();

    ConvertSafetensorsSummary sum;
    sum.files = static_cast<int>(outs_.size());
    sum.converted = static_cast<int>(convs_.size());
    sum.quantized = static_cast<int>(quants_.size());
    for (const InputFile& f : inputs_.files) sum.input_bytes += f.map->bytes().size();
    for (const OutFile& f : outs_) {
      sum.output_bytes += f.size;
      for (const OutTensor& t : f.tensors) sum.copied += t.conversion < 0 && t.quantization < 0 ? 1 : 0;
    }
    sum.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    return sum;
  }

 private:
  // OUT must be a path we may replace: not IN, not a folder with files in it.
  absl::Status CheckOutput() {
    std::error_code ec;
    if (args_.output.empty()) return Bad("OUT must not be empty");
    if (fs::exists(args_.output, ec) && fs::equivalent(args_.input, args_.output, ec)) {
      return Bad(absl::StrCat("OUT '", args_.output, "' is IN: write the converted checkpoint elsewhere"));
    }
    const bool sharded_in = fs::is_directory(args_.input, ec) || absl::EndsWith(args_.input, ".json");
    if (sharded_in) {
      if (fs::exists(args_.output, ec) && !(fs::is_directory(args_.output, ec) && fs::is_empty(args_.output, ec))) {
        return Bad(absl::StrCat("OUT '", args_.output, "' exists; for a sharded checkpoint it must be a new or empty folder"));
      }
      tmp_dir_ = absl::StrCat(args_.output, ".wprep-tmp-", getpid());
    } else if (fs::is_directory(args_.output, ec)) {
      return Bad(absl::StrCat("OUT '", args_.output, "' is a folder; name the output file"));
    }
    return absl::OkStatus();
  }

  // The tensors --quantize names, each checked and planned: a pattern that names nothing,
  // a tensor that is not BF16/F16/F32, a last dim that is 0 or not a multiple of 32, or a
  // NAME_blocks/NAME_scales already in the checkpoint is InvalidArgument, before anything
  // is written.
  absl::Status FindQuantizations() {
    if (args_.quantize.empty()) return absl::OkStatus();
    std::map<std::string, bool> names;
    for (const InputFile& f : inputs_.files) {
      for (const SafetensorsTensor& t : f.header.tensors) names[t.name] = true;
    }
    std::vector<bool> used(args_.quantize.size(), false);
    for (size_t f = 0; f < inputs_.files.size(); ++f) {
      for (const SafetensorsTensor& t : inputs_.files[f].header.tensors) {
        bool chosen = false;
        for (size_t p = 0; p < args_.quantize.size(); ++p) {
          if (fnmatch(args_.quantize[p].c_str(), t.name.c_str(), 0) == 0) chosen = used[p] = true;
        }
        if (!chosen) continue;
        absl::StatusOr<Quantization> q = PlanQuantization(t, names);
        if (!q.ok()) {
          return absl::Status(q.status().code(), absl::StrCat("--quantize: '", t.name, "' ", q.status().message()));
        }
        q->file = static_cast<int>(f);
        quants_.push_back(*std::move(q));
      }
    }
    for (size_t p = 0; p < args_.quantize.size(); ++p) {
      if (!used[p]) return Bad(absl::StrCat("--quantize: '", args_.quantize[p], "' names no tensor of '", args_.input, "'"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Quantization> PlanQuantization(const SafetensorsTensor& t, const std::map<std::string, bool>& names) {
    absl::StatusOr<QuantDtype> dtype = QuantDtypeOf(t.dtype);
    if (!dtype.ok()) return dtype.status();
    if (t.shape.empty()) return Bad("is a scalar; quantizing needs a last dim of groups of 32");
    const int64_t q = t.shape.back();
    if (q <= 0 || q % 32 != 0) {
      return Bad(absl::StrCat("has shape ", ShapeString(t.shape), "; its last dim must be a positive multiple of 32 ",
                              "(NAME_blocks holds [..., Q/32, 16])"));
    }
    for (const std::string& n : {BlocksName(t.name), ScalesName(t.name)}) {
      if (names.count(n)) return Bad(absl::StrCat("would become '", n, "', which the checkpoint holds already"));
    }
    absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(*dtype, t.shape, args_.scale_rounding);
    if (!plan.ok()) return Bad(absl::StrCat("cannot be quantized: ", plan.status().message()));
    Quantization out;
    out.tensor = &t;
    out.plan = *std::move(plan);
    out.scales_shape = t.shape;
    out.scales_shape.back() = q / 32;
    out.blocks_shape = out.scales_shape;
    out.blocks_shape.push_back(16);
    if (args_.convert) {
      if (absl::Status s = PlanFused(out); !s.ok()) return s;
    }
    return out;
  }

  // The conversions --layout makes of the pair, and the fused kernel's sizes, which must
  // be theirs: the fused bytes are the converted pair's.
  absl::Status PlanFused(Quantization& q) const {
    if (q.blocks_shape.size() < 3) {
      return Bad(absl::StrCat("has shape ", ShapeString(q.tensor->shape),
                              "; quantizing into a layout needs a weight [..., N, K] (rank 2 or more)"));
    }
    absl::StatusOr<TensorConversion> v = client::CheckpointValues(args_.values, q.blocks_shape);
    if (!v.ok()) return v.status();
    absl::StatusOr<TensorConversion> sc = client::CheckpointScales(args_.scales, q.scales_shape);
    if (!sc.ok()) return sc.status();
    for (auto [conv, part] : {std::pair{&*v, &q.values}, std::pair{&*sc, &q.scales}}) {
      absl::StatusOr<Plan> plan = MakePlan(conv->spec, conv->logical_shape, InputBinding{conv->input_strides, {}});
      if (!plan.ok()) return plan.status();
      part->conversion = *conv;
      part->plan = *std::move(plan);
    }
    // The argument parser refused every other pair.
    const std::optional<QuantLayoutSpec> fused = FusedQuantLayout(args_.values, args_.scales);
    if (!fused.has_value()) return absl::InternalError("--quantize with --layout: no fused quantizer for the pair");
    q.layout = *fused;
    absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(q.plan, q.layout);
    if (!sizes.ok()) return sizes.status();
    if (static_cast<uint64_t>(sizes->values_bytes) != q.values.plan.output_bytes ||
        static_cast<uint64_t>(sizes->scales_bytes) != q.scales.plan.output_bytes) {
      return absl::InternalError(absl::StrCat("the fused quantizer writes ", sizes->values_bytes, " + ",
                                              sizes->scales_bytes, " bytes; the layouts take ",
                                              q.values.plan.output_bytes, " + ", q.scales.plan.output_bytes));
    }
    q.fused = true;
    return absl::OkStatus();
  }

  absl::Status FindConversions() {
    std::vector<const SafetensorsTensor*> all;
    std::vector<int> file_of;
    for (size_t f = 0; f < inputs_.files.size(); ++f) {
      for (const SafetensorsTensor& t : inputs_.files[f].header.tensors) {
        all.push_back(&t);
        file_of.push_back(static_cast<int>(f));
      }
    }
    absl::StatusOr<std::vector<Mxfp4Tensor>> found = FindMxfp4Tensors(all, args_.values, args_.scales);
    if (!found.ok()) return found.status();
    for (Mxfp4Tensor& m : *found) {
      Conversion c;
      c.role = m.values ? Role::kValues : Role::kScales;
      c.file = file_of[m.index];
      c.tensor = all[m.index];
      c.whole = std::move(m.conversion);
      c.experts = m.experts;
      convs_.push_back(std::move(c));
    }
    if (convs_.empty() && quants_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("'", args_.input, "' holds no MXFP4 tensors (NAME_blocks and NAME_scales pairs) to convert"));
    }
    return absl::OkStatus();
  }

  // The plan of every tensor (the daemon's, or with --device this process's): its output
  // shape, strides, size and layout.
  absl::Status PlanConversions() {
    if (convs_.empty()) return absl::OkStatus();  // only quantized tensors: no daemon needed
    client::Client c(args_.target, 1);
    client::CallOptions o;
    o.retry = retry_;
    if (!args_.local) {
      absl::StatusOr<v1::ListDevicesResponse> devices = c.ListDevices(o);
      if (!devices.ok()) return Prefixed(devices.status(), absl::StrCat("no wprepd answers at ", args_.target));
    }
    for (Conversion& conv : convs_) {
      absl::StatusOr<v1::PlanResponse> plan;
      if (args_.local) {
        plan = LocalPlan(conv.whole, conv.tensor->bytes());
      } else {
        v1::PlanRequest req;
        *req.mutable_spec() = SpecToProto(conv.whole.spec);
        for (int64_t d : conv.whole.logical_shape) req.add_logical_shape(d);
        for (int64_t s : conv.whole.input_strides) req.add_input_strides(s);
        req.set_input_buffer_bytes(conv.tensor->bytes());
        plan = c.Plan(req, o);
      }
      if (!plan.ok()) return Prefixed(plan.status(), conv.tensor->name);
      conv.plan = *std::move(plan);
      const uint64_t e = static_cast<uint64_t>(conv.experts);
      if (e > 0 && (conv.tensor->bytes() % e != 0 || conv.plan.output_bytes() % e != 0)) {
        return absl::InternalError(absl::StrCat(conv.tensor->name, ": ", conv.plan.output_bytes(),
                                                " output bytes do not split into ", e, " matrices"));
      }
      conv.in_per = e > 0 ? conv.tensor->bytes() / e : 0;
      conv.out_per = e > 0 ? conv.plan.output_bytes() / e : 0;
    }
    return absl::OkStatus();
  }

  // Each output file: its tensors in the input's order, converted ones at their new
  // sizes, and the header that describes them.
  void LayOutOutputs() {
    std::map<const SafetensorsTensor*, int> conv_of, quant_of;
    for (size_t i = 0; i < convs_.size(); ++i) conv_of[convs_[i].tensor] = static_cast<int>(i);
    for (size_t i = 0; i < quants_.size(); ++i) quant_of[quants_[i].tensor] = static_cast<int>(i);
    const Conversion* first_values = nullptr;
    const Conversion* first_scales = nullptr;
    for (const Conversion& c : convs_) {
      if (c.role == Role::kValues && first_values == nullptr) first_values = &c;
      if (c.role == Role::kScales && first_scales == nullptr) first_scales = &c;
    }
    std::vector<std::pair<std::string, std::string>> global;
    if (first_values != nullptr && first_scales != nullptr) {
      global.emplace_back("wprep.contract_version", absl::StrCat(first_values->plan.identity().contract_version()));
      for (const Conversion* c : {first_values, first_scales}) {
        const std::string role = c->role == Role::kValues ? "values" : "scales";
        global.emplace_back(absl::StrCat("wprep.", role, ".layout"), c->plan.identity().layout());
        global.emplace_back(absl::StrCat("wprep.", role, ".conversion"), c->plan.identity().conversion());
        global.emplace_back(absl::StrCat("wprep.", role, ".params"), ParamsJson(c->whole.spec));
      }
    } else if (!quants_.empty() && quants_.front().fused) {
      // Only fused tensors: the same entries, named by this build's layout identities.
      const Quantization& q = quants_.front();
      global.emplace_back("wprep.contract_version", absl::StrCat(kLayoutContractVersion));
      for (const FusedPart* part : {&q.values, &q.scales}) {
        const std::string role = part == &q.values ? "values" : "scales";
        global.emplace_back(absl::StrCat("wprep.", role, ".layout"), LayoutIdentity(part->conversion.spec));
        global.emplace_back(absl::StrCat("wprep.", role, ".conversion"), ConversionIdentity(part->conversion.spec));
        global.emplace_back(absl::StrCat("wprep.", role, ".params"), ParamsJson(part->conversion.spec));
      }
    }
    if (!quants_.empty()) {
      // Not wprep.contract_version: a quantized checkpoint is still one to convert.
      global.emplace_back("wprep.quantize.patterns", absl::StrJoin(args_.quantize, ";"));
      global.emplace_back("wprep.quantize.scale_rounding",
                          args_.scale_rounding == ScaleRounding::kUp ? "up" : "down");
    }
    global_metadata_ = global;

    for (const InputFile& in : inputs_.files) {
      OutFile out;
      out.final_path = inputs_.sharded ? (fs::path(args_.output) / in.name).string() : args_.output;
      out.tmp_path = inputs_.sharded ? absl::StrCat(tmp_dir_, "/", in.name)
                                     : absl::StrCat(args_.output, ".wprep-tmp-", getpid());
      std::vector<std::pair<std::string, std::string>> metadata = in.header.metadata;
      metadata.insert(metadata.end(), global.begin(), global.end());
      uint64_t at = 0;
      for (const SafetensorsTensor& t : in.header.tensors) {
        OutTensor o;
        o.in = &t;
        o.out = t;
        if (auto q = quant_of.find(&t); q != quant_of.end()) {
          Quantization& z = quants_[static_cast<size_t>(q->second)];
          o.quantization = q->second;
          o.out.dtype = Dtype::kU8;
          // NAME_blocks, then NAME_scales, each at the next free offset.
          auto place = [&](bool scales, std::string name, std::vector<int64_t> shape, uint64_t bytes,
                           uint64_t* begin) {
            o.scales = scales;
            o.out.name = std::move(name);
            o.out.shape = std::move(shape);
            o.out.begin = *begin = at;
            o.out.end = at = at + bytes;
            out.tensors.push_back(o);
          };
          place(false, BlocksName(t.name), z.fused ? z.values.plan.output_shape : z.blocks_shape, z.BlocksBytes(),
                &z.blocks_begin);
          place(true, ScalesName(t.name), z.fused ? z.scales.plan.output_shape : z.scales_shape, z.ScalesBytes(),
                &z.scales_begin);
          metadata.emplace_back(absl::StrCat("wprep.quantized.", t.name), QuantizedJson(z));
          if (z.fused) {
            // As --layout records the pair it converts.
            metadata.emplace_back(absl::StrCat("wprep.tensor.", BlocksName(t.name)),
                                  TensorJson(Role::kValues, z.values, z.blocks_shape));
            metadata.emplace_back(absl::StrCat("wprep.tensor.", ScalesName(t.name)),
                                  TensorJson(Role::kScales, z.scales, z.scales_shape));
          }
          continue;
        }
        auto it = conv_of.find(&t);
        if (it != conv_of.end()) {
          o.conversion = it->second;
          Conversion& c = convs_[static_cast<size_t>(it->second)];
          o.out.dtype = Dtype::kU8;
          o.out.shape.assign(c.plan.output_shape().begin(), c.plan.output_shape().end());
          o.out.begin = at;
          o.out.end = at + c.plan.output_bytes();
          c.out_begin = at;
          metadata.emplace_back(absl::StrCat("wprep.tensor.", t.name), TensorJson(c));
        } else {
          o.out.begin = at;
          o.out.end = at + t.bytes();
        }
        at = o.out.end;
        out.tensors.push_back(std::move(o));
      }
      std::vector<SafetensorsTensor> described;
      for (const OutTensor& o : out.tensors) described.push_back(o.out);
      out.header = SerializeSafetensorsHeader(metadata, described);
      out.size = out.header.size() + at;
      outs_.push_back(std::move(out));
    }
  }

  std::string QuantizedJson(const Quantization& q) const {
    nlohmann::ordered_json j;
    j["format"] = "mxfp4";
    j["blocks"] = BlocksName(q.tensor->name);
    j["scales"] = ScalesName(q.tensor->name);
    j["scale_rounding"] = args_.scale_rounding == ScaleRounding::kUp ? "up" : "down";
    j["checkpoint_shape"] = q.tensor->shape;
    j["checkpoint_dtype"] = std::string(DtypeName(q.tensor->dtype));
    j["blocks_shape"] = q.blocks_shape;
    j["scales_shape"] = q.scales_shape;
    return j.dump();
  }

  static std::string TensorJson(Role role, const FusedPart& p, const std::vector<int64_t>& checkpoint_shape) {
    nlohmann::ordered_json j;
    j["role"] = role == Role::kValues ? "values" : "scales";
    j["layout"] = LayoutIdentity(p.conversion.spec);
    j["conversion"] = ConversionIdentity(p.conversion.spec);
    j["logical_shape"] = p.conversion.logical_shape;
    j["checkpoint_shape"] = checkpoint_shape;
    j["checkpoint_dtype"] = std::string(DtypeName(Dtype::kU8));
    if (!p.conversion.input_strides.empty()) j["input_strides"] = p.conversion.input_strides;
    j["storage_shape"] = p.plan.output_shape;
    j["storage_strides"] = p.plan.output_strides;
    return j.dump();
  }

  static std::string TensorJson(const Conversion& c) {
    nlohmann::ordered_json j;
    j["role"] = c.role == Role::kValues ? "values" : "scales";
    j["layout"] = c.plan.identity().layout();
    j["conversion"] = c.plan.identity().conversion();
    j["logical_shape"] = c.whole.logical_shape;
    j["checkpoint_shape"] = c.tensor->shape;
    j["checkpoint_dtype"] = std::string(DtypeName(c.tensor->dtype));
    if (!c.whole.input_strides.empty()) j["input_strides"] = c.whole.input_strides;
    j["storage_shape"] = std::vector<int64_t>(c.plan.output_shape().begin(), c.plan.output_shape().end());
    j["storage_strides"] = std::vector<int64_t>(c.plan.output_strides().begin(), c.plan.output_strides().end());
    return j.dump();
  }

  // Value tensors of at least stream_min_bytes stream in pieces of whole matrices; the
  // rest, and the scales (a strided view, which a stream cannot carry), go in batches.
  void MakeJobs() {
    pieces_left_ = std::make_unique<std::atomic<int>[]>(convs_.size());
    Job batch;
    batch.kind = Job::Kind::kBatch;
    uint64_t batch_bytes = 0;
    auto flush = [&] {
      if (!batch.pieces.empty()) jobs_.push_back(std::move(batch));
      batch = Job();
      batch.kind = Job::Kind::kBatch;
      batch_bytes = 0;
    };
    for (size_t f = 0; f < outs_.size(); ++f) {
      for (size_t ti = 0; ti < outs_[f].tensors.size(); ++ti) {
        const OutTensor& o = outs_[f].tensors[ti];
        if (o.quantization >= 0) {
          if (o.scales) continue;  // quantized with its blocks
          Job j;
          j.kind = Job::Kind::kQuantize;
          j.file = static_cast<int>(f);
          j.tensor = static_cast<int>(ti);
          jobs_.push_back(std::move(j));
          ++items_;
          continue;
        }
        if (o.conversion < 0) {
          Job j;
          j.kind = Job::Kind::kCopy;
          j.file = static_cast<int>(f);
          j.tensor = static_cast<int>(ti);
          jobs_.push_back(std::move(j));
          ++items_;
          continue;
        }
        ++items_;
        const Conversion& c = convs_[static_cast<size_t>(o.conversion)];
        const uint64_t per = std::max<uint64_t>(1, c.in_per + c.out_per);
        const bool stream = c.role == Role::kValues && c.tensor->bytes() >= args_.stream_min_bytes && c.experts > 0;
        const uint64_t budget = stream ? args_.piece_bytes : args_.batch_bytes / 2;
        const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(budget / per));
        int pieces = 0;
        for (int64_t first = 0; first < std::max<int64_t>(c.experts, 1); first += step) {
          Piece p{o.conversion, first, std::min(step, c.experts - first)};
          if (c.experts == 0) p = Piece{o.conversion, 0, 0};
          ++pieces;
          if (stream) {
            Job j;
            j.kind = Job::Kind::kStream;
            j.pieces.push_back(p);
            jobs_.push_back(std::move(j));
            continue;
          }
          const uint64_t bytes = static_cast<uint64_t>(p.count) * per;
          if (!batch.pieces.empty() && (batch_bytes + bytes > args_.batch_bytes || batch.pieces.size() >= 512)) flush();
          batch.pieces.push_back(p);
          batch_bytes += bytes;
        }
        pieces_left_[static_cast<size_t>(o.conversion)].store(pieces);
      }
    }
    flush();
  }

  absl::Status Create(OutFile& f) {
    f.fd = open(f.tmp_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.fd < 0) return Errno(errno, absl::StrCat("cannot create '", f.tmp_path, "'"));
    // The blocks are reserved now: a full disk is this clean error, never a SIGBUS on a
    // store into the mapping later.
    if (const int err = posix_fallocate(f.fd, 0, static_cast<off_t>(f.size)); err != 0) {
      return Errno(err, absl::StrCat("cannot allocate ", f.size, " bytes for '", f.tmp_path, "'"));
    }
    void* p = mmap(nullptr, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
    if (p == MAP_FAILED) return Errno(errno, absl::StrCat("cannot map '", f.tmp_path, "'"));
    f.map = static_cast<uint8_t*>(p);
    std::memcpy(f.map, f.header.data(), f.header.size());
    return absl::OkStatus();
  }

  absl::Status WriteIndex() {
    nlohmann::ordered_json doc = inputs_.index;
    nlohmann::ordered_json& meta = doc["metadata"];
    if (!meta.is_object()) meta = nlohmann::ordered_json::object();
    uint64_t total = 0;
    for (const OutFile& f : outs_) {
      for (const OutTensor& t : f.tensors) total += t.out.bytes();
    }
    meta["total_size"] = total;
    for (const auto& [k, v] : global_metadata_) meta[k] = v;
    nlohmann::ordered_json& weights = doc["weight_map"];
    for (const Quantization& q : quants_) {
      const std::string& file = inputs_.files[static_cast<size_t>(q.file)].name;
      weights.erase(q.tensor->name);
      weights[BlocksName(q.tensor->name)] = file;
      weights[ScalesName(q.tensor->name)] = file;
    }
    const std::string text = doc.dump(2) + "\n";
    const std::string path = tmp_dir_ + "/" + inputs_.index_name;
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Errno(errno, absl::StrCat("cannot create '", path, "'"));
    absl::Status s = WriteAll(fd, reinterpret_cast<const uint8_t*>(text.data()), text.size(), 0, path);
    if (s.ok() && args_.fsync && fsync(fd) != 0) s = Errno(errno, absl::StrCat("cannot fsync '", path, "'"));
    if (close(fd) != 0 && s.ok()) s = Errno(errno, absl::StrCat("cannot write '", path, "'"));
    return s;
  }

  absl::Status RunJobs() {
    uint64_t total = 0;
    for (const InputFile& f : inputs_.files) {
      for (const SafetensorsTensor& t : f.header.tensors) total += t.bytes();
    }
    progress_ = std::make_unique<Progress>(args_.progress, total, items_);
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false};
    absl::Mutex mu;
    absl::Status first_error;
    std::vector<std::thread> workers;
    for (int w = 0; w < std::max(1, args_.jobs); ++w) {
      workers.emplace_back([&] {
        client::Client c(args_.target, 1);
        Scratch scratch;
        while (!stop.load()) {
          const size_t i = next.fetch_add(1);
          if (i >= jobs_.size()) break;
          absl::Status s = RunJob(c, jobs_[i], scratch);
          if (!s.ok()) {
            absl::MutexLock lock(&mu);
            if (first_error.ok()) first_error = s;
            stop.store(true);
          }
        }
      });
    }
    for (std::thread& t : workers) t.join();
    progress_->Finish();
    return first_error;
  }

  struct Scratch {
    std::string back;  // --verify's round trip, reused between jobs
  };

  absl::Status RunJob(client::Client& c, const Job& job, Scratch& scratch) {
    switch (job.kind) {
      case Job::Kind::kCopy: {
        const OutFile& out = outs_[static_cast<size_t>(job.file)];
        const OutTensor& t = out.tensors[static_cast<size_t>(job.tensor)];
        const InputFile& in = inputs_.files[static_cast<size_t>(job.file)];
        if (absl::Status s = CopyRange(in, *t.in, out, out.header.size() + t.out.begin); !s.ok()) return s;
        progress_->AddBytes(t.in->bytes());
        progress_->ItemDone(absl::StrCat("copied ", t.in->name, " ", DtypeName(t.in->dtype), " ", ShapeString(t.in->shape)));
        return absl::OkStatus();
      }
      case Job::Kind::kQuantize:
        return RunQuantize(job);
      case Job::Kind::kStream:
        return args_.local ? RunLocal(job, scratch) : RunStream(c, job.pieces.front(), scratch);
      case Job::Kind::kBatch:
        return args_.local ? RunLocal(job, scratch) : RunBatch(c, job);
    }
    return absl::InternalError("unknown job");
  }

  // One tensor quantized from the input's mapping straight into the output's, on the CPU or
  // the --device GPU, in pieces of at most --piece-bytes in (at least one unit each): whole
  // rows (each row quantizes on its own), or fused, whole matrices (each lays out on its
  // own). Either way the bytes are the whole tensor's.
  absl::Status RunQuantize(const Job& job) {
    const OutFile& out = outs_[static_cast<size_t>(job.file)];
    const OutTensor& t = out.tensors[static_cast<size_t>(job.tensor)];
    const Quantization& q = quants_[static_cast<size_t>(t.quantization)];
    const absl::Span<const uint8_t> in = inputs_.files[static_cast<size_t>(job.file)].Data(*q.tensor);
    uint8_t* blocks = out.map + out.header.size() + q.blocks_begin;
    uint8_t* scales = out.map + out.header.size() + q.scales_begin;
    absl::Status s;
    // A unit: a row [Q], or fused, a matrix [N, K]; each piece is a plan of whole units.
    // Fused tensors have rank 2 or more (PlanFused): their matrices are [N, K].
    const int64_t n_rows = q.fused ? q.plan.input_shape[q.plan.input_shape.size() - 2] : 1;
    const int64_t units = q.fused ? (n_rows == 0 ? 0 : q.plan.rows / n_rows) : q.plan.rows;
    const int64_t unit_in = q.plan.input_bytes / std::max<int64_t>(units, 1);
    const int64_t unit_v = static_cast<int64_t>(q.BlocksBytes()) / std::max<int64_t>(units, 1);
    const int64_t unit_s = static_cast<int64_t>(q.ScalesBytes()) / std::max<int64_t>(units, 1);
    const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(args_.piece_bytes) / std::max<int64_t>(unit_in, 1));
    for (int64_t first = 0; first < units && s.ok(); first += step) {
      const int64_t n = std::min(step, units - first);
      std::vector<int64_t> shape = {n, q.plan.q};
      if (q.fused) shape = {n, n_rows, q.plan.q};
      absl::StatusOr<QuantizePlan> piece = MakeQuantizePlan(q.plan.dtype, shape, q.plan.rounding);
      if (!piece.ok()) return piece.status();
      const uint8_t* src = in.data() + first * unit_in;
      uint8_t* v = blocks + first * unit_v;
      uint8_t* sc = scales + first * unit_s;
      const size_t in_n = static_cast<size_t>(n * unit_in), v_n = static_cast<size_t>(n * unit_v),
                   s_n = static_cast<size_t>(n * unit_s);
      s = args_.device < 0 ? QuantizeLayoutOnCpu(*piece, q.layout, src, in_n, v, v_n, sc, s_n)
                           : QuantizeHostBuffersOnCuda(*piece, src, in_n, v, v_n, sc, s_n, args_.device, q.layout);
    }
    if (!s.ok()) return Prefixed(s, q.tensor->name);
    progress_->AddBytes(in.size());
    progress_->ItemDone(absl::StrCat(
        "quantized ", q.tensor->name, " ", DtypeName(q.tensor->dtype), " ", ShapeString(q.tensor->shape), " -> ",
        BlocksName(q.tensor->name), " ", ShapeString(q.fused ? q.values.plan.output_shape : q.blocks_shape), ", ",
        ScalesName(q.tensor->name), " ", ShapeString(q.fused ? q.scales.plan.output_shape : q.scales_shape)));
    return absl::OkStatus();
  }

  absl::Span<const uint8_t> PieceInput(const Piece& p) const {
    const Conversion& c = convs_[static_cast<size_t>(p.conversion)];
    return inputs_.files[static_cast<size_t>(c.file)]
        .Data(*c.tensor)
        .subspan(static_cast<uint64_t>(p.first) * c.in_per, static_cast<uint64_t>(p.count) * c.in_per);
  }

  std::string PieceName(const Piece& p) const {
    const Conversion& c = convs_[static_cast<size_t>(p.conversion)];
    if (p.count == c.experts) return c.tensor->name;
    return absl::StrCat(c.tensor->name, " matrices [", p.first, ", ", p.first + p.count, ")");
  }

  // Where piece `p`'s output goes in its file's mapping.
  absl::Span<uint8_t> PieceOutput(const Piece& p) const {
    const Conversion& c = convs_[static_cast<size_t>(p.conversion)];
    const OutFile& f = outs_[static_cast<size_t>(c.file)];
    const uint64_t at = f.header.size() + c.out_begin + static_cast<uint64_t>(p.first) * c.out_per;
    return {f.map + at, static_cast<uint64_t>(p.count) * c.out_per};
  }

  // The piece's output is in place: counts it, and reports its tensor once all is.
  void PieceDone(const Piece& p) {
    const Conversion& c = convs_[static_cast<size_t>(p.conversion)];
    if (pieces_left_[static_cast<size_t>(p.conversion)].fetch_sub(1) == 1) {
      progress_->ItemDone(absl::StrCat("converted ", c.tensor->name, " ", ShapeString(c.tensor->shape), " -> ",
                                       ShapeString(std::vector<int64_t>(c.plan.output_shape().begin(),
                                                                        c.plan.output_shape().end())),
                                       args_.verify ? ", verified" : ""));
    }
  }

  // --device with --layout: the plan, as the daemon's Plan would answer it.
  static absl::StatusOr<v1::PlanResponse> LocalPlan(const TensorConversion& t, uint64_t buffer_bytes) {
    absl::StatusOr<Plan> plan = MakePlan(t.spec, t.logical_shape, InputBinding{t.input_strides, buffer_bytes});
    if (!plan.ok()) return plan.status();
    v1::PlanResponse r;
    for (int64_t d : plan->output_shape) r.add_output_shape(d);
    for (int64_t d : plan->output_strides) r.add_output_strides(d);
    r.set_output_bytes(plan->output_bytes);
    r.set_input_bytes(plan->input_bytes);
    *r.mutable_identity() = IdentityToProto(plan->spec);
    return r;
  }

  // --device with --layout: `t` from `in` into `out` in this process, on the CPU (one
  // thread: the jobs run side by side) or the GPU.
  absl::Status ConvertLocally(const TensorConversion& t, absl::Span<const uint8_t> in, absl::Span<uint8_t> out) const {
    absl::StatusOr<Plan> plan = MakePlan(t.spec, t.logical_shape, InputBinding{t.input_strides, in.size()});
    if (!plan.ok()) return plan.status();
    if (plan->output_bytes != out.size()) {
      return absl::InternalError(absl::StrCat("the piece's plan writes ", plan->output_bytes, " bytes into ", out.size()));
    }
    if (args_.device < 0) {
      CpuOptions cpu;
      cpu.threads = 1;
      return ConvertOnCpu(*plan, in.data(), in.size(), out.data(), out.size(), cpu);
    }
    return ConvertHostBuffersOnCuda(*plan, in.data(), in.size(), out.data(), out.size(), args_.device);
  }

  // --verify of a piece converted in this process: its output converted back equals its
  // input (values as stored; scales through the transposed view).
  absl::Status VerifyLocally(const Piece& p, const TensorConversion& piece, Scratch& scratch) const {
    const Conversion& conv = convs_[static_cast<size_t>(p.conversion)];
    const absl::Span<const uint8_t> in = PieceInput(p);
    scratch.back.resize(in.size());
    absl::Span<uint8_t> back(reinterpret_cast<uint8_t*>(scratch.back.data()), scratch.back.size());
    if (absl::Status s = ConvertLocally(BackOf(piece), PieceOutput(p), back); !s.ok()) {
      return Prefixed(s, absl::StrCat("--verify: ", PieceName(p)));
    }
    uint64_t at = 0;
    const bool same = conv.role == Role::kValues
                          ? absl::Span<const uint8_t>(back) == in
                          : ScalesRoundTrip(in, back, p.count, piece.logical_shape[1], piece.logical_shape[2], &at);
    if (!same) return absl::DataLossError(absl::StrCat("--verify: ", PieceName(p), " does not convert back to its input"));
    return absl::OkStatus();
  }

  absl::Status RunLocal(const Job& job, Scratch& scratch) {
    for (const Piece& p : job.pieces) {
      const TensorConversion piece = PieceOf(convs_[static_cast<size_t>(p.conversion)], p.count);
      const absl::Span<const uint8_t> in = PieceInput(p);
      const absl::Span<uint8_t> out = PieceOutput(p);
      Populate(in.data(), in.size(), MADV_POPULATE_READ);
      Populate(out.data(), out.size(), MADV_POPULATE_WRITE);
      if (absl::Status s = ConvertLocally(piece, in, out); !s.ok()) return Prefixed(s, PieceName(p));
      if (args_.verify) {
        if (absl::Status s = VerifyLocally(p, piece, scratch); !s.ok()) return s;
      }
      progress_->AddBytes(in.size());
      PieceDone(p);
    }
    return absl::OkStatus();
  }

  absl::Status RunStream(client::Client& c, const Piece& p, Scratch& scratch) {
    const Conversion& conv = convs_[static_cast<size_t>(p.conversion)];
    const absl::Span<const uint8_t> in = PieceInput(p);
    const absl::Span<uint8_t> out = PieceOutput(p);
    Populate(in.data(), in.size(), MADV_POPULATE_READ);
    Populate(out.data(), out.size(), MADV_POPULATE_WRITE);
    const TensorConversion piece = PieceOf(conv, p.count);
    uint64_t counted = 0;
    client::StreamOptions o;
    o.retry = retry_;
    o.chunk_bytes = 4u << 20;
    o.stripe_min_bytes = UINT64_MAX;  // the jobs run side by side already
    // Done is what came back, counted in input bytes (the output may be padded larger).
    o.progress = [&](const client::StreamProgress& sp) {
      if (sp.output_bytes == 0) return;
      const uint64_t done = static_cast<uint64_t>(static_cast<double>(sp.bytes_received) /
                                                  static_cast<double>(sp.output_bytes) * static_cast<double>(in.size()));
      if (done > counted) {
        progress_->AddBytes(done - counted);
        counted = done;
      }
    };
    auto header = [](const TensorConversion& t) {
      v1::StreamRequestHeader h;
      *h.mutable_spec() = SpecToProto(t.spec);
      for (int64_t d : t.logical_shape) h.add_logical_shape(d);
      return h;
    };
    // Straight into the output file's pages.
    absl::StatusOr<v1::StreamResponseHeader> r = c.ConvertStream(header(piece), in, out, o);
    if (!r.ok()) return Prefixed(r.status(), PieceName(p));
    progress_->AddBytes(in.size() - std::min<uint64_t>(counted, in.size()));
    if (args_.verify) {
      client::StreamOptions back = o;
      back.progress = nullptr;
      r = c.ConvertStream(header(BackOf(piece)), out, &scratch.back, back);
      if (!r.ok()) return Prefixed(r.status(), absl::StrCat("--verify: ", PieceName(p)));
      if (absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(scratch.back.data()), scratch.back.size()) != in) {
        return absl::DataLossError(absl::StrCat("--verify: ", PieceName(p), " does not convert back to its input"));
      }
    }
    PieceDone(p);
    return absl::OkStatus();
  }

  absl::Status RunBatch(client::Client& c, const Job& job) {
    client::CallOptions o;
    o.retry = retry_;
    client::BatchBuilder batch;
    std::vector<TensorConversion> pieces;
    for (const Piece& p : job.pieces) {
      pieces.push_back(PieceOf(convs_[static_cast<size_t>(p.conversion)], p.count));
      batch.AddInline(pieces.back(), PieceInput(p));
    }
    absl::StatusOr<v1::ConvertBatchResponse> r = c.ConvertBatch(batch.Take(), o);
    if (!r.ok()) return Prefixed(r.status(), PieceName(job.pieces.front()));
    if (r->items_size() != static_cast<int>(job.pieces.size())) {
      return absl::DataLossError(absl::StrCat("the daemon answered ", r->items_size(), " of ", job.pieces.size(), " items"));
    }
    auto output = [&](const v1::ConvertBatchResponse& resp, size_t i) -> absl::StatusOr<absl::Span<const uint8_t>> {
      const v1::BatchItemResult& item = resp.items(static_cast<int>(i));
      if (item.outputs_size() != 1) return absl::DataLossError("a batch item without its output");
      const std::string& b = item.outputs(0).inline_bytes();
      return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size());
    };
    if (args_.verify) {
      client::BatchBuilder back;
      for (size_t i = 0; i < job.pieces.size(); ++i) {
        absl::StatusOr<absl::Span<const uint8_t>> out = output(*r, i);
        if (!out.ok()) return out.status();
        back.AddInline(BackOf(pieces[i]), *out);
      }
      absl::StatusOr<v1::ConvertBatchResponse> b = c.ConvertBatch(back.Take(), o);
      if (!b.ok()) return Prefixed(b.status(), absl::StrCat("--verify: ", PieceName(job.pieces.front())));
      for (size_t i = 0; i < job.pieces.size(); ++i) {
        const Piece& p = job.pieces[i];
        const Conversion& conv = convs_[static_cast<size_t>(p.conversion)];
        absl::StatusOr<absl::Span<const uint8_t>> got = output(*b, i);
        if (!got.ok()) return got.status();
        const absl::Span<const uint8_t> in = PieceInput(p);
        uint64_t at = 0;
        const bool same = conv.role == Role::kValues
                              ? *got == in
                              : ScalesRoundTrip(in, *got, p.count, pieces[i].logical_shape[1],
                                                pieces[i].logical_shape[2], &at);
        if (!same) {
          return absl::DataLossError(absl::StrCat("--verify: ", PieceName(p), " does not convert back to its input"));
        }
      }
    }
    for (size_t i = 0; i < job.pieces.size(); ++i) {
      absl::StatusOr<absl::Span<const uint8_t>> out = output(*r, i);
      if (!out.ok()) return out.status();
      const absl::Span<uint8_t> dst = PieceOutput(job.pieces[i]);
      if (out->size() != dst.size()) {
        return absl::DataLossError(absl::StrCat(PieceName(job.pieces[i]), ": the daemon returned ", out->size(),
                                                " bytes, expected ", dst.size()));
      }
      std::memcpy(dst.data(), out->data(), out->size());
      progress_->AddBytes(PieceInput(job.pieces[i]).size());
      PieceDone(job.pieces[i]);
    }
    return absl::OkStatus();
  }

  const ConvertSafetensorsArgs& args_;
  client::RetryPolicy retry_;
  std::string tmp_dir_;  // sharded: the folder built beside OUT
  Inputs inputs_;
  std::vector<Conversion> convs_;
  std::vector<Quantization> quants_;
  std::vector<OutFile> outs_;
  std::vector<std::pair<std::string, std::string>> global_metadata_;
  std::vector<Job> jobs_;
  std::unique_ptr<std::atomic<int>[]> pieces_left_;
  int items_ = 0;
  std::unique_ptr<Progress> progress_;
};

}  // namespace

namespace {

// `wprep convert-safetensors`' flags: the parser and --help.
flags::FlagSet ConvertSafetensorsFlags() {
  const ConvertSafetensorsArgs d;
  flags::FlagSet fs = CommandFlags(
      "convert-safetensors",
      "usage: wprep convert-safetensors IN OUT (--layout L | --quantize PATTERNS) [flags]\n"
      "IN is a .safetensors file, a model.safetensors.index.json, or a folder holding one index;\n"
      "OUT is then a file, or a folder for the converted shards and their index.\n"
      "Every MXFP4 pair of a gpt-oss-style checkpoint, NAME_blocks U8 [..., N, K/32, 16] and\n"
      "NAME_scales U8 [..., N, K/32], is converted: the blocks as the checkpoint-order storage\n"
      "of the weight [..., K, N], the scales through the view [..., K/32, N]. Each keeps its name\n"
      "and takes the storage shape the daemon reports; every other tensor is copied byte for\n"
      "byte; __metadata__ records the layouts, their parameters and each tensor's shapes.\n"
      "With --quantize instead, the BF16/F16/F32 tensors the patterns name, each NAME of shape\n"
      "[..., Q] (Q a multiple of 32), are quantized to MXFP4 in this process (no daemon):\n"
      "NAME_blocks U8 [..., Q/32, 16] and NAME_scales U8 [..., Q/32], the pair --layout reads;\n"
      "__metadata__ records each as wprep.quantized.NAME. With --layout blackwell_value, or\n"
      "hopper_value at --mx-axis -2, too, the pair is written already converted, as --layout\n"
      "would convert it.\n");
  fs.String("layout", "L", "", "the values' layout: hopper_value, blackwell_value or blackwell_shuffled_value");
  fs.String("quantize", "PATTERNS", "",
            "fnmatch(3) globs of the BF16/F16/F32 tensors to quantize to MXFP4, separated by ';' or ','; "
            "with --layout blackwell_value or hopper_value they are written laid out (fused)");
  fs.String("scale-rounding", "up|down", "up", "with --quantize: how a group's e8m0 scale rounds");
  fs.String("device", "cpu|cuda:N", "cpu",
            "where this process quantizes (--quantize) and, given with --layout, converts: then "
            "no daemon is used");
  fs.String("scale-layout", "L", "",
            "hopper_scale or blackwell_scale (default: hopper_scale for hopper_value, "
            "blackwell_scale for the Blackwell layouts)");
  AddSpecFlags(&fs, {"mx-axis", "mma-version", "num-warps", "align-k", "block-k", "block-n"});
  fs.String("target", "ADDR", d.target, "the wprepd: unix:///path.sock or HOST:PORT");
  fs.Switch("verify", "unswizzle every output back and compare with the input");
  fs.String("jobs", "N", absl::StrCat(d.jobs), "requests in flight, 1 to 64");
  fs.String("progress", "MODE", "auto", "auto (a bar on a terminal), bar, lines or none; on stderr");
  fs.Switch("fsync", "fsync the outputs before renaming them into place");
  fs.String("piece-bytes", "N", absl::StrCat(d.piece_bytes),
            "value tensors of at least --stream-min-bytes stream in pieces of whole matrices of "
            "at most this many bytes in and out");
  fs.String("stream-min-bytes", "N", absl::StrCat(d.stream_min_bytes),
            "value tensors smaller than this, and the scales, go in ConvertBatch calls");
  fs.String("batch-bytes", "N", absl::StrCat(d.batch_bytes), "bytes in and out of one ConvertBatch call");
  fs.Positional(2, 2);
  fs.Footer(
      "Nothing is written at OUT unless all of it converted. On error exits 2 with one line\n"
      "beginning with the status code.\n");
  return fs;
}

absl::Status ParseQuantizeFlags(const Flags& flags, ConvertSafetensorsArgs* out) {
  if (const std::string* r = flags.Get("--scale-rounding")) {
    if (!flags.Has("--quantize")) return Bad("--scale-rounding is for --quantize");
    absl::StatusOr<ScaleRounding> rounding = ParseScaleRounding(*r);
    if (!rounding.ok()) return Bad(absl::StrCat("--scale-rounding must be up or down, got '", *r, "'"));
    out->scale_rounding = *rounding;
  }
  const std::string* q = flags.Get("--quantize");
  if (const std::string* d = flags.Get("--device")) {
    if (q == nullptr && !flags.Has("--layout")) return Bad("--device is for --quantize or --layout");
    absl::StatusOr<int> device = ParseDevice(*d);
    if (!device.ok()) return device.status();
    out->device = *device;
    out->local = flags.Has("--layout");
    if (out->local && flags.Has("--target")) return Bad("--target is for the daemon; --device converts in this process");
  }
  if (q == nullptr) return absl::OkStatus();
  for (absl::string_view p : absl::StrSplit(*q, absl::ByAnyChar(";,"), absl::SkipWhitespace())) {
    out->quantize.emplace_back(absl::StripAsciiWhitespace(p));
  }
  if (out->quantize.empty()) return Bad("--quantize names no pattern");
  if (flags.Get("--layout") == nullptr) {
    // The layout's own flags mean nothing without one.
    for (const char* f : {"--scale-layout", "--mx-axis", "--mma-version", "--num-warps", "--align-k", "--block-k",
                          "--block-n", "--verify"}) {
      if (flags.Has(f)) return Bad(absl::StrCat(f, " is for --layout"));
    }
  }
  return absl::OkStatus();
}

// The flags of how the run goes, whatever it does.
absl::StatusOr<ConvertSafetensorsArgs> ParseRunFlags(const Flags& flags, ConvertSafetensorsArgs out) {
  if (const std::string* t = flags.Get("--target")) {
    if (t->empty()) return Bad("--target must not be empty");
    out.target = *t;
  }
  absl::StatusOr<int64_t> jobs = flags.Int("--jobs", out.jobs);
  if (!jobs.ok()) return jobs.status();
  if (*jobs < 1 || *jobs > 64) return Bad(absl::StrCat("--jobs must be in [1, 64], got ", *jobs));
  out.jobs = static_cast<int>(*jobs);
  const std::string* progress = flags.Get("--progress");
  absl::StatusOr<ProgressMode> mode = ParseProgressMode(progress != nullptr ? *progress : "auto", stderr);
  if (!mode.ok()) return mode.status();
  out.progress = *mode;
  struct Size {
    const char* flag;
    uint64_t* dst;
  };
  for (Size z : {Size{"--piece-bytes", &out.piece_bytes}, Size{"--stream-min-bytes", &out.stream_min_bytes},
                 Size{"--batch-bytes", &out.batch_bytes}}) {
    absl::StatusOr<int64_t> v = flags.Int(z.flag, static_cast<int64_t>(*z.dst));
    if (!v.ok()) return v.status();
    if (*v < 1) return Bad(absl::StrCat(z.flag, " must be at least 1, got ", *v));
    *z.dst = static_cast<uint64_t>(*v);
  }
  out.verify = flags.Has("--verify");
  out.fsync = flags.Has("--fsync");
  return out;
}

}  // namespace

std::string ConvertSafetensorsUsage() { return ConvertSafetensorsFlags().Usage(); }

absl::StatusOr<ConvertSafetensorsArgs> ParseConvertSafetensorsArgs(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, ConvertSafetensorsFlags());
  if (!flags.ok()) return flags.status();
  ConvertSafetensorsArgs out;
  out.input = flags->positional()[0];
  out.output = flags->positional()[1];
  if (absl::Status s = ParseQuantizeFlags(*flags, &out); !s.ok()) return s;
  const std::string* layout = flags->Get("--layout");
  if (layout == nullptr && !out.quantize.empty()) {
    out.convert = false;
    return ParseRunFlags(*flags, out);
  }
  if (layout == nullptr) {
    return Bad("--layout (hopper_value, blackwell_value or blackwell_shuffled_value) or --quantize is required");
  }
  absl::StatusOr<Layout> values = ParseLayout(*layout);
  if (!values.ok()) return values.status();
  if (!IsValueLayout(*values)) {
    return Bad(absl::StrCat("--layout names the value layout (hopper_value, blackwell_value, "
                            "blackwell_shuffled_value), got ", *layout, "; --scale-layout names the scales'"));
  }
  Layout scales = *values == Layout::kHopperValue ? Layout::kHopperScale : Layout::kBlackwellScale;
  if (const std::string* s = flags->Get("--scale-layout")) {
    absl::StatusOr<Layout> l = ParseLayout(*s);
    if (!l.ok()) return l.status();
    if (IsValueLayout(*l)) return Bad(absl::StrCat("--scale-layout must be hopper_scale or blackwell_scale, got ", *s));
    scales = *l;
  }
  absl::StatusOr<ConversionSpec> v = ParseSpecFlags(*flags, *values, Direction::kSwizzle);
  if (!v.ok()) return v.status();
  absl::StatusOr<ConversionSpec> s = ParseSpecFlags(*flags, scales, Direction::kSwizzle);
  if (!s.ok()) return s.status();
  out.values = *v;
  out.values.packing_axis = -2;
  out.scales = *s;
  if (!out.quantize.empty() && !FusedQuantLayout(out.values, out.scales).has_value()) {
    return absl::UnimplementedError(absl::StrCat(
        "--quantize with --layout ", *layout, ": quantizing straight into a layout serves blackwell_value and "
        "blackwell_shuffled_value with blackwell_scale, and hopper_value with hopper_scale at --mx-axis -2; run "
        "--quantize alone, then --layout on its output"));
  }
  return ParseRunFlags(*flags, out);
}

absl::StatusOr<ConvertSafetensorsSummary> RunConvertSafetensors(const ConvertSafetensorsArgs& args) {
  Converter c(args);
  return c.Run();
}

int ConvertSafetensorsCommand(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(ConvertSafetensorsUsage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<ConvertSafetensorsArgs> parsed = ParseConvertSafetensorsArgs(args);
  if (!parsed.ok()) return FailLine(parsed.status());
  client::TuneHeapForStreaming();
  absl::StatusOr<ConvertSafetensorsSummary> summary = RunConvertSafetensors(*parsed);
  if (!summary.ok()) return FailLine(summary.status());
  std::printf("%s\n", FormatSummary(*parsed, *summary).c_str());
  return 0;
}

std::string FormatSummary(const ConvertSafetensorsArgs& args, const ConvertSafetensorsSummary& s) {
  if (!args.convert) {
    return absl::StrFormat("quantized %d tensors (scales rounded %s) and copied %d, %d file%s, %s in %.2f s (%s) -> %s",
                           s.quantized, args.scale_rounding == ScaleRounding::kUp ? "up" : "down", s.copied, s.files,
                           s.files == 1 ? "" : "s", Progress::Bytes(s.input_bytes), s.seconds,
                           Progress::PerSecond(s.seconds > 0 ? static_cast<double>(s.input_bytes) / s.seconds : 0),
                           args.output);
  }
  const std::string quantized =
      s.quantized == 0 ? ""
                       : absl::StrFormat("quantized %d tensors (scales rounded %s) into the layouts, ", s.quantized,
                                         args.scale_rounding == ScaleRounding::kUp ? "up" : "down");
  return absl::StrFormat("%sconverted %d tensors%s and copied %d, %d file%s, %s in %.2f s (%s) -> %s", quantized,
                         s.converted,
                         args.verify ? " (verified)" : "", s.copied, s.files, s.files == 1 ? "" : "s",
                         Progress::Bytes(s.input_bytes), s.seconds,
                         Progress::PerSecond(s.seconds > 0 ? static_cast<double>(s.input_bytes) / s.seconds : 0),
                         args.output);
}

}  // namespace wprep::cli
