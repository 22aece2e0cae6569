// wprep_quantize_bench: quantize_mxfp4 on the GPU next to a device copy that moves as many
// bytes as the quantization reads plus writes (a program, not a test). CUDA events around
// each call, warm-up first, median reported; quantize and copy interleaved so both see the
// same conditions. Also checks the GPU output against the CPU engine once per shape, so a
// fast but wrong kernel cannot post a number.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "wprep/kernels/moe.h"
#include "wprep/kernels/quantize.h"
#include "wprep/config.h"
#include "wprep/flags/flags.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>

namespace {

#define CHECK_CUDA(call)                                                       \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));         \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<uint8_t> RandomBf16(uint64_t bytes) {
  // bf16 normals spread over a few binades (random sign), like trained weights.
  std::vector<uint8_t> v(bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i + 1 < bytes; i += 2) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint16_t h = static_cast<uint16_t>(((x >> 20) & 0x8000u) | ((118u + (x >> 40) % 12) << 7) |
                                             (x & 0x7Fu));
    v[i] = static_cast<uint8_t>(h);
    v[i + 1] = static_cast<uint8_t>(h >> 8);
  }
  return v;
}

// What a row of output calls a layout.
std::string LayoutName(const wprep::QuantLayoutSpec& spec) {
  switch (spec.layout) {
    case wprep::QuantLayout::kCanonical:
      return "quantize (canonical)";
    case wprep::QuantLayout::kBlackwell:
      return "fused blackwell_value+blackwell_scale";
    case wprep::QuantLayout::kBlackwellShuffled:
      return "fused blackwell_shuffled_value(block_k=" + std::to_string(spec.block_k) +
             ",block_n=" + std::to_string(spec.block_n) + ")+blackwell_scale";
    case wprep::QuantLayout::kHopper:
      return "fused hopper_value(mma_version=" + std::to_string(spec.mma_version) +
             ")+hopper_scale(num_warps=" + std::to_string(spec.num_warps) +
             ",align_k=" + std::to_string(spec.align_k) + ")";
    case wprep::QuantLayout::kTrtllmW13:
    case wprep::QuantLayout::kTrtllmW2:
      return std::string("fused trtllm-gen mxfp4 ") +
             (spec.layout == wprep::QuantLayout::kTrtllmW13 ? "prepare_w13" : "prepare_w2") +
             " align=" + std::to_string(spec.align);
  }
  return "?";
}

