// The MoE batch item through a real wprepd on the CPU engine, inline bytes: every
// trtllm-gen reference case byte for byte in ConvertBatch and ConvertBatches, each output's
// name, shape, strides and identity, and every malformed item INVALID_ARGUMENT (or
// UNIMPLEMENTED for what is not served yet) naming its operand, the daemon serving on.
// (IPC operands: moe_ipc_test, on fake GPUs.)
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "golden.h"
#include "moe_golden.h"
#include "wprep/client/client.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

v1::MoeDType DTypeOf(const std::string& name) {
  if (name == "uint8") return v1::MOE_DTYPE_UINT8;
  if (name == "float32") return v1::MOE_DTYPE_FLOAT32;
  if (name == "bfloat16") return v1::MOE_DTYPE_BFLOAT16;
  ADD_FAILURE() << "dtype " << name;
  return v1::MOE_DTYPE_UNSPECIFIED;
}

// Case `c` as a MoE item, its params typed as the manifest types them.
v1::MoeItem ItemFor(const MoeGoldenCase& c) {
  v1::MoeItem item;
  item.set_op(c.op);
  v1::MoeParams* p = item.mutable_params();
  for (const auto& [k, v] : c.params) {
    if (k == "format") {
      p->set_format(v);
    } else if (k == "gated") {
      p->set_gated(v == "true");
    } else {
      const int64_t n = std::stoll(v);
      if (k == "align") p->set_align(n);
      if (k == "align_h") p->set_align_h(n);
      if (k == "align_i") p->set_align_i(n);
      if (k == "block_k") p->set_block_k(n);
      if (k == "axis") p->set_axis(n);
      if (k == "epilogue_tile_m") p->set_epilogue_tile_m(n);
      if (k == "num_elts_per_sf") p->set_num_elts_per_sf(n);
    }
  }
  for (const MoeGoldenTensor& t : c.inputs) {
    v1::MoeInput* in = item.add_inputs();
    in->set_name(t.name);
    in->set_dtype(DTypeOf(t.dtype));
    for (int64_t d : t.shape) in->add_shape(d);
    const std::vector<uint8_t> bytes = MoeGoldenInput(t);
    in->mutable_source()->set_inline_bytes(bytes.data(), bytes.size());
  }
  return item;
}

// Item result `r` is case `c`'s: every output byte-exact, named, shaped and identified.
void ExpectCaseResult(const MoeGoldenCase& c, const v1::BatchItemResult& r) {
  ASSERT_EQ(r.outputs_size(), static_cast<int>(c.outputs.size()));
  EXPECT_EQ(r.engine(), "cpu");
  for (size_t j = 0; j < c.outputs.size(); ++j) {
    const MoeGoldenTensor& want = c.outputs[j];
    const v1::TensorResult& got = r.outputs(static_cast<int>(j));
    EXPECT_EQ(got.name(), want.name);
    EXPECT_EQ(got.dtype(), DTypeOf(want.dtype)) << want.name;
    EXPECT_EQ(std::vector<int64_t>(got.shape().begin(), got.shape().end()), want.shape) << want.name;
    EXPECT_EQ(std::vector<int64_t>(got.strides().begin(), got.strides().end()), want.strides) << want.name;
    EXPECT_EQ(got.bytes(), want.bytes) << want.name;
    EXPECT_EQ(Sha256Hex(std::vector<uint8_t>(got.inline_bytes().begin(), got.inline_bytes().end())), want.sha256)
        << want.name;
    EXPECT_EQ(got.moe_identity().op(), c.op);
    EXPECT_EQ(got.moe_identity().contract_version(), 1u);
    EXPECT_FALSE(got.moe_identity().description().empty());
    if (c.op == "prepare_w13" || c.op == "prepare_w2") {
      std::string format = "mxfp4";
      for (const auto& [k, v] : c.params) {
        if (k == "format") format = v;
      }
      EXPECT_EQ(got.moe_identity().format(), format);
      EXPECT_EQ(got.moe_identity().params().format(), format);
    } else {
      EXPECT_EQ(got.moe_identity().format(), "");
    }
    // The params the case gave come back as given.
    const v1::MoeParams& p = got.moe_identity().params();
    for (const auto& [k, v] : c.params) {
      if (k == "align") {
        EXPECT_EQ(std::to_string(p.align()), v);
      }
      if (k == "align_h") {
        EXPECT_EQ(std::to_string(p.align_h()), v);
      }
      if (k == "align_i") {
        EXPECT_EQ(std::to_string(p.align_i()), v);
      }
      if (k == "block_k") {
        EXPECT_EQ(std::to_string(p.block_k()), v);
      }
      if (k == "axis") {
        EXPECT_EQ(std::to_string(p.axis()), v);
      }
      if (k == "epilogue_tile_m") {
        EXPECT_EQ(std::to_string(p.epilogue_tile_m()), v);
      }
      if (k == "num_elts_per_sf") {
        EXPECT_EQ(std::to_string(p.num_elts_per_sf()), v);
      }
      if (k == "gated") {
        EXPECT_EQ(p.gated() ? "true" : "false", v);
      }
    }
  }
}

