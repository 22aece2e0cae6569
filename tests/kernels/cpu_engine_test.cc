// Properties of the CPU engine on random shapes: round trips, retile as a composition,
// strided inputs, thread counts, and the engine's own argument checks.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "golden.h"
#include "hopper_cpu.h"
#include "layout_math.h"
#include "nibble_cpu.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

std::vector<uint8_t> Convert(const Plan& plan, const std::vector<uint8_t>& in, int threads = 2) {
  std::vector<uint8_t> out(plan.output_bytes, 0xEE);
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

ConversionSpec With(ConversionSpec s, Direction d) {
  s.direction = d;
  return s;
}

// Every spec of the closed set the tests sweep.
std::vector<ConversionSpec> AllSwizzleSpecs() {
  std::vector<ConversionSpec> specs;
  for (int mx : {-1, -2}) {
    for (int mma : {2, 3}) {
      ConversionSpec s;
      s.layout = Layout::kHopperValue;
      s.hopper = {mx, mma};
      specs.push_back(s);
    }
  }
  // {128, 20}: the word-level Blackwell tile with tile_n not a multiple of 8, so a
  // swizzle thread's eight storage rows can straddle two N tiles.
  for (auto [bk, bn] : std::vector<std::pair<int, int>>{
           {128, 256}, {256, 128}, {64, 64}, {6, 10}, {384, 48}, {128, 20}}) {
    ConversionSpec s;
    s.layout = Layout::kBlackwellShuffledValue;
    s.blackwell = {bk, bn};
    specs.push_back(s);
  }
  return specs;
}

std::vector<int64_t> RandomShape(std::mt19937_64& rng) {
  auto dim = [&](int max) { return static_cast<int64_t>(rng() % max) + 1; };
  std::vector<int64_t> shape;
  const int lead = static_cast<int>(rng() % 3);
  for (int i = 0; i < lead; ++i) shape.push_back(dim(3));
  shape.push_back(2 * dim(300));
  shape.push_back(2 * dim(300));
  return shape;
}

TEST(FastDivisor, EqualsDivisionBelow2To31) {
  std::mt19937 rng(5);
  for (uint32_t d : {1u, 2u, 3u, 5u, 7u, 10u, 32u, 48u, 64u, 96u, 128u, 192u, 255u, 256u, 1000u, 2048u, 4095u}) {
    const FastDivisor fd(d);
    for (uint32_t x : {0u, 1u, d - 1, d, d + 1, 2 * d - 1, 2 * d, 0x7FFFFFFFu, 0x7FFFFFFFu - d}) {
      ASSERT_EQ(fd.Div(x), x / d) << x << " / " << d;
    }
    for (int i = 0; i < 20000; ++i) {
      const uint32_t x = rng() & 0x7FFFFFFFu;
      ASSERT_EQ(fd.Div(x), x / d) << x << " / " << d;
    }
  }
}

// LAYOUTS.md step 4, written out as the contract states it.
uint32_t ContractS(uint32_t n) { return ((n & 8) << 12) | ((n & 7) << 6); }
uint32_t ContractS4(uint32_t n) { return ((n & 8) << 11) | ((n & 6) << 9) | ((n & 1) << 13); }
uint32_t ContractF(uint32_t b) { return ContractS(b & 15) | ContractS(b >> 4) << 16; }
uint32_t ContractG(uint32_t b) { return ContractS4(b & 15) | ContractS4(b >> 4) << 16; }
uint32_t ContractInterleave(uint32_t x) {
  return ContractF(x & 255) | ContractF((x >> 8) & 255) >> 3 | ContractF((x >> 16) & 255) >> 6 |
         ContractG(x >> 24);
}

TEST(InterleaveWord, GatheredInterleaveIsABijectionAndDeinterleaveInvertsIt) {
  uint32_t seen = 0;
  for (int i = 0; i < 32; ++i) {
    const uint32_t w = HopperInterleaveGathered(1u << i);
    EXPECT_EQ(__builtin_popcount(w), 1) << "bit " << i;
    seen |= w;
    EXPECT_EQ(HopperDeinterleaveGathered(w), 1u << i);
  }
  EXPECT_EQ(seen, 0xFFFFFFFFu);
  std::mt19937 rng(7);
  for (int i = 0; i < 10000; ++i) {
    const uint32_t x = rng();
    EXPECT_EQ(HopperDeinterleaveGathered(HopperInterleaveGathered(x)), x);
  }
}

TEST(HopperPlacement, SourceInvertsPlace) {
  for (int mma : {2, 3}) {
    for (int r = 0; r < 256; ++r) {
      for (int c = 0; c < 64; ++c) {
        int orow, ocol, r2, c2;
        HopperPlace(r, c, mma, &orow, &ocol);
        ASSERT_LT(ocol, 4 * 64);
        HopperSource(orow, ocol, mma, &r2, &c2);
        ASSERT_EQ(r2, r);
        ASSERT_EQ(c2, c);
      }
    }
  }
}

// The word-level forms used by the fast tiles equal the per-byte definitions.
TEST(WordForms, PairTransposeMatchesPairNibbles) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 1000; ++trial) {
    uint32_t in[8], out[8], back[8];
    for (auto& w : in) w = rng();
    PairTranspose8x4(in, out);
    for (int m = 0; m < 8; ++m) {
      for (int t = 0; t < 4; ++t) {
        const int p = m / 2, h = m % 2;
        const uint32_t a = (in[2 * t] >> (8 * p)) & 255, b = (in[2 * t + 1] >> (8 * p)) & 255;
        ASSERT_EQ((out[m] >> (8 * t)) & 255, PairNibbles(a, b, h)) << "m=" << m << " t=" << t;
      }
    }
    PairTranspose8x4(out, back);
    for (int r = 0; r < 8; ++r) ASSERT_EQ(back[r], in[r]);
  }
}

