// wprep_memory_soak: the daemon's load and soak test. Does wprepd serve a long mixed load
// from many clients without an error, how fast, and does its memory return to its idle
// level afterwards? (a program: `make soak-memory`, scripts/soak.sh, and in CI the ctest
// load_cpu_10k).
//
//   wprep_memory_soak [flags] [-- wprepd flags]     (wprep_memory_soak --help lists them)
//
// Without --target it starts wprepd itself (daemon_harness.h). K clients (default 2), each
// a wprep::client::Client on its own connection, alternately over the daemon's Unix socket
// and its TCP port (one connection with --target), are connected first. It samples the idle
// level (the daemon's VmRSS and RssAnon, wprep_host_buffered_bytes,
// wprep_device_allocated_bytes per device and, with GPUs, each GPU's used memory from
// cudaMemGetInfo), sends N requests from T threads, thread t through client t mod K (Plan,
// inline Convert of 4 KiB..2 MiB over the five layouts, each direction and both packing
// axes, a 16 MiB ConvertStream every S-th (default 250; docs/RELIABILITY.md's admission
// load takes 10, so that many clients' streams contend for --max-buffered-bytes at once),
// bad requests expecting INVALID_ARGUMENT and,
// when the daemon serves this process's GPU 0, IPC->IPC, bytes->IPC and IPC->bytes on
// cudaMalloc'd buffers, some fresh and released with ReleaseIpcHandles before cudaFree;
// without a GPU the IPC requests are skipped and it says so), checks every output against
// the CPU engine, waits for the daemon's idle trim and prints each kind's count, failures
// and latency (p50, p99, max), the throughput, and the memory rows idle, peak and after.
// Exit 0 when every request had its expected outcome and every row came back within its
// tolerance (host H MiB, default 8; the metrics 0; cudaMemGetInfo C MiB, default 16), else
// 1.
//
// Each request's expected output comes from the CPU engine in this process: the engine
// is checked against the reference vectors elsewhere (tests/kernels/golden_test.cc); here
// the daemon's transports are under test.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon_harness.h"
#include "golden.h"
#include "wprep/client/client.h"
#include "wprep/kernels/cpu_engine.h"
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
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kConnectionMiB = 5;  // what one open connection may keep after the load

struct Args {
  std::string target, metrics = "127.0.0.1:9464";  // metrics: with --target only
  pid_t pid = -1;
  int requests = 10000, threads = 8, clients = 2;
  int stream_every = 250;  // every stream_every-th request is a 16 MiB ConvertStream
  double tolerance_mib = 8, cuda_tolerance_mib = 16;
  std::vector<std::string> daemon_args;
};

// One conversion, its input and the CPU engine's output for it.
struct Case {
  wprep::ConversionSpec spec;
  std::vector<int64_t> shape;
  std::vector<uint8_t> input;
  std::string expected;
  void* d_in = nullptr;  // the input on this process's GPU 0 (IPC requests)
  std::string h_in;      // its cudaIpcMemHandle_t
};

// Hopper (mx, mma) or Blackwell tiling (bk, bn); a Blackwell retile goes to (256, 128).
wprep::ConversionSpec Spec(wprep::Layout l, wprep::Direction d, int32_t mx = -2, int32_t mma = 3,
                           int64_t bk = 128, int64_t bn = 256) {
  return {l, d, {mx, mma}, {bk, bn}, {256, 128}, {}, -1};
}

// `s` with its canonical side in checkpoint order (packing axis -2).
wprep::ConversionSpec Checkpoint(wprep::ConversionSpec s) {
  s.packing_axis = -2;
  return s;
}

// A PlanRequest, ConvertRequest or StreamRequestHeader for `spec` and `shape`.
template <typename Message>
Message For(const wprep::ConversionSpec& spec, const std::vector<int64_t>& shape) {
  Message m;
  *m.mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : shape) m.add_logical_shape(d);
  return m;
}

