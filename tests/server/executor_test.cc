// Host-only tests of the executor's routing and the device-run layer, driven through the
// fake GPUs of FakeRuntime: which engine runs a job, what it reads and writes, what device
// memory it holds, and the operand its errors name. Expected bytes come from the
// reference vectors, never from the engine.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "device/completions.h"
#include "device/device_manager.h"
#include "exec/executor.h"
#include "fake_runtime.h"
#include "golden.h"
#include "golden_rpc.h"
#include "gtest/gtest.h"
#include "device/ipc_cache.h"
#include "net/metrics.h"
#include "exec/operand_error.h"
#include "shm_file.h"
#include "device/host_words.h"
#include "wprep/server/options.h"

namespace wprep::testing {
namespace {

using server::ConvertJob;
using server::ConvertOutcome;
using server::DeviceManager;
using server::Executor;
using server::IpcCache;
using server::IpcRegion;
using server::Metrics;
using server::Operand;

// A golden case with its stored output, of a few KiB.
// A batch's fences as the edge fills them: a client's event on fake GPU `gpu`, a word of
// GPU memory or of a /dev/shm file and its value; answered once queued when signalling.
server::FenceRef EventFence(std::string handle, int gpu) {
  server::FenceRef f;
  f.event = server::FenceRef::EventRef{std::move(handle), FakeRuntime::FakeUuid(gpu)};
  return f;
}
server::FenceRef::WordRef GpuWord(const IpcRegion& region, uint32_t value) {
  server::FenceRef::WordRef w;
  w.gpu_memory = region;
  w.value = value;
  return w;
}
server::FenceRef::WordRef HostWord(const std::string& file, uint64_t offset, uint32_t value) {
  server::FenceRef::WordRef w;
  w.host_file = file;
  w.host_offset = offset;
  w.value = value;
  return w;
}
server::BatchFences Queued(server::FenceRef signal) {
  server::BatchFences f;
  f.signal = std::move(signal);
  f.queued_answer = true;
  return f;
}
server::BatchFences Waiting(server::FenceRef wait) {
  server::BatchFences f;
  f.wait = std::move(wait);
  return f;
}
server::FenceRef WordFence(server::FenceRef::WordRef word) {
  server::FenceRef f;
  f.word = std::move(word);
  return f;
}

// Which fence a refused batch's error names, by role: "wait.event.handle",
// "signal.word.buffer", ...; "" for an error about no fence.
std::string FencePart(const absl::Status& s) {
  std::optional<server::OperandPath> path = server::OperandPathOf(s);
  if (!path) return "";
  const std::string dot = path->part.empty() ? "" : "." + path->part;
  if (path->operand == Operand::kWaitFence) return "wait" + dot;
  if (path->operand == Operand::kSignalFence) return "signal" + dot;
  return "";
}

const GoldenCase& SmallCase() {
  for (const GoldenCase& c : GoldenCases()) {
    if (!c.error && !c.output_file.empty() && c.input_bytes >= 4096 && c.logical_shape.size() == 3) return c;
  }
  ADD_FAILURE() << "no small stored golden case";
  return GoldenCases().front();
}

// The daemon's parts on `gpus` fake GPUs.
struct Parts {
  explicit Parts(int gpus, uint64_t max_device_bytes = 0, uint64_t stream_slice_bytes = 1 << 20)
      : runtime(gpus) {
    server::Options o;
    o.max_device_bytes = max_device_bytes;
    o.memory_wait = absl::Milliseconds(50);
    metrics = *Metrics::Create("", true);
    devices = *DeviceManager::Create(o, &runtime, metrics.get());
    ipc = std::make_unique<IpcCache>(&runtime, 64, absl::Minutes(5), metrics.get());
    executor = std::make_unique<Executor>(devices.get(), ipc.get(),
                                          server::StreamSlicing{stream_slice_bytes, 256ull << 20}, o.memory_wait);
  }
  FakeRuntime runtime;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<DeviceManager> devices;
  std::unique_ptr<IpcCache> ipc;
  std::unique_ptr<Executor> executor;
};

ConvertJob BytesJob(const GoldenCase& c, const std::string& input) {
  ConvertJob job;
  job.plan = *MakePlan(c.spec, c.logical_shape);
  job.source_bytes = input;
  return job;
}

bool WaitFor(const std::function<bool()>& pred) {
  for (const absl::Time end = absl::Now() + absl::Seconds(20); absl::Now() < end; absl::SleepFor(absl::Milliseconds(5))) {
    if (pred()) return true;
  }
  return pred();
}

IpcRegion Region(const FakeRuntime::Exported& e, int gpu, uint64_t size) {
  return IpcRegion{e.handle, 0, size, FakeRuntime::FakeUuid(gpu)};
}

TEST(Executor, BytesRunOnTheRequestedGpuThroughStagingAndMatchTheReference) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  Parts p(2);
  ConvertJob job = BytesJob(c, input);
  job.gpu = FakeRuntime::FakeUuid(1);
  std::string out;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(job, &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(MatchesGolden(c, out)) << c.name;
  EXPECT_EQ(r->engine, p.devices->gpu(1).engine_name());
  EXPECT_EQ(p.runtime.counts(1).converts, 1);
  EXPECT_EQ(p.runtime.counts(0).converts, 0);
  // Device copies of the input and the output, freed once the request ended.
  EXPECT_EQ(r->peak_extra_device_bytes, c.input_bytes + c.output_bytes);
  EXPECT_EQ(p.runtime.totals().device_bytes_now, 0u);
  EXPECT_EQ(p.devices->gpu(1).allocator().allocated(), 0u);
  ASSERT_TRUE(r->kernel_seconds.has_value());
}

TEST(Executor, BytesGoToTheLeastLoadedGpu) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  Parts p(2);
  // GPU 0 is busy with another request (it holds one of its streams).
  absl::StatusOr<server::Gpu::StreamLease> busy = p.devices->gpu(0).AcquireStream(absl::InfiniteFuture());
  ASSERT_TRUE(busy.ok());
  std::string out;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->engine, p.devices->gpu(1).engine_name());
  EXPECT_TRUE(MatchesGolden(c, out));
}

