// The planner's contract: shapes and byte counts, and the error table (each bad input is
// InvalidArgument with a message naming the problem and the value).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
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
      // Leading dims that overflow (the last two dims stay below 2^31: MakePlan refuses
      // bigger ones first, below).
      {"shape overflow", Hopper(-1, 3), {big, big, 2, 2}, {}, "product of leading dims overflows"},
      {"matrix overflow", Blackwell(128, 256), {(int64_t{1} << 31) - 2, (int64_t{1} << 31) - 2}, {}, "canonical matrix size overflows"},
      // Issue 26: a last dim of 2^32 was a zero 32-bit divisor (SIGFPE).
      {"a last dim of 2^32", Blackwell(128, 4), {65536, int64_t{1} << 32}, {}, "the last two dims must stay below 2^31, got 4294967296"},
      {"a dim -2 of 2^31", Hopper(-1, 3), {int64_t{1} << 31, 64}, {}, "the last two dims must stay below 2^31, got 2147483648"},
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

ConversionSpec Scale(Layout layout, int mx_axis = -2, int num_warps = 8,
                     Direction d = Direction::kSwizzle, int align_k = 2) {
  ConversionSpec s;
  s.layout = layout;
  s.direction = d;
  s.hopper_scale = {mx_axis, num_warps, align_k};
  return s;
}

ConversionSpec Packed(ConversionSpec s, int packing_axis) {
  s.packing_axis = packing_axis;
  return s;
}

ConversionSpec BlackwellValue(Direction d = Direction::kSwizzle, int packing_axis = -1) {
  ConversionSpec s;
  s.layout = Layout::kBlackwellValue;
  s.direction = d;
  s.packing_axis = packing_axis;
  return s;
}

std::vector<BadCase> NewBadCases() {
  const int64_t big = int64_t{1} << 40;
  return {
      {"num_warps 3", Scale(Layout::kHopperScale, -2, 3), {64, 8}, {}, "num_warps must be a power of two in [1, 32], got 3"},
      {"num_warps 0", Scale(Layout::kHopperScale, -2, 0), {64, 8}, {}, "got 0"},
      {"num_warps 64", Scale(Layout::kHopperScale, -2, 64), {64, 8}, {}, "got 64"},
      {"scale mx_axis 1", Scale(Layout::kHopperScale, 1, 8), {64, 8}, {}, "hopper_scale: mx_axis must be -1 or -2, got 1"},
      {"align_k 3", Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 3), {64, 8}, {}, "hopper_scale: align_k must be a power of two in [2, 64], got 3"},
      {"align_k 1", Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 1), {64, 8}, {}, "align_k must be a power of two in [2, 64], got 1"},
      {"align_k 0", Scale(Layout::kHopperScale, -1, 8, Direction::kUnswizzle, 0), {64, 8}, {}, "got 0"},
      {"align_k 128", Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 128), {64, 8}, {}, "got 128"},
      {"align_k -4", Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, -4), {64, 8}, {}, "got -4"},
      {"scale retile", Scale(Layout::kBlackwellScale, -2, 8, Direction::kRetile), {64, 8}, {}, "retile is defined only for blackwell_shuffled_value"},
      {"blackwell_value retile", BlackwellValue(Direction::kRetile), {64, 8}, {}, "retile is defined only"},
      {"packing_axis 0", Packed(Hopper(-1, 3), 0), {256, 256}, {}, "packing_axis must be -1 or -2, got 0"},
      {"packing -2 on scales", Packed(Scale(Layout::kBlackwellScale), -2), {64, 8}, {}, "blackwell_scale has no packed FP4 axis"},
      {"packing -2 on retile", Packed(Blackwell(128, 256, Direction::kRetile), -2), {256, 256}, {}, "retile has no canonical side"},
      {"odd D0 from packing -2", Packed(Hopper(-2, 3), -2), {7, 64}, {}, "dimension -2 must have an even size"},
      {"odd D1 for Hopper mx -1 from packing -2", Packed(Hopper(-1, 3), -2), {8, 5}, {}, "dimension -1 must have an even size, got 5"},
      {"odd N for blackwell_value", BlackwellValue(), {64, 5}, {}, "dimension -1 must have an even size, got 5"},
      {"odd K for blackwell_value", BlackwellValue(), {5, 64}, {}, "dimension -2 must have an even size"},
      {"odd K, N 0", BlackwellValue(Direction::kSwizzle, -2), {3, 0}, {}, "dimension -2 must have an even size"},
      {"scale overflow", Scale(Layout::kBlackwellScale), {big, big, 2, 2}, {}, "product of leading dims overflows"},
      {"scale negative stride", Scale(Layout::kHopperScale), {4, 64, 8}, {{512, -8, 1}, {}}, "stride of dim 1 must be >= 0, got -8"},
      {"scale view outside buffer", Scale(Layout::kHopperScale), {4, 64, 8}, {{512, 1, 64}, 2047}, "outside the 2047-byte input buffer"},
      {"scale storage keeps its contiguous dim", Scale(Layout::kBlackwellScale, -2, 8, Direction::kUnswizzle), {8, 128}, {{1024, 1024, 512, 256, 2}, {}}, "dim 4 must be contiguous"},
      {"blackwell_value storage keeps dim -2 contiguous", BlackwellValue(Direction::kUnswizzle), {256, 256}, {{256, 1}, {}}, "dim 0 must be contiguous"},
      {"checkpoint rows keep dim -1 contiguous", Packed(Blackwell(128, 256), -2), {256, 256}, {{1, 256}, {}}, "dim 1 must be contiguous"},
  };
}