bool AddCase(const wprep::ConversionSpec& spec, std::vector<int64_t> shape, uint64_t seed,
             std::vector<Case>* out) {
  absl::StatusOr<wprep::Plan> plan = wprep::MakePlan(spec, shape);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s: %s\n", wprep::Describe(spec).c_str(), plan.status().ToString().c_str());
    return false;
  }
  Case c{spec, std::move(shape), wprep::testing::RandomBytes(plan->input_bytes, seed), {}, nullptr, {}};
  c.expected.resize(plan->output_bytes);
  if (!wprep::ConvertOnCpu(*plan, c.input.data(), c.input.size(),
                           reinterpret_cast<uint8_t*>(c.expected.data()), c.expected.size()).ok()) {
    return false;
  }
  out->push_back(std::move(c));
  return true;
}

v1::ConvertRequest Request(const Case& c, bool inline_source) {
  v1::ConvertRequest r = For<v1::ConvertRequest>(c.spec, c.shape);
  if (inline_source) r.set_source_bytes(std::string(c.input.begin(), c.input.end()));
  return r;
}

v1::CudaIpcBuffer Ipc(const std::string& handle, uint64_t size, const std::string& uuid) {
  v1::CudaIpcBuffer b;
  b.set_handle(handle);
  b.set_size(size);
  b.set_device_uuid(uuid);
  return b;
}

// The memory rows, in bytes: the daemon's VmRSS and RssAnon (when pid > 0), the allocator
// metric per device label, and the used memory of each GPU this process sees (device-wide:
// other processes' and this one's buffers count too, so it is sampled with them unchanged).
struct Probe {
  pid_t pid = -1;
  std::string metrics;
  std::vector<std::string> labels;
  int gpus = 0;
  std::vector<std::string> names;
  std::vector<double> tolerance;

  void AddRows(const Args& a) {
    if (pid > 0) names = {"daemon VmRSS", "daemon RssAnon"};
    tolerance.assign(names.size(), a.tolerance_mib * kMiB);
    names.push_back("wprep_host_buffered_bytes");
    tolerance.push_back(0);
    for (const std::string& l : labels) names.push_back("wprep_device_allocated_bytes{" + l + "}");
    tolerance.resize(names.size(), 0);
    for (int g = 0; g < gpus; ++g) names.push_back(absl::StrCat("cudaMemGetInfo used, GPU ", g));
    tolerance.resize(names.size(), a.cuda_tolerance_mib * kMiB);
  }

  std::vector<double> Sample() const {  // -1 where a value could not be read
    std::vector<double> v;
    if (pid > 0) {
      double rss = -1, anon = -1, kb = 0;
      std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
      for (std::string key; f >> key;) {
        if ((key == "VmRSS:" || key == "RssAnon:") && f >> kb) (key == "VmRSS:" ? rss : anon) = kb * 1024;
      }
      v = {rss, anon};
    }
    const std::string text = wprep::testing::HttpGet(metrics, "/metrics");
    v.push_back(wprep::testing::MetricValue(text, "wprep_host_buffered_bytes").value_or(-1));
    for (const std::string& l : labels) {
      v.push_back(wprep::testing::MetricValue(text, "wprep_device_allocated_bytes", {{"device", l}}).value_or(-1));
    }
#if WPREP_HAVE_CUDA
    for (int g = 0; g < gpus; ++g) {
      size_t free_b = 0, total_b = 0;
      const bool ok = cudaSetDevice(g) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
      v.push_back(ok ? static_cast<double>(total_b - free_b) : -1);
    }
#endif
    return v;
  }
};

class Soak {
 public:
  Soak(const Args& a, std::vector<wprep::client::Client*> clients) : a_(a), clients_(std::move(clients)) {}

