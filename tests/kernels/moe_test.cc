// The trtllm-gen MoE engine on the CPU: every reference vector of both manifests byte for
// byte, every error case rejected with its reason, and PlanMoe's rules one by one.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "golden.h"
#include "moe_golden.h"
#include "wprep/kernels/moe.h"

namespace wprep {
namespace {

using testing::LoadMoeGolden;
using testing::MoeGoldenCase;

// What the rejection of each error case of the manifests must say (the operand and the
// offending value), written from the contract. A new error case without an entry here
// fails the test, so none passes unexamined.
const std::map<std::string, std::vector<std::string>>& ExpectedReasons() {
  static const auto* m = new std::map<std::string, std::vector<std::string>>{
      {"err_swap_pairs_odd_rows_1x5x8", {"x:", "must be even, got 5"}},
      {"err_row_shuffle_t128_rows48", {"x:", "multiple of 32", "got 48"}},
      {"err_row_shuffle_tile0", {"epilogue_tile_m:", "positive integer, got 0"}},
      {"err_scale_row_shuffle_rows96", {"x:", "multiple of 128, got 96"}},
      {"err_block_scale_interleave_rank1", {"x:", "rank must be 2 or 3, got rank 1"}},
      {"err_prepare_w13_scales_mismatch", {"scales:", "[1, 64, 2], got [1, 64, 3]"}},
      {"err_prepare_w13_h48_not_mult32", {"values:", "multiple of 32, got 48"}},
      {"err_prepare_w2_align64", {"align:", "positive multiple of 128, got 64"}},
      {"err_prepare_w13_e0", {"values:", "experts must be >= 1, got 0"}},
      {"err_swap_halves_odd_1x5x4", {"x:", "must be even, got 5"}},
      {"err_block_layout_k100_bk128", {"x:", "K = 100 must be a multiple of block_k = 128"}},
      {"err_block_layout_bk0", {"block_k:", "positive integer, got 0"}},
      {"err_prepare_w13_nvfp4_scales_mismatch", {"scales:", "[1, 128, 8], got [1, 128, 7]"}},
      {"err_prepare_w13_nvfp4_k24", {"values:", "K = 24 must be a multiple of 16"}},
      {"err_prepare_w13_nvfp4_missing_align_i", {"params:", "missing [align_i]"}},
      {"err_prepare_w2_nvfp4_h64_align_h64", {"scales:", "scale rows 64 must be a multiple of 128"}},
      {"err_prepare_w13_mxfp8_rows64", {"scales:", "scale rows 64 must be a multiple of 128"}},
      {"err_prepare_w2_mxfp8_i96", {"scales:", "scale columns 3 a multiple of 4"}},
      {"err_prepare_w2_fp8_h48", {"values:", "rows = 48 must be a multiple of 32"}},
      {"err_prepare_w13_fp8_gated_odd_rows", {"values:", "rows must be even, got 33"}},
      {"err_prepare_w13_fp8_block_one_scale_block",
       {"scales:", "even number of 128-row scale blocks, got 1"}},
      {"err_prepare_w13_fp8_block_scales_u8", {"scales:", "[float32], got uint8"}},
      {"err_prepare_w13_bf16_values_u8", {"values:", "[bfloat16], got uint8"}},
      {"err_prepare_w2_bf16_i32", {"values:", "K = 32 must be a multiple of 64 for BlockMajorK"}},
      {"err_prepare_w13_unknown_format", {"format:", "got 'int4'"}},
      {"err_prepare_w13_mxfp8_e0", {"values:", "experts must be >= 1, got 0"}},
      {"err_prepare_w2_fp8_align_i0", {"align_i:", "positive integer, got 0"}},
  };
  return *m;
}

void RunSetOnCpu(const std::string& set, size_t want_cases) {
  const std::vector<MoeGoldenCase> cases = LoadMoeGolden(set);
  EXPECT_EQ(cases.size(), want_cases) << set;
  int valid = 0, errors = 0;
  for (const MoeGoldenCase& c : cases) {
    SCOPED_TRACE(set + "/" + c.name);
    auto plan = testing::PlanMoeGolden(c);
    if (c.error) {
      ++errors;
      ASSERT_FALSE(plan.ok()) << "accepted; the contract rejects it: " << c.why;
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
      auto reasons = ExpectedReasons().find(c.name);
      ASSERT_NE(reasons, ExpectedReasons().end()) << "no expected reason for this error case";
      for (const std::string& r : reasons->second) {
        EXPECT_NE(std::string(plan.status().message()).find(r), std::string::npos)
            << "message \"" << plan.status().message() << "\" lacks \"" << r << "\"";
      }
      continue;
    }
    ++valid;
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto inputs = testing::InPlanOrder(*plan, c, testing::MoeGoldenInputs(c));
    ASSERT_EQ(inputs.size(), plan->inputs.size());
    testing::ExpectMatchesGolden(c, *plan, testing::RunMoeCpuFresh(*plan, inputs), "cpu");
  }
  EXPECT_GT(valid, 0);
  EXPECT_GT(errors, 0);
}

TEST(MoeGolden, EveryMxfp4CaseMatchesOnCpu) { RunSetOnCpu("golden_trtllm", 34); }

TEST(MoeGolden, EveryFormatsCaseMatchesOnCpu) { RunSetOnCpu("golden_trtllm_formats", 47); }

// --- PlanMoe's rules, one by one ---------------------------------------------------

MoeParams Params(std::vector<std::pair<std::string, std::string>> kv) {
  MoeParams p;
  for (const auto& [k, v] : kv) EXPECT_TRUE(SetMoeParam(p, k, v).ok()) << k << "=" << v;
  return p;
}

MoeTensorDesc T(std::string name, MoeDType dt, std::vector<int64_t> shape) {
  return {std::move(name), dt, std::move(shape)};
}

constexpr MoeDType kU8 = MoeDType::kUint8;
constexpr MoeDType kF32 = MoeDType::kFloat32;
constexpr MoeDType kBf16 = MoeDType::kBfloat16;

void ExpectInvalid(const absl::StatusOr<MoePlan>& plan, const std::string& needle) {
  ASSERT_FALSE(plan.ok()) << "accepted; wanted an error with \"" << needle << "\"";
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(std::string(plan.status().message()).find(needle), std::string::npos)
      << plan.status().message();
}

TEST(MoePlan, ParsesEveryOpOfTheReference) {
  for (const char* name : {"swap_pairs", "gated_act_reorder", "row_shuffle", "scale_row_shuffle",
                           "block_scale_interleave", "shuffle_sf_a", "bias_shuffle", "swap_halves",
                           "block_layout", "prepare_w13", "prepare_w2"}) {
    auto op = ParseMoeOp(name);
    ASSERT_TRUE(op.ok()) << name;
    EXPECT_EQ(MoeOpName(*op), name);
  }
  EXPECT_EQ(ParseMoeOp("shuffle").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MoePlan, SetMoeParamRejectsWhatTheCliMustNotPass) {
  MoeParams p;
  EXPECT_TRUE(SetMoeParam(p, "gated", "false").ok());
  EXPECT_FALSE(p.gated);
  EXPECT_TRUE(SetMoeParam(p, "axis", "-1").ok());
  EXPECT_EQ(p.axis, -1);
  EXPECT_TRUE(SetMoeParam(p, "format", "fp8_block").ok());
  EXPECT_EQ(p.format, MoeFormat::kFp8Block);
  EXPECT_EQ(p.given, kMoeParamGated | kMoeParamAxis | kMoeParamFormat);
  for (auto [k, v] : std::vector<std::pair<const char*, const char*>>{
           {"gated", "1"}, {"gated", "True"}, {"align", "+256"}, {"align", "0x100"},
           {"align", "256 "}, {"align", ""}, {"block_k", "-"}, {"axis", "99999999999999999999"},
           {"format", "int4"}, {"tile", "128"}}) {
    const absl::Status s = SetMoeParam(p, k, v);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k << "=" << v;
    EXPECT_NE(std::string(s.message()).find(k), std::string::npos) << s.message();
  }
}

TEST(MoePlan, SwapErrors) {
  const MoeParams p = Params({{"axis", "-2"}});
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {2, 3, 4})}), "must be even, got 3");
  ExpectInvalid(PlanMoe(MoeOp::kSwapHalves, p, {T("x", kU8, {2, 3, 4})}), "must be even, got 3");
  // Zero elements do not excuse an odd axis (contract S1).
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {0, 3, 4})}), "must be even, got 3");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, Params({{"axis", "-3"}}), {T("x", kU8, {2, 2, 2})}),
                "axis: must be -1 or -2");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {4})}), "axis: must be -1 or -2");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("y", kU8, {2, 2})}), "x: missing");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {2, 2}), T("x", kU8, {2, 2})}),
                "more than once");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {2, 2}), T("bias", kF32, {2})}),
                "bias: not an input");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, Params({{"axis", "-2"}, {"block_k", "4"}}),
                        {T("x", kU8, {2, 2})}),
                "extra [block_k]");
  ExpectInvalid(PlanMoe(MoeOp::kSwapPairs, p, {T("x", kU8, {-1, 2})}), "dimensions must be >= 0");
}

