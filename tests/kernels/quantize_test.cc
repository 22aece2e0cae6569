// quantize_mxfp4 on the CPU: the reference vectors (tests/data/golden_quant, produced by
// upstream triton_kernels' _downcast_to_mxfp), hand-derived edge cases, and validation.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "golden.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/kernels/moe.h"
#include "wprep/kernels/quantize.h"

namespace wprep {
namespace {

std::string QuantDataDir() { return testing::TestDataDir("golden_quant") + "/"; }

using testing::ReadFile;

struct Result {
  std::vector<uint8_t> values, scales;
};

Result Quantize(QuantDtype dtype, std::vector<int64_t> shape, const std::vector<uint8_t>& in,
                ScaleRounding rounding = ScaleRounding::kUp) {
  auto plan = MakeQuantizePlan(dtype, shape, rounding);
  EXPECT_TRUE(plan.ok()) << plan.status();
  Result r;
  r.values.assign(plan->values_bytes, 0xAB);  // poison: every byte must be written
  r.scales.assign(plan->scales_bytes, 0xAB);
  absl::Status s = QuantizeOnCpu(*plan, in.data(), in.size(), r.values.data(), r.values.size(),
                                 r.scales.data(), r.scales.size());
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

std::vector<uint8_t> Bf16Bytes(const std::vector<uint16_t>& v) {
  std::vector<uint8_t> out;
  for (uint16_t h : v) {
    out.push_back(static_cast<uint8_t>(h));
    out.push_back(static_cast<uint8_t>(h >> 8));
  }
  return out;
}

TEST(Quantize, MatchesEveryGoldenCaseByteForByte) {
  const std::string dir = QuantDataDir();
  std::ifstream mf(dir + "manifest.json");
  ASSERT_TRUE(mf.good());
  nlohmann::json manifest = nlohmann::json::parse(mf);
  ASSERT_EQ(manifest["cases"].size(), 40u);
  for (const auto& c : manifest["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    ASSERT_EQ(c["op"], "quantize_mxfp4");
    auto dtype = ParseQuantDtype(c["input_dtype"].get<std::string>());
    ASSERT_TRUE(dtype.ok());
    auto rounding = ParseScaleRounding(c["params"]["scale_rounding"].get<std::string>());
    ASSERT_TRUE(rounding.ok());
    std::vector<int64_t> shape = c["input_shape"].get<std::vector<int64_t>>();
    auto plan = MakeQuantizePlan(*dtype, shape, *rounding);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->values_shape, c["values_shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(plan->scales_shape, c["scales_shape"].get<std::vector<int64_t>>());
    Result r = Quantize(*dtype, shape, ReadFile(dir + c["input"].get<std::string>()), *rounding);
    EXPECT_EQ(r.values, ReadFile(dir + c["values"].get<std::string>()));
    EXPECT_EQ(r.scales, ReadFile(dir + c["scales"].get<std::string>()));
  }
}

// Values picked so each step of the contract is visible by hand (bf16 bits):
// amax 6.0 -> ds 1.0 -> scale 127 either way; codes are the e2m1 grid itself.
TEST(Quantize, EncodesTheE2m1GridAtUnitScale) {
  // 0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6, 0.25 (tie -> 0), 0.75 (tie -> 1.0), 5 (tie -> 4),
  // 2.5 (tie -> 2), 7 (saturates to 6).
  std::vector<uint16_t> x = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                             0xBF00, 0xC0C0, 0x3E80, 0x3F40, 0x40A0, 0x4020};
  x.resize(32, 0x0000);
  for (ScaleRounding r : {ScaleRounding::kUp, ScaleRounding::kDown}) {
    Result q = Quantize(QuantDtype::kBfloat16, {32}, Bf16Bytes(x), r);
    ASSERT_EQ(q.scales, std::vector<uint8_t>{127});
    std::vector<uint8_t> want = {0x10, 0x32, 0x54, 0x76, 0xF9, 0x20, 0x46, 0x00};
    want.resize(16, 0x00);
    EXPECT_EQ(q.values, want);
  }
}

TEST(Quantize, RaggedLastGroupAndOddLengthAreScaledOnTheirOwn) {
  // Q = 35: group 0 has amax 6 (scale 127), group 1 (3 values) has amax 12 (scale 128).
  std::vector<uint16_t> x(35, 0x3F80);     // 1.0
  x[0] = 0x40C0;                           // 6.0
  x[32] = 0x4140;                          // 12.0 -> 6.0 at scale 2 -> code 7
  x[33] = 0x4000;                          // 2.0 -> 1.0 -> code 2
  x[34] = 0xC080;                          // -4.0 -> -2.0 -> code 0xC
  Result q = Quantize(QuantDtype::kBfloat16, {1, 35}, Bf16Bytes(x));
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{127, 128}));
  ASSERT_EQ(q.values.size(), 18u);
  EXPECT_EQ(q.values[0], 0x27);
  EXPECT_EQ(q.values[1], 0x22);
  EXPECT_EQ(q.values[16], 0x27);
  EXPECT_EQ(q.values[17], 0x0C);  // odd Q: the unused high nibble is zero
}

TEST(Quantize, ZeroGroupGetsScaleZeroAndSignedZeroCodes) {
  std::vector<uint16_t> x(32, 0x0000);
  x[1] = 0x8000;  // -0.0 keeps its sign: code 8 (the contract multiplies by qs = 0)
  Result q = Quantize(QuantDtype::kBfloat16, {32}, Bf16Bytes(x));
  EXPECT_EQ(q.scales, std::vector<uint8_t>{0});
  EXPECT_EQ(q.values[0], 0x80);
  for (size_t i = 1; i < q.values.size(); ++i) EXPECT_EQ(q.values[i], 0) << i;
}

TEST(Quantize, InfinitySetsScale255AndNaNIsIgnoredByAmax) {
  std::vector<uint16_t> x(64, 0x3F80);  // 1.0
  x[0] = 0x7F80;                        // +inf in group 0: ds = inf -> e = 0xFF, qs = 0
  x[32] = 0xFFC0;                       // -NaN in group 1: amax stays 6.0 -> scale 127
  x[33] = 0x40C0;                       // 6.0
  Result q = Quantize(QuantDtype::kBfloat16, {64}, Bf16Bytes(x));
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{255, 127}));
  EXPECT_EQ(q.values[0], 0x07);  // inf * 0 = NaN -> saturates to code 7; 1.0 * 0 = 0
  for (int i = 1; i < 16; ++i) EXPECT_EQ(q.values[i], 0x00) << i;
  EXPECT_EQ(q.values[16], 0x77);  // NaN, whatever its sign -> code 7; 6.0 -> code 7
  EXPECT_EQ(q.values[17], 0x22);
}