// Byte i of x, nibble h.
uint32_t Nib(uint32_t x, int i, int h) { return (x >> (8 * i + 4 * h)) & 15; }

TEST(WordForms, GatheredInterleaveMatchesInterleaveWord) {
  // Both are bit permutations written as ORs of disjoint fields (linear maps), so single
  // bits decide; random words check again.
  auto gather = [](uint32_t x) {
    uint32_t g = 0;
    const int order[4] = {2, 1, 3, 0};  // G's nibbles: b2, b1, b3, b0 per half
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) g |= Nib(x, order[k], h) << (16 * h + 4 * k);
    }
    return g;
  };
  std::mt19937 rng(5);
  for (int i = 0; i < 100032; ++i) {
    const uint32_t x = i < 32 ? 1u << i : rng();
    ASSERT_EQ(HopperInterleaveGathered(gather(x)), ContractInterleave(x)) << x;
    ASSERT_EQ(HopperDeinterleaveGathered(ContractInterleave(x)), gather(x)) << x;
  }
}

TEST(WordForms, CanonicalInterleaveTakesTheDocumentedNibbles) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 1000; ++trial) {
    uint32_t x[4], y[4], out[8], x2[4], y2[4];
    for (int i = 0; i < 4; ++i) {
      x[i] = rng();
      y[i] = rng();
    }
    HopperInterleaveCanonical(x, y, out);
    for (int t0 = 0; t0 < 4; ++t0) {
      for (int s0 = 0; s0 < 2; ++s0) {
        // x = (lo b2, lo b3, hi b2, hi b3), y = (lo b1, lo b0, hi b1, hi b0).
        const uint32_t b0 = Nib(y[1], t0, s0) | Nib(y[3], t0, s0) << 4;
        const uint32_t b1 = Nib(y[0], t0, s0) | Nib(y[2], t0, s0) << 4;
        const uint32_t b2 = Nib(x[0], t0, s0) | Nib(x[2], t0, s0) << 4;
        const uint32_t b3 = Nib(x[1], t0, s0) | Nib(x[3], t0, s0) << 4;
        ASSERT_EQ(out[2 * t0 + s0], ContractInterleave(b0 | b1 << 8 | b2 << 16 | b3 << 24))
            << "t0=" << t0 << " s0=" << s0;
      }
    }
    HopperDeinterleaveCanonical(out, x2, y2);
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(x2[i], x[i]);
      ASSERT_EQ(y2[i], y[i]);
    }
  }
}