  bool Setup() {
    using D = wprep::Direction;
    const wprep::Layout h = wprep::Layout::kHopperValue, b = wprep::Layout::kBlackwellShuffledValue;
    return AddCase(Spec(h, D::kSwizzle, -1, 2), {64, 128}, 1, &cases_) &&  // 4 KiB
           AddCase(Spec(h, D::kSwizzle, -1, 3), {3, 300, 200}, 2, &cases_) &&
           AddCase(Spec(h, D::kSwizzle, -2, 3), {1024, 2048}, 3, &cases_) &&  // 1 MiB
           AddCase(Spec(h, D::kSwizzle, -2, 2), {2048, 2048}, 4, &cases_) &&  // 2 MiB
           AddCase(Spec(h, D::kUnswizzle, -2, 3), {2, 512, 1024}, 5, &cases_) &&
           AddCase(Spec(h, D::kUnswizzle, -1, 3), {256, 512}, 6, &cases_) &&
           AddCase(Spec(b, D::kSwizzle), {1000, 2000}, 7, &cases_) &&
           AddCase(Spec(b, D::kSwizzle, -2, 3, 64, 64), {130, 200}, 8, &cases_) &&
           AddCase(Spec(b, D::kUnswizzle), {256, 512}, 9, &cases_) &&
           AddCase(Spec(b, D::kRetile), {1024, 1024}, 10, &cases_) &&
           AddCase(Checkpoint(Spec(h, D::kSwizzle)), {2, 256, 256}, 13, &cases_) &&
           AddCase(Spec(wprep::Layout::kBlackwellValue, D::kSwizzle), {2, 256, 256}, 14, &cases_) &&
           AddCase(Checkpoint(Spec(wprep::Layout::kBlackwellValue, D::kUnswizzle)), {2, 256, 256}, 15, &cases_) &&
           AddCase(Spec(wprep::Layout::kHopperScale, D::kSwizzle), {2, 256, 256}, 16, &cases_) &&
           AddCase(Spec(wprep::Layout::kBlackwellScale, D::kUnswizzle), {2, 256, 256}, 17, &cases_) &&
           AddCase(Spec(h, D::kSwizzle), {8, 2048, 2048}, 11, &big_) &&  // 16 MiB
           AddCase(Spec(b, D::kUnswizzle), {4, 2048, 4096}, 12, &big_);
  }

#if WPREP_HAVE_CUDA
  // Puts every case's input on GPU 0 (current) for the IPC requests; `uuid` names the GPU.
  bool SetupIpc(const std::string& uuid) {
    for (Case& c : cases_) {
      if (!DeviceCopy(c.input, &c.d_in, &c.h_in)) return false;
    }
    uuid_ = uuid;
    return true;
  }
  void FreeIpc(wprep::client::Client& client) {
    for (Case& c : cases_) {
      (void)Release(client, {c.h_in});
      cudaFree(c.d_in);
    }
  }
#endif

  // Sends the requests from --threads threads; prints the outcomes per kind and returns
  // true when every request had its expected outcome.
  bool Run() {
    std::vector<std::thread> workers;
    for (int t = 0; t < a_.threads; ++t) workers.emplace_back([this, t] { Worker(t); });
    for (std::thread& w : workers) w.join();
    int failed = 0;
    std::vector<double> all;
    std::printf("  %-24s %8s %7s %9s %9s %9s\n", "kind", "requests", "failed", "p50 ms", "p99 ms", "max ms");
    for (auto& [kind, n] : done_) {
      const int f = failed_.count(kind) != 0 ? failed_.at(kind) : 0;
      std::vector<double>& s = seconds_[kind];
      all.insert(all.end(), s.begin(), s.end());
      std::printf("  %-24s %8d %7d %9.2f %9.2f %9.2f\n", kind.c_str(), n, f, Quantile(s, 0.5) * 1e3,
                  Quantile(s, 0.99) * 1e3, Quantile(s, 1) * 1e3);
      failed += f;
    }
    std::printf("  %-24s %8zu %7d %9.2f %9.2f %9.2f\n", "all", all.size(), failed, Quantile(all, 0.5) * 1e3,
                Quantile(all, 0.99) * 1e3, Quantile(all, 1) * 1e3);
    for (const std::string& m : first_failures_) std::printf("  FAIL %s\n", m.c_str());
    errors_ = failed;
    p50_ = Quantile(all, 0.5);
    p99_ = Quantile(all, 0.99);
    return failed == 0;
  }

  int errors() const { return errors_; }
  double p50() const { return p50_; }
  double p99() const { return p99_; }
  uint64_t bytes() const { return bytes_.load(); }

