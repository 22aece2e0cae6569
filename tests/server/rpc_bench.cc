// wprep_rpc_bench: end-to-end figures of wprepd (a program, not a test).
//
//   wprep_rpc_bench [--target=unix:///path] [--iters=N] [--stream-runs=N] [-- wprepd flags]
//
// Without --target it starts wprepd itself (WPREPD env or the built binary) on a Unix
// socket and reports start-to-SERVING. Then, with a GPU: 1 MiB and 128 MiB Hopper
// mx_axis=-2 swizzle IPC->IPC end-to-end p50 next to the kernel's own p50 (cudaEvent
// timing of the same kernel in this process), and the first request after SERVING;
// always: 128 MiB bytes->bytes ConvertStream GB/s over the Unix socket, on one connection
// and striped over two (the client's default) and four.
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
#include "daemon_harness.h"
#include "golden.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/plan.h"

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

// IPC->IPC p50 of `shape` next to the kernel's p50; `first_ms` receives the first call.
// With `register_first`, the handles are registered (RegisterIpcHandles) before it; then
// `pings` ListDevices calls go just before the first Convert.
bool BenchIpc(wprep::client::Client& client, const std::vector<int64_t>& shape, int iters,
              const char* label, double* first_ms, bool register_first = false, int pings = 0,
              bool busy_gpu_first = false) {
  const wprep::ConversionSpec spec = HopperMx2Swizzle();
  absl::StatusOr<wprep::Plan> plan = wprep::MakePlan(spec, shape);
  if (!plan.ok()) return false;
  void *in = nullptr, *out = nullptr;
  BENCH_CUDA(cudaSetDevice(0));
  BENCH_CUDA(cudaMalloc(&in, plan->input_bytes));
  BENCH_CUDA(cudaMalloc(&out, plan->output_bytes));
  std::vector<uint8_t> host = wprep::testing::RandomBytes(plan->input_bytes, 42);
  BENCH_CUDA(cudaMemcpy(in, host.data(), host.size(), cudaMemcpyHostToDevice));
  cudaIpcMemHandle_t hin, hout;
  BENCH_CUDA(cudaIpcGetMemHandle(&hin, in));
  BENCH_CUDA(cudaIpcGetMemHandle(&hout, out));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  v1::ConvertRequest req;
  *req.mutable_spec() = wprep::client::SpecToProto(spec);
  for (int64_t d : shape) req.add_logical_shape(d);
  auto* s = req.mutable_source_ipc();
  s->set_handle(std::string(reinterpret_cast<const char*>(&hin), 64));
  s->set_size(plan->input_bytes);
  s->set_device_uuid(std::string(prop.uuid.bytes, 16));
  auto* d = req.mutable_destination_ipc();
  d->set_handle(std::string(reinterpret_cast<const char*>(&hout), 64));
  d->set_size(plan->output_bytes);
  d->set_device_uuid(std::string(prop.uuid.bytes, 16));
  // Both handles as IpcHandleRefs (RegisterIpcHandles and ReleaseIpcHandles take them).
  auto add_refs = [&](google::protobuf::RepeatedPtrField<v1::IpcHandleRef>* refs) {
    for (const std::string& h : {s->handle(), d->handle()}) {
      v1::IpcHandleRef* x = refs->Add();
      x->set_handle(h);
      x->set_device_uuid(std::string(prop.uuid.bytes, 16));
    }
  };
  if (register_first) {
    v1::RegisterIpcHandlesRequest reg;
    add_refs(reg.mutable_handles());
    const auto t0 = Clock::now();
    absl::StatusOr<v1::RegisterIpcHandlesResponse> r = client.RegisterIpcHandles(reg);
    if (!r.ok()) {
      std::fprintf(stderr, "RegisterIpcHandles: %s\n", r.status().ToString().c_str());
      return false;
    }
    std::printf("%s_register_two_handles_ms %.4f\n", label, Ms(Clock::now() - t0));
  }
  for (int i = 0; i < pings; ++i) {
    const auto t0 = Clock::now();
    if (!client.ListDevices().ok()) return false;
    if (i == 0 || i == pings - 1) {
      std::printf("%s_list_devices_ping%d_ms %.4f\n", label, i + 1, Ms(Clock::now() - t0));
    }
  }
  if (busy_gpu_first) {
    // ~2 ms of memsets on the same GPU right before the first Convert: if the first
    // Convert's extra time is the GPU waking from idle, this removes it.
    void* scratch = nullptr;
    BENCH_CUDA(cudaMalloc(&scratch, 64 << 20));
    for (int i = 0; i < 100; ++i) BENCH_CUDA(cudaMemsetAsync(scratch, i, 64 << 20));
    BENCH_CUDA(cudaDeviceSynchronize());
    BENCH_CUDA(cudaFree(scratch));
  }
  std::vector<double> rpc;
  double first = 0;
  for (int i = 0; i < iters + 1; ++i) {
    const absl::Time sent = absl::Now();
    const auto t0 = Clock::now();
    absl::StatusOr<v1::ConvertResponse> r = client.Convert(req);
    const double ms = Ms(Clock::now() - t0);
    if (!r.ok()) {
      std::fprintf(stderr, "Convert: %s\n", r.status().ToString().c_str());
      return false;
    }
    if (i < 2) {
      // Wall-clock send and receive times of the first two calls: against the daemon's
      // log (ts = end of the handler, seconds = its duration) they split the round trip
      // into the way in, the handler and the way out (one host, one clock).
      std::printf("%s_call%d_sent_unix_us %lld received_unix_us %lld\n", label, i + 1,
                  static_cast<long long>(absl::ToUnixMicros(sent)),
                  static_cast<long long>(absl::ToUnixMicros(absl::Now())));
    }
    if (i == 0) first = ms;
    if (i == 0 && first_ms != nullptr) *first_ms = ms;
    if (i > 0) rpc.push_back(ms);
  }
  // The same kernel in this process, timed with events.
  cudaStream_t st;
  BENCH_CUDA(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<double> kernel;
  for (int i = 0; i < iters + 1; ++i) {
    BENCH_CUDA(cudaEventRecord(e0, st));
    if (!wprep::ConvertOnCuda(*plan, in, out, st).ok()) return false;
    BENCH_CUDA(cudaEventRecord(e1, st));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) kernel.push_back(ms);
  }
  v1::ReleaseIpcHandlesRequest rel;
  add_refs(rel.mutable_handles());
  (void)client.ReleaseIpcHandles(rel);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
  cudaFree(in);
  cudaFree(out);
  std::printf("%s_ipc_to_ipc_rpc_p50_ms %.4f\n%s_kernel_p50_ms %.4f\n%s_rpc_minus_kernel_ms %.4f\n",
              label, Median(rpc), label, Median(kernel), label, Median(rpc) - Median(kernel));
  std::printf("%s_first_call_ms %.4f\n", label, first);
  return true;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string target;
  int iters = 100, stream_runs = 5;
  std::vector<std::string> daemon_args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      daemon_args.assign(argv + i + 1, argv + argc);
      break;
    }
    if (a.rfind("--target=", 0) == 0) target = a.substr(9);
    else if (a.rfind("--iters=", 0) == 0) iters = std::max(1, std::atoi(a.c_str() + 8));
    else if (a.rfind("--stream-runs=", 0) == 0) stream_runs = std::max(1, std::atoi(a.c_str() + 14));
    else {
      std::fprintf(stderr, "usage: wprep_rpc_bench [--target=ADDR] [--iters=N] [--stream-runs=N] [-- wprepd flags]\n");
      return 2;
    }
  }
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
    if (daemon != nullptr) {
      // Fresh daemons, called by this (now warm) client: one whose first Convert brings
      // unregistered handles, one whose first Convert follows a registration, and two
      // whose first Convert follows a registration and one or ten ListDevices calls (if
      // ten bring it to the warm p50, the daemon's Convert path is warm and what is left
      // is the round trip after a pause).
      struct Fresh {
        const char* label;
        const char* summary;
        bool registered;
        int pings;
        bool busy_gpu = false;
      };
      for (const Fresh& f : {Fresh{"1MiB_fresh_daemon", "unregistered", false, 0},
                             Fresh{"1MiB_fresh_daemon_registered", "registered", true, 0},
                             Fresh{"1MiB_fresh_daemon_registered_pinged", "registered_then_pinged",
                                   true, 1},
                             Fresh{"1MiB_fresh_daemon_registered_pinged10",
                                   "registered_then_pinged10", true, 10},
                             Fresh{"1MiB_fresh_daemon_registered_pinged10_busy_gpu",
                                   "registered_then_pinged10_busy_gpu", true, 10, true}}) {
        std::string error;
        std::unique_ptr<wprep::testing::Daemon> fresh = wprep::testing::Daemon::Start(daemon_args, &error);
        if (fresh == nullptr || !fresh->WaitServing()) {
          std::fprintf(stderr, "another wprepd did not start: %s\n", error.c_str());
          return 1;
        }
        wprep::client::Client fresh_client(wprep::client::MakeChannel(fresh->unix_target(), 512 << 20));
        if (!fresh_client.ListDevices().ok()) return 1;
        if (!BenchIpc(fresh_client, {2048, 1024}, iters, f.label, &first_ms, f.registered, f.pings,
                      f.busy_gpu)) {
          return 1;
        }
        std::printf("first_convert_after_serving_%s_ms %.4f (warm client)\n", f.summary, first_ms);
        // Its requests up to the second Convert (the first Convert's handler and kernel
        // time against the next one's).
        std::istringstream log(fresh->Log());
        int converts = 0;
        for (std::string line; std::getline(log, line) && converts < 2;) {
          if (line.find("event=request") == std::string::npos) continue;
          if (line.find("method=ListDevices") != std::string::npos && converts == 0 &&
              line.find(" id=1 ") == std::string::npos) {
            continue;  // the pings between the first ListDevices and the first Convert
          }
          std::printf("fresh_daemon_log %s\n", line.c_str());
          if (line.find("method=Convert") != std::string::npos) ++converts;
        }
      }
    }
#endif
  } else {
    // The CPU engine: the first and warm 1 MiB bytes->bytes Convert.
    const wprep::ConversionSpec spec = HopperMx2Swizzle();
    std::vector<uint8_t> in = wprep::testing::RandomBytes(1 << 20, 7);
    v1::ConvertRequest req;
    *req.mutable_spec() = wprep::client::SpecToProto(spec);
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
  *h.mutable_spec() = wprep::client::SpecToProto(HopperMx2Swizzle());
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
