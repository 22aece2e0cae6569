// The planner's contract: shapes and byte counts, and the error table (each bad input is
// InvalidArgument with a message naming the problem and the value).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

ConversionSpec Hopper(int mx_axis, int mma, Direction d = Direction::kSwizzle) {
  ConversionSpec s;
  s.layout = Layout::kHopperValue;
  s.direction = d;
  s.hopper = {mx_axis, mma};
  return s;
}

ConversionSpec Blackwell(int64_t bk, int64_t bn, Direction d = Direction::kSwizzle) {
  ConversionSpec s;
  s.layout = Layout::kBlackwellShuffledValue;
  s.direction = d;
  s.blackwell = {bk, bn};
  s.blackwell_to = {256, 128};
  return s;
}

struct BadCase {
  const char* what;
  ConversionSpec spec;
  std::vector<int64_t> shape;
  InputBinding binding;
  const char* message_part;  // must appear in the error message
};

std::vector<BadCase> BadCases() {
  const int64_t big = int64_t{1} << 40;
  return {
      {"rank 1", Hopper(-1, 3), {256}, {}, "between 2 and 8 dims, got 1"},
      {"rank 9", Hopper(-1, 3), {1, 1, 1, 1, 1, 1, 1, 2, 2}, {}, "got 9"},
      {"negative dim", Hopper(-1, 3), {-4, 256}, {}, "dim 0 must be >= 0, got -4"},
      {"odd last dim", Hopper(-1, 3), {256, 3}, {}, "packing dimension -1 must have an even size, got 3"},
      {"odd last dim, other dim 0", Blackwell(128, 256), {0, 3}, {}, "dimension -1 must have an even size, got 3"},
      {"odd K, other dim 0", Blackwell(128, 256), {3, 0}, {}, "dimension -2 must have an even size"},
      {"odd D0 for mx_axis -2", Hopper(-2, 3), {3, 256}, {}, "dimension -2 must have an even size"},
      {"mx_axis 0", Hopper(0, 3), {256, 256}, {}, "mx_axis must be -1 or -2, got 0"},
      {"mma_version 4", Hopper(-1, 4), {256, 256}, {}, "mma_version must be 2 or 3, got 4"},
      {"hopper retile", Hopper(-1, 3, Direction::kRetile), {256, 256}, {}, "retile is defined only for blackwell"},
      {"odd block_k", Blackwell(7, 256), {256, 256}, {}, "block_k must be an even number in [2, 4096], got 7"},
      {"zero block_k", Blackwell(0, 256), {256, 256}, {}, "got 0"},
      {"huge block_k", Blackwell(8192, 256), {256, 256}, {}, "got 8192"},
      {"zero block_n", Blackwell(128, 0), {256, 256}, {}, "block_n must be in [1, 4096], got 0"},
      {"bad retile target",
       [] {
         auto s = Blackwell(128, 256, Direction::kRetile);
         s.blackwell_to = {128, -1};
         return s;
       }(),
       {256, 256}, {}, "retile target block_n"},
      {"shape overflow", Hopper(-1, 3), {big, big, 2}, {}, "overflows"},
      {"matrix overflow", Blackwell(128, 256), {big, big}, {}, "overflows"},
      {"buffer too small", Hopper(-1, 3), {256, 256}, {{}, 100}, "input holds 100 bytes but input shape [256, 128] needs exactly 32768"},
      {"buffer too large", Blackwell(128, 256), {256, 256}, {{}, 32769}, "needs exactly 32768 bytes"},
      {"stride count", Hopper(-1, 3), {256, 256}, {{128}, {}}, "have 1 entries"},
      {"negative stride", Hopper(-1, 3), {4, 256, 256}, {{-1, 128, 1}, {}}, "stride of dim 0 must be >= 0, got -1"},
      {"last dim not contiguous", Hopper(-1, 3), {256, 256}, {{256, 2}, {}}, "dim 1 must be contiguous (byte stride 1), got stride 2"},
      {"hopper mx -2 storage needs dim -2 contiguous", Hopper(-2, 3, Direction::kUnswizzle), {256, 128}, {{512, 1}, {}}, "dim 0 must be contiguous"},
      {"strides outside buffer", Hopper(-1, 3), {256, 256}, {{256, 1}, 32768}, "outside the 32768-byte input buffer"},
      {"stride overflow", Hopper(-1, 3), {4, 256, 256}, {{int64_t{1} << 62, 128, 1}, {}}, "overflow"},
  };
}