TEST(PlanErrors, NewLayoutsAndPackingRejectEachBadInputWithItsReason) {
  for (const BadCase& c : NewBadCases()) {
    auto plan = MakePlan(c.spec, c.shape, c.binding);
    ASSERT_FALSE(plan.ok()) << c.what;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(std::string(plan.status().message()).find(c.message_part), std::string::npos)
        << c.what << ": message was \"" << plan.status().message() << "\"";
  }
}

TEST(PlanShapes, ScalesAtTheBenchShape) {
  // [16, 4096, 128] scales (N = 4096 rows of K/32 = 128 groups): 8 MiB.
  auto h1 = MakePlan(Scale(Layout::kHopperScale, -1, 8), {16, 4096, 128});
  ASSERT_TRUE(h1.ok()) << h1.status();
  EXPECT_EQ(h1->output_shape, (std::vector<int64_t>{16, 128, 4096}));
  EXPECT_EQ(h1->output_bytes, uint64_t{16} * 4096 * 128);
  // mx_axis -2: S rows are the 128 columns, padded to 256 (32 * 8 warps).
  auto h2 = MakePlan(Scale(Layout::kHopperScale, -2, 8), {16, 4096, 128});
  ASSERT_TRUE(h2.ok()) << h2.status();
  EXPECT_EQ(h2->output_shape, (std::vector<int64_t>{16, 131072, 8}));
  EXPECT_EQ(h2->output_strides, (std::vector<int64_t>{131072 * 8, 1, 131072}));
  auto b = MakePlan(Scale(Layout::kBlackwellScale), {16, 4096, 128});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->output_shape, (std::vector<int64_t>{1, 16, 1024, 2, 256}));
}