TEST(Quantize, SubnormalGroupRoundsUpToScaleOneAndDownToZero) {
  std::vector<uint16_t> x(32, 0x0000);
  x[0] = 0x0040;  // bf16 subnormal 2^-127: ds = 2^-127 / 6 is subnormal too
  Result up = Quantize(QuantDtype::kBfloat16, {32}, Bf16Bytes(x), ScaleRounding::kUp);
  Result down = Quantize(QuantDtype::kBfloat16, {32}, Bf16Bytes(x), ScaleRounding::kDown);
  EXPECT_EQ(up.scales, std::vector<uint8_t>{1});
  EXPECT_EQ(down.scales, std::vector<uint8_t>{0});
  EXPECT_EQ(down.values[0], 0x00);
  // up: q = 2^-127 * 2^126 = 0.5 -> code 1
  EXPECT_EQ(up.values[0], 0x01);
}

// bf16 widens exactly to fp32 and to fp16 (for values in fp16 range with <= 8 mantissa bits),
// so the three dtypes must agree on such data.
TEST(Quantize, Float16AndFloat32InputsAgreeWithBfloat16OnTheSameValues) {
  std::vector<uint16_t> bf;
  std::vector<uint8_t> f32, f16;
  uint32_t s = 12345;
  for (int i = 0; i < 3 * 70; ++i) {
    s = s * 1664525u + 1013904223u;
    // exponent in [-10, 5], 3 mantissa bits, random sign: exact in all three dtypes
    int exp = static_cast<int>((s >> 8) % 16) - 10;
    uint32_t man = (s >> 16) & 7u;
    uint32_t sign = (s >> 31) & 1u;
    uint32_t f = sign << 31 | static_cast<uint32_t>(exp + 127) << 23 | man << 20;
    bf.push_back(static_cast<uint16_t>(f >> 16));
    for (int k = 0; k < 4; ++k) f32.push_back(static_cast<uint8_t>(f >> (8 * k)));
    uint16_t h = static_cast<uint16_t>(sign << 15 | static_cast<uint32_t>(exp + 15) << 10 |
                                       man << 7);
    f16.push_back(static_cast<uint8_t>(h));
    f16.push_back(static_cast<uint8_t>(h >> 8));
  }
  Result a = Quantize(QuantDtype::kBfloat16, {3, 70}, Bf16Bytes(bf));
  Result b = Quantize(QuantDtype::kFloat32, {3, 70}, f32);
  Result c = Quantize(QuantDtype::kFloat16, {3, 70}, f16);
  EXPECT_EQ(a.values, b.values);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.values, c.values);
  EXPECT_EQ(a.scales, c.scales);
}