template <int kMma>
void CheckHopperBlocks() {
  std::mt19937 rng(kMma);
  // Q: 16 rows x 32 columns (one r0 group, one cr group); O: 4 rows x 128 bytes.
  uint8_t q[16][32], o[4][128];
  for (auto& row : q) {
    for (auto& b : row) b = static_cast<uint8_t>(rng());
  }
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 32; ++c) {
      int orow, ocol;
      HopperPlace(r, c, kMma, &orow, &ocol);
      o[orow][ocol] = q[r][c];
    }
  }
  for (int t0 = 0; t0 < 4; ++t0) {
    for (int s0 = 0; s0 < 2; ++s0) {
      uint32_t q0[8], q1[8], packed[16], u0[8], u1[8];
      std::memcpy(q0, q[2 * t0 + s0], 32);
      std::memcpy(q1, q[8 + 2 * t0 + s0], 32);
      HopperPackBlock<kMma>(q0, q1, packed);
      for (int w = 0; w < 16; ++w) {
        uint32_t placed;
        std::memcpy(&placed, &o[t0][64 * s0 + 4 * w], 4);
        ASSERT_EQ(packed[w], ContractInterleave(placed)) << "t0=" << t0 << " s0=" << s0 << " w=" << w;
      }
      HopperUnpackBlock<kMma>(packed, u0, u1);
      ASSERT_EQ(std::memcmp(u0, q0, 32), 0);
      ASSERT_EQ(std::memcmp(u1, q1, 32), 0);
    }
    // The CPU passes' pair form (both blocks of the O row's 128-byte chunk at once; AVX2
    // lanes for mma 3 where the CPU has AVX2).
    uint8_t pair[128], back[4][32];
    const uint8_t* pieces[4] = {q[2 * t0], q[8 + 2 * t0], q[2 * t0 + 1], q[9 + 2 * t0]};
    cpu_hopper::PackPair<kMma>(pieces[0], pieces[1], pieces[2], pieces[3], pair);
    for (int w = 0; w < 32; ++w) {
      uint32_t placed, got;
      std::memcpy(&placed, &o[t0][4 * w], 4);
      std::memcpy(&got, pair + 4 * w, 4);
      ASSERT_EQ(got, ContractInterleave(placed)) << "pair: t0=" << t0 << " w=" << w;
    }
    cpu_hopper::UnpackPair<kMma>(pair, back[0], back[1], back[2], back[3]);
    for (int i = 0; i < 4; ++i) ASSERT_EQ(std::memcmp(back[i], pieces[i], 32), 0) << "pair: t0=" << t0 << " piece " << i;
  }
}

TEST(WordForms, HopperPackBlockMatchesPlaceAndInterleave) {
  for (int i = 0; i < 20; ++i) {
    CheckHopperBlocks<2>();
    CheckHopperBlocks<3>();
  }
}

// The nibble transpose block (Blackwell layouts from and to canonical storage) in each of
// its instruction sets equals the per-nibble definition on random rows.
TEST(NibbleBlock, EveryVariantEqualsTheDefinition) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<uint8_t> x = testing::RandomBytes(32 * 48, rng());  // rows 48 bytes apart
    const uint8_t* xs[32];
    for (int i = 0; i < 32; ++i) xs[i] = x.data() + 48 * i + trial % 7;
    auto run = [&](auto block) {
      std::vector<uint8_t> y(32 * 40, 0xEE);
      uint8_t* ys[32];
      for (int n = 0; n < 32; ++n) ys[n] = y.data() + 40 * n + trial % 5;
      block(xs, ys);
      return y;
    };
    const std::vector<uint8_t> want = run(cpu_nibble::BlockScalar);
    for (int n = 0; n < 32; ++n) {  // the definition, spelled out for one byte a row
      const int k = (n + trial) % 16, s = 4 * (n & 1);
      const int lo = (xs[2 * k][n / 2] >> s) & 15, hi = (xs[2 * k + 1][n / 2] >> s) & 15;
      ASSERT_EQ(want[40 * n + trial % 5 + k], lo | hi << 4) << n;
    }
    // Each variant with the rows as pointer arrays and as runs (a first row and a step).
    auto runs = [&](auto block) {
      std::vector<uint8_t> y(32 * 40, 0xEE);
      block(cpu_nibble::RowsAt<const uint8_t>{x.data() + trial % 7, 48}, cpu_nibble::RowsAt<uint8_t>{y.data() + trial % 5, 40});
      return y;
    };
    auto both = [&](auto block) {
      EXPECT_EQ(run(block), want);
      EXPECT_EQ(runs(block), want);
    };
    both([](auto src, auto dst) { cpu_nibble::Block(src, dst); });
