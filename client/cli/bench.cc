#include "bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <latch>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench_ipc.h"
#include "checkpoint.h"
#include "flags.h"
#include "inspect.h"
#include "local_convert.h"
#include "safetensors.h"
#include "wprep/client/batch.h"
#include "wprep/client/client.h"

namespace wprep::cli {

namespace {

namespace v1 = wprep::v1;
using Clock = std::chrono::steady_clock;

enum class Mode { kUnary, kStream, kBatch, kIpc };

absl::StatusOr<Mode> ParseMode(absl::string_view m) {
  if (m == "unary") return Mode::kUnary;
  if (m == "stream") return Mode::kStream;
  if (m == "batch") return Mode::kBatch;
  if (m == "ipc") return Mode::kIpc;
  return absl::InvalidArgumentError(absl::StrCat("--modes takes unary, stream, batch and ipc, got '", m, "'"));
}

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kUnary: return "unary";
    case Mode::kStream: return "stream";
    case Mode::kBatch: return "batch";
    case Mode::kIpc: return "ipc";
  }
  return "?";
}

// Bytes that do not compress or repeat: splitmix64.
std::vector<uint8_t> RandomBytes(uint64_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  uint64_t state = seed;
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (uint64_t b = 0; b < 8 && i + b < n; ++b) out[i + b] = static_cast<uint8_t>(z >> (8 * b));
  }
  return out;
}

struct Row {
  std::vector<double> latency_ms;
  double wall_s = 0;
  uint64_t bytes = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::min(v.size(), std::max<size_t>(rank, 1)) - 1];
}

struct Settings {
  std::string target;
  int requests = 20, warmup = 2, batch_items = 8;
};

// What one worker sends for item `i`, with what it needs between requests.
class Worker {
 public:
  Worker(const Settings& s, Mode mode, const std::vector<BenchItem>& items)
      : mode_(mode), items_(items), client_(s.target, 1), batch_items_(s.batch_items) {}

  absl::Status Prepare() {
    if (mode_ == Mode::kIpc) {
      absl::StatusOr<std::unique_ptr<IpcBench>> ipc = IpcBench::Make(items_);
      if (!ipc.ok()) return ipc.status();
      ipc_ = *std::move(ipc);
    }
    if (mode_ == Mode::kBatch) {
      for (const BenchItem& item : items_) {
        client::BatchBuilder b;
        for (int k = 0; k < batch_items_; ++k) {
          b.AddInline(client::TensorConversion{item.spec, item.logical_shape, item.input_strides}, item.input);
        }
        batches_.push_back(b.Take());
      }
    }
    return absl::OkStatus();
  }

  // One request; the input bytes it converted.
  absl::StatusOr<uint64_t> Run(size_t i) {
    const BenchItem& item = items_[i % items_.size()];
    switch (mode_) {
      case Mode::kUnary: {
        v1::ConvertRequest r;
        *r.mutable_spec() = SpecToProto(item.spec);
        for (int64_t d : item.logical_shape) r.add_logical_shape(d);
        for (int64_t s : item.input_strides) r.add_source_strides(s);
        r.set_source_bytes(item.input.data(), item.input.size());
        absl::StatusOr<v1::ConvertResponse> resp = client_.Convert(r);
        if (!resp.ok()) return resp.status();
        return item.input.size();
      }
      case Mode::kStream: {
        v1::StreamRequestHeader h;
        *h.mutable_spec() = SpecToProto(item.spec);
        for (int64_t d : item.logical_shape) h.add_logical_shape(d);
        client::StreamOptions o;
        o.chunk_bytes = 4u << 20;
        o.stripe_min_bytes = UINT64_MAX;  // one connection per worker; concurrency is the knob
        absl::StatusOr<v1::StreamResponseHeader> resp = client_.ConvertStream(h, item.input, &out_, o);
        if (!resp.ok()) return resp.status();
        return item.input.size();
      }
      case Mode::kBatch: {
        absl::StatusOr<v1::ConvertBatchResponse> resp = client_.ConvertBatch(batches_[i % batches_.size()]);
        if (!resp.ok()) return resp.status();
        return item.input.size() * static_cast<uint64_t>(batch_items_);
      }
      case Mode::kIpc: {
        if (absl::Status s = ipc_->Convert(client_, i); !s.ok()) return s;
        return item.input.size();
      }
    }
    return absl::InternalError("unknown mode");
  }

  void Finish() {
    if (ipc_) ipc_->Release(client_);
  }

 private:
  const Mode mode_;
  const std::vector<BenchItem>& items_;
  client::Client client_;
  const int batch_items_;
  std::string out_;
  std::vector<v1::ConvertBatchRequest> batches_;
  std::unique_ptr<IpcBench> ipc_;
};