TEST(PlanErrors, EachBadInputIsInvalidArgumentWithItsReason) {
  for (const BadCase& c : BadCases()) {
    auto plan = MakePlan(c.spec, c.shape, c.binding);
    ASSERT_FALSE(plan.ok()) << c.what;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(std::string(plan.status().message()).find(c.message_part), std::string::npos)
        << c.what << ": message was \"" << plan.status().message() << "\"";
  }
}

TEST(PlanShapes, HopperMxMinus2ReportsTransposedStorage) {
  auto plan = MakePlan(Hopper(-2, 3), {16, 4096, 4096});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_shape, (std::vector<int64_t>{16, 4096, 2048}));
  EXPECT_EQ(plan->output_shape, (std::vector<int64_t>{16, 8192, 1024}));
  EXPECT_EQ(plan->output_strides, (std::vector<int64_t>{8192 * 1024, 1, 8192}));
  EXPECT_EQ(plan->output_bytes, uint64_t{16} * 4096 * 2048);
}

TEST(PlanShapes, PaddingGrowsHopperStorage) {
  auto plan = MakePlan(Hopper(-1, 2), {5, 256});
  ASSERT_TRUE(plan.ok()) << plan.status();
  // rows 5 -> 256, cols 128 -> 128: storage [64, 512].
  EXPECT_EQ(plan->output_shape, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(plan->output_bytes, 32768u);
}

TEST(PlanShapes, BlackwellAlignsKToLcmOf128AndTile) {
  // block_k 384 -> tile_k 192, align_k = lcm(128, 192) = 384; K/2 = 100 -> Kpad 384.
  auto plan = MakePlan(Blackwell(384, 64), {200, 64});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->output_shape, (std::vector<int64_t>{1, 2, 1, 64, 192}));
}

TEST(PlanShapes, EmptyTensorsAreValidAndEmpty) {
  for (auto shape : std::vector<std::vector<int64_t>>{{0, 256}, {256, 0}, {0, 0}, {3, 0, 256, 256}}) {
    for (auto spec : {Hopper(-1, 3), Hopper(-2, 2), Blackwell(128, 256)}) {
      auto plan = MakePlan(spec, shape);
      ASSERT_TRUE(plan.ok()) << Describe(spec) << ": " << plan.status();
      EXPECT_TRUE(plan->empty());
    }
  }
}

TEST(PlanShapes, RetileUsesBothTilings) {
  auto plan = MakePlan(Blackwell(128, 256, Direction::kRetile), {256, 512});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_shape, (std::vector<int64_t>{1, 2, 2, 256, 64}));
  EXPECT_EQ(plan->output_shape, (std::vector<int64_t>{1, 1, 4, 128, 128}));
}

TEST(PlanBinding, StridedViewSpansOnlyWhatItReaches) {
  // [4, 256, 128] canonical with rows padded to 160 bytes and matrices 256*160+32 apart.
  InputBinding b{{256 * 160 + 32, 160, 1}, {}};
  auto plan = MakePlan(Hopper(-1, 3), {4, 256, 256}, b);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->input_dense);
  EXPECT_EQ(plan->input_bytes, uint64_t{3} * (256 * 160 + 32) + 255 * 160 + 128);
}

TEST(Names, RoundTripAndRejectUnknown) {
  for (Layout l : {Layout::kHopperValue, Layout::kBlackwellShuffledValue}) {
    EXPECT_EQ(*ParseLayout(LayoutName(l)), l);
  }
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle, Direction::kRetile}) {
    EXPECT_EQ(*ParseDirection(DirectionName(d)), d);
  }
  EXPECT_EQ(ParseLayout("ampere").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseDirection("sideways").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wprep
