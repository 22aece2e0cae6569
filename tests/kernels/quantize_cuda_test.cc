// quantize_mxfp4 on the GPU: the reference vectors, and byte equality with the CPU engine
// on random shapes full of the special values. Skipped where no GPU is found.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "golden.h"
#include "gtest/gtest.h"
#include "wprep/config.h"
#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "nlohmann/json.hpp"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/quantize.h"

namespace wprep {
namespace {

std::string QuantDataDir() { return testing::TestDataDir("golden_quant") + "/"; }

using testing::ReadFile;

struct Out {
  std::vector<uint8_t> values, scales;
};

Out Quantize(bool gpu, const QuantizePlan& plan, const std::vector<uint8_t>& in) {
  Out o;
  o.values.assign(plan.values_bytes, 0xAB);
  o.scales.assign(plan.scales_bytes, 0xAB);
  absl::Status s =
      gpu ? QuantizeHostBuffersOnCuda(plan, in.data(), in.size(), o.values.data(), o.values.size(),
                                      o.scales.data(), o.scales.size(), 0)
          : QuantizeOnCpu(plan, in.data(), in.size(), o.values.data(), o.values.size(),
                          o.scales.data(), o.scales.size());
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

TEST(QuantizeCuda, MatchesEveryGoldenCase) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::string dir = QuantDataDir();
  std::ifstream mf(dir + "manifest.json");
  ASSERT_TRUE(mf.good());
  const nlohmann::json manifest = nlohmann::json::parse(mf);
  for (const auto& c : manifest["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto plan = MakeQuantizePlan(*ParseQuantDtype(c["input_dtype"].get<std::string>()),
                                 c["input_shape"].get<std::vector<int64_t>>(),
                                 *ParseScaleRounding(c["params"]["scale_rounding"].get<std::string>()));
    ASSERT_TRUE(plan.ok());
    Out o = Quantize(true, *plan, ReadFile(dir + c["input"].get<std::string>()));
    EXPECT_EQ(o.values, ReadFile(dir + c["values"].get<std::string>()));
    EXPECT_EQ(o.scales, ReadFile(dir + c["scales"].get<std::string>()));
  }
}

// Random elements drawn so that every special class shows up often: zeros of both signs,
// subnormals, +-inf, NaNs of both signs, huge and tiny normals, and whole zero groups.
std::vector<uint8_t> SpecialInput(QuantDtype dtype, int64_t elems, std::mt19937_64& rng) {
  const int esize = QuantDtypeBytes(dtype);
  std::vector<uint8_t> out(static_cast<size_t>(elems * esize));
  const bool zero_block = rng() % 3 == 0;
  for (int64_t i = 0; i < elems; ++i) {
    uint64_t r = rng();
    uint32_t bits32 = static_cast<uint32_t>(r);
    const uint32_t kind = static_cast<uint32_t>(r >> 32) % 16;
    if (zero_block && (i / 32) % 4 == 1) kind == 0 ? bits32 = 0x80000000u : bits32 = 0;
    else if (kind == 0) bits32 &= 0x80000000u;                               // +-0
    else if (kind == 1) bits32 &= 0x807FFFFFu;                               // subnormal
    else if (kind == 2) bits32 = (bits32 & 0x80000000u) | 0x7F800000u;      // +-inf
    else if (kind == 3) bits32 |= 0x7FC00000u;                               // NaN
    if (dtype == QuantDtype::kFloat32) {
      for (int k = 0; k < 4; ++k) out[i * 4 + k] = static_cast<uint8_t>(bits32 >> (8 * k));
    } else {
      // Top half: bf16 of the same class; for fp16 the classes land differently, which is
      // fine: only CPU-GPU equality is asserted.
      uint16_t h = static_cast<uint16_t>(bits32 >> 16);
      if (dtype == QuantDtype::kFloat16 && kind == 1) h &= 0x83FF;  // fp16 subnormal
      out[i * 2] = static_cast<uint8_t>(h);
      out[i * 2 + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return out;
}

TEST(QuantizeCuda, EqualsTheCpuEngineOnRandomShapesAndSpecialValues) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(28);
  int compared = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = trial % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    std::vector<int64_t> shape;
    const int rank = 1 + static_cast<int>(rng() % 3);
    for (int d = 0; d + 1 < rank; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % 9));
    shape.push_back(1 + static_cast<int64_t>(rng() % 300));  // ragged and odd Q included
    auto plan = MakeQuantizePlan(dtype, shape, rounding);
    ASSERT_TRUE(plan.ok());
    const std::vector<uint8_t> in =
        SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng);
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    Out cpu = Quantize(false, *plan, in);
    Out gpu = Quantize(true, *plan, in);
    EXPECT_EQ(cpu.values, gpu.values);
    EXPECT_EQ(cpu.scales, gpu.scales);
    ++compared;
  }
  EXPECT_EQ(compared, 60);
}

// The GPU widens fp16 with the conversion instruction (infinities and NaNs by their bits),
// the CPU by bits alone: every one of the 65536 fp16 patterns, in order (groups of like
// magnitude: subnormal groups set subnormal scales) and shuffled, both roundings.
TEST(QuantizeCuda, Fp16EqualsTheCpuForEveryBitPattern) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<uint16_t> patterns(1 << 16);
  for (size_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<uint16_t>(i);
  std::mt19937_64 rng(1616);
  for (bool shuffled : {false, true}) {
    if (shuffled) std::shuffle(patterns.begin(), patterns.end(), rng);
    std::vector<uint8_t> in(2 * patterns.size());
    std::memcpy(in.data(), patterns.data(), in.size());
    for (ScaleRounding rounding : {ScaleRounding::kUp, ScaleRounding::kDown}) {
      auto plan = MakeQuantizePlan(QuantDtype::kFloat16, {2048, 32}, rounding);
      ASSERT_TRUE(plan.ok());
      SCOPED_TRACE(::testing::Message() << "shuffled " << shuffled << " rounding " << static_cast<int>(rounding));
      Out cpu = Quantize(false, *plan, in);
      Out gpu = Quantize(true, *plan, in);
      EXPECT_EQ(cpu.values, gpu.values);
      EXPECT_EQ(cpu.scales, gpu.scales);
    }
  }
}

TEST(QuantizeCuda, RefusesHostPointers) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, std::vector<int64_t>{32});
  ASSERT_TRUE(plan.ok());
  std::vector<uint8_t> in(64), v(16), s(1);
  absl::Status st = QuantizeOnCuda(*plan, in.data(), v.data(), s.data(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

#if WPREP_HAVE_CUDA
// A fused layout on the CPU and on the GPU; the output buffers start as 0xAB so that padding
// left unwritten shows. `off` bytes put the GPU input off 16-byte alignment (the element path).
struct FusedPair {
  Out cpu, gpu;
};

FusedPair Fused(const QuantizePlan& plan, const QuantLayoutSpec& spec, const std::vector<uint8_t>& in, size_t off = 0) {
  FusedPair r;
  auto sizes = PlanQuantizeLayout(plan, spec);
  EXPECT_TRUE(sizes.ok()) << sizes.status();
  if (!sizes.ok()) return r;
  r.cpu.values.assign(sizes->values_bytes, 0xAB);
  r.cpu.scales.assign(sizes->scales_bytes, 0xAB);
  EXPECT_TRUE(QuantizeLayoutOnCpu(plan, spec, in.data(), in.size(), r.cpu.values.data(), r.cpu.values.size(),
                                  r.cpu.scales.data(), r.cpu.scales.size()).ok());
  uint8_t *din = nullptr, *dv = nullptr, *ds = nullptr;
  EXPECT_EQ(cudaMalloc(&din, in.size() + off), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dv, r.cpu.values.size()), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&ds, r.cpu.scales.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(din + off, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(dv, 0xAB, r.cpu.values.size()), cudaSuccess);
  EXPECT_EQ(cudaMemset(ds, 0xAB, r.cpu.scales.size()), cudaSuccess);
  absl::Status st = QuantizeLayoutOnCuda(plan, spec, din + off, dv, ds, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  r.gpu.values.resize(r.cpu.values.size());
  r.gpu.scales.resize(r.cpu.scales.size());
  EXPECT_EQ(cudaMemcpy(r.gpu.values.data(), dv, r.gpu.values.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(r.gpu.scales.data(), ds, r.gpu.scales.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  (void)cudaFree(din);
  (void)cudaFree(dv);
  (void)cudaFree(ds);
  return r;
}

// Both fused Blackwell pairs on the GPU equal the CPU's (which the CPU test holds to
// quantize-then-swizzle), on random [E, N, K] with the special values: every dtype, both
// roundings, tiles that do and do not divide K and N (tile_k odd or 1 byte: byte stores),
// and inputs off 16-byte alignment.
TEST(QuantizeCuda, BlackwellFusedEqualsTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(2829);
  const int blocks[][2] = {{128, 256}, {2, 1}, {34, 7}, {64, 64}, {256, 32}, {6, 130}};
  int compared = 0;
  for (int trial = 0; trial < 36; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    QuantLayoutSpec spec;
    spec.layout = trial % 4 == 0 ? QuantLayout::kBlackwell : QuantLayout::kBlackwellShuffled;
    spec.block_k = blocks[trial % 6][0];
    spec.block_n = blocks[trial % 6][1];
    // Every third shape has whole groups (K a multiple of 32): the packed 16-bit path, by
    // whole rows of 32-group chunks where a row has 32 groups or more (every sixth shape:
    // 33 to 102 groups, most not a multiple of 32), else by flat runs of 32 groups.
    const int64_t sq = trial % 6 == 0 ? 33 + static_cast<int64_t>(rng() % 70) : 1 + static_cast<int64_t>(rng() % 20);
    const int64_t k = trial % 3 == 0 ? 32 * sq : 2 * (1 + static_cast<int64_t>(rng() % 300));
    const std::vector<int64_t> shape = {1 + static_cast<int64_t>(rng() % 3), 1 + static_cast<int64_t>(rng() % 300), k};
    auto plan = MakeQuantizePlan(dtype, shape, rounding);
    ASSERT_TRUE(plan.ok());
    const size_t off = trial % 5 == 4 ? QuantDtypeBytes(dtype) : 0;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " shape " << ::testing::PrintToString(shape) << " block "
                                      << spec.block_k << "x" << spec.block_n << " off " << off);
    const FusedPair r = Fused(*plan, spec, SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng), off);
    EXPECT_EQ(r.gpu.values, r.cpu.values);
    EXPECT_EQ(r.gpu.scales, r.cpu.scales);
    ++compared;
  }
  EXPECT_EQ(compared, 36);
}

// 16-bit groups (bf16 or fp16) the packed encoder takes (no NaN or inf, a scale whose
// multiplier is a normal of the type), next to the groups it hands to the scalar path, mixed
// in one tensor. Tie groups have amax 6 * 2^j, so the scale is exactly 2^j and each element
// sits on an e2m1 rounding threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6) times 2^j, or
// one step of the type either side of it; wide groups spread over a dozen binades anywhere
// in the type's range, subnormals included.
std::vector<uint8_t> Groups16Input(QuantDtype dtype, int64_t groups, std::mt19937_64& rng) {
  const bool bf16 = dtype == QuantDtype::kBfloat16;
  static constexpr uint16_t kBf16Ties[] = {0x3E80, 0x3F40, 0x3FA0, 0x3FE0, 0x4020, 0x4060, 0x40A0, 0x40C0};
  static constexpr uint16_t kFp16Ties[] = {0x3400, 0x3A00, 0x3D00, 0x3F00, 0x4100, 0x4300, 0x4500, 0x4600};
  const uint16_t* ties = bf16 ? kBf16Ties : kFp16Ties;
  const int mant = bf16 ? 7 : 10, max_exp = bf16 ? 254 : 30;  // fraction bits, largest finite exponent
  const uint16_t mant_mask = static_cast<uint16_t>((1 << mant) - 1), exp_mask = bf16 ? 0xFF : 0x1F;
  const uint16_t inf = bf16 ? 0x7F80 : 0x7C00, nan = bf16 ? 0x7FC1 : 0x7E01;
  std::vector<uint8_t> out(static_cast<size_t>(groups) * 64);
  for (int64_t g = 0; g < groups; ++g) {
    const int kind = static_cast<int>(rng() % 8);
    const int j = static_cast<int>(rng() % (2 * max_exp / 2 + 1)) - max_exp / 2;  // tie groups: scale 2^j
    const int center = 1 + static_cast<int>(rng() % max_exp);  // wide groups: top binade
    for (int i = 0; i < 32; ++i) {
      uint64_t r = rng();
      uint16_t h;
      if (kind < 4) {  // ties
        const int k = i == 0 ? 7 : static_cast<int>(r % 8);
        const int step = i == 0 ? 0 : static_cast<int>((r >> 8) % 3) - 1;
        const int exp = ((ties[k] >> mant) & exp_mask) + j;
        const bool finite = exp >= 1 && exp <= max_exp;
        h = finite ? static_cast<uint16_t>(((exp << mant) | (ties[k] & mant_mask)) + step) : 0;
        if (i == 0) h = finite ? static_cast<uint16_t>((exp << mant) | (ties[7] & mant_mask)) : 0;  // 6 * 2^j
      } else {
        int exp = center - static_cast<int>((r >> 8) % 14);
        if (exp < 0) exp = 0;  // subnormal (or zero)
        h = static_cast<uint16_t>((exp << mant) | (r & mant_mask));
        if (kind == 7 && (r >> 20) % 16 == 0) h = (r >> 24) % 2 ? inf : nan;
      }
      h = static_cast<uint16_t>(h | ((r >> 40) & 1) << 15);
      out[(g * 32 + i) * 2] = static_cast<uint8_t>(h);
      out[(g * 32 + i) * 2 + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return out;
}

TEST(QuantizeCuda, PackedEncoderEqualsTheCpuAtEveryScaleAndTie) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(3232);
  const std::vector<std::vector<int64_t>> shapes = {
      {32}, {3, 64}, {7, 4096}, {2, 130, 96}, {1, 128, 256}, {3, 5, 1024}, {4, 1000, 320}};
  int compared = 0;
  for (QuantDtype dtype : {QuantDtype::kBfloat16, QuantDtype::kFloat16}) {
    for (const auto& shape : shapes) {
      for (ScaleRounding rounding : {ScaleRounding::kUp, ScaleRounding::kDown}) {
        auto plan = MakeQuantizePlan(dtype, shape, rounding);
        ASSERT_TRUE(plan.ok());
        SCOPED_TRACE(::testing::Message() << "dtype " << static_cast<int>(dtype) << " shape "
                                          << ::testing::PrintToString(shape) << " rounding " << static_cast<int>(rounding));
        const std::vector<uint8_t> in = Groups16Input(dtype, plan->input_bytes / 64, rng);
        Out cpu = Quantize(false, *plan, in);
        Out gpu = Quantize(true, *plan, in);
        EXPECT_EQ(cpu.values, gpu.values);
        EXPECT_EQ(cpu.scales, gpu.scales);
        if (shape.size() >= 2) {
          QuantLayoutSpec blackwell, shuffled, hopper;
          blackwell.layout = QuantLayout::kBlackwell;
          shuffled.layout = QuantLayout::kBlackwellShuffled;
          hopper.layout = QuantLayout::kHopper;
          for (const QuantLayoutSpec& spec : {blackwell, shuffled, hopper}) {
            const FusedPair r = Fused(*plan, spec, in);
            EXPECT_EQ(r.gpu.values, r.cpu.values);
            EXPECT_EQ(r.gpu.scales, r.cpu.scales);
          }
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 28);
}

// fp32 groups as Groups16Input makes 16-bit ones: tie groups (amax 6 * 2^j, each element an
// e2m1 rounding threshold times 2^j or up to three ulps either side of it: the encoder's lines
// and the contract's dropped bits below 0.5 meet there) and wide groups over 14 binades,
// subnormals, infinities and NaNs included.
std::vector<uint8_t> Groups32Input(int64_t groups, std::mt19937_64& rng) {
  static constexpr uint32_t kTies[] = {0x3E800000u, 0x3F400000u, 0x3FA00000u, 0x3FE00000u,
                                       0x40200000u, 0x40600000u, 0x40A00000u, 0x40C00000u};
  std::vector<uint8_t> out(static_cast<size_t>(groups) * 128);
  for (int64_t g = 0; g < groups; ++g) {
    const int kind = static_cast<int>(rng() % 8);
    const int j = static_cast<int>(rng() % 253) - 126;
    const int center = 1 + static_cast<int>(rng() % 254);
    for (int i = 0; i < 32; ++i) {
      const uint64_t r = rng();
      uint32_t bits;
      if (kind < 4) {
        const int k = i == 0 ? 7 : static_cast<int>(r % 8);
        const int step = i == 0 ? 0 : static_cast<int>((r >> 8) % 7) - 3;
        const int exp = static_cast<int>(kTies[k] >> 23) + j;
        bits = exp >= 1 && exp <= 254 ? ((static_cast<uint32_t>(exp) << 23) | (kTies[k] & 0x7FFFFFu)) + step : 0;
      } else {
        int exp = center - static_cast<int>((r >> 8) % 14);
        if (exp < 0) exp = 0;
        bits = (static_cast<uint32_t>(exp) << 23) | static_cast<uint32_t>((r >> 12) & 0x7FFFFFu);
        if (kind == 7 && (r >> 36) % 16 == 0) bits = (r >> 44) % 2 ? 0x7F800000u : 0x7FC00001u;
      }
      bits |= static_cast<uint32_t>((r >> 50) & 1) << 31;
      for (int b = 0; b < 4; ++b) out[(g * 32 + i) * 4 + b] = static_cast<uint8_t>(bits >> (8 * b));
    }
  }
  return out;
}

// fp32 rows of whole groups take the warp kernels (the three-line code): canonical and both
// fused Blackwell pairs (flat runs, and rows of 32 groups or more in chunks) equal the CPU's.
TEST(QuantizeCuda, Fp32WholeGroupsEqualTheCpuAtEveryScaleAndTie) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(3233);
  const std::vector<std::vector<int64_t>> shapes = {
      {32}, {3, 64}, {7, 4096}, {2, 130, 96}, {1, 128, 256}, {3, 5, 1024}, {4, 1000, 320}};
  int compared = 0;
  for (const auto& shape : shapes) {
    for (ScaleRounding rounding : {ScaleRounding::kUp, ScaleRounding::kDown}) {
      auto plan = MakeQuantizePlan(QuantDtype::kFloat32, shape, rounding);
      ASSERT_TRUE(plan.ok());
      SCOPED_TRACE(::testing::Message() << "shape " << ::testing::PrintToString(shape) << " rounding "
                                        << static_cast<int>(rounding));
      const std::vector<uint8_t> in = Groups32Input(plan->input_bytes / 128, rng);
      Out cpu = Quantize(false, *plan, in);
      Out gpu = Quantize(true, *plan, in);
      EXPECT_EQ(cpu.values, gpu.values);
      EXPECT_EQ(cpu.scales, gpu.scales);
      if (shape.size() >= 2) {
        QuantLayoutSpec blackwell, shuffled;
        blackwell.layout = QuantLayout::kBlackwell;
        shuffled.layout = QuantLayout::kBlackwellShuffled;
        for (const QuantLayoutSpec& spec : {blackwell, shuffled}) {
          const FusedPair r = Fused(*plan, spec, in);
          EXPECT_EQ(r.gpu.values, r.cpu.values);
          EXPECT_EQ(r.gpu.scales, r.cpu.scales);
        }
      }
      ++compared;
    }
  }
  EXPECT_EQ(compared, 14);
}

// The fused Hopper pair on the GPU equals the CPU's (which the CPU test holds to
// quantize-then-swizzle), over dtypes, roundings, both mma versions, num_warps and align_k,
// ragged K, N off every tile boundary, and inputs 16-byte aligned or not (the element path).
TEST(QuantizeCuda, HopperFusedEqualsTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(2930);
  const int warps[] = {1, 4, 8, 16};
  const int aligns[] = {2, 4, 64};
  int compared = 0;
  for (int trial = 0; trial < 36; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    QuantLayoutSpec spec;
    spec.layout = QuantLayout::kHopper;
    spec.mma_version = 2 + (trial / 6) % 2;
    spec.num_warps = warps[rng() % 4];
    spec.align_k = aligns[rng() % 3];
    const bool unaligned = trial % 4 == 3;
    const std::vector<int64_t> shape = {1 + static_cast<int64_t>(rng() % 3), 1 + static_cast<int64_t>(rng() % 300),
                                        2 * (1 + static_cast<int64_t>(rng() % 300))};
    auto plan = MakeQuantizePlan(dtype, shape, rounding);
    ASSERT_TRUE(plan.ok());
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " shape " << ::testing::PrintToString(shape)
                                      << " unaligned " << unaligned);
    const FusedPair r = Fused(*plan, spec, SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng),
                              unaligned ? QuantDtypeBytes(dtype) : 0);
    EXPECT_EQ(r.gpu.values, r.cpu.values);
    EXPECT_EQ(r.gpu.scales, r.cpu.scales);
    ++compared;
  }
  EXPECT_EQ(compared, 36);
}

// Tiles wholly inside the rows and K groups take straight loads (16-bit types, rows of whole
// 16-byte words, the input 16-byte aligned); the edge tiles of the same tensor take the
// bounded loads. Shapes with both, the input aligned and not, and rows of 520 bytes (the
// bounded path everywhere), against the CPU.
TEST(QuantizeCuda, HopperFusedInteriorAndEdgeTilesEqualTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(3119);
  const std::vector<std::vector<int64_t>> shapes = {{2, 200, 520}, {1, 128, 4096}, {3, 64, 128}, {1, 65, 136}, {2, 130, 260}};
  int compared = 0;
  for (const QuantDtype dtype : {QuantDtype::kBfloat16, QuantDtype::kFloat16}) {
    for (const std::vector<int64_t>& shape : shapes) {
      for (const int mma : {2, 3}) {
        for (const bool unaligned : {false, true}) {
          QuantLayoutSpec spec;
          spec.layout = QuantLayout::kHopper;
          spec.mma_version = mma;
          auto plan = MakeQuantizePlan(dtype, shape, compared % 2 ? ScaleRounding::kDown : ScaleRounding::kUp);
          ASSERT_TRUE(plan.ok());
          SCOPED_TRACE(::testing::Message() << "dtype " << static_cast<int>(dtype) << " shape "
                                            << ::testing::PrintToString(shape) << " mma " << mma << " unaligned "
                                            << unaligned);
          const FusedPair r = Fused(*plan, spec, SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng),
                                    unaligned ? 16 + QuantDtypeBytes(dtype) : 0);
          EXPECT_EQ(r.gpu.values, r.cpu.values);
          EXPECT_EQ(r.gpu.scales, r.cpu.scales);
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 40);
}

// The fused pairs through QuantizeHostBuffersOnCuda (the CLI's --device cuda:N path), on the
// bf16 groups of the packed encoder: ties on every rounding threshold.
TEST(QuantizeCuda, FusedHostBuffersEqualTheCpuOnTies) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(3233);
  QuantLayoutSpec hopper, blackwell, shuffled;
  hopper.layout = QuantLayout::kHopper;
  blackwell.layout = QuantLayout::kBlackwell;
  shuffled.layout = QuantLayout::kBlackwellShuffled;
  for (const QuantLayoutSpec& spec : {hopper, blackwell, shuffled}) {
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 130, 96}, std::vector<int64_t>{3, 257, 1024}}) {
      SCOPED_TRACE(::testing::Message() << "layout " << static_cast<int>(spec.layout) << " shape "
                                        << ::testing::PrintToString(shape));
      auto plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape);
      ASSERT_TRUE(plan.ok());
      const std::vector<uint8_t> in = Groups16Input(QuantDtype::kBfloat16, plan->input_bytes / 64, rng);
      auto sizes = PlanQuantizeLayout(*plan, spec);
      ASSERT_TRUE(sizes.ok());
      Out cpu, gpu;
      cpu.values.assign(sizes->values_bytes, 0xAB);
      cpu.scales.assign(sizes->scales_bytes, 0xAB);
      gpu = cpu;
      ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), cpu.values.data(), cpu.values.size(),
                                      cpu.scales.data(), cpu.scales.size()).ok());
      absl::Status st = QuantizeHostBuffersOnCuda(*plan, in.data(), in.size(), gpu.values.data(), gpu.values.size(),
                                                  gpu.scales.data(), gpu.scales.size(), 0, spec);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(gpu.values, cpu.values);
      EXPECT_EQ(gpu.scales, cpu.scales);
    }
  }
}

