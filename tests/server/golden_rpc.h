// Test helpers: golden cases as wprep.v1 requests and their expected outputs.
#ifndef WPREP_TESTS_SERVER_GOLDEN_RPC_H_
#define WPREP_TESTS_SERVER_GOLDEN_RPC_H_

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "golden.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep::testing {

inline std::string AsString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// True when `out` is the case's expected output (stored file, else its sha256).
inline bool MatchesGolden(const GoldenCase& c, const std::string& out) {
  if (out.size() != c.output_bytes) return false;
  if (!c.output_file.empty()) return AsString(ReadFile(c.output_file)) == out;
  return Sha256Hex(std::vector<uint8_t>(out.begin(), out.end())) == c.output_sha256;
}

inline wprep::v1::ConvertRequest ConvertRequestFor(const ConversionSpec& spec,
                                                   const std::vector<int64_t>& shape,
                                                   const std::vector<uint8_t>& input) {
  wprep::v1::ConvertRequest r;
  *r.mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : shape) r.add_logical_shape(d);
  r.set_source_bytes(AsString(input));
  return r;
}

inline wprep::v1::StreamRequestHeader StreamHeaderFor(const ConversionSpec& spec,
                                                      const std::vector<int64_t>& shape) {
  wprep::v1::StreamRequestHeader h;
  *h.mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : shape) h.add_logical_shape(d);
  return h;
}

// The CPU engine's output for `input`: the reference for tensors without golden vectors.
inline std::string CpuReference(const ConversionSpec& spec, const std::vector<int64_t>& shape,
                                const std::vector<uint8_t>& input) {
  absl::StatusOr<Plan> plan = MakePlan(spec, shape);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return "";
  std::string out(plan->output_bytes, '\0');
  absl::Status s = ConvertOnCpu(*plan, input.data(), input.size(),
                                reinterpret_cast<uint8_t*>(out.data()), out.size());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

inline ConversionSpec HopperSpec(Direction d, int mx, int mma) {
  ConversionSpec s;
  s.layout = Layout::kHopperValue;
  s.direction = d;
  s.hopper.mx_axis = mx;
  s.hopper.mma_version = mma;
  return s;
}

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_GOLDEN_RPC_H_