// `requests` timed requests over the items by `concurrency` workers, after each worker's
// warm-up; the wall time runs from the moment all are warm to the last answer.
absl::StatusOr<Row> RunRow(const Settings& s, Mode mode, const std::vector<BenchItem>& items, int concurrency,
                           int requests) {
  std::vector<std::unique_ptr<Worker>> workers;
  for (int w = 0; w < concurrency; ++w) {
    workers.push_back(std::make_unique<Worker>(s, mode, items));
    if (absl::Status st = workers.back()->Prepare(); !st.ok()) return st;
  }
  Row row;
  absl::Mutex mu;
  absl::Status error;
  std::atomic<int> next{0};
  std::atomic<uint64_t> bytes{0};
  std::latch warm(concurrency + 1), go(1);
  std::vector<std::vector<double>> latencies(static_cast<size_t>(concurrency));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(concurrency));
  for (int w = 0; w < concurrency; ++w) {
    threads.emplace_back([&, w] {
      Worker& worker = *workers[static_cast<size_t>(w)];
      absl::Status st;
      for (int i = 0; i < s.warmup && st.ok(); ++i) st = worker.Run(static_cast<size_t>(w) + static_cast<size_t>(i)).status();
      warm.count_down();
      go.wait();
      for (int i = next.fetch_add(1); st.ok() && i < requests; i = next.fetch_add(1)) {
        const Clock::time_point t0 = Clock::now();
        absl::StatusOr<uint64_t> n = worker.Run(static_cast<size_t>(i));
        if (!n.ok()) {
          st = n.status();
          break;
        }
        latencies[static_cast<size_t>(w)].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        bytes.fetch_add(*n);
      }
      if (!st.ok()) {
        absl::MutexLock lock(&mu);
        if (error.ok()) error = st;
        next.store(requests);
      }
    });
  }
  warm.arrive_and_wait();
  const Clock::time_point start = Clock::now();
  go.count_down();
  for (std::thread& t : threads) t.join();
  row.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& w : workers) w->Finish();
  if (!error.ok()) return error;
  for (const auto& l : latencies) row.latency_ms.insert(row.latency_ms.end(), l.begin(), l.end());
  row.bytes = bytes.load();
  return row;
}

void PrintHeader() {
  std::printf("%-7s %-26s %-34s %5s %6s %9s %9s %9s %9s\n", "mode", "layout", "shape", "conc", "reqs", "p50_ms",
              "p90_ms", "p99_ms", "GB/s");
}

void PrintRow(Mode mode, const std::string& layout, const std::string& shape, int conc, const Row& r) {
  std::printf("%-7s %-26s %-34s %5d %6zu %9.3f %9.3f %9.3f %9.3f\n", ModeName(mode), layout.c_str(), shape.c_str(),
              conc, r.latency_ms.size(), Percentile(r.latency_ms, 0.50), Percentile(r.latency_ms, 0.90),
              Percentile(r.latency_ms, 0.99), r.wall_s > 0 ? static_cast<double>(r.bytes) / r.wall_s / 1e9 : 0.0);
  std::fflush(stdout);
}

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view s) {
  std::vector<int64_t> out;
  for (absl::string_view d : absl::StrSplit(s, 'x')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(d, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--shapes takes shapes like 4x2880x2880, got '", s, "'"));
    }
    out.push_back(v);
  }
  return out;
}

// The items of `--safetensors FILE`: every MXFP4 tensor, in the file's order.
absl::Status CheckpointItems(const std::string& path, const ConversionSpec& values, const ConversionSpec& scales,
                             std::vector<uint8_t>* file, std::vector<BenchItem>* items) {
  absl::StatusOr<std::vector<uint8_t>> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  *file = *std::move(bytes);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(*file, file->size());
  if (!h.ok()) {
    return absl::Status(h.status().code(),
                        absl::StrCat("'", path, "' is not a valid safetensors file: ", h.status().message()));
  }
  std::vector<const SafetensorsTensor*> all;
  for (const SafetensorsTensor& t : h->tensors) all.push_back(&t);
  absl::StatusOr<std::vector<Mxfp4Tensor>> found = FindMxfp4Tensors(all, values, scales);
  if (!found.ok()) return found.status();
  for (const Mxfp4Tensor& m : *found) {
    const SafetensorsTensor& t = *all[m.index];
    BenchItem item;
    item.name = t.name;
    item.spec = m.conversion.spec;
    // A stream carries dense bytes: the scales go as the tensor they are stored as.
    item.logical_shape = m.values ? m.conversion.logical_shape : t.shape;
    item.input = absl::MakeConstSpan(*file).subspan(h->data_offset() + t.begin, t.bytes());
    items->push_back(std::move(item));
  }
  if (items->empty()) return absl::FailedPreconditionError(absl::StrCat("'", path, "' holds no MXFP4 tensors"));
  return absl::OkStatus();
}