TEST(Executor, IpcToIpcRunsOnTheOwningGpuWithZeroExtraDeviceBytes) {
  const GoldenCase& c = SmallCase();
  const std::vector<uint8_t> input = GoldenInput(c);
  Parts p(2);
  FakeRuntime::Exported src = p.runtime.ExportHandle(1, input.size());
  FakeRuntime::Exported dst = p.runtime.ExportHandle(1, c.output_bytes);
  std::copy(input.begin(), input.end(), src.ptr);
  std::fill(dst.ptr, dst.ptr + c.output_bytes, 0xAB);
  ConvertJob job;
  job.plan = *MakePlan(c.spec, c.logical_shape, InputBinding{{}, input.size()});
  job.source_ipc = Region(src, 1, input.size());
  job.destination_ipc = Region(dst, 1, c.output_bytes);
  std::string unused;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(job, &unused, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->peak_extra_device_bytes, 0u);
  EXPECT_TRUE(unused.empty());
  EXPECT_TRUE(MatchesGolden(c, std::string(dst.ptr, dst.ptr + c.output_bytes)));
  EXPECT_EQ(p.runtime.counts(1).converts, 1);
  EXPECT_EQ(p.runtime.counts(1).ipc_opens, 2);
}

TEST(Executor, IpcSourceToBytesAllocatesOnlyTheOutput) {
  const GoldenCase& c = SmallCase();
  const std::vector<uint8_t> input = GoldenInput(c);
  Parts p(1);
  FakeRuntime::Exported src = p.runtime.ExportHandle(0, input.size() + 100);
  std::copy(input.begin(), input.end(), src.ptr + 100);
  ConvertJob job;
  job.plan = *MakePlan(c.spec, c.logical_shape, InputBinding{{}, input.size()});
  job.source_ipc = IpcRegion{src.handle, 100, input.size(), FakeRuntime::FakeUuid(0)};
  std::string out;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(job, &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->peak_extra_device_bytes, c.output_bytes);
  EXPECT_TRUE(MatchesGolden(c, out));
}

TEST(Executor, NoGpuRunsBytesOnTheCpuEngine) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  Parts p(0);
  std::string out;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->engine, "cpu");
  EXPECT_TRUE(MatchesGolden(c, out));
  EXPECT_EQ(p.runtime.totals().converts, 0);
}

TEST(Executor, ErrorsNameTheOperandTheyAreAbout) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  Parts p(2);
  std::string out;

  ConvertJob unknown = BytesJob(c, input);
  unknown.gpu = FakeRuntime::FakeUuid(7);
  absl::Status s = p.executor->Convert(unknown, &out, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(server::OperandPathOf(s).has_value()) << s;
  EXPECT_EQ(server::OperandPathOf(s)->operand, Operand::kDevice);
  EXPECT_NE(s.message().find("is not a GPU this daemon serves"), std::string::npos) << s;

  // Source and destination on different GPUs.
  FakeRuntime::Exported src = p.runtime.ExportHandle(0, input.size());
  FakeRuntime::Exported dst = p.runtime.ExportHandle(1, c.output_bytes);
  ConvertJob split;
  split.plan = *MakePlan(c.spec, c.logical_shape, InputBinding{{}, input.size()});
  split.source_ipc = Region(src, 0, input.size());
  split.destination_ipc = Region(dst, 1, c.output_bytes);
  s = p.executor->Convert(split, &out, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server::OperandPathOf(s)->operand, Operand::kDestination);
  EXPECT_EQ(server::OperandPathOf(s)->part, "device_uuid");

  // A handle whose owner freed it: the source cannot be opened, nothing runs.
  p.runtime.FreeExported(src.handle);
  ConvertJob freed = split;
  freed.destination_ipc.reset();
  s = p.executor->Convert(freed, &out, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server::OperandPathOf(s)->operand, Operand::kSource);
  EXPECT_NE(s.message().find("could not be opened"), std::string::npos) << s;
  EXPECT_EQ(p.runtime.totals().converts, 0);
}

TEST(Executor, DeviceBudgetExhaustionIsResourceExhaustedThenRecovers) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  const uint64_t need = c.input_bytes + c.output_bytes;
  Parts p(1, need);
  // Another request holds the whole budget: this one waits --memory-wait, then gives up.
  ASSERT_TRUE(p.devices->gpu(0).allocator().Reserve(need, absl::InfiniteFuture()).ok());
  std::string out;
  absl::Status s = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(p.runtime.totals().converts, 0);
  p.devices->gpu(0).allocator().Unreserve(need);
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(MatchesGolden(c, out));
}

TEST(Executor, FailedDeviceAllocationLeavesNothingHeld) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  const uint64_t need = c.input_bytes + c.output_bytes;
  Parts p(1, need);
  p.runtime.SetDeviceCapacity(0, c.input_bytes);  // room for the input copy, not the output
  std::string out;
  absl::Status s = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(p.runtime.totals().device_bytes_now, 0u);
  EXPECT_EQ(p.devices->gpu(0).in_flight(), 0);
  EXPECT_TRUE(p.devices->gpu(0).allocator().Reserve(need, absl::Now()).ok())
      << "the failed request's reservation was not returned";
}