#if defined(__SSE2__)
    both([](auto src, auto dst) { cpu_nibble::BlockSse2(src, dst); });
#endif
#if defined(WPREP_NIBBLE_AVX2)
    if (cpu_nibble::HasAvx2()) both([](auto src, auto dst) { cpu_nibble::BlockAvx2(src, dst); });
#endif
  }
}

TEST(CpuRoundTrip, UnswizzleOfSwizzleIsIdentityOnRandomShapes) {
  std::mt19937_64 rng(1234);
  for (const ConversionSpec& spec : AllSwizzleSpecs()) {
    for (int trial = 0; trial < 6; ++trial) {
      const std::vector<int64_t> shape = RandomShape(rng);
      SCOPED_TRACE(Describe(spec));
      const Plan fwd = MustPlan(spec, shape);
      const Plan back = MustPlan(With(spec, Direction::kUnswizzle), shape);
      const auto x = testing::RandomBytes(fwd.input_bytes, rng());
      const auto stored = Convert(fwd, x, 1 + trial % 3);
      ASSERT_EQ(stored.size(), back.input_bytes);
      EXPECT_EQ(Convert(back, stored, 1 + trial % 2), x);
    }
  }
}

TEST(CpuRoundTrip, SwizzleIgnoresNothingAndWritesZeroPadding) {
  // Swizzling then unswizzling through different thread counts gives identical storage,
  // and padding bytes are zero (so the poison value 0xEE never survives).
  const std::vector<int64_t> shape = {2, 130, 66};
  for (const ConversionSpec& spec : AllSwizzleSpecs()) {
    const Plan fwd = MustPlan(spec, shape);
    const auto x = testing::RandomBytes(fwd.input_bytes, 99);
    const auto a = Convert(fwd, x, 1);
    const auto b = Convert(fwd, x, 4);
    EXPECT_EQ(a, b) << Describe(spec);
    const auto zeros = std::vector<uint8_t>(fwd.input_bytes, 0);
    const auto z = Convert(fwd, zeros, 1);
    EXPECT_EQ(std::count(z.begin(), z.end(), 0), static_cast<long>(z.size())) << Describe(spec);
  }
}

TEST(CpuRetile, EqualsUnswizzleThenSwizzleAndRoundTrips) {
  std::mt19937_64 rng(77);
  const std::vector<std::pair<BlackwellParams, BlackwellParams>> pairs = {
      {{128, 256}, {256, 128}}, {{64, 64}, {128, 256}}, {{6, 10}, {128, 128}}, {{384, 48}, {64, 32}}};
  for (const auto& [from, to] : pairs) {
    for (int trial = 0; trial < 4; ++trial) {
      const auto shape = RandomShape(rng);
      ConversionSpec sa;
      sa.layout = Layout::kBlackwellShuffledValue;
      sa.blackwell = from;
      ConversionSpec sb = sa;
      sb.blackwell = to;
      ConversionSpec retile = sa;
      retile.direction = Direction::kRetile;
      retile.blackwell_to = to;
      ConversionSpec back = retile;
      back.blackwell = to;
      back.blackwell_to = from;
      SCOPED_TRACE(Describe(retile));

      // Random storage bytes, padding included: retile must ignore the input padding.
      const Plan p_retile = MustPlan(retile, shape);
      const auto stored_a = testing::RandomBytes(p_retile.input_bytes, rng());
      const auto direct = Convert(p_retile, stored_a);
      const auto canonical = Convert(MustPlan(With(sa, Direction::kUnswizzle), shape), stored_a);
      const auto composed = Convert(MustPlan(sb, shape), canonical);
      EXPECT_EQ(direct, composed);
      // A -> B -> A returns A's storage with zero padding: equal to swizzle(canonical).
      const auto again = Convert(MustPlan(back, shape), direct);
      EXPECT_EQ(again, Convert(MustPlan(sa, shape), canonical));
    }
  }
}