TEST(MoePlan, RowShuffleErrors) {
  const MoeParams p = Params({{"epilogue_tile_m", "64"}});
  ExpectInvalid(PlanMoe(MoeOp::kRowShuffle, p, {T("x", kU8, {40, 8})}), "multiple of 16");
  ExpectInvalid(PlanMoe(MoeOp::kRowShuffle, Params({{"epilogue_tile_m", "-128"}}),
                        {T("x", kU8, {32, 8})}),
                "epilogue_tile_m: must be a positive integer, got -128");
  ExpectInvalid(PlanMoe(MoeOp::kRowShuffle, p, {T("x", kF32, {32, 8})}), "x: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kRowShuffle, p, {T("x", kU8, {1, 1, 32, 8})}), "rank must be 2 or 3");
  ExpectInvalid(PlanMoe(MoeOp::kGatedActReorder, {}, {T("x", kU8, {1, 7, 8})}), "rows must be even");
  ExpectInvalid(PlanMoe(MoeOp::kBiasShuffle, {}, {T("x", kF32, {2, 48})}), "multiple of 32");
  ExpectInvalid(PlanMoe(MoeOp::kBiasShuffle, {}, {T("x", kU8, {64})}), "x: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kBiasShuffle, {}, {T("x", kF32, {1, 1, 64})}), "rank must be 1 or 2");
  // R = 0 is an empty output, not an error (contract S3).
  auto empty = PlanMoe(MoeOp::kRowShuffle, {}, {T("x", kU8, {2, 0, 8})});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->output_bytes[0], 0u);
}

TEST(MoePlan, ScaleErrors) {
  ExpectInvalid(PlanMoe(MoeOp::kScaleRowShuffle, Params({{"num_elts_per_sf", "8"}}),
                        {T("x", kU8, {128, 4})}),
                "num_elts_per_sf: must be 16 or 32, got 8");
  ExpectInvalid(PlanMoe(MoeOp::kScaleRowShuffle, {}, {T("x", kBf16, {128, 4})}), "x: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kShuffleSfA, {}, {T("x", kU8, {1, 160, 4})}), "multiple of 128, got 160");
  ExpectInvalid(PlanMoe(MoeOp::kBlockScaleInterleave, {}, {T("x", kF32, {128, 4})}), "x: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kBlockScaleInterleave, {}, {T("x", kU8, {1, 1, 128, 4})}),
                "rank must be 2 or 3");
  // num_elts_per_sf 32 and C % 4 != 0 are valid (contract section 5).
  EXPECT_TRUE(PlanMoe(MoeOp::kScaleRowShuffle, Params({{"num_elts_per_sf", "32"}}),
                      {T("x", kU8, {128, 3})})
                  .ok());
}

TEST(MoePlan, BlockLayoutErrors) {
  ExpectInvalid(PlanMoe(MoeOp::kBlockLayout, Params({{"block_k", "-4"}}), {T("x", kU8, {4, 8})}),
                "block_k: must be a positive integer, got -4");
  ExpectInvalid(PlanMoe(MoeOp::kBlockLayout, Params({{"block_k", "3"}}), {T("x", kU8, {4, 8})}),
                "K = 8 must be a multiple of block_k = 3");
  ExpectInvalid(PlanMoe(MoeOp::kBlockLayout, {}, {T("x", kF32, {4, 128})}), "x: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kBlockLayout, {}, {T("x", kU8, {128})}), "rank must be 2 or 3");
}

TEST(MoePlan, Mxfp4PrepareErrors) {
  const std::vector<MoeTensorDesc> ok = {T("values", kU8, {2, 64, 32}), T("scales", kU8, {2, 64, 2}),
                                         T("bias", kF32, {2, 64})};
  ASSERT_TRUE(PlanMoe(MoeOp::kPrepareW13, {}, ok).ok());
  // Bias is optional: no bias in, no bias out.
  auto no_bias = PlanMoe(MoeOp::kPrepareW13, {}, {ok[0], ok[1]});
  ASSERT_TRUE(no_bias.ok()) << no_bias.status();
  EXPECT_EQ(no_bias->outputs.size(), 2u);
  // Any positive multiple of 128 is an alignment (contract section 3).
  EXPECT_TRUE(PlanMoe(MoeOp::kPrepareW13, Params({{"align", "384"}}), ok).ok());
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, Params({{"align", "0"}}), ok), "align: must be a positive multiple of 128, got 0");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {T("values", kBf16, {2, 64, 32}), ok[1], ok[2]}),
                "values: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {ok[0], T("scales", kF32, {2, 64, 2}), ok[2]}),
                "scales: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {ok[0], ok[1], T("bias", kU8, {2, 64})}), "bias: dtype");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {T("values", kU8, {64, 32}), ok[1], ok[2]}),
                "values: must have rank 3");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {T("values", kU8, {2, 0, 32}), T("scales", kU8, {2, 0, 2}), T("bias", kF32, {2, 0})}),
                "values: dimensions must be non-zero");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {ok[0], ok[1], T("bias", kF32, {2, 63})}),
                "bias: must have shape [2, 64], got [2, 63]");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {T("values", kU8, {1, 63, 32}), T("scales", kU8, {1, 63, 2}), T("bias", kF32, {1, 63})}),
                "values: w13 rows (2*I) must be even, got 63");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, {}, {ok[0]}), "scales: missing");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, Params({{"gated", "true"}}), ok), "extra [gated]");
  // w2 takes odd rows (only w13's pairs must be even).
  EXPECT_TRUE(PlanMoe(MoeOp::kPrepareW2, {}, {T("values", kU8, {1, 63, 32}), T("scales", kU8, {1, 63, 2}), T("bias", kF32, {1, 63})}).ok());
}

