// The engine's internals behind the public plan (kernels/src, on this test's include path
// only): the geometry MakePlan builds, the tile dispatch, the one Gcd, and the occupancy
// decision of the CUDA engine, and the packed quantizer's scale byte and code lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "golden.h"
#include "hopper_scale_runs.h"
#include "layout_math.h"
#include "occupancy.h"
#include "quantize_math.h"
#include "tiles.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

ConversionSpec Hopper(int mx_axis, int mma, Direction d) {
  ConversionSpec s;
  s.layout = Layout::kHopperValue;
  s.direction = d;
  s.hopper = {mx_axis, mma};
  return s;
}

TEST(KernelVariants, ReachBothHopperScaleTilesEachWay) {
  std::set<std::pair<Op, ScaleAccess>> reached;
  for (const ConversionSpec& s : KernelVariantSpecs()) {
    auto plan = MakePlan(s, {2, 256, 256});
    ASSERT_TRUE(plan.ok());
    ASSERT_NE(plan->geometry, nullptr);
    const Geometry& g = *plan->geometry;
    if (g.op == Op::kHopperScaleSwizzle || g.op == Op::kHopperScaleUnswizzle) {
      reached.emplace(g.op, g.scale_access);
    }
  }
  for (Op op : {Op::kHopperScaleSwizzle, Op::kHopperScaleUnswizzle}) {
    EXPECT_TRUE(reached.count({op, ScaleAccess::kRows})) << static_cast<int>(op);
    EXPECT_TRUE(reached.count({op, ScaleAccess::kColumns})) << static_cast<int>(op);
  }
}

// Which Hopper scale conversions the GPU's passes take (hopper_scale_runs.h) and which keep
// the tiles: the routing the H100 measurements chose (PERFORMANCE.md, "Scales at model
// shapes"), checked where no GPU is.
ConversionSpec HopperScale(int mx_axis, int num_warps, Direction d) {
  ConversionSpec s;
  s.layout = Layout::kHopperScale;
  s.direction = d;
  s.hopper_scale.mx_axis = mx_axis;
  s.hopper_scale.num_warps = num_warps;
  return s;
}

TEST(HopperScalePasses, TakeTheLoadersViewsAndLeaveLongColumnsToTheTiles) {
  alignas(16) static uint8_t buffer[64];
  const void* aligned = buffer;
  const void* odd = buffer + 1;
  auto geometry = [](const ConversionSpec& spec, const std::vector<int64_t>& shape, bool checkpoint_view) {
    InputBinding b;
    if (checkpoint_view) b.strides = testing::CheckpointScaleViewStrides(shape);
    auto plan = MakePlan(spec, shape, b);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan->geometry : Geometry{};
  };
  for (int nw : {4, 8}) {
    SCOPED_TRACE(nw);
    // The sm_90 loaders' call: mx_axis -2 of the checkpoint's transposed view (S rows of 90
    // or 64 groups, dense): the rows pass, but only with 16-byte aligned buffers.
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{128, 90, 5760}, {256, 64, 7168}}) {
      const Geometry g = geometry(HopperScale(-2, nw, Direction::kSwizzle), shape, true);
      EXPECT_TRUE(HopperScaleRunsPassOf(g, aligned, aligned).has_value());
      EXPECT_FALSE(HopperScaleRunsPassOf(g, odd, aligned).has_value());
      EXPECT_FALSE(HopperScaleColumnsPassOf(g, aligned, aligned).has_value());
    }
    // mx_axis -1 of that view: S columns of 90 / 224 / 64 groups take the columns pass.
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{128, 90, 5760}, {256, 224, 4096}, {256, 64, 7168}}) {
      const Geometry g = geometry(HopperScale(-1, nw, Direction::kSwizzle), shape, true);
      EXPECT_TRUE(HopperScaleColumnsPassOf(g, aligned, aligned).has_value()) << shape[1];
      EXPECT_FALSE(HopperScaleRunsPassOf(g, aligned, aligned).has_value());
    }
    // Columns of a multiple of 128 rows, and long ones (mx_axis -2 of a dense tensor: N
    // rows), measured faster on the tiles.
    EXPECT_FALSE(HopperScaleColumnsPassOf(geometry(HopperScale(-1, nw, Direction::kSwizzle), {16, 128, 4096}, true),
                                          aligned, aligned));
    EXPECT_FALSE(HopperScaleColumnsPassOf(geometry(HopperScale(-2, nw, Direction::kSwizzle), {128, 90, 5760}, false),
                                          aligned, aligned));
    // Unswizzles into dense S rows (mx_axis -2 where N is a multiple of 32 num_warps):
    // the rows pass the other way.
    const Geometry un = geometry(HopperScale(-2, nw, Direction::kUnswizzle), {256, 224, 4096}, false);
    ASSERT_EQ(un.scale_access, ScaleAccess::kRows);
    const std::optional<HopperScaleRunsPass> p = HopperScaleRunsPassOf(un, aligned, aligned);
    ASSERT_TRUE(p.has_value());
    EXPECT_FALSE(p->swizzle);
  }
  // Checkpoint rows padded to 96 bytes (a strided view of one matrix): runs are not
  // contiguous, tiles.
  {
    InputBinding padded;
    padded.strides = {256 * 96, 1, 96};
    auto plan = MakePlan(HopperScale(-2, 4, Direction::kSwizzle), {1, 90, 256}, padded);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(HopperScaleRunsPassOf(*plan->geometry, aligned, aligned).has_value());
  }
  // S rows of more than 512 groups keep the tiles.
  EXPECT_FALSE(HopperScaleRunsPassOf(geometry(HopperScale(-2, 4, Direction::kSwizzle), {16, 4096, 128}, true),
                                     aligned, aligned));
}

