// wprep_loader_bench: what a model loader pays to prepare a gpt-oss-120b-shaped model's
// expert weights for Hopper through wprepd, next to a device copy of the same bytes, in
// one run. Per layer, in checkpoint order (random bytes):
//   w13: values [128, 5760, 1440] (logical [128, 2880, 5760], packing -2) and scales
//        [128, 5760, 90] (passed as the transposed view [128, 90, 5760]);
//   w2:  values [128, 2880, 1440] and scales [128, 2880, 90];
// converted to HopperMXValueLayout(mx_axis=-2, mma_version=3) and
// HopperMXScaleLayout(mx_axis=-2, num_warps=8), IPC -> IPC. Variants: one ConvertBatch per
// layer, one after the other; one per layer with several in flight; one batch for the
// whole model; each answered once its work is done, and again answered as soon as it is
// queued (ConvertBatchRequest.signal_when_done and ANSWER_WHEN_QUEUED: the client's stream waits on the event
// of each answer). Wall time from the first send to the last completion (the last answer,
// or the client's stream done after it waited on every event); the baseline is a
// cudaMemcpyAsync of every input tensor (events, one stream). Layer 0's outputs are
// checked byte for byte against the CPU engine, after the early-answer variants ran last.
//
// Without --target it starts its own wprepd (harness), with each --daemon-arg; its flags:
// wprep_loader_bench --help. Needs a GPU; exits 3 without one.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon_harness.h"
#include "wprep/client/client.h"
#include "wprep/client/cuda_ipc.h"
#include "wprep/flags/flags.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

// What the command line asks for (main parses it).
struct LoaderArgs {
  int layers = 0, inflight = 4, reps = 3;
  std::string target;
  std::vector<std::string> daemon_flags;
};

namespace v1 = wprep::v1;