// The unfused GPU chain of a trtllm layout: QuantizeOnCuda into canonical temporaries, then
// RunMoeCuda's prepare_w13 / prepare_w2. Writes its values and scales to `v` and `s` (host)
// and returns its median time over `iters` calls (temporaries allocated outside the timing).
double TrtllmChain(const wprep::QuantizePlan& plan, const wprep::QuantLayoutSpec& layout, const void* in,
                   size_t /*in_bytes*/, std::vector<uint8_t>* v, std::vector<uint8_t>* s, cudaStream_t stream,
                   int iters) {
  const int64_t e = plan.input_shape[0], r = plan.input_shape[1], k = plan.q;
  wprep::MoeParams params;
  if (!wprep::SetMoeParam(params, "align", std::to_string(layout.align)).ok()) std::exit(1);
  auto mp = wprep::PlanMoe(layout.layout == wprep::QuantLayout::kTrtllmW13 ? wprep::MoeOp::kPrepareW13
                                                                             : wprep::MoeOp::kPrepareW2,
                           params,
                           {{"values", wprep::MoeDType::kUint8, {e, r, k / 2}},
                            {"scales", wprep::MoeDType::kUint8, {e, r, k / 32}}});
  if (!mp.ok()) {
    std::fprintf(stderr, "%s\n", mp.status().ToString().c_str());
    std::exit(1);
  }
  void *cv, *cs, *ov, *os;
  CHECK_CUDA(cudaMalloc(&cv, plan.values_bytes));
  CHECK_CUDA(cudaMalloc(&cs, plan.scales_bytes));
  CHECK_CUDA(cudaMalloc(&ov, mp->output_bytes[0]));
  CHECK_CUDA(cudaMalloc(&os, mp->output_bytes[1]));
  auto once = [&] {
    if (!wprep::QuantizeOnCuda(plan, in, cv, cs, stream).ok()) std::exit(1);
    if (!wprep::RunMoeCuda(*mp, {cv, cs}, {ov, os}, stream).ok()) std::exit(1);
  };
  once();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  v->resize(mp->output_bytes[0]);
  s->resize(mp->output_bytes[1]);
  CHECK_CUDA(cudaMemcpy(v->data(), ov, v->size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(s->data(), os, s->size(), cudaMemcpyDeviceToHost));
  std::vector<double> t;
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    once();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  for (void* p : {cv, cs, ov, os}) (void)cudaFree(p);
  return Median(t);
}

// --only: a row runs when its layout's name contains this (empty: every row).
std::string g_only;

void Bench(const std::vector<int64_t>& shape, wprep::ScaleRounding rounding, const wprep::QuantLayoutSpec& layout,
           int iters, int warmup, wprep::QuantDtype dtype = wprep::QuantDtype::kBfloat16) {
  if (LayoutName(layout).find(g_only) == std::string::npos) return;
  auto plan = wprep::MakeQuantizePlan(dtype, shape, rounding);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    std::exit(1);
  }
  auto sizes = wprep::PlanQuantizeLayout(*plan, layout);
  if (!sizes.ok()) {
    std::fprintf(stderr, "%s\n", sizes.status().ToString().c_str());
    std::exit(1);
  }
  const uint64_t in_b = plan->input_bytes, v_b = sizes->values_bytes, s_b = sizes->scales_bytes;
  auto run = [&](const void* i, void* vv, void* ss, cudaStream_t st) {
    return wprep::QuantizeLayoutOnCuda(*plan, layout, i, vv, ss, st);
  };
  const uint64_t moved = in_b + v_b + s_b;  // bytes the quantization reads plus writes
  const uint64_t copy_b = moved / 2;        // a copy of copy_b bytes moves 2 * copy_b
  void *in, *v, *s, *csrc, *cdst;
  CHECK_CUDA(cudaMalloc(&in, in_b));
  CHECK_CUDA(cudaMalloc(&v, v_b));
  CHECK_CUDA(cudaMalloc(&s, s_b));
  CHECK_CUDA(cudaMalloc(&csrc, copy_b));
  CHECK_CUDA(cudaMalloc(&cdst, copy_b));
  // fp16 reads these 16-bit words as finite normals too, fp32 its word pairs.
  const std::vector<uint8_t> host = RandomBf16(in_b);
  CHECK_CUDA(cudaMemcpy(in, host.data(), in_b, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(csrc, 1, copy_b));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Correctness first: GPU bytes == CPU engine bytes, or for the trtllm layouts (whose
  // shapes are too large for the CPU engine in a bench) == the unfused GPU chain: canonical
  // quantization into a temporary, then the MoE engine's prepare.
  if (!run(in, v, s, stream).ok()) std::exit(1);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> gv(v_b), gs(s_b), cv(v_b), cs(s_b);
  CHECK_CUDA(cudaMemcpy(gv.data(), v, v_b, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gs.data(), s, s_b, cudaMemcpyDeviceToHost));
  const bool trtllm = layout.layout == wprep::QuantLayout::kTrtllmW13 || layout.layout == wprep::QuantLayout::kTrtllmW2;
  double chain_ms = 0;
  if (trtllm) {
    chain_ms = TrtllmChain(*plan, layout, in, host.size(), &cv, &cs, stream, iters);
  } else if (!wprep::QuantizeLayoutOnCpu(*plan, layout, host.data(), in_b, cv.data(), v_b, cs.data(), s_b).ok()) {
    std::exit(1);
  }
  const bool equal = gv == cv && gs == cs;

  for (int i = 0; i < warmup; ++i) {
    (void)run(in, v, s, stream);
    CHECK_CUDA(cudaMemcpyAsync(cdst, csrc, copy_b, cudaMemcpyDeviceToDevice, stream));
  }
  std::vector<cudaEvent_t> ev(4 * iters);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[4 * i], stream));
    (void)run(in, v, s, stream);
    CHECK_CUDA(cudaEventRecord(ev[4 * i + 1], stream));
    CHECK_CUDA(cudaEventRecord(ev[4 * i + 2], stream));
    CHECK_CUDA(cudaMemcpyAsync(cdst, csrc, copy_b, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(ev[4 * i + 3], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> q, c;
  for (int i = 0; i < iters; ++i) {
    float a, b;
    CHECK_CUDA(cudaEventElapsedTime(&a, ev[4 * i], ev[4 * i + 1]));
    CHECK_CUDA(cudaEventElapsedTime(&b, ev[4 * i + 2], ev[4 * i + 3]));
    q.push_back(a);
    c.push_back(b);
  }
  std::string name;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) name.push_back('x');
    name.append(std::to_string(shape[i]));
  }
  const double qm = Median(q), cm = Median(c);
  if (trtllm) std::printf("  the unfused chain (quantize, then prepare): %.3f ms\n", chain_ms);
  const char* dtype_name = dtype == wprep::QuantDtype::kBfloat16 ? "bf16"
                           : dtype == wprep::QuantDtype::kFloat16 ? "fp16"
                                                                  : "fp32";
  std::printf("%s %s %s rounding=%s: quantize %.3f ms (%.1f GB/s of %llu B read+written), "
              "copy of %llu B %.3f ms (%.1f GB/s moved); quantize/copy %.2f; gpu==%s %s\n",
              LayoutName(layout).c_str(), dtype_name,
              name.c_str(), rounding == wprep::ScaleRounding::kUp ? "up" : "down", qm,
              moved / qm / 1e6, static_cast<unsigned long long>(moved),
              static_cast<unsigned long long>(copy_b), cm, 2.0 * copy_b / cm / 1e6, qm / cm,
              trtllm ? "chain" : "cpu", equal ? "yes" : "NO");
  for (auto& e : ev) (void)cudaEventDestroy(e);
  (void)cudaFree(in);
  (void)cudaFree(v);
  (void)cudaFree(s);
  (void)cudaFree(csrc);
  (void)cudaFree(cdst);
  (void)cudaStreamDestroy(stream);
}

}  // namespace