 private:
  // The q-quantile (nearest rank) of `v`, sorted in place; 0 when empty.
  static double Quantile(std::vector<double>& v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::min(v.size() - 1, rank == 0 ? 0 : rank - 1)];
  }

  void Worker(int t) {
    wprep::client::Client& client = *clients_[static_cast<size_t>(t) % clients_.size()];
    [[maybe_unused]] void* d_out = nullptr;  // this thread's IPC destination on GPU 0
    [[maybe_unused]] std::string h_out;
#if WPREP_HAVE_CUDA
    uint64_t max_out = 0;
    for (const Case& c : cases_) max_out = std::max<uint64_t>(max_out, c.expected.size());
    if (!uuid_.empty() && (cudaSetDevice(0) != cudaSuccess ||
                           !DeviceCopy(std::vector<uint8_t>(max_out), &d_out, &h_out))) {
      return Record("setup", "cannot allocate the thread's output buffer");
    }
#endif
    for (int i; (i = next_.fetch_add(1)) < a_.requests;) {
      const auto start = Clock::now();
      const Case& c = cases_[static_cast<size_t>(i) * 7919 % cases_.size()];
      const char* kind = "convert inline";
      std::string why;  // empty: the expected outcome
      if (i % a_.stream_every == 0) {
        kind = "stream 16 MiB";
        const Case& s = big_[static_cast<size_t>(i / a_.stream_every) % big_.size()];
        std::string out;
        absl::StatusOr<v1::StreamResponseHeader> r =
            client.ConvertStream(For<v1::StreamRequestHeader>(s.spec, s.shape), s.input, &out);
        why = !r.ok() ? r.status().ToString() : out != s.expected ? "output differs" : "";
        bytes_.fetch_add(s.input.size() + s.expected.size());
      } else if (i % 20 == 1) {
        kind = "plan";
        absl::StatusOr<v1::PlanResponse> r = client.Plan(For<v1::PlanRequest>(c.spec, c.shape));
        why = !r.ok() ? r.status().ToString() : r->output_bytes() != c.expected.size() ? "wrong size" : "";
      } else if (i % 20 == 2) {
        kind = "bad (INVALID_ARGUMENT)";
        why = Bad(client, i / 20 % (uuid_.empty() ? 4 : 5));
      } else if (!uuid_.empty() && i % 20 >= 3 && i % 20 <= 8) {
#if WPREP_HAVE_CUDA
        static const char* const kKinds[] = {"ipc->ipc", "bytes->ipc", "ipc->bytes", "ipc->ipc fresh+release"};
        const int mode = i % 20 <= 5 ? i % 20 - 3 : i % 20 == 6 ? 3 : 0;
        kind = kKinds[mode];
        why = IpcRequest(client, c, mode, d_out, h_out);
        bytes_.fetch_add(c.input.size() + c.expected.size());
#endif
      } else {
        absl::StatusOr<v1::ConvertResponse> r = client.Convert(Request(c, true));
        why = !r.ok() ? r.status().ToString() : r->output_bytes_inline() != c.expected ? "output differs" : "";
        bytes_.fetch_add(c.input.size() + c.expected.size());
      }
      Record(kind, why.empty() ? "" : absl::StrCat("request ", i, " (", wprep::Describe(c.spec), "): ", why),
             std::chrono::duration<double>(Clock::now() - start).count());
    }
#if WPREP_HAVE_CUDA
    if (d_out != nullptr) {
      if (std::string e = Release(client, {h_out}); !e.empty()) Record("release", e);
      cudaFree(d_out);
    }
#endif
  }

  // Bad request number `which`; "" when the daemon answered INVALID_ARGUMENT.
  std::string Bad(wprep::client::Client& client, int which) const {
    const Case& c = cases_[0];
    v1::ConvertRequest r = Request(c, true);
    absl::Status s;
    std::string out;
    if (which == 0) {  // odd packing dim
      r.set_logical_shape(1, 127);
      s = client.Convert(r).status();
    } else if (which == 1) {  // byte count not matching the shape
      r.mutable_source_bytes()->resize(c.input.size() - 100);
      s = client.Convert(r).status();
    } else if (which == 2) {  // negative dim
      s = client.Plan(For<v1::PlanRequest>(c.spec, {-256, 128})).status();
    } else if (which == 3) {  // truncated stream
      const auto head = absl::MakeConstSpan(c.input).subspan(0, 1000);
      s = client.ConvertStream(For<v1::StreamRequestHeader>(c.spec, c.shape), head, &out).status();
    } else {  // garbage IPC handle on a GPU the daemon serves
      std::string garbage(64, '\0');
      for (int k = 0; k < 64; ++k) garbage[k] = static_cast<char>(k * 37 + 11);
      *r.mutable_source_ipc() = Ipc(garbage, c.input.size(), uuid_);
      s = client.Convert(r).status();
    }
    return s.code() == absl::StatusCode::kInvalidArgument ? "" : "got " + s.ToString();
  }