#if WPREP_HAVE_CUDA

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                    \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// Progress on stderr with the seconds since start: a run cut short still says how far it got.
void Progress(const char* what) {
  static const auto t0 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "[%7.2f s] %s\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), what);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One tensor of a layer: its conversion, its input (checkpoint bytes) and output on the
// GPU, and their IPC handles.
struct Tensor {
  std::string name;
  wprep::ConversionSpec spec;
  std::vector<int64_t> logical_shape;
  std::vector<int64_t> input_strides;  // empty: dense
  wprep::Plan plan;
  void* in = nullptr;
  void* out = nullptr;
  std::string in_handle, out_handle;
};

std::string Handle(void* p) {
  cudaIpcMemHandle_t h;
  CHECK_CUDA(cudaIpcGetMemHandle(&h, p));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::vector<Tensor> LayerTensors() {
  wprep::ConversionSpec values;
  values.layout = wprep::Layout::kHopperValue;
  values.direction = wprep::Direction::kSwizzle;
  values.hopper = {-2, 3};
  values.packing_axis = -2;
  wprep::ConversionSpec scales;
  scales.layout = wprep::Layout::kHopperScale;
  scales.direction = wprep::Direction::kSwizzle;
  scales.hopper_scale = {-2, 8, 2};
  constexpr int64_t kE = 128, kK = 2880;
  std::vector<Tensor> t;
  for (auto [name, n] : {std::pair<const char*, int64_t>{"w13", 5760}, {"w2", 2880}}) {
    Tensor v;
    v.name = absl::StrCat(name, ".values");
    v.spec = values;
    v.logical_shape = {kE, kK, n};
    t.push_back(v);
    // The checkpoint's [E, N, K/32] scales, seen as the transposed [E, K/32, N].
    Tensor s;
    s.name = absl::StrCat(name, ".scales");
    s.spec = scales;
    s.logical_shape = {kE, kK / 32, n};
    s.input_strides = {n * (kK / 32), 1, kK / 32};
    t.push_back(s);
  }
  for (Tensor& x : t) {
    absl::StatusOr<wprep::Plan> p = wprep::MakePlan(x.spec, x.logical_shape, wprep::InputBinding{x.input_strides, {}});
    if (!p.ok()) {
      std::fprintf(stderr, "plan %s: %s\n", x.name.c_str(), p.status().ToString().c_str());
      std::exit(1);
    }
    x.plan = *p;
  }
  return t;
}

v1::CudaIpcBuffer Ipc(const std::string& handle, uint64_t size, const std::string& uuid,
                      const std::vector<int64_t>& strides = {}) {
  v1::CudaIpcBuffer b;
  b.set_handle(handle);
  b.set_size(size);
  b.set_device_uuid(uuid);
  for (int64_t s : strides) b.add_strides(s);
  return b;
}

void AddItems(const std::vector<Tensor>& layer, const std::string& uuid, v1::ConvertBatchRequest* batch) {
  for (const Tensor& x : layer) {
    v1::ConvertItem* ci = batch->add_items()->mutable_convert();
    *ci->mutable_spec() = wprep::SpecToProto(x.spec);
    for (int64_t d : x.logical_shape) ci->add_logical_shape(d);
    *ci->mutable_source()->mutable_ipc() = Ipc(x.in_handle, x.plan.input_bytes, uuid, x.input_strides);
    *ci->mutable_destination()->mutable_ipc() = Ipc(x.out_handle, x.plan.output_bytes, uuid);
  }
}

int Main(const LoaderArgs& args) {
  int layers = args.layers;
  const int inflight = args.inflight, reps = args.reps;
  std::string target = args.target;
  std::vector<std::string> daemon_flags = {"--devices=0"};
  daemon_flags.insert(daemon_flags.end(), args.daemon_flags.begin(), args.daemon_flags.end());
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Progress("start");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no GPU\n");
    return 3;
  }
  CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const std::string uuid(prop.uuid.bytes, 16);
  const std::vector<Tensor> shape = LayerTensors();
  uint64_t layer_in = 0, layer_out = 0;
  for (const Tensor& x : shape) {
    layer_in += x.plan.input_bytes;
    layer_out += x.plan.output_bytes;
  }
  size_t free_bytes = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total));
  const int fit = static_cast<int>((free_bytes - (4ull << 30)) / (layer_in + layer_out));
  if (layers <= 0) layers = std::min(36, fit);
  std::printf("layer: %.3f GB in, %.3f GB out; GPU %s free %.1f GB: %d layers fit, running %d\n", layer_in / 1e9,
              layer_out / 1e9, prop.name, free_bytes / 1e9, fit, layers);

  // Random checkpoint bytes: one host pattern, rotated per layer and tensor.
  std::vector<uint8_t> host(shape[0].plan.input_bytes + 4096);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < host.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&host[i], &x, std::min<size_t>(8, host.size() - i));
  }
  std::vector<std::vector<Tensor>> model(static_cast<size_t>(layers), shape);
  for (int l = 0; l < layers; ++l) {
    for (size_t t = 0; t < model[l].size(); ++t) {
      Tensor& ten = model[l][t];
      CHECK_CUDA(cudaMalloc(&ten.in, ten.plan.input_bytes));
      CHECK_CUDA(cudaMalloc(&ten.out, ten.plan.output_bytes));
      CHECK_CUDA(cudaMemcpy(ten.in, host.data() + (l * 131 + t * 17) % 4096, ten.plan.input_bytes,
                            cudaMemcpyHostToDevice));
      ten.in_handle = Handle(ten.in);
      ten.out_handle = Handle(ten.out);
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  Progress("inputs on the GPU");

  std::unique_ptr<wprep::testing::Daemon> daemon;
  if (target.empty()) {
    std::string error;
    daemon = wprep::testing::Daemon::Start(daemon_flags, &error);
    if (daemon == nullptr || !daemon->WaitServing()) {
      std::fprintf(stderr, "wprepd did not start: %s\n", error.c_str());
      return 1;
    }
    target = daemon->unix_target();
  }
  Progress("daemon serving");
  wprep::client::Client client(target, 2);
  // The loader registers its buffers once.
  v1::RegisterIpcHandlesRequest reg;
  for (const auto& layer : model) {
    for (const Tensor& t : layer) {
      for (const std::string* h : {&t.in_handle, &t.out_handle}) {
        v1::IpcHandleRef* r = reg.add_handles();
        r->set_handle(*h);
        r->set_device_uuid(uuid);
      }
    }
  }
  if (auto r = client.RegisterIpcHandles(reg); !r.ok()) {
    std::fprintf(stderr, "RegisterIpcHandles: %s\n", r.status().ToString().c_str());
    return 1;
  }
  Progress("handles registered");
  std::vector<v1::ConvertBatchRequest> per_layer(static_cast<size_t>(layers));
  v1::ConvertBatchRequest whole;
  for (int l = 0; l < layers; ++l) {
    AddItems(model[l], uuid, &per_layer[l]);
    AddItems(model[l], uuid, &whole);
  }

  // The baseline: a device copy of every input tensor into its output buffer.
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> copy_ms;
  for (int r = 0; r < reps + 1; ++r) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    for (const auto& layer : model) {
      for (const Tensor& t : layer) CHECK_CUDA(cudaMemcpyAsync(t.out, t.in, t.plan.input_bytes, cudaMemcpyDeviceToDevice, stream));
    }
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (r > 0) copy_ms.push_back(ms);
  }

  auto kernel_ms = [](const v1::ConvertBatchResponse& resp) {
    double s = 0;
    for (const v1::BatchItemResult& it : resp.items()) s += it.kernel_seconds();
    return s * 1e3;
  };
  struct Row {
    std::string variant;
    double wall_ms = 0, kernel_ms = 0;
    int failures = 0;
  };
  std::vector<Row> rows;
  std::atomic<uint64_t> peak_extra{0};  // the most extra device memory any batch reported
  Progress("copy baseline timed");
  auto run = [&](const std::string& name, auto body) {
    Progress(name.c_str());
    std::vector<double> wall, kern;
    int failures = 0;
    for (int r = 0; r < reps + 1; ++r) {
      double k = 0;
      const auto t0 = std::chrono::steady_clock::now();
      failures += body(&k);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) {  // the first is a warm-up
        wall.push_back(ms);
        kern.push_back(k);
      }
    }
    rows.push_back({name, Median(wall), Median(kern), failures});
  };
  auto one = [&](const v1::ConvertBatchRequest& b, double* k) -> int {
    absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(b);
    if (!resp.ok()) {
      std::fprintf(stderr, "ConvertBatch: %s\n", resp.status().ToString().c_str());
      return 1;
    }
    *k += kernel_ms(*resp);
    for (uint64_t seen = peak_extra.load(), mine = resp->peak_extra_device_bytes();
         mine > seen && !peak_extra.compare_exchange_weak(seen, mine);) {
    }
    return 0;
  };
  // The early-answer variants: one event per thread of calls, and the client's stream
  // waits on each answer's event; the run ends when that stream is done.
  auto make_events = [](int n, std::vector<wprep::client::CompletionEvent>* out) {
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<wprep::client::CompletionEvent> e = wprep::client::CompletionEvent::Create(0);
      if (!e.ok()) {
        std::fprintf(stderr, "CompletionEvent: %s\n", e.status().ToString().c_str());
        return false;
      }
      out->push_back(*std::move(e));
    }
    return true;
  };
  std::vector<wprep::client::CompletionEvent> events;
  if (!make_events(std::max(1, inflight), &events)) return 1;
  absl::Mutex stream_mu;  // one waiter at a time on the client's stream
  std::vector<double> wait_us;  // host time of each StreamWait call, guarded by stream_mu
  // `b` carries `ev` already.
  auto early = [&](const v1::ConvertBatchRequest& b, const wprep::client::CompletionEvent& ev, double* k) -> int {
    if (one(b, k) != 0) return 1;
    absl::MutexLock lock(&stream_mu);
    const absl::Time t = absl::Now();
    absl::Status s = ev.StreamWait(stream);
    wait_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    if (!s.ok()) std::fprintf(stderr, "StreamWait: %s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  };
  auto finish = [&]() -> int { return cudaStreamSynchronize(stream) == cudaSuccess ? 0 : 1; };
  // Early batches carry the event field: made once, outside the timed runs.
  std::vector<v1::ConvertBatchRequest> per_layer_early = per_layer;
  v1::ConvertBatchRequest whole_early = whole;
  for (auto& b : per_layer_early) events[0].AttachTo(&b);
  events[0].AttachTo(&whole_early);

  // One run per variant; the in-turn ones return their last run's send and answer times.
  auto in_turn = [&](const std::string& name, bool answer_early) {
    std::vector<std::pair<absl::Time, absl::Time>> stamps;
    run(name, [&](double* k) {
      int f = 0;
      stamps.clear();
      for (size_t l = 0; l < per_layer.size(); ++l) {
        const absl::Time sent = absl::Now();
        f += answer_early ? early(per_layer_early[l], events[0], k) : one(per_layer[l], k);
        stamps.emplace_back(sent, absl::Now());
      }
      return f + (answer_early ? finish() : 0);
    });
    return stamps;
  };
  auto in_flight = [&](const std::string& name, bool answer_early) {
    run(name, [&](double* k) {
      std::atomic<int> next{0}, failures{0};
      std::vector<double> ks(static_cast<size_t>(inflight), 0);
      std::vector<std::thread> threads;
      for (int t = 0; t < inflight; ++t) {
        threads.emplace_back([&, t] {
          for (int l; (l = next.fetch_add(1)) < layers;) {
            if (!answer_early) {
              failures += one(per_layer[l], &ks[t]);
              continue;
            }
            v1::ConvertBatchRequest b = per_layer[l];
            events[t].AttachTo(&b);
            failures += early(b, events[t], &ks[t]);
          }
        });
      }
      for (auto& th : threads) th.join();
      for (double v : ks) *k += v;
      return failures.load() + (answer_early ? finish() : 0);
    });
  };
  const std::string in_turn_when_done = "one batch per layer, in turn";
  const std::vector<std::pair<absl::Time, absl::Time>> done_stamps = in_turn(in_turn_when_done, false);
  // Where a layer's round trip goes: the way in (send to the handler's start), the
  // handler, the way out (its end to the answer), from the daemon's request log. Read
  // now: the log holds the latest calls.
  std::vector<std::string> splits;
  auto split = [&](const std::vector<std::pair<absl::Time, absl::Time>>& stamps, const std::string& name) {
    if (daemon == nullptr || stamps.empty()) return;
    std::vector<wprep::testing::HandlerSpan> spans = wprep::testing::RequestSpans(daemon->Log(), "ConvertBatch");
    if (spans.size() < stamps.size()) return;
    spans.erase(spans.begin(), spans.end() - static_cast<std::ptrdiff_t>(stamps.size()));
    std::vector<double> in_us, handler_us, out_us;
    for (size_t i = 0; i < stamps.size(); ++i) {
      in_us.push_back(spans[i].InMicros(stamps[i].first));
      handler_us.push_back(spans[i].seconds * 1e6);
      out_us.push_back(spans[i].OutMicros(stamps[i].second));
    }
    splits.push_back(absl::StrFormat("%s: median per layer %.0f us in, %.0f us handler, %.0f us out", name,
                                     Median(in_us), Median(handler_us), Median(out_us)));
  };
  split(done_stamps, in_turn_when_done);
  in_flight(absl::StrCat("one batch per layer, ", inflight, " in flight"), false);
  run("one batch for the whole model", [&](double* k) { return one(whole, k); });
  const std::string in_turn_when_queued = "one batch per layer, in turn, answered when queued";
  split(in_turn(in_turn_when_queued, true), in_turn_when_queued);
  {
    std::vector<double> w = wait_us;
    std::sort(w.begin(), w.end());
    if (!w.empty()) {
      splits.push_back(absl::StrFormat("StreamWait host time, in-turn early runs: median %.1f us, max %.1f us",
                                       w[w.size() / 2], w.back()));
    }
  }
  // The same calls, each with its own event, the client waiting on the host for every event
  // at the end instead of ordering its stream after each (a loader that needs the whole
  // model before use).
  std::vector<v1::ConvertBatchRequest> per_layer_own_event = per_layer;
  std::vector<wprep::client::CompletionEvent> layer_events;
  if (!make_events(layers, &layer_events)) return 1;
  for (int l = 0; l < layers; ++l) layer_events[l].AttachTo(&per_layer_own_event[l]);
  run("one batch per layer, in turn, answered when queued, host waits at the end", [&](double* k) {
    int f = 0;
    for (const auto& b : per_layer_own_event) f += one(b, k);
    for (const auto& e : layer_events) f += e.Synchronize().ok() ? 0 : 1;
    return f;
  });
  in_flight(absl::StrCat("one batch per layer, ", inflight, " in flight, answered when queued"), true);
  run("one batch for the whole model, answered when queued", [&](double* k) {
    return early(whole_early, events[0], k) + finish();
  });

  // Layer 0, byte for byte against the CPU engine.
  Progress("checking layer 0");
  int mismatches = 0;
  for (const Tensor& t : model[0]) {
    std::vector<uint8_t> in(t.plan.input_bytes), got(t.plan.output_bytes), want(t.plan.output_bytes);
    CHECK_CUDA(cudaMemcpy(in.data(), t.in, in.size(), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got.data(), t.out, got.size(), cudaMemcpyDeviceToHost));
    absl::Status s = wprep::ConvertOnCpu(t.plan, in.data(), in.size(), want.data(), want.size());
    if (!s.ok() || got != want) {
      ++mismatches;
      std::printf("MISMATCH %s: %s\n", t.name.c_str(), s.ok() ? "bytes differ" : s.ToString().c_str());
    }
  }
  const double copy = Median(copy_ms);
  std::printf("\n%d layers, %.1f GB in, %.1f GB out, reps %d (median; first run dropped)\n", layers,
              layers * layer_in / 1e9, layers * layer_out / 1e9, reps);
  std::printf("| variant | wall ms | device copy ms | wall / copy | sum of kernel ms | failures |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.2f | %.2f | %.3f | %.2f | %d |\n", r.variant.c_str(), r.wall_ms, copy, r.wall_ms / copy,
                r.kernel_ms, r.failures);
  }
  for (const std::string& line : splits) std::printf("%s\n", line.c_str());
  std::printf("(answered when queued: the answers carry no kernel times)\n");
  std::printf("extra device bytes, the most any batch reported: %llu\n",
              static_cast<unsigned long long>(peak_extra.load()));
  std::printf("layer 0 checked against the CPU engine: %s\n", mismatches == 0 ? "byte exact" : "MISMATCH");
  for (const auto& layer : model) {
    for (const Tensor& t : layer) {
      cudaFree(t.in);
      cudaFree(t.out);
    }
  }
  return mismatches == 0 ? 0 : 1;
}

