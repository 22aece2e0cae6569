// `wprep moe --target` against a real wprepd process (CPU engine, inline bytes): the same
// files, bytes and exit-2 contract as --local, the errors now coming from the daemon.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli_runner.h"
#include "daemon_harness.h"
#include "moe_cli_cases.h"
#include "moe_golden.h"
#include "shared_daemon.h"

namespace wprep {
namespace {

using testing::MoeGoldenCase;
using testing::MoeGoldenCases;

class CliMoeRemoteTest : public testing::SharedDaemonTest<CliMoeRemoteTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--cpu-threads=2"}); }
};

TEST_F(CliMoeRemoteTest, RemoteMatchesEveryReferenceCase) {
  int cases = 0;
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    SCOPED_TRACE(c.set + "/" + c.name);
    const RunResult r = RunCli("moe --target " + daemon_->unix_target() + " " + testing::MoeCaseFlags(*this, c));
    testing::ExpectMoeCaseOutcome(*this, c, r);
    ++cases;
  }
  EXPECT_EQ(cases, 81);
  // Every rejection left the daemon serving: one more case over TCP.
  const MoeGoldenCase& last_good = MoeGoldenCases()[0];
  ASSERT_FALSE(last_good.error);
  const RunResult r = RunCli("moe --target " + daemon_->tcp_target() + " " + testing::MoeCaseFlags(*this, last_good));
  testing::ExpectMoeCaseOutcome(*this, last_good, r);
}

// The daemon's own checks, through the CLI: sizes, names and params it alone sees in
// remote mode. One INVALID_ARGUMENT line naming the operand, and no file.
TEST_F(CliMoeRemoteTest, TheDaemonsRejectionsAreOneLineAndNoOutputFile) {
  const std::string x = Write("x.in", std::vector<uint8_t>(2 * 64 * 48, 1)).string();
  const std::string y = (dir_ / "y.out").string();
  const std::string target = "moe --target " + daemon_->unix_target();
  struct Bad {
    std::string flags, mentions;
  };
  const std::vector<Bad> bad = {
      // 6144 bytes for a shape of 6145.
      {"--op swap_pairs --param axis=-2 --input x:uint8:2,64,48=" + x + " --input bias:float32:1=" + x +
           " --output y=" + y,
       "items[0].moe"},
      {"--op swap_pairs --param axis=-2 --input x:uint8:2,64,49=" + x + " --output y=" + y, "items[0].moe.x"},
      {"--op swap_pairs --param axis=-2 --input x:uint8:2,64,48=" + x + " --output values=" + y, "'values'"},
      {"--op row_shuffle --param epilogue_tile_m=0 --input x:uint8:2,64,48=" + x + " --output y=" + y,
       "items[0].moe"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.flags);
    const RunResult r = RunCli(target + " " + b.flags);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
    EXPECT_NE(r.err.find(b.mentions), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(y));
    EXPECT_FALSE(std::filesystem::exists(y + ".wprep-tmp"));
  }
}

}  // namespace
}  // namespace wprep