// gpt-oss's w13 scales as loaders pass them: the [E, K/32, N] = [E, 90, 5760] transposed
// view. vLLM on sm_90 pads the 90 groups to 92 (align_k 4) before the layout.
TEST(PlanShapes, AlignKPadsTheScaleGroupsOfGptOss) {
  const std::vector<int64_t> view = {128, 90, 5760};
  const InputBinding checkpoint{{90 * 5760, 1, 90}, uint64_t{128} * 90 * 5760};
  auto plain = MakePlan(Scale(Layout::kHopperScale, -2, 8), view, checkpoint);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->output_shape, (std::vector<int64_t>{128, 2880, 184}));
  auto padded = MakePlan(Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 4), view, checkpoint);
  ASSERT_TRUE(padded.ok()) << padded.status();
  EXPECT_EQ(padded->output_shape, (std::vector<int64_t>{128, 2944, 184}));
  EXPECT_EQ(padded->output_strides, (std::vector<int64_t>{2944 * 184, 1, 2944}));
  EXPECT_EQ(padded->output_bytes, uint64_t{128} * 2944 * 184);
  // Its unswizzle reads that storage back to the 90 groups.
  auto back = MakePlan(Scale(Layout::kHopperScale, -2, 8, Direction::kUnswizzle, 4), view);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->input_shape, padded->output_shape);
  EXPECT_EQ(back->output_shape, view);
  // DeepSeek-V3's 224 and 64 groups are multiples of 4 already: nothing changes.
  for (const std::vector<int64_t>& ds : {std::vector<int64_t>{256, 224, 4096}, std::vector<int64_t>{256, 64, 7168}}) {
    auto a2 = MakePlan(Scale(Layout::kHopperScale, -2, 8), ds);
    auto a4 = MakePlan(Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 4), ds);
    ASSERT_TRUE(a2.ok() && a4.ok());
    EXPECT_EQ(a2->output_shape, a4->output_shape);
  }
}

TEST(PlanShapes, BlackwellValueReportsKPaddedTransposedStorage) {
  auto plan = MakePlan(BlackwellValue(), {16, 4096, 4096});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->output_shape, (std::vector<int64_t>{16, 2048, 4096}));
  EXPECT_EQ(plan->output_strides, (std::vector<int64_t>{2048 * 4096, 1, 2048}));
  auto padded = MakePlan(BlackwellValue(Direction::kSwizzle, -2), {2, 130, 7});
  ASSERT_TRUE(padded.ok()) << padded.status();
  EXPECT_EQ(padded->input_shape, (std::vector<int64_t>{2, 7, 65}));
  EXPECT_EQ(padded->output_shape, (std::vector<int64_t>{2, 128, 7}));
  EXPECT_EQ(padded->output_bytes, 2u * 7 * 128);
}

TEST(PlanShapes, PackingMinus2InputIsTheCheckpointOrder) {
  for (int mx : {-1, -2}) {
    auto p2 = MakePlan(Packed(Hopper(mx, 3), -2), {4, 1024, 512});
    auto p1 = MakePlan(Hopper(mx, 3), {4, 1024, 512});
    ASSERT_TRUE(p2.ok() && p1.ok());
    EXPECT_EQ(p2->input_shape, (std::vector<int64_t>{4, 512, 512}));
    EXPECT_EQ(p2->output_shape, p1->output_shape);
    EXPECT_EQ(p2->output_strides, p1->output_strides);
    auto u2 = MakePlan(Packed(Hopper(mx, 3, Direction::kUnswizzle), -2), {4, 1024, 512});
    ASSERT_TRUE(u2.ok());
    EXPECT_EQ(u2->output_shape, (std::vector<int64_t>{4, 512, 512}));
  }
}

TEST(PlanBinding, ScaleTensorsTakeTransposedAndZeroStrides) {
  // The loader's view: [E, K/32, N] over the checkpoint's [E, N, K/32].
  InputBinding transposed{{4096 * 90, 1, 90}, uint64_t{4} * 4096 * 90};
  auto plan = MakePlan(Scale(Layout::kHopperScale), {4, 90, 4096}, transposed);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->input_dense);
  EXPECT_EQ(plan->input_bytes, uint64_t{4} * 4096 * 90);
  // A broadcast over the leading dim reads the same matrix four times.
  InputBinding broadcast{{0, 8, 1}, 512};
  auto b = MakePlan(Scale(Layout::kBlackwellScale), {4, 64, 8}, broadcast);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->input_bytes, 512u);
}

TEST(PlanShapes, UnswizzleOutputStridesDescribeTheBytesWritten) {
  // Hopper scale mx_axis -2: the reference keeps its transposed view where that view is
  // dense (rows fill the padding), else the output is the row-major copy.
  auto dense = MakePlan(Scale(Layout::kHopperScale, -2, 4, Direction::kUnswizzle), {1, 512, 64});
  ASSERT_TRUE(dense.ok());
  EXPECT_EQ(dense->output_strides, (std::vector<int64_t>{65536, 1, 512}));
  auto sliced = MakePlan(Scale(Layout::kHopperScale, -2, 4, Direction::kUnswizzle), {3, 100, 90});
  ASSERT_TRUE(sliced.ok());
  EXPECT_EQ(sliced->output_strides, (std::vector<int64_t>{9000, 90, 1}));
  EXPECT_EQ(sliced->output_bytes, 27000u);
}

