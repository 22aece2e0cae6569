// quantize_mxfp4 on the GPU: the reference vectors, and byte equality with the CPU engine
// on random shapes full of the special values. Skipped where no GPU is found.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

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

// The data folder: $WPREP_TEST_DATA_DIR where the build tree moved (GPU bundle), else the
// source tree's.
std::string QuantDataDir() {
  const char* env = std::getenv("WPREP_TEST_DATA_DIR");
  return std::string(env != nullptr && *env != '\0' ? env : WPREP_TEST_DATA_DIR) + "/golden_quant/";
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

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
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    Out cpu = Quantize(false, *plan, in);
    Out gpu = Quantize(true, *plan, in);
    EXPECT_EQ(cpu.values, gpu.values);
    EXPECT_EQ(cpu.scales, gpu.scales);
    ++compared;
  }
  EXPECT_EQ(compared, 60);
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
// The fused Blackwell pair on the GPU equals the CPU's (which the CPU test holds to
// quantize-then-swizzle), on random [E, N, K] with the special values.
TEST(QuantizeCuda, BlackwellFusedEqualsTheCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(2829);
  int compared = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const QuantDtype dtype = static_cast<QuantDtype>(trial % 3);
    const ScaleRounding rounding = (trial / 3) % 2 ? ScaleRounding::kDown : ScaleRounding::kUp;
    const std::vector<int64_t> shape = {1 + static_cast<int64_t>(rng() % 3),
                                        1 + static_cast<int64_t>(rng() % 300),
                                        2 * (1 + static_cast<int64_t>(rng() % 300))};
    auto plan = MakeQuantizePlan(dtype, shape, rounding);
    ASSERT_TRUE(plan.ok());
    auto sizes = PlanQuantizeBlackwell(*plan);
    ASSERT_TRUE(sizes.ok());
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    const std::vector<uint8_t> in =
        SpecialInput(dtype, plan->input_bytes / QuantDtypeBytes(dtype), rng);
    std::vector<uint8_t> cv(sizes->values_bytes, 0xAB), cs(sizes->scales_bytes, 0xAB);
    ASSERT_TRUE(QuantizeBlackwellOnCpu(*plan, in.data(), in.size(), cv.data(), cv.size(),
                                       cs.data(), cs.size()).ok());
    void *din = nullptr, *dv = nullptr, *ds = nullptr;
    ASSERT_EQ(cudaMalloc(&din, in.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dv, cv.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&ds, cs.size()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(din, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dv, 0xAB, cv.size()), cudaSuccess);  // padding must be written
    ASSERT_EQ(cudaMemset(ds, 0xAB, cs.size()), cudaSuccess);
    absl::Status st = QuantizeBlackwellOnCuda(*plan, din, dv, ds, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<uint8_t> gv(cv.size()), gs(cs.size());
    ASSERT_EQ(cudaMemcpy(gv.data(), dv, gv.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gs.data(), ds, gs.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    (void)cudaFree(din);
    (void)cudaFree(dv);
    (void)cudaFree(ds);
    EXPECT_EQ(gv, cv);
    EXPECT_EQ(gs, cs);
    ++compared;
  }
  EXPECT_EQ(compared, 24);
}
#endif

}  // namespace
}  // namespace wprep