TEST(MoePlan, FormatPrepareErrors) {
  const MoeParams nv = Params({{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "256"}, {"align_i", "64"}});
  const std::vector<MoeTensorDesc> nv_in = {T("values", kU8, {1, 128, 64}), T("scales", kU8, {1, 128, 8})};
  ASSERT_TRUE(PlanMoe(MoeOp::kPrepareW13, nv, nv_in).ok());
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW2, nv, nv_in), "extra [gated]");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, Params({{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "256"}, {"align_i", "64"}, {"align", "256"}}), nv_in),
                "extra [align]");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, Params({{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "-256"}, {"align_i", "64"}}), nv_in),
                "align_h: must be a positive integer, got -256");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, nv, {nv_in[0], nv_in[1], T("bias", kF32, {1, 128})}),
                "bias: not an input of prepare_w13 format nvfp4");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, nv, {nv_in[0]}), "scales: missing");
  const MoeParams fb = Params({{"format", "fp8_block"}, {"gated", "false"}});
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, fb, {T("values", kU8, {1, 192, 128}), T("scales", kF32, {1, 1, 1})}),
                "rows and K must be multiples of 128, got 192 x 128");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, fb, {T("values", kU8, {1, 128, 128}), T("scales", kF32, {1, 1, 2})}),
                "scales: must have shape [1, 1, 1], got [1, 1, 2]");
  const MoeParams bf = Params({{"format", "bf16"}, {"gated", "true"}, {"align_i", "1"}});
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, bf, {T("values", kBf16, {1, 48, 64})}),
                "rows = 48 must be a multiple of 32");
  const MoeParams f8 = Params({{"format", "fp8"}, {"gated", "true"}});
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, f8, {T("values", kU8, {1, 64, 64})}), "missing [align_i]");
}