TEST(Quantize, EmptyTensorsAreValidAndWriteNothing) {
  auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{4, 0});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->values_shape, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(plan->scales_bytes, 0);
  EXPECT_TRUE(QuantizeOnCpu(*plan, nullptr, 0, nullptr, 0, nullptr, 0).ok());
}

TEST(Quantize, PlanRejectsBadShapesNamingTheOperand) {
  auto rank0 = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{});
  EXPECT_EQ(rank0.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(rank0.status().message().find("shape"), absl::string_view::npos);
  auto neg = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{2, -1});
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  auto big = MakeQuantizePlan(QuantDtype::kFloat32,
                              std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 22});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("overflows"), absl::string_view::npos);
  EXPECT_EQ(ParseQuantDtype("int8").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseScaleRounding("nearest").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Quantize, RejectsBuffersWhoseSizeDoesNotMatchThePlan) {
  auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{32});
  ASSERT_TRUE(plan.ok());
  std::vector<uint8_t> in(63), v(16), s(1);
  absl::Status st = QuantizeOnCpu(*plan, in.data(), in.size(), v.data(), v.size(), s.data(), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("input"), absl::string_view::npos);
}

// Random bf16 with every special class: +-0, subnormals, +-inf, NaN of both signs, whole
// zero groups, and ordinary normals over many binades.
std::vector<uint8_t> SpecialBf16(int64_t elems, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(elems));
  for (int64_t i = 0; i < elems; ++i) {
    const uint64_t r = rng();
    uint16_t h = static_cast<uint16_t>(r);
    switch ((r >> 32) % 16) {
      case 0: h &= 0x8000; break;                       // +-0
      case 1: h &= 0x807F; break;                       // subnormal
      case 2: h = (h & 0x8000) | 0x7F80; break;         // +-inf
      case 3: h |= 0x7FC0; break;                       // NaN
      default: break;
    }
    if ((i / 32) % 5 == 3) h = 0;  // a zero group now and then
    v[static_cast<size_t>(i)] = h;
  }
  return Bf16Bytes(v);
}