// A strided view of the input must convert exactly like its dense copy.
TEST(CpuStrided, StridedInputsMatchDenseCopies) {
  std::mt19937_64 rng(5);
  for (const ConversionSpec& base : AllSwizzleSpecs()) {
    std::vector<ConversionSpec> specs = {base, With(base, Direction::kUnswizzle)};
    if (base.layout == Layout::kBlackwellShuffledValue) {
      ConversionSpec r = base;
      r.direction = Direction::kRetile;
      r.blackwell_to = {128, 256};
      specs.push_back(r);
    }
    for (const ConversionSpec& spec : specs) {
      for (int64_t pad : {16, 3}) {  // aligned (vector path) and unaligned (byte path)
        const std::vector<int64_t> shape = {3, 2 * static_cast<int64_t>(rng() % 150 + 1), 2 * static_cast<int64_t>(rng() % 150 + 1)};
        const Plan dense = MustPlan(spec, shape);
        const auto x = testing::RandomBytes(dense.input_bytes, rng());
        const auto [buffer, strides] = testing::MakeStridedInput(dense, x, pad);
        const Plan strided = MustPlan(spec, shape, InputBinding{strides, buffer.size()});
        SCOPED_TRACE(Describe(spec) + " pad=" + std::to_string(pad));
        EXPECT_EQ(Convert(strided, buffer), Convert(dense, x));
      }
    }
  }
}

// Scales as loaders pass them, the transposed view [..., K/32, N] of a checkpoint's
// [..., N, K/32] (blackwell_scale takes the interleave pass for it): the same bytes as
// the dense swizzle (the layout's tiles, held to the reference vectors) of the
// transposed tensor made here, for ragged and odd shapes, one and two leading dims, and
// hopper_scale alongside.
TEST(CpuStrided, TransposedCheckpointScaleViewsEqualTheDenseSwizzle) {
  std::mt19937_64 rng(29);
  const std::vector<std::vector<int64_t>> shapes = {
      {4, 90, 300}, {3, 5, 129}, {2, 3, 17, 129}, {1, 1, 1}, {2, 8, 256}, {1, 224, 40}, {5, 64, 7}, {16, 90, 1000},
      {2, 68, 250000}};  // the last: over 32 MiB out, which the interleave pass writes with streaming stores
  for (const std::vector<int64_t>& shape : shapes) {
    const size_t r = shape.size();
    const int64_t g = shape[r - 2], n = shape[r - 1];
    int64_t e = 1;
    for (size_t i = 0; i + 2 < r; ++i) e *= shape[i];
    const std::vector<uint8_t> checkpoint = testing::RandomBytes(static_cast<uint64_t>(e * n * g), rng());
    std::vector<uint8_t> dense(checkpoint.size());  // [E, G, N]
    for (int64_t x = 0; x < e; ++x) {
      for (int64_t k = 0; k < g; ++k) {
        for (int64_t c = 0; c < n; ++c) dense[(x * g + k) * n + c] = checkpoint[(x * n + c) * g + k];
      }
    }
    const std::vector<int64_t> strides = testing::CheckpointScaleViewStrides(shape);
    for (Layout layout : {Layout::kBlackwellScale, Layout::kHopperScale}) {
      ConversionSpec spec;
      spec.layout = layout;
      spec.direction = Direction::kSwizzle;
      SCOPED_TRACE(Describe(spec) + " " + ::testing::PrintToString(shape));
      const Plan view = MustPlan(spec, shape, InputBinding{strides, checkpoint.size()});
      const Plan plain = MustPlan(spec, shape);
      for (int threads : {1, 2}) {
        std::vector<uint8_t> got(view.output_bytes, 0xEE), want(plain.output_bytes, 0xDD);
        CpuOptions o;
        o.threads = threads;
        ASSERT_TRUE(ConvertOnCpu(view, checkpoint.data(), checkpoint.size(), got.data(), got.size(), o).ok());
        ASSERT_TRUE(ConvertOnCpu(plain, dense.data(), dense.size(), want.data(), want.size(), o).ok());
        EXPECT_EQ(got, want);
      }
    }
  }
}

