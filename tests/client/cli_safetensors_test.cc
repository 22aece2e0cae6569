// `wprep convert-safetensors` against a real wprepd on the CPU engine, on gpt-oss-shaped
// checkpoints the test writes (one file, and sharded). Every converted tensor is checked
// against the local engine, wprep::ConvertOnCpu on the same bytes (the engine itself is
// checked against the reference vectors in tests/kernels and tests/server); every other
// tensor must be byte-identical; the header must parse, be aligned as the format's
// reference implementation aligns it, and carry the metadata.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli_runner.h"
#include "daemon_harness.h"
#include "shared_daemon.h"
#include "fake_checkpoint.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"
#include "wprep/client/batch.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

using cli::SafetensorsHeader;
using testing::FakeCheckpointOptions;
using testing::FakeTensor;

class CliSafetensorsTest : public testing::SharedDaemonTest<CliSafetensorsTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--devices=cpu", "--cpu-threads=2"}); }

  RunResult Convert(const fs::path& in, const fs::path& out, const std::string& flags) {
    return RunCli("convert-safetensors " + in.string() + " " + out.string() + " --target " + daemon_->unix_target() +
                  " " + flags);
  }

  // Nothing but `keep` in the test's folder: no output, no temporary left behind.
  void ExpectOnly(const std::vector<std::string>& keep) {
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string name = e.path().filename().string();
      if (name == "stdout" || name == "stderr") continue;
      EXPECT_NE(std::find(keep.begin(), keep.end(), name), keep.end()) << "left behind: " << name;
    }
  }

};

struct Layouts {
  std::string flags;  // the command line's layout flags
  ConversionSpec values, scales;
};

// The conversion wprep must have made of `t`, from the checkpoint's own bytes.
struct Expectation {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape, strides, logical;
  std::string layout;
};
Expectation Expect(const FakeTensor& t, const Layouts& l) {
  const std::vector<uint8_t> in = testing::FakeTensorBytes(t);
  const bool values = absl::EndsWith(t.name, "_blocks");
  absl::StatusOr<client::TensorConversion> c =
      values ? client::CheckpointValues(l.values, t.shape) : client::CheckpointScales(l.scales, t.shape);
  EXPECT_TRUE(c.ok()) << c.status();
  absl::StatusOr<Plan> plan = MakePlan(c->spec, c->logical_shape, InputBinding{c->input_strides, in.size()});
  EXPECT_TRUE(plan.ok()) << plan.status();
  Expectation e;
  e.bytes.resize(plan->output_bytes);
  EXPECT_TRUE(ConvertOnCpu(*plan, in.data(), in.size(), e.bytes.data(), e.bytes.size()).ok());
  e.shape = plan->output_shape;
  e.strides = plan->output_strides;
  e.logical = c->logical_shape;
  e.layout = LayoutIdentity(c->spec);
  return e;
}

