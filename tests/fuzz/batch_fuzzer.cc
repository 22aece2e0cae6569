// libFuzzer target: ConvertBatch over arbitrary protobuf bytes. The input is the wire
// form of a ConvertBatchRequest, parsed as gRPC would; it goes through what the handler
// runs before any work (BatchJobsFromProto, which translates each item's spec and plans
// it, and CheckTensorBytes), then, for batches of at most 1 MiB, through the daemon's
// executor on one fake GPU (fake_runtime.h: its device memory is exactly sized heap
// memory, so ASan sees any staging copy or conversion past a buffer), with two IPC
// allocations exported on it (wprep_fuzz_seeds' batches name them). Checks:
// - refusals are INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never another code, from the
//   edge and from the executor alike;
// - one job per item, each item's spec as SpecFromProto reads it, each plan passing
//   CheckPlan; an inline source holds exactly the plan's input bytes (or, with
//   inline_strides, a view inside them); an IPC destination holds the output; the inline
//   outputs together fit --max-message-bytes; a request's device_uuid reaches every job;
// - every inline output, and the IPC output of an item whose destination no other item
//   shares, is the CPU engine's conversion of that item's source (the CPU engine is held
//   to the reference vectors elsewhere; here the batch path around it is under test);
// - afterwards the fake GPU holds no device memory.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "device/device_manager.h"
#include "exec/executor.h"
#include "fake_runtime.h"
#include "fuzz_support.h"
#include "device/ipc_cache.h"
#include "net/metrics.h"
#include "proto_mutator.h"
#include "rpc/proto_translate.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/server/options.h"

namespace {

namespace v1 = wprep::v1;
using wprep::fuzz::CheckPlan;
using wprep::testing::FakeRuntime;

constexpr int64_t kMaxMessageBytes = 64ll << 20;  // the daemon's defaults
constexpr uint64_t kMaxTensorBytes = 64ull << 30;
constexpr uint64_t kRunBatchBytes = 1 << 20;      // inputs and outputs of a batch that runs
constexpr uint64_t kIpcBytes = 256 << 10;         // each exported allocation

// One fake GPU and the daemon's device parts on it, for every input.
struct Gpu {
  Gpu() : runtime(1) {
    src = runtime.ExportHandle(0, kIpcBytes);  // handle id 1 (FakeRuntime numbers them)
    dst = runtime.ExportHandle(0, kIpcBytes);  // handle id 2
    const std::vector<uint8_t> p = wprep::fuzz::Pattern(kIpcBytes, 5);
    std::memcpy(src.ptr, p.data(), p.size());
    metrics = *wprep::server::Metrics::Create("", true);
    wprep::server::Options o;
    o.memory_wait = absl::Milliseconds(10);
    devices = *wprep::server::DeviceManager::Create(o, &runtime, metrics.get());
  }
  FakeRuntime runtime;
  FakeRuntime::Exported src, dst;
  std::unique_ptr<wprep::server::Metrics> metrics;
  std::unique_ptr<wprep::server::DeviceManager> devices;
};

Gpu& TheGpu() {
  static Gpu* const gpu = new Gpu();
  return *gpu;
}

absl::Span<const int64_t> Shape(const google::protobuf::RepeatedField<int64_t>& f) {
  return absl::MakeConstSpan(f.data(), static_cast<size_t>(f.size()));
}

void CheckRefusal(const absl::Status& s, const char* stage) {
  WPREP_FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kResourceExhausted,
                   "%s refused with %s", stage, s.ToString().c_str());
}

// The bytes of an IPC region of one of the exported allocations at `base`, or nullptr
// when it reaches past the allocation.
const uint8_t* Region(const wprep::server::IpcRegion& r, uint8_t* base) {
  return r.offset > kIpcBytes || r.size > kIpcBytes - r.offset ? nullptr : base + r.offset;
}

}  // namespace