TEST(MoePlan, SizesOverflowingInt64AreRejectedBeforeAnyWork) {
  ExpectInvalid(PlanMoe(MoeOp::kRowShuffle, {}, {T("x", kU8, {int64_t{1} << 40, 32, int64_t{1} << 30})}),
                "overflows");
  ExpectInvalid(PlanMoe(MoeOp::kPrepareW13, Params({{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "4611686018427387904"}, {"align_i", "64"}}),
                        {T("values", kU8, {1, 128, 64}), T("scales", kU8, {1, 128, 8})}),
                "overflows");
}

TEST(MoePlan, IdentityNamesOpParamsAndContract) {
  auto w13 = PlanMoe(MoeOp::kPrepareW13, {}, {T("values", kU8, {1, 64, 32}), T("scales", kU8, {1, 64, 2})});
  ASSERT_TRUE(w13.ok());
  EXPECT_EQ(w13->identity, "trtllm_gen:prepare_w13 format=mxfp4 align=256 contract=1");
  auto nv = PlanMoe(MoeOp::kPrepareW2, Params({{"format", "nvfp4"}, {"align_h", "256"}, {"align_i", "128"}}),
                    {T("values", kU8, {1, 128, 64}), T("scales", kU8, {1, 128, 8})});
  ASSERT_TRUE(nv.ok()) << nv.status();
  EXPECT_EQ(nv->identity, "trtllm_gen:prepare_w2 format=nvfp4 align_h=256 align_i=128 contract=1");
  auto rs = PlanMoe(MoeOp::kRowShuffle, Params({{"epilogue_tile_m", "64"}}), {T("x", kU8, {32, 4})});
  ASSERT_TRUE(rs.ok());
  EXPECT_EQ(rs->identity, "trtllm_gen:row_shuffle epilogue_tile_m=64 contract=1");
}

