// The CUDA engine against the CPU engine, byte for byte. Every test skips (reported as
// skipped, never passed) where no GPU exists.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "golden.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace wprep {
namespace {

#if !WPREP_HAVE_CUDA

TEST(Gpu, RequiresACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Device buffer owned by a test.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t n, int device) : size_(n) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    if (n > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, n), cudaSuccess);
    }
    cudaSetDevice(prev);
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

std::vector<uint8_t> CpuConvert(const Plan& plan, const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out(plan.output_bytes);
  EXPECT_TRUE(ConvertOnCpu(plan, in.data(), in.size(), out.data(), out.size()).ok());
  return out;
}

// Runs the plan on `device` (input copied there), on `stream`; returns the output.
std::vector<uint8_t> GpuConvert(const Plan& plan, const std::vector<uint8_t>& in, int device = 0,
                                cudaStream_t stream = nullptr, size_t in_offset = 0) {
  DeviceBuffer d_in(in.size() + in_offset, device), d_out(plan.output_bytes + 16, device);
  EXPECT_EQ(cudaMemcpy(d_in.get() + in_offset, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  {  // cudaMemset needs the buffer's device current; the conversion itself must not.
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    EXPECT_EQ(cudaMemset(d_out.get(), 0xEE, plan.output_bytes + 16), cudaSuccess);  // poison
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaSetDevice(current);
  }
  const absl::Status s = ConvertOnCuda(plan, d_in.get() + in_offset, d_out.get(), stream);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<uint8_t> out(plan.output_bytes + 16);
  EXPECT_EQ(cudaMemcpy(out.data(), d_out.get(), out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = plan.output_bytes; i < out.size(); ++i) {
    EXPECT_EQ(out[i], 0xEE) << "wrote past the output at byte " << i;
  }
  out.resize(plan.output_bytes);
  return out;
}

Plan MustPlan(const ConversionSpec& spec, const std::vector<int64_t>& shape,
              const InputBinding& b = {}) {
  auto plan = MakePlan(spec, shape, b);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : Plan{};
}

// Every kernel variant, plus more Blackwell tilings ({128, 20}: tile_n not a multiple of
// 8, so a swizzle thread's eight storage rows can straddle two N tiles).
std::vector<ConversionSpec> AllSpecs() {
  std::vector<ConversionSpec> specs = KernelVariantSpecs();
  for (auto [bk, bn] : std::vector<std::pair<int, int>>{{256, 128}, {64, 64}, {128, 20}}) {
    for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle, Direction::kRetile}) {
      ConversionSpec s;
      s.layout = Layout::kBlackwellShuffledValue;
      s.direction = d;
      s.blackwell = {bk, bn};
      s.blackwell_to = {128, 256};
      specs.push_back(s);
    }
  }
  return specs;
}

TEST_F(GpuTest, EveryGoldenCaseMatchesTheReference) {
  int ran = 0;
  for (const auto& c : testing::GoldenCases()) {
    if (c.error.has_value()) continue;
    SCOPED_TRACE(c.name);
    const Plan plan = MustPlan(c.spec, c.logical_shape);
    const auto input = testing::SplitMix64Bytes(c.input_seed, c.input_bytes);
    const auto out = GpuConvert(plan, input);
    EXPECT_EQ(testing::Sha256Hex(out), c.output_sha256);
    ++ran;
  }
  EXPECT_GT(ran, 100);
}

TEST_F(GpuTest, RandomShapesEqualTheCpuEngine) {
  std::mt19937_64 rng(2024);
  for (const ConversionSpec& spec : AllSpecs()) {
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<int64_t> shape;
      for (int i = 0, lead = static_cast<int>(rng() % 3); i < lead; ++i) shape.push_back(static_cast<int64_t>(rng() % 3) + 1);
      shape.push_back(2 * (static_cast<int64_t>(rng() % 700) + 1));
      shape.push_back(2 * (static_cast<int64_t>(rng() % 700) + 1));
      SCOPED_TRACE(Describe(spec));
      const Plan plan = MustPlan(spec, shape);
      const auto x = testing::RandomBytes(plan.input_bytes, rng());
      EXPECT_EQ(GpuConvert(plan, x), CpuConvert(plan, x));
    }
  }
}