TEST(Executor, ShortPinnedMemoryFallsBackToOrdinaryStaging) {
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  Parts p(1);
  p.runtime.SetPinnedFails(true);
  std::string out;
  absl::StatusOr<ConvertOutcome> r = p.executor->Convert(BytesJob(c, input), &out, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(MatchesGolden(c, out));
}

TEST(Executor, StreamsOnAFakeGpuMatchEveryStoredMultiMatrixCase) {
  Parts p(1, 0, /*stream_slice_bytes=*/1);  // one matrix per slice
  int checked = 0;
  for (const GoldenCase& c : GoldenCases()) {
    if (c.error || c.output_file.empty() || c.logical_shape.size() < 3 || c.logical_shape[0] < 2) continue;
    const std::vector<uint8_t> input = GoldenInput(c);
    absl::StatusOr<std::unique_ptr<server::StreamConverter>> conv =
        p.executor->StartStream(*MakePlan(c.spec, c.logical_shape), std::nullopt, absl::InfiniteFuture());
    ASSERT_TRUE(conv.ok()) << conv.status();
    std::string out;
    const uint64_t slice = (*conv)->slice_input_bytes();
    for (uint64_t off = 0; off < input.size(); off += slice) {
      const uint64_t n = std::min<uint64_t>(slice, input.size() - off);
      absl::StatusOr<absl::Span<const uint8_t>> o =
          (*conv)->ConvertSlice(absl::Span<const uint8_t>(input.data() + off, n));
      ASSERT_TRUE(o.ok()) << o.status();
      out.append(o->begin(), o->end());
    }
    EXPECT_TRUE(MatchesGolden(c, out)) << c.name;
    EXPECT_LT(slice, input.size()) << c.name << " was not sliced";
    ++checked;
  }
  EXPECT_GT(checked, 3);
  EXPECT_EQ(p.runtime.totals().device_bytes_now, 0u);
}

// A batch of IPC items on two GPUs: each runs on the GPU holding its memory, the bytes
// are the reference's, nothing extra is allocated; one bad handle anywhere fails the batch
// before any item writes a byte.
// IPC -> IPC items of small stored cases on `gpu_of(i)`, their destinations filled with 0xAB.
struct IpcBatch {
  std::vector<const GoldenCase*> cases;
  std::vector<ConvertJob> jobs;
  std::vector<FakeRuntime::Exported> outs;
  std::vector<std::string> unused;
  std::vector<std::string*> inline_outputs;

  IpcBatch(FakeRuntime& runtime, size_t count, const std::function<int(size_t)>& gpu_of) {
    for (const GoldenCase& c : GoldenCases()) {
      if (!c.error && !c.output_file.empty() && c.input_bytes <= (64 << 10) && cases.size() < count) {
        cases.push_back(&c);
      }
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      const GoldenCase& c = *cases[i];
      const int gpu = gpu_of(i);
      const std::vector<uint8_t> in = GoldenInput(c);
      FakeRuntime::Exported src = runtime.ExportHandle(gpu, in.size());
      std::copy(in.begin(), in.end(), src.ptr);
      FakeRuntime::Exported dst = runtime.ExportHandle(gpu, c.output_bytes);
      std::fill(dst.ptr, dst.ptr + c.output_bytes, 0xAB);
      ConvertJob job;
      job.plan = *MakePlan(c.spec, c.logical_shape, InputBinding{{}, in.size()});
      job.source_ipc = Region(src, gpu, in.size());
      job.destination_ipc = Region(dst, gpu, c.output_bytes);
      jobs.push_back(job);
      outs.push_back(dst);
    }
    unused.resize(jobs.size());
    for (std::string& u : unused) inline_outputs.push_back(&u);
  }
  bool Untouched() const {
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!std::all_of(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes, [](uint8_t b) { return b == 0xAB; })) {
        return false;
      }
    }
    return true;
  }
  // Every output holds its golden bytes.
  void ExpectGolden() const {
    for (size_t i = 0; i < cases.size(); ++i) {
      EXPECT_TRUE(MatchesGolden(*cases[i], std::string(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes)))
          << cases[i]->name;
    }
  }
};

TEST(Executor, BatchesRunEachItemOnItsGpuAndOneBadItemWritesNothing) {
  Parts p(2);
  IpcBatch b(p.runtime, 12, [](size_t i) { return static_cast<int>(i % 2); });
  ASSERT_GE(b.cases.size(), 8u);
  const std::vector<const GoldenCase*>& cases = b.cases;
  const std::vector<ConvertJob>& jobs = b.jobs;
  const std::vector<FakeRuntime::Exported>& outs = b.outs;
  const std::vector<std::string*>& inline_outputs = b.inline_outputs;

  // Item 5's source handle names memory its owner freed: the batch fails naming item 5.
  std::vector<ConvertJob> spoiled = jobs;
  FakeRuntime::Exported gone = p.runtime.ExportHandle(1, 64);
  p.runtime.FreeExported(gone.handle);
  spoiled[5].source_ipc->handle = gone.handle;
  absl::Status s = p.executor->ConvertBatch(spoiled, inline_outputs, absl::InfiniteFuture()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  ASSERT_TRUE(server::OperandPathOf(s).has_value()) << s;
  EXPECT_EQ(server::OperandPathOf(s)->item, 5);
  EXPECT_EQ(server::OperandPathOf(s)->operand, Operand::kSource);
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before every item was checked";
  for (size_t i = 0; i < outs.size(); ++i) {
    EXPECT_TRUE(std::all_of(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes, [](uint8_t b) { return b == 0xAB; }))
        << "item " << i << " was written";
  }

  absl::StatusOr<Executor::BatchOutcome> r = p.executor->ConvertBatch(jobs, inline_outputs, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->peak_extra_device_bytes, 0u);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(MatchesGolden(*cases[i], std::string(outs[i].ptr, outs[i].ptr + cases[i]->output_bytes))) << cases[i]->name;
    EXPECT_EQ(r->outcomes[i].engine, p.devices->gpu(i % 2).engine_name());
    EXPECT_TRUE(r->outcomes[i].kernel_seconds.has_value());
  }
  EXPECT_EQ(p.runtime.counts(0).converts + p.runtime.counts(1).converts, static_cast<int>(cases.size()));
  EXPECT_GT(p.runtime.counts(0).converts, 0);
  EXPECT_GT(p.runtime.counts(1).converts, 0);
  EXPECT_EQ(p.runtime.totals().device_bytes_now, 0u);
}