TEST(MoePlan, InputsAreTakenInAnyOrderAndPlannedInOne) {
  auto plan = PlanMoe(MoeOp::kPrepareW2, {}, {T("bias", kBf16, {1, 64}), T("scales", kU8, {1, 64, 2}), T("values", kU8, {1, 64, 32})});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->inputs.size(), 3u);
  EXPECT_EQ(plan->inputs[0].name, "values");
  EXPECT_EQ(plan->inputs[1].name, "scales");
  EXPECT_EQ(plan->inputs[2].name, "bias");
  EXPECT_EQ(plan->input_bytes, (std::vector<uint64_t>{64 * 32, 64 * 2, 64 * 2}));
}

// --- the engine ---------------------------------------------------------------------

TEST(MoeCpu, ThreadsGiveTheSameBytesAsOneThread) {
  // Large enough (> 1 MiB out) for the parallel path, with padding of H and I.
  MoeParams p = Params({{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "256"}, {"align_i", "64"}});
  auto plan = PlanMoe(MoeOp::kPrepareW13, p, {T("values", kU8, {8, 2 * 200, 720}), T("scales", kU8, {8, 400, 90})});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::vector<uint8_t>> in = {testing::RandomBytes(plan->input_bytes[0], 1),
                                          testing::RandomBytes(plan->input_bytes[1], 2)};
  EXPECT_GT(plan->output_bytes[0], uint64_t{1} << 20);
  const auto one = testing::RunMoeCpuFresh(*plan, in, 1);
  const auto many = testing::RunMoeCpuFresh(*plan, in, 4);
  EXPECT_TRUE(one == many);
}

TEST(MoeCpu, Fp8BlockScaleClampFollowsTheBitRule) {
  // Contract 10.6: below 1e-10f (0x2EDBE6FF) becomes 0x2EDBE6FF, -0, negatives, -inf and
  // denormals included; NaNs keep their payload; the rest is unchanged. Non-gated w2
  // leaves the scale order alone, so output word i is the clamp of input word i.
  const std::vector<uint32_t> in = {0x00000000, 0x80000000, 0x00000001, 0xBF800000,
                                    0xFF800000, 0x7F800000, 0x7FC00001, 0xFFC12345,
                                    0x2EDBE6FF, 0x2EDBE6FE, 0x2EDBE700, 0x3F800000};
  const std::vector<uint32_t> want = {0x2EDBE6FF, 0x2EDBE6FF, 0x2EDBE6FF, 0x2EDBE6FF,
                                      0x2EDBE6FF, 0x7F800000, 0x7FC00001, 0xFFC12345,
                                      0x2EDBE6FF, 0x2EDBE6FF, 0x2EDBE700, 0x3F800000};
  auto plan = PlanMoe(MoeOp::kPrepareW2, Params({{"format", "fp8_block"}}),
                      {T("values", kU8, {1, 128, 128 * 12}), T("scales", kF32, {1, 1, 12})});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<uint8_t> scales(4 * in.size());
  std::memcpy(scales.data(), in.data(), scales.size());
  const auto out = testing::RunMoeCpuFresh(
      *plan, {std::vector<uint8_t>(plan->input_bytes[0], 0), scales});
  ASSERT_EQ(out[1].size(), 4 * want.size());
  std::vector<uint32_t> got(want.size());
  std::memcpy(got.data(), out[1].data(), out[1].size());
  EXPECT_EQ(got, want);
}

TEST(MoeCpu, RejectsWrongBufferSizesAndOverlap) {
  auto plan = PlanMoe(MoeOp::kRowShuffle, {}, {T("x", kU8, {32, 4})});
  ASSERT_TRUE(plan.ok());
  std::vector<uint8_t> in(128), out(128), small(127);
  std::vector<absl::Span<const uint8_t>> ins = {in};
  std::vector<absl::Span<uint8_t>> outs = {absl::Span<uint8_t>(small)};
  EXPECT_EQ(RunMoeCpu(*plan, ins, outs).code(), absl::StatusCode::kInvalidArgument);
  outs = {absl::Span<uint8_t>(in)};
  EXPECT_EQ(RunMoeCpu(*plan, ins, outs).code(), absl::StatusCode::kInvalidArgument);
  outs = {absl::Span<uint8_t>(out)};
  EXPECT_TRUE(RunMoeCpu(*plan, ins, outs).ok());
  EXPECT_EQ(RunMoeCpu(*plan, {}, outs).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wprep
