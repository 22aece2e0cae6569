// The quantize batch item. Through a real wprepd on the CPU engine (inline bytes): every
// quantization reference case byte for byte in ConvertBatch and ConvertBatches, the fused
// Blackwell pair equal to the engine's, each output's name, shape and identity, and every
// malformed item refused with a status naming its field while the daemon serves on. Below
// the wire, on the fake GPUs of FakeRuntime: IPC -> IPC in place with no device memory of
// the daemon's, and IPC problems naming their operand with nothing written.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/time/time.h"
#include "daemon_harness.h"
#include "device/device_manager.h"
#include "fake_runtime.h"
#include "golden.h"
#include "device/ipc_cache.h"
#include "net/metrics.h"
#include "nlohmann/json.hpp"
#include "rpc/quantize_item.h"
#include "wprep/client/client.h"
#include "wprep/kernels/quantize.h"
#include "wprep/server/options.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

struct QuantCase {
  std::string name, dtype, rounding;
  std::vector<int64_t> shape, values_shape, scales_shape;
  std::vector<uint8_t> input;
  std::string values_sha256, scales_sha256;
};

const std::vector<QuantCase>& QuantCases() {
  static const std::vector<QuantCase>* cases = [] {
    auto* out = new std::vector<QuantCase>;
    const std::string dir = TestDataDir("golden_quant") + "/";
    std::ifstream f(dir + "manifest.json");
    const nlohmann::json m = nlohmann::json::parse(f);
    for (const auto& c : m["cases"]) {
      QuantCase q;
      q.name = c["name"].get<std::string>();
      q.dtype = c["input_dtype"].get<std::string>();
      q.rounding = c["params"]["scale_rounding"].get<std::string>();
      q.shape = c["input_shape"].get<std::vector<int64_t>>();
      q.values_shape = c["values_shape"].get<std::vector<int64_t>>();
      q.scales_shape = c["scales_shape"].get<std::vector<int64_t>>();
      q.input = ReadFile(dir + c["input"].get<std::string>());
      q.values_sha256 = c["values_sha256"].get<std::string>();
      q.scales_sha256 = c["scales_sha256"].get<std::string>();
      out->push_back(std::move(q));
    }
    return out;
  }();
  return *cases;
}

v1::QuantizeDType DTypeOf(const std::string& name) {
  if (name == "bfloat16") return v1::QUANTIZE_DTYPE_BFLOAT16;
  if (name == "float16") return v1::QUANTIZE_DTYPE_FLOAT16;
  if (name == "float32") return v1::QUANTIZE_DTYPE_FLOAT32;
  ADD_FAILURE() << "dtype " << name;
  return v1::QUANTIZE_DTYPE_UNSPECIFIED;
}

v1::QuantizeItem ItemFor(const QuantCase& c) {
  v1::QuantizeItem item;
  item.set_dtype(DTypeOf(c.dtype));
  for (int64_t d : c.shape) item.add_shape(d);
  item.set_scale_rounding(c.rounding == "down" ? v1::SCALE_ROUNDING_DOWN : v1::SCALE_ROUNDING_UP);
  item.mutable_source()->set_inline_bytes(c.input.data(), c.input.size());
  return item;
}

std::vector<int64_t> Shape(const v1::TensorResult& t) { return {t.shape().begin(), t.shape().end()}; }
std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

void ExpectCaseResult(const QuantCase& c, const v1::BatchItemResult& r) {
  ASSERT_EQ(r.outputs_size(), 2);
  EXPECT_EQ(r.engine(), "cpu");
  const v1::TensorResult& v = r.outputs(0);
  const v1::TensorResult& s = r.outputs(1);
  EXPECT_EQ(v.name(), "values");
  EXPECT_EQ(s.name(), "scales");
  EXPECT_EQ(Shape(v), c.values_shape);
  EXPECT_EQ(Shape(s), c.scales_shape);
  EXPECT_EQ(Sha256Hex(Bytes(v.inline_bytes())), c.values_sha256);
  EXPECT_EQ(Sha256Hex(Bytes(s.inline_bytes())), c.scales_sha256);
  EXPECT_EQ(v.bytes(), v.inline_bytes().size());
  EXPECT_EQ(v.identity().conversion(),
            c.dtype + " -> quantize_mxfp4(scale_rounding=" + c.rounding + ") -> canonical(packing_axis=-1)");
  EXPECT_EQ(v.identity().contract_version(), 1u);
}

class QuantizeItemTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    daemon_ = Daemon::Start({"--devices=cpu", "--cpu-threads=2"}, &error).release();
    ASSERT_NE(daemon_, nullptr) << error;
    ASSERT_TRUE(daemon_->WaitServing(absl::Seconds(60))) << daemon_->Log();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  static inline Daemon* daemon_ = nullptr;
};

TEST_F(QuantizeItemTest, EveryReferenceCaseInOneConvertBatch) {
  v1::ConvertBatchRequest req;
  for (const QuantCase& c : QuantCases()) *req.add_items()->mutable_quantize() = ItemFor(c);
  ASSERT_EQ(req.items_size(), 40);
  Client client(MakeChannel(daemon_->unix_target()));
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->items_size(), 40);
  for (int i = 0; i < 40; ++i) {
    SCOPED_TRACE(QuantCases()[static_cast<size_t>(i)].name);
    ExpectCaseResult(QuantCases()[static_cast<size_t>(i)], resp->items(i));
  }
}