// Inline items of a batch on a GPU go through staging one at a time, mixed with IPC items.
TEST(Executor, BatchesMixInlineAndIpcItems) {
  Parts p(1);
  const GoldenCase& c = SmallCase();
  const std::string input = AsString(GoldenInput(c));
  FakeRuntime::Exported dst = p.runtime.ExportHandle(0, c.output_bytes);
  std::vector<ConvertJob> jobs(3, BytesJob(c, input));
  jobs[1].destination_ipc = Region(dst, 0, c.output_bytes);
  std::vector<std::string> outs(3);
  std::vector<std::string*> inline_outputs = {&outs[0], &outs[1], &outs[2]};
  absl::StatusOr<Executor::BatchOutcome> r = p.executor->ConvertBatch(jobs, inline_outputs, absl::InfiniteFuture());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(MatchesGolden(c, outs[0]));
  EXPECT_TRUE(outs[1].empty());
  EXPECT_TRUE(MatchesGolden(c, std::string(dst.ptr, dst.ptr + c.output_bytes)));
  EXPECT_TRUE(MatchesGolden(c, outs[2]));
  EXPECT_GT(r->peak_extra_device_bytes, 0u);
}

// A batch answered once queued, signalling an event: the batch returns once its work
// is queued, with the client's event recorded after every item; until the fake GPU says
// the work is done, the mappings stay leased (a release is deferred), `keep` stays held
// and `done` has not run; then `done` gets every item's kernel time and everything goes.
TEST(Executor, EarlyAnswerRecordsTheClientsEventAfterEveryItemAndHoldsItsMappingsUntilDone) {
  Parts p(1);
  IpcBatch b(p.runtime, 8, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 8u);
  p.runtime.HoldEventWaits(true);
  server::BatchFences early = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
  auto keep = std::make_shared<int>(7);
  std::weak_ptr<int> kept = keep;
  early.keep = std::move(keep);
  std::atomic<int> done_calls{0};
  std::vector<std::optional<double>> seconds;
  absl::Status done_status = absl::UnknownError("not called");
  early.done = [&](const absl::Status& s, server::DeviceMetrics* m, const std::vector<std::optional<double>>& k) {
    done_status = s;
    seconds = k;
    EXPECT_EQ(m, p.devices->gpu(0).metrics());
    done_calls++;
  };
  absl::StatusOr<Executor::BatchOutcome> r =
      p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &early);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(p.runtime.WaitEventWaiters(1)) << "nothing waits for the work";
  for (size_t i = 0; i < b.cases.size(); ++i) {
    EXPECT_TRUE(MatchesGolden(*b.cases[i], std::string(b.outs[i].ptr, b.outs[i].ptr + b.cases[i]->output_bytes)))
        << b.cases[i]->name;
    EXPECT_FALSE(r->outcomes[i].kernel_seconds.has_value()) << "an early answer cannot know the kernel time";
  }
  const FakeRuntime::Counts c = p.runtime.counts(0);
  EXPECT_EQ(c.ipc_event_opens, 1);
  EXPECT_EQ(c.ipc_event_records, 1);
  EXPECT_EQ(c.converts_at_ipc_event_record, 8) << "the client's event came before some item";
  EXPECT_EQ(p.executor->pending_completions(), 1u);
  EXPECT_EQ(done_calls.load(), 0);
  EXPECT_FALSE(kept.expired()) << "the work's keep went before the work was done";
  EXPECT_EQ(p.ipc->Release(0, b.jobs[0].source_ipc->handle), std::make_pair(0, 1)) << "the mapping was not leased";
  EXPECT_EQ(p.devices->gpu(0).in_flight(), 0) << "the streams went back at the answer";

  p.runtime.HoldEventWaits(false);
  ASSERT_TRUE(WaitFor([&] { return done_calls.load() == 1 && kept.expired(); }));
  EXPECT_TRUE(done_status.ok()) << done_status;
  ASSERT_EQ(seconds.size(), 8u);
  for (const auto& k : seconds) EXPECT_TRUE(k.has_value());
  EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
  EXPECT_EQ(p.runtime.counts(0).ipc_events_alive, 0) << "the client's event was left open";
  EXPECT_EQ(p.runtime.counts(0).ipc_closes, 1) << "the deferred release did not close once the work was done";

  // The daemon's own events (the lanes' joins and its completion mark) are reused: another
  // such batch makes none.
  const int pooled = p.runtime.counts(0).events_alive;
  EXPECT_GT(pooled, 0);
  server::BatchFences again = Queued(EventFence(early.signal.event->handle, 0));
  ASSERT_TRUE(p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &again).ok());
  EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
  EXPECT_EQ(p.runtime.counts(0).events_alive, pooled) << "a batch made events instead of reusing them";
  EXPECT_EQ(p.runtime.counts(0).ipc_event_records, 2);
}

// An early answer's checks come with the others, before any work: the event's GPU must
// be every item's and the event must open; a failed one writes nothing and leaves no event.
TEST(Executor, EarlyAnswerChecksTheEventsGpuAndHandleBeforeAnyWork) {
  Parts p(2);
  IpcBatch b(p.runtime, 4, [](size_t i) { return i == 2 ? 1 : 0; });
  ASSERT_EQ(b.jobs.size(), 4u);
  auto early_for = [&](std::string handle, int gpu) { return Queued(EventFence(std::move(handle), gpu)); };
  {
    server::BatchFences e = early_for(p.runtime.ExportEventHandle(0), 0);
    absl::Status s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), "signal.event.device_uuid") << s;
    EXPECT_NE(s.message().find("item 2 is on GPU"), std::string::npos) << s;
  }
  std::vector<ConvertJob> one_gpu = {b.jobs[0], b.jobs[1], b.jobs[3]};
  std::vector<std::string*> outs = {b.inline_outputs[0], b.inline_outputs[1], b.inline_outputs[3]};
  {
    server::BatchFences e = early_for(p.runtime.ExportEventHandle(0), 9);
    absl::Status s = p.executor->ConvertBatch(one_gpu, outs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), "signal.event.device_uuid") << s;
  }
  {
    const std::string forgotten = p.runtime.ExportEventHandle(0);
    p.runtime.ForgetEventHandle(forgotten);
    server::BatchFences e = early_for(forgotten, 0);
    absl::Status s = p.executor->ConvertBatch(one_gpu, outs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), "signal.event.handle") << s;
    EXPECT_NE(s.message().find("cannot be opened"), std::string::npos) << s;
  }
  {
    server::BatchFences e = early_for(p.runtime.ExportEventHandle(1), 1);  // an event of the other GPU
    absl::Status s = p.executor->ConvertBatch(one_gpu, outs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), "signal.event.device_uuid") << s;
    EXPECT_NE(s.message().find("item 0 is on GPU"), std::string::npos) << s;
  }
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before the checks";
  EXPECT_TRUE(b.Untouched());
  EXPECT_EQ(p.runtime.totals().events_alive, 0) << "a refused batch made or kept an event";
  EXPECT_EQ(p.runtime.totals().ipc_event_records, 0);
  EXPECT_EQ(p.executor->pending_completions(), 0u);
}

