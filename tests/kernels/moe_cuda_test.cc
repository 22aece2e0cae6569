// The trtllm-gen MoE engine on the GPU: every reference vector of both manifests, and
// full gpt-oss-120b- and DeepSeek-V3-shaped layers against the CPU engine, byte for
// byte. Every test skips (reported as skipped, never passed) where no GPU exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "golden.h"
#include "moe_golden.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/moe.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "driver_entry.h"
#endif

namespace wprep {
namespace {

#if !WPREP_HAVE_CUDA

TEST(MoeGpu, RequiresACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#else

using testing::DriverEntry;

#define ASSERT_CUDA(call) \
  ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

class MoeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : size(n) {
    if (n > 0) {
      EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess);
    }
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr); }
  void* ptr = nullptr;
  size_t size = 0;
};

// Runs the plan on the GPU with every input at byte `offset` of its allocation and every
// output at byte `out_offset` (1: no pointer is aligned, so the narrow-word kernels run;
// an unaligned input with an aligned output: the wide-word kernels' unaligned loads);
// outputs are poisoned first.
std::vector<std::vector<uint8_t>> RunOnGpu(const MoePlan& plan,
                                           const std::vector<std::vector<uint8_t>>& in,
                                           size_t offset, size_t out_offset) {
  std::vector<std::unique_ptr<DeviceBuffer>> d_in, d_out;
  std::vector<const void*> in_ptrs;
  std::vector<void*> out_ptrs;
  for (const auto& b : in) {
    d_in.push_back(std::make_unique<DeviceBuffer>(b.size() + offset));
    if (!b.empty()) {
      EXPECT_EQ(cudaMemcpy(d_in.back()->get() + offset, b.data(), b.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    in_ptrs.push_back(d_in.back()->get() + offset);
  }
  for (uint64_t n : plan.output_bytes) {
    d_out.push_back(std::make_unique<DeviceBuffer>(n + out_offset));
    if (n > 0) {
      EXPECT_EQ(cudaMemset(d_out.back()->get(), 0xA5, n + out_offset), cudaSuccess);
    }
    out_ptrs.push_back(d_out.back()->get() + out_offset);
  }
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const absl::Status s = RunMoeCuda(plan, in_ptrs, out_ptrs, stream);
  EXPECT_TRUE(s.ok()) << plan.identity << ": " << s;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  std::vector<std::vector<uint8_t>> out;
  for (size_t i = 0; i < plan.output_bytes.size(); ++i) {
    out.emplace_back(plan.output_bytes[i]);
    if (!out.back().empty()) {
      EXPECT_EQ(cudaMemcpy(out.back().data(), out_ptrs[i], out.back().size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }
  return out;
}

void RunSetOnGpu(const std::string& set) {
  int valid = 0;
  for (const testing::MoeGoldenCase& c : testing::LoadMoeGolden(set)) {
    if (c.error) continue;
    SCOPED_TRACE(set + "/" + c.name);
    auto plan = testing::PlanMoeGolden(c);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ++valid;
    const auto in = testing::InPlanOrder(*plan, c, testing::MoeGoldenInputs(c));
    const auto cpu = testing::RunMoeCpuFresh(*plan, in);
    for (const auto& [offset, out_offset] :
         std::vector<std::pair<size_t, size_t>>{{0, 0}, {1, 1}, {3, 0}, {10, 0}}) {
      const auto gpu = RunOnGpu(*plan, in, offset, out_offset);
      const std::string engine = absl::StrCat("cuda, input at +", offset, ", output at +", out_offset);
      testing::ExpectMatchesGolden(c, *plan, gpu, engine.c_str());
      EXPECT_TRUE(gpu == cpu) << "GPU and CPU engines differ";
    }
  }
  EXPECT_GT(valid, 0);
}

TEST_F(MoeGpu, EveryMxfp4CaseMatches) { RunSetOnGpu("golden_trtllm"); }

TEST_F(MoeGpu, EveryFormatsCaseMatches) { RunSetOnGpu("golden_trtllm_formats"); }

// splitmix64 words, filled on all cores (layers are gigabytes).
std::vector<uint8_t> FastRandom(uint64_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t words = n / 8, per = (words + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t i = t * per; i < std::min(words, (t + 1) * per); ++i) {
        uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        std::memcpy(out.data() + 8 * i, &z, 8);
      }
    });
  }
  for (auto& th : pool) th.join();
  for (uint64_t i = words * 8; i < n; ++i) out[i] = static_cast<uint8_t>(i * 131 + seed);
  return out;
}

// One prepare_* of a full layer on both engines; the outputs must be equal.
void ExpectLayerEqual(MoeOp op, std::vector<std::pair<std::string, std::string>> kv,
                      std::vector<MoeTensorDesc> inputs) {
  MoeParams params;
  for (const auto& [k, v] : kv) ASSERT_TRUE(SetMoeParam(params, k, v).ok()) << k;
  auto plan = PlanMoe(op, params, std::move(inputs));
  ASSERT_TRUE(plan.ok()) << plan.status();
  SCOPED_TRACE(plan->identity);
  std::vector<std::vector<uint8_t>> in;
  for (size_t i = 0; i < plan->inputs.size(); ++i) {
    in.push_back(FastRandom(plan->input_bytes[i], 1000 + i));
  }
  const auto gpu = RunOnGpu(*plan, in, 0, 0);
  const auto cpu = testing::RunMoeCpuFresh(*plan, in, 0);
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    EXPECT_EQ(gpu[i].size(), plan->output_bytes[i]);
    EXPECT_TRUE(gpu[i] == cpu[i]) << plan->outputs[i].name << " differs";
  }
}

constexpr MoeDType kU8 = MoeDType::kUint8;
constexpr MoeDType kF32 = MoeDType::kFloat32;
constexpr MoeDType kBf16 = MoeDType::kBfloat16;

TEST_F(MoeGpu, GptOss120bLayerMxfp4EqualsCpu) {
  constexpr int64_t e = 128, h = 2880, i = 2880;
  ExpectLayerEqual(MoeOp::kPrepareW13, {{"align", "256"}},
                   {{"values", kU8, {e, 2 * i, h / 2}}, {"scales", kU8, {e, 2 * i, h / 32}},
                    {"bias", kBf16, {e, 2 * i}}});
  ExpectLayerEqual(MoeOp::kPrepareW2, {{"align", "256"}},
                   {{"values", kU8, {e, h, i / 2}}, {"scales", kU8, {e, h, i / 32}},
                    {"bias", kF32, {e, h}}});
}

constexpr int64_t kDsE = 256, kDsH = 7168, kDsI = 2048;

TEST_F(MoeGpu, DeepSeekV3LayerMxfp4EqualsCpu) {
  ExpectLayerEqual(MoeOp::kPrepareW13, {{"align", "256"}},
                   {{"values", kU8, {kDsE, 2 * kDsI, kDsH / 2}},
                    {"scales", kU8, {kDsE, 2 * kDsI, kDsH / 32}},
                    {"bias", kF32, {kDsE, 2 * kDsI}}});
  ExpectLayerEqual(MoeOp::kPrepareW2, {{"align", "256"}},
                   {{"values", kU8, {kDsE, kDsH, kDsI / 2}}, {"scales", kU8, {kDsE, kDsH, kDsI / 32}},
                    {"bias", kF32, {kDsE, kDsH}}});
}

TEST_F(MoeGpu, DeepSeekV3LayerNvfp4EqualsCpu) {
  ExpectLayerEqual(MoeOp::kPrepareW13,
                   {{"format", "nvfp4"}, {"gated", "true"}, {"align_h", "256"}, {"align_i", "64"}},
                   {{"values", kU8, {kDsE, 2 * kDsI, kDsH / 2}},
                    {"scales", kU8, {kDsE, 2 * kDsI, kDsH / 16}}});
  ExpectLayerEqual(MoeOp::kPrepareW2, {{"format", "nvfp4"}, {"align_h", "256"}, {"align_i", "64"}},
                   {{"values", kU8, {kDsE, kDsH, kDsI / 2}}, {"scales", kU8, {kDsE, kDsH, kDsI / 16}}});
}

TEST_F(MoeGpu, DeepSeekV3LayerFp8BlockEqualsCpu) {
  ExpectLayerEqual(MoeOp::kPrepareW13, {{"format", "fp8_block"}, {"gated", "true"}},
                   {{"values", kU8, {kDsE, 2 * kDsI, kDsH}},
                    {"scales", kF32, {kDsE, 2 * kDsI / 128, kDsH / 128}}});
  ExpectLayerEqual(MoeOp::kPrepareW2, {{"format", "fp8_block"}},
                   {{"values", kU8, {kDsE, kDsH, kDsI}}, {"scales", kF32, {kDsE, kDsH / 128, kDsI / 128}}});
}

// A golden case whose plan has several non-empty outputs (values, scales, bias): its
// smaller outputs run on the engine's side stream.
struct MultiOutput {
  MoePlan plan;
  std::vector<std::vector<uint8_t>> in, want;
};
std::optional<MultiOutput> MultiOutputCase() {
  for (const testing::MoeGoldenCase& c : testing::LoadMoeGolden("golden_trtllm")) {
    if (c.error) continue;
    auto plan = testing::PlanMoeGolden(c);
    if (!plan.ok()) continue;
    int outputs = 0;
    for (uint64_t n : plan->output_bytes) outputs += n > 0;
    if (outputs < 3) continue;
    MultiOutput m{*plan, testing::InPlanOrder(*plan, c, testing::MoeGoldenInputs(c)), {}};
    m.want = testing::RunMoeCpuFresh(m.plan, m.in);
    return m;
  }
  return std::nullopt;
}

// The case's buffers on the GPU, outputs poisoned with 0xA5.
struct GpuBuffers {
  explicit GpuBuffers(const MultiOutput& m) {
    for (const auto& b : m.in) {
      ins.push_back(std::make_unique<DeviceBuffer>(b.size()));
      EXPECT_EQ(cudaMemcpy(ins.back()->get(), b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
      in_ptrs.push_back(ins.back()->get());
    }
    for (uint64_t n : m.plan.output_bytes) {
      outs.push_back(std::make_unique<DeviceBuffer>(n));
      out_ptrs.push_back(outs.back()->get());
    }
    Poison();
  }
  void Poison() {
    for (const auto& o : outs) {
      if (o->size > 0) {
        EXPECT_EQ(cudaMemset(o->get(), 0xA5, o->size), cudaSuccess);
      }
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // The outputs as they are now, read on a stream of their own.
  std::vector<std::vector<uint8_t>> Read() const {
    cudaStream_t t = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking), cudaSuccess);
    std::vector<std::vector<uint8_t>> got;
    for (const auto& o : outs) {
      got.emplace_back(o->size);
      if (o->size > 0) {
        EXPECT_EQ(cudaMemcpyAsync(got.back().data(), o->get(), o->size, cudaMemcpyDeviceToHost, t), cudaSuccess);
      }
    }
    EXPECT_EQ(cudaStreamSynchronize(t), cudaSuccess);
    cudaStreamDestroy(t);
    return got;
  }
  std::vector<std::unique_ptr<DeviceBuffer>> ins, outs;
  std::vector<const void*> in_ptrs;
  std::vector<void*> out_ptrs;
};

// The caller's stream waits on a host word before the call and writes another after it:
// until the first is set nothing of the call may run (its side stream included), and once
// the second is written every output must be complete.
TEST_F(MoeGpu, SideStreamWorkIsOrderedWithTheCallersStream) {
  using ValueOp = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  const auto wait_value = DriverEntry<ValueOp>("cuStreamWaitValue32");
  const auto write_value = DriverEntry<ValueOp>("cuStreamWriteValue32");
  ASSERT_NE(wait_value, nullptr);
  ASSERT_NE(write_value, nullptr);
  const std::optional<MultiOutput> m = MultiOutputCase();
  ASSERT_TRUE(m.has_value()) << "no golden case with three outputs";
  GpuBuffers b(*m);
  uint32_t* words = nullptr;
  ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&words), 2 * sizeof(uint32_t), cudaHostAllocMapped));
  volatile uint32_t* w = words;
  w[0] = 0;
  w[1] = 0;
  void* dwords = nullptr;
  ASSERT_CUDA(cudaHostGetDevicePointer(&dwords, words, 0));
  const auto dw = reinterpret_cast<CUdeviceptr>(dwords);
  cudaStream_t s = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ASSERT_EQ(wait_value(reinterpret_cast<CUstream>(s), dw, 1, CU_STREAM_WAIT_VALUE_EQ), CUDA_SUCCESS);
  const absl::Status run = RunMoeCuda(m->plan, b.in_ptrs, b.out_ptrs, s);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(write_value(reinterpret_cast<CUstream>(s), dw + sizeof(uint32_t), 1, 0), CUDA_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto before = b.Read();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(std::count(before[i].begin(), before[i].end(), uint8_t{0xA5}),
              static_cast<std::ptrdiff_t>(before[i].size()))
        << m->plan.outputs[i].name << " was written before the caller's stream reached the call";
  }
  w[0] = 1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (w[1] == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_EQ(w[1], 1u) << "the caller's stream never passed the call";
  const auto after = b.Read();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(after[i] == m->want[i])
        << m->plan.outputs[i].name << " incomplete once the caller's stream passed the call";
  }
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaStreamDestroy(s);
  cudaFreeHost(words);
}

// Captured into a CUDA graph (global capture mode, as frameworks capture), the call
// records a graph that writes every output when launched.
TEST_F(MoeGpu, CapturesIntoACudaGraph) {
  const std::optional<MultiOutput> m = MultiOutputCase();
  ASSERT_TRUE(m.has_value()) << "no golden case with three outputs";
  GpuBuffers b(*m);
  cudaStream_t s = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const absl::Status run = RunMoeCuda(m->plan, b.in_ptrs, b.out_ptrs, s);
  ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  ASSERT_TRUE(run.ok()) << run;
  for (const auto& o : b.Read()) {
    EXPECT_EQ(std::count(o.begin(), o.end(), uint8_t{0xA5}), static_cast<std::ptrdiff_t>(o.size()))
        << "capturing ran the work";
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int launch = 0; launch < 2; ++launch) {
    b.Poison();
    ASSERT_CUDA(cudaGraphLaunch(exec, s));
    ASSERT_CUDA(cudaStreamSynchronize(s));
    const auto got = b.Read();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(got[i] == m->want[i]) << m->plan.outputs[i].name << ", launch " << launch;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_F(MoeGpu, RejectsWrongBufferCountsHostPointersAndOverlap) {
  MoeParams p;
  auto plan = PlanMoe(MoeOp::kRowShuffle, p, {{"x", kU8, {32, 4}}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(RunMoeCuda(*plan, {}, {}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> host(256);
  EXPECT_EQ(RunMoeCuda(*plan, {host.data()}, {host.data() + 128}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  DeviceBuffer d(256);
  EXPECT_EQ(RunMoeCuda(*plan, {d.get()}, {d.get() + 64}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // overlapping: the gather would read moved bytes
  EXPECT_TRUE(RunMoeCuda(*plan, {d.get()}, {d.get() + 128}, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

#endif  // WPREP_HAVE_CUDA

}  // namespace
}  // namespace wprep