TEST_F(QuantizeItemTest, EveryReferenceCaseThroughConvertBatchesOverTcp) {
  auto stub = v1::WeightPrep::NewStub(MakeChannel(daemon_->tcp_target()));
  grpc::ClientContext ctx;
  auto stream = stub->ConvertBatches(&ctx);
  for (const QuantCase& c : QuantCases()) {
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_quantize() = ItemFor(c);
    ASSERT_TRUE(stream->Write(req));
  }
  stream->WritesDone();
  v1::ConvertBatchesResponse answer;
  size_t n = 0;
  while (stream->Read(&answer)) {
    ASSERT_LT(answer.index(), QuantCases().size());
    const QuantCase& c = QuantCases()[answer.index()];
    SCOPED_TRACE(c.name);
    ASSERT_EQ(answer.code(), 0) << answer.message();
    ASSERT_EQ(answer.batch().items_size(), 1);
    ExpectCaseResult(c, answer.batch().items(0));
    ++n;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(n, QuantCases().size());
}

// An inline bf16 item of `shape` into `layout`, and the daemon's answer to it alone.
v1::QuantizeItem InlineBf16Item(const std::vector<int64_t>& shape, v1::QuantizeLayout layout,
                                const std::vector<uint8_t>& in) {
  v1::QuantizeItem item;
  item.set_dtype(v1::QUANTIZE_DTYPE_BFLOAT16);
  for (int64_t d : shape) item.add_shape(d);
  item.set_layout(layout);
  item.mutable_source()->set_inline_bytes(in.data(), in.size());
  return item;
}

absl::StatusOr<v1::BatchItemResult> Answer(Client& client, const v1::QuantizeItem& item) {
  v1::ConvertBatchRequest req;
  *req.add_items()->mutable_quantize() = item;
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  if (!resp.ok()) return resp.status();
  return resp->items(0);
}

// Empty tensors come back with torch's dense strides (a dim of size 0 counts as 1), the
// strides a convert item reports for them.
TEST_F(QuantizeItemTest, EmptyOutputsReportTorchsDenseStrides) {
  Client client(MakeChannel(daemon_->unix_target()));
  struct Case {
    std::vector<int64_t> shape;
    v1::QuantizeLayout layout;
    std::vector<int64_t> values_strides, scales_strides;
  };
  for (const Case& c : std::vector<Case>{{{3, 0, 64}, v1::QUANTIZE_LAYOUT_CANONICAL, {32, 32, 1}, {2, 2, 1}},
                                         {{2, 0, 64}, v1::QUANTIZE_LAYOUT_BLACKWELL, {128, 128, 1}, {1, 1}}}) {
    SCOPED_TRACE(::testing::PrintToString(c.shape));
    absl::StatusOr<v1::BatchItemResult> r = Answer(client, InlineBf16Item(c.shape, c.layout, {}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(std::vector<int64_t>(r->outputs(0).strides().begin(), r->outputs(0).strides().end()),
              c.values_strides);
    EXPECT_EQ(std::vector<int64_t>(r->outputs(1).strides().begin(), r->outputs(1).strides().end()),
              c.scales_strides);
  }
}

// The fused Blackwell pair over the wire equals the engine's, which the kernel tests hold to
// quantize-then-swizzle; shapes with and without padding.
TEST_F(QuantizeItemTest, BlackwellPairOverTheWireEqualsTheEngine) {
  std::mt19937_64 rng(2804);
  Client client(MakeChannel(daemon_->unix_target()));
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{2, 130, 96}, {1, 128, 256}, {3, 7, 34}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape, ScaleRounding::kDown);
    ASSERT_TRUE(plan.ok());
    const QuantLayoutSpec spec{QuantLayout::kBlackwell};
    absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(*plan, spec);
    ASSERT_TRUE(sizes.ok());
    std::vector<uint8_t> in(static_cast<size_t>(plan->input_bytes));
    for (size_t i = 0; i < in.size(); i += 2) {  // bf16 normals over a few binades
      const uint64_t r = rng();
      in[i] = static_cast<uint8_t>(r);
      in[i + 1] = static_cast<uint8_t>(0x3C + (r >> 8) % 8 + ((r >> 16) & 1) * 0x80);
    }
    std::vector<uint8_t> v(static_cast<size_t>(sizes->values_bytes)), s(static_cast<size_t>(sizes->scales_bytes));
    ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), v.data(), v.size(), s.data(), s.size()).ok());
    v1::QuantizeItem item = InlineBf16Item(shape, v1::QUANTIZE_LAYOUT_BLACKWELL, in);
    item.set_scale_rounding(v1::SCALE_ROUNDING_DOWN);
    absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
    ASSERT_TRUE(answer.ok()) << answer.status();
    const v1::BatchItemResult& r = *answer;
    EXPECT_EQ(Bytes(r.outputs(0).inline_bytes()), v);
    EXPECT_EQ(Bytes(r.outputs(1).inline_bytes()), s);
    EXPECT_EQ(r.outputs(0).identity().layout(), "BlackwellMXValueLayout()");
    EXPECT_EQ(r.outputs(1).identity().layout(), "BlackwellMXScaleLayout()");
    EXPECT_EQ(r.outputs(0).identity().conversion(),
              "bfloat16 -> quantize_mxfp4(scale_rounding=down) -> canonical(packing_axis=-2) -> "
              "BlackwellMXValueLayout()");
    EXPECT_EQ(Shape(r.outputs(0)), (std::vector<int64_t>{shape[0], shape[1], (shape[2] / 2 + 127) / 128 * 128}));
  }
}