// A wait fence of an event stands for the client's host waiting
// before the call: every stream the batch uses waits for it before its first item, so
// every item runs after it; the event is opened once, even when it is the signal fence's
// event too, and closed once the work is queued.
TEST(Executor, EveryStreamOfABatchWaitsForItsReadyEventBeforeAnyItem) {
  for (const char* mode : {"ready", "ready and completion, one event", "ready and completion, two events"}) {
    SCOPED_TRACE(mode);
    Parts p(1);  // fresh streams: none has waited for anything yet
    IpcBatch b(p.runtime, 8, [](size_t) { return 0; });
    ASSERT_EQ(b.jobs.size(), 8u);
    const bool with_early = std::string(mode) != "ready";
    const bool one_event = std::string(mode) == "ready and completion, one event";
    const std::string ready = p.runtime.ExportEventHandle(0);
    server::BatchFences fences =
        with_early ? Queued(EventFence(one_event ? ready : p.runtime.ExportEventHandle(0), 0)) : server::BatchFences();
    fences.wait = EventFence(ready, 0);
    absl::StatusOr<Executor::BatchOutcome> r =
        p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &fences);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
    b.ExpectGolden();
    const FakeRuntime::Counts c = p.runtime.counts(0);
    EXPECT_EQ(c.converts, 8);
    EXPECT_EQ(c.converts_after_ipc_wait, 8) << "an item ran on a stream that had not waited for the ready event";
    EXPECT_GE(c.ipc_event_waits, 1);
    EXPECT_LE(c.ipc_event_waits, p.devices->gpu(0).streams()) << "a stream waited more than once";
    EXPECT_EQ(c.ipc_event_opens, one_event || !with_early ? 1 : 2);
    EXPECT_EQ(c.ipc_event_records, with_early ? 1 : 0);
    if (with_early) {
      EXPECT_EQ(c.converts_at_ipc_event_record, 8);
    }
    EXPECT_EQ(c.ipc_events_alive, 0) << "a client's event was left open";
  }
}

// A wait event's checks come with the others: its GPU must hold every item's IPC memory
// and its handle must open; a refused batch writes nothing and leaves no event open.
TEST(Executor, ReadyEventChecksItsGpuAndHandleBeforeAnyWork) {
  Parts p(2);
  IpcBatch b(p.runtime, 3, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 3u);
  auto expect_invalid = [&](server::FenceRef wait, const std::string& part, const std::string& what) {
    server::BatchFences fences = Waiting(std::move(wait));
    absl::Status s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &fences).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), part) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  expect_invalid(EventFence(p.runtime.ExportEventHandle(1), 1), "wait.event.device_uuid", "item 0 is on GPU");
  expect_invalid(EventFence(p.runtime.ExportEventHandle(0), 9), "wait.event.device_uuid", "");
  const std::string forgotten = p.runtime.ExportEventHandle(0);
  p.runtime.ForgetEventHandle(forgotten);
  expect_invalid(EventFence(forgotten, 0), "wait.event.handle", "cannot be opened");
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before the checks";
  EXPECT_TRUE(b.Untouched());
  EXPECT_EQ(p.runtime.totals().events_alive, 0) << "a refused batch made or kept an event";
  EXPECT_EQ(p.runtime.totals().ipc_event_waits, 0);
}

// A wait fence of a word in place of an event: every stream the
// batch uses waits for the word before its first item, with no client event opened; its
// mapping is held, like the items', until the work is done.
TEST(Executor, EveryStreamOfABatchWaitsForItsReadyFlagBeforeAnyItem) {
  for (const char* mode : {"gpu word", "host word", "gpu word, answered early", "host word, answered early"}) {
    SCOPED_TRACE(mode);
    const std::string m = mode;
    Parts p(1);  // fresh streams: none has waited for anything yet
    IpcBatch b(p.runtime, 8, [](size_t) { return 0; });
    ASSERT_EQ(b.jobs.size(), 8u);
    FakeRuntime::Exported words = p.runtime.ExportHandle(0, 16);
    ShmFile file(4096);
    ASSERT_TRUE(file.ok());
    const uint32_t value = 0x80000003u;
    server::FenceRef::WordRef word;
    if (absl::StartsWith(m, "gpu")) {
      std::memcpy(words.ptr + 8, &value, 4);  // the client's stream wrote it (the fake does not wait)
      word = GpuWord(IpcRegion{words.handle, 8, 4, FakeRuntime::FakeUuid(0)}, value);
    } else {
      std::memcpy(file.base() + 4, &value, 4);
      word = HostWord(file.name(), 4, value);
    }
    const bool with_early = absl::EndsWith(m, "early");
    server::BatchFences fences =
        with_early ? Queued(EventFence(p.runtime.ExportEventHandle(0), 0)) : server::BatchFences();
    fences.wait = WordFence(word);
    p.runtime.HoldEventWaits(with_early);
    absl::StatusOr<Executor::BatchOutcome> r =
        p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &fences);
    ASSERT_TRUE(r.ok()) << r.status();
    if (with_early && absl::StartsWith(m, "gpu")) {
      EXPECT_EQ(p.ipc->Release(0, words.handle), std::make_pair(0, 1)) << "the ready word's mapping was not leased";
    }
    p.runtime.HoldEventWaits(false);
    EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
    b.ExpectGolden();
    const FakeRuntime::Counts c = p.runtime.counts(0);
    EXPECT_EQ(c.converts, 8);
    EXPECT_EQ(c.converts_after_value_wait, 8) << "an item ran on a stream that had not waited for the ready word";
    EXPECT_GE(c.value_waits, 1);
    EXPECT_LE(c.value_waits, p.devices->gpu(0).streams()) << "a stream waited more than once";
    EXPECT_EQ(c.ipc_event_waits, 0);
    EXPECT_EQ(c.ipc_event_opens, with_early ? 1 : 0) << "a ready event was opened for a ready flag";
    EXPECT_EQ(c.ipc_events_alive, 0);
  }
}

