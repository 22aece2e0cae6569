// wprep_rpc_bench: end-to-end figures of wprepd (a program, not a test).
//
//   wprep_rpc_bench [flags] [-- wprepd flags]     (wprep_rpc_bench --help lists them)
//
// Without --target it starts wprepd itself (WPREPD env or the built binary) on a Unix
// socket and reports start-to-SERVING. Then, with a GPU: 1 MiB and 128 MiB Hopper
// mx_axis=-2 swizzle IPC->IPC end-to-end p50 next to the kernel's own p50 (cudaEvent
// timing of the same kernel in this process); a warm daemon's request after pauses of
// 0.2-30 ms; and the first request after SERVING: --fresh-runs fresh daemons per variant
// (how the client prepares it), each next to the same sequence on the long-running
// daemon, every call split into the way in, the handler (kernel) and the way out from the
// daemon's log. Always: 128 MiB bytes->bytes ConvertStream GB/s over the Unix socket, on
// one connection and striped over two (the client's default) and four.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon_harness.h"
#include "golden.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/config.h"
#include "wprep/flags/flags.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

namespace v1 = wprep::v1;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

wprep::ConversionSpec HopperMx2Swizzle() {
  wprep::ConversionSpec s;
  s.layout = wprep::Layout::kHopperValue;
  s.direction = wprep::Direction::kSwizzle;
  s.hopper.mx_axis = -2;
  s.hopper.mma_version = 3;
  return s;
}

#if WPREP_HAVE_CUDA
#define BENCH_CUDA(call)                                                          \
  do {                                                                            \
    cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));            \
      return false;                                                               \
    }                                                                             \
  } while (0)

// An input and an output buffer of one shape on GPU 0, with the IPC->IPC Hopper mx-2
// swizzle request that names them.
class IpcPair {
 public:
  IpcPair() = default;
  IpcPair(const IpcPair&) = delete;
  IpcPair& operator=(const IpcPair&) = delete;
  ~IpcPair() {
    cudaFree(in_);
    cudaFree(out_);
  }
  bool Init(const std::vector<int64_t>& shape, uint64_t seed) {
    absl::StatusOr<wprep::Plan> plan = wprep::MakePlan(HopperMx2Swizzle(), shape);
    if (!plan.ok()) return false;
    plan_ = *std::move(plan);
    BENCH_CUDA(cudaSetDevice(0));
    BENCH_CUDA(cudaMalloc(&in_, plan_.input_bytes));
    BENCH_CUDA(cudaMalloc(&out_, plan_.output_bytes));
    std::vector<uint8_t> host = wprep::testing::RandomBytes(plan_.input_bytes, seed);
    BENCH_CUDA(cudaMemcpy(in_, host.data(), host.size(), cudaMemcpyHostToDevice));
    cudaIpcMemHandle_t hin, hout;
    BENCH_CUDA(cudaIpcGetMemHandle(&hin, in_));
    BENCH_CUDA(cudaIpcGetMemHandle(&hout, out_));
    cudaDeviceProp prop;
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    uuid_.assign(prop.uuid.bytes, 16);
    *req_.mutable_spec() = wprep::SpecToProto(HopperMx2Swizzle());
    for (int64_t d : shape) req_.add_logical_shape(d);
    auto* s = req_.mutable_source_ipc();
    s->set_handle(std::string(reinterpret_cast<const char*>(&hin), 64));
    s->set_size(plan_.input_bytes);
    s->set_device_uuid(uuid_);
    auto* d = req_.mutable_destination_ipc();
    d->set_handle(std::string(reinterpret_cast<const char*>(&hout), 64));
    d->set_size(plan_.output_bytes);
    d->set_device_uuid(uuid_);
    return true;
  }
  // Both handles as IpcHandleRefs (RegisterIpcHandles and ReleaseIpcHandles take them).
  template <typename Request>
  Request Refs() const {
    Request r;
    for (const std::string& h : {req_.source_ipc().handle(), req_.destination_ipc().handle()}) {
      v1::IpcHandleRef* x = r.add_handles();
      x->set_handle(h);
      x->set_device_uuid(uuid_);
    }
    return r;
  }
  const v1::ConvertRequest& request() const { return req_; }
  const wprep::Plan& plan() const { return plan_; }
  void* in() const { return in_; }
  void* out() const { return out_; }