// Random bf16 bytes of `shape` and the CPU engine's `spec` outputs of them (scales rounded up).
struct EngineBytes {
  std::vector<uint8_t> in, values, scales;
};

EngineBytes OnTheEngine(const std::vector<int64_t>& shape, const QuantLayoutSpec& spec, std::mt19937_64& rng) {
  EngineBytes out;
  absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape, ScaleRounding::kUp);
  EXPECT_TRUE(plan.ok());
  if (!plan.ok()) return out;
  absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(*plan, spec);
  EXPECT_TRUE(sizes.ok()) << sizes.status();
  if (!sizes.ok()) return out;
  out.in.resize(static_cast<size_t>(plan->input_bytes));
  for (auto& b : out.in) b = static_cast<uint8_t>(rng());
  out.values.resize(static_cast<size_t>(sizes->values_bytes));
  out.scales.resize(static_cast<size_t>(sizes->scales_bytes));
  EXPECT_TRUE(QuantizeLayoutOnCpu(*plan, spec, out.in.data(), out.in.size(), out.values.data(), out.values.size(),
                                  out.scales.data(), out.scales.size())
                  .ok());
  return out;
}

// The shuffled Blackwell pair over the wire equals the engine's, with its tile; the values
// are reported as the blackwell_shuffled_value swizzle reports them ([M, ntk, ntn, tile_n,
// tile_k]), the scales as the Blackwell pair's. A tile out of range is refused naming it.
TEST_F(QuantizeItemTest, ShuffledBlackwellPairOverTheWireEqualsTheEngine) {
  std::mt19937_64 rng(2806);
  Client client(MakeChannel(daemon_->unix_target()));
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{2, 130, 96}, {3, 7, 34}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    QuantLayoutSpec spec{QuantLayout::kBlackwellShuffled};
    spec.block_k = 64;
    spec.block_n = 48;
    const EngineBytes want = OnTheEngine(shape, spec, rng);
    const std::vector<uint8_t>&v = want.values, &s = want.scales;
    v1::QuantizeItem item = InlineBf16Item(shape, v1::QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED, want.in);
    item.mutable_blackwell()->set_block_k(64);
    item.mutable_blackwell()->set_block_n(48);
    absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
    ASSERT_TRUE(answer.ok()) << answer.status();
    const v1::BatchItemResult& r = *answer;
    EXPECT_EQ(Bytes(r.outputs(0).inline_bytes()), v);
    EXPECT_EQ(Bytes(r.outputs(1).inline_bytes()), s);
    EXPECT_EQ(r.outputs(0).identity().layout(), "BlackwellMX4ValueShuffledLayout(block_k=64, block_n=48)");
    EXPECT_EQ(r.outputs(1).identity().layout(), "BlackwellMXScaleLayout()");
    const int64_t tile_k = 32, kpad = (shape[2] / 2 + 127) / 128 * 128;
    EXPECT_EQ(Shape(r.outputs(0)), (std::vector<int64_t>{shape[0], kpad / tile_k, (shape[1] + 47) / 48, 48, tile_k}));
    const int64_t mats = shape[0], per = ((shape[2] + 31) / 32 + 7) / 8 * 8 * ((shape[1] + 127) / 128 * 128);
    EXPECT_EQ(Shape(r.outputs(1)), (std::vector<int64_t>{mats, per}));
  }
  for (auto [field, k, n] : std::vector<std::tuple<const char*, int64_t, int64_t>>{
           {".blackwell.block_k", 0, 48}, {".blackwell.block_n", 64, 5000}, {"block_k", 63, 48}}) {
    v1::QuantizeItem item = InlineBf16Item({1, 8, 64}, v1::QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED,
                                           std::vector<uint8_t>(8 * 64 * 2, 0));
    item.mutable_blackwell()->set_block_k(k);
    item.mutable_blackwell()->set_block_n(n);
    absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
    ASSERT_FALSE(answer.ok());
    EXPECT_EQ(answer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(answer.status().message().find(field), absl::string_view::npos) << answer.status();
  }
  v1::QuantizeItem item = InlineBf16Item({1, 8, 64}, v1::QUANTIZE_LAYOUT_BLACKWELL, std::vector<uint8_t>(8 * 64 * 2, 0));
  item.mutable_blackwell()->set_block_k(64);
  absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
  ASSERT_FALSE(answer.ok());
  EXPECT_NE(answer.status().message().find(".blackwell is for layout QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED only"),
            absl::string_view::npos)
      << answer.status();
}