TEST(Names, NewLayoutsRoundTripAndDescribe) {
  for (Layout l : AllLayouts()) EXPECT_EQ(*ParseLayout(LayoutName(l)), l);
  EXPECT_EQ(AllLayouts().size(), 5u);
  EXPECT_EQ(LayoutName(Layout::kHopperScale), "hopper_scale");
  EXPECT_EQ(LayoutName(Layout::kBlackwellScale), "blackwell_scale");
  EXPECT_EQ(LayoutName(Layout::kBlackwellValue), "blackwell_value");
  EXPECT_EQ(Describe(Scale(Layout::kHopperScale, -1, 4)), "hopper_scale swizzle mx_axis=-1 num_warps=4");
  EXPECT_EQ(Describe(Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 4)),
            "hopper_scale swizzle mx_axis=-2 num_warps=8 align_k=4");
  EXPECT_EQ(Describe(Packed(Hopper(-2, 3), -2)), "hopper_value swizzle mx_axis=-2 mma=3 packing_axis=-2");
  EXPECT_EQ(Describe(BlackwellValue(Direction::kUnswizzle)), "blackwell_value unswizzle");
}

TEST(Identity, NamesTheUpstreamLayoutObject) {
  EXPECT_EQ(kLayoutContractVersion, 1);
  EXPECT_EQ(LayoutIdentity(Hopper(-2, 3)), "HopperMXValueLayout(mx_axis=-2, mma_version=3)");
  EXPECT_EQ(LayoutIdentity(Hopper(-1, 2, Direction::kUnswizzle)),
            "HopperMXValueLayout(mx_axis=-1, mma_version=2)");
  EXPECT_EQ(LayoutIdentity(Blackwell(128, 256)),
            "BlackwellMX4ValueShuffledLayout(block_k=128, block_n=256)");
  EXPECT_EQ(LayoutIdentity(Blackwell(128, 256, Direction::kRetile)),
            "BlackwellMX4ValueShuffledLayout(block_k=256, block_n=128)");
  EXPECT_EQ(LayoutIdentity(BlackwellValue()), "BlackwellMXValueLayout()");
  EXPECT_EQ(LayoutIdentity(Scale(Layout::kHopperScale)), "HopperMXScaleLayout(mx_axis=-2, num_warps=8)");
  EXPECT_EQ(LayoutIdentity(Scale(Layout::kBlackwellScale)), "BlackwellMXScaleLayout()");
  EXPECT_EQ(ConversionIdentity(Packed(Hopper(-2, 3), -2)),
            "canonical(packing_axis=-2) -> HopperMXValueLayout(mx_axis=-2, mma_version=3)");
  EXPECT_EQ(ConversionIdentity(Scale(Layout::kBlackwellScale, -2, 8, Direction::kUnswizzle)),
            "BlackwellMXScaleLayout() -> scales");
  // Zero groups appended along the mx axis are the plain side's, not the layout object's.
  const ConversionSpec padded = Scale(Layout::kHopperScale, -2, 8, Direction::kSwizzle, 4);
  EXPECT_EQ(LayoutIdentity(padded), "HopperMXScaleLayout(mx_axis=-2, num_warps=8)");
  EXPECT_EQ(ConversionIdentity(padded), "scales(align_k=4) -> HopperMXScaleLayout(mx_axis=-2, num_warps=8)");
  EXPECT_EQ(ConversionIdentity(Scale(Layout::kHopperScale, -1, 4, Direction::kUnswizzle, 8)),
            "HopperMXScaleLayout(mx_axis=-1, num_warps=4) -> scales(align_k=8)");
  EXPECT_EQ(ConversionIdentity(Scale(Layout::kHopperScale)), "scales -> HopperMXScaleLayout(mx_axis=-2, num_warps=8)");
  EXPECT_EQ(ConversionIdentity(Blackwell(128, 256, Direction::kRetile)),
            "BlackwellMX4ValueShuffledLayout(block_k=128, block_n=256) -> "
            "BlackwellMX4ValueShuffledLayout(block_k=256, block_n=128)");
}

