// `wprep moe` on the trtllm-gen reference cases, shared by the local and the remote CLI
// tests: the flags of a case, and the checks of its files.
#ifndef WPREP_TESTS_CLIENT_MOE_CLI_CASES_H_
#define WPREP_TESTS_CLIENT_MOE_CLI_CASES_H_

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "moe_golden.h"

namespace wprep::testing {

// Writes case `c`'s inputs into `t`'s folder; returns the flags after `moe --local|--target
// ADDR`: --op, --param, --input and one --output per expected output (for an error case,
// the output a success would have written: y, or values), each output at `dir`/NAME.out.
inline std::string MoeCaseFlags(CliTest& t, const MoeGoldenCase& c) {
  std::string f = "--op " + c.op;
  for (const auto& [k, v] : c.params) f += " --param " + k + "=" + v;
  for (const MoeGoldenTensor& in : c.inputs) {
    const std::filesystem::path p = t.Write(in.name + ".in", MoeGoldenInput(in));
    f += " --input " + in.name + ":" + in.dtype + ":" + JoinDims(in.shape) + "=" + p.string();
  }
  if (c.error) {
    const std::string name = c.inputs[0].name == "x" ? "y" : "values";
    f += " --output " + name + "=" + (t.dir_ / (name + ".out")).string();
  }
  for (const MoeGoldenTensor& out : c.outputs) {
    f += " --output " + out.name + "=" + (t.dir_ / (out.name + ".out")).string();
  }
  return f;
}

// The outcome of `wprep moe` on case `c`: every output file byte-exact (its checksum) and
// reported with the manifest's shape; or, for an error case, exit 2, one INVALID_ARGUMENT
// line and no file written. Removes the files for the next case.
inline void ExpectMoeCaseOutcome(CliTest& t, const MoeGoldenCase& c, const RunResult& r) {
  if (c.error) {
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_EQ(r.err.rfind("INVALID_ARGUMENT: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  } else {
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const MoeGoldenTensor& out : c.outputs) {
      const std::filesystem::path p = t.dir_ / (out.name + ".out");
      EXPECT_EQ(Sha256Hex(ReadFile(p.string())), out.sha256) << out.name;
      const std::string line = out.name + " " + out.dtype + " shape [" + JoinDims(out.shape, ", ") + "] strides [" +
                               JoinDims(out.strides, ", ") + "] bytes " + std::to_string(out.bytes) + "\n";
      EXPECT_NE(r.out.find(line), std::string::npos) << "want " << line << "in " << r.out;
    }
    EXPECT_NE(r.out.find("identity "), std::string::npos) << r.out;
  }
  // No file but the outputs asked for (no temporaries left behind, none on error).
  for (const auto& e : std::filesystem::directory_iterator(t.dir_)) {
    const std::string n = e.path().filename().string();
    if (n == "stdout" || n == "stderr" || (n.size() > 3 && n.substr(n.size() - 3) == ".in")) continue;
    bool expected = false;
    for (const MoeGoldenTensor& out : c.outputs) expected = expected || n == out.name + ".out";
    EXPECT_TRUE(expected && !c.error) << "unexpected file " << n;
    std::filesystem::remove(e.path());
  }
}

}  // namespace wprep::testing

#endif  // WPREP_TESTS_CLIENT_MOE_CLI_CASES_H_