// Checks one output file against the tensors of the input that it must hold.
void CheckOutputFile(const fs::path& path, const std::vector<const FakeTensor*>& tensors, const Layouts& l) {
  SCOPED_TRACE(path.string());
  const std::vector<uint8_t> file = testing::ReadFile(path.string());
  absl::StatusOr<SafetensorsHeader> h = cli::ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(h.ok()) << h.status();
  // Aligned as the reference writes it: JSON, then spaces to a multiple of 8 bytes.
  EXPECT_EQ(h->header_bytes % 8, 0u);
  const std::string text(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(h->header_bytes));
  const size_t end = text.find_last_not_of(' ');
  EXPECT_LT(text.size() - end - 1, 8u);
  const nlohmann::json json = nlohmann::json::parse(text.substr(0, end + 1), nullptr, false);
  ASSERT_FALSE(json.is_discarded());

  std::map<std::string, std::string> meta(h->metadata.begin(), h->metadata.end());
  EXPECT_EQ(meta["format"], "pt");  // the input's metadata is kept
  EXPECT_EQ(meta["wprep.contract_version"], std::to_string(kLayoutContractVersion));
  ConversionSpec v = l.values;
  v.packing_axis = -2;
  EXPECT_EQ(meta["wprep.values.layout"], LayoutIdentity(v));
  EXPECT_EQ(meta["wprep.scales.layout"], LayoutIdentity(l.scales));
  EXPECT_EQ(meta["wprep.values.conversion"], ConversionIdentity(v));
  const nlohmann::json params = nlohmann::json::parse(meta["wprep.values.params"], nullptr, false);
  ASSERT_TRUE(params.is_object()) << meta["wprep.values.params"];
  EXPECT_EQ(params["layout"], std::string(LayoutName(l.values.layout)));
  EXPECT_EQ(params["packing_axis"], -2);

  ASSERT_EQ(h->tensors.size(), tensors.size());
  std::map<std::string, const cli::SafetensorsTensor*> out;
  for (const cli::SafetensorsTensor& t : h->tensors) out[t.name] = &t;
  int converted = 0;
  for (const FakeTensor* t : tensors) {
    SCOPED_TRACE(t->name);
    ASSERT_TRUE(out.count(t->name));
    const cli::SafetensorsTensor& o = *out[t->name];
    const std::vector<uint8_t> got(file.begin() + static_cast<std::ptrdiff_t>(h->data_offset() + o.begin),
                                   file.begin() + static_cast<std::ptrdiff_t>(h->data_offset() + o.end));
    const bool mxfp4 = absl::EndsWith(t->name, "_blocks") || absl::EndsWith(t->name, "_scales");
    if (!mxfp4) {
      EXPECT_EQ(std::string(cli::DtypeName(o.dtype)), t->dtype);
      EXPECT_EQ(o.shape, t->shape);
      EXPECT_TRUE(got == testing::FakeTensorBytes(*t)) << "a copied tensor changed";
      EXPECT_FALSE(meta.count("wprep.tensor." + t->name));
      continue;
    }
    ++converted;
    const Expectation e = Expect(*t, l);
    EXPECT_EQ(o.dtype, cli::Dtype::kU8);
    EXPECT_EQ(o.shape, e.shape);
    EXPECT_TRUE(got == e.bytes) << "converted bytes differ from ConvertOnCpu's";
    const nlohmann::json tj = nlohmann::json::parse(meta["wprep.tensor." + t->name], nullptr, false);
    ASSERT_TRUE(tj.is_object()) << meta["wprep.tensor." + t->name];
    EXPECT_EQ(tj["storage_shape"].get<std::vector<int64_t>>(), e.shape);
    EXPECT_EQ(tj["storage_strides"].get<std::vector<int64_t>>(), e.strides);
    EXPECT_EQ(tj["logical_shape"].get<std::vector<int64_t>>(), e.logical);
    EXPECT_EQ(tj["checkpoint_shape"].get<std::vector<int64_t>>(), t->shape);
    EXPECT_EQ(tj["layout"], e.layout);
    EXPECT_EQ(tj["role"], absl::EndsWith(t->name, "_blocks") ? "values" : "scales");
  }
  (void)converted;
}

std::vector<Layouts> AllLayouts() {
  std::vector<Layouts> out;
  Layouts h;
  h.flags = "--layout hopper_value";
  h.values.layout = Layout::kHopperValue;
  h.scales.layout = Layout::kHopperScale;
  out.push_back(h);
  Layouts h2 = h;
  h2.flags = "--layout hopper_value --mma-version 2 --num-warps 4";
  h2.values.hopper.mma_version = 2;
  h2.scales.hopper_scale.num_warps = 4;
  out.push_back(h2);
  Layouts bv;
  bv.flags = "--layout blackwell_value";
  bv.values.layout = Layout::kBlackwellValue;
  bv.scales.layout = Layout::kBlackwellScale;
  out.push_back(bv);
  Layouts bs = bv;
  bs.flags = "--layout blackwell_shuffled_value --block-k 64 --block-n 128";
  bs.values.layout = Layout::kBlackwellShuffledValue;
  bs.values.blackwell = {64, 128};
  out.push_back(bs);
  return out;
}

std::vector<const FakeTensor*> Pointers(const std::vector<FakeTensor>& t) {
  std::vector<const FakeTensor*> p;
  for (const FakeTensor& x : t) p.push_back(&x);
  return p;
}