 private:
  wprep::Plan plan_;
  void *in_ = nullptr, *out_ = nullptr;
  std::string uuid_;
  v1::ConvertRequest req_;
};

bool Register(wprep::client::Client& client, const IpcPair& pair, const char* label) {
  const auto t0 = Clock::now();
  absl::StatusOr<v1::RegisterIpcHandlesResponse> r =
      client.RegisterIpcHandles(pair.Refs<v1::RegisterIpcHandlesRequest>());
  if (!r.ok()) {
    std::fprintf(stderr, "RegisterIpcHandles: %s\n", r.status().ToString().c_str());
    return false;
  }
  if (label != nullptr) std::printf("%s_register_two_handles_ms %.4f\n", label, Ms(Clock::now() - t0));
  return true;
}

// Wall-clock send and receive times of a call (one host, one clock: against the daemon's
// log they split a round trip into the way in, the handler and the way out).
struct Stamps {
  absl::Time sent, received;
};

// `n` Converts of `pair`: each call's milliseconds appended to `ms`, and its stamps to
// `stamps` when given.
bool Converts(wprep::client::Client& client, const IpcPair& pair, int n, std::vector<double>* ms,
              std::vector<Stamps>* stamps = nullptr) {
  for (int i = 0; i < n; ++i) {
    const absl::Time sent = absl::Now();
    const auto t0 = Clock::now();
    absl::StatusOr<v1::ConvertResponse> r = client.Convert(pair.request());
    ms->push_back(Ms(Clock::now() - t0));
    if (stamps != nullptr) stamps->push_back({sent, absl::Now()});
    if (!r.ok()) {
      std::fprintf(stderr, "Convert: %s\n", r.status().ToString().c_str());
      return false;
    }
  }
  return true;
}

