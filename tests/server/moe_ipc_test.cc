// MoE items with CUDA IPC operands, below the wire, on the fake GPUs of FakeRuntime (host
// memory standing in for a client's device memory): outputs written in place into the
// client's memory byte-exact, no device memory of the daemon's, and every IPC problem
// INVALID_ARGUMENT naming its operand with nothing written.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "device/device_manager.h"
#include "fake_runtime.h"
#include "golden.h"
#include "device/ipc_cache.h"
#include "net/metrics.h"
#include "moe_golden.h"
#include "rpc/moe_item.h"
#include "wprep/server/options.h"

namespace wprep::testing {
namespace {

using server::DeviceManager;
using server::IpcCache;
using server::Metrics;
using server::MoeEngines;
using server::MoeJob;
using server::MoeLimits;
namespace v1 = wprep::v1;

struct Parts {
  explicit Parts(int gpus) : runtime(gpus) {
    server::Options o;
    metrics = *Metrics::Create("", true);
    devices = *DeviceManager::Create(o, &runtime, metrics.get());
    ipc = std::make_unique<IpcCache>(&runtime, 512, absl::Minutes(5), metrics.get());  // 54 items x up to 6 operands
  }
  MoeEngines engines() { return MoeEngines{1, devices.get(), ipc.get()}; }
  FakeRuntime runtime;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<DeviceManager> devices;
  std::unique_ptr<IpcCache> ipc;
};

v1::MoeDType DTypeOf(const std::string& name) {
  return name == "float32" ? v1::MOE_DTYPE_FLOAT32 : name == "bfloat16" ? v1::MOE_DTYPE_BFLOAT16 : v1::MOE_DTYPE_UINT8;
}

v1::CudaIpcBuffer Buffer(const FakeRuntime::Exported& e, int gpu, uint64_t size, uint64_t offset = 0) {
  v1::CudaIpcBuffer b;
  b.set_handle(e.handle);
  b.set_offset(offset);
  b.set_size(size);
  const server::Uuid u = FakeRuntime::FakeUuid(gpu);
  b.set_device_uuid(std::string(reinterpret_cast<const char*>(u.data()), u.size()));
  return b;
}

// Case `c` as an item whose inputs and outputs are client memory of fake GPU `gpu`: the
// inputs hold the case's bytes, the outputs 0xEE.
struct IpcCase {
  v1::MoeItem item;
  std::vector<FakeRuntime::Exported> inputs, outputs;
};
IpcCase MakeIpcCase(Parts& p, const MoeGoldenCase& c, int gpu) {
  IpcCase k;
  k.item.set_op(c.op);
  for (const auto& [key, v] : c.params) {
    v1::MoeParams* m = k.item.mutable_params();
    if (key == "format") m->set_format(v);
    if (key == "gated") m->set_gated(v == "true");
    if (key == "align") m->set_align(std::stoll(v));
    if (key == "align_h") m->set_align_h(std::stoll(v));
    if (key == "align_i") m->set_align_i(std::stoll(v));
    if (key == "block_k") m->set_block_k(std::stoll(v));
    if (key == "axis") m->set_axis(std::stoll(v));
    if (key == "epilogue_tile_m") m->set_epilogue_tile_m(std::stoll(v));
    if (key == "num_elts_per_sf") m->set_num_elts_per_sf(std::stoll(v));
  }
  for (const MoeGoldenTensor& t : c.inputs) {
    const std::vector<uint8_t> bytes = MoeGoldenInput(t);
    FakeRuntime::Exported e = p.runtime.ExportHandle(gpu, bytes.size() + 1);
    if (!bytes.empty()) std::memcpy(e.ptr, bytes.data(), bytes.size());
    v1::MoeInput* in = k.item.add_inputs();
    in->set_name(t.name);
    in->set_dtype(DTypeOf(t.dtype));
    for (int64_t d : t.shape) in->add_shape(d);
    *in->mutable_source()->mutable_ipc() = Buffer(e, gpu, bytes.size());
    k.inputs.push_back(e);
  }
  for (const MoeGoldenTensor& t : c.outputs) {
    FakeRuntime::Exported e = p.runtime.ExportHandle(gpu, t.bytes + 1);
    std::memset(e.ptr, 0xEE, t.bytes + 1);
    v1::MoeOutput* o = k.item.add_outputs();
    o->set_name(t.name);
    *o->mutable_destination()->mutable_ipc() = Buffer(e, gpu, t.bytes);
    k.outputs.push_back(e);
  }
  return k;
}

std::string Hash(const FakeRuntime::Exported& e, uint64_t n) {
  return Sha256Hex(std::vector<uint8_t>(e.ptr, e.ptr + n));
}

// Every success case of both manifests, IPC -> IPC in one batch on fake GPU 1: the outputs
// are written in place, the byte after each is untouched, and the daemon allocated nothing.
TEST(MoeIpc, EveryReferenceCaseIpcToIpcInPlaceWithNoDeviceMemory) {
  Parts p(2);
  std::vector<const MoeGoldenCase*> cases;
  std::vector<IpcCase> ipc;
  v1::ConvertBatchRequest req;
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (c.error) continue;
    cases.push_back(&c);
    ipc.push_back(MakeIpcCase(p, c, 1));
    *req.add_items()->mutable_moe() = ipc.back().item;
  }
  ASSERT_EQ(cases.size(), 54u);
  absl::StatusOr<std::vector<MoeJob>> jobs = server::MoeJobsFromProto(req, MoeLimits{});
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  v1::ConvertBatchResponse resp;
  const absl::Status run = server::RunMoeJobs(*jobs, p.engines(), absl::InfiniteFuture(), &resp);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(resp.items_size(), 54);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i]->name);
    const v1::BatchItemResult& r = resp.items(static_cast<int>(i));
    EXPECT_EQ(r.engine(), p.devices->gpu(1).engine_name());
    ASSERT_EQ(r.outputs_size(), static_cast<int>(cases[i]->outputs.size()));
    for (size_t j = 0; j < cases[i]->outputs.size(); ++j) {
      const MoeGoldenTensor& want = cases[i]->outputs[j];
      EXPECT_EQ(Hash(ipc[i].outputs[j], want.bytes), want.sha256) << want.name;
      EXPECT_EQ(ipc[i].outputs[j].ptr[want.bytes], 0xEE) << want.name << ": a byte past the output was written";
      EXPECT_TRUE(r.outputs(static_cast<int>(j)).inline_bytes().empty());
      EXPECT_EQ(r.outputs(static_cast<int>(j)).bytes(), want.bytes);
      EXPECT_EQ(r.outputs(static_cast<int>(j)).name(), want.name);
    }
  }
  EXPECT_EQ(p.runtime.counts(1).converts, 54);
  EXPECT_EQ(p.runtime.counts(0).converts, 0);
  EXPECT_EQ(p.runtime.totals().device_bytes_peak, 0u);
}

