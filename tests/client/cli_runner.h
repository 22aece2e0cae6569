// Runs the `wprep` binary as a user would: a fresh folder per test, real files, the exit
// status and both output streams captured.
#ifndef WPREP_TESTS_CLIENT_CLI_RUNNER_H_
#define WPREP_TESTS_CLIENT_CLI_RUNNER_H_

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "golden.h"

namespace wprep {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

inline std::string Slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("wprep_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

 public:
  RunResult RunCli(const std::string& args) {
    const fs::path out = dir_ / "stdout", err = dir_ / "stderr";
    const char* env = std::getenv("WPREP_CLI");  // set where the build tree moved (GPU bundle)
    const std::string cli = env != nullptr && *env != 0 ? env : WPREP_CLI_PATH;
    const std::string cmd = cli + " " + args + " >" + out.string() +
                            " 2>" + err.string();
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = Slurp(out);
    r.err = Slurp(err);
    return r;
  }

  fs::path Write(const std::string& name, const std::vector<uint8_t>& data) {
    const fs::path p = dir_ / name;
    std::ofstream f(p, std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    return p;
  }

  fs::path dir_;
};

// The `wprep convert` flags that ask for case `c`'s conversion (layout, direction, shape,
// parameters, packing axis, input strides), without --input/--output.
inline std::string ConvertFlagsFor(const testing::GoldenCase& c) {
  auto join = [](const std::vector<int64_t>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) s.push_back(',');
      s.append(std::to_string(v[i]));
    }
    return s;
  };
  const ConversionSpec& sp = c.spec;
  std::string f = "--layout " + std::string(LayoutName(sp.layout)) + " --direction " +
                  std::string(DirectionName(sp.direction)) + " --shape " + join(c.logical_shape);
  switch (sp.layout) {
    case Layout::kHopperValue:
      f += " --mx-axis=" + std::to_string(sp.hopper.mx_axis) + " --mma-version " + std::to_string(sp.hopper.mma_version);
      break;
    case Layout::kBlackwellShuffledValue:
      f += " --block-k " + std::to_string(sp.blackwell.block_k) + " --block-n " + std::to_string(sp.blackwell.block_n);
      if (sp.direction == Direction::kRetile) {
        f += " --to-block-k " + std::to_string(sp.blackwell_to.block_k) + " --to-block-n " +
             std::to_string(sp.blackwell_to.block_n);
      }
      break;
    case Layout::kHopperScale:
      f += " --mx-axis=" + std::to_string(sp.hopper_scale.mx_axis) + " --num-warps " +
           std::to_string(sp.hopper_scale.num_warps);
      if (sp.hopper_scale.align_k != 2) f += " --align-k " + std::to_string(sp.hopper_scale.align_k);
      break;
    case Layout::kBlackwellValue:
    case Layout::kBlackwellScale:
      break;
  }
  if (sp.packing_axis != -1) f += " --packing-axis=" + std::to_string(sp.packing_axis);
  if (!c.input_strides.empty()) f += " --input-strides " + join(c.input_strides);
  return f;
}

inline const testing::GoldenCase& FindCase(const std::string& name) {
  for (const auto& c : testing::GoldenCases()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no golden case " << name;
  std::abort();
}

}  // namespace wprep

#endif  // WPREP_TESTS_CLIENT_CLI_RUNNER_H_