// The trtllm layouts on the GPU equal the CPU's (held to quantize-then-prepare by the CPU
// test): w13 and w2, both alignments, bias none / float32 / bfloat16, gpt-oss-like rows, and
// an input that is not 16-byte aligned (the element path).
TEST(QuantizeCuda, TrtllmFusedEqualsTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(3132);
  int compared = 0;
  for (int trial = 0; trial < 18; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    QuantLayoutSpec spec;
    spec.layout = trial % 2 == 0 ? QuantLayout::kTrtllmW13 : QuantLayout::kTrtllmW2;
    spec.align = trial % 4 < 2 ? 128 : 256;
    const int bias_kind = trial % 3;
    const bool unaligned = trial % 5 == 4;
    const std::vector<int64_t> shape = {1 + static_cast<int64_t>(rng() % 3), 2 * (1 + static_cast<int64_t>(rng() % 200)),
                                        32 * (1 + static_cast<int64_t>(rng() % 100))};
    auto plan = MakeQuantizePlan(dtype, shape, rounding);
    ASSERT_TRUE(plan.ok());
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " shape " << ::testing::PrintToString(shape));
    const std::vector<uint8_t> in = SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng);
    std::vector<uint8_t> bias(static_cast<size_t>(shape[0] * shape[1] * (bias_kind == 2 ? 2 : 4)));
    for (auto& b : bias) b = static_cast<uint8_t>(rng());
    auto sizes = PlanQuantizeLayout(*plan, spec);
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    Out cpu, gpu;
    cpu.values.assign(sizes->values_bytes, 0xAB);
    cpu.scales.assign(sizes->scales_bytes, 0xAB);
    std::vector<uint8_t> cpu_bias(bias_kind ? sizes->bias_bytes : 0, 0xAB), gpu_bias(cpu_bias.size());
    QuantBias qb;
    if (bias_kind) qb = {bias.data(), bias_kind == 2, cpu_bias.data()};
    ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), cpu.values.data(), cpu.values.size(),
                                    cpu.scales.data(), cpu.scales.size(), qb).ok());
    const size_t off = unaligned ? QuantDtypeBytes(dtype) : 0;
    uint8_t *din = nullptr, *dv = nullptr, *ds = nullptr, *dbi = nullptr, *dbo = nullptr;
    ASSERT_EQ(cudaMalloc(&din, in.size() + off), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dv, cpu.values.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ds, cpu.scales.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dbi, bias.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dbo, cpu_bias.size() + 1), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(din + off, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dbi, bias.data(), bias.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dv, 0xAB, cpu.values.size()), cudaSuccess);
    ASSERT_EQ(cudaMemset(ds, 0xAB, cpu.scales.size()), cudaSuccess);
    QuantBias gb;
    if (bias_kind) gb = {dbi, bias_kind == 2, dbo};
    absl::Status st = QuantizeLayoutOnCuda(*plan, spec, din + off, dv, ds, nullptr, gb);
    EXPECT_TRUE(st.ok()) << st;
    gpu.values.resize(cpu.values.size());
    gpu.scales.resize(cpu.scales.size());
    EXPECT_EQ(cudaMemcpy(gpu.values.data(), dv, gpu.values.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(gpu.scales.data(), ds, gpu.scales.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(gpu_bias.data(), dbo, gpu_bias.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint8_t* p : {din, dv, ds, dbi, dbo}) (void)cudaFree(p);
    EXPECT_EQ(gpu.values, cpu.values);
    EXPECT_EQ(gpu.scales, cpu.scales);
    EXPECT_EQ(gpu_bias, cpu_bias);
    ++compared;
  }
  EXPECT_EQ(compared, 18);
}
#endif

}  // namespace
}  // namespace wprep