const MoeGoldenCase& W13() {
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (c.name == "prepare_w13_e2_i96_h160") return c;
  }
  ADD_FAILURE() << "no case";
  std::abort();
}

// Each IPC problem of the second item of a batch: its code, the operand its message names,
// and nothing written to the first (good) item's outputs.
TEST(MoeIpc, IpcProblemsNameTheirOperandAndNothingIsWritten) {
  struct Bad {
    std::string what;
    std::function<void(Parts&, v1::MoeItem&)> edit;
    std::string starts;
    bool at_edge;  // caught by MoeJobsFromProto (else by RunMoeJobs' mapping)
  };
  const std::vector<Bad> table = {
      {"short handle", [](Parts&, v1::MoeItem& m) { m.mutable_inputs(1)->mutable_source()->mutable_ipc()->set_handle("x"); },
       "items[1].moe.scales.source.ipc.handle", true},
      {"destination too small",
       [](Parts&, v1::MoeItem& m) { m.mutable_outputs(0)->mutable_destination()->mutable_ipc()->set_size(100); },
       "items[1].moe.values.destination.ipc.size", true},
      {"strided source",
       [](Parts&, v1::MoeItem& m) { m.mutable_inputs(0)->mutable_source()->mutable_ipc()->add_strides(1); },
       "items[1].moe.values.source.ipc.strides", true},
      {"one inline input", [](Parts&, v1::MoeItem& m) { m.mutable_inputs(2)->mutable_source()->set_inline_bytes("x"); },
       "items[1].moe.bias.source", true},
      {"an output without IPC", [](Parts&, v1::MoeItem& m) { m.mutable_outputs()->RemoveLast(); },
       "items[1].moe.bias.destination.ipc is not set", true},
      {"operands on two GPUs",
       [](Parts& p, v1::MoeItem& m) {
         *m.mutable_outputs(1)->mutable_destination()->mutable_ipc() = Buffer(p.runtime.ExportHandle(0, 8192), 0, 8192);
       },
       "items[1].moe.scales.destination.ipc.device_uuid", true},
      {"an output over an input",
       [](Parts&, v1::MoeItem& m) {
         v1::CudaIpcBuffer* dst = m.mutable_outputs(1)->mutable_destination()->mutable_ipc();
         const uint64_t size = dst->size();
         *dst = m.inputs(0).source().ipc();  // values' memory (30720 bytes) for scales (8192)
         dst->set_size(size);
       },
       "items[1].moe.scales.destination.ipc overlaps values.source.ipc", true},
      {"two outputs in one place",
       [](Parts&, v1::MoeItem& m) {
         v1::CudaIpcBuffer* dst = m.mutable_outputs(2)->mutable_destination()->mutable_ipc();
         const uint64_t size = dst->size();
         *dst = m.outputs(0).destination().ipc();
         dst->set_offset(1000);
         dst->set_size(size);
       },
       "items[1].moe.bias.destination.ipc overlaps values.destination.ipc", true},
      {"a range past the allocation",
       [](Parts&, v1::MoeItem& m) { m.mutable_inputs(1)->mutable_source()->mutable_ipc()->set_offset(64); },
       "items[1].moe.scales.source.ipc", false},
      {"a GPU the daemon does not serve",
       [](Parts&, v1::MoeItem& m) {
         for (auto& in : *m.mutable_inputs()) {
           const server::Uuid u = FakeRuntime::FakeUuid(7);
           in.mutable_source()->mutable_ipc()->set_device_uuid(std::string(reinterpret_cast<const char*>(u.data()), 16));
         }
         for (auto& o : *m.mutable_outputs()) {
           const server::Uuid u = FakeRuntime::FakeUuid(7);
           o.mutable_destination()->mutable_ipc()->set_device_uuid(std::string(reinterpret_cast<const char*>(u.data()), 16));
         }
       },
       "items[1].moe.values.source.ipc.device_uuid", false},
  };
  for (const Bad& b : table) {
    SCOPED_TRACE(b.what);
    Parts p(2);
    IpcCase good = MakeIpcCase(p, W13(), 1), bad = MakeIpcCase(p, W13(), 1);
    b.edit(p, bad.item);
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_moe() = good.item;
    *req.add_items()->mutable_moe() = bad.item;
    absl::StatusOr<std::vector<MoeJob>> jobs = server::MoeJobsFromProto(req, MoeLimits{});
    absl::Status s = jobs.status();
    EXPECT_EQ(b.at_edge, !s.ok()) << s;
    if (s.ok()) {
      v1::ConvertBatchResponse resp;
      s = server::RunMoeJobs(*jobs, p.engines(), absl::InfiniteFuture(), &resp);
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(std::string(s.message()).rfind(b.starts, 0), 0u) << s;
    for (size_t j = 0; j < good.outputs.size(); ++j) {
      const uint64_t n = W13().outputs[j].bytes;
      EXPECT_EQ(std::vector<uint8_t>(good.outputs[j].ptr, good.outputs[j].ptr + n), std::vector<uint8_t>(n, 0xEE))
          << "the good item's " << W13().outputs[j].name << " was written";
    }
    EXPECT_EQ(p.runtime.totals().converts, 0);
  }
}

}  // namespace
}  // namespace wprep::testing