#if WPREP_HAVE_CUDA
  // cudaMalloc + copy of `host` on the current device, and its IPC handle.
  static bool DeviceCopy(const std::vector<uint8_t>& host, void** d, std::string* handle) {
    cudaIpcMemHandle_t h;
    if (cudaMalloc(d, host.size()) != cudaSuccess ||
        cudaMemcpy(*d, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaIpcGetMemHandle(&h, *d) != cudaSuccess) {
      return false;
    }
    handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return true;
  }

  // ReleaseIpcHandles of `handles` on GPU 0; "" when it succeeded.
  std::string Release(wprep::client::Client& client, const std::vector<std::string>& handles) const {
    v1::ReleaseIpcHandlesRequest rel;
    for (const std::string& h : handles) {
      v1::IpcHandleRef* ref = rel.add_handles();
      ref->set_handle(h);
      ref->set_device_uuid(uuid_);
    }
    absl::StatusOr<v1::ReleaseIpcHandlesResponse> r = client.ReleaseIpcHandles(rel);
    return r.ok() ? "" : "ReleaseIpcHandles: " + r.status().ToString();
  }

  // mode 0 IPC->IPC, 1 bytes->IPC, 2 IPC->bytes, 3 IPC->IPC on fresh buffers that are
  // released and freed afterwards; "" when the output matched.
  std::string IpcRequest(wprep::client::Client& client, const Case& c, int mode, void* d_out,
                         const std::string& h_out) const {
    void *in = c.d_in, *out = d_out;
    std::string hin = c.h_in, hout = h_out, got, why;
    if (mode == 3 && (!DeviceCopy(c.input, &in, &hin) ||
                      !DeviceCopy(std::vector<uint8_t>(c.expected.size()), &out, &hout))) {
      return "cudaMalloc of fresh buffers failed";
    }
    v1::ConvertRequest r = Request(c, mode == 1);
    if (mode != 1) *r.mutable_source_ipc() = Ipc(hin, c.input.size(), uuid_);
    if (mode != 2) *r.mutable_destination_ipc() = Ipc(hout, c.expected.size(), uuid_);
    absl::StatusOr<v1::ConvertResponse> resp = client.Convert(r);
    if (!resp.ok()) {
      why = resp.status().ToString();
    } else if (mode == 2) {
      got = resp->output_bytes_inline();
    } else {
      got.resize(c.expected.size());
      if (cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost) != cudaSuccess) why = "cudaMemcpy";
    }
    if (why.empty() && got != c.expected) why = "output differs";
    if (why.empty() && mode != 1 && mode != 2 && resp->peak_extra_device_bytes() != 0) {
      why = absl::StrCat("IPC->IPC used ", resp->peak_extra_device_bytes(), " device bytes");
    }
    if (mode == 3) {
      if (std::string e = Release(client, {hin, hout}); why.empty()) why = e;
      cudaFree(in);
      cudaFree(out);
    }
    return why;
  }
