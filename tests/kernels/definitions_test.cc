// The per-byte definitions of layout_math.h, through testing::ReferenceConvert, against
// every reference vector; then the CPU engine (the fast tiles' word-level paths, which
// the CUDA engine runs too) against those definitions on random shapes, parameters and
// views that the vectors do not have.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "golden.h"
#include "layout_math.h"
#include "reference.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

using testing::GoldenSet;

std::vector<uint8_t> Cpu(const Plan& plan, const std::vector<uint8_t>& in, int threads = 2) {
  std::vector<uint8_t> out(plan.output_bytes, 0xEE);  // poison: every byte must be written
  const absl::Status s = ConvertOnCpu(plan, in.data(), in.size(), out.data(), out.size(), {threads});
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

Plan MustPlan(const ConversionSpec& spec, const std::vector<int64_t>& shape,
              const InputBinding& b = {}) {
  auto plan = MakePlan(spec, shape, b);
  EXPECT_TRUE(plan.ok()) << Describe(spec) << ": " << plan.status();
  return plan.ok() ? *plan : Plan{};
}

std::string ShapeName(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s.push_back('x');
    s.append(std::to_string(shape[i]));
  }
  return s;
}

// LAYOUTS.md step 4 written out once more here, independently of layout_math.h.
uint32_t ContractInterleave(uint32_t x) {
  auto s = [](uint32_t n) { return ((n & 8) << 12) | ((n & 7) << 6); };
  auto s4 = [](uint32_t n) { return ((n & 8) << 11) | ((n & 6) << 9) | ((n & 1) << 13); };
  auto f = [&](uint32_t b) { return s(b & 15) | s(b >> 4) << 16; };
  auto g = [&](uint32_t b) { return s4(b & 15) | s4(b >> 4) << 16; };
  return f(x & 255) | f((x >> 8) & 255) >> 3 | f((x >> 16) & 255) >> 6 | g(x >> 24);
}

TEST(Definitions, InterleaveWordIsTheContractAndDeinterleaveWordInvertsIt) {
  std::mt19937 rng(17);
  for (int i = 0; i < 200032; ++i) {
    const uint32_t x = i < 32 ? 1u << i : rng();
    ASSERT_EQ(HopperInterleaveWord(x), ContractInterleave(x)) << x;
    ASSERT_EQ(HopperDeinterleaveWord(HopperInterleaveWord(x)), x) << x;
    ASSERT_EQ(HopperInterleaveWord(HopperDeinterleaveWord(x)), x) << x;
  }
}

TEST(Definitions, ScaleSourcesCoverThePaddedTensorOnce) {
  for (int nw : {1, 2, 4, 8, 16, 32}) {
    for (int mx : {-1, -2}) {
      for (int align_k : {2, 4, 64}) {
        const HopperScaleTiling t = MakeHopperScaleTiling(mx, nw, align_k, 70, 9);
        // 9 groups along the mx axis (mx_axis -1) or 70 (-2), padded to align_k's multiple.
        ASSERT_EQ(t.cols_pad, (t.cols + align_k - 1) / align_k * align_k);
        std::vector<int> hits(t.rows_pad * t.cols_pad, 0);
        for (int64_t orow = 0; orow < t.out_rows; ++orow) {
          for (int64_t ocol = 0; ocol < t.out_cols; ++ocol) {
            int64_t r, col;
            HopperScaleSource(t, orow, ocol, &r, &col);
            ASSERT_LT(r, t.rows_pad);
            ASSERT_LT(col, t.cols_pad);
            ++hits[r * t.cols_pad + col];
          }
        }
        EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), static_cast<long>(hits.size()))
            << "num_warps " << nw << " align_k " << align_k;
      }
    }
  }
  const BlackwellScaleTiling t = MakeBlackwellScaleTiling(13, 200);
  std::vector<int> hits(t.kpad * t.npad, 0);
  for (int64_t i = 0; i < t.kpad * t.npad; ++i) {
    int64_t k, n;
    BlackwellScaleSource(t, i, &k, &n);
    ASSERT_LT(k, t.kpad);
    ASSERT_LT(n, t.npad);
    ++hits[k * t.npad + n];
  }
  EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), static_cast<long>(hits.size()));
}

