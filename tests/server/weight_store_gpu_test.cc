// Weight sets kept on a GPU, on the fake GPUs of FakeRuntime (host memory standing in for
// device memory): the set's bytes in its one shared allocation equal the checkpoint's
// (copies, slices read as runs across the staging pieces, conversions by the GPU's engine),
// attach hands out an IPC handle that opens onto them, the budget holds per GPU apart from
// host memory, a GPU without room or one the daemon does not serve is refused with nothing
// left behind, and a drop frees the memory and its handle.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device/device_manager.h"
#include "exec/weight_store.h"
#include "fake_runtime.h"
#include "net/metrics.h"
#include "safetensors_files.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/server/options.h"

namespace wprep::testing {
namespace {

using server::WeightRuleSpec;
using server::WeightStore;

ConversionSpec Swizzle(Layout layout) {
  ConversionSpec s;
  s.layout = layout;
  s.direction = Direction::kSwizzle;
  return s;
}

// Rows [start, start + length) of each index of axis 0 of a [a, b] byte tensor, as the
// set keeps a slice along axis 1.
std::vector<uint8_t> Columns(const Tensor& t, int64_t start, int64_t length) {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < t.shape[0]; ++r) {
    const uint8_t* row = t.bytes.data() + r * t.shape[1];
    out.insert(out.end(), row + start, row + start + length);
  }
  return out;
}

class WeightStoreGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wprep-wsgpu-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::filesystem::create_directories(dir_ + "/root");
    std::filesystem::create_directories(dir_ + "/shm");
    metrics_ = *server::Metrics::Create("", true);
    server::Options o;
    devices_ = *server::DeviceManager::Create(o, &runtime_, metrics_.get());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<WeightStore> Store(uint64_t budget, bool with_gpus = true) {
    return std::make_unique<WeightStore>(dir_ + "/root", budget, 1, dir_ + "/shm", server::WeightStoreObserver{},
                                         with_gpus ? devices_.get() : nullptr);
  }

  // A checkpoint with a tensor larger than one staging piece (64 MiB) kept as a slice of
  // odd-length runs, a swizzled value and scale pair, and a BF16 copy.
  std::vector<Tensor> Checkpoint() {
    return {
        {"big", "U8", {68, 1 << 20}, Pattern(68u << 20, 7)},
        {"experts_blocks", "U8", {2, 256, 128}, Pattern(2 * 256 * 128, 1)},
        {"experts_scales", "U8", {2, 256, 8}, Pattern(2 * 256 * 8, 2)},
        {"embed", "BF16", {16, 8}, Pattern(16 * 8 * 2, 4)},
    };
  }
  std::vector<WeightRuleSpec> Rules() {
    std::vector<WeightRuleSpec> rules(3);
    rules[0].pattern = "big";
    rules[0].slice = server::WeightSliceSpec{1, 3, (1 << 20) - 5};
    rules[1].pattern = "*_blocks";
    rules[1].convert = Swizzle(Layout::kHopperValue);
    rules[2].pattern = "*_scales";
    rules[2].convert = Swizzle(Layout::kHopperScale);
    return rules;
  }
  // What the set must hold for `t`.
  std::vector<uint8_t> Want(const Tensor& t) {
    if (t.name == "big") return Columns(t, 3, (1 << 20) - 5);
    if (t.name == "embed") return t.bytes;
    const ConversionSpec spec = Swizzle(t.name == "experts_blocks" ? Layout::kHopperValue : Layout::kHopperScale);
    std::vector<int64_t> logical = t.shape;
    if (t.name == "experts_blocks") logical.back() *= 2;
    absl::StatusOr<Plan> plan = MakePlan(spec, logical);
    EXPECT_TRUE(plan.ok()) << plan.status();
    std::vector<uint8_t> out(plan->output_bytes);
    EXPECT_TRUE(ConvertOnCpu(*plan, t.bytes.data(), t.bytes.size(), out.data(), out.size()).ok());
    return out;
  }