// Every layout, with the work cut small (several streams per tensor, several batches
// per layer) so the pieces must land in the right places; progress as plain lines.
TEST_F(CliSafetensorsTest, ConvertsEveryMxfp4TensorAndCopiesTheRest) {
  FakeCheckpointOptions o;
  o.experts = 5;
  o.hidden = 256;
  o.intermediate = 160;
  const fs::path in = dir_ / "model.safetensors";
  const std::vector<FakeTensor> tensors = testing::WriteFakeCheckpoint(in.string(), o);
  for (const Layouts& l : AllLayouts()) {
    SCOPED_TRACE(l.flags);
    const fs::path out = dir_ / "out.safetensors";
    const RunResult r = Convert(in, out, l.flags + " --jobs 3 --piece-bytes 40000 --stream-min-bytes 50000 --batch-bytes 30000");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    CheckOutputFile(out, Pointers(tensors), l);
    EXPECT_EQ(r.out.rfind(absl::StrCat("converted 8 tensors and copied ", tensors.size() - 8, ", 1 file"), 0), 0u)
        << r.out;
    // Not a terminal: one plain line per tensor, numbered, the last at 100%.
    std::vector<std::string> lines = absl::StrSplit(r.err, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), tensors.size()) << r.err;
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i].rfind(absl::StrCat("[", i + 1, "/", tensors.size(), "] "), 0), 0u)
          << lines[i];
      EXPECT_NE(lines[i].find("B/s)"), std::string::npos) << lines[i];
      EXPECT_EQ(lines[i].find('\r'), std::string::npos);
    }
    EXPECT_NE(lines.back().find("100.0%"), std::string::npos) << lines.back();
    EXPECT_NE(r.err.find("converted model.layers.1.mlp.experts.gate_up_proj_blocks [5, 320, 8, 16] -> ["),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("copied model.embed_tokens.weight BF16 [64, 256]"), std::string::npos) << r.err;
    fs::remove(out);
  }
  ExpectOnly({"model.safetensors"});
}

TEST_F(CliSafetensorsTest, VerifyRoundTripsEveryTensor) {
  FakeCheckpointOptions o;
  o.experts = 3;
  o.hidden = 160;
  const fs::path in = dir_ / "model.safetensors";
  const std::vector<FakeTensor> tensors = testing::WriteFakeCheckpoint(in.string(), o);
  for (const Layouts& l : {AllLayouts()[0], AllLayouts()[3]}) {
    const fs::path out = dir_ / "out.safetensors";
    const RunResult r = Convert(in, out, l.flags + " --verify --progress none --piece-bytes 20000 --stream-min-bytes 1");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_NE(r.out.find("(verified)"), std::string::npos) << r.out;
    CheckOutputFile(out, Pointers(tensors), l);
    fs::remove(out);
  }
}

// --device with --layout converts in this process, no daemon: the same file, byte for byte,
// as through the daemon, for every layout, --verify included; on the CPU here, and on the
// first GPU where there is one.
TEST_F(CliSafetensorsTest, DeviceConvertsInThisProcessToTheDaemonsBytes) {
  FakeCheckpointOptions o;
  o.experts = 3;
  o.hidden = 192;
  o.intermediate = 96;
  const fs::path in = dir_ / "model.safetensors";
  const std::vector<FakeTensor> tensors = testing::WriteFakeCheckpoint(in.string(), o);
  std::vector<std::string> devices = {"cpu"};
  if (CudaDeviceCount() > 0) devices.push_back("cuda:0");
  for (const Layouts& l : AllLayouts()) {
    SCOPED_TRACE(l.flags);
    const fs::path daemon_out = dir_ / "daemon.safetensors";
    const std::string cut = " --progress none --piece-bytes 20000 --stream-min-bytes 30000 --batch-bytes 30000";
    RunResult r = Convert(in, daemon_out, l.flags + cut);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::vector<uint8_t> want = testing::ReadFile(daemon_out.string());
    for (const std::string& device : devices) {
      SCOPED_TRACE(device);
      const fs::path out = dir_ / "local.safetensors";
      // No --target: nothing listens at the default address, so the daemon cannot be used.
      r = RunCli("convert-safetensors " + in.string() + " " + out.string() + " " + l.flags + cut + " --verify --device " +
                 device);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_NE(r.out.find("(verified)"), std::string::npos) << r.out;
      EXPECT_TRUE(testing::ReadFile(out.string()) == want) << "the file differs from the daemon's";
      fs::remove(out);
    }
    fs::remove(daemon_out);
  }
  const RunResult both = RunCli("convert-safetensors " + in.string() + " " + (dir_ / "x").string() +
                                " --layout hopper_value --device cpu --target unix:///tmp/none.sock");
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("--target"), std::string::npos) << both.err;
  ExpectOnly({"model.safetensors"});
}