// Every copy of a plan runs the same geometry, and MakePlan's plans always carry one.
TEST(PlanGeometry, SharedByCopies) {
  auto plan = MakePlan(Hopper(-1, 2, Direction::kSwizzle), {2, 256, 256});
  ASSERT_TRUE(plan.ok());
  ASSERT_NE(plan->geometry, nullptr);
  const Plan copy = *plan;
  EXPECT_EQ(copy.geometry.get(), plan->geometry.get());
  EXPECT_EQ(copy.geometry->mma_version, 2);
  EXPECT_EQ(copy.geometry->num_matrices, 2);
}

// The Hopper tiles exist for mma versions 2 and 3. A geometry naming any other version
// must reach no tile and fail with a message naming the version; the dispatch once sent
// every version but 2 to the mma 3 tiles, and the conversion "succeeded".
TEST(TileDispatch, RefusesUnknownMmaVersions) {
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
    for (int mx : {-1, -2}) {
      auto plan = MakePlan(Hopper(mx, 3, d), {2, 256, 256});
      ASSERT_TRUE(plan.ok()) << plan.status();
      std::vector<uint8_t> in(plan->input_bytes, 0x5A), out(plan->output_bytes);
      for (int version : {-1, 0, 1, 4, 100}) {
        Geometry g = *plan->geometry;
        g.mma_version = version;
        bool reached = false;
        EXPECT_FALSE(tiles::DispatchTile(g, [&]<class T>() { reached = true; }))
            << "mma_version " << version;
        EXPECT_FALSE(reached) << "mma_version " << version;

        Plan bad = *plan;
        bad.geometry = std::make_shared<const Geometry>(g);
        const absl::Status s = ConvertOnCpu(bad, in.data(), in.size(), out.data(), out.size());
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
        EXPECT_NE(std::string(s.message()).find("no tiles for mma_version " + std::to_string(version)),
                  std::string::npos)
            << s;
      }
      for (int version : {2, 3}) {
        Geometry g = *plan->geometry;
        g.mma_version = version;
        bool reached = false;
        EXPECT_TRUE(tiles::DispatchTile(g, [&]<class T>() { reached = true; }));
        EXPECT_TRUE(reached);
      }
    }
  }
}

