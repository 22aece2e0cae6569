// Times every conversion of ANCHORS.md (plus a Blackwell retile), the same tensors from
// checkpoint order (packing axis -2), blackwell_value both ways and packings, and the
// scale layouts at each --scale_shape (dense, and the transposed view loaders pass), on the
// GPU next to a device-to-device copy of the same bytes, and on the CPU next to a memcpy on
// as many threads, in one run.
// GPU: CUDA events around each call (warm-up, then the median of --iters calls), copy and
// conversion interleaved so both see the same conditions. CPU: median of --cpu_reps.
// Prints a markdown table; --csv FILE also writes every figure.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cpu_parallel.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/config.h"
#include "wprep/flags/flags.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace wprep {
namespace {

// The bench's flags (absl-style names: scripts and docs pass them so).
flags::FlagSet& Flags() {
  static flags::FlagSet* fs = [] {
    auto* f = new flags::FlagSet("wprep_bench",
                                 "usage: wprep_bench [flags]\n"
                                 "Times every conversion on the GPU next to a device copy of the same bytes,\n"
                                 "and on the CPU next to a memcpy; prints a markdown table.\n");
    f->List("shapes", "S,...", {"16x4096x4096", "1x256x256"}, "logical shapes to time, dims joined by x");
    f->Int("iters", "N", 200, "timed GPU calls per conversion (median reported)", 1, 1 << 20);
    f->Int("warmup", "N", 20, "untimed GPU calls first", 0, 1 << 20);
    f->Bool("gpu", true, "time the CUDA engine");
    f->Bool("cpu", true, "time the CPU engine");
    f->String("cpu_shape", "S", "16x4096x4096", "logical shape for the CPU engine");
    f->List("cpu_threads", "N,...", {"1", "0"}, "CPU thread counts (0 = all hardware threads)");
    f->Int("cpu_reps", "N", 3, "timed CPU runs per conversion (median reported)", 1, 1 << 20);
    f->String("csv", "FILE", "", "also write results to this CSV file");
    f->String("only", "TEXT", "", "time only conversions whose name contains this text");
    f->List("scale_shape", "S,...", {"16x4096x128", "128x90x5760", "256x224x4096", "256x64x7168"},
            "logical [E, K/32, N] shapes of the scale tensors the scale rows time: 8 MiB, gpt-oss-120b's, "
            "DeepSeek-V3's w13 and w2 (each also as the transposed view of a checkpoint [E, N, K/32])");
    f->Bool("moe", false, "time the trtllm-gen MoE preparation instead of the conversions");
    f->Int("moe_iters", "N", 20, "timed calls per MoE preparation (median reported)", 1, 1 << 20);
    f->Int("moe_warmup", "N", 3, "untimed MoE calls first", 0, 1 << 20);
    return f;
  }();
  return *fs;
}


struct Case {
  std::string name;
  ConversionSpec spec;
  // Empty: the --shapes sweep. Else this case's own shape (the scale rows run at each
  // --scale_shape, whatever --shapes says).
  std::vector<int64_t> shape = {};
  // The input view's strides (empty: dense), e.g. the transposed scale view loaders pass.
  std::vector<int64_t> strides = {};
  std::string shape_name = {};  // how the table names `shape`
};

std::vector<int64_t> ParseShape(const std::string& s);

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto hopper = [](int mx, Direction d, int packing = -1) {
    ConversionSpec s;
    s.layout = Layout::kHopperValue;
    s.direction = d;
    s.hopper = {mx, 3};
    s.packing_axis = packing;
    return s;
  };
  auto blackwell = [](Direction d, int packing = -1) {
    ConversionSpec s;
    s.layout = Layout::kBlackwellShuffledValue;
    s.direction = d;
    s.blackwell = {128, 256};
    s.blackwell_to = {256, 128};
    s.packing_axis = packing;
    return s;
  };
  auto blackwell_value = [](Direction d, int packing) {
    ConversionSpec s;
    s.layout = Layout::kBlackwellValue;
    s.direction = d;
    s.packing_axis = packing;
    return s;
  };
  auto scale = [](Layout l, int mx, int nw, Direction d) {
    ConversionSpec s;
    s.layout = l;
    s.direction = d;
    s.hopper_scale = {mx, nw, 2};
    return s;
  };
  cases.push_back({"hopper mx-2 mma3 swizzle", hopper(-2, Direction::kSwizzle)});
  cases.push_back({"hopper mx-2 mma3 unswizzle", hopper(-2, Direction::kUnswizzle)});
  cases.push_back({"hopper mx-1 mma3 swizzle", hopper(-1, Direction::kSwizzle)});
  cases.push_back({"hopper mx-1 mma3 unswizzle", hopper(-1, Direction::kUnswizzle)});
  cases.push_back({"blackwell 128x256 swizzle", blackwell(Direction::kSwizzle)});
  cases.push_back({"blackwell 128x256 unswizzle", blackwell(Direction::kUnswizzle)});
  cases.push_back({"blackwell retile 128x256->256x128", blackwell(Direction::kRetile)});
  // Checkpoint order (packing axis -2) of the same logical tensors.
  cases.push_back({"hopper mx-2 mma3 swizzle packing-2", hopper(-2, Direction::kSwizzle, -2)});
  cases.push_back({"hopper mx-2 mma3 unswizzle packing-2", hopper(-2, Direction::kUnswizzle, -2)});
  cases.push_back({"hopper mx-1 mma3 swizzle packing-2", hopper(-1, Direction::kSwizzle, -2)});
  cases.push_back({"hopper mx-1 mma3 unswizzle packing-2", hopper(-1, Direction::kUnswizzle, -2)});
  cases.push_back({"blackwell 128x256 swizzle packing-2", blackwell(Direction::kSwizzle, -2)});
  cases.push_back({"blackwell 128x256 unswizzle packing-2", blackwell(Direction::kUnswizzle, -2)});
  for (int packing : {-1, -2}) {
    const std::string p = packing == -1 ? "" : " packing-2";
    cases.push_back({"blackwell_value swizzle" + p, blackwell_value(Direction::kSwizzle, packing)});
    cases.push_back({"blackwell_value unswizzle" + p, blackwell_value(Direction::kUnswizzle, packing)});
  }
  // Scales: [E, K/32, N]-shaped scale tensors, dense and as the transposed view of a
  // checkpoint's [E, N, K/32] (what loaders pass).
  for (const std::string& name : Flags().GetList("scale_shape")) {
    const std::vector<int64_t> ss = ParseShape(name);
    const int64_t rows = ss[ss.size() - 2], cols = ss.back();
    const std::vector<int64_t> transposed = {rows * cols, 1, rows};  // over a dense [E, cols, rows]
    for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
      const std::string dn = d == Direction::kSwizzle ? " swizzle" : " unswizzle";
      for (int mx : {-1, -2}) {
        for (int nw : {4, 8}) {
          cases.push_back({absl::StrFormat("hopper_scale mx%d w%d%s", mx, nw, dn),
                           scale(Layout::kHopperScale, mx, nw, d), ss, {}, name});
        }
      }
      cases.push_back({"blackwell_scale" + dn, scale(Layout::kBlackwellScale, -2, 8, d), ss, {}, name});
    }
    if (ss.size() == 3) {
      for (int mx : {-1, -2}) {
        for (int nw : {4, 8}) {
          cases.push_back({absl::StrFormat("hopper_scale mx%d w%d swizzle transposed view", mx, nw),
                           scale(Layout::kHopperScale, mx, nw, Direction::kSwizzle), ss, transposed, name});
        }
      }
      cases.push_back({"blackwell_scale swizzle transposed view",
                       scale(Layout::kBlackwellScale, -2, 8, Direction::kSwizzle), ss, transposed, name});
    }
  }
  const std::string only = Flags().GetString("only");
  std::erase_if(cases, [&](const Case& c) { return c.name.find(only) == std::string::npos; });
  return cases;
}