// `wprep bench`'s flags: the parser and --help.
flags::FlagSet BenchFlags() {
  flags::FlagSet fs = CommandFlags(
      "bench",
      "usage: wprep bench [flags]\n"
      "Prints one row per mode, layout, shape and concurrency: the latency percentiles of the\n"
      "timed requests and GB/s, the input bytes they converted per second of wall time.\n");
  fs.String("target", "ADDR", "unix:///tmp/wprepd.sock", "the daemon: unix:///path.sock or HOST:PORT");
  fs.String("modes", "M,...", "unary,stream",
            "transports: unary (Convert with inline bytes), stream (ConvertStream), batch "
            "(ConvertBatch of --batch-items items), ipc (Convert IPC -> IPC; needs CUDA in this "
            "build and a GPU)");
  fs.String("layouts", "L,...", "hopper_value", "layouts to time");
  fs.String("direction", "D", "swizzle", "swizzle, unswizzle or retile");
  fs.String("shapes", "S,...", "2880x2880", "logical shapes, dims joined by x: 2880x2880,4x2880x2880");
  fs.String("concurrency", "N,...", "1", "requests in flight, each on its own connection");
  fs.String("requests", "N", "20", "timed requests per row (with --safetensors: the number of tensors)");
  fs.String("warmup", "N", "2", "untimed requests per connection first (with --safetensors: 0)");
  fs.String("batch-items", "N", "8", "items per ConvertBatch");
  AddSpecFlags(&fs);
  fs.String("safetensors", "FILE", "",
            "instead of --shapes: every MXFP4 tensor of a checkpoint, its bytes read into memory "
            "first, one ConvertStream each (values as convert-safetensors converts them, scales as "
            "their dense [..., N, K/32] tensor); --layouts names the value layout");
  fs.String("scale-layout", "L", "", "with --safetensors: the scales' layout (default: the value layout's)");
  return fs;
}