// The definitions reproduce every reference vector: they are the contract as code.
TEST(Definitions, ReproduceEveryReferenceVector) {
  int checked = 0;
  for (GoldenSet set : {GoldenSet::kValues, GoldenSet::kScales, GoldenSet::kPacking}) {
    for (const auto& c : testing::GoldenCases(set)) {
      if (c.error.has_value()) continue;
      SCOPED_TRACE(c.name);
      const Plan plan = MustPlan(c.spec, c.logical_shape, InputBinding{c.input_strides, {}});
      const auto input = testing::GoldenInput(c);
      ASSERT_EQ(testing::Sha256Hex(input), c.input_sha256);
      EXPECT_EQ(testing::Sha256Hex(testing::ReferenceConvert(plan, input)), c.output_sha256);
      ++checked;
    }
  }
  EXPECT_GT(checked, 250);
}

// The engine's word-level paths equal the definitions, on shapes with every kind of edge
// (odd sizes where allowed, partial tiles, leading dims) and fresh random bytes.
TEST(EngineVsDefinitions, RandomShapesOfEverySpec) {
  std::mt19937_64 rng(4242);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    for (int trial = 0; trial < 4; ++trial) {
      const auto shape = testing::RandomShapeFor(spec, rng(), trial < 2 ? 70 : 300);
      SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape));
      const Plan plan = MustPlan(spec, shape);
      const auto x = testing::RandomBytes(plan.input_bytes, rng());
      EXPECT_EQ(Cpu(plan, x, 1 + trial % 3), testing::ReferenceConvert(plan, x));
    }
  }
}

// Strided, transposed and byte-strided views convert like the dense tensor they show.
TEST(EngineVsDefinitions, ViewsEqualTheDenseConversion) {
  std::mt19937_64 rng(99);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    const auto shape = testing::RandomShapeFor(spec, rng(), 150);
    const Plan dense = MustPlan(spec, shape);
    const auto x = testing::RandomBytes(dense.input_bytes, rng());
    const auto expected = Cpu(dense, x);
    for (const auto& [name, view] : testing::ViewsOf(dense, x)) {
      SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape) + " " + name);
      const Plan strided = MustPlan(spec, shape, InputBinding{view.strides, view.buffer.size()});
      EXPECT_EQ(Cpu(strided, view.buffer), expected);
      EXPECT_EQ(testing::ReferenceConvert(strided, view.buffer), expected);
    }
  }
}

// What loaders pass: scales [E, K/32, N] as the transposed view of the checkpoint's
// [E, N, K/32], with the sizes of a real expert.
TEST(EngineVsDefinitions, LoaderTransposedScaleViews) {
  std::vector<ConversionSpec> specs;
  for (int mx : {-1, -2}) {
    for (int nw : {4, 8}) {
      for (int align_k : {2, 4}) {  // 4: vLLM's sm_90 call pads the 90 groups to 92
        ConversionSpec s;
        s.layout = Layout::kHopperScale;
        s.hopper_scale = {mx, nw, align_k};
        specs.push_back(s);
      }
    }
  }
  ConversionSpec bw;
  bw.layout = Layout::kBlackwellScale;
  specs.push_back(bw);
  // K/32 = 90 groups, N = 2880; and the [2, 4096, 128] view of the scale benchmark's shape,
  // whose mx_axis -2 runs a = 1 are all padding with num_warps 8.
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{4, 90, 2880}, std::vector<int64_t>{2, 4096, 128}}) {
    const int64_t m = shape[1], k = shape[2];
    const auto checkpoint = testing::RandomBytes(static_cast<uint64_t>(shape[0] * m * k), 5);
    const std::vector<int64_t> strides = {m * k, 1, m};
    for (const ConversionSpec& spec : specs) {
      SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape));
      const Plan view = MustPlan(spec, shape, InputBinding{strides, checkpoint.size()});
      EXPECT_EQ(Cpu(view, checkpoint, 2), testing::ReferenceConvert(view, checkpoint));
    }
  }
}