// The fused Hopper pair over the wire equals the engine's (held to quantize-then-swizzle by
// the kernel tests), with its parameters; shapes and strides are the swizzles' (transposed
// views of row-major memory), as a convert item of the same layout reports them.
TEST_F(QuantizeItemTest, HopperPairOverTheWireEqualsTheEngine) {
  std::mt19937_64 rng(2805);
  Client client(MakeChannel(daemon_->unix_target()));
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{2, 130, 96}, {1, 300, 64}, {3, 7, 34}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    QuantLayoutSpec spec;
    spec.layout = QuantLayout::kHopper;
    spec.mma_version = 2;
    spec.num_warps = 4;
    spec.align_k = 4;
    const EngineBytes want = OnTheEngine(shape, spec, rng);
    const std::vector<uint8_t>&v = want.values, &s = want.scales;
    v1::QuantizeItem item = InlineBf16Item(shape, v1::QUANTIZE_LAYOUT_HOPPER, want.in);
    item.mutable_hopper()->set_mma_version(2);
    item.mutable_hopper()->set_mx_axis(-2);
    item.mutable_hopper_scale()->set_num_warps(4);
    item.mutable_hopper_scale()->set_align_k(4);
    absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
    ASSERT_TRUE(answer.ok()) << answer.status();
    const v1::BatchItemResult& r = *answer;
    EXPECT_EQ(Bytes(r.outputs(0).inline_bytes()), v);
    EXPECT_EQ(Bytes(r.outputs(1).inline_bytes()), s);
    EXPECT_EQ(r.outputs(0).identity().layout(), "HopperMXValueLayout(mx_axis=-2, mma_version=2)");
    EXPECT_EQ(r.outputs(1).identity().layout(), "HopperMXScaleLayout(mx_axis=-2, num_warps=4)");
    EXPECT_EQ(r.outputs(1).identity().conversion(),
              "bfloat16 -> quantize_mxfp4(scale_rounding=up) -> scales(align_k=4) -> "
              "HopperMXScaleLayout(mx_axis=-2, num_warps=4)");
    // The value layout's memory [R/4, 4C] per matrix, reported as its transpose.
    const int64_t rows = (shape[1] + 255) / 256 * 256, cols = (shape[2] / 2 + 63) / 64 * 64;
    EXPECT_EQ(Shape(r.outputs(0)), (std::vector<int64_t>{shape[0], 4 * cols, rows / 4}));
    EXPECT_EQ(std::vector<int64_t>(r.outputs(0).strides().begin(), r.outputs(0).strides().end()),
              (std::vector<int64_t>{rows * cols, 1, 4 * cols}));
  }
}

// The trtllm layouts over the wire, with a bias of each type, equal the engine's (held to
// quantize-then-prepare by the kernel tests); the outputs carry the prepare's identities.
TEST_F(QuantizeItemTest, TrtllmLayoutsWithTheirBiasOverTheWireEqualTheEngine) {
  std::mt19937_64 rng(2806);
  Client client(MakeChannel(daemon_->unix_target()));
  for (const bool w13 : {true, false}) {
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "w13 " << w13 << " bf16 bias " << bf16);
      const std::vector<int64_t> shape = {3, 70, 96};
      absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape, ScaleRounding::kUp);
      ASSERT_TRUE(plan.ok());
      QuantLayoutSpec spec;
      spec.layout = w13 ? QuantLayout::kTrtllmW13 : QuantLayout::kTrtllmW2;
      spec.align = 128;
      absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(*plan, spec);
      ASSERT_TRUE(sizes.ok()) << sizes.status();
      std::vector<uint8_t> in(static_cast<size_t>(plan->input_bytes)), bias(3 * 70 * (bf16 ? 2 : 4));
      for (auto& b : in) b = static_cast<uint8_t>(rng());
      for (auto& b : bias) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> v(static_cast<size_t>(sizes->values_bytes)), sc(static_cast<size_t>(sizes->scales_bytes)),
          bo(static_cast<size_t>(sizes->bias_bytes));
      ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), v.data(), v.size(), sc.data(), sc.size(),
                                      QuantBias{bias.data(), bf16, bo.data()}).ok());
      v1::QuantizeItem item =
          InlineBf16Item(shape, w13 ? v1::QUANTIZE_LAYOUT_TRTLLM_W13 : v1::QUANTIZE_LAYOUT_TRTLLM_W2, in);
      item.set_align(128);
      item.mutable_bias()->set_inline_bytes(bias.data(), bias.size());
      item.set_bias_dtype(bf16 ? v1::QUANTIZE_DTYPE_BFLOAT16 : v1::QUANTIZE_DTYPE_FLOAT32);
      absl::StatusOr<v1::BatchItemResult> answer = Answer(client, item);
      ASSERT_TRUE(answer.ok()) << answer.status();
      const v1::BatchItemResult& r = *answer;
      ASSERT_EQ(r.outputs_size(), 3);
      EXPECT_EQ(Bytes(r.outputs(0).inline_bytes()), v);
      EXPECT_EQ(Bytes(r.outputs(1).inline_bytes()), sc);
      EXPECT_EQ(Bytes(r.outputs(2).inline_bytes()), bo);
      EXPECT_EQ(r.outputs(2).name(), "bias");
      const std::string op = w13 ? "prepare_w13" : "prepare_w2";
      EXPECT_EQ(r.outputs(0).moe_identity().op(), op);
      EXPECT_EQ(r.outputs(0).moe_identity().description(), "trtllm_gen:" + op + " format=mxfp4 align=128 contract=1");
      EXPECT_EQ(r.outputs(1).identity().conversion(),
                "bfloat16 -> quantize_mxfp4(scale_rounding=up) -> trtllm_gen:" + op + " format=mxfp4 align=128 contract=1");
      const int64_t rows = w13 ? 2 * 128 : 128;
      EXPECT_EQ(Shape(r.outputs(0)), (std::vector<int64_t>{3, rows, 64}));
      EXPECT_EQ(Shape(r.outputs(1)), (std::vector<int64_t>{3, rows, 4}));
      EXPECT_EQ(Shape(r.outputs(2)), (std::vector<int64_t>{3, rows}));
    }
  }
}

