// Every reference vector of ../shared/golden (copied to tests/data/golden) through the
// planner and the CPU engine.
#include <gtest/gtest.h>

#include "golden.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

using testing::GoldenCase;
using testing::GoldenCases;

// Strides of size-1 dims and of empty tensors carry no information; compare the rest.
void ExpectSameStrides(const GoldenCase& c, const Plan& plan) {
  EXPECT_EQ(plan.output_strides, c.output_strides) << c.name;
}

class GoldenCpuTest : public ::testing::TestWithParam<size_t> {};

TEST_P(GoldenCpuTest, MatchesReference) {
  const GoldenCase& c = GoldenCases()[GetParam()];
  SCOPED_TRACE(c.name);
  auto plan = MakePlan(c.spec, c.logical_shape);
  if (c.error.has_value()) {
    ASSERT_FALSE(plan.ok()) << "expected " << *c.error;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    return;
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_shape, c.input_shape);
  EXPECT_EQ(plan->input_bytes, c.input_bytes);
  EXPECT_EQ(plan->output_shape, c.output_shape);
  ExpectSameStrides(c, *plan);
  ASSERT_EQ(plan->output_bytes, c.output_bytes);

  const std::vector<uint8_t> input = testing::SplitMix64Bytes(c.input_seed, c.input_bytes);
  ASSERT_EQ(testing::Sha256Hex(input), c.input_sha256) << "regenerated input differs";

  for (int threads : {1, 3}) {
    std::vector<uint8_t> out(c.output_bytes, 0xCD);  // poison: every byte must be written
    ASSERT_TRUE(
        ConvertOnCpu(*plan, input.data(), input.size(), out.data(), out.size(), {threads}).ok());
    EXPECT_EQ(testing::Sha256Hex(out), c.output_sha256) << "threads=" << threads;
    if (!c.output_file.empty()) {
      const std::vector<uint8_t> expected = testing::ReadFile(c.output_file);
      ASSERT_EQ(expected.size(), out.size());
      size_t first_diff = 0;
      while (first_diff < out.size() && out[first_diff] == expected[first_diff]) ++first_diff;
      EXPECT_EQ(first_diff, out.size()) << "first differing byte " << first_diff;
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<size_t>& info) {
  return GoldenCases()[info.param].name;
}

INSTANTIATE_TEST_SUITE_P(AllCases, GoldenCpuTest,
                         ::testing::Range<size_t>(0, GoldenCases().size()), CaseName);

TEST(GoldenManifest, HasEveryKindOfCase) {
  int errors = 0, retiles = 0, empties = 0;
  for (const auto& c : GoldenCases()) {
    errors += c.error.has_value();
    retiles += c.spec.direction == Direction::kRetile;
    empties += !c.error.has_value() && c.output_bytes == 0;
  }
  EXPECT_GE(GoldenCases().size(), 100u);
  EXPECT_GT(errors, 0);
  EXPECT_GT(retiles, 0);
  EXPECT_GT(empties, 0);
}

}  // namespace
}  // namespace wprep