// Dense scales of real experts, both directions: O rows of few blocks (N = 90 groups wide
// with mx_axis -2) and many, and runs of padding (num_warps 8).
TEST(EngineVsDefinitions, DenseExpertScaleShapes) {
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 90, 5760}, std::vector<int64_t>{3, 5760, 90},
                                            std::vector<int64_t>{2, 4096, 128}}) {
    for (Direction dir : {Direction::kSwizzle, Direction::kUnswizzle}) {
      for (int mx : {-1, -2}) {
        for (int nw : {4, 8}) {
          for (int align_k : {2, 4}) {
            ConversionSpec spec;
            spec.layout = Layout::kHopperScale;
            spec.direction = dir;
            spec.hopper_scale = {mx, nw, align_k};
            SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape));
            const Plan plan = MustPlan(spec, shape);
            const auto x = testing::RandomBytes(plan.input_bytes, 17);
            EXPECT_EQ(Cpu(plan, x, 2), testing::ReferenceConvert(plan, x));
          }
        }
      }
    }
  }
}

// A zero stride repeats bytes (a broadcast view): the conversion reads them as given.
TEST(EngineVsDefinitions, BroadcastViewsConvertTheRepeatedTensor) {
  std::vector<ConversionSpec> specs;
  for (const ConversionSpec& s : testing::SweepSpecs()) {
    if (s.direction == Direction::kSwizzle) specs.push_back(s);
  }
  for (const ConversionSpec& spec : specs) {
    const std::vector<int64_t> shape = {3, 64, 96};
    const Plan dense = MustPlan(spec, shape);
    const int64_t matrix = dense.input_bytes / 3;
    const auto one = testing::RandomBytes(static_cast<uint64_t>(matrix), 3);
    std::vector<uint8_t> repeated;
    for (int i = 0; i < 3; ++i) repeated.insert(repeated.end(), one.begin(), one.end());
    std::vector<int64_t> strides = dense.input_strides;
    strides[0] = 0;
    SCOPED_TRACE(Describe(spec));
    const Plan broadcast = MustPlan(spec, shape, InputBinding{strides, one.size()});
    EXPECT_EQ(broadcast.input_bytes, one.size());
    EXPECT_EQ(Cpu(broadcast, one), Cpu(dense, repeated));
  }
}

// Swizzle then unswizzle gives the input back, for every layout and packing; and an
// unswizzle of random storage (padding included) swizzled again is that storage with
// zero padding, which unswizzles to the same tensor: the two are inverses on the
// unpadded region.
TEST(RoundTrip, EveryLayoutAndPacking) {
  std::mt19937_64 rng(31);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    if (spec.direction != Direction::kSwizzle) continue;
    ConversionSpec back = spec;
    back.direction = Direction::kUnswizzle;
    for (int trial = 0; trial < 3; ++trial) {
      const auto shape = testing::RandomShapeFor(spec, rng(), 260);
      SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape));
      const Plan fwd = MustPlan(spec, shape), bwd = MustPlan(back, shape);
      // A swizzle that reads the unswizzle's output as the plan describes it (Hopper
      // scales with mx_axis -2 keep the reference's transposed view where it is dense).
      const Plan fwd_of_output =
          MustPlan(spec, shape, InputBinding{bwd.output_strides, bwd.output_bytes});
      const auto x = testing::RandomBytes(fwd.input_bytes, rng());
      const auto stored = Cpu(fwd, x, 1 + trial);
      ASSERT_EQ(stored.size(), bwd.input_bytes);
      const auto recovered = Cpu(bwd, stored, 2);
      if (bwd.output_strides == fwd.input_strides) {
        EXPECT_EQ(recovered, x);
      }
      EXPECT_EQ(Cpu(fwd_of_output, recovered), stored);

      const auto junk = testing::RandomBytes(bwd.input_bytes, rng());
      const auto tensor = Cpu(bwd, junk);
      const auto restored = Cpu(fwd_of_output, tensor);
      EXPECT_EQ(restored, testing::ReferenceConvert(fwd_of_output, tensor));
      EXPECT_EQ(Cpu(bwd, restored), tensor);
    }
  }
}