TEST(Defaults, MatchWhatLoadersPass) {
  const ConversionSpec s;
  EXPECT_EQ(s.packing_axis, -1);
  EXPECT_EQ(s.hopper_scale.mx_axis, -2);
  EXPECT_EQ(s.hopper_scale.num_warps, 8);
  EXPECT_EQ(s.hopper_scale.align_k, 2);  // the layout's own padding; loaders ask for more
}

TEST(KernelVariants, EveryVariantPlansAtTheWarmUpShape) {
  std::set<std::pair<Layout, Direction>> kinds;
  for (const ConversionSpec& s : KernelVariantSpecs()) {
    auto plan = MakePlan(s, {2, 256, 256});
    EXPECT_TRUE(plan.ok()) << Describe(s) << ": " << plan.status();
    kinds.emplace(s.layout, s.direction);
  }
  EXPECT_EQ(kinds.size(), 11u);  // 5 layouts x swizzle/unswizzle, plus retile
}

// Issue 26: logical_shape [65536, 2^32] with blackwell_shuffled_value, block_n 4 (block_k
// at its default) divided by a 32-bit zero (SIGFPE) inside MakePlan. Every layout and
// direction, block sizes 1, 2, 4 and the default, ranks 2 to 5, a dim of 2^31, 2^32,
// 2^32 + 1 or 2^63 - 1 in each position beside dims of 64 or 0: each plan is refused with
// InvalidArgument and a message, or (an empty tensor whose last two dims are ordinary)
// planned with 0 bytes in and out.
TEST(PlanErrors, ExtremeDimsAreRefusedOrEmptyNeverDivideByZero) {
  std::vector<ConversionSpec> specs;
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle, Direction::kRetile}) {
    for (int64_t bk : {2, 4, 256}) {
      for (int64_t bn : {1, 2, 4, 128}) {
        ConversionSpec s = Blackwell(bk, bn, d);
        specs.push_back(s);
        s.blackwell_to = {bk, bn};
        specs.push_back(s);
      }
    }
    for (int mx : {-1, -2}) specs.push_back(Hopper(mx, 3, d));
    for (Layout l : {Layout::kBlackwellValue, Layout::kBlackwellScale, Layout::kHopperScale}) {
      ConversionSpec s;
      s.layout = l;
      s.direction = d;
      specs.push_back(s);
    }
  }
  const int64_t huge[] = {int64_t{1} << 31, int64_t{1} << 32, (int64_t{1} << 32) + 1, INT64_MAX};
  std::vector<std::vector<int64_t>> shapes = {{65536, int64_t{1} << 32}};
  for (size_t rank = 2; rank <= 5; ++rank) {
    for (size_t pos = 0; pos < rank; ++pos) {
      for (int64_t h : huge) {
        for (int64_t other : {int64_t{64}, int64_t{0}}) {
          std::vector<int64_t> shape(rank, other);
          shape[pos] = h;
          shapes.push_back(shape);
        }
      }
    }
  }
  int refused = 0;
  for (const ConversionSpec& spec : specs) {
    for (const std::vector<int64_t>& shape : shapes) {
      const std::string what = Describe(spec) + " " + ::testing::PrintToString(shape);
      absl::StatusOr<Plan> p = MakePlan(spec, shape);
      if (p.ok()) {
        const size_t r = shape.size();
        EXPECT_TRUE(shape[r - 1] < (int64_t{1} << 31) && shape[r - 2] < (int64_t{1} << 31)) << what;
        EXPECT_EQ(p->input_bytes, 0u) << what;
        EXPECT_EQ(p->output_bytes, 0u) << what;
        continue;
      }
      ++refused;
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << p.status();
      EXPECT_FALSE(p.status().message().empty()) << what;
    }
  }
  EXPECT_GT(refused, static_cast<int>(specs.size() * shapes.size() / 2));
}

}  // namespace
}  // namespace wprep