class MoeItemTest : public ::testing::Test {
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

// Every success case of both manifests as one item of a single ConvertBatch.
TEST_F(MoeItemTest, EveryReferenceCaseInOneConvertBatch) {
  v1::ConvertBatchRequest req;
  std::vector<const MoeGoldenCase*> cases;
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (c.error) continue;
    *req.add_items()->mutable_moe() = ItemFor(c);
    cases.push_back(&c);
  }
  ASSERT_EQ(cases.size(), 54u);
  Client client(MakeChannel(daemon_->unix_target()));
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->items_size(), static_cast<int>(cases.size()));
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i]->set + "/" + cases[i]->name);
    ExpectCaseResult(*cases[i], resp->items(static_cast<int>(i)));
  }
}

// Every case of both manifests as its own batch of one ConvertBatches stream: the error
// cases answer INVALID_ARGUMENT naming the item, and the stream goes on.
TEST_F(MoeItemTest, EveryReferenceCaseThroughConvertBatchesOverTcp) {
  auto channel = MakeChannel(daemon_->tcp_target());
  auto stub = v1::WeightPrep::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->ConvertBatches(&ctx);
  const std::vector<MoeGoldenCase>& all = MoeGoldenCases();
  for (const MoeGoldenCase& c : all) {
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_moe() = ItemFor(c);
    ASSERT_TRUE(stream->Write(req));
  }
  stream->WritesDone();
  v1::ConvertBatchesResponse answer;
  size_t n = 0;
  while (stream->Read(&answer)) {
    ASSERT_LT(n, all.size());
    const MoeGoldenCase& c = all[answer.index()];
    SCOPED_TRACE(c.set + "/" + c.name);
    if (c.error) {
      EXPECT_EQ(answer.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << answer.message();
      EXPECT_EQ(answer.message().rfind("items[0].moe", 0), 0u) << answer.message();
    } else {
      ASSERT_EQ(answer.code(), 0) << answer.message();
      ASSERT_EQ(answer.batch().items_size(), 1);
      ExpectCaseResult(c, answer.batch().items(0));
    }
    ++n;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(n, all.size());
}

const MoeGoldenCase& CaseNamed(const std::string& name) {
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no case " << name;
  std::abort();
}

// Each malformed batch: its code and the operand its message names. A good item first, so
// the path of the bad one (items[1]) is checked too; nothing of the good one comes back.
TEST_F(MoeItemTest, MalformedItemsNameTheirOperandAndTheDaemonServesOn) {
  const v1::MoeItem good = ItemFor(CaseNamed("prepare_w13_e2_i96_h160"));
  struct Bad {
    std::string what;
    std::function<void(v1::ConvertBatchRequest&)> edit;  // of a batch {good, good}
    grpc::StatusCode code;
    std::string starts;  // the message begins so
  };
  auto moe = [](v1::ConvertBatchRequest& r) { return r.mutable_items(1)->mutable_moe(); };
  const std::vector<Bad> table = {
      {"no op", [&](auto& r) { moe(r)->clear_op(); }, grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.op"},
      {"unknown op", [&](auto& r) { moe(r)->set_op("prepare_w4"); }, grpc::StatusCode::INVALID_ARGUMENT,
       "items[1].moe.op"},
      {"unknown format", [&](auto& r) { moe(r)->mutable_params()->set_format("int4"); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.params.format"},
      {"no dtype", [&](auto& r) { moe(r)->mutable_inputs(1)->clear_dtype(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "items[1].moe.inputs[1].dtype"},
      {"no source", [&](auto& r) { moe(r)->mutable_inputs(1)->clear_source(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "items[1].moe.scales.source"},
      {"short scales", [&](auto& r) { moe(r)->mutable_inputs(1)->mutable_source()->mutable_inline_bytes()->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.scales.source.inline_bytes"},
      {"scales shape disagrees", [&](auto& r) { moe(r)->mutable_inputs(1)->set_shape(2, 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.scales"},
      {"strided", [&](auto& r) { moe(r)->mutable_inputs(0)->mutable_source()->add_inline_strides(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.values.source.inline_strides"},
      {"same input twice", [&](auto& r) { moe(r)->mutable_inputs(2)->set_name("scales"); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.inputs[2].name"},
      {"four inputs", [&](auto& r) { *moe(r)->add_inputs() = moe(r)->inputs(0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "items[1].moe.inputs"},
      {"unknown output", [&](auto& r) { moe(r)->add_outputs()->set_name("y"); }, grpc::StatusCode::INVALID_ARGUMENT,
       "items[1].moe.outputs[0].name"},
      {"IPC source without a handle",
       [&](auto& r) { moe(r)->mutable_inputs(0)->mutable_source()->mutable_ipc()->set_size(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.values.source.ipc.handle"},
      {"IPC operands on a daemon serving no GPU",
       [&](auto& r) {
         v1::MoeItem* m = moe(r);
         char tag = 0;  // a handle per operand: one allocation each, none overlapping
         auto fill = [&tag](v1::CudaIpcBuffer* b, uint64_t size) {
           b->set_handle(std::string(64, ++tag));
           b->set_size(size);
           b->set_device_uuid(std::string(16, '\x02'));
         };
         for (auto& in : *m->mutable_inputs()) fill(in.mutable_source()->mutable_ipc(), 1 << 20);
         for (const char* name : {"values", "scales", "bias"}) {
           v1::MoeOutput* o = m->add_outputs();
           o->set_name(name);
           fill(o->mutable_destination()->mutable_ipc(), 1 << 20);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.values.source.ipc.device_uuid"},
      {"IPC destination of an inline item",
       [&](auto& r) {
         v1::MoeOutput* o = moe(r)->add_outputs();
         o->set_name("bias");
         o->mutable_destination()->mutable_ipc()->set_size(4096);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1].moe.bias.destination.ipc"},
      {"mixed with a convert item", [&](auto& r) { r.mutable_items(1)->mutable_convert(); },
       grpc::StatusCode::INVALID_ARGUMENT, "items[1]: a batch holds items of one kind"},
      {"signal fence", [&](auto& r) { r.add_signal_when_done(); }, grpc::StatusCode::UNIMPLEMENTED,
       "signal_when_done"},
      {"wait fence", [&](auto& r) { r.mutable_wait_for(); }, grpc::StatusCode::UNIMPLEMENTED, "wait_for"},
  };
  Client client(MakeChannel(daemon_->unix_target()));
  for (const Bad& b : table) {
    SCOPED_TRACE(b.what);
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_moe() = good;
    *req.add_items()->mutable_moe() = good;
    b.edit(req);
    v1::ConvertBatchResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = client.stub().ConvertBatch(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), b.code) << s.error_message();
    EXPECT_EQ(s.error_message().rfind(b.starts, 0), 0u) << s.error_message();
    EXPECT_EQ(resp.items_size(), 0);
  }
  // Still serving: the good pair.
  v1::ConvertBatchRequest req;
  *req.add_items()->mutable_moe() = good;
  *req.add_items()->mutable_moe() = good;
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ExpectCaseResult(CaseNamed("prepare_w13_e2_i96_h160"), resp->items(0));
  ExpectCaseResult(CaseNamed("prepare_w13_e2_i96_h160"), resp->items(1));
}

// The reference's error cases, each the first item of a batch: INVALID_ARGUMENT naming it.
TEST_F(MoeItemTest, EveryReferenceErrorCaseIsInvalidArgument) {
  Client client(MakeChannel(daemon_->unix_target()));
  int n = 0;
  for (const MoeGoldenCase& c : MoeGoldenCases()) {
    if (!c.error) continue;
    SCOPED_TRACE(c.set + "/" + c.name);
    v1::ConvertBatchRequest req;
    *req.add_items()->mutable_moe() = ItemFor(c);
    const absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
    EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument) << resp.status();
    EXPECT_EQ(std::string(resp.status().message()).rfind("items[0].moe", 0), 0u) << resp.status();
    ++n;
  }
  EXPECT_EQ(n, 27);
}

}  // namespace
}  // namespace wprep::testing