// Packing -2 on the canonical side equals packing -1 of the same logical tensor: a swizzle
// from checkpoint order produces the same storage bytes, an unswizzle to it the packing -2
// form of what the packing -1 unswizzle recovers.
TEST(Packing, CheckpointOrderIsTheSameLogicalTensor) {
  std::mt19937_64 rng(7);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    if (spec.packing_axis != -2) continue;
    ConversionSpec p1 = spec;
    p1.packing_axis = -1;
    // Shapes both packings accept: both last dims even.
    auto shape = testing::RandomShapeFor(spec, rng(), 200);
    for (size_t i = shape.size() - 2; i < shape.size(); ++i) shape[i] += shape[i] % 2;
    SCOPED_TRACE(Describe(spec) + " " + ShapeName(shape));
    const Plan plan2 = MustPlan(spec, shape), plan1 = MustPlan(p1, shape);
    if (spec.direction == Direction::kSwizzle) {
      const auto canonical = testing::RandomBytes(plan1.input_bytes, rng());
      EXPECT_EQ(Cpu(plan2, testing::RepackToPacking2(canonical, shape)), Cpu(plan1, canonical));
      EXPECT_EQ(plan2.output_shape, plan1.output_shape);
      EXPECT_EQ(plan2.output_strides, plan1.output_strides);
    } else {
      const auto stored = testing::RandomBytes(plan1.input_bytes, rng());
      EXPECT_EQ(Cpu(plan2, stored), testing::RepackToPacking2(Cpu(plan1, stored), shape));
    }
  }
}

TEST(Packing, OddSizesAreRejectedOnlyWherePacked) {
  auto spec = [](Layout l, int packing, int mx = -2) {
    ConversionSpec s;
    s.layout = l;
    s.packing_axis = packing;
    s.hopper.mx_axis = mx;
    return s;
  };
  struct Case {
    ConversionSpec spec;
    std::vector<int64_t> shape;
    bool ok;
  };
  const std::vector<Case> cases = {
      // Checkpoint order packs D0; Blackwell storage packs K = D0 as well, so N may be odd.
      {spec(Layout::kBlackwellValue, -2), {8, 5}, true},
      {spec(Layout::kBlackwellShuffledValue, -2), {8, 5}, true},
      {spec(Layout::kBlackwellValue, -1), {8, 5}, false},
      {spec(Layout::kBlackwellValue, -2), {5, 8}, false},
      {spec(Layout::kBlackwellValue, -2), {3, 0}, false},
      {spec(Layout::kBlackwellValue, -1), {0, 3}, false},
      // Hopper mx_axis -2 packs D0 in storage: from checkpoint order D1 may be odd.
      {spec(Layout::kHopperValue, -2, -2), {8, 5}, true},
      {spec(Layout::kHopperValue, -2, -1), {8, 5}, false},
      {spec(Layout::kHopperValue, -2, -1), {5, 8}, false},
      {spec(Layout::kHopperValue, -2, -2), {7, 0}, false},
      // Scales pack nothing.
      {spec(Layout::kHopperScale, -1), {7, 5}, true},
      {spec(Layout::kBlackwellScale, -1), {7, 5}, true},
  };
  for (const Case& c : cases) {
    auto plan = MakePlan(c.spec, c.shape);
    EXPECT_EQ(plan.ok(), c.ok) << Describe(c.spec) << " " << ShapeName(c.shape) << ": "
                               << plan.status();
    if (!c.ok) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(EmptyTensors, EveryNewSpecPlansAndConvertsNothing) {
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    for (auto shape : std::vector<std::vector<int64_t>>{{0, 256}, {256, 0}, {0, 0}, {3, 0, 8, 8}}) {
      auto plan = MakePlan(spec, shape);
      ASSERT_TRUE(plan.ok()) << Describe(spec) << " " << ShapeName(shape) << ": " << plan.status();
      EXPECT_TRUE(plan->empty());
      EXPECT_TRUE(ConvertOnCpu(*plan, nullptr, 0, nullptr, 0).ok()) << Describe(spec);
    }
  }
}

}  // namespace
}  // namespace wprep