#endif

  // One finished request of `kind` that took `seconds`; `failure` is empty when it had its
  // expected outcome.
  void Record(const std::string& kind, const std::string& failure, double seconds = -1) {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_[kind];
    if (seconds >= 0) seconds_[kind].push_back(seconds);
    if (failure.empty()) return;
    ++failed_[kind];
    if (first_failures_.size() < 10) first_failures_.push_back(kind + ", " + failure);
  }

  // Constant after construction (cases_, big_, uuid_ after Setup/SetupIpc).
  const Args& a_;
  const std::vector<wprep::client::Client*> clients_;
  std::vector<Case> cases_, big_;
  std::string uuid_;  // GPU 0's UUID when the IPC requests run
  std::atomic<int> next_{0};
  std::mutex mu_;
  std::map<std::string, int> done_, failed_;          // guarded by mu_
  std::map<std::string, std::vector<double>> seconds_;  // guarded by mu_
  std::vector<std::string> first_failures_;            // guarded by mu_
  std::atomic<uint64_t> bytes_{0};  // input + output bytes of the conversions that ran
  // Set by Run.
  int errors_ = 0;
  double p50_ = 0, p99_ = 0;
};

}  // namespace

// The command line, or an exit status (2 on bad flags, 0 after --help).
int ParseArgs(int argc, char** argv, Args* a) {
  wprep::flags::FlagSet fs("wprep_memory_soak",
                           "usage: wprep_memory_soak [flags] [-- wprepd flags]\n"
                           "The daemon's load and soak test: a long mixed load from many clients, every output\n"
                           "checked, and the daemon's memory back at its idle level afterwards. Without\n"
                           "--target it starts wprepd itself, with the flags after --.\n");
  fs.Int("requests", "N", a->requests, "requests to send", 1, 1 << 30);
  fs.Int("threads", "T", a->threads, "sending threads", 1, 1 << 16);
  fs.Int("clients", "K", a->clients, "clients, each on its own connection", 1, 1 << 16);
  fs.Int("stream-every", "S", a->stream_every, "every S-th request is a 16 MiB ConvertStream", 1, 1 << 30);
  fs.String("tolerance-mib", "H", absl::StrCat(a->tolerance_mib),
            "MiB the daemon's host memory may stay above its idle level");
  fs.String("cuda-tolerance-mib", "C", absl::StrCat(a->cuda_tolerance_mib),
            "MiB each GPU's used memory may stay above its idle level");
  fs.String("target", "ADDR", a->target, "a running wprepd instead of one of its own");
  fs.Int("pid", "PID", a->pid, "with --target: the daemon's process, for its memory", -1,
         std::numeric_limits<int>::max())
      .HideDefault();
  fs.String("metrics", "HOST:PORT", a->metrics, "with --target: the daemon's metrics address");
  fs.AllowRest();
  // scripts/soak.sh passes its defaults, then the caller's flags: the later value wins.
  fs.LastWins();
  if (absl::Status s = fs.Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_memory_soak: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  a->requests = static_cast<int>(fs.GetInt("requests"));
  a->threads = static_cast<int>(fs.GetInt("threads"));
  a->clients = static_cast<int>(fs.GetInt("clients"));
  a->stream_every = static_cast<int>(fs.GetInt("stream-every"));
  for (auto [flag, out] : {std::pair<const char*, double*>{"tolerance-mib", &a->tolerance_mib},
                           {"cuda-tolerance-mib", &a->cuda_tolerance_mib}}) {
    if (!absl::SimpleAtod(fs.GetString(flag), out) || *out < 0) {
      std::fprintf(stderr, "wprep_memory_soak: --%s=%s is not valid: expected a number of MiB\n", flag,
                   fs.GetString(flag).c_str());
      return 2;
    }
  }
  a->target = fs.GetString("target");
  a->pid = static_cast<pid_t>(fs.GetInt("pid"));
  a->metrics = fs.GetString("metrics");
  a->daemon_args = fs.rest();
  return -1;
}

int main(int argc, char** argv) {
  Args a;
  if (const int rc = ParseArgs(argc, argv, &a); rc >= 0) return rc;
  std::unique_ptr<wprep::testing::Daemon> daemon;
  std::vector<std::string> targets = {a.target};
  Probe probe{a.pid, a.metrics, {"cpu"}, 0, {}, {}};
  if (a.target.empty()) {
    std::string error;
    daemon = wprep::testing::Daemon::Start(a.daemon_args, &error);
    if (daemon == nullptr || !daemon->WaitServing()) {
      std::fprintf(stderr, "wprepd did not start: %s\n", error.c_str());
      return 1;
    }
    targets = {daemon->unix_target(), daemon->tcp_target()};  // two connections
    probe.pid = daemon->pid();
    probe.metrics = daemon->metrics_address();
  }
  std::vector<std::unique_ptr<wprep::client::Client>> owned;
  std::vector<wprep::client::Client*> clients;
  absl::StatusOr<v1::ListDevicesResponse> devs;
  for (int k = 0; k < a.clients; ++k) {  // each on its own connection, connected before the idle sample
    const std::string& t = targets[static_cast<size_t>(k) % targets.size()];
    owned.push_back(std::make_unique<wprep::client::Client>(wprep::client::MakeChannel(t, 256 << 20, k)));
    clients.push_back(owned.back().get());
    devs = clients.back()->ListDevices();
    if (!devs.ok()) {
      std::fprintf(stderr, "ListDevices on %s: %s\n", t.c_str(), devs.status().ToString().c_str());
      return 1;
    }
  }
  for (const v1::DeviceInfo& d : devs->devices()) probe.labels.push_back(absl::StrCat("gpu", d.ordinal()));
  Soak soak(a, clients);
  if (!soak.Setup()) return 1;
  bool ipc = false;
#if WPREP_HAVE_CUDA
  if (!devs->cpu_engine() && wprep::CudaDeviceCount() > 0) {
    cudaDeviceProp prop;
    const std::string uuid = cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? std::string(prop.uuid.bytes, 16) : "";
    ipc = std::any_of(devs->devices().begin(), devs->devices().end(),
                      [&](const v1::DeviceInfo& d) { return d.uuid() == uuid; });
    if (ipc && (cudaSetDevice(0) != cudaSuccess || !soak.SetupIpc(uuid))) return 1;
    probe.gpus = wprep::CudaDeviceCount();
  }
#endif
  std::printf("engine %s, %d requests from %d threads over %d client connections\n",
              devs->cpu_engine() ? "cpu" : "cuda", a.requests, a.threads, a.clients);
  std::printf("IPC requests: %s\n", ipc ? "on (this process's GPU 0)"
                                         : "skipped (no GPU shared with the daemon: only inline bytes and streams)");
  probe.AddRows(a);

  std::this_thread::sleep_for(std::chrono::seconds(1));  // settle after start-up
  const std::vector<double> idle = probe.Sample();
  std::vector<double> peak = idle;  // written by the sampler until it is joined
  std::atomic<bool> stop{false};
  std::thread sampler([&] {
    while (!stop.load()) {
      const std::vector<double> v = probe.Sample();
      for (size_t i = 0; i < v.size(); ++i) peak[i] = std::max(peak[i], v[i]);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const auto t0 = Clock::now();
  const bool outcomes_ok = soak.Run();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  stop.store(true);
  sampler.join();
  std::printf("%d requests in %.1f s: %.0f requests/s, %.1f MiB/s converted (in + out)\n", a.requests, seconds,
              a.requests / seconds, static_cast<double>(soak.bytes()) / kMiB / seconds);

  // The daemon trims its heap and pinned pool 2 s after the last request: wait up to 10 s
  // for every row to come back, first with the clients' connections open, then once they
  // are closed. An open connection keeps the read buffer gRPC grew for its traffic (up
  // to about 5 MiB each, measured; it goes with the connection), so with more than two
  // clients the first host rows allow that much per extra client, and the second must
  // come back within the tolerance.
  std::vector<double> open_tolerance = probe.tolerance;
  for (size_t i = 0; i < (probe.pid > 0 ? 2u : 0u); ++i) {
    open_tolerance[i] += std::max(0, a.clients - 2) * kConnectionMiB * kMiB;
  }
  auto wait_for_idle = [&](const char* when, const std::vector<double>& tolerance) {
    std::vector<double> after;
    std::vector<bool> back;
    const auto wait_start = Clock::now();
    // Not before the trim could have run (2 s after the last request, checked every 1 s).
    std::this_thread::sleep_for(std::chrono::milliseconds(3250));
    for (bool all_back = false; !all_back && Clock::now() - wait_start < std::chrono::seconds(10);) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      after = probe.Sample();
      back.assign(after.size(), false);
      all_back = true;
      for (size_t i = 0; i < after.size(); ++i) {
        back[i] = idle[i] >= 0 && after[i] >= 0 && after[i] - idle[i] <= tolerance[i];
        all_back = all_back && back[i];
      }
    }
    std::printf("%s: waited %.1f s for idle\n%-40s %10s %10s %10s %11s %10s\n", when,
                std::chrono::duration<double>(Clock::now() - wait_start).count(), "MiB", "idle", "peak",
                "after", "after-idle", "tolerance");
    for (size_t i = 0; i < after.size(); ++i) {
      std::printf("%-40s %10.2f %10.2f %10.2f %11.2f %10.2f  %s\n", probe.names[i].c_str(), idle[i] / kMiB,
                  peak[i] / kMiB, after[i] / kMiB, (after[i] - idle[i]) / kMiB, tolerance[i] / kMiB,
                  idle[i] < 0 || after[i] < 0 ? "NOT MEASURED" : back[i] ? "returned" : "DID NOT RETURN");
    }
    return std::all_of(back.begin(), back.end(), [](bool b) { return b; });
  };
  const bool back_open = wait_for_idle("after the load, its connections open", open_tolerance);
  // Closed: every client goes, and one request on a new connection lets the daemon trim
  // again once they have.
  owned.clear();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  auto last = std::make_unique<wprep::client::Client>(wprep::client::MakeChannel(targets[0], 256 << 20, a.clients));
  if (!last->ListDevices().ok()) std::printf("ListDevices after the load failed\n");
  const bool back_closed = wait_for_idle("after the load, its connections closed", probe.tolerance);
  if (probe.pid <= 0) std::printf("(the daemon's host memory was not measured: give --pid with --target)\n");
#if WPREP_HAVE_CUDA
  if (ipc) soak.FreeIpc(*last);  // after the last sample: the soak's own buffers stayed put
#endif
  const bool back = back_open && back_closed;
  const bool pass = outcomes_ok && back;
  {
    // How the load met --max-buffered-bytes: calls timed at the budget (waited or not),
    // their total wait, and those refused (RESOURCE_EXHAUSTED counts as errors above too).
    const std::string text = wprep::testing::HttpGet(probe.metrics, "/metrics");
    auto m = [&](const char* name, std::map<std::string, std::string> labels = {}) {
      return wprep::testing::MetricValue(text, name, labels).value_or(-1);
    };
    std::printf("host budget: %.0f calls timed, %.1f s waited in all, refused timeout=%.0f queue_full=%.0f "
                "too_large=%.0f cancelled=%.0f\n",
                m("wprep_host_buffer_wait_seconds_count"), m("wprep_host_buffer_wait_seconds_sum"),
                m("wprep_host_buffer_refused_total", {{"reason", "timeout"}}),
                m("wprep_host_buffer_refused_total", {{"reason", "queue_full"}}),
                m("wprep_host_buffer_refused_total", {{"reason", "too_large"}}),
                m("wprep_host_buffer_refused_total", {{"reason", "cancelled"}}));
  }
  // One line with the figures, for docs/RELIABILITY.md.
  std::printf("summary requests=%d clients=%d threads=%d seconds=%.1f requests_per_second=%.0f p50_ms=%.2f "
              "p99_ms=%.2f errors=%d peak_rss_mib=%.1f peak_buffered_mib=%.1f\n",
              a.requests, a.clients, a.threads, seconds, a.requests / seconds, soak.p50() * 1e3, soak.p99() * 1e3,
              soak.errors(), probe.pid > 0 ? peak[0] / kMiB : -1.0, peak[probe.pid > 0 ? 2 : 0] / kMiB);
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