// Each malformed batch {good, bad}: its code and the field its message starts with; then a
// good batch is still served.
TEST_F(QuantizeItemTest, MalformedItemsNameTheirFieldAndTheDaemonServesOn) {
  const v1::QuantizeItem good = ItemFor(QuantCases()[0]);
  struct Bad {
    std::string what;
    std::function<void(v1::ConvertBatchRequest&)> edit;
    grpc::StatusCode code;
    std::string starts;
  };
  auto q = [](v1::ConvertBatchRequest& r) { return r.mutable_items(1)->mutable_quantize(); };
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const std::vector<Bad> table = {
      {"no dtype", [&](auto& r) { q(r)->clear_dtype(); }, kInvalid, "items[1].quantize.dtype"},
      {"unknown dtype", [&](auto& r) { q(r)->set_dtype(static_cast<v1::QuantizeDType>(9)); }, kInvalid,
       "items[1].quantize.dtype"},
      {"unknown rounding", [&](auto& r) { q(r)->set_scale_rounding(static_cast<v1::ScaleRounding>(7)); }, kInvalid,
       "items[1].quantize.scale_rounding"},
      {"unknown layout", [&](auto& r) { q(r)->set_layout(static_cast<v1::QuantizeLayout>(5)); }, kInvalid,
       "items[1].quantize.layout"},
      {"no shape", [&](auto& r) { q(r)->clear_shape(); }, kInvalid, "items[1].quantize.shape"},
      {"negative dim", [&](auto& r) { q(r)->set_shape(0, -4); }, kInvalid, "items[1].quantize.shape"},
      {"huge dims", [&](auto& r) { q(r)->set_shape(0, int64_t{1} << 40); q(r)->add_shape(int64_t{1} << 40); },
       kInvalid, "items[1].quantize"},
      {"Blackwell of a rank-1 tensor",
       [&](auto& r) {
         q(r)->clear_shape();
         q(r)->add_shape(32);
         q(r)->set_layout(v1::QUANTIZE_LAYOUT_BLACKWELL);
         q(r)->mutable_source()->mutable_inline_bytes()->resize(64);
       },
       kInvalid, "items[1].quantize.layout"},
      {"Hopper parameters without the Hopper layout", [&](auto& r) { q(r)->mutable_hopper_scale()->set_num_warps(4); },
       kInvalid, "items[1].quantize.hopper_scale"},
      {"a Hopper scale mx_axis of -1",
       [&](auto& r) {
         q(r)->clear_shape();
         q(r)->add_shape(2);
         q(r)->add_shape(32);
         q(r)->set_layout(v1::QUANTIZE_LAYOUT_HOPPER);
         q(r)->mutable_hopper_scale()->set_mx_axis(-1);
         q(r)->mutable_source()->mutable_inline_bytes()->resize(128);
       },
       kInvalid, "items[1].quantize.hopper_scale.mx_axis"},
      {"a Hopper num_warps not a power of two",
       [&](auto& r) {
         q(r)->clear_shape();
         q(r)->add_shape(2);
         q(r)->add_shape(32);
         q(r)->set_layout(v1::QUANTIZE_LAYOUT_HOPPER);
         q(r)->mutable_hopper_scale()->set_num_warps(6);
         q(r)->mutable_source()->mutable_inline_bytes()->resize(128);
       },
       kInvalid, "items[1].quantize.layout QUANTIZE_LAYOUT_HOPPER: num_warps"},
      {"a bias without a trtllm layout", [&](auto& r) { q(r)->mutable_bias()->set_inline_bytes("abcd"); }, kInvalid,
       "items[1].quantize.bias"},
      {"a trtllm layout on a matrix",
       [&](auto& r) {
         q(r)->clear_shape();
         q(r)->add_shape(2);
         q(r)->add_shape(32);
         q(r)->set_layout(v1::QUANTIZE_LAYOUT_TRTLLM_W2);
         q(r)->mutable_source()->mutable_inline_bytes()->resize(128);
       },
       kInvalid, "items[1].quantize.layout QUANTIZE_LAYOUT_TRTLLM_W2: shape"},
      {"a trtllm bias of the wrong size",
       [&](auto& r) {
         q(r)->clear_shape();
         for (int d : {1, 2, 32}) q(r)->add_shape(d);
         q(r)->set_layout(v1::QUANTIZE_LAYOUT_TRTLLM_W13);
         q(r)->mutable_source()->mutable_inline_bytes()->resize(128);
         q(r)->mutable_bias()->set_inline_bytes(std::string(4, 'x'));
         q(r)->set_bias_dtype(v1::QUANTIZE_DTYPE_FLOAT32);
       },
       kInvalid, "items[1].quantize.bias"},
      {"no source", [&](auto& r) { q(r)->clear_source(); }, kInvalid, "items[1].quantize.source"},
      {"short input", [&](auto& r) { q(r)->mutable_source()->mutable_inline_bytes()->pop_back(); }, kInvalid,
       "items[1].quantize.source.inline_bytes"},
      {"strided", [&](auto& r) { q(r)->mutable_source()->add_inline_strides(2); }, kInvalid,
       "items[1].quantize.source.inline_strides"},
      {"IPC output of an inline item", [&](auto& r) { q(r)->mutable_values()->mutable_ipc()->set_size(1); }, kInvalid,
       "items[1].quantize.values.ipc"},
      {"IPC source without a handle", [&](auto& r) { q(r)->mutable_source()->mutable_ipc()->set_size(1 << 20); },
       kInvalid, "items[1].quantize.source.ipc.handle"},
      {"a convert item beside it", [&](auto& r) { r.mutable_items(1)->mutable_convert(); }, kInvalid, "items[1]"},
      {"a fence", [&](auto& r) { r.set_answer_when(v1::ANSWER_WHEN_QUEUED); }, grpc::StatusCode::UNIMPLEMENTED,
       "answer_when"},
  };
  Client client(MakeChannel(daemon_->unix_target()));
  for (const Bad& b : table) {
    SCOPED_TRACE(b.what);
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_quantize() = good;
    *req.add_items()->mutable_quantize() = good;
    b.edit(req);
    absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
    ASSERT_FALSE(resp.ok());
    EXPECT_EQ(static_cast<int>(resp.status().code()), static_cast<int>(b.code)) << resp.status();
    EXPECT_EQ(std::string(resp.status().message()).rfind(b.starts, 0), 0u) << resp.status();
  }
  v1::ConvertBatchRequest req;
  *req.add_items()->mutable_quantize() = good;
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  ASSERT_TRUE(resp.ok()) << resp.status() << daemon_->Log();
  ExpectCaseResult(QuantCases()[0], resp->items(0));
}

