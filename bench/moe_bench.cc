// wprep_bench --moe: trtllm-gen MoE preparation (prepare_w13, prepare_w2: values + scales
// + bias, each one RunMoeCuda call) next to a cudaMemcpyAsync device-to-device copy of
// the same input bytes, for one gpt-oss-120b layer (MXFP4) and one DeepSeek-V3-shaped
// layer (256 experts, H 7168, I 2048) in every format: MXFP4, NVFP4, MXFP8, FP8,
// fp8_block and BF16.
// CUDA events around each call; warm-up, then the median of --moe_iters calls, copy and
// preparation interleaved so both see the same conditions.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/moe.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace wprep {

int RunMoeBench(int iters, int warmup);

#if WPREP_HAVE_CUDA
namespace {

struct MoeCase {
  std::string layer;
  MoeOp op;
  std::vector<std::pair<std::string, std::string>> params;
  std::vector<MoeTensorDesc> inputs;
};

std::vector<MoeCase> MoeCases() {
  using D = MoeDType;
  constexpr int64_t ge = 128, gh = 2880, gi = 2880;            // gpt-oss-120b
  constexpr int64_t de = 256, dh = 7168, di = 2048;            // DeepSeek-V3
  const std::vector<std::pair<std::string, std::string>> nv13 = {
      {"format", "nvfp4"}, {"gated", "true"}, {"align_h", "256"}, {"align_i", "64"}};
  const std::vector<std::pair<std::string, std::string>> nv2 = {
      {"format", "nvfp4"}, {"align_h", "256"}, {"align_i", "64"}};
  return {
      {"gpt-oss-120b mxfp4", MoeOp::kPrepareW13, {{"align", "256"}},
       {{"values", D::kUint8, {ge, 2 * gi, gh / 2}}, {"scales", D::kUint8, {ge, 2 * gi, gh / 32}},
        {"bias", D::kBfloat16, {ge, 2 * gi}}}},
      {"gpt-oss-120b mxfp4", MoeOp::kPrepareW2, {{"align", "256"}},
       {{"values", D::kUint8, {ge, gh, gi / 2}}, {"scales", D::kUint8, {ge, gh, gi / 32}},
        {"bias", D::kBfloat16, {ge, gh}}}},
      {"DeepSeek-V3 mxfp4", MoeOp::kPrepareW13, {{"align", "256"}},
       {{"values", D::kUint8, {de, 2 * di, dh / 2}}, {"scales", D::kUint8, {de, 2 * di, dh / 32}},
        {"bias", D::kFloat32, {de, 2 * di}}}},
      {"DeepSeek-V3 mxfp4", MoeOp::kPrepareW2, {{"align", "256"}},
       {{"values", D::kUint8, {de, dh, di / 2}}, {"scales", D::kUint8, {de, dh, di / 32}},
        {"bias", D::kFloat32, {de, dh}}}},
      {"DeepSeek-V3 nvfp4", MoeOp::kPrepareW13, nv13,
       {{"values", D::kUint8, {de, 2 * di, dh / 2}}, {"scales", D::kUint8, {de, 2 * di, dh / 16}}}},
      {"DeepSeek-V3 nvfp4", MoeOp::kPrepareW2, nv2,
       {{"values", D::kUint8, {de, dh, di / 2}}, {"scales", D::kUint8, {de, dh, di / 16}}}},
      {"DeepSeek-V3 fp8_block", MoeOp::kPrepareW13, {{"format", "fp8_block"}, {"gated", "true"}},
       {{"values", D::kUint8, {de, 2 * di, dh}}, {"scales", D::kFloat32, {de, 2 * di / 128, dh / 128}}}},
      {"DeepSeek-V3 fp8_block", MoeOp::kPrepareW2, {{"format", "fp8_block"}},
       {{"values", D::kUint8, {de, dh, di}}, {"scales", D::kFloat32, {de, dh / 128, di / 128}}}},
      {"DeepSeek-V3 mxfp8", MoeOp::kPrepareW13, {{"format", "mxfp8"}, {"gated", "true"}},
       {{"values", D::kUint8, {de, 2 * di, dh}}, {"scales", D::kUint8, {de, 2 * di, dh / 32}}}},
      {"DeepSeek-V3 mxfp8", MoeOp::kPrepareW2, {{"format", "mxfp8"}},
       {{"values", D::kUint8, {de, dh, di}}, {"scales", D::kUint8, {de, dh, di / 32}}}},
      {"DeepSeek-V3 fp8", MoeOp::kPrepareW13, {{"format", "fp8"}, {"gated", "true"}, {"align_i", "1"}},
       {{"values", D::kUint8, {de, 2 * di, dh}}}},
      {"DeepSeek-V3 fp8", MoeOp::kPrepareW2, {{"format", "fp8"}, {"align_i", "1"}},
       {{"values", D::kUint8, {de, dh, di}}}},
      {"DeepSeek-V3 bf16", MoeOp::kPrepareW13, {{"format", "bf16"}, {"gated", "true"}, {"align_i", "1"}},
       {{"values", D::kBfloat16, {de, 2 * di, dh}}}},
      {"DeepSeek-V3 bf16", MoeOp::kPrepareW2, {{"format", "bf16"}, {"align_i", "1"}},
       {{"values", D::kBfloat16, {de, dh, di}}}},
      // Where the time goes: the values pass and the scale pass alone, as single steps
      // of the same sizes (unpadded).
      {"gpt-oss-120b w13 values", MoeOp::kRowShuffle, {{"epilogue_tile_m", "128"}},
       {{"x", D::kUint8, {ge, 2 * gi, gh / 2}}}},
      {"gpt-oss-120b w13 scales", MoeOp::kShuffleSfA, {{"epilogue_tile_m", "128"}},
       {{"x", D::kUint8, {ge, 2 * gi, gh / 32}}}},
      {"DeepSeek-V3 w2 values", MoeOp::kRowShuffle, {{"epilogue_tile_m", "128"}},
       {{"x", D::kUint8, {de, dh, di / 2}}}},
      {"DeepSeek-V3 w2 mxfp4 scales", MoeOp::kShuffleSfA, {{"epilogue_tile_m", "128"}},
       {{"x", D::kUint8, {de, dh, di / 32}}}},
      {"DeepSeek-V3 w13 nvfp4 scales", MoeOp::kShuffleSfA, {{"epilogue_tile_m", "128"}},
       {{"x", D::kUint8, {de, 2 * di, dh / 16}}}},
  };
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

#define MOE_CHECK_CUDA(call)                                                    \
  do {                                                                          \
    cudaError_t moe_err_ = (call);                                              \
    if (moe_err_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(moe_err_));    \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

int RunMoeBench(int iters, int warmup) {
  if (CudaDeviceCount() == 0) {
    std::printf("GPU: none found, MoE timings skipped\n");
    return 0;
  }
  cudaDeviceProp prop{};
  MOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  cudaStream_t stream;
  MOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("\n| layer | op | in GB | out GB | prepare ms | copy ms | ratio | GB/s in+out |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const MoeCase& c : MoeCases()) {
    MoeParams params;
    for (const auto& [k, v] : c.params) {
      if (absl::Status s = SetMoeParam(params, k, v); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
    auto plan = PlanMoe(c.op, params, c.inputs);
    if (!plan.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.layer.c_str(), plan.status().ToString().c_str());
      return 1;
    }
    uint64_t in_bytes = 0, out_bytes = 0;
    std::vector<const void*> ins;
    std::vector<void*> outs;
    std::vector<void*> owned;
    for (uint64_t n : plan->input_bytes) {
      void* p = nullptr;
      MOE_CHECK_CUDA(cudaMalloc(&p, n));
      // Any bytes do: the preparation moves them without looking (fp8_block's clamp
      // aside, which is branch-free per word).
      MOE_CHECK_CUDA(cudaMemset(p, 0x5A, n));
      ins.push_back(p);
      owned.push_back(p);
      in_bytes += n;
    }
    for (uint64_t n : plan->output_bytes) {
      void* p = nullptr;
      MOE_CHECK_CUDA(cudaMalloc(&p, n));
      outs.push_back(p);
      owned.push_back(p);
      out_bytes += n;
    }
    // The copy baseline: the same input bytes, read and written once, in one call.
    void *copy_src = nullptr, *copy_dst = nullptr;
    MOE_CHECK_CUDA(cudaMalloc(&copy_src, in_bytes));
    MOE_CHECK_CUDA(cudaMalloc(&copy_dst, in_bytes));
    MOE_CHECK_CUDA(cudaMemset(copy_src, 0x5A, in_bytes));
    for (int i = 0; i < warmup; ++i) {
      if (absl::Status s = RunMoeCuda(*plan, ins, outs, stream); !s.ok()) {
        std::fprintf(stderr, "%s: %s\n", plan->identity.c_str(), s.ToString().c_str());
        return 1;
      }
      MOE_CHECK_CUDA(cudaMemcpyAsync(copy_dst, copy_src, in_bytes, cudaMemcpyDeviceToDevice, stream));
    }
    std::vector<cudaEvent_t> ev(4 * iters);
    for (auto& e : ev) MOE_CHECK_CUDA(cudaEventCreate(&e));
    for (int i = 0; i < iters; ++i) {
      MOE_CHECK_CUDA(cudaEventRecord(ev[4 * i], stream));
      (void)RunMoeCuda(*plan, ins, outs, stream);
      MOE_CHECK_CUDA(cudaEventRecord(ev[4 * i + 1], stream));
      MOE_CHECK_CUDA(cudaEventRecord(ev[4 * i + 2], stream));
      MOE_CHECK_CUDA(cudaMemcpyAsync(copy_dst, copy_src, in_bytes, cudaMemcpyDeviceToDevice, stream));
      MOE_CHECK_CUDA(cudaEventRecord(ev[4 * i + 3], stream));
    }
    MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> prep, copy;
    for (int i = 0; i < iters; ++i) {
      float a = 0, b = 0;
      MOE_CHECK_CUDA(cudaEventElapsedTime(&a, ev[4 * i], ev[4 * i + 1]));
      MOE_CHECK_CUDA(cudaEventElapsedTime(&b, ev[4 * i + 2], ev[4 * i + 3]));
      prep.push_back(a);
      copy.push_back(b);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    const double ms = Median(prep), copy_ms = Median(copy);
    std::printf("| %s | %s | %.3f | %.3f | %.4f | %.4f | %.2f | %.0f |\n", c.layer.c_str(),
                plan->identity.c_str(), in_bytes / 1e9, out_bytes / 1e9, ms, copy_ms,
                ms / copy_ms, (in_bytes + out_bytes) / (ms * 1e6));
    std::fflush(stdout);
    for (void* p : owned) cudaFree(p);
    cudaFree(copy_src);
    cudaFree(copy_dst);
  }
  cudaStreamDestroy(stream);
  return 0;
}
#else
int RunMoeBench(int /*iters*/, int /*warmup*/) {
  std::printf("GPU: built without CUDA, MoE timings skipped\n");
  return 0;
}
#endif

}  // namespace wprep