int Bench(const std::vector<std::string>& args) {
  const flags::FlagSet declared = BenchFlags();
  absl::StatusOr<Flags> flags = Flags::Parse(args, declared);
  if (!flags.ok()) return FailLine(flags.status());
  // A flag's value, else its declared default.
  auto text = [&](const char* name) {
    const std::string* v = flags->Get(name);
    return v != nullptr ? *v : declared.GetString(absl::string_view(name).substr(2));
  };
  Settings s;
  s.target = text("--target");
  std::vector<Mode> modes;
  for (absl::string_view m : absl::StrSplit(text("--modes"), ',')) {
    absl::StatusOr<Mode> mode = ParseMode(m);
    if (!mode.ok()) return FailLine(mode.status());
    modes.push_back(*mode);
  }
  absl::StatusOr<Direction> direction = ParseDirection(text("--direction"));
  if (!direction.ok()) return FailLine(direction.status());
  std::vector<ConversionSpec> specs;
  for (absl::string_view l : absl::StrSplit(text("--layouts"), ',')) {
    absl::StatusOr<Layout> layout = ParseLayout(std::string(l));
    if (!layout.ok()) return FailLine(layout.status());
    absl::StatusOr<ConversionSpec> spec = ParseSpecFlags(*flags, *layout, *direction);
    if (!spec.ok()) return FailLine(spec.status());
    specs.push_back(*spec);
  }
  absl::StatusOr<std::vector<int64_t>> conc = ParseIntList("--concurrency", text("--concurrency"));
  if (!conc.ok()) return FailLine(conc.status());
  for (int64_t c : *conc) {
    if (c < 1 || c > 256) return FailLine(absl::InvalidArgumentError(absl::StrCat("--concurrency must be in [1, 256], got ", c)));
  }
  absl::StatusOr<int64_t> requests = flags->Int("--requests", 20);
  absl::StatusOr<int64_t> warmup = flags->Int("--warmup", 2);
  absl::StatusOr<int64_t> batch_items = flags->Int("--batch-items", 8);
  for (const auto* v : {&requests, &warmup, &batch_items}) {
    if (!v->ok()) return FailLine(v->status());
  }
  if (*requests < 1 || *warmup < 0 || *batch_items < 1 || *requests > 1000000 || *warmup > 10000 || *batch_items > 4096) {
    return FailLine(absl::InvalidArgumentError("--requests and --batch-items must be at least 1, --warmup at least 0"));
  }
  s.requests = static_cast<int>(*requests);
  s.warmup = static_cast<int>(*warmup);
  s.batch_items = static_cast<int>(*batch_items);

  client::Client probe(s.target, 1);
  client::CallOptions probe_options;
  probe_options.timeout = std::chrono::seconds(10);
  if (absl::StatusOr<v1::ListDevicesResponse> d = probe.ListDevices(probe_options); !d.ok()) {
    return FailLine(absl::Status(d.status().code(), absl::StrCat("no wprepd answers at ", s.target, ": ",
                                                                d.status().message())));
  }

  // Each row's items: synthetic shapes, or the checkpoint's tensors.
  struct Set {
    std::string layout, shape;
    std::vector<BenchItem> items;
  };
  std::vector<Set> sets;
  std::vector<std::vector<uint8_t>> buffers;
  if (const std::string* path = flags->Get("--safetensors")) {
    if (flags->Has("--shapes")) return FailLine(absl::InvalidArgumentError("give --shapes or --safetensors, not both"));
    if (specs.size() != 1 || !IsValueLayout(specs[0].layout)) {
      return FailLine(absl::InvalidArgumentError("with --safetensors, --layouts names one value layout"));
    }
    for (Mode m : modes) {
      if (m != Mode::kStream) return FailLine(absl::InvalidArgumentError("--safetensors runs --modes stream only"));
    }
    Layout scale = specs[0].layout == Layout::kHopperValue ? Layout::kHopperScale : Layout::kBlackwellScale;
    if (const std::string* sl = flags->Get("--scale-layout")) {
      absl::StatusOr<Layout> l = ParseLayout(*sl);
      if (!l.ok()) return FailLine(l.status());
      scale = *l;
    }
    absl::StatusOr<ConversionSpec> scales = ParseSpecFlags(*flags, scale, Direction::kSwizzle);
    if (!scales.ok()) return FailLine(scales.status());
    Set set;
    set.layout = std::string(LayoutName(specs[0].layout));
    buffers.emplace_back();
    if (absl::Status st = CheckpointItems(*path, specs[0], *scales, &buffers.back(), &set.items); !st.ok()) {
      return FailLine(st);
    }
    uint64_t total = 0;
    for (const BenchItem& i : set.items) total += i.input.size();
    set.shape = absl::StrCat(set.items.size(), "tensors/", total, "B");
    if (!flags->Has("--requests")) s.requests = static_cast<int>(set.items.size());
    if (!flags->Has("--warmup")) s.warmup = 0;
    sets.push_back(std::move(set));
  } else {
    std::vector<std::vector<int64_t>> shapes;
    for (absl::string_view sh : absl::StrSplit(text("--shapes"), ',')) {
      absl::StatusOr<std::vector<int64_t>> shape = ParseShape(sh);
      if (!shape.ok()) return FailLine(shape.status());
      shapes.push_back(*shape);
    }
    for (const ConversionSpec& spec : specs) {
      for (const std::vector<int64_t>& shape : shapes) {
        v1::PlanRequest req;
        *req.mutable_spec() = SpecToProto(spec);
        for (int64_t d : shape) req.add_logical_shape(d);
        absl::StatusOr<v1::PlanResponse> plan = probe.Plan(req, probe_options);
        if (!plan.ok()) return FailLine(plan.status());
        buffers.push_back(RandomBytes(plan->input_bytes(), buffers.size() + 1));
        BenchItem item;
        item.name = absl::StrJoin(shape, "x");
        item.spec = spec;
        item.logical_shape = shape;
        item.input = buffers.back();
        item.output_bytes = plan->output_bytes();
        sets.push_back(Set{std::string(LayoutName(spec.layout)), item.name, {item}});
      }
    }
  }

  std::printf("# wprep bench against %s: %d timed requests per row after %d per connection; "
              "GB/s = input bytes / wall time\n", s.target.c_str(), s.requests, s.warmup);
  PrintHeader();
  for (Mode mode : modes) {
    for (Set& set : sets) {
      for (int64_t c : *conc) {
        absl::StatusOr<Row> row = RunRow(s, mode, set.items, static_cast<int>(c), s.requests);
        if (!row.ok()) {
          return FailLine(absl::Status(row.status().code(), absl::StrCat(ModeName(mode), " ", set.layout, " ",
                                                                         set.shape, ": ", row.status().message())));
        }
        PrintRow(mode, set.layout, set.shape, static_cast<int>(c), *row);
      }
    }
  }
  return 0;
}

}  // namespace

int BenchCommand(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(BenchFlags().Usage().c_str(), stdout);
      return 0;
    }
  }
  client::TuneHeapForStreaming();
  return Bench(args);
}

}  // namespace wprep::cli