  absl::StatusOr<std::shared_ptr<const server::WeightManifestData>> Load(WeightStore& store, const std::string& name,
                                                                        std::optional<server::Uuid> gpu) {
    return store.Load(name, "model.safetensors", Rules(), [](const server::WeightLoadProgress&) { return true; },
                      server::WeightPlacement{gpu, std::nullopt});
  }

  std::string dir_;
  FakeRuntime runtime_{2};
  std::unique_ptr<server::Metrics> metrics_;
  std::unique_ptr<server::DeviceManager> devices_;
};

TEST_F(WeightStoreGpuTest, LoadsOntoTheGpuAndAttachOpensTheSameBytes) {
  const std::vector<Tensor> cp = Checkpoint();
  WriteSafetensors(dir_ + "/root/model.safetensors", cp);
  auto store = Store(0);
  const server::Uuid gpu1 = FakeRuntime::FakeUuid(1);
  auto m = Load(*store, "g", gpu1);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE((*m)->gpu.has_value());
  EXPECT_EQ(*(*m)->gpu, gpu1);
  EXPECT_EQ(runtime_.counts(1).device_bytes_now, (*m)->total_bytes) << "the staging scratch is freed, the set kept";
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u);

  auto a = store->Attach("g");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->shm_path.empty());
  ASSERT_EQ(a->ipc_handle.size(), server::kIpcHandleBytes);
  absl::StatusOr<server::IpcMapping> mapped = runtime_.OpenIpc(1, a->ipc_handle);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_GE(mapped->bytes, (*m)->total_bytes);
  const auto* base = static_cast<const uint8_t*>(mapped->base);
  ASSERT_EQ((*m)->tensors.size(), cp.size());
  for (size_t i = 0; i < cp.size(); ++i) {
    const server::WeightEntry& e = (*m)->tensors[i];
    SCOPED_TRACE(e.name);
    const std::vector<uint8_t> want = Want(cp[i]);
    ASSERT_EQ(e.bytes, want.size());
    EXPECT_TRUE(std::memcmp(base + e.offset, want.data(), want.size()) == 0) << "bytes differ";
  }
  EXPECT_TRUE(runtime_.CloseIpc(1, mapped->base).ok());
  EXPECT_GE(runtime_.counts(1).converts, 2);  // the pair converted by the GPU's engine

  // Attached: a plain drop is refused; after detaching, the drop frees the memory, and the
  // handle no longer opens.
  EXPECT_EQ(store->Drop("g", false).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store->Detach(a->id).ok());
  EXPECT_TRUE(store->Hold(a->id, [] { return false; }).ok());
  auto freed = store->Drop("g", false);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, (*m)->total_bytes);
  EXPECT_EQ(runtime_.counts(1).device_bytes_now, 0u);
  EXPECT_FALSE(runtime_.OpenIpc(1, a->ipc_handle).ok());
}

TEST_F(WeightStoreGpuTest, TheBudgetHoldsPerGpuAndForHostMemoryApart) {
  WriteSafetensors(dir_ + "/root/model.safetensors", Checkpoint());
  // Learn the set's size from an unlimited store, then allow exactly one such set a place.
  uint64_t size = 0;
  {
    auto probe = Store(0);
    auto m = Load(*probe, "probe", FakeRuntime::FakeUuid(0));
    ASSERT_TRUE(m.ok()) << m.status();
    size = (*m)->total_bytes;
  }
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u) << "the store's sets go with it";
  auto store = Store(size);
  ASSERT_TRUE(Load(*store, "a", FakeRuntime::FakeUuid(0)).ok());
  const uint64_t held = runtime_.counts(0).device_bytes_now;
  auto second = Load(*store, "b", FakeRuntime::FakeUuid(0));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  EXPECT_NE(second.status().message().find("on that GPU"), std::string::npos) << second.status();
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, held) << "a refused load allocated";
  // The other GPU and host memory have budgets of their own.
  EXPECT_TRUE(Load(*store, "b", FakeRuntime::FakeUuid(1)).ok());
  EXPECT_TRUE(Load(*store, "c", std::nullopt).ok());
  EXPECT_EQ(store->List().size(), 3u);
  EXPECT_EQ(store->resident_bytes(), 3 * size);
}