// A sharded checkpoint, one pair split over two shards: every shard converted under its
// own name, and the index written for the output.
TEST_F(CliSafetensorsTest, ConvertsAShardedCheckpointAndWritesItsIndex) {
  FakeCheckpointOptions o;
  o.layers = 3;
  o.shards = 3;
  o.split_a_pair = true;
  const fs::path in = dir_ / "ckpt";
  const std::vector<FakeTensor> tensors = testing::WriteFakeCheckpoint(in.string(), o);
  const fs::path out = dir_ / "converted";
  const Layouts l = AllLayouts()[0];
  for (const fs::path& arg : {in, in / "model.safetensors.index.json"}) {
    SCOPED_TRACE(arg.string());
    const RunResult r = Convert(arg, out, l.flags + " --verify");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find(", 3 files"), std::string::npos) << r.out;
    std::map<std::string, std::vector<const FakeTensor*>> by_file;
    for (const FakeTensor& t : tensors) by_file[t.file].push_back(&t);
    ASSERT_EQ(by_file.size(), 3u);
    uint64_t total = 0;
    for (const auto& [file, list] : by_file) {
      CheckOutputFile(out / file, list, l);
      const std::vector<uint8_t> bytes = testing::ReadFile((out / file).string());
      total += bytes.size() - cli::ParseSafetensorsHeader(bytes, bytes.size())->data_offset();
    }
    const nlohmann::json index = nlohmann::json::parse(Slurp(out / "model.safetensors.index.json"), nullptr, false);
    ASSERT_TRUE(index.is_object());
    EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
    EXPECT_EQ(index["metadata"]["wprep.values.layout"], "HopperMXValueLayout(mx_axis=-2, mma_version=3)");
    ASSERT_EQ(index["weight_map"].size(), tensors.size());
    for (const FakeTensor& t : tensors) EXPECT_EQ(index["weight_map"][t.name], t.file) << t.name;
    size_t entries = 0;
    for (const auto& e : fs::directory_iterator(out)) entries += e.is_regular_file() ? 1 : 0;
    EXPECT_EQ(entries, 4u);  // three shards and the index
    fs::remove_all(out);
  }
  // An output folder with files in it is never replaced.
  fs::create_directories(out);
  Write("converted/keep.txt", {1});
  const RunResult r = Convert(in, out, l.flags);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
  EXPECT_TRUE(fs::exists(out / "keep.txt"));
}

// A file of `json` (padded to 8) followed by `data` bytes.
std::vector<uint8_t> RawFile(const std::string& json, size_t data) {
  std::string h = json;
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(static_cast<uint64_t>(h.size()) >> (8 * i)));
  bytes += h;
  bytes.append(data, '\x07');
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

