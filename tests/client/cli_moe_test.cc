// `wprep moe --local`: the trtllm-gen reference cases through the real binary, byte for
// byte, and the exit-2 contract on bad input (one INVALID_ARGUMENT line, no output file).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "moe_cli_cases.h"
#include "moe_golden.h"
#include "wprep/kernels/cuda_engine.h"

namespace wprep {
namespace {

using testing::MoeGoldenCase;
using testing::MoeGoldenCases;

class CliMoeTest : public CliTest {};

TEST_F(CliMoeTest, LocalMatchesEveryReferenceCase) {
  int ran = 0, rejected = 0;
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    SCOPED_TRACE(c.set + "/" + c.name);
    const RunResult r = RunCli("moe --local " + testing::MoeCaseFlags(*this, c));
    testing::ExpectMoeCaseOutcome(*this, c, r);
    ++(c.error ? rejected : ran);
  }
  // 34 + 47 cases: the manifests were read whole.
  EXPECT_EQ(ran + rejected, 81);
  EXPECT_EQ(rejected, 27);
}

TEST_F(CliMoeTest, LocalOnTheGpuMatchesEveryReferenceCase) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU";
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    SCOPED_TRACE(c.set + "/" + c.name);
    const RunResult r = RunCli("moe --local --device cuda:0 " + testing::MoeCaseFlags(*this, c));
    testing::ExpectMoeCaseOutcome(*this, c, r);
  }
}

// A prepare_w13 case whose files the bad-input tests start from.
const MoeGoldenCase& W13Case() {
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (c.name == "prepare_w13_e2_i96_h160") return c;
  }
  ADD_FAILURE() << "no case prepare_w13_e2_i96_h160";
  std::abort();
}

void ExpectRejected(CliTest& t, const RunResult& r, const std::string& mentions) {
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  EXPECT_NE(r.err.find(mentions), std::string::npos) << "the message names " << mentions << ": " << r.err;
  for (const char* name : {"values.out", "scales.out", "bias.out", "values.out.wprep-tmp", "bias.out.wprep-tmp"}) {
    EXPECT_FALSE(std::filesystem::exists(t.dir_ / name)) << name;
  }
}

TEST_F(CliMoeTest, BadInputIsOneInvalidArgumentLineAndNoOutputFile) {
  const MoeGoldenCase& c = W13Case();
  const std::string good = testing::MoeCaseFlags(*this, c);
  // Each of these breaks one thing of a case that runs; the last --input/--output wins
  // nothing: names may be given once.
  const std::string values = (dir_ / "values.in").string(), scales = (dir_ / "scales.in").string(),
                    bias = (dir_ / "bias.in").string(), out = (dir_ / "values.out").string();
  const std::string io_scales_bias = " --input scales:uint8:2,192,5=" + scales + " --input bias:float32:2,192=" + bias;
  struct Bad {
    std::string flags, mentions;
  };
  const std::vector<Bad> bad = {
      // A file one byte short of its shape.
      {"--op prepare_w13 --param align=256 --input values:uint8:2,192,81=" + values + io_scales_bias +
           " --output values=" + out,
       "values"},
      // An output the op does not write.
      {good + " --output y=" + (dir_ / "y.out").string(), "'y'"},
      // An unknown op, dtype, param, and a malformed value.
      {"--op shuffle_everything --input x:uint8:4=" + values + " --output y=" + out, "--op"},
      {"--op prepare_w13 --input values:int4:2,192,80=" + values + io_scales_bias + " --output values=" + out,
       "int4"},
      {"--op prepare_w13 --param colour=blue --input values:uint8:2,192,80=" + values + io_scales_bias +
           " --output values=" + out,
       "colour"},
      {"--op prepare_w13 --param align=two --input values:uint8:2,192,80=" + values + io_scales_bias +
           " --output values=" + out,
       "align"},
      // Shapes that disagree (the engine's check), and an input file that does not exist.
      {"--op prepare_w13 --param align=256 --input values:uint8:2,192,80=" + values +
           " --input scales:uint8:2,192,4=" + scales + " --input bias:float32:2,192=" + bias + " --output values=" + out,
       "scales"},
      {"--op prepare_w13 --param align=256 --input values:uint8:2,192,80=" + (dir_ / "missing.in").string() +
           io_scales_bias + " --output values=" + out,
       "missing.in"},
      // The same input twice, no output, both --local and --target.
      {"--op prepare_w13 --input values:uint8:2,192,80=" + values + " --input values:uint8:2,192,80=" + values +
           " --output values=" + out,
       "values"},
      {"--op prepare_w13 --param align=256 --input values:uint8:2,192,80=" + values + io_scales_bias, "--output"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.flags);
    ExpectRejected(*this, RunCli("moe --local " + b.flags), b.mentions);
  }
  ExpectRejected(*this, RunCli("moe --local --target unix:///nowhere " + good), "--local");
  ExpectRejected(*this, RunCli("moe --local --device tpu:0 " + good), "--device");
}

// A bad output later in the list: nothing at all is written, not even the outputs before it.
TEST_F(CliMoeTest, AnUnwritableOutputLeavesNoOtherOutput) {
  const MoeGoldenCase& c = W13Case();
  std::string flags = testing::MoeCaseFlags(*this, c);
  const std::string bias_out = (dir_ / "bias.out").string();
  flags.replace(flags.find(bias_out), bias_out.size(), (dir_ / "no_such_dir" / "bias.out").string());
  const RunResult r = RunCli("moe --local " + flags);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string().find(".out"), std::string::npos) << e.path();
  }
}

TEST_F(CliMoeTest, HelpNamesTheInterfaceAndTheTopLevelUsageListsMoe) {
  const RunResult r = RunCli("moe --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* s : {"--op", "--param KEY=VALUE", "--input NAME:DTYPE:D0,D1,...=PATH", "--output NAME=PATH",
                        "prepare_w13", "epilogue_tile_m", "num_elts_per_sf", "bfloat16"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
  const RunResult top = RunCli("--help");
  EXPECT_NE(top.out.find("  moe "), std::string::npos) << top.out;
}

}  // namespace
}  // namespace wprep