// Below the wire, on fake GPUs (host memory standing in for the client's device memory).
struct Parts {
  explicit Parts(int gpus) : runtime(gpus) {
    server::Options o;
    metrics = *server::Metrics::Create("", true);
    devices = *server::DeviceManager::Create(o, &runtime, metrics.get());
    ipc = std::make_unique<server::IpcCache>(&runtime, 512, absl::Minutes(5), metrics.get());
  }
  server::MoeEngines engines() { return server::MoeEngines{1, devices.get(), ipc.get()}; }
  FakeRuntime runtime;
  std::unique_ptr<server::Metrics> metrics;
  std::unique_ptr<server::DeviceManager> devices;
  std::unique_ptr<server::IpcCache> ipc;
};

v1::CudaIpcBuffer Buffer(const FakeRuntime::Exported& e, int gpu, uint64_t size) {
  v1::CudaIpcBuffer b;
  b.set_handle(e.handle);
  b.set_size(size);
  const server::Uuid u = FakeRuntime::FakeUuid(gpu);
  b.set_device_uuid(std::string(reinterpret_cast<const char*>(u.data()), u.size()));
  return b;
}

QuantLayoutSpec HopperOrNot(QuantLayout layout) {
  QuantLayoutSpec spec;
  spec.layout = layout;
  if (layout == QuantLayout::kHopper) spec = {layout, 2, 16, 4};
  return spec;
}

struct IpcItem {
  v1::QuantizeItem item;
  FakeRuntime::Exported in, values, scales;
  uint64_t values_bytes = 0, scales_bytes = 0;
};

// Case `c` into `layout` (the Hopper pair with mma_version 2, 16 warps, align_k 4) with its
// source and outputs in fake GPU memory; the outputs hold 0xEE, one byte more than the output.
IpcItem MakeIpcItem(Parts& p, const QuantCase& c, QuantLayout layout, int gpu) {
  IpcItem k;
  k.item = ItemFor(c);
  k.item.mutable_source()->clear_inline_bytes();
  const QuantLayoutSpec spec = HopperOrNot(layout);
  if (layout == QuantLayout::kBlackwell) k.item.set_layout(v1::QUANTIZE_LAYOUT_BLACKWELL);
  if (layout == QuantLayout::kHopper) {
    k.item.set_layout(v1::QUANTIZE_LAYOUT_HOPPER);
    k.item.mutable_hopper()->set_mma_version(spec.mma_version);
    k.item.mutable_hopper_scale()->set_num_warps(spec.num_warps);
    k.item.mutable_hopper_scale()->set_align_k(spec.align_k);
  }
  absl::StatusOr<QuantizePlan> plan =
      MakeQuantizePlan(c.dtype == "float32" ? QuantDtype::kFloat32 : c.dtype == "float16" ? QuantDtype::kFloat16
                                                                                         : QuantDtype::kBfloat16,
                       c.shape, c.rounding == "down" ? ScaleRounding::kDown : ScaleRounding::kUp);
  EXPECT_TRUE(plan.ok());
  absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(*plan, spec);
  EXPECT_TRUE(sizes.ok());
  k.values_bytes = static_cast<uint64_t>(sizes->values_bytes);
  k.scales_bytes = static_cast<uint64_t>(sizes->scales_bytes);
  k.in = p.runtime.ExportHandle(gpu, c.input.size() + 1);
  if (!c.input.empty()) std::memcpy(k.in.ptr, c.input.data(), c.input.size());
  *k.item.mutable_source()->mutable_ipc() = Buffer(k.in, gpu, c.input.size());
  k.values = p.runtime.ExportHandle(gpu, k.values_bytes + 1);
  k.scales = p.runtime.ExportHandle(gpu, k.scales_bytes + 1);
  std::memset(k.values.ptr, 0xEE, k.values_bytes + 1);
  std::memset(k.scales.ptr, 0xEE, k.scales_bytes + 1);
  *k.item.mutable_values()->mutable_ipc() = Buffer(k.values, gpu, k.values_bytes);
  *k.item.mutable_scales()->mutable_ipc() = Buffer(k.scales, gpu, k.scales_bytes);
  return k;
}