// Blackwell value swizzles from canonical storage whose output is at least 32 MiB (the
// nibble pass; shuffled tiles 64 bytes along K go out with streaming stores): the same
// bytes as each matrix converted on its own (16 MiB, ordinary stores), with ragged K (a
// last 64-byte step that is not whole) and N (edge blocks among the streamed ones).
TEST(CpuEngine, StreamedBlackwellSwizzlesEqualEachMatrixAlone) {
  std::mt19937_64 rng(41);
  ConversionSpec plain;
  plain.layout = Layout::kBlackwellValue;
  ConversionSpec shuffled;
  shuffled.layout = Layout::kBlackwellShuffledValue;
  shuffled.blackwell = {128, 256};
  for (const ConversionSpec& spec : {plain, shuffled}) {
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{3, 4096, 8192}, {3, 4100, 8170}}) {
      SCOPED_TRACE(Describe(spec) + " " + ::testing::PrintToString(shape));
      const Plan all = MustPlan(spec, shape);
      const Plan one = MustPlan(spec, {1, shape[1], shape[2]});
      ASSERT_GE(all.output_bytes, uint64_t{32} << 20);
      ASSERT_LT(one.output_bytes, uint64_t{32} << 20);
      const std::vector<uint8_t> x = testing::RandomBytes(all.input_bytes, rng());
      const std::vector<uint8_t> got = Convert(all, x);
      for (int64_t e = 0; e < shape[0]; ++e) {
        const auto in_e = x.begin() + static_cast<int64_t>(e * one.input_bytes);
        const std::vector<uint8_t> want = Convert(one, std::vector<uint8_t>(in_e, in_e + one.input_bytes));
        const auto out_e = got.begin() + static_cast<int64_t>(e * one.output_bytes);
        EXPECT_TRUE(std::equal(want.begin(), want.end(), out_e)) << "matrix " << e;
      }
    }
  }
}

TEST(CpuEngine, RejectsShortBuffersAndOverlap) {
  ConversionSpec spec;
  const Plan plan = MustPlan(spec, {256, 256});
  std::vector<uint8_t> in(plan.input_bytes), out(plan.output_bytes);
  EXPECT_EQ(ConvertOnCpu(plan, in.data(), in.size() - 1, out.data(), out.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConvertOnCpu(plan, in.data(), in.size(), out.data(), out.size() - 1).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> both(plan.output_bytes + plan.input_bytes);
  EXPECT_EQ(ConvertOnCpu(plan, both.data(), plan.input_bytes, both.data() + 16, plan.output_bytes)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A plan assembled by hand carries no engine geometry: refused with a status, never run.
TEST(CpuEngine, RejectsPlansNotMadeByMakePlan) {
  ConversionSpec spec;
  Plan plan = MustPlan(spec, {256, 256});
  plan.geometry = nullptr;
  std::vector<uint8_t> in(plan.input_bytes), out(plan.output_bytes);
  const absl::Status s = ConvertOnCpu(plan, in.data(), in.size(), out.data(), out.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("MakePlan"), std::string::npos) << s;
}

TEST(CpuEngine, EmptyTensorsSucceedWithoutTouchingBuffers) {
  for (auto shape : std::vector<std::vector<int64_t>>{{0, 256}, {256, 0}, {4, 0, 2, 2}}) {
    for (const ConversionSpec& spec : AllSwizzleSpecs()) {
      const Plan plan = MustPlan(spec, shape);
      EXPECT_TRUE(ConvertOnCpu(plan, nullptr, 0, nullptr, plan.output_bytes).ok());
    }
  }
}

}  // namespace
}  // namespace wprep
