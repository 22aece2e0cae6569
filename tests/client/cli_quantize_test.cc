// `wprep quantize --local` as a user runs it: the golden_quant reference vectors through
// the binary, and refusals (exit 2, one INVALID_ARGUMENT/UNIMPLEMENTED line, no files).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "golden.h"
#include "nlohmann/json.hpp"
#include "wprep/kernels/cuda_engine.h"

namespace wprep {
namespace {

// The data folder: $WPREP_TEST_DATA_DIR where the build tree moved (GPU bundle), else the
// source tree's.
std::string QuantDataDir() {
  const char* env = std::getenv("WPREP_TEST_DATA_DIR");
  return std::string(env != nullptr && *env != '\0' ? env : WPREP_TEST_DATA_DIR) + "/golden_quant/";
}

const std::string kQuantDir = QuantDataDir();

std::vector<uint8_t> Bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::string Join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s.push_back(',');
    s.append(std::to_string(v[i]));
  }
  return s;
}

TEST_F(CliTest, QuantizeMatchesEveryGoldenCase) {
  std::ifstream mf(kQuantDir + "manifest.json");
  ASSERT_TRUE(mf.good());
  const nlohmann::json manifest = nlohmann::json::parse(mf);
  int checked = 0;
  for (const auto& c : manifest["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
    const RunResult r = RunCli(
        "quantize --local --device cpu --dtype " + c["input_dtype"].get<std::string>() +
        " --shape " + Join(c["input_shape"].get<std::vector<int64_t>>()) + " --scale-rounding " +
        c["params"]["scale_rounding"].get<std::string>() + " --input " + kQuantDir +
        c["input"].get<std::string>() + " --values-output " + v.string() + " --scales-output " +
        s.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(Bytes(v), Bytes(kQuantDir + c["values"].get<std::string>()));
    EXPECT_EQ(Bytes(s), Bytes(kQuantDir + c["scales"].get<std::string>()));
    ++checked;
  }
  EXPECT_EQ(checked, 40);
}

TEST_F(CliTest, QuantizeRoundsScalesUpByDefault) {
  const std::string c = "quant_4x256_normal_up";
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
  const RunResult r = RunCli("quantize --local --dtype bfloat16 --shape 4,256 --input " + kQuantDir +
                             "cases/" + c + ".in.bin --values-output " + v.string() +
                             " --scales-output " + s.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Bytes(s), Bytes(kQuantDir + "cases/" + c + ".scales.bin"));
  EXPECT_NE(r.out.find("values_shape [4, 128] scales_shape [4, 8]"), std::string::npos) << r.out;
}

TEST_F(CliTest, QuantizeRefusesBadRequestsWithExit2AndNoFiles) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(2 * 4 * 64, 0));
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
  const std::string io =
      " --input " + in.string() + " --values-output " + v.string() + " --scales-output " + s.string();
  struct Bad {
    std::string flags, code, mention;
  };
  const std::vector<Bad> cases = {
      {"--local --dtype bfloat16 --shape 4,65" + io, "INVALID_ARGUMENT: ", "--input"},
      {"--local --dtype int8 --shape 4,64" + io, "INVALID_ARGUMENT: ", "dtype"},
      {"--local --dtype bfloat16 --shape 4,64 --scale-rounding even" + io, "INVALID_ARGUMENT: ",
       "scale_rounding"},
      {"--local --dtype bfloat16 --shape 4,-64" + io, "INVALID_ARGUMENT: ", "shape"},
      {"--local --dtype bfloat16" + io, "INVALID_ARGUMENT: ", "--shape"},
      {"--local --dtype bfloat16 --shape 4,64 --device tpu:0" + io, "INVALID_ARGUMENT: ", "--device"},
      {"--local --dtype bfloat16 --shape 4,64 --bogus 1" + io, "INVALID_ARGUMENT: ", "--bogus"},
      {"--dtype bfloat16 --shape 4,64" + io, "INVALID_ARGUMENT: ", "--local"},
      {"--local --target localhost:1 --dtype bfloat16 --shape 4,64" + io, "INVALID_ARGUMENT: ", "--target"},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.flags);
    const RunResult r = RunCli("quantize " + b.flags);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(r.err.rfind(b.code, 0), 0u) << r.err;
    EXPECT_NE(r.err.find(b.mention), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_FALSE(fs::exists(v));
    EXPECT_FALSE(fs::exists(s));
  }
}