// The one Gcd of the engine (planner alignments, tilings, access choice): std::gcd's
// results, at compile time too.
TEST(Gcd, MatchesStdGcd) {
  static_assert(Gcd(128, 48) == 16);
  static_assert(Gcd(0, 0) == 0);
  EXPECT_EQ(Gcd(0, 64), 64);
  EXPECT_EQ(Gcd(64, 0), 64);
  EXPECT_EQ(Gcd(-12, 18), 6);
  EXPECT_EQ(Gcd(12, -18), 6);
  EXPECT_EQ(Gcd(1, int64_t{1} << 40), 1);
  EXPECT_EQ(Gcd(int64_t{3} << 40, int64_t{6} << 20), int64_t{3} << 21);
}

TEST(Occupancy, FullWhenEveryMultiprocessorHoldsWhatTheKernelWants) {
  const Residency r = MakeResidency(132, 3, 3);
  EXPECT_TRUE(r.full());
  EXPECT_EQ(r.blocks, 396);
  EXPECT_TRUE(MakeResidency(132, 4, 3).full());
}

TEST(Occupancy, FewerBlocksPerMultiprocessorIsReported) {
  const Residency r = MakeResidency(132, 1, 3);
  EXPECT_FALSE(r.full());
  EXPECT_EQ(r.blocks, 132);  // the launch still runs, on what fits
  const std::string w = ResidencyWarning(r, "K", 0);
  EXPECT_NE(w.find("admits 1 resident blocks per multiprocessor, not 3"), std::string::npos) << w;
}

// A failed query once left a launch on one block without a word.
TEST(Occupancy, FailedQueriesAreReported) {
  const Residency no_sms = MakeResidency(0, 0, 2);
  EXPECT_FALSE(no_sms.full());
  EXPECT_EQ(no_sms.blocks, 1);
  EXPECT_NE(ResidencyWarning(no_sms, "K", 1).find("multiprocessor count query failed"),
            std::string::npos);
  const Residency no_occupancy = MakeResidency(132, 0, 2);
  EXPECT_FALSE(no_occupancy.full());
  EXPECT_EQ(no_occupancy.blocks, 132);
  EXPECT_NE(ResidencyWarning(no_occupancy, "K", 1).find("occupancy query failed"),
            std::string::npos);
}

// How many of the 2 x 32768 magnitudes (both roundings) `scale_byte` takes, asserting that it
// gives ScaleBits' byte for every normal one whose byte is in [lo, hi] and 0 for the rest.
template <class ScaleByte, class ToFloat>
int CheckScaleByte(ScaleByte scale_byte, ToFloat to_float, uint32_t normal_lo, uint32_t normal_end, uint32_t lo,
                   uint32_t hi) {
  int taken = 0;
  for (const bool up : {true, false}) {
    for (uint32_t h = 0; h < 0x8000; ++h) {  // magnitudes: the encoder's amax has no sign
      const uint32_t want = qmath::ScaleBits(to_float(static_cast<uint16_t>(h)), up) >> 23;
      const uint32_t got = scale_byte(h, up, lo, hi);
      if (h >= normal_lo && h < normal_end && want >= lo && want <= hi) {
        EXPECT_EQ(got, want) << std::hex << h << " up " << up;
        ++taken;
      } else {
        EXPECT_EQ(got, 0u) << std::hex << h << " up " << up;
      }
    }
  }
  return taken;
}

// The packed encoder's scale byte from amax's bits equals step 2 for every bf16 it takes, and
// it takes every normal amax whose byte is in range.
TEST(QuantizeMath, Bf16ScaleByteIsScaleBitsForEveryBf16) {
  const int taken = CheckScaleByte(qmath::Bf16ScaleByte, qmath::Bf16ToFloat, 0x80u, 0x7F80u, 8, 253);
  EXPECT_GT(taken, 60000);  // 2 x 253 binades x 128, less the scales out of range
}