int main(int argc, char** argv) {
  wprep::flags::FlagSet fs("wprep_quantize_bench",
                           "usage: wprep_quantize_bench [flags]\n"
                           "quantize_mxfp4 on the GPU next to a device copy of as many bytes.\n");
  fs.Int("iters", "N", 50, "timed calls per shape (median reported)", 1, 1 << 20);
  fs.String("only", "TEXT", "", "run only the rows whose layout name contains TEXT (e.g. hopper, prepare_w13)");
  if (absl::Status s = fs.Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_quantize_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  const int iters = static_cast<int>(fs.GetInt("iters"));
  g_only = fs.GetString("only");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp p{};
  CHECK_CUDA(cudaGetDeviceProperties(&p, 0));
  std::printf("device: %s; iters %d, warm-up 5, medians of CUDA-event times\n", p.name, iters);
  using wprep::QuantLayout;
  const wprep::QuantLayoutSpec canonical, blackwell{QuantLayout::kBlackwell};
  const wprep::QuantLayoutSpec hopper{QuantLayout::kHopper}, hopper_v2{QuantLayout::kHopper, 2, 8, 4};
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, canonical, iters, 5);
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kDown, canonical, iters, 5);
  Bench({16, 4096, 4000}, wprep::ScaleRounding::kUp, canonical, iters, 5);  // rows not 16-byte aligned
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, canonical, iters, 5, wprep::QuantDtype::kFloat16);
  Bench({8, 4096, 4096}, wprep::ScaleRounding::kUp, canonical, iters, 5, wprep::QuantDtype::kFloat32);
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, blackwell, iters, 5);
  wprep::QuantLayoutSpec shuffled{QuantLayout::kBlackwellShuffled};
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, shuffled, iters, 5);
  Bench({16, 5760, 2880}, wprep::ScaleRounding::kUp, shuffled, iters, 5);
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, hopper, iters, 5);
  Bench({16, 4096, 4096}, wprep::ScaleRounding::kUp, hopper_v2, iters, 5);
  // 16 of gpt-oss-120b's w13 experts in bf16 ([E, 2I, H]): K = 2880 is 90 groups, no tile multiple.
  Bench({16, 5760, 2880}, wprep::ScaleRounding::kUp, hopper, iters, 5);
  // One gpt-oss-120b MoE layer in bf16 (128 experts, H = I = 2880) to the trtllm-gen layout.
  wprep::QuantLayoutSpec w13{QuantLayout::kTrtllmW13}, w2{QuantLayout::kTrtllmW2};
  Bench({128, 5760, 2880}, wprep::ScaleRounding::kUp, w13, iters, 5);
  Bench({128, 2880, 2880}, wprep::ScaleRounding::kUp, w2, iters, 5);
  return 0;
}
#else
int main() {
  // Nothing to time; the flags (--iters) are those of a CUDA build.
  std::fprintf(stderr, "wprep_quantize_bench: built without CUDA\n");
  return 1;
}
#endif