TEST_F(WeightStoreGpuTest, AGpuWithoutRoomOrNotServedIsRefusedAndNothingStays) {
  WriteSafetensors(dir_ + "/root/model.safetensors", Checkpoint());
  auto store = Store(0);
  runtime_.SetDeviceCapacity(0, 1 << 20);
  auto full = Load(*store, "a", FakeRuntime::FakeUuid(0));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u);
  EXPECT_TRUE(store->List().empty());
  // The name is free again, and the set loads where there is room.
  EXPECT_TRUE(Load(*store, "a", FakeRuntime::FakeUuid(1)).ok());

  server::Uuid stranger{};
  stranger[0] = 0xEE;
  auto unknown = Load(*store, "x", stranger);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument) << unknown.status();
  EXPECT_NE(unknown.status().message().find("device_uuid"), std::string::npos) << unknown.status();

  auto host_only = Store(0, /*with_gpus=*/false);
  auto none = Load(*host_only, "y", FakeRuntime::FakeUuid(0));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
  EXPECT_EQ(store->List().size(), 1u);
}

// A GPU named by its index in the daemon's list (what a --preload file shared by nodes
// does): the set lands on that GPU and reports its UUID; an index past the last, or both
// ways of naming a GPU, are refused.
TEST_F(WeightStoreGpuTest, AGpuByItsIndexInTheDaemonsList) {
  WriteSafetensors(dir_ + "/root/model.safetensors", Checkpoint());
  auto store = Store(0);
  auto progress = [](const server::WeightLoadProgress&) { return true; };
  auto m = store->Load("i", "model.safetensors", Rules(), progress, server::WeightPlacement{std::nullopt, 1});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE((*m)->gpu.has_value());
  EXPECT_EQ(*(*m)->gpu, FakeRuntime::FakeUuid(1));
  EXPECT_EQ(runtime_.counts(1).device_bytes_now, (*m)->total_bytes);
  auto past = store->Load("j", "model.safetensors", Rules(), progress, server::WeightPlacement{std::nullopt, 2});
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  EXPECT_NE(past.status().message().find("device_index"), std::string::npos) << past.status();
  auto both = store->Load("j", "model.safetensors", Rules(), progress,
                          server::WeightPlacement{FakeRuntime::FakeUuid(0), 0});
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument) << both.status();
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u);
  EXPECT_EQ(store->List().size(), 1u);
}

TEST_F(WeightStoreGpuTest, AMalformedCheckpointIsRefusedWithNoDeviceMemoryLeft) {
  // A header that promises more data than the file holds.
  std::vector<Tensor> cp = {{"w", "U8", {1024}, Pattern(1024, 9)}};
  WriteSafetensors(dir_ + "/root/model.safetensors", cp);
  const std::string path = dir_ + "/root/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  auto store = Store(0);
  auto m = store->Load("w", "model.safetensors", {}, [](const server::WeightLoadProgress&) { return true; },
                       server::WeightPlacement{FakeRuntime::FakeUuid(0), std::nullopt});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u);
  EXPECT_TRUE(store->List().empty());
}

TEST_F(WeightStoreGpuTest, ALoadCancelledHalfwayFreesItsDeviceMemory) {
  WriteSafetensors(dir_ + "/root/model.safetensors", Checkpoint());
  auto store = Store(0);
  int calls = 0;
  auto m = store->Load("c", "model.safetensors", Rules(),
                       [&](const server::WeightLoadProgress& p) { return ++calls < 3 || p.tensors_done == 0; },
                       server::WeightPlacement{FakeRuntime::FakeUuid(0), std::nullopt});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kCancelled) << m.status();
  EXPECT_GE(calls, 3) << "cancelled before any tensor was in place";
  EXPECT_EQ(runtime_.counts(0).device_bytes_now, 0u);
  EXPECT_TRUE(store->List().empty());
  EXPECT_TRUE(Load(*store, "c", FakeRuntime::FakeUuid(0)).ok()) << "the name stayed taken";
}

}  // namespace
}  // namespace wprep::testing