TEST_F(CliSafetensorsTest, BadInputsAreOneLineExitTwoAndNoOutput) {
  FakeCheckpointOptions o;
  const fs::path good = dir_ / "good.safetensors";
  testing::WriteFakeCheckpoint(good.string(), o);
  const std::vector<uint8_t> bytes = testing::ReadFile(good.string());
  std::vector<uint8_t> absurd = bytes;
  absurd[6] = 0x7F;
  std::vector<uint8_t> bad_json = bytes;
  bad_json[9] = 'x';
  const std::string pair = R"("x_blocks":{"dtype":"U8","shape":[2,64,2,16],"data_offsets":[0,4096]},)";
  struct Case {
    std::string name;
    std::vector<uint8_t> file;
    std::string code, reason;
  };
  const std::vector<Case> cases = {
      {"truncated", std::vector<uint8_t>(bytes.begin(), bytes.end() - 100), "INVALID_ARGUMENT", "out of range"},
      {"truncated_header", std::vector<uint8_t>(bytes.begin(), bytes.begin() + 100), "INVALID_ARGUMENT", "truncated"},
      {"absurd", absurd, "INVALID_ARGUMENT", "absurd"},
      {"bad_json", bad_json, "INVALID_ARGUMENT", "bad header JSON"},
      {"out_of_range", RawFile(R"({"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}})", 32), "INVALID_ARGUMENT",
       "offsets out of range"},
      {"overlapping",
       RawFile(R"({"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},"b":{"dtype":"U8","shape":[64],"data_offsets":[32,96]}})",
               96),
       "INVALID_ARGUMENT", "overlapping tensors"},
      {"dtype", RawFile(R"({"x_blocks":{"dtype":"BF16","shape":[2,64,2,16],"data_offsets":[0,8192]},)"
                        R"("x_scales":{"dtype":"U8","shape":[2,64,2],"data_offsets":[8192,8448]}})",
                        8448),
       "INVALID_ARGUMENT", "unsupported dtype: 'x_blocks' is BF16"},
      {"unknown_dtype", RawFile(R"({"a":{"dtype":"Q4","shape":[64],"data_offsets":[0,64]}})", 64), "INVALID_ARGUMENT",
       "unsupported dtype 'Q4'"},
      {"mismatch", RawFile(absl::StrCat("{", pair, R"("x_scales":{"dtype":"U8","shape":[2,64,3],"data_offsets":[4096,4480]}})"), 4480),
       "INVALID_ARGUMENT", "shape mismatch: 'x_blocks' [2, 64, 2, 16] and 'x_scales' [2, 64, 3]"},
      {"unpaired", RawFile(absl::StrCat("{", pair.substr(0, pair.size() - 1), "}"), 4096), "INVALID_ARGUMENT",
       "'x_blocks' has no 'x_scales'"},
      {"nothing", RawFile(R"({"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}})", 64), "FAILED_PRECONDITION",
       "no MXFP4 tensors"},
  };
  std::vector<std::string> inputs = {"good.safetensors"};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path in = Write(c.name + ".safetensors", c.file);
    inputs.push_back(in.filename().string());
    const RunResult r = Convert(in, dir_ / "out.safetensors", "--layout hopper_value");
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_EQ(r.err.rfind(c.code + ": ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.reason), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "out.safetensors"));
  }
  // A file that is not there, a folder without an index, usage errors.
  RunResult r = Convert(dir_ / "missing.safetensors", dir_ / "out.safetensors", "--layout hopper_value");
  EXPECT_EQ(r.err.rfind("NOT_FOUND: cannot open", 0), 0u) << r.err;
  fs::create_directories(dir_ / "empty");
  inputs.push_back("empty");
  r = Convert(dir_ / "empty", dir_ / "out", "--layout hopper_value");
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
  r = Convert(good, dir_ / "out.safetensors", "--layout hopper_scale");
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: --layout names the value layout", 0), 0u) << r.err;
  r = RunCli("convert-safetensors " + good.string() + " --layout hopper_value");
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
  EXPECT_EQ(r.exit_code, 2);
  // No daemon.
  r = RunCli("convert-safetensors " + good.string() + " " + (dir_ / "out.safetensors").string() +
             " --layout hopper_value --target unix://" + (dir_ / "nobody.sock").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("UNAVAILABLE: no wprepd answers at unix://", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  ExpectOnly(inputs);
}

// The daemon's own refusal (parameters its layout cannot take) ends the run the same way.
TEST_F(CliSafetensorsTest, ADaemonRefusalNamesTheTensor) {
  const std::string json = R"({"x_blocks":{"dtype":"U8","shape":[1,4,1,16],"data_offsets":[0,64]},)"
                           R"("x_scales":{"dtype":"U8","shape":[1,4,1],"data_offsets":[64,68]}})";
  const fs::path in = Write("small.safetensors", RawFile(json, 68));
  const RunResult r = Convert(in, dir_ / "out.safetensors", "--layout blackwell_shuffled_value --block-k 7");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: x_blocks: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("block_k"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out.safetensors"));
  ExpectOnly({"small.safetensors"});
}

}  // namespace
}  // namespace wprep