// A wait word's checks come with the others, before any work: one GPU holds every item's
// IPC memory and a GPU word; the word is in range; the file opens.
TEST(Executor, AReadyFlagIsCheckedBeforeAnyWork) {
  Parts p(2);
  IpcBatch b(p.runtime, 3, [](size_t) { return 0; });
  IpcBatch two(p.runtime, 2, [](size_t i) { return static_cast<int>(i % 2); });
  FakeRuntime::Exported words = p.runtime.ExportHandle(0, 16);
  FakeRuntime::Exported other = p.runtime.ExportHandle(1, 16);
  std::fill(words.ptr, words.ptr + 16, 0xFF);
  std::fill(other.ptr, other.ptr + 16, 0xFF);
  auto expect_invalid = [&](IpcBatch& batch, const server::FenceRef::WordRef& word, const std::string& part,
                            const std::string& what) {
    server::BatchFences fences = Waiting(WordFence(word));
    absl::Status s =
        p.executor->ConvertBatch(batch.jobs, batch.inline_outputs, absl::InfiniteFuture(), &fences).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), part) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  expect_invalid(b, GpuWord(IpcRegion{other.handle, 0, 4, FakeRuntime::FakeUuid(1)}, 1), "wait.word.buffer.device_uuid",
                 "names GPU");
  expect_invalid(b, GpuWord(IpcRegion{words.handle, 16, 4, FakeRuntime::FakeUuid(0)}, 1), "wait.word.buffer", "");
  expect_invalid(b, HostWord("wprep-absent-" + std::to_string(getpid()), 0, 1), "wait.word.host_word",
                 "/dev/shm/wprep-absent-");
  expect_invalid(two, GpuWord(IpcRegion{words.handle, 0, 4, FakeRuntime::FakeUuid(0)}, 1), "wait.word",
                 "orders one GPU's work");
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before the checks";
  EXPECT_TRUE(b.Untouched());
  EXPECT_TRUE(two.Untouched());
  EXPECT_EQ(p.runtime.totals().value_waits, 0);
}

// A signal word is the client's stream's release:
// its word is written with the value after every item and after the client's event, and
// its mapping is held, like the items', until the work is done.
TEST(Executor, ACompletionFlagIsWrittenAfterEveryItemAndHeldUntilTheWorkIsDone) {
  Parts p(1);
  IpcBatch b(p.runtime, 6, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 6u);
  FakeRuntime::Exported words = p.runtime.ExportHandle(0, 64);
  std::fill(words.ptr, words.ptr + 64, 0);
  p.runtime.HoldEventWaits(true);
  server::BatchFences early = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
  early.signal.word = GpuWord(IpcRegion{words.handle, 12, 4, FakeRuntime::FakeUuid(0)}, 0xC0FFEE01u);
  ASSERT_TRUE(p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &early).ok());
  uint32_t word = 0;
  std::memcpy(&word, words.ptr + 12, 4);
  EXPECT_EQ(word, 0xC0FFEE01u);
  for (int i = 0; i < 64; ++i) {
    if (i < 12 || i >= 16) {
      EXPECT_EQ(words.ptr[i], 0) << "byte " << i << " beside the word was written";
    }
  }
  const FakeRuntime::Counts c = p.runtime.counts(0);
  EXPECT_EQ(c.flag_writes, 1);
  EXPECT_EQ(c.converts_at_flag_write, 6) << "the flag came before some item";
  EXPECT_EQ(c.ipc_event_records, 1);
  EXPECT_EQ(p.ipc->Release(0, words.handle), std::make_pair(0, 1)) << "the flag's mapping was not leased";
  p.runtime.HoldEventWaits(false);
  EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
  EXPECT_TRUE(WaitFor([&] { return p.runtime.counts(0).ipc_closes == 1; }))
      << "the flag's deferred release did not close once the work was done";
}

// A signal word's checks come with the others, before any work: on the event's GPU, inside
// its allocation, its handle opening; a refused batch writes nothing, not even the word.
TEST(Executor, ACompletionFlagIsCheckedBeforeAnyWork) {
  Parts p(2);
  IpcBatch b(p.runtime, 3, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 3u);
  FakeRuntime::Exported words = p.runtime.ExportHandle(0, 16);
  FakeRuntime::Exported other = p.runtime.ExportHandle(1, 16);
  std::fill(words.ptr, words.ptr + 16, 0);
  std::fill(other.ptr, other.ptr + 16, 0);
  auto expect_invalid = [&](const IpcRegion& flag, const std::string& part) {
    server::BatchFences e = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
    e.signal.word = GpuWord(flag, 5);
    absl::Status s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(FencePart(s), part) << s;
  };
  expect_invalid(IpcRegion{other.handle, 0, 4, FakeRuntime::FakeUuid(1)}, "signal.word.buffer.device_uuid");
  expect_invalid(IpcRegion{words.handle, 16, 4, FakeRuntime::FakeUuid(0)}, "signal.word.buffer");
  expect_invalid(IpcRegion{std::string(64, '\x7f'), 0, 4, FakeRuntime::FakeUuid(0)}, "signal.word.buffer");
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before the checks";
  EXPECT_EQ(p.runtime.totals().flag_writes, 0);
  EXPECT_TRUE(b.Untouched());
  EXPECT_TRUE(std::all_of(words.ptr, words.ptr + 16, [](uint8_t x) { return x == 0; }));
  EXPECT_EQ(p.runtime.totals().events_alive, 0) << "a refused batch made or kept an event";
}