// The oracle: canonical quantization, then the existing CPU engine's conversions. Both
// Blackwell pairs: blackwell_value, and blackwell_shuffled_value over tile shapes that do and
// do not divide K and N (tile_k odd, 1 byte, or wider than the row).
TEST(QuantizeFused, BlackwellPairsEqualQuantizeThenSwizzle) {
  std::mt19937_64 rng(2828);
  const int blocks[][2] = {{128, 256}, {2, 1}, {34, 7}, {64, 64}, {256, 32}, {6, 130}};
  int compared = 0;
  for (int trial = 0; trial < 36; ++trial) {
    const ScaleRounding rounding = trial % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    QuantLayoutSpec spec;
    const bool shuffled = trial % 3 != 0;
    spec.layout = shuffled ? QuantLayout::kBlackwellShuffled : QuantLayout::kBlackwell;
    spec.block_k = blocks[trial % 6][0];
    spec.block_n = blocks[trial % 6][1];
    const int64_t e = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 150);
    const int64_t k = 2 * (1 + static_cast<int64_t>(rng() % 200));  // ragged last groups too
    SCOPED_TRACE(::testing::Message() << "[" << e << "," << n << "," << k << "] trial " << trial << " shuffled "
                                      << shuffled << " block " << spec.block_k << "x" << spec.block_n);
    auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{e, n, k}, rounding);
    ASSERT_TRUE(plan.ok());
    const std::vector<uint8_t> in = SpecialBf16(e * n * k, rng);
    Result canon = Quantize(QuantDtype::kBfloat16, {e, n, k}, in, rounding);

    ConversionSpec vspec;
    vspec.layout = shuffled ? Layout::kBlackwellShuffledValue : Layout::kBlackwellValue;
    vspec.direction = Direction::kSwizzle;
    vspec.packing_axis = -2;
    vspec.blackwell.block_k = spec.block_k;
    vspec.blackwell.block_n = spec.block_n;
    auto vplan = MakePlan(vspec, std::vector<int64_t>{e, k, n});
    ASSERT_TRUE(vplan.ok()) << vplan.status();
    std::vector<uint8_t> want_v(vplan->output_bytes);
    ASSERT_TRUE(ConvertOnCpu(*vplan, canon.values.data(), canon.values.size(), want_v.data(),
                             want_v.size()).ok());
    const int64_t sq = (k + 31) / 32;
    ConversionSpec sspec;
    sspec.layout = Layout::kBlackwellScale;
    sspec.direction = Direction::kSwizzle;
    auto splan = MakePlan(sspec, std::vector<int64_t>{e, sq, n},
                          InputBinding{{n * sq, 1, sq}, canon.scales.size()});
    ASSERT_TRUE(splan.ok()) << splan.status();
    std::vector<uint8_t> want_s(splan->output_bytes);
    ASSERT_TRUE(ConvertOnCpu(*splan, canon.scales.data(), canon.scales.size(), want_s.data(),
                             want_s.size()).ok());

    auto sizes = PlanQuantizeLayout(*plan, spec);
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    std::vector<uint8_t> got_v(sizes->values_bytes, 0xAB), got_s(sizes->scales_bytes, 0xAB);
    absl::Status st = QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), got_v.data(), got_v.size(),
                                          got_s.data(), got_s.size());
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(got_v, want_v);
    EXPECT_EQ(got_s, want_s);
    ++compared;
  }
  EXPECT_EQ(compared, 36);
}

TEST(QuantizeFused, BlackwellRefusesOddKVectorsAndBadBlocks) {
  QuantLayoutSpec bw, sh;
  bw.layout = QuantLayout::kBlackwell;
  sh.layout = QuantLayout::kBlackwellShuffled;
  auto odd = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{4, 33});
  ASSERT_TRUE(odd.ok());
  auto vec = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{64});
  ASSERT_TRUE(vec.ok());
  for (const QuantLayoutSpec& spec : {bw, sh}) {
    EXPECT_EQ(PlanQuantizeLayout(*odd, spec).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(PlanQuantizeLayout(*vec, spec).status().code(), absl::StatusCode::kInvalidArgument);
  }
  auto mat = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{4, 64});
  ASSERT_TRUE(mat.ok());
  for (auto [bk, bn, what] : std::vector<std::tuple<int, int, const char*>>{
           {3, 256, "block_k"}, {0, 256, "block_k"}, {4098, 256, "block_k"}, {128, 0, "block_n"}, {128, 4097, "block_n"}}) {
    QuantLayoutSpec bad = sh;
    bad.block_k = bk;
    bad.block_n = bn;
    absl::Status st = PlanQuantizeLayout(*mat, bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bk << "x" << bn;
    EXPECT_NE(st.message().find(what), absl::string_view::npos) << st;
  }
  auto wide = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{int64_t{1} << 31, 2});
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(PlanQuantizeLayout(*wide, sh).status().code(), absl::StatusCode::kInvalidArgument);
}