TEST_F(GpuTest, StridedAndMisalignedInputsEqualTheCpuEngine) {
  std::mt19937_64 rng(11);
  for (const ConversionSpec& spec : AllSpecs()) {
    for (int64_t pad : {16, 3}) {
      const std::vector<int64_t> shape = {2, 2 * static_cast<int64_t>(rng() % 300 + 1),
                                          2 * static_cast<int64_t>(rng() % 300 + 1)};
      const Plan dense = MustPlan(spec, shape);
      const auto x = testing::RandomBytes(dense.input_bytes, rng());
      const auto [buffer, strides] = testing::MakeStridedInput(dense, x, pad);
      const Plan strided = MustPlan(spec, shape, InputBinding{strides, buffer.size()});
      SCOPED_TRACE(Describe(spec) + " pad=" + std::to_string(pad));
      const auto expected = CpuConvert(dense, x);
      EXPECT_EQ(GpuConvert(strided, buffer), expected);
      // A dense input at an odd address takes the byte path.
      EXPECT_EQ(GpuConvert(dense, x, 0, nullptr, /*in_offset=*/1), expected);
    }
  }
}

TEST_F(GpuTest, RunsOnTheOwningDeviceAndKeepsTheCurrentOne) {
  int count = CudaDeviceCount();
  if (count < 2) GTEST_SKIP() << "needs two GPUs, found " << count;
  ConversionSpec spec;
  const Plan plan = MustPlan(spec, {3, 512, 256});
  const auto x = testing::RandomBytes(plan.input_bytes, 3);
  ASSERT_CUDA(cudaSetDevice(0));
  cudaStream_t stream1;
  ASSERT_CUDA(cudaSetDevice(1));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream1, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaSetDevice(0));
  EXPECT_EQ(GpuConvert(plan, x, /*device=*/1, stream1), CpuConvert(plan, x));
  int current = -1;
  ASSERT_CUDA(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
  // A stream of the wrong device is refused.
  DeviceBuffer in(plan.input_bytes, 0), out(plan.output_bytes, 0);
  EXPECT_EQ(ConvertOnCuda(plan, in.get(), out.get(), stream1).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_CUDA(cudaStreamDestroy(stream1));
}

TEST_F(GpuTest, NonDefaultStreamAndCurrentDeviceUnchanged) {
  ConversionSpec spec;
  spec.hopper = {-1, 2};
  const Plan plan = MustPlan(spec, {2, 300, 200});
  const auto x = testing::RandomBytes(plan.input_bytes, 4);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EXPECT_EQ(GpuConvert(plan, x, 0, stream), CpuConvert(plan, x));
  int current = -1;
  ASSERT_CUDA(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

// Captured into a CUDA graph (global capture mode, as frameworks capture), a conversion
// records a graph that converts when launched, and nothing runs while capturing.
TEST_F(GpuTest, CapturesIntoACudaGraph) {
  ConversionSpec spec;
  spec.hopper = {-2, 3};
  const Plan plan = MustPlan(spec, {2, 512, 256});
  const auto x = testing::RandomBytes(plan.input_bytes, 9);
  DeviceBuffer in(plan.input_bytes, 0), out(plan.output_bytes, 0);
  ASSERT_CUDA(cudaMemcpy(in.get(), x.data(), x.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(out.get(), 0xA5, plan.output_bytes));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status run = ConvertOnCuda(plan, in.get(), out.get(), stream);
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(run.ok()) << run;
  std::vector<uint8_t> got(plan.output_bytes);
  ASSERT_CUDA(cudaMemcpy(got.data(), out.get(), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, std::vector<uint8_t>(plan.output_bytes, 0xA5)) << "capturing ran the conversion";
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaMemcpy(got.data(), out.get(), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, CpuConvert(plan, x));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST_F(GpuTest, EmptyTensorsLaunchNothingAndSucceed) {
  for (const ConversionSpec& spec : AllSpecs()) {
    for (auto shape : std::vector<std::vector<int64_t>>{{0, 256}, {256, 0}, {2, 0, 4, 4}}) {
      const Plan plan = MustPlan(spec, shape);
      EXPECT_TRUE(ConvertOnCuda(plan, nullptr, nullptr, nullptr).ok()) << Describe(spec);
    }
  }
}

TEST_F(GpuTest, RejectsHostPointersAndOverlap) {
  ConversionSpec spec;
  const Plan plan = MustPlan(spec, {256, 256});
  std::vector<uint8_t> host(plan.input_bytes);
  DeviceBuffer out(plan.output_bytes + plan.input_bytes, 0);
  EXPECT_EQ(ConvertOnCuda(plan, host.data(), out.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConvertOnCuda(plan, out.get(), out.get() + 16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuTest, ConversionsAllocateNoDeviceMemory) {
  const auto specs = AllSpecs();
  std::vector<Plan> plans;
  size_t max_in = 0, max_out = 0;
  for (const auto& s : specs) {
    plans.push_back(MustPlan(s, {4, 1024, 1024}));
    max_in = std::max<size_t>(max_in, plans.back().input_bytes);
    max_out = std::max<size_t>(max_out, plans.back().output_bytes);
  }
  DeviceBuffer in(max_in, 0), out(max_out, 0);
  ASSERT_CUDA(cudaMemset(in.get(), 0x5A, max_in));
  // Warm-up loads every kernel (module loading may allocate once).
  for (const Plan& p : plans) ASSERT_TRUE(ConvertOnCuda(p, in.get(), out.get(), nullptr).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  size_t free_before = 0, total = 0, free_after = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));
  for (int rep = 0; rep < 20; ++rep) {
    for (const Plan& p : plans) ASSERT_TRUE(ConvertOnCuda(p, in.get(), out.get(), nullptr).ok());
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_CUDA(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_after, free_before);
}

// ---------------------------------------------------------------------------------------
// The scale layouts, blackwell_value and checkpoint order (packing axis -2).

// Every case of one manifest on the GPU: the output poisoned first, every byte compared
// (sha256, and the stored file where there is one), the input through its manifest view.
void ExpectGoldenSetOnGpu(testing::GoldenSet set, size_t min_cases) {
  size_t ran = 0;
  for (const auto& c : testing::GoldenCases(set)) {
    if (c.error.has_value()) continue;
    SCOPED_TRACE(c.name);
    const Plan plan = MustPlan(c.spec, c.logical_shape, InputBinding{c.input_strides, c.input_bytes});
    const auto input = testing::GoldenInput(c);
    ASSERT_EQ(testing::Sha256Hex(input), c.input_sha256);
    const auto out = GpuConvert(plan, input);
    EXPECT_EQ(testing::Sha256Hex(out), c.output_sha256);
    if (!c.output_file.empty()) {
      EXPECT_TRUE(out == testing::ReadFile(c.output_file));
    }
    ++ran;
  }
  EXPECT_GE(ran, min_cases);
}

TEST_F(GpuTest, EveryScaleGoldenCaseMatchesTheReference) {
  ExpectGoldenSetOnGpu(testing::GoldenSet::kScales, 50);
}

TEST_F(GpuTest, EveryPackingGoldenCaseMatchesTheReference) {
  ExpectGoldenSetOnGpu(testing::GoldenSet::kPacking, 108);
}

// Fresh random bytes on random shapes (every edge: odd sizes where allowed, partial tiles,
// tensors of a few tiles that take the split launch) of every spec the sweep has.
TEST_F(GpuTest, EverySweptSpecOnRandomShapesEqualsTheCpuEngine) {
  std::mt19937_64 rng(777);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    for (int trial = 0; trial < 4; ++trial) {
      const auto shape = testing::RandomShapeFor(spec, rng(), trial == 0 ? 40 : 700);
      SCOPED_TRACE(Describe(spec));
      const Plan plan = MustPlan(spec, shape);
      const auto x = testing::RandomBytes(plan.input_bytes, rng());
      EXPECT_EQ(GpuConvert(plan, x), CpuConvert(plan, x));
    }
  }
}

// Padded, transposed and byte-strided views, and dense inputs at an odd address, convert
// like the dense tensor on the CPU.
TEST_F(GpuTest, EverySweptSpecOnViewsEqualsTheDenseCpuConversion) {
  std::mt19937_64 rng(778);
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    const auto shape = testing::RandomShapeFor(spec, rng(), 300);
    const Plan dense = MustPlan(spec, shape);
    const auto x = testing::RandomBytes(dense.input_bytes, rng());
    const auto expected = CpuConvert(dense, x);
    for (const auto& [name, view] : testing::ViewsOf(dense, x)) {
      SCOPED_TRACE(Describe(spec) + " " + name);
      const Plan strided = MustPlan(spec, shape, InputBinding{view.strides, view.buffer.size()});
      EXPECT_EQ(GpuConvert(strided, view.buffer), expected);
    }
    SCOPED_TRACE(Describe(spec) + " at an odd address");
    EXPECT_EQ(GpuConvert(dense, x, 0, nullptr, /*in_offset=*/1), expected);
  }
}

// Scales as loaders pass them (the transposed view of a checkpoint's [E, N, K/32]), at a
// size where every tile runs many times, at the bench shape, with N and K/32 off every
// tile (blackwell_scale's view takes the interleave pass: rows of 5 or 90 bytes, padding
// rows and columns), two leading dims, and the checkpoint at odd byte offsets. The
// hopper_scale swizzles take passes of their own where matrices are 16-byte multiples
// (mx_axis -2: S rows of 90, 36, 7 and 45 groups, N not a multiple of 16, and rows of more
// than 512 groups for the tiles; mx_axis -1: S columns of 90 or 36 groups in one band of
// 32 num_warps rows, of 224 in several; 128 and odd ones for the tiles).
TEST_F(GpuTest, LoaderTransposedScaleViewsEqualTheCpuEngine) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {4, 90, 2880}, {16, 128, 4096}, {3, 5, 300}, {2, 3, 17, 129}, {1, 36, 64}, {2, 7, 32},
           {3, 45, 144}, {1, 7, 37}, {2, 600, 16}, {2, 224, 96}}) {
    const size_t r = shape.size();
    const int64_t k32 = shape[r - 2], n = shape[r - 1];
    int64_t e = 1;
    for (size_t i = 0; i + 2 < r; ++i) e *= shape[i];
    const auto checkpoint = testing::RandomBytes(static_cast<uint64_t>(e * n * k32), 6);
    const std::vector<int64_t> strides = testing::CheckpointScaleViewStrides(shape);
    const InputBinding view{strides, checkpoint.size()};
    for (const ConversionSpec& spec : testing::SweepSpecs()) {
      if (spec.direction != Direction::kSwizzle ||
          (spec.layout != Layout::kHopperScale && spec.layout != Layout::kBlackwellScale)) {
        continue;
      }
      SCOPED_TRACE(Describe(spec) + " " + ::testing::PrintToString(shape));
      const Plan plan = MustPlan(spec, shape, view);
      const std::vector<uint8_t> want = CpuConvert(plan, checkpoint);
      for (size_t offset : {0, 1, 6}) EXPECT_EQ(GpuConvert(plan, checkpoint, 0, nullptr, offset), want) << offset;
    }
  }
}

// Scale unswizzles at model-like shapes, where the result is S with dense rows (mx_axis -1,
// and mx_axis -2 where upstream's padded S is no larger: N a multiple of 32 num_warps) or
// dense columns: random storage bytes, padding included, as the CPU engine reads them.
TEST_F(GpuTest, ScaleUnswizzlesAtModelShapesEqualTheCpuEngine) {
  std::mt19937_64 rng(779);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{3, 90, 256}, {2, 224, 512}, {2, 64, 1024}, {1, 36, 128}, {2, 45, 96}}) {
    for (const ConversionSpec& spec : testing::SweepSpecs()) {
      if (spec.direction != Direction::kUnswizzle || spec.layout != Layout::kHopperScale) continue;
      SCOPED_TRACE(Describe(spec) + " " + ::testing::PrintToString(shape));
      const Plan plan = MustPlan(spec, shape);
      const auto x = testing::RandomBytes(plan.input_bytes, rng());
      EXPECT_EQ(GpuConvert(plan, x), CpuConvert(plan, x));
    }
  }
}

TEST_F(GpuTest, EverySweptSpecOnEmptyTensorsLaunchesNothing) {
  for (const ConversionSpec& spec : testing::SweepSpecs()) {
    for (auto shape : std::vector<std::vector<int64_t>>{{0, 256}, {256, 0}, {2, 0, 4, 4}}) {
      const Plan plan = MustPlan(spec, shape);
      EXPECT_TRUE(ConvertOnCuda(plan, nullptr, nullptr, nullptr).ok()) << Describe(spec);
    }
  }
}

TEST_F(GpuTest, EverySweptSpecAllocatesNoDeviceMemory) {
  std::vector<Plan> plans;
  size_t max_in = 0, max_out = 0;
  for (const auto& s : testing::SweepSpecs()) {
    plans.push_back(MustPlan(s, {4, 1024, 1024}));
    max_in = std::max<size_t>(max_in, plans.back().input_bytes);
    max_out = std::max<size_t>(max_out, plans.back().output_bytes);
  }
  DeviceBuffer in(max_in, 0), out(max_out, 0);
  ASSERT_CUDA(cudaMemset(in.get(), 0x5A, max_in));
  for (const Plan& p : plans) ASSERT_TRUE(ConvertOnCuda(p, in.get(), out.get(), nullptr).ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  size_t free_before = 0, total = 0, free_after = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));
  for (int rep = 0; rep < 5; ++rep) {
    for (const Plan& p : plans) ASSERT_TRUE(ConvertOnCuda(p, in.get(), out.get(), nullptr).ok());
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_CUDA(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_after, free_before);
}

#endif  // WPREP_HAVE_CUDA

}  // namespace
}  // namespace wprep