int wprep::fuzz::FuzzBatch(const uint8_t* data, size_t size) {
  v1::ConvertBatchRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(std::min<size_t>(size, 1 << 30)))) return 0;
  absl::StatusOr<std::vector<server::ConvertJob>> jobs =
      server::BatchJobsFromProto(req, server::BatchLimits{kMaxMessageBytes, 4096});
  if (!jobs.ok()) {
    CheckRefusal(jobs.status(), "BatchJobsFromProto");
    return 0;
  }
  WPREP_FUZZ_CHECK(jobs->size() == static_cast<size_t>(req.items_size()), "%zu jobs for %d items", jobs->size(),
                   req.items_size());
  uint64_t inline_out = 0, total = 0;
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::ConvertItem& item = req.items(i).convert();
    const server::ConvertJob& job = (*jobs)[static_cast<size_t>(i)];
    absl::StatusOr<ConversionSpec> spec = SpecFromProto(item.spec(), "spec");
    WPREP_FUZZ_CHECK(spec.ok() && Describe(*spec) == Describe(job.plan.spec), "item %d: the job's spec is not the item's", i);
    CheckPlan(job.plan, Shape(item.logical_shape()));
    if (job.source_ipc) {
      WPREP_FUZZ_CHECK(job.plan.input_bytes <= job.source_ipc->size, "item %d: view outside its IPC source", i);
    } else if (item.source().inline_strides_size() == 0) {
      WPREP_FUZZ_CHECK(job.source_bytes.size() == job.plan.input_bytes, "item %d: %zu inline bytes, plan needs %llu", i,
                       job.source_bytes.size(), static_cast<unsigned long long>(job.plan.input_bytes));
    } else {
      WPREP_FUZZ_CHECK(job.plan.input_bytes <= job.source_bytes.size(), "item %d: view outside its inline bytes", i);
    }
    if (job.destination_ipc) {
      WPREP_FUZZ_CHECK(job.destination_ipc->size >= job.plan.output_bytes, "item %d: destination too small", i);
    } else {
      inline_out += job.plan.output_bytes;
    }
    WPREP_FUZZ_CHECK(req.device_uuid().empty() || job.gpu.has_value(), "item %d lost the request's device_uuid", i);
    const absl::Status t = server::CheckTensorBytes(job.plan, kMaxTensorBytes);
    if (!t.ok()) return 0;
    total += job.plan.input_bytes + job.plan.output_bytes;
  }
  WPREP_FUZZ_CHECK(inline_out <= static_cast<uint64_t>(kMaxMessageBytes), "inline outputs of %llu bytes accepted",
                   static_cast<unsigned long long>(inline_out));
  if (total > kRunBatchBytes) return 0;

  Gpu& gpu = TheGpu();
  server::IpcCache ipc(&gpu.runtime, 8, absl::Minutes(5), gpu.metrics.get());
  server::Executor executor(gpu.devices.get(), &ipc, server::StreamSlicing{1 << 20, 256ull << 20},
                            absl::Milliseconds(10));
  std::fill(gpu.dst.ptr, gpu.dst.ptr + kIpcBytes, 0xA5);
  std::vector<std::string> outputs(jobs->size());
  std::vector<std::string*> inline_outputs;
  for (std::string& o : outputs) inline_outputs.push_back(&o);
  absl::StatusOr<server::Executor::BatchOutcome> r =
      executor.ConvertBatch(*jobs, inline_outputs, absl::InfiniteFuture());
  WPREP_FUZZ_CHECK(gpu.runtime.totals().device_bytes_now == 0, "the batch left %llu device bytes allocated",
                   static_cast<unsigned long long>(gpu.runtime.totals().device_bytes_now));
  if (!r.ok()) {
    CheckRefusal(r.status(), "Executor::ConvertBatch");
    return 0;
  }
  WPREP_FUZZ_CHECK(r->outcomes.size() == jobs->size(), "%zu outcomes for %zu jobs", r->outcomes.size(), jobs->size());
  std::map<std::string, int> writers;  // destination handle -> items writing it
  for (const server::ConvertJob& job : *jobs) {
    if (job.destination_ipc) ++writers[job.destination_ipc->handle];
  }
  for (size_t i = 0; i < jobs->size(); ++i) {
    const server::ConvertJob& job = (*jobs)[i];
    const uint8_t* in = reinterpret_cast<const uint8_t*>(job.source_bytes.data());
    uint64_t in_size = job.source_bytes.size();
    if (job.source_ipc) {
      // Only the source allocation, and only while no item of the batch writes into it.
      if (job.source_ipc->handle != gpu.src.handle || writers.count(gpu.src.handle) != 0) continue;
      in = Region(*job.source_ipc, gpu.src.ptr);
      in_size = job.source_ipc->size;
      if (in == nullptr) continue;
    }
    const uint8_t* got = reinterpret_cast<const uint8_t*>(outputs[i].data());
    if (job.destination_ipc) {
      if (writers[job.destination_ipc->handle] != 1 || job.destination_ipc->handle != gpu.dst.handle) continue;
      got = Region(*job.destination_ipc, gpu.dst.ptr);
      if (got == nullptr) continue;
    } else {
      WPREP_FUZZ_CHECK(outputs[i].size() == job.plan.output_bytes, "item %zu: %zu inline output bytes, expected %llu", i,
                       outputs[i].size(), static_cast<unsigned long long>(job.plan.output_bytes));
    }
    std::vector<uint8_t> want(job.plan.output_bytes);
    const absl::Status s = ConvertOnCpu(job.plan, in, in_size, want.data(), want.size(), CpuOptions{1});
    WPREP_FUZZ_CHECK(s.ok(), "item %zu: %s", i, s.ToString().c_str());
    WPREP_FUZZ_CHECK(want.empty() || std::memcmp(got, want.data(), want.size()) == 0,
                     "item %zu (%s): the batch's output differs from the CPU engine's", i,
                     Describe(job.plan.spec).c_str());
  }
  return 0;
}

#ifndef WPREP_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return wprep::fuzz::FuzzBatch(data, size); }

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Structure-aware: three times in four the batch is parsed, edited field by field
// (proto_mutator.h: item count, each item's spec, shape, strides, sources) and written
// back; otherwise libFuzzer's byte mutations.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::minstd_rand rng(seed);
  if (rng() % 4 == 0) return LLVMFuzzerMutate(data, size, max_size);
  v1::ConvertBatchRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(std::min<size_t>(size, 1 << 30)))) req.Clear();
  wprep::fuzz::MutateMessage(&req, rng);
  const std::string wire = req.SerializeAsString();
  if (wire.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, wire.data(), wire.size());
  return wire.size();
}
#endif