// Any dtype's input for the Hopper oracle: bf16 with every special class, widened exactly
// to float32, or raw random fp16 bits (every fp16 class occurs).
std::vector<uint8_t> HopperInput(QuantDtype dtype, int64_t elems, std::mt19937_64& rng) {
  const std::vector<uint8_t> bf = SpecialBf16(elems, rng);
  if (dtype == QuantDtype::kBfloat16) return bf;
  std::vector<uint8_t> out;
  if (dtype == QuantDtype::kFloat32) {
    for (size_t i = 0; i < bf.size(); i += 2) {
      out.insert(out.end(), {0, 0, bf[i], bf[i + 1]});
    }
    return out;
  }
  out.resize(bf.size());
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// The oracle: canonical quantization, then the CPU engine's hopper_value swizzle (mx_axis -2,
// from packing -2) of the logical [E, K, N] and hopper_scale swizzle of the transposed scale
// view [E, ceil(K/32), N].
TEST(QuantizeFused, HopperEqualsQuantizeThenSwizzle) {
  std::mt19937_64 rng(2929);
  const QuantDtype dtypes[] = {QuantDtype::kBfloat16, QuantDtype::kFloat16, QuantDtype::kFloat32};
  const int warps[] = {1, 4, 8, 16};
  const int aligns[] = {2, 4, 64};
  int compared = 0;
  for (int trial = 0; trial < 30; ++trial) {
    const QuantDtype dtype = dtypes[trial % 3];
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    QuantLayoutSpec spec;
    spec.layout = QuantLayout::kHopper;
    spec.mma_version = 2 + trial % 2;
    spec.num_warps = warps[rng() % 4];
    spec.align_k = aligns[rng() % 3];
    const int64_t e = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t k = 2 * (1 + static_cast<int64_t>(rng() % 200));  // ragged last groups too
    SCOPED_TRACE(::testing::Message() << "[" << e << "," << n << "," << k << "] trial " << trial << " mma "
                                      << spec.mma_version << " warps " << spec.num_warps << " align_k "
                                      << spec.align_k);
    auto plan = MakeQuantizePlan(dtype, std::vector<int64_t>{e, n, k}, rounding);
    ASSERT_TRUE(plan.ok());
    const std::vector<uint8_t> in = HopperInput(dtype, e * n * k, rng);
    Result canon = Quantize(dtype, {e, n, k}, in, rounding);

    ConversionSpec vspec;
    vspec.layout = Layout::kHopperValue;
    vspec.direction = Direction::kSwizzle;
    vspec.hopper.mx_axis = -2;
    vspec.hopper.mma_version = spec.mma_version;
    vspec.packing_axis = -2;
    auto vplan = MakePlan(vspec, std::vector<int64_t>{e, k, n});
    ASSERT_TRUE(vplan.ok()) << vplan.status();
    std::vector<uint8_t> want_v(vplan->output_bytes);
    ASSERT_TRUE(ConvertOnCpu(*vplan, canon.values.data(), canon.values.size(), want_v.data(),
                             want_v.size()).ok());
    const int64_t sq = (k + 31) / 32;
    ConversionSpec sspec;
    sspec.layout = Layout::kHopperScale;
    sspec.direction = Direction::kSwizzle;
    sspec.hopper_scale.mx_axis = -2;
    sspec.hopper_scale.num_warps = spec.num_warps;
    sspec.hopper_scale.align_k = spec.align_k;
    auto splan = MakePlan(sspec, std::vector<int64_t>{e, sq, n},
                          InputBinding{{n * sq, 1, sq}, canon.scales.size()});
    ASSERT_TRUE(splan.ok()) << splan.status();
    std::vector<uint8_t> want_s(splan->output_bytes);
    ASSERT_TRUE(ConvertOnCpu(*splan, canon.scales.data(), canon.scales.size(), want_s.data(),
                             want_s.size()).ok());

    auto sizes = PlanQuantizeLayout(*plan, spec);
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    ASSERT_EQ(static_cast<uint64_t>(sizes->values_bytes), want_v.size());
    ASSERT_EQ(static_cast<uint64_t>(sizes->scales_bytes), want_s.size());
    std::vector<uint8_t> got_v(want_v.size(), 0xAB), got_s(want_s.size(), 0xAB);
    absl::Status st = QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), got_v.data(), got_v.size(),
                                          got_s.data(), got_s.size());
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(got_v, want_v);
    EXPECT_EQ(got_s, want_s);
    ++compared;
  }
  EXPECT_EQ(compared, 30);
}