// The fused Blackwell outputs (blackwell_value, and blackwell_shuffled_value with its tile)
// equal canonical quantization followed by `wprep convert`'s swizzles (values from checkpoint
// order, scales from the transposed view).
TEST_F(CliTest, QuantizeBlackwellEqualsQuantizeThenConvert) {
  const std::string in = kQuantDir + "cases/quant_2x64x1024_ties_up.in.bin";  // [2, 64, 1024]
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin", fv = dir_ / "fv.bin", fs_ = dir_ / "fs.bin";
  const fs::path wv = dir_ / "wv.bin", ws = dir_ / "ws.bin";
  RunResult r = RunCli("quantize --local --dtype bfloat16 --shape 2,64,1024 --input " + in +
                       " --values-output " + v.string() + " --scales-output " + s.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli("convert --local --layout blackwell_scale --direction swizzle --shape 2,32,64 "
             "--input-strides 2048,1,32 --input " + s.string() + " --output " + ws.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string layout : {"blackwell_value", "blackwell_shuffled_value --block-k 96 --block-n 24"}) {
    SCOPED_TRACE(layout);
    r = RunCli("convert --local --layout " + layout + " --direction swizzle --packing-axis -2 "
               "--shape 2,1024,64 --input " + v.string() + " --output " + wv.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    r = RunCli("quantize --local --layout " + layout + " --dtype bfloat16 --shape 2,64,1024 --input " + in +
               " --values-output " + fv.string() + " --scales-output " + fs_.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(Bytes(fv), Bytes(wv));
    EXPECT_EQ(Bytes(fs_), Bytes(ws));
    EXPECT_FALSE(Bytes(fv).empty());
  }
}

// The fused Hopper output (with its parameters) equals canonical quantization followed by
// `wprep convert`'s Hopper swizzles, mx axis -2 (values from checkpoint order, scales from the
// transposed view).
TEST_F(CliTest, QuantizeHopperEqualsQuantizeThenConvert) {
  const std::string in = kQuantDir + "cases/quant_2x64x1024_ties_up.in.bin";  // [2, 64, 1024]
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin", fv = dir_ / "fv.bin", fs_ = dir_ / "fs.bin";
  const fs::path wv = dir_ / "wv.bin", ws = dir_ / "ws.bin";
  RunResult r = RunCli("quantize --local --dtype bfloat16 --shape 2,64,1024 --input " + in +
                       " --values-output " + v.string() + " --scales-output " + s.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli("convert --local --layout hopper_value --direction swizzle --mx-axis -2 --mma-version 2 "
             "--packing-axis -2 --shape 2,1024,64 --input " + v.string() + " --output " + wv.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli("convert --local --layout hopper_scale --direction swizzle --mx-axis -2 --num-warps 4 --align-k 4 "
             "--shape 2,32,64 --input-strides 2048,1,32 --input " + s.string() + " --output " + ws.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli("quantize --local --layout hopper_value --mma-version 2 --num-warps 4 --align-k 4 --dtype bfloat16 "
             "--shape 2,64,1024 --input " + in + " --values-output " + fv.string() + " --scales-output " +
             fs_.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("(hopper_value)"), std::string::npos) << r.out;
  EXPECT_EQ(Bytes(fv), Bytes(wv));
  EXPECT_EQ(Bytes(fs_), Bytes(ws));
  EXPECT_FALSE(Bytes(fv).empty());
}

// The trtllm layouts, with a bias, equal canonical quantization followed by `wprep moe`'s
// MXFP4 prepare of its outputs (the MoE engine, another path through the code).
// --device cuda:0 writes the CPU engine's bytes for the trtllm layouts, the bias included.
TEST_F(CliTest, QuantizeTrtllmWithABiasOnTheGpuEqualsTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::string in = kQuantDir + "cases/quant_2x64x1024_ties_up.in.bin";  // [2, 64, 1024]
  const fs::path bias = Write("bias.bin", testing::RandomBytes(2 * 64 * 2, 6));  // bfloat16
  for (const std::string op : {"w13", "w2"}) {
    SCOPED_TRACE(op);
    std::vector<std::vector<uint8_t>> got[2];
    for (const std::string device : {"cpu", "cuda:0"}) {
      const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin", b = dir_ / "b.bin";
      const RunResult r = RunCli("quantize --local --device " + device + " --layout trtllm_" + op +
                                 " --dtype bfloat16 --shape 2,64,1024 --input " + in + " --bias-input " +
                                 bias.string() + " --bias-dtype bfloat16 --values-output " + v.string() +
                                 " --scales-output " + s.string() + " --bias-output " + b.string());
      ASSERT_EQ(r.exit_code, 0) << r.err;
      got[device == "cpu" ? 0 : 1] = {Bytes(v), Bytes(s), Bytes(b)};
    }
    EXPECT_EQ(got[1], got[0]);
    EXPECT_FALSE(got[0][2].empty());
  }
}

TEST_F(CliTest, QuantizeTrtllmEqualsQuantizeThenPrepare) {
  const std::string in = kQuantDir + "cases/quant_2x64x1024_ties_up.in.bin";  // [2, 64, 1024]
  const fs::path bias = Write("bias.bin", testing::RandomBytes(2 * 64 * 4, 5));
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
  RunResult r = RunCli("quantize --local --dtype bfloat16 --shape 2,64,1024 --input " + in + " --values-output " +
                       v.string() + " --scales-output " + s.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string op : {"w13", "w2"}) {
    SCOPED_TRACE(op);
    const fs::path wv = dir_ / "wv.bin", ws = dir_ / "ws.bin", wb = dir_ / "wb.bin";
    const fs::path fv = dir_ / "fv.bin", fs_ = dir_ / "fs.bin", fb = dir_ / "fb.bin";
    r = RunCli("moe --local --op prepare_" + op + " --param format=mxfp4 --param align=128 --input values:uint8:2,64,512=" +
               v.string() + " --input scales:uint8:2,64,32=" + s.string() + " --input bias:float32:2,64=" +
               bias.string() + " --output values=" + wv.string() + " --output scales=" + ws.string() +
               " --output bias=" + wb.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    r = RunCli("quantize --local --layout trtllm_" + op + " --align 128 --dtype bfloat16 --shape 2,64,1024 --input " +
               in + " --bias-input " + bias.string() + " --values-output " + fv.string() + " --scales-output " +
               fs_.string() + " --bias-output " + fb.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("trtllm_gen:prepare_" + op + " format=mxfp4 align=128"), std::string::npos) << r.out;
    EXPECT_EQ(Bytes(fv), Bytes(wv));
    EXPECT_EQ(Bytes(fs_), Bytes(ws));
    EXPECT_EQ(Bytes(fb), Bytes(wb));
    EXPECT_FALSE(Bytes(fb).empty());
  }
  // A bias that does not fit [E, R]: refused, no file.
  const fs::path short_bias = Write("short.bin", std::vector<uint8_t>(12, 0));
  r = RunCli("quantize --local --layout trtllm_w2 --dtype bfloat16 --shape 2,64,1024 --input " + in +
             " --bias-input " + short_bias.string() + " --values-output " + (dir_ / "x.v").string() +
             " --scales-output " + (dir_ / "x.s").string() + " --bias-output " + (dir_ / "x.b").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: --bias-input", 0), 0u) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "x.v"));
}

TEST_F(CliTest, QuantizeRefusesLayoutParametersOfAnotherLayoutOrOutOfRange) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(2 * 4 * 64, 0));
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
  // A layout's parameters without that layout, and a bad one with it: refused, no files.
  for (const std::string flags : {"--num-warps 4", "--layout hopper_value --num-warps 6",
                                  "--layout hopper_value --mma-version 4", "--block-k 64",
                                  "--layout blackwell_value --block-n 64", "--layout blackwell_shuffled_value --block-k 3",
                                  "--layout blackwell_shuffled_value --block-n 0"}) {
    const RunResult r = RunCli("quantize --local " + flags + " --dtype bfloat16 --shape 4,64 --input " +
                               in.string() + " --values-output " + v.string() + " --scales-output " + s.string());
    EXPECT_EQ(r.exit_code, 2) << flags;
    EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
    EXPECT_FALSE(fs::exists(v));
  }
  // An odd K cannot take the Blackwell value layout: refused before any file is written.
  const fs::path odd = Write("odd.bin", std::vector<uint8_t>(2 * 4 * 63, 0));
  const RunResult r = RunCli("quantize --local --layout blackwell_value --dtype bfloat16 --shape 4,63 "
                             "--input " + odd.string() + " --values-output " + v.string() +
                             " --scales-output " + s.string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
  EXPECT_FALSE(fs::exists(v));
  EXPECT_FALSE(fs::exists(s));
}

}  // namespace
}  // namespace wprep