// The same kernel in this process, timed with events: its p50 in milliseconds.
bool KernelP50(const IpcPair& pair, int iters, double* p50) {
  cudaStream_t st;
  BENCH_CUDA(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<double> kernel;
  for (int i = 0; i < iters + 1; ++i) {
    BENCH_CUDA(cudaEventRecord(e0, st));
    if (!wprep::ConvertOnCuda(pair.plan(), pair.in(), pair.out(), st).ok()) return false;
    BENCH_CUDA(cudaEventRecord(e1, st));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) kernel.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
  *p50 = Median(kernel);
  return true;
}

// IPC->IPC p50 of `shape` next to the kernel's p50; `first_ms` receives the first call.
// With `register_first`, the handles are registered (RegisterIpcHandles) before it.
bool BenchIpc(wprep::client::Client& client, const std::vector<int64_t>& shape, int iters,
              const char* label, double* first_ms, bool register_first = false) {
  IpcPair pair;
  if (!pair.Init(shape, 42)) return false;
  if (register_first && !Register(client, pair, label)) return false;
  std::vector<double> rpc;
  if (!Converts(client, pair, iters + 1, &rpc)) return false;
  double kernel = 0;
  if (!KernelP50(pair, iters, &kernel)) return false;
  (void)client.ReleaseIpcHandles(pair.Refs<v1::ReleaseIpcHandlesRequest>());
  const double first = rpc.front();
  rpc = std::vector<double>(rpc.begin() + 1, rpc.end());
  std::printf("%s_ipc_to_ipc_rpc_p50_ms %.4f\n%s_kernel_p50_ms %.4f\n%s_rpc_minus_kernel_ms %.4f\n",
              label, Median(rpc), label, kernel, label, Median(rpc) - kernel);
  std::printf("%s_first_call_ms %.4f\n", label, first);
  if (first_ms != nullptr) *first_ms = first;
  return true;
}

// A warm daemon after a pause: `iters` back-to-back Converts give the warm p50, then for
// each pause, `repeats` times: the pause, then one Convert. Prints each pause's median
// call and its ratio to the warm p50. If a request after a pause costs what a fresh
// daemon's first request costs, what is left of the first request is the host waking
// from idle, not warm-up.
bool PausedCalls(wprep::client::Client& client, int iters, int repeats) {
  IpcPair pair;
  if (!pair.Init({2048, 1024}, 44) || !Register(client, pair, nullptr)) return false;
  std::vector<double> warm;
  if (!Converts(client, pair, iters + 1, &warm)) return false;
  const double p50 = Median(std::vector<double>(warm.begin() + 1, warm.end()));
  std::printf("1MiB_warm_daemon_p50_ms %.4f\n", p50);
  for (const int pause_us : {0, 200, 1000, 3000, 10000, 30000}) {
    std::vector<double> ms;
    for (int i = 0; i < repeats; ++i) {
      absl::SleepFor(absl::Microseconds(pause_us));
      if (!Converts(client, pair, 1, &ms)) return false;
    }
    std::printf("1MiB_warm_daemon_after_pause_%dus_median_ms %.4f ratio %.2f\n", pause_us, Median(ms),
                Median(ms) / p50);
  }
  (void)client.ReleaseIpcHandles(pair.Refs<v1::ReleaseIpcHandlesRequest>());
  return true;
}

// How a fresh daemon meets its first Convert (1 MiB IPC->IPC, called by this warm client).
struct FreshVariant {
  const char* name;
  bool registered;      // the measured handles are registered just before the first Convert
  int pings;            // ListDevices calls between the registration and the first Convert
  int sleep_us;         // a pause after those
  bool busy_gpu;        // ~2 ms of this process's own GPU work right before it
  int other_converts;   // Converts of another registered pair, on a channel of their own,
                        // before it (as a daemon-side IPC warm-up would)
};

// One run of variant `v` on a fresh daemon (or, with `warm`, on that long-running one):
// `v`'s preparation, then `iters` + 1 Converts. Prints the first five calls, the warm p50
// and the ratio, each call's split and the daemon's log lines of the first two Converts;
// appends the ratio to `ratios`. The same sequence on a warm daemon is the baseline of
// the fresh one: what is left between them is the fresh daemon's own first-request cost.
bool FreshDaemonRun(const std::vector<std::string>& daemon_args, wprep::testing::Daemon* warm,
                    const FreshVariant& v, int run, int iters, std::vector<double>* ratios) {
  std::string error;
  std::unique_ptr<wprep::testing::Daemon> started;
  wprep::testing::Daemon* d = warm;
  if (warm == nullptr) {
    started = wprep::testing::Daemon::Start(daemon_args, &error);
    if (started == nullptr || !started->WaitServing()) {
      std::fprintf(stderr, "another wprepd did not start: %s\n", error.c_str());
      return false;
    }
    d = started.get();
  }
  const std::string label = absl::StrCat(warm == nullptr ? "1MiB_fresh_" : "1MiB_warm_", v.name, "_run", run);
  std::vector<double> ms;
  IpcPair other;
  if (v.other_converts > 0) {
    wprep::client::Client c(wprep::client::MakeChannel(d->unix_target(), 512 << 20));
    if (!other.Init({2048, 1024}, 43) || !Register(c, other, nullptr) ||
        !Converts(c, other, v.other_converts, &ms)) {
      return false;
    }
  }
  wprep::client::Client client(wprep::client::MakeChannel(d->unix_target(), 512 << 20));
  if (!client.ListDevices().ok()) return false;
  IpcPair pair;
  if (!pair.Init({2048, 1024}, 42)) return false;
  if (v.registered && !Register(client, pair, label.c_str())) return false;
  for (int i = 0; i < v.pings; ++i) {
    if (!client.ListDevices().ok()) return false;
  }
  if (v.sleep_us > 0) absl::SleepFor(absl::Microseconds(v.sleep_us));
  if (v.busy_gpu) {
    // If the first Convert's extra time is the GPU switching from this process's context
    // to the daemon's, this adds it.
    void* scratch = nullptr;
    BENCH_CUDA(cudaMalloc(&scratch, 64 << 20));
    for (int i = 0; i < 100; ++i) BENCH_CUDA(cudaMemsetAsync(scratch, i, 64 << 20));
    BENCH_CUDA(cudaDeviceSynchronize());
    BENCH_CUDA(cudaFree(scratch));
  }
  ms.clear();
  std::vector<Stamps> stamps;
  if (!Converts(client, pair, iters + 1, &ms, &stamps)) return false;
  (void)client.ReleaseIpcHandles(pair.Refs<v1::ReleaseIpcHandlesRequest>());
  if (v.other_converts > 0) (void)client.ReleaseIpcHandles(other.Refs<v1::ReleaseIpcHandlesRequest>());
  const double first = ms.front();
  const double p50 = Median(std::vector<double>(ms.begin() + 1, ms.end()));
  ratios->push_back(first / p50);
  std::string firsts;
  for (size_t i = 0; i < std::min<size_t>(5, ms.size()); ++i) absl::StrAppend(&firsts, " ", absl::SixDigits(ms[i]));
  std::printf("%s first_calls_ms%s warm_p50_ms %.4f ratio %.2f\n", label.c_str(), firsts.c_str(), p50,
              first / p50);
  // Each call split into the way in (send to handler start), the handler and the way out
  // (handler end to receipt), in microseconds, with the kernel's share of the handler
  // (its events' time): the first five calls, then the median of the
  // warm ones. The measured pair's Converts are the last iters + 1 in the log.
  std::vector<wprep::testing::HandlerSpan> spans = wprep::testing::RequestSpans(d->Log(), "Convert");
  if (spans.size() < stamps.size()) {
    std::printf("%s split unavailable (%zu Convert lines for %zu calls)\n", label.c_str(), spans.size(),
                stamps.size());
    return true;
  }
  spans.erase(spans.begin(), spans.end() - static_cast<std::ptrdiff_t>(stamps.size()));
  std::vector<double> in_us, handler_us, kernel_us, out_us;
  for (size_t i = 0; i < stamps.size(); ++i) {
    in_us.push_back(spans[i].InMicros(stamps[i].sent));
    handler_us.push_back(spans[i].seconds * 1e6);
    kernel_us.push_back(spans[i].kernel_seconds * 1e6);
    out_us.push_back(spans[i].OutMicros(stamps[i].received));
  }
  std::string split;
  for (size_t i = 0; i < std::min<size_t>(5, stamps.size()); ++i) {
    absl::StrAppend(&split, " ", static_cast<int>(in_us[i]), "/", static_cast<int>(handler_us[i]), "(",
                    static_cast<int>(kernel_us[i]), ")/", static_cast<int>(out_us[i]));
  }
  auto warm_median = [](const std::vector<double>& v) {
    return static_cast<int>(Median(std::vector<double>(v.begin() + 1, v.end())));
  };
  std::printf("%s split_in/handler(kernel)/out_us%s warm_median %d/%d(%d)/%d\n", label.c_str(),
              split.c_str(), warm_median(in_us), warm_median(handler_us), warm_median(kernel_us),
              warm_median(out_us));
  // The daemon's log lines of the measured pair's first two Converts and of its last.
  for (size_t i : {size_t{0}, size_t{1}, spans.size() - 1}) {
    std::printf("fresh_daemon_log %s %s\n", label.c_str(), spans[i].line.c_str());
  }
  return true;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  wprep::flags::FlagSet fs("wprep_rpc_bench",
                           "usage: wprep_rpc_bench [flags] [-- wprepd flags]\n"
                           "End-to-end figures of wprepd. Without --target it starts wprepd itself, with the\n"
                           "flags after --.\n");
  fs.String("target", "ADDR", "", "a running wprepd (unix:///path) instead of one of its own");
  fs.Int("iters", "N", 100, "timed calls per figure", 1, 1 << 20);
  fs.Int("stream-runs", "N", 5, "timed ConvertStream runs per figure", 1, 1 << 20);
  fs.Int("fresh-runs", "N", 3, "fresh daemons per first-request variant (GPU builds)", 0, 1 << 10);
  fs.AllowRest();
  if (absl::Status s = fs.Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_rpc_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  std::string target = fs.GetString("target");
  [[maybe_unused]] const int iters = static_cast<int>(fs.GetInt("iters"));  // GPU builds only
  const int stream_runs = static_cast<int>(fs.GetInt("stream-runs"));
  [[maybe_unused]] const int fresh_runs = static_cast<int>(fs.GetInt("fresh-runs"));  // GPU builds only
  const std::vector<std::string>& daemon_args = fs.rest();
  wprep::client::TuneHeapForStreaming();
  std::unique_ptr<wprep::testing::Daemon> daemon;
  if (target.empty()) {
    std::string error;
    const auto t0 = Clock::now();
    daemon = wprep::testing::Daemon::Start(daemon_args, &error);
    if (daemon == nullptr || !daemon->WaitServing()) {
      std::fprintf(stderr, "wprepd did not start: %s\n", error.c_str());
      return 1;
    }
    std::printf("start_to_serving_ms %.2f\n", Ms(Clock::now() - t0));
    target = daemon->unix_target();
  }
  wprep::client::Client client(wprep::client::MakeChannel(target, 512 << 20));
  absl::StatusOr<v1::ListDevicesResponse> devs = client.ListDevices();
  if (!devs.ok()) {
    std::fprintf(stderr, "ListDevices: %s\n", devs.status().ToString().c_str());
    return 1;
  }
  std::printf("engine %s\n", devs->cpu_engine() ? "cpu" : "cuda");

  if (!devs->cpu_engine() && wprep::CudaDeviceCount() > 0) {
#if WPREP_HAVE_CUDA
    // The first Convert after SERVING, on handles registered just before it (the way a
    // loader with a buffer pool uses the daemon). It is also this process's first Convert,
    // so it includes the client's own cold path; the fresh daemons below are called by a
    // warm client.
    double first_ms = 0;
    if (!BenchIpc(client, {2048, 1024}, iters, "1MiB_registered", &first_ms, true)) return 1;
    std::printf("first_convert_after_serving_ms %.4f (1 MiB IPC->IPC, handles registered first, "
                "cold client)\n",
                first_ms);
    // The same 1 MiB request on fresh, unregistered allocations in the warm daemon: its
    // first call opens the new IPC handles.
    if (!BenchIpc(client, {2048, 1024}, iters, "1MiB", nullptr)) return 1;
    if (!BenchIpc(client, {8192, 32768}, std::max(5, iters / 4), "128MiB", nullptr)) return 1;
    if (!PausedCalls(client, iters, 15)) return 1;
    if (daemon != nullptr) {
      // Fresh daemons called by this (now warm) client, `fresh_runs` of each variant,
      // each next to the same sequence on the long-running daemon: the first Convert on
      // unregistered handles; on registered ones; after one or ten ListDevices calls, or
      // a 2 ms pause; after this process's own GPU work; and after twenty Converts of
      // another pair on another channel (what a daemon-side IPC warm-up would give).
      const FreshVariant variants[] = {
          {"unregistered", false, 0, 0, false, 0},
          {"registered", true, 0, 0, false, 0},
          {"registered_slept2ms", true, 0, 2000, false, 0},
          {"registered_pinged", true, 1, 0, false, 0},
          {"registered_pinged10", true, 10, 0, false, 0},
          {"registered_pinged10_busy_gpu", true, 10, 0, true, 0},
          {"other_pair_other_channel", true, 1, 0, false, 20},
      };
      for (const FreshVariant& v : variants) {
        std::vector<double> fresh_ratios, warm_ratios;
        std::string fresh_runs_text, warm_runs_text;
        for (int run = 1; run <= fresh_runs; ++run) {
          if (!FreshDaemonRun(daemon_args, nullptr, v, run, iters, &fresh_ratios) ||
              !FreshDaemonRun(daemon_args, daemon.get(), v, run, iters, &warm_ratios)) {
            return 1;
          }
          absl::StrAppend(&fresh_runs_text, run == 1 ? "" : " ", absl::SixDigits(fresh_ratios.back()));
          absl::StrAppend(&warm_runs_text, run == 1 ? "" : " ", absl::SixDigits(warm_ratios.back()));
        }
        std::printf("first_convert_%s_ratio_median fresh_daemon %.2f warm_daemon %.2f (warm client; "
                    "fresh runs: %s; warm runs: %s)\n",
                    v.name, Median(fresh_ratios), Median(warm_ratios), fresh_runs_text.c_str(),
                    warm_runs_text.c_str());
      }
    }
#endif
  } else {
    // The CPU engine: the first and warm 1 MiB bytes->bytes Convert.
    const wprep::ConversionSpec spec = HopperMx2Swizzle();
    std::vector<uint8_t> in = wprep::testing::RandomBytes(1 << 20, 7);
    v1::ConvertRequest req;
    *req.mutable_spec() = wprep::SpecToProto(spec);
    req.add_logical_shape(2048);
    req.add_logical_shape(1024);
    req.set_source_bytes(std::string(in.begin(), in.end()));
    std::vector<double> ms;
    for (int i = 0; i < iters + 1; ++i) {
      const auto t0 = Clock::now();
      if (!client.Convert(req).ok()) return 1;
      ms.push_back(Ms(Clock::now() - t0));
    }
    std::printf("first_request_after_serving_ms %.4f (1 MiB bytes->bytes, CPU engine)\n", ms[0]);
    ms.erase(ms.begin());
    std::printf("1MiB_bytes_to_bytes_rpc_p50_ms %.4f\n", Median(ms));
  }

  // 128 MiB bytes->bytes through ConvertStream: 32 matrices of 4 MiB, 1 MiB chunks.
  const std::vector<int64_t> shape = {32, 4096, 2048};
  absl::StatusOr<wprep::Plan> plan = wprep::MakePlan(HopperMx2Swizzle(), shape);
  if (!plan.ok()) return 1;
  std::vector<uint8_t> in = wprep::testing::RandomBytes(plan->input_bytes, 9);
  v1::StreamRequestHeader h;
  *h.mutable_spec() = wprep::SpecToProto(HopperMx2Swizzle());
  for (int64_t d : shape) h.add_logical_shape(d);
  std::string out;
  // One connection (one stream), then the client's default of two connections (two
  // striped streams), then four; 1 MiB chunks. GB/s = 128 MiB / the whole call.
  for (const int connections : {1, 2, 4}) {
    wprep::client::Client striped(target, connections, 512 << 20);
    std::vector<double> gbs;
    std::string runs;
    for (int i = 0; i < stream_runs; ++i) {
      const auto t0 = Clock::now();
      absl::StatusOr<v1::StreamResponseHeader> r = striped.ConvertStream(h, in, &out);
      const double s = Ms(Clock::now() - t0) / 1e3;
      if (!r.ok()) {
        std::fprintf(stderr, "ConvertStream: %s\n", r.status().ToString().c_str());
        return 1;
      }
      gbs.push_back(static_cast<double>(plan->input_bytes) / s / 1e9);
      absl::StrAppend(&runs, i == 0 ? "" : " ", absl::SixDigits(gbs.back()));
    }
    std::printf("128MiB_stream_bytes_to_bytes_%d_connections_GBps_median %.3f (runs: %s)\n",
                connections, Median(gbs), runs.c_str());
  }
  if (daemon != nullptr) {
    // From the daemon's log, in one pass: its own time per IPC->IPC request (seconds=:
    // handler entry to final status, kernel and stream sync included) by input size, and
    // the lines of the requests that opened IPC handles (ipc_open and the request after
    // them) and of its first requests.
    std::map<std::string, std::vector<double>> handler_ms;
    std::istringstream log(daemon->Log());
    bool after_open = false;
    int requests = 0;
    for (std::string line; std::getline(log, line);) {
      const bool open = line.find("event=ipc_open") != std::string::npos;
      const bool request = line.find("event=request") != std::string::npos;
      if (open || (request && (after_open || ++requests <= 3))) {
        std::printf("daemon_log %s\n", line.c_str());
      }
      if (open || request) after_open = open;
      const size_t sp = line.find(" seconds="), bp = line.find(" bytes_in=");
      if (request && line.find("transport=ipc_to_ipc code=OK") != std::string::npos &&
          sp != std::string::npos && bp != std::string::npos) {
        const double sec = std::atof(line.c_str() + sp + 9);
        handler_ms[line.substr(bp + 10, line.find(' ', bp + 10) - bp - 10)].push_back(sec * 1e3);
      }
    }
    for (const auto& [bytes, v] : handler_ms) {
      std::printf("daemon_handler_ipc_to_ipc_bytes_%s_p50_ms %.4f (of %zu)\n", bytes.c_str(),
                  Median(v), v.size());
    }
  }
  return 0;
}