TEST(QuantizeFused, HopperRefusesBadShapesAndParamsNamingThem) {
  auto odd = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{4, 33});
  ASSERT_TRUE(odd.ok());
  QuantLayoutSpec spec;
  spec.layout = QuantLayout::kHopper;
  EXPECT_EQ(PlanQuantizeLayout(*odd, spec).status().code(), absl::StatusCode::kInvalidArgument);
  auto vec = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{64});
  ASSERT_TRUE(vec.ok());
  EXPECT_EQ(PlanQuantizeLayout(*vec, spec).status().code(), absl::StatusCode::kInvalidArgument);
  // 2^20 matrices of 64 x 32 tiles: 2^31 tiles, one past what the GPU kernel numbers.
  auto huge = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{int64_t{1} << 20, 4096, 4096});
  ASSERT_TRUE(huge.ok()) << huge.status();
  absl::Status too_many = PlanQuantizeLayout(*huge, spec).status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.message().find("tiles"), absl::string_view::npos) << too_many;
  auto ok = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{4, 64});
  ASSERT_TRUE(ok.ok());
  const std::pair<QuantLayoutSpec, const char*> bad[] = {
      {{QuantLayout::kHopper, 1, 8, 2}, "mma_version"},
      {{QuantLayout::kHopper, 3, 3, 2}, "num_warps"},
      {{QuantLayout::kHopper, 3, 64, 2}, "num_warps"},
      {{QuantLayout::kHopper, 3, 8, 1}, "align_k"},
      {{QuantLayout::kHopper, 3, 8, 128}, "align_k"},
  };
  for (const auto& [s, field] : bad) {
    absl::Status st = PlanQuantizeLayout(*ok, s).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(field), absl::string_view::npos) << st;
  }
}

// The trtllm layouts' oracle: canonical quantization, then the MoE engine's MXFP4
// prepare_w13 / prepare_w2 (with the bias where given) on the CPU.
struct TrtllmOut {
  std::vector<uint8_t> values, scales, bias;
};

TrtllmOut TrtllmByPrepare(QuantDtype dtype, const std::vector<int64_t>& shape, const std::vector<uint8_t>& in,
                          ScaleRounding rounding, bool w13, int64_t align, const std::vector<uint8_t>* bias,
                          bool bias_bf16) {
  Result canon = Quantize(dtype, shape, in, rounding);
  MoeParams params;
  EXPECT_TRUE(SetMoeParam(params, "align", std::to_string(align)).ok());
  std::vector<MoeTensorDesc> inputs = {{"values", MoeDType::kUint8, {shape[0], shape[1], shape[2] / 2}},
                                       {"scales", MoeDType::kUint8, {shape[0], shape[1], shape[2] / 32}}};
  std::vector<absl::Span<const uint8_t>> ins = {canon.values, canon.scales};
  if (bias != nullptr) {
    inputs.push_back({"bias", bias_bf16 ? MoeDType::kBfloat16 : MoeDType::kFloat32, {shape[0], shape[1]}});
    ins.push_back(*bias);
  }
  auto plan = PlanMoe(w13 ? MoeOp::kPrepareW13 : MoeOp::kPrepareW2, params, inputs);
  EXPECT_TRUE(plan.ok()) << plan.status();
  TrtllmOut o;
  if (!plan.ok()) return o;
  o.values.assign(plan->output_bytes[0], 0xAB);
  o.scales.assign(plan->output_bytes[1], 0xAB);
  std::vector<absl::Span<uint8_t>> outs = {absl::MakeSpan(o.values), absl::MakeSpan(o.scales)};
  if (bias != nullptr) {
    o.bias.assign(plan->output_bytes[2], 0xAB);
    outs.push_back(absl::MakeSpan(o.bias));
  }
  EXPECT_TRUE(RunMoeCpu(*plan, ins, outs, 1).ok());
  return o;
}

