// Every reference vector through the planner and the CPU engine: ../shared/golden (values,
// copied to tests/data/golden), golden_scales (MX scales) and golden_packing (checkpoint
// order and blackwell_value), each copied to tests/data.
#include <gtest/gtest.h>

#include <set>
#include <utility>

#include "golden.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

using testing::GoldenCase;
using testing::GoldenCases;
using testing::GoldenSet;

// The case's plan: with its input view's strides where the manifest gives them.
absl::StatusOr<Plan> PlanCase(const GoldenCase& c) {
  InputBinding binding;
  if (!c.error.has_value()) {
    binding.strides = c.input_strides;
    binding.buffer_bytes = c.input_bytes;
  }
  return MakePlan(c.spec, c.logical_shape, binding);
}

void ExpectMatchesReference(const GoldenCase& c) {
  SCOPED_TRACE(c.name);
  auto plan = PlanCase(c);
  if (c.error.has_value()) {
    ASSERT_FALSE(plan.ok()) << "expected " << *c.error;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    return;
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_shape, c.input_shape);
  if (!c.input_strides.empty()) {
    EXPECT_EQ(plan->input_strides, c.input_strides);
  }
  EXPECT_EQ(plan->input_bytes, c.input_bytes);
  EXPECT_EQ(plan->output_shape, c.output_shape);
  if (c.set == GoldenSet::kValues) {
    EXPECT_EQ(plan->output_strides, c.output_strides);
  } else {
    EXPECT_EQ(plan->output_strides, testing::ExpectedOutputStrides(c));
  }
  ASSERT_EQ(plan->output_bytes, c.output_bytes);

  const std::vector<uint8_t> input = testing::GoldenInput(c);
  ASSERT_EQ(testing::Sha256Hex(input), c.input_sha256) << "regenerated input differs";
  if (!c.input_file.empty()) {
    ASSERT_EQ(testing::ReadFile(c.input_file), input);
  }

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

class GoldenCpuTest : public ::testing::TestWithParam<size_t> {};
class GoldenScalesCpuTest : public ::testing::TestWithParam<size_t> {};
class GoldenPackingCpuTest : public ::testing::TestWithParam<size_t> {};

TEST_P(GoldenCpuTest, MatchesReference) {
  ExpectMatchesReference(GoldenCases()[GetParam()]);
}
TEST_P(GoldenScalesCpuTest, MatchesReference) {
  ExpectMatchesReference(GoldenCases(GoldenSet::kScales)[GetParam()]);
}
TEST_P(GoldenPackingCpuTest, MatchesReference) {
  ExpectMatchesReference(GoldenCases(GoldenSet::kPacking)[GetParam()]);
}

template <GoldenSet kSet>
std::string CaseName(const ::testing::TestParamInfo<size_t>& info) {
  return GoldenCases(kSet)[info.param].name;
}

INSTANTIATE_TEST_SUITE_P(AllCases, GoldenCpuTest,
                         ::testing::Range<size_t>(0, GoldenCases().size()),
                         CaseName<GoldenSet::kValues>);
INSTANTIATE_TEST_SUITE_P(AllCases, GoldenScalesCpuTest,
                         ::testing::Range<size_t>(0, GoldenCases(GoldenSet::kScales).size()),
                         CaseName<GoldenSet::kScales>);
INSTANTIATE_TEST_SUITE_P(AllCases, GoldenPackingCpuTest,
                         ::testing::Range<size_t>(0, GoldenCases(GoldenSet::kPacking).size()),
                         CaseName<GoldenSet::kPacking>);

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

TEST(GoldenManifest, ScalesCoverBothLayoutsDirectionsAndTransposedViews) {
  int hopper = 0, blackwell = 0, unswizzle = 0, transposed_inputs = 0, padded = 0;
  for (const auto& c : GoldenCases(GoldenSet::kScales)) {
    hopper += c.spec.layout == Layout::kHopperScale;
    padded += c.spec.layout == Layout::kHopperScale && c.spec.hopper_scale.align_k != 2;
    blackwell += c.spec.layout == Layout::kBlackwellScale;
    unswizzle += c.spec.direction == Direction::kUnswizzle;
    const size_t r = c.input_strides.size();
    transposed_inputs += r >= 2 && c.input_strides[r - 2] == 1;
  }
  EXPECT_EQ(GoldenCases(GoldenSet::kScales).size(), 66u);
  EXPECT_EQ(padded, 16);  // align_k: vLLM's sm_90 form on gpt-oss's shapes, and errors
  EXPECT_GT(hopper, 0);
  EXPECT_GT(blackwell, 0);
  EXPECT_GT(unswizzle, 0);
  EXPECT_GT(transposed_inputs, 0);
}

TEST(GoldenManifest, PackingCoversEveryValueLayoutBothWaysAndErrors) {
  int errors = 0, packing2 = 0, stored_inputs = 0;
  std::set<std::pair<Layout, Direction>> kinds;
  for (const auto& c : GoldenCases(GoldenSet::kPacking)) {
    errors += c.error.has_value();
    packing2 += c.spec.packing_axis == -2;
    stored_inputs += !c.input_file.empty();
    kinds.emplace(c.spec.layout, c.spec.direction);
  }
  EXPECT_EQ(GoldenCases(GoldenSet::kPacking).size(), 114u);
  EXPECT_GT(errors, 0);
  EXPECT_GT(packing2, 0);
  EXPECT_GT(stored_inputs, 0);
  EXPECT_EQ(kinds.size(), 6u);  // three value layouts, swizzle and unswizzle
}

}  // namespace
}  // namespace wprep
