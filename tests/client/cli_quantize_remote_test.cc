// `wprep quantize --target` against a real wprepd process (a quantize batch item on its CPU
// engine): every reference case byte for byte over the Unix socket, the fused Blackwell pair
// over TCP equal to --local's, and the exit-2 contract when the daemon refuses.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "daemon_harness.h"
#include "nlohmann/json.hpp"
#include "shared_daemon.h"

namespace wprep {
namespace {

std::string QuantDir() {
  const char* env = std::getenv("WPREP_TEST_DATA_DIR");
  return std::string(env != nullptr && *env != '\0' ? env : WPREP_TEST_DATA_DIR) + "/golden_quant/";
}

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

class CliQuantizeRemoteTest : public testing::SharedDaemonTest<CliQuantizeRemoteTest, CliTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({"--cpu-threads=2"}); }
};

TEST_F(CliQuantizeRemoteTest, RemoteMatchesEveryReferenceCase) {
  const std::string dir = QuantDir();
  std::ifstream mf(dir + "manifest.json");
  ASSERT_TRUE(mf.good());
  const nlohmann::json manifest = nlohmann::json::parse(mf);
  int checked = 0;
  for (const auto& c : manifest["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
    const RunResult r = RunCli("quantize --target " + daemon_->unix_target() + " --dtype " +
                               c["input_dtype"].get<std::string>() + " --shape " +
                               Join(c["input_shape"].get<std::vector<int64_t>>()) + " --scale-rounding " +
                               c["params"]["scale_rounding"].get<std::string>() + " --input " + dir +
                               c["input"].get<std::string>() + " --values-output " + v.string() +
                               " --scales-output " + s.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(Bytes(v), Bytes(dir + c["values"].get<std::string>()));
    EXPECT_EQ(Bytes(s), Bytes(dir + c["scales"].get<std::string>()));
    ++checked;
  }
  EXPECT_EQ(checked, 40);
}

// The fused pairs through the daemon (Blackwell; Hopper with non-default parameters) equal
// the local engine's bytes.
TEST_F(CliQuantizeRemoteTest, FusedLayoutsOverTcpEqualLocal) {
  std::vector<uint8_t> in(2 * 3 * 130 * 96);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 1 < in.size(); i += 2) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    in[i] = static_cast<uint8_t>(x);
    in[i + 1] = static_cast<uint8_t>(0x3A + (x >> 8) % 10 + ((x >> 20) & 1) * 0x80);
  }
  const fs::path input = Write("w.bf16", in);
  for (const std::string layout : {"blackwell_value", "hopper_value --mma-version 2 --num-warps 4 --align-k 4"}) {
    SCOPED_TRACE(layout);
    const std::string common = " --dtype bfloat16 --shape 3,130,96 --layout " + layout + " --input " + input.string();
    const RunResult local = RunCli("quantize --local" + common + " --values-output " + (dir_ / "lv").string() +
                                   " --scales-output " + (dir_ / "ls").string());
    ASSERT_EQ(local.exit_code, 0) << local.err;
    const RunResult remote = RunCli("quantize --target " + daemon_->tcp_target() + common + " --values-output " +
                                    (dir_ / "rv").string() + " --scales-output " + (dir_ / "rs").string());
    ASSERT_EQ(remote.exit_code, 0) << remote.err;
    EXPECT_EQ(Bytes(dir_ / "rv"), Bytes(dir_ / "lv"));
    EXPECT_EQ(Bytes(dir_ / "rs"), Bytes(dir_ / "ls"));
    EXPECT_FALSE(Bytes(dir_ / "rv").empty());
    EXPECT_EQ(remote.out, local.out);
  }
}

// A daemon that cannot be reached, and flags that are refused before any call: exit 2, one
// line, no files.
TEST_F(CliQuantizeRemoteTest, RefusalsAreOneLineAndNoFiles) {
  const fs::path in = Write("in.bin", std::vector<uint8_t>(2 * 4 * 64, 0));
  const fs::path v = dir_ / "v.bin", s = dir_ / "s.bin";
  const std::string io = " --input " + in.string() + " --values-output " + v.string() + " --scales-output " + s.string();
  struct Bad {
    std::string flags, code;
  };
  const std::vector<Bad> cases = {
      {"--target unix://" + (dir_ / "nobody.sock").string() + " --dtype bfloat16 --shape 4,64" + io, "UNAVAILABLE: "},
      {"--target " + daemon_->unix_target() + " --device cpu --dtype bfloat16 --shape 4,64" + io,
       "INVALID_ARGUMENT: "},
      {"--target " + daemon_->unix_target() + " --dtype bfloat16 --shape 4,65" + io, "INVALID_ARGUMENT: "},
      {"--target " + daemon_->unix_target() + " --dtype bfloat16 --shape 64 --layout blackwell_value" + io,
       "INVALID_ARGUMENT: "},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.flags);
    const RunResult r = RunCli("quantize " + b.flags);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(r.err.rfind(b.code, 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_FALSE(fs::exists(v));
    EXPECT_FALSE(fs::exists(s));
  }
}

}  // namespace
}  // namespace wprep