TEST(QuantizeFused, TrtllmEqualsQuantizeThenPrepare) {
  std::mt19937_64 rng(3131);
  int compared = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    const bool w13 = trial % 2 == 0;
    const int64_t align = trial % 4 < 2 ? 128 : 256;
    const int64_t e = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t r = 2 * (1 + static_cast<int64_t>(rng() % 150));
    const int64_t k = 32 * (1 + static_cast<int64_t>(rng() % 12));
    const int bias_kind = trial % 3;  // none, float32, bfloat16
    SCOPED_TRACE(::testing::Message() << "[" << e << "," << r << "," << k << "] trial " << trial << " w13 " << w13
                                      << " align " << align << " bias " << bias_kind);
    auto plan = MakeQuantizePlan(dtype, std::vector<int64_t>{e, r, k}, rounding);
    ASSERT_TRUE(plan.ok());
    const std::vector<uint8_t> in = HopperInput(dtype, e * r * k, rng);
    std::vector<uint8_t> bias(static_cast<size_t>(e * r * (bias_kind == 2 ? 2 : 4)));
    for (auto& b : bias) b = static_cast<uint8_t>(rng());
    const TrtllmOut want = TrtllmByPrepare(dtype, {e, r, k}, in, rounding, w13, align,
                                           bias_kind ? &bias : nullptr, bias_kind == 2);
    QuantLayoutSpec spec;
    spec.layout = w13 ? QuantLayout::kTrtllmW13 : QuantLayout::kTrtllmW2;
    spec.align = align;
    auto sizes = PlanQuantizeLayout(*plan, spec);
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    ASSERT_EQ(static_cast<size_t>(sizes->values_bytes), want.values.size());
    ASSERT_EQ(static_cast<size_t>(sizes->scales_bytes), want.scales.size());
    std::vector<uint8_t> v(want.values.size(), 0xCD), s(want.scales.size(), 0xCD), b;
    QuantBias qb;
    if (bias_kind) {
      ASSERT_EQ(static_cast<size_t>(sizes->bias_bytes), want.bias.size());
      b.assign(want.bias.size(), 0xCD);
      qb = {bias.data(), bias_kind == 2, b.data()};
    }
    absl::Status st = QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), v.data(), v.size(), s.data(), s.size(), qb);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(v, want.values);
    EXPECT_EQ(s, want.scales);
    EXPECT_EQ(b, want.bias);
    ++compared;
  }
  EXPECT_EQ(compared, 24);
}

TEST(QuantizeFused, TrtllmRefusesWhatPrepareRefuses) {
  QuantLayoutSpec spec;
  spec.layout = QuantLayout::kTrtllmW13;
  const std::pair<std::vector<int64_t>, const char*> bad[] = {
      {{4, 64}, "rank 3"}, {{2, 6, 48}, "multiple of 32"}, {{2, 7, 64}, "even"}};
  for (const auto& [shape, mention] : bad) {
    auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape);
    ASSERT_TRUE(plan.ok());
    absl::Status st = PlanQuantizeLayout(*plan, spec).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << mention;
    EXPECT_NE(st.message().find(mention), absl::string_view::npos) << st;
  }
  spec.align = 100;
  auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{2, 6, 64});
  ASSERT_TRUE(plan.ok());
  absl::Status st = PlanQuantizeLayout(*plan, spec).status();
  EXPECT_NE(st.message().find("align"), absl::string_view::npos) << st;
}

}  // namespace
}  // namespace wprep
