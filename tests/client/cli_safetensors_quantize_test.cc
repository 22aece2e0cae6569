// `wprep convert-safetensors --quantize` as a user runs it: checkpoints the test writes
// (its own header writer) hold the golden_quant reference inputs among other tensors; each
// chosen tensor must come out as the gpt-oss pair NAME_blocks / NAME_scales holding exactly
// the reference values and scales (or, for F16/F32, exactly what `wprep quantize` writes for
// the same bytes), every other tensor byte-identical, and the metadata must say what was
// done. The quantized checkpoint then converts with --layout through a real wprepd into
// the bytes of the fused `wprep quantize --layout`. Refusals: exit 2, one line, no output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli_runner.h"
#include "daemon_harness.h"
#include "golden.h"
#include "nlohmann/json.hpp"
#include "safetensors.h"
#include "shared_daemon.h"
#include "wprep/kernels/cuda_engine.h"

namespace wprep {
namespace {

std::vector<uint8_t> Bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

struct Tensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A safetensors file of `tensors` in order, with __metadata__ {"format": "pt"}: JSON
// padded with spaces to 8 bytes, as the format's reference implementation writes it.
std::vector<uint8_t> SafetensorsFile(const std::vector<Tensor>& tensors) {
  nlohmann::ordered_json h;
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t at = 0;
  for (const Tensor& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string json = h.dump();
  while (json.size() % 8 != 0) json.push_back(' ');
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(json.size()) >> (8 * i)));
  out.insert(out.end(), json.begin(), json.end());
  for (const Tensor& t : tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

// Finite float16 / float32 weights (no NaN or infinity bit patterns): the exponent field
// kept below all-ones.
std::vector<uint8_t> FiniteHalf(size_t count, uint32_t seed) {
  std::vector<uint8_t> v = testing::RandomBytes(2 * count, seed);
  for (size_t i = 1; i < v.size(); i += 2) v[i] &= 0xBB;
  return v;
}
std::vector<uint8_t> FiniteFloat(size_t count, uint32_t seed) {
  std::vector<uint8_t> v = testing::RandomBytes(4 * count, seed);
  for (size_t i = 3; i < v.size(); i += 4) v[i] &= 0xBF;
  return v;
}

struct Output {
  cli::SafetensorsHeader header;
  std::vector<uint8_t> file;
  std::map<std::string, std::string> meta;
  std::map<std::string, const cli::SafetensorsTensor*> tensors;

  std::vector<uint8_t> Data(const std::string& name) const {
    const cli::SafetensorsTensor& t = *tensors.at(name);
    return std::vector<uint8_t>(file.begin() + static_cast<std::ptrdiff_t>(header.data_offset() + t.begin),
                                file.begin() + static_cast<std::ptrdiff_t>(header.data_offset() + t.end));
  }
};

Output ReadOutput(const fs::path& p) {
  Output o;
  o.file = Bytes(p);
  absl::StatusOr<cli::SafetensorsHeader> h = cli::ParseSafetensorsHeader(o.file, o.file.size());
  EXPECT_TRUE(h.ok()) << h.status();
  if (!h.ok()) return o;
  o.header = *std::move(h);
  o.meta.insert(o.header.metadata.begin(), o.header.metadata.end());
  for (const cli::SafetensorsTensor& t : o.header.tensors) o.tensors[t.name] = &t;
  return o;
}

std::vector<int64_t> Grouped(std::vector<int64_t> shape, bool blocks) {
  shape.back() /= 32;
  if (blocks) shape.push_back(16);
  return shape;
}

class CliSafetensorsQuantizeTest : public testing::SharedDaemonTest<CliSafetensorsQuantizeTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--devices=cpu", "--cpu-threads=2"}); }

  // No daemon is asked: the target is a socket nobody listens on.
  RunResult Quantize(const fs::path& in, const fs::path& out, const std::string& flags) {
    return RunCli("convert-safetensors " + in.string() + " " + out.string() + " --target unix://" +
                  (dir_ / "nobody.sock").string() + " " + flags);
  }

  // `wprep quantize --local` of `t`'s bytes: values and scales files.
  std::pair<std::vector<uint8_t>, std::vector<uint8_t>> QuantizeCli(const Tensor& t, const std::string& flags) {
    const fs::path in = Write("q.in", t.bytes);
    const std::string dtype = t.dtype == "BF16" ? "bfloat16" : t.dtype == "F16" ? "float16" : "float32";
    const RunResult r = RunCli("quantize --local --dtype " + dtype + " --shape " + absl::StrJoin(t.shape, ",") +
                               " --input " + in.string() + " --values-output " + (dir_ / "q.v").string() +
                               " --scales-output " + (dir_ / "q.s").string() + " " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return {Bytes(dir_ / "q.v"), Bytes(dir_ / "q.s")};
  }

  // The body of FusedLayoutEqualsQuantizeThenConvert for one --layout (and its flags).
  void FusedLayoutEqualsQuantizeThenConvert(const std::string& layout, const std::string& extra);
};

struct Golden {
  Tensor input;
  std::vector<uint8_t> values, scales;
  std::string rounding;
};

std::vector<Golden> GoldenCases() {
  const std::string dir = testing::TestDataDir("golden_quant") + "/";
  std::ifstream mf(dir + "manifest.json");
  EXPECT_TRUE(mf.good());
  const nlohmann::json manifest = nlohmann::json::parse(mf);
  std::vector<Golden> out;
  for (const auto& c : manifest["cases"]) {
    EXPECT_EQ(c["input_dtype"], "bfloat16");
    Golden g;
    g.input.name = "g." + c["name"].get<std::string>() + ".weight";
    g.input.dtype = "BF16";
    g.input.shape = c["input_shape"].get<std::vector<int64_t>>();
    g.input.bytes = Bytes(dir + c["input"].get<std::string>());
    g.values = Bytes(dir + c["values"].get<std::string>());
    g.scales = Bytes(dir + c["scales"].get<std::string>());
    g.rounding = c["params"]["scale_rounding"].get<std::string>();
    out.push_back(std::move(g));
  }
  EXPECT_EQ(out.size(), 40u);
  return out;
}

// Every golden case in one checkpoint among tensors that stay; two runs, one per rounding,
// each choosing its cases by pattern (the other rounding's cases are then copied).
TEST_F(CliSafetensorsQuantizeTest, QuantizesChosenTensorsToTheGoldenVectors) {
  const std::vector<Golden> golden = GoldenCases();
  std::vector<Tensor> tensors;
  tensors.push_back({"embed.weight", "BF16", {8, 32}, testing::RandomBytes(512, 1)});
  for (const Golden& g : golden) tensors.push_back(g.input);
  tensors.push_back({"h.weight", "F16", {3, 64}, FiniteHalf(192, 2)});
  tensors.push_back({"f.weight", "F32", {2, 2, 96}, FiniteFloat(384, 3)});
  tensors.push_back({"router.bias", "BF16", {7}, testing::RandomBytes(14, 4)});
  tensors.push_back({"ids", "I32", {3}, testing::RandomBytes(12, 5)});
  const fs::path in = Write("model.safetensors", SafetensorsFile(tensors));

  for (const std::string rounding : {"up", "down"}) {
    SCOPED_TRACE(rounding);
    const fs::path out = dir_ / ("out_" + rounding + ".safetensors");
    // ';' and ',' both separate; a tensor two patterns name is quantized once.
    const std::string flags = absl::StrCat("--quantize 'g.*_", rounding, ".weight;g.quant_1x32_*_", rounding,
                                           ".weight,?.weight' --progress lines",
                                           // Down: in pieces of one row.
                                           rounding == "down" ? " --scale-rounding down --piece-bytes 1000" : "");
    const RunResult r = Quantize(in, out, flags);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    // 20 golden cases, h.weight and f.weight.
    EXPECT_EQ(r.out.rfind(absl::StrCat("quantized 22 tensors (scales rounded ", rounding, ") and copied ",
                                       tensors.size() - 22, ", 1 file"),
                          0),
              0u)
        << r.out;
    const Output o = ReadOutput(out);
    EXPECT_EQ(o.header.tensors.size(), tensors.size() + 22);
    EXPECT_EQ(o.meta.at("format"), "pt");
    EXPECT_EQ(o.meta.at("wprep.quantize.scale_rounding"), rounding);
    // Still a checkpoint to convert: no contract version.
    EXPECT_FALSE(o.meta.count("wprep.contract_version"));
    int quantized = 0;
    for (const Tensor& t : tensors) {
      SCOPED_TRACE(t.name);
      const auto g = std::find_if(golden.begin(), golden.end(), [&](const Golden& x) { return x.input.name == t.name; });
      const bool chosen = (g != golden.end() && g->rounding == rounding) || t.name == "h.weight" || t.name == "f.weight";
      if (!chosen) {
        ASSERT_TRUE(o.tensors.count(t.name));
        EXPECT_EQ(std::string(cli::DtypeName(o.tensors.at(t.name)->dtype)), t.dtype);
        EXPECT_EQ(o.tensors.at(t.name)->shape, t.shape);
        EXPECT_TRUE(o.Data(t.name) == t.bytes) << "a copied tensor changed";
        EXPECT_FALSE(o.meta.count("wprep.quantized." + t.name));
        continue;
      }
      ++quantized;
      EXPECT_FALSE(o.tensors.count(t.name));
      const std::string blocks = t.name + "_blocks", scales = t.name + "_scales";
      ASSERT_TRUE(o.tensors.count(blocks));
      ASSERT_TRUE(o.tensors.count(scales));
      EXPECT_EQ(o.tensors.at(blocks)->dtype, cli::Dtype::kU8);
      EXPECT_EQ(o.tensors.at(scales)->dtype, cli::Dtype::kU8);
      EXPECT_EQ(o.tensors.at(blocks)->shape, Grouped(t.shape, true));
      EXPECT_EQ(o.tensors.at(scales)->shape, Grouped(t.shape, false));
      if (g != golden.end()) {
        EXPECT_TRUE(o.Data(blocks) == g->values) << "values differ from the golden vector";
        EXPECT_TRUE(o.Data(scales) == g->scales) << "scales differ from the golden vector";
      } else {
        const auto [values, s] = QuantizeCli(t, "--scale-rounding " + rounding);
        EXPECT_TRUE(o.Data(blocks) == values) << "values differ from wprep quantize's";
        EXPECT_TRUE(o.Data(scales) == s) << "scales differ from wprep quantize's";
      }
      const nlohmann::json j = nlohmann::json::parse(o.meta.at("wprep.quantized." + t.name), nullptr, false);
      ASSERT_TRUE(j.is_object());
      EXPECT_EQ(j["format"], "mxfp4");
      EXPECT_EQ(j["blocks"], blocks);
      EXPECT_EQ(j["scales"], scales);
      EXPECT_EQ(j["scale_rounding"], rounding);
      EXPECT_EQ(j["checkpoint_dtype"], t.dtype);
      EXPECT_EQ(j["checkpoint_shape"].get<std::vector<int64_t>>(), t.shape);
      EXPECT_EQ(j["blocks_shape"].get<std::vector<int64_t>>(), Grouped(t.shape, true));
      EXPECT_EQ(j["scales_shape"].get<std::vector<int64_t>>(), Grouped(t.shape, false));
    }
    EXPECT_EQ(quantized, 22);
  }
}

// The golden cases quantized on the GPU (--device cuda:0), in pieces of a few rows.
TEST_F(CliSafetensorsQuantizeTest, GoldenVectorsOnTheGpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<Golden> golden = GoldenCases();
  std::vector<Tensor> tensors;
  for (const Golden& g : golden) tensors.push_back(g.input);
  const fs::path in = Write("model.safetensors", SafetensorsFile(tensors));
  for (const std::string rounding : {"up", "down"}) {
    SCOPED_TRACE(rounding);
    const fs::path out = dir_ / ("out_" + rounding + ".safetensors");
    const RunResult r = Quantize(in, out, "--device cuda:0 --piece-bytes 5000 --quantize 'g.*_" + rounding +
                                              ".weight' --scale-rounding " + rounding);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const Output o = ReadOutput(out);
    for (const Golden& g : golden) {
      if (g.rounding != rounding) continue;
      SCOPED_TRACE(g.input.name);
      EXPECT_TRUE(o.Data(g.input.name + "_blocks") == g.values);
      EXPECT_TRUE(o.Data(g.input.name + "_scales") == g.scales);
    }
  }
}

// The quantized checkpoint is a gpt-oss one: --layout converts its new pairs through the
// daemon into exactly what the fused `wprep quantize --layout L` writes. And --quantize with
// --layout in one run (fused, beside a pair the daemon converts) writes the same checkpoint as
// the two runs: every tensor and every metadata entry. For the Blackwell pair and the Hopper
// pair and the shuffled Blackwell pair (non-default parameters, and pieces of one matrix each).
TEST_F(CliSafetensorsQuantizeTest, FusedLayoutEqualsQuantizeThenConvert) {
  for (const std::string layout : {"blackwell_value", "hopper_value --mma-version 2 --num-warps 4 --align-k 4",
                                   "blackwell_shuffled_value --block-k 64 --block-n 48"}) {
    SCOPED_TRACE(layout);
    FusedLayoutEqualsQuantizeThenConvert(layout, layout == "blackwell_value" ? "" : " --piece-bytes 40000");
  }
}

void CliSafetensorsQuantizeTest::FusedLayoutEqualsQuantizeThenConvert(const std::string& layout,
                                                                      const std::string& extra) {
  for (const char* name : {"q.safetensors", "two.safetensors", "fused.safetensors", "alone.safetensors"}) {
    fs::remove_all(dir_ / name);
  }
  std::vector<Tensor> tensors = {
      {"experts.gate_up_proj", "BF16", {2, 64, 256}, testing::RandomBytes(2 * 64 * 256 * 2, 7)},
      {"experts.down_proj", "BF16", {2, 32, 128}, testing::RandomBytes(2 * 32 * 128 * 2, 8)},
      {"norm.weight", "BF16", {32}, testing::RandomBytes(64, 9)},
  };
  for (Tensor& t : tensors) {
    for (size_t i = 1; i < t.bytes.size(); i += 2) t.bytes[i] &= 0xBF;  // finite bf16
  }
  const fs::path plain = Write("plain.safetensors", SafetensorsFile(tensors));
  tensors.push_back({"moe.w_blocks", "U8", {2, 64, 4, 16}, testing::RandomBytes(2 * 64 * 4 * 16, 10)});
  tensors.push_back({"moe.w_scales", "U8", {2, 64, 4}, testing::RandomBytes(2 * 64 * 4, 11)});
  const fs::path in = Write("model.safetensors", SafetensorsFile(tensors));
  const std::string daemon = " --target " + daemon_->unix_target();
  const fs::path q = dir_ / "q.safetensors", two = dir_ / "two.safetensors", fused = dir_ / "fused.safetensors";

  RunResult r = Quantize(in, q, "--quantize 'experts.*'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli("convert-safetensors " + q.string() + " " + two.string() + daemon + " --layout " + layout);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("converted 6 tensors and copied 1", 0), 0u) << r.out;
  r = RunCli("convert-safetensors " + in.string() + " " + fused.string() + daemon + " --layout " + layout +
             " --quantize 'experts.*'" + extra);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("quantized 2 tensors (scales rounded up) into the layouts, converted 2 tensors and copied 1", 0),
            0u)
      << r.out;

  const Output a = ReadOutput(two), b = ReadOutput(fused);
  EXPECT_TRUE(a.meta.count("wprep.quantized.experts.down_proj"));  // carried through the conversion
  EXPECT_TRUE(a.meta.count("wprep.contract_version"));
  EXPECT_EQ(a.meta, b.meta);
  ASSERT_EQ(a.tensors.size(), 7u);
  ASSERT_EQ(b.tensors.size(), 7u);
  for (const auto& [name, t] : a.tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(b.tensors.count(name));
    EXPECT_EQ(b.tensors.at(name)->dtype, t->dtype);
    EXPECT_EQ(b.tensors.at(name)->shape, t->shape);
    EXPECT_TRUE(a.Data(name) == b.Data(name)) << "fused bytes differ from quantize-then-convert";
  }
  for (const Tensor& t : tensors) {
    SCOPED_TRACE(t.name);
    if (!absl::StartsWith(t.name, "experts.")) continue;
    const auto [values, scales] = QuantizeCli(t, "--layout " + layout);
    EXPECT_TRUE(a.Data(t.name + "_blocks") == values) << "differs from the fused quantize";
    EXPECT_TRUE(a.Data(t.name + "_scales") == scales) << "differs from the fused quantize";
  }

  // Nothing for the daemon to convert: no daemon asked, the same bytes.
  const fs::path alone = dir_ / "alone.safetensors";
  r = Quantize(plain, alone, "--layout " + layout + " --quantize 'experts.*'" + extra);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Output c = ReadOutput(alone);
  ASSERT_EQ(c.tensors.size(), 5u);
  for (const auto& [name, t] : c.tensors) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(c.Data(name) == a.Data(name));
    if (name == "norm.weight") continue;
    ASSERT_TRUE(c.meta.count("wprep.tensor." + name));
    EXPECT_EQ(c.meta.at("wprep.tensor." + name), a.meta.at("wprep.tensor." + name)) << "recorded differently";
  }
}

// A sharded checkpoint: each pair stays in its tensor's shard and the index maps it there.
TEST_F(CliSafetensorsQuantizeTest, ShardedIndexMapsThePairs) {
  fs::create_directories(dir_ / "in");
  const Tensor a{"a.weight", "BF16", {4, 64}, testing::RandomBytes(512, 10)};
  const Tensor b{"b.weight", "BF16", {2, 32}, testing::RandomBytes(128, 11)};
  Write("in/s1.safetensors", SafetensorsFile({a}));
  Write("in/s2.safetensors", SafetensorsFile({b}));
  const std::string index =
      R"({"metadata":{"total_size":640},"weight_map":{"a.weight":"s1.safetensors","b.weight":"s2.safetensors"}})";
  Write("in/model.safetensors.index.json", std::vector<uint8_t>(index.begin(), index.end()));
  const RunResult r = Quantize(dir_ / "in", dir_ / "out", "--quantize b.weight");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(dir_ / "out" / "model.safetensors.index.json");
  const nlohmann::json doc = nlohmann::json::parse(f, nullptr, false);
  ASSERT_TRUE(doc.is_object());
  const nlohmann::json& wm = doc["weight_map"];
  EXPECT_EQ(wm.size(), 3u);
  EXPECT_EQ(wm["a.weight"], "s1.safetensors");
  EXPECT_EQ(wm["b.weight_blocks"], "s2.safetensors");
  EXPECT_EQ(wm["b.weight_scales"], "s2.safetensors");
  EXPECT_EQ(doc["metadata"]["total_size"], 512 + 2 * 16 + 2);
  EXPECT_EQ(doc["metadata"]["wprep.quantize.patterns"], "b.weight");
  EXPECT_TRUE(ReadOutput(dir_ / "out" / "s1.safetensors").Data("a.weight") == a.bytes);
  const Output o = ReadOutput(dir_ / "out" / "s2.safetensors");
  EXPECT_EQ(o.header.tensors.size(), 2u);
  EXPECT_TRUE(o.tensors.count("b.weight_blocks"));
}

TEST_F(CliSafetensorsQuantizeTest, RefusalsAreOneLineExitTwoAndNoOutput) {
  const std::vector<Tensor> tensors = {
      {"w.weight", "BF16", {2, 64}, testing::RandomBytes(256, 12)},
      {"ids", "U8", {2, 32}, testing::RandomBytes(64, 13)},
      {"empty.weight", "BF16", {4, 0}, {}},
      {"odd.weight", "BF16", {2, 48}, testing::RandomBytes(192, 14)},
      {"scalar", "F32", {}, testing::RandomBytes(4, 15)},
      {"d.weight", "F64", {1, 32}, testing::RandomBytes(256, 16)},
      {"taken", "BF16", {1, 32}, testing::RandomBytes(64, 17)},
      {"taken_scales", "U8", {1, 1}, testing::RandomBytes(1, 18)},
      {"vec", "BF16", {64}, testing::RandomBytes(128, 19)},
  };
  const fs::path in = Write("model.safetensors", SafetensorsFile(tensors));
  const std::string unknown_json = R"({"a":{"dtype":"Q4","shape":[64],"data_offsets":[0,64]}})";
  std::vector<uint8_t> unknown;
  std::string h = unknown_json;
  while (h.size() % 8 != 0) h.push_back(' ');
  for (int i = 0; i < 8; ++i) unknown.push_back(static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i)));
  unknown.insert(unknown.end(), h.begin(), h.end());
  unknown.resize(unknown.size() + 64, 0);
  const fs::path bad_dtype = Write("unknown.safetensors", unknown);
  struct Case {
    fs::path in;
    std::string flags, code, reason;
  };
  const std::vector<Case> cases = {
      {in, "--quantize ids", "INVALID_ARGUMENT", "--quantize: 'ids' is U8; only BF16, F16 and F32 tensors quantize"},
      {in, "--quantize '*'", "INVALID_ARGUMENT", "'ids' is U8"},
      {in, "--quantize d.weight", "INVALID_ARGUMENT", "'d.weight' is F64"},
      {in, "--quantize empty.weight", "INVALID_ARGUMENT", "'empty.weight' has shape [4, 0]; its last dim must be"},
      {in, "--quantize odd.weight", "INVALID_ARGUMENT", "multiple of 32"},
      {in, "--quantize scalar", "INVALID_ARGUMENT", "'scalar' is a scalar"},
      {in, "--quantize taken", "INVALID_ARGUMENT", "would become 'taken_scales'"},
      {in, "--quantize 'w.weight;nothing.*'", "INVALID_ARGUMENT", "'nothing.*' names no tensor"},
      {in, "--quantize ';'", "INVALID_ARGUMENT", "--quantize names no pattern"},
      {bad_dtype, "--quantize a", "INVALID_ARGUMENT", "unsupported dtype 'Q4'"},
      {in, "--quantize w.weight --scale-rounding sideways", "INVALID_ARGUMENT",
       "--scale-rounding must be up or down, got 'sideways'"},
      {in, "--layout hopper_value --scale-rounding down", "INVALID_ARGUMENT", "--scale-rounding is for --quantize"},
      {in, "--quantize w.weight --verify", "INVALID_ARGUMENT", "--verify is for --layout"},
      {in, "--quantize w.weight --num-warps 4", "INVALID_ARGUMENT", "--num-warps is for --layout"},
      {in, "", "INVALID_ARGUMENT", "--layout"},
      {in, "--quantize w.weight --device gpu", "INVALID_ARGUMENT", "gpu"},
      // --device with --layout converts in this process: a daemon address is a mistake.
      {in, "--layout hopper_value --device cpu", "INVALID_ARGUMENT", "--target is for the daemon"},
      {in, "--quantize w.weight --layout hopper_value --mx-axis -1", "UNIMPLEMENTED", "run --quantize alone"},
      {in, "--quantize w.weight --layout hopper_value --scale-layout blackwell_scale", "UNIMPLEMENTED",
       "run --quantize alone"},
      {in, "--quantize w.weight --layout blackwell_shuffled_value --scale-layout hopper_scale", "UNIMPLEMENTED",
       "run --quantize alone"},
      {in, "--quantize vec --layout blackwell_value", "INVALID_ARGUMENT", "'vec' has shape [64]; quantizing into a layout"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    const RunResult r = Quantize(c.in, dir_ / "out.safetensors", c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_EQ(r.err.rfind(c.code + ": ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.reason), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "out.safetensors"));
  }
  for (const auto& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "model.safetensors" || name == "unknown.safetensors" || name == "stdout" || name == "stderr")
        << "left behind: " << name;
  }
}

}  // namespace
}  // namespace wprep