// A signal word in shared host memory is written like a GPU word,
// after every item and the client's event; its file is mapped and registered once and
// kept, and mapped again when another file takes its name.
TEST(Executor, AHostWordFlagIsWrittenAfterEveryItemAndItsFileIsMappedOnce) {
  Parts p(1);
  IpcBatch b(p.runtime, 4, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 4u);
  auto file = std::make_unique<ShmFile>(4096);
  ASSERT_TRUE(file->ok());
  auto run = [&](uint64_t offset, uint32_t value) {
    server::BatchFences early = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
    early.signal.word = HostWord(file->name(), offset, value);
    absl::Status s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &early).status();
    EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
    return s;
  };
  ASSERT_TRUE(run(4092, 0xA5A5A501u).ok());
  EXPECT_EQ(file->Word(4092), 0xA5A5A501u);
  EXPECT_TRUE(std::all_of(file->base(), file->base() + 4092, [](uint8_t x) { return x == 0; }))
      << "a byte beside the word was written";
  EXPECT_EQ(p.runtime.counts(0).flag_writes, 1);
  EXPECT_EQ(p.runtime.counts(0).converts_at_flag_write, 4) << "the flag came before some item";
  ASSERT_TRUE(run(0, 7).ok());
  EXPECT_EQ(file->Word(0), 7u);
  EXPECT_EQ(p.runtime.host_registrations(), 1u) << "the file was registered again";
  // A new file at the same name (a client that started again) is mapped anew.
  const std::string name = file->name();
  file.reset();
  file = std::make_unique<ShmFile>(4096);
  ASSERT_EQ(rename(file->path().c_str(), ("/dev/shm/" + name).c_str()), 0);
  struct Named {
    std::string path;
    ~Named() { unlink(path.c_str()); }
  } renamed{"/dev/shm/" + name};
  server::BatchFences early = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
  early.signal.word = HostWord(name, 8, 9);
  ASSERT_TRUE(p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &early).ok());
  EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
  EXPECT_EQ(file->Word(8), 9u) << "the value went to the file that had the name before";
  EXPECT_EQ(p.runtime.host_registrations(), 1u) << "the replaced file stayed registered";
}

// With a wait word and a signal word a batch needs no client event at all: it is answered
// once queued, every stream waits for the ready word, the completion word is written after
// every item, and the work is held and finished like any early answer.
TEST(Executor, WordsAloneOrderABatchAnsweredEarlyWithNoEvent) {
  Parts p(2);
  IpcBatch b(p.runtime, 4, [](size_t) { return 0; });
  ASSERT_EQ(b.jobs.size(), 4u);
  ShmFile file(4096);
  ASSERT_TRUE(file.ok());
  const uint32_t go = 5;
  std::memcpy(file.base(), &go, 4);  // the client's stream wrote the ready word
  server::BatchFences early = Queued(WordFence(HostWord(file.name(), 4, 0xFEEDu)));
  early.wait = WordFence(HostWord(file.name(), 0, go));
  p.runtime.HoldEventWaits(true);
  absl::StatusOr<Executor::BatchOutcome> r =
      p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &early);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(file.Word(4), 0xFEEDu);
  for (const ConvertOutcome& o : r->outcomes) EXPECT_FALSE(o.kernel_seconds.has_value()) << "answered after the work";
  EXPECT_EQ(p.executor->pending_completions(), 1u);
  p.runtime.HoldEventWaits(false);
  EXPECT_TRUE(WaitFor([&] { return p.executor->pending_completions() == 0; }));
  b.ExpectGolden();
  const FakeRuntime::Counts c = p.runtime.counts(0);
  EXPECT_EQ(c.converts_after_value_wait, 4);
  EXPECT_EQ(c.converts_at_flag_write, 4) << "the completion word came before some item";
  EXPECT_EQ(c.ipc_event_opens, 0);
  EXPECT_EQ(c.ipc_event_records, 0);
  EXPECT_EQ(c.ipc_events_alive, 0);

  // A signal word alone orders one GPU's work, and a GPU word must live there.
  IpcBatch two(p.runtime, 2, [](size_t i) { return static_cast<int>(i % 2); });
  server::BatchFences split = Queued(WordFence(*early.signal.word));
  absl::Status s = p.executor->ConvertBatch(two.jobs, two.inline_outputs, absl::InfiniteFuture(), &split).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(FencePart(s), "signal.word") << s;
  EXPECT_NE(s.message().find("orders one GPU's work"), std::string::npos) << s;
  FakeRuntime::Exported other = p.runtime.ExportHandle(1, 16);
  server::BatchFences elsewhere = Queued(WordFence(GpuWord(IpcRegion{other.handle, 0, 4, FakeRuntime::FakeUuid(1)}, 0)));
  s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &elsewhere).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(FencePart(s), "signal.word.buffer.device_uuid") << s;
  EXPECT_NE(s.message().find("not the items' GPU"), std::string::npos) << s;
  EXPECT_TRUE(two.Untouched());
}

