// The `wprep` binary as a user runs it: real files, real exit codes, real output.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli_runner.h"
#include "golden.h"
#include "wprep/kernels/cuda_engine.h"

namespace wprep {
namespace {

TEST_F(CliTest, LocalConvertWritesTheReferenceBytesAndPrintsShape) {
  const auto& c = FindCase("hopper_swizzle_130x66_mx2_mma3");
  const fs::path in = Write("in.bin", testing::SplitMix64Bytes(c.input_seed, c.input_bytes));
  const fs::path out = dir_ / "out.bin";
  const RunResult r = RunCli("convert --local --layout hopper_value --direction swizzle --shape 130,66 "
                          "--mx-axis -2 --mma-version 3 --input " + in.string() + " --output " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(testing::Sha256Hex(testing::ReadFile(out.string())), c.output_sha256);
  EXPECT_NE(r.out.find("output_shape [512, 64] output_strides [1, 512]"), std::string::npos) << r.out;
}

// Every scale and checkpoint-order reference case through `wprep convert --local`, with
// the flags a user would type (--num-warps, --packing-axis, --input-strides).
TEST_F(CliTest, LocalConvertMatchesEveryScaleAndPackingCase) {
  int converted = 0, refused = 0;
  for (testing::GoldenSet set : {testing::GoldenSet::kScales, testing::GoldenSet::kPacking}) {
    for (const auto& c : testing::GoldenCases(set)) {
      SCOPED_TRACE(c.name);
      const fs::path in = Write("in.bin", c.error ? std::vector<uint8_t>() : testing::GoldenInput(c));
      const fs::path out = dir_ / "out.bin";
      const RunResult r = RunCli("convert --local " + ConvertFlagsFor(c) + " --input " + in.string() +
                                 " --output " + out.string());
      if (c.error) {
        EXPECT_EQ(r.exit_code, 2) << r.out;
        EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
        ++refused;
        continue;
      }
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_EQ(testing::Sha256Hex(testing::ReadFile(out.string())), c.output_sha256);
      ++converted;
    }
  }
  EXPECT_GT(converted, 150);
}

void RoundTrip(CliTest* t, const std::string& device) {
  const auto x = testing::RandomBytes(3 * 258 * 65, 42);
  const fs::path in = t->Write("x.bin", x);
  struct Variant {
    std::string layout, params, back_params;
  };
  for (const Variant& v : std::vector<Variant>{
           {"hopper_value", "--mx-axis -1 --mma-version 2", "--mx-axis -1 --mma-version 2"},
           {"hopper_value", "--mx-axis=-2", "--mx-axis=-2"},
           {"blackwell_shuffled_value", "--block-k 64 --block-n 64", "--block-k 128 --block-n 256"}}) {
    const std::string stored = (t->dir_ / "stored.bin").string(), back = (t->dir_ / "back.bin").string();
    const std::string common = "--layout " + v.layout + " --shape 3,258,130 --device " + device;
    RunResult r = t->RunCli("convert --local " + common + " --direction swizzle " + v.params +
                         " --input " + in.string() + " --output " + stored);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    if (v.layout == "blackwell_shuffled_value") {
      // Go through a retile to the second tiling first.
      const std::string retiled = (t->dir_ / "retiled.bin").string();
      r = t->RunCli("convert --local " + common + " --direction retile " + v.params +
                 " --to-block-k 128 --to-block-n 256 --input " + stored + " --output " + retiled);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      fs::rename(retiled, stored);
    }
    r = t->RunCli("convert --local " + common + " --direction unswizzle " + v.back_params +
               " --input " + stored + " --output " + back);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(testing::ReadFile(back), x) << v.layout << " " << v.params;
  }
}

TEST_F(CliTest, LocalRoundTripOnCpu) { RoundTrip(this, "cpu"); }

TEST_F(CliTest, GpuLocalRoundTrip) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  RoundTrip(this, "cuda:0");
}

TEST_F(CliTest, BadInputExitsTwoWithOneInvalidArgumentLineAndNoOutput) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(256 * 128, 7));
  const std::string io = " --input " + in.string() + " --output " + (dir_ / "out.bin").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--layout hopper_value --direction swizzle --shape 256,3", "even size, got 3"},
      {"--layout ampere --direction swizzle --shape 256,256", "unknown layout 'ampere'"},
      {"--layout hopper_value --direction swizzle --shape 256,256 --mx-axis 0", "mx_axis must be -1 or -2, got 0"},
      {"--layout hopper_value --direction swizzle --shape 256,256 --mma-version 5", "mma_version must be 2 or 3"},
      {"--layout blackwell_shuffled_value --direction swizzle --shape 256,256 --block-k 7", "block_k"},
      {"--layout hopper_value --direction swizzle --shape 128,256", "needs exactly 16384 bytes"},
      {"--layout hopper_value --direction swizzle --shape 256,x", "--shape must be comma-separated"},
      {"--layout hopper_value --direction swizzle --shape -2,256", "must be >= 0, got -2"},
      {"--layout hopper_value --direction sideways --shape 256,256", "unknown direction"},
      {"--layout hopper_value --direction swizzle --shape 256,256 --bogus 1", "unknown flag --bogus"},
      {"--layout hopper_value --direction swizzle --shape 256,256 --device gpu7", "--device must be cpu or cuda:N"},
      {"--layout blackwell_shuffled_value --direction retile --shape 256,256", "retile needs --to-block-k"},
  };
  for (const auto& [flags, reason] : cases) {
    const RunResult r = RunCli("convert --local " + flags + io);
    EXPECT_EQ(r.exit_code, 2) << flags;
    EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << flags << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(reason), std::string::npos) << flags << ": " << r.err;
    EXPECT_FALSE(fs::exists(dir_ / "out.bin")) << flags;
  }
}

TEST_F(CliTest, MissingInputFileIsNotFound) {
  const RunResult r = RunCli("convert --local --layout hopper_value --direction swizzle --shape 256,256 "
                          "--input /nonexistent/x --output " + (dir_ / "o").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("NOT_FOUND: ", 0), 0u) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "o"));
}

}  // namespace
}  // namespace wprep