#else

int Main(const LoaderArgs&) {
  std::printf("no GPU (built without CUDA)\n");
  return 3;
}

#endif

}  // namespace

int main(int argc, char** argv) {
  wprep::flags::FlagSet fs("wprep_loader_bench",
                           "usage: wprep_loader_bench [flags]\n"
                           "A gpt-oss-120b-shaped model's expert weights prepared for Hopper through wprepd,\n"
                           "next to a device copy of the same bytes. Needs a GPU; exits 3 without one.\n");
  fs.Int("layers", "N", 0, "layers to prepare; 0 = as many as fit on the GPU, at most 36", 0, 1 << 20);
  fs.Int("inflight", "K", 4, "batches in flight in the several-in-flight variant", 1, 1 << 10);
  fs.Int("reps", "R", 3, "timed repetitions of each variant (after one untimed)", 0, 1 << 20);
  fs.String("target", "ADDR", "", "a running wprepd (unix:///... or HOST:PORT); without it the bench "
                                  "starts its own");
  fs.String("daemon-arg", "FLAG", "", "a flag for the wprepd the bench starts; repeatable").Repeatable();
  if (absl::Status s = fs.Parse(std::vector<std::string>(argv + 1, argv + argc)); !s.ok()) {
    std::fprintf(stderr, "wprep_loader_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  LoaderArgs args;
  args.layers = static_cast<int>(fs.GetInt("layers"));
  args.inflight = static_cast<int>(fs.GetInt("inflight"));
  args.reps = static_cast<int>(fs.GetInt("reps"));
  args.target = fs.GetString("target");
  args.daemon_flags = fs.GetList("daemon-arg");
  return Main(args);
}