// Every reference case IPC -> IPC in one batch on fake GPU 1, and the same inputs fused to
// the Blackwell and the Hopper pairs where the shape allows: written in place, byte-exact
// (fused: equal to the CPU engine's), nothing past the outputs, no device memory of the
// daemon's.
TEST(QuantizeIpc, EveryReferenceCaseIpcToIpcInPlaceWithNoDeviceMemory) {
  Parts p(2);
  std::vector<IpcItem> items;
  std::vector<const QuantCase*> cases;
  std::vector<QuantLayout> fused;
  v1::ConvertBatchRequest req;
  for (const QuantCase& c : QuantCases()) {
    for (QuantLayout layout : {QuantLayout::kCanonical, QuantLayout::kBlackwell, QuantLayout::kHopper}) {
      if (layout != QuantLayout::kCanonical && (c.shape.size() < 2 || c.shape.back() % 2 != 0)) continue;
      items.push_back(MakeIpcItem(p, c, layout, 1));
      cases.push_back(&c);
      fused.push_back(layout);
      *req.add_items()->mutable_quantize() = items.back().item;
    }
  }
  ASSERT_GT(req.items_size(), 40);
  absl::StatusOr<std::vector<server::QuantizeJob>> jobs = server::QuantizeJobsFromProto(req, server::MoeLimits{});
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  v1::ConvertBatchResponse resp;
  const absl::Status run = server::RunQuantizeJobs(*jobs, p.engines(), absl::InfiniteFuture(), &resp);
  ASSERT_TRUE(run.ok()) << run;
  ASSERT_EQ(resp.items_size(), req.items_size());
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(cases[i]->name + " layout " + std::to_string(static_cast<int>(fused[i])));
    const IpcItem& k = items[i];
    EXPECT_EQ(resp.items(static_cast<int>(i)).engine(), p.devices->gpu(1).engine_name());
    std::vector<uint8_t> v(k.values.ptr, k.values.ptr + k.values_bytes), s(k.scales.ptr, k.scales.ptr + k.scales_bytes);
    if (fused[i] != QuantLayout::kCanonical) {
      absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(
          (*jobs)[i].plan.dtype, cases[i]->shape, (*jobs)[i].plan.rounding);
      std::vector<uint8_t> wv(v.size()), ws(s.size());
      ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, HopperOrNot(fused[i]), cases[i]->input.data(), cases[i]->input.size(),
                                      wv.data(), wv.size(), ws.data(), ws.size()).ok());
      EXPECT_EQ(v, wv);
      EXPECT_EQ(s, ws);
    } else {
      EXPECT_EQ(Sha256Hex(v), cases[i]->values_sha256);
      EXPECT_EQ(Sha256Hex(s), cases[i]->scales_sha256);
    }
    EXPECT_EQ(k.values.ptr[k.values_bytes], 0xEE);
    EXPECT_EQ(k.scales.ptr[k.scales_bytes], 0xEE);
    EXPECT_TRUE(resp.items(static_cast<int>(i)).outputs(0).inline_bytes().empty());
  }
  EXPECT_EQ(p.runtime.counts(1).converts, req.items_size());
  EXPECT_EQ(p.runtime.counts(0).converts, 0);
  EXPECT_EQ(p.runtime.totals().device_bytes_peak, 0u);
}