std::vector<int64_t> ParseShape(const std::string& s) {
  std::vector<int64_t> shape;
  for (absl::string_view d : absl::StrSplit(s, 'x')) shape.push_back(std::stoll(std::string(d)));
  return shape;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Row {
  std::string engine, shape, conversion;
  double ms, baseline_ms;
  uint64_t bytes;
  std::string note;
};

std::vector<uint8_t> RandomBytes(uint64_t n) {
  std::vector<uint8_t> v(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  return v;
}

#if WPREP_HAVE_CUDA
#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    cudaError_t bench_err_ = (call);                                                        \
    if (bench_err_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(bench_err_));              \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

void TimeGpu(const std::vector<int64_t>& shape, const std::string& shape_name,
             std::vector<Row>* rows) {
  const int iters = static_cast<int>(Flags().GetInt("iters")), warmup = static_cast<int>(Flags().GetInt("warmup"));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Case& c : Cases()) {
    // Scale rows have their own shape: run them once, with the first --shapes entry.
    if (!c.shape.empty() && shape_name != Flags().GetList("shapes").front()) continue;
    const std::vector<int64_t>& case_shape = c.shape.empty() ? shape : c.shape;
    auto plan = MakePlan(c.spec, case_shape, InputBinding{c.strides, {}});
    if (!plan.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), plan.status().ToString().c_str());
      std::exit(1);
    }
    const uint64_t in_bytes = plan->input_bytes, out_bytes = plan->output_bytes;
    void *in, *out, *copy_dst;
    CHECK_CUDA(cudaMalloc(&in, in_bytes));
    CHECK_CUDA(cudaMalloc(&out, out_bytes));
    CHECK_CUDA(cudaMalloc(&copy_dst, in_bytes));
    const auto host = RandomBytes(in_bytes);
    CHECK_CUDA(cudaMemcpy(in, host.data(), in_bytes, cudaMemcpyHostToDevice));
    std::vector<cudaEvent_t> ev(4 * iters);
    for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
    for (int i = 0; i < warmup; ++i) {
      auto s = ConvertOnCuda(*plan, in, out, stream);
      if (!s.ok()) {
        std::fprintf(stderr, "%s: %s\n", c.name.c_str(), s.ToString().c_str());
        std::exit(1);
      }
      CHECK_CUDA(cudaMemcpyAsync(copy_dst, in, in_bytes, cudaMemcpyDeviceToDevice, stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> host_conv, host_copy;  // CPU time of the calls themselves
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(cudaEventRecord(ev[4 * i], stream));
      auto h0 = std::chrono::steady_clock::now();
      (void)ConvertOnCuda(*plan, in, out, stream);
      auto h1 = std::chrono::steady_clock::now();
      CHECK_CUDA(cudaEventRecord(ev[4 * i + 1], stream));
      CHECK_CUDA(cudaEventRecord(ev[4 * i + 2], stream));
      auto h2 = std::chrono::steady_clock::now();
      CHECK_CUDA(cudaMemcpyAsync(copy_dst, in, in_bytes, cudaMemcpyDeviceToDevice, stream));
      auto h3 = std::chrono::steady_clock::now();
      CHECK_CUDA(cudaEventRecord(ev[4 * i + 3], stream));
      host_conv.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
      host_copy.push_back(std::chrono::duration<double, std::micro>(h3 - h2).count());
      if (i % 16 == 15) CHECK_CUDA(cudaStreamSynchronize(stream));  // keep the queue short
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<double> conv, copy;
    for (int i = 0; i < iters; ++i) {
      float a, b;
      CHECK_CUDA(cudaEventElapsedTime(&a, ev[4 * i], ev[4 * i + 1]));
      CHECK_CUDA(cudaEventElapsedTime(&b, ev[4 * i + 2], ev[4 * i + 3]));
      conv.push_back(a);
      copy.push_back(b);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    // A layout that pads makes more bytes than it reads: once each, that is a floor of
    // (in + out) / (2 in) copies of the input.
    const std::string floor =
        in_bytes > 0 && out_bytes > in_bytes
            ? absl::StrFormat("; output %.2fx the input, floor %.2fx this copy",
                              static_cast<double>(out_bytes) / static_cast<double>(in_bytes),
                              static_cast<double>(in_bytes + out_bytes) / (2.0 * static_cast<double>(in_bytes)))
            : std::string();
    rows->push_back({"cuda", c.shape.empty() ? shape_name : c.shape_name,
                     c.name, Median(conv), Median(copy), in_bytes,
                     absl::StrFormat("baseline: cudaMemcpyAsync D2D of the input bytes; host "
                                     "call %.1f us vs copy call %.1f us%s",
                                     Median(host_conv), Median(host_copy), floor)});
    cudaFree(in);
    cudaFree(out);
    cudaFree(copy_dst);
  }
  cudaStreamDestroy(stream);
}
#endif

// memcpy of n bytes on `threads` threads, scheduled as the CPU engine schedules its passes
// (cpu::Parallel: contiguous 64 KiB chunks taken in turn): its baseline at the same
// parallelism.
void ParallelMemcpy(uint8_t* dst, const uint8_t* src, size_t n, int threads) {
  constexpr size_t kChunk = size_t{64} << 10;
  const auto units = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  wprep::cpu::Parallel(units, n, threads, [&](int64_t begin, int64_t end) {
    const size_t from = static_cast<size_t>(begin) * kChunk, to = std::min(n, static_cast<size_t>(end) * kChunk);
    std::memcpy(dst + from, src + from, to - from);
  });
}

void TimeCpu(const std::vector<int64_t>& shape, const std::string& shape_name,
             std::vector<Row>* rows) {
  const int reps = static_cast<int>(Flags().GetInt("cpu_reps"));
  for (const std::string& t : Flags().GetList("cpu_threads")) {
    int threads = std::stoi(t);
    if (threads == 0) threads = static_cast<int>(std::thread::hardware_concurrency());
    for (const Case& c : Cases()) {
      auto plan = MakePlan(c.spec, c.shape.empty() ? shape : c.shape, InputBinding{c.strides, {}});
      if (!plan.ok()) std::exit(1);
      const auto in = RandomBytes(plan->input_bytes);
      std::vector<uint8_t> out(plan->output_bytes, 1), copy(plan->input_bytes, 1);
      std::vector<double> conv, memcpy_ms;
      for (int r = 0; r < reps + 1; ++r) {  // first run warms pages and caches
        auto t0 = std::chrono::steady_clock::now();
        auto s = ConvertOnCpu(*plan, in.data(), in.size(), out.data(), out.size(), {threads});
        auto t1 = std::chrono::steady_clock::now();
        ParallelMemcpy(copy.data(), in.data(), in.size(), threads);
        auto t2 = std::chrono::steady_clock::now();
        if (!s.ok()) std::exit(1);
        if (r == 0) continue;
        conv.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        memcpy_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      rows->push_back({absl::StrFormat("cpu x%d", threads),
                       c.shape.empty() ? shape_name : c.shape_name, c.name,
                       Median(conv),
                       Median(memcpy_ms), plan->input_bytes,
                       absl::StrFormat("baseline: memcpy of the input bytes on %d threads", threads)});
    }
  }
}

}  // namespace
}  // namespace wprep

namespace wprep {
int RunMoeBench(int iters, int warmup);  // bench/moe_bench.cc
}  // namespace wprep

int main(int argc, char** argv) {
  using namespace wprep;
  if (absl::Status s = Flags().Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (Flags().help()) {
    std::fputs(Flags().Usage().c_str(), stdout);
    return 0;
  }
  if (Flags().GetBool("moe")) {
    return RunMoeBench(static_cast<int>(Flags().GetInt("moe_iters")),
                       static_cast<int>(Flags().GetInt("moe_warmup")));
  }
  std::vector<Row> rows;
  if (Flags().GetBool("gpu")) {
#if WPREP_HAVE_CUDA
    if (CudaDeviceCount() > 0) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, 0);
      std::printf("GPU: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
      {  // Bring clocks up before the first measurement (~0.2 s of copies).
        void* buf = nullptr;
        CHECK_CUDA(cudaMalloc(&buf, size_t{256} << 20));
        for (int i = 0; i < 1500; ++i) CHECK_CUDA(cudaMemsetAsync(buf, i, size_t{256} << 20));
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaFree(buf));
      }
      for (const std::string& s : Flags().GetList("shapes")) TimeGpu(ParseShape(s), s, &rows);
    } else {
      std::printf("GPU: none found, GPU timings skipped\n");
    }
#else
    std::printf("GPU: built without CUDA, GPU timings skipped\n");
#endif
  }
  if (Flags().GetBool("cpu")) {
    std::printf("CPU: %u hardware threads\n", std::thread::hardware_concurrency());
    const std::string s = Flags().GetString("cpu_shape");
    TimeCpu(ParseShape(s), s, &rows);
  }
  std::printf("\n| engine | shape | conversion | time ms | baseline ms | ratio | GB/s in+out | note |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %s | %s | %.4f | %.4f | %.2f | %.1f | %s |\n", r.engine.c_str(),
                r.shape.c_str(), r.conversion.c_str(), r.ms, r.baseline_ms, r.ms / r.baseline_ms,
                2.0 * r.bytes / (r.ms * 1e6), r.note.c_str());
  }
  if (const std::string path = Flags().GetString("csv"); !path.empty()) {
    std::ofstream f(path);
    f << "engine,shape,conversion,ms,baseline_ms,ratio,bytes,note\n";
    for (const Row& r : rows) {
      f << r.engine << "," << r.shape << "," << r.conversion << "," << r.ms << ","
        << r.baseline_ms << "," << r.ms / r.baseline_ms << "," << r.bytes << "," << r.note
        << "\n";
    }
  }
  return 0;
}
