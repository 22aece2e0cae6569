// `wprep convert --target` against a real wprepd process: the same files and the same
// exit-2 contract as --local, with the daemon's gRPC status code on the error line.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "cli_runner.h"
#include "daemon_harness.h"
#include "shared_daemon.h"
#include "golden.h"

namespace wprep {
namespace {

class CliRemoteTest : public testing::SharedDaemonTest<CliRemoteTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--cpu-threads=2"}); }
};

// Every scale and checkpoint-order reference case through `wprep convert --target`
// (strided inputs as one Convert, dense ones as a ConvertStream).
TEST_F(CliRemoteTest, RemoteConvertMatchesEveryScaleAndPackingCase) {
  int converted = 0;
  for (testing::GoldenSet set : {testing::GoldenSet::kScales, testing::GoldenSet::kPacking}) {
    for (const auto& c : testing::GoldenCases(set)) {
      if (c.error) continue;
      SCOPED_TRACE(c.name);
      const fs::path in = Write("in.bin", testing::GoldenInput(c));
      const fs::path out = dir_ / "out.bin";
      const RunResult r = RunCli("convert --target " + daemon_->unix_target() + " " + ConvertFlagsFor(c) +
                                 " --input " + in.string() + " --output " + out.string());
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_EQ(testing::Sha256Hex(testing::ReadFile(out.string())), c.output_sha256);
      ++converted;
    }
  }
  EXPECT_GT(converted, 150);
}

TEST_F(CliRemoteTest, ConvertsAReferenceCaseOverTheUnixSocketAndTcp) {
  const auto& c = FindCase("blackwell_swizzle_3x258x130_bk64_bn64");
  const fs::path in = Write("in.bin", testing::SplitMix64Bytes(c.input_seed, c.input_bytes));
  for (const std::string& target : {daemon_->unix_target(), daemon_->tcp_target()}) {
    const fs::path out = dir_ / "out.bin";
    const RunResult r = RunCli("convert --target " + target +
                               " --layout blackwell_shuffled_value --direction swizzle"
                               " --shape 3,258,130 --block-k 64 --block-n 64 --input " +
                               in.string() + " --output " + out.string());
    ASSERT_EQ(r.exit_code, 0) << target << ": " << r.err;
    EXPECT_EQ(testing::Sha256Hex(testing::ReadFile(out.string())), c.output_sha256) << target;
    EXPECT_NE(r.out.find("output_shape [3, 8, 3, 64, 32]"), std::string::npos) << r.out;
    fs::remove(out);
  }
}

TEST_F(CliRemoteTest, BadInputIsOneStatusLineExitTwoAndNoOutput) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(256 * 128, 7));
  const fs::path out = dir_ / "out.bin";
  const std::string io = " --input " + in.string() + " --output " + out.string();
  struct Case {
    std::string flags, prefix, reason;
  };
  for (const Case& c : std::vector<Case>{
           {"--layout hopper_value --direction swizzle --shape 256,3", "INVALID_ARGUMENT: ", "even size, got 3"},
           {"--layout hopper_value --direction swizzle --shape 128,256", "INVALID_ARGUMENT: ", "16384"},
           {"--layout blackwell_shuffled_value --direction swizzle --shape 256,256 --block-k 7",
            "INVALID_ARGUMENT: ", "block_k"}}) {
    const RunResult r = RunCli("convert --target " + daemon_->unix_target() + " " + c.flags + io);
    EXPECT_EQ(r.exit_code, 2) << c.flags;
    EXPECT_EQ(r.err.rfind(c.prefix, 0), 0u) << c.flags << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.reason), std::string::npos) << c.flags << ": " << r.err;
    EXPECT_FALSE(fs::exists(out)) << c.flags;
  }
  // The daemon keeps serving.
  EXPECT_EQ(daemon_->Health(), 1);
}

TEST_F(CliRemoteTest, UnreachableDaemonIsUnavailable) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(256 * 128, 7));
  const RunResult r =
      RunCli("convert --target unix://" + (dir_ / "nobody.sock").string() +
             " --layout hopper_value --direction swizzle --shape 256,256 --input " + in.string() +
             " --output " + (dir_ / "out.bin").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("UNAVAILABLE: ", 0), 0u) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out.bin"));
}

}  // namespace
}  // namespace wprep