// A trtllm w13 item with a bfloat16 bias, every operand in fake GPU memory: the three
// outputs written in place, equal to the CPU engine's, nothing past them, no device memory of
// the daemon's.
TEST(QuantizeIpc, TrtllmWithItsBiasIpcToIpcInPlace) {
  Parts p(2);
  std::mt19937_64 rng(2807);
  const std::vector<int64_t> shape = {2, 66, 64};
  absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(QuantDtype::kBfloat16, shape, ScaleRounding::kDown);
  ASSERT_TRUE(plan.ok());
  QuantLayoutSpec spec;
  spec.layout = QuantLayout::kTrtllmW13;
  absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(*plan, spec);
  ASSERT_TRUE(sizes.ok());
  std::vector<uint8_t> in(static_cast<size_t>(plan->input_bytes)), bias(2 * 66 * 2);
  for (auto& b : in) b = static_cast<uint8_t>(rng());
  for (auto& b : bias) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> wv(static_cast<size_t>(sizes->values_bytes)), ws(static_cast<size_t>(sizes->scales_bytes)),
      wb(static_cast<size_t>(sizes->bias_bytes));
  ASSERT_TRUE(QuantizeLayoutOnCpu(*plan, spec, in.data(), in.size(), wv.data(), wv.size(), ws.data(), ws.size(),
                                  QuantBias{bias.data(), true, wb.data()}).ok());
  auto exported = [&](const std::vector<uint8_t>* bytes, uint64_t size) {
    FakeRuntime::Exported e = p.runtime.ExportHandle(1, size + 1);
    std::memset(e.ptr, 0xEE, size + 1);
    if (bytes != nullptr) std::memcpy(e.ptr, bytes->data(), bytes->size());
    return e;
  };
  const FakeRuntime::Exported src = exported(&in, in.size()), bsrc = exported(&bias, bias.size());
  const FakeRuntime::Exported v = exported(nullptr, wv.size()), s = exported(nullptr, ws.size()),
                              b = exported(nullptr, wb.size());
  v1::ConvertBatchRequest req;
  v1::QuantizeItem* item = req.add_items()->mutable_quantize();
  item->set_dtype(v1::QUANTIZE_DTYPE_BFLOAT16);
  for (int64_t d : shape) item->add_shape(d);
  item->set_scale_rounding(v1::SCALE_ROUNDING_DOWN);
  item->set_layout(v1::QUANTIZE_LAYOUT_TRTLLM_W13);
  *item->mutable_source()->mutable_ipc() = Buffer(src, 1, in.size());
  *item->mutable_bias()->mutable_ipc() = Buffer(bsrc, 1, bias.size());
  item->set_bias_dtype(v1::QUANTIZE_DTYPE_BFLOAT16);
  *item->mutable_values()->mutable_ipc() = Buffer(v, 1, wv.size());
  *item->mutable_scales()->mutable_ipc() = Buffer(s, 1, ws.size());
  *item->mutable_bias_out()->mutable_ipc() = Buffer(b, 1, wb.size());
  absl::StatusOr<std::vector<server::QuantizeJob>> jobs = server::QuantizeJobsFromProto(req, server::MoeLimits{});
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  v1::ConvertBatchResponse resp;
  ASSERT_TRUE(server::RunQuantizeJobs(*jobs, p.engines(), absl::InfiniteFuture(), &resp).ok());
  EXPECT_EQ(std::vector<uint8_t>(v.ptr, v.ptr + wv.size()), wv);
  EXPECT_EQ(std::vector<uint8_t>(s.ptr, s.ptr + ws.size()), ws);
  EXPECT_EQ(std::vector<uint8_t>(b.ptr, b.ptr + wb.size()), wb);
  EXPECT_EQ(v.ptr[wv.size()], 0xEE);
  EXPECT_EQ(s.ptr[ws.size()], 0xEE);
  EXPECT_EQ(b.ptr[wb.size()], 0xEE);
  ASSERT_EQ(resp.items(0).outputs_size(), 3);
  EXPECT_EQ(p.runtime.totals().device_bytes_peak, 0u);
  // Without bias_out, an IPC bias is refused naming the field, before any work.
  item->clear_bias_out();
  absl::StatusOr<std::vector<server::QuantizeJob>> bad = server::QuantizeJobsFromProto(req, server::MoeLimits{});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("items[0].quantize.bias_out"), std::string::npos) << bad.status();
}

// Each IPC problem of the second item: INVALID_ARGUMENT naming the operand, and nothing of
// the first (good) item written.
TEST(QuantizeIpc, IpcProblemsNameTheirOperandAndNothingIsWritten) {
  struct Bad {
    std::string what;
    std::function<void(Parts&, IpcItem&)> edit;
    std::string starts;
  };
  const std::vector<Bad> table = {
      {"short source", [](Parts&, IpcItem& k) { k.item.mutable_source()->mutable_ipc()->set_size(1); },
       "items[1].quantize.source.ipc.size"},
      {"short values", [](Parts&, IpcItem& k) { k.item.mutable_values()->mutable_ipc()->set_size(1); },
       "items[1].quantize.values.ipc.size"},
      {"no scales destination", [](Parts&, IpcItem& k) { k.item.clear_scales(); }, "items[1].quantize.scales.ipc"},
      {"scales on another GPU",
       [](Parts&, IpcItem& k) { *k.item.mutable_scales()->mutable_ipc() = Buffer(k.scales, 0, k.scales_bytes); },
       "items[1].quantize.scales.ipc.device_uuid"},
      {"values over the source",
       [](Parts&, IpcItem& k) { *k.item.mutable_values()->mutable_ipc() = Buffer(k.in, 1, k.values_bytes); },
       "items[1].quantize.values.ipc overlaps"},
      {"scales over the values",
       [](Parts&, IpcItem& k) { *k.item.mutable_scales()->mutable_ipc() = Buffer(k.values, 1, k.scales_bytes); },
       "items[1].quantize.scales.ipc overlaps"},
      {"a freed allocation", [](Parts& p, IpcItem& k) { p.runtime.FreeExported(k.values.handle); },
       "items[1].quantize.values.ipc"},
      {"a source offset that splits an element",
       [](Parts&, IpcItem& k) { k.item.mutable_source()->mutable_ipc()->set_offset(1); },
       "items[1].quantize.source.ipc.offset"},
  };
  const QuantCase& c = QuantCases()[5];
  for (const Bad& b : table) {
    SCOPED_TRACE(b.what);
    Parts p(2);
    IpcItem first = MakeIpcItem(p, c, QuantLayout::kCanonical, 1);
    IpcItem second = MakeIpcItem(p, c, QuantLayout::kCanonical, 1);
    b.edit(p, second);
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_quantize() = first.item;
    *req.add_items()->mutable_quantize() = second.item;
    absl::Status st;
    absl::StatusOr<std::vector<server::QuantizeJob>> jobs = server::QuantizeJobsFromProto(req, server::MoeLimits{});
    if (!jobs.ok()) {
      st = jobs.status();
    } else {
      v1::ConvertBatchResponse resp;
      st = server::RunQuantizeJobs(*jobs, p.engines(), absl::InfiniteFuture(), &resp);
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_EQ(std::string(st.message()).rfind(b.starts, 0), 0u) << st;
    EXPECT_EQ(first.values.ptr[0], 0xEE) << "the good item ran";
    EXPECT_EQ(p.runtime.counts(1).converts, 0);
  }
}

}  // namespace
}  // namespace wprep::testing