// The same for the packed fp16 encoder: it takes the normal amax whose scale's multiplier
// 2^(127 - E) is an fp16 normal (E in [112, 141]).
TEST(QuantizeMath, Fp16ScaleByteIsScaleBitsForEveryFp16) {
  const int taken = CheckScaleByte(qmath::Fp16ScaleByte, qmath::Fp16ToFloat, 0x400u, 0x7C00u, 112, 141);
  EXPECT_GT(taken, 55000);  // 2 x 30 binades x 1024, less the few scales out of range
}

// x > 0 rounded to `bits` significant bits, ties to even (the sums below are far from the
// types' exponent limits, and exact in a double for the q they are asked of).
double RoundToBits(double x, int bits) {
  int e = 0;
  std::frexp(x, &e);
  const double unit = std::ldexp(1.0, e - bits);
  return std::nearbyint(x / unit) * unit;  // the default rounding mode: to nearest, ties to even
}

// The packed encoder's code (quantize_cuda.cu, EncodePair): min(RN(2q), RN(q + 2), RN(q/2 + 4), 7),
// each line one FMA of the type with the bias added, equals EncodeE2m1 for every non-negative
// finite q of the type. q in [2^-30, 2^30] keeps every sum exact in a double before the type's
// rounding; below, every line rounds to the bias (the code 0), above, the cap is the min (7).
void CheckCodeLines(uint32_t end, float (*to_float)(uint16_t), int bits, double bias, int want_checked) {
  int checked = 0;
  for (uint32_t h = 0; h < end; ++h) {
    const double q = to_float(static_cast<uint16_t>(h));
    const uint32_t want = qmath::EncodeE2m1(static_cast<float>(q));
    uint32_t got = 0;
    if (q >= std::ldexp(1.0, -30) && q <= std::ldexp(1.0, 30)) {
      const double code = std::min(std::min(RoundToBits(2 * q + bias, bits), RoundToBits(q + bias + 2, bits)),
                                   std::min(RoundToBits(q / 2 + bias + 4, bits), bias + 7)) - bias;
      got = static_cast<uint32_t>(code);
      ++checked;
    } else {
      got = q < 1 ? 0u : 7u;
    }
    EXPECT_EQ(got, want) << std::hex << h << " q " << q;
  }
  EXPECT_EQ(checked, want_checked);
}

TEST(QuantizeMath, CodeLinesAreTheE2m1CodeForEveryBf16) {
  CheckCodeLines(0x7F80u, qmath::Bf16ToFloat, 8, 128.0, 60 * 128 + 1);  // 60 binades, and 2^30
}

TEST(QuantizeMath, CodeLinesAreTheE2m1CodeForEveryFp16) {
  CheckCodeLines(0x7C00u, qmath::Fp16ToFloat, 11, 1024.0, 0x7C00 - 1);  // every fp16 but 0
}

// The fp32 GPU encoder's lines (EncodeE2m1Lines) equal EncodeE2m1 for every float it can
// meet: every bf16 bit pattern (signs, zeros, subnormals, infinities, NaNs) and the floats
// one ulp either side of it, where the lines' steps are; every 16th float in [0.25, 8), the
// codes' range; and a million random bit patterns.
TEST(QuantizeMath, Fp32CodeLinesAreEncodeE2m1) {
  int64_t checked = 0;
  auto check = [&](uint32_t bits) {
    const float q = qmath::BitsFloat(bits);
    ASSERT_EQ(qmath::EncodeE2m1Lines(q), qmath::EncodeE2m1(q)) << std::hex << bits << " q " << q;
    ++checked;
  };
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    check(h << 16);
    check((h << 16) + 1);
    check((h << 16) - 1);
  }
  for (uint32_t bits = qmath::FloatBits(0.25f); bits < qmath::FloatBits(8.0f); bits += 16) check(bits);
  std::mt19937 rng(20261207);
  for (int i = 0; i < 1000000; ++i) check(static_cast<uint32_t>(rng()));
  EXPECT_EQ(checked, 3 * 0x10000 + (5 << 23) / 16 + 1000000);
}

}  // namespace
}  // namespace wprep