// A host word's checks come before any work: a file that is missing, too small or not a
// multiple of 4096 bytes, a symbolic link, an offset outside it or unaligned, a bad name.
TEST(Executor, AHostWordFlagIsCheckedBeforeAnyWork) {
  Parts p(1);
  IpcBatch b(p.runtime, 2, [](size_t) { return 0; });
  ShmFile good(4096), odd(100);
  ASSERT_TRUE(good.ok() && odd.ok());
  const std::string link = "/dev/shm/" + ShmFile::NextName();
  ASSERT_EQ(symlink(good.path().c_str(), link.c_str()), 0);
  struct Unlink {
    std::string path;
    ~Unlink() { unlink(path.c_str()); }
  } unlink_link{link};
  auto expect_invalid = [&](const std::string& name, uint64_t offset, const std::string& what) {
    server::BatchFences e = Queued(EventFence(p.runtime.ExportEventHandle(0), 0));
    e.signal.word = HostWord(name, offset, 5);
    absl::Status s = p.executor->ConvertBatch(b.jobs, b.inline_outputs, absl::InfiniteFuture(), &e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name << " " << offset << ": " << s;
    EXPECT_EQ(FencePart(s), "signal.word.host_word") << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  expect_invalid("wprep-no-such-file-" + std::to_string(getpid()), 0, "does not open");
  expect_invalid(odd.name(), 0, "has 100 bytes");
  expect_invalid(link.substr(9), 0, "is not a regular file");
  expect_invalid(good.name(), 4096, "outside the file's 4096 bytes");
  expect_invalid(good.name(), 2, "multiple of 4");
  expect_invalid("../shm/" + good.name(), 0, "name must be");
  expect_invalid("wprep-", 0, "name must be");
  EXPECT_EQ(p.runtime.totals().converts, 0) << "a conversion ran before the checks";
  EXPECT_EQ(p.runtime.totals().flag_writes, 0);
  EXPECT_TRUE(b.Untouched());
  EXPECT_TRUE(std::all_of(good.base(), good.base() + 4096, [](uint8_t x) { return x == 0; }));
  EXPECT_EQ(p.runtime.totals().events_alive, 0) << "a refused batch made or kept an event";
}

// The daemon keeps at most max_files files mapped and registered (page-locked): files whose
// names are gone first, then the least recently used; a file too large is refused.
TEST(HostWords, KeepsAtMostMaxFilesUnlinkedOnesFirst) {
  FakeRuntime rt(1);
  char dir_template[] = "/tmp/wprep-host-words-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  auto make = [&](const std::string& name, off_t bytes) {
    const std::string path = dir + "/" + name;
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    close(fd);
    return path;
  };
  {
    server::HostWords words(dir, 3);
    for (const char* n : {"wprep-a", "wprep-b", "wprep-c"}) {
      make(n, 4096);
      ASSERT_TRUE(words.Acquire(rt, 0, n, 0, "w").ok()) << n;
    }
    EXPECT_EQ(words.size(), 3u);
    ASSERT_TRUE(words.Acquire(rt, 0, "wprep-a", 4, "w").ok());  // a is now the most recently used
    unlink((dir + "/wprep-c").c_str());
    make("wprep-d", 4096);
    ASSERT_TRUE(words.Acquire(rt, 0, "wprep-d", 0, "w").ok());
    EXPECT_EQ(words.size(), 3u) << "the unlinked file was not dropped";
    EXPECT_EQ(rt.host_registrations(), 3u);
    make("wprep-e", 8192);
    ASSERT_TRUE(words.Acquire(rt, 0, "wprep-e", 8188, "w").ok());
    EXPECT_EQ(words.size(), 3u);
    EXPECT_EQ(rt.host_registrations(), 3u) << "an evicted file stayed registered";
    const int registered = rt.host_register_calls();
    ASSERT_TRUE(words.Acquire(rt, 0, "wprep-a", 0, "w").ok());
    EXPECT_EQ(rt.host_register_calls(), registered) << "the most recently used file was evicted, not b";
    ASSERT_TRUE(words.Acquire(rt, 0, "wprep-b", 0, "w").ok());
    EXPECT_EQ(rt.host_register_calls(), registered + 1) << "the least recently used file was kept";
    EXPECT_EQ(rt.host_registrations(), 3u);
    make("wprep-big", server::HostWords::kMaxFileBytes + 4096);
    absl::StatusOr<server::HostWords::Word> big = words.Acquire(rt, 0, "wprep-big", 0, "w");
    EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(big.status().message().find("at most 65536"), std::string::npos) << big.status();
  }
  EXPECT_EQ(rt.host_registrations(), 0u) << "a file stayed registered after the daemon let go";
  for (const char* n : {"wprep-a", "wprep-b", "wprep-d", "wprep-e", "wprep-big"}) unlink((dir + "/" + n).c_str());
  rmdir(dir.c_str());
}

// The completions thread finishes work in the order it was added, once its event's wait
// returns; at most max_pending pieces wait at once, and Add blocks for room beyond that
// (an early answer's handler then waits, rather than the daemon holding ever more
// mappings); the destructor waits for everything added.
TEST(Completions, FinishesInOrderHoldsAtMostMaxPendingAndDrainsOnDestruction) {
  FakeRuntime rt(1);
  rt.HoldEventWaits(true);
  std::vector<int> finished;
  std::vector<server::Event> events;
  absl::Mutex mu;
  auto work = [&](int n) {
    server::Completions::Work w;
    w.gpu = 0;
    w.event = *rt.CreateEvent(0);
    events.push_back(w.event);
    w.done = [&, n](const absl::Status& s) {
      EXPECT_TRUE(s.ok()) << s;
      absl::MutexLock lock(&mu);
      finished.push_back(n);
    };
    return w;
  };
  std::atomic<bool> third_added{false};
  {
    server::Completions c(&rt, 2);
    c.Add(work(1));
    c.Add(work(2));
    EXPECT_EQ(c.pending(), 2u);
    std::thread adder([&] {
      c.Add(work(3));
      third_added = true;
    });
    ASSERT_TRUE(rt.WaitEventWaiters(1));
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_FALSE(third_added.load()) << "a third piece of work got in beyond max_pending = 2";
    {
      absl::MutexLock lock(&mu);
      EXPECT_TRUE(finished.empty()) << "work finished while its event's wait was held";
    }
    rt.HoldEventWaits(false);
    adder.join();
    EXPECT_TRUE(third_added.load());
  }  // waits for all three
  EXPECT_EQ(finished, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(rt.counts(0).events_alive, 3) << "Completions destroys no event: they are the caller's";
  for (server::Event e : events) rt.DestroyEvent(0, e);
}

}  // namespace
}  // namespace wprep::testing
