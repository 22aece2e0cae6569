// Resident weight sets (wprep.v1.WeightSets) through a real wprepd on the CPU engine:
// checkpoints written here by hand (single file and sharded), the rules (first match
// wins, converted bytes equal to the CPU engine's, the rest copied), the manifest, the
// budget, every way out of --weights-root, malformed checkpoints, attachments (detach,
// drop while attached, a killed client), and the daemon serving after every refusal.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon_harness.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "openssl/evp.h"
#include "safetensors_files.h"
#include "wprep/client/weights.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::testing {
namespace {

namespace v1 = wprep::v1;

std::string Sha256(const std::string& s) {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(s.data(), s.size(), d, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<char*>(d), len);
}

ConversionSpec HopperValue() {
  ConversionSpec s;
  s.layout = Layout::kHopperValue;
  s.direction = Direction::kSwizzle;
  return s;
}
ConversionSpec HopperScale() {
  ConversionSpec s;
  s.layout = Layout::kHopperScale;
  s.direction = Direction::kSwizzle;
  return s;
}

// The checkpoint the tests load: MXFP4 values and scales of two experts, a copy that a
// verbatim rule shields from the *_blocks rule, and a BF16 tensor no rule matches.
std::vector<Tensor> Checkpoint() {
  return {
      {"layers.0.experts_blocks", "U8", {2, 256, 128}, Pattern(2 * 256 * 128, 1)},
      {"layers.0.experts_scales", "U8", {2, 256, 8}, Pattern(2 * 256 * 8, 2)},
      {"lm_head_blocks", "U8", {64, 32}, Pattern(64 * 32, 3)},
      {"embed.weight", "BF16", {16, 8}, Pattern(16 * 8 * 2, 4)},
  };
}

std::vector<v1::WeightRule> Rules() {
  std::vector<v1::WeightRule> rules(3);
  rules[0].set_pattern("lm_head*");
  rules[0].set_verbatim(true);
  rules[1].set_pattern("*_blocks");
  *rules[1].mutable_convert() = SpecToProto(HopperValue());
  rules[2].set_pattern("*.experts_scales");
  *rules[2].mutable_convert() = SpecToProto(HopperScale());
  return rules;
}

// What the CPU engine makes of `t` as the dense canonical input of `spec`'s swizzle.
std::vector<uint8_t> Converted(const ConversionSpec& spec, const Tensor& t, Plan* plan_out = nullptr) {
  std::vector<int64_t> logical = t.shape;
  if (IsValueLayout(spec.layout)) logical.back() *= 2;
  absl::StatusOr<Plan> plan = MakePlan(spec, logical);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  std::vector<uint8_t> out(plan->output_bytes);
  absl::Status s = ConvertOnCpu(*plan, t.bytes.data(), t.bytes.size(), out.data(), out.size());
  EXPECT_TRUE(s.ok()) << s;
  if (plan_out != nullptr) *plan_out = *plan;
  return out;
}

struct LoadResult {
  grpc::Status status;
  std::vector<v1::LoadWeightsResponse> messages;
};

class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wprep-weights-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    root_ = dir_ + "/root";
    outside_ = dir_ + "/outside";
    ASSERT_EQ(mkdir(root_.c_str(), 0755), 0);
    ASSERT_EQ(mkdir(outside_.c_str(), 0755), 0);
    shm_ = dir_ + "/shm";
    ASSERT_EQ(mkdir(shm_.c_str(), 0700), 0);
  }
  void TearDown() override {
    daemon_.reset();
    std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }

  void StartDaemon(uint64_t budget = 0, bool with_root = true, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--devices=cpu", "--cpu-threads=2"};
    args.insert(args.end(), extra.begin(), extra.end());
    if (with_root) args.push_back("--weights-root=" + root_);
    args.push_back("--weights-shm-dir=" + shm_);  // the harness kills its daemons; no leftovers
    if (budget != 0) args.push_back(absl::StrCat("--weights-budget=", budget));
    std::string error;
    daemon_ = Daemon::Start(args, &error);
    ASSERT_NE(daemon_, nullptr) << error;
    ASSERT_TRUE(daemon_->WaitServing()) << daemon_->Log();
    stub_ = v1::WeightSets::NewStub(grpc::CreateChannel(daemon_->unix_target(), grpc::InsecureChannelCredentials()));
  }

  LoadResult Load(const std::string& name, const std::string& path,
                  const std::vector<v1::WeightRule>& rules = Rules(), const std::string& device_uuid = "") {
    v1::LoadWeightsRequest req;
    req.set_name(name);
    req.set_path(path);
    req.set_device_uuid(device_uuid);
    for (const auto& r : rules) *req.add_rules() = r;
    return LoadRequest(req);
  }

  LoadResult LoadRequest(const v1::LoadWeightsRequest& req) {
    grpc::ClientContext ctx;
    auto reader = stub_->LoadWeights(&ctx, req);
    LoadResult out;
    v1::LoadWeightsResponse msg;
    while (reader->Read(&msg)) out.messages.push_back(msg);
    out.status = reader->Finish();
    return out;
  }

  v1::ListWeightsResponse List() {
    grpc::ClientContext ctx;
    v1::ListWeightsRequest req;
    v1::ListWeightsResponse resp;
    grpc::Status s = stub_->ListWeights(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  grpc::Status Drop(const std::string& name, bool force, uint64_t* freed = nullptr) {
    grpc::ClientContext ctx;
    v1::DropWeightsRequest req;
    req.set_name(name);
    req.set_force(force);
    v1::DropWeightsResponse resp;
    grpc::Status s = stub_->DropWeights(&ctx, req, &resp);
    if (freed != nullptr) *freed = resp.freed_bytes();
    return s;
  }

  // An AttachWeights stream of set `name` (the attachment lives while it is open).
  std::unique_ptr<grpc::ClientReader<v1::AttachWeightsResponse>> Attach(grpc::ClientContext* ctx,
                                                                      const std::string& name) {
    v1::AttachWeightsRequest req;
    req.set_name(name);
    return stub_->AttachWeights(ctx, req);
  }

  int SetCount() {
    const v1::ListWeightsResponse list = List();
    return list.sets_size();
  }
  uint64_t Resident() {
    const v1::ListWeightsResponse list = List();
    return list.resident_bytes();
  }

  uint32_t Attachments(const std::string& name) {
    const v1::ListWeightsResponse list = List();
    for (const auto& s : list.sets()) {
      if (s.manifest().name() == name) return s.attachments();
    }
    return UINT32_MAX;
  }

  // Waits (bounded) until set `name` has `n` attachments.
  bool WaitAttachments(const std::string& name, uint32_t n) {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (absl::Now() < end) {
      if (Attachments(name) == n) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // A refusal: its code, a message naming each of `names`, and the daemon serving on.
  void ExpectRefused(const LoadResult& r, grpc::StatusCode code, const std::vector<std::string>& names) {
    EXPECT_EQ(r.status.error_code(), code) << r.status.error_message();
    for (const std::string& n : names) {
      EXPECT_NE(r.status.error_message().find(n), std::string::npos) << r.status.error_message() << " lacks " << n;
    }
    EXPECT_EQ(daemon_->Health(), 1) << daemon_->Log();
    EXPECT_EQ(SetCount(), 0);
  }

  // Attaches to set `name` and checks it against `cp` as Rules() prepare it
  // (ExpectPrepared), then detaches.
  void ExpectAttachedPrepared(const std::string& name, const std::vector<Tensor>& cp);

  std::string dir_, root_, outside_, shm_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<v1::WeightSets::Stub> stub_;
};

std::vector<uint8_t> ReadShm(const std::string& path, uint64_t offset, uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  if (fd < 0) return {};
  EXPECT_EQ(pread(fd, out.data(), bytes, static_cast<off_t>(offset)), static_cast<ssize_t>(bytes));
  close(fd);
  return out;
}

// Every tensor of `cp` in `manifest` and in the attached bytes, as the rules prepare it.
void ExpectPrepared(const std::vector<Tensor>& cp, const v1::WeightManifest& manifest, const std::string& shm) {
  ASSERT_EQ(manifest.tensors_size(), static_cast<int>(cp.size()));
  for (const v1::WeightTensor& t : manifest.tensors()) {
    SCOPED_TRACE(t.name());
    EXPECT_EQ(t.offset() % 256, 0u);
    EXPECT_LE(t.offset() + t.bytes(), manifest.total_bytes());
    const Tensor* src = nullptr;
    for (const Tensor& c : cp) {
      if (c.name == t.name()) src = &c;
    }
    ASSERT_NE(src, nullptr);
    const std::vector<uint8_t> got = ReadShm(shm, t.offset(), t.bytes());
    if (src->name == "layers.0.experts_blocks" || src->name == "layers.0.experts_scales") {
      const ConversionSpec spec = src->name == "layers.0.experts_blocks" ? HopperValue() : HopperScale();
      Plan plan;
      const std::vector<uint8_t> want = Converted(spec, *src, &plan);
      EXPECT_EQ(t.rule(), src->name == "layers.0.experts_blocks" ? 1 : 2);
      EXPECT_EQ(t.dtype(), "U8");
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), plan.output_shape);
      EXPECT_EQ(std::vector<int64_t>(t.strides().begin(), t.strides().end()), plan.output_strides);
      EXPECT_EQ(t.bytes(), plan.output_bytes);
      EXPECT_EQ(t.identity().layout(), IdentityToProto(spec).layout());
      EXPECT_EQ(t.identity().contract_version(), kLayoutContractVersion);
      EXPECT_TRUE(got == want) << "converted bytes differ from the CPU engine's";
    } else {
      EXPECT_EQ(t.rule(), src->name == "lm_head_blocks" ? 0 : -1);
      EXPECT_EQ(t.dtype(), src->dtype);
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), src->shape);
      EXPECT_EQ(std::vector<int64_t>(t.strides().begin(), t.strides().end()), DenseStrides(src->shape));
      EXPECT_FALSE(t.has_identity());
      EXPECT_TRUE(got == src->bytes) << "a copied tensor differs from the file";
    }
  }
}

void WeightsTest::ExpectAttachedPrepared(const std::string& name, const std::vector<Tensor>& cp) {
  grpc::ClientContext actx;
  auto attach = Attach(&actx, name);
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a)) << name;
  ExpectPrepared(cp, a.manifest(), a.shm_path());
  actx.TryCancel();
  attach->Finish();
}

TEST_F(WeightsTest, LoadsAppliesRulesAndAttachesTheSameBytes) {
  StartDaemon();
  const std::vector<Tensor> cp = Checkpoint();
  const std::string header = WriteSafetensors(root_ + "/model.safetensors", cp);
  const LoadResult r = Load("gpt", "model.safetensors");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << daemon_->Log();
  ASSERT_GE(r.messages.size(), 2u);
  EXPECT_EQ(r.messages.front().tensors_done(), 0u);
  EXPECT_EQ(r.messages.front().tensors_total(), cp.size());
  const v1::LoadWeightsResponse& last = r.messages.back();
  ASSERT_TRUE(last.has_manifest());
  EXPECT_EQ(last.tensors_done(), cp.size());
  EXPECT_EQ(last.manifest().name(), "gpt");
  EXPECT_EQ(last.manifest().path(), "model.safetensors");
  EXPECT_EQ(last.manifest().source_checksum(), Sha256(Sha256(header)));

  grpc::ClientContext actx;

  auto attach = Attach(&actx, "gpt");
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a)) << attach->Finish().error_message();
  EXPECT_EQ(a.manifest().SerializeAsString(), last.manifest().SerializeAsString());
  ExpectPrepared(cp, a.manifest(), a.shm_path());

  const v1::ListWeightsResponse list = List();
  ASSERT_EQ(list.sets_size(), 1);
  EXPECT_EQ(list.sets(0).attachments(), 1u);
  EXPECT_EQ(list.sets(0).manifest().tensors_size(), 0);  // without with_tensors
  EXPECT_EQ(list.resident_bytes(), last.manifest().total_bytes());
  {
    const std::string m = HttpGet(daemon_->metrics_address(), "/metrics");
    EXPECT_EQ(MetricValue(m, "wprep_weight_set_resident_bytes", {{"set", "gpt"}}),
              static_cast<double>(last.manifest().total_bytes()));
    EXPECT_EQ(MetricValue(m, "wprep_weight_attachments"), 1.0);
    EXPECT_EQ(MetricValue(m, "wprep_weight_load_seconds_count"), 1.0);
    EXPECT_EQ(MetricValue(m, "wprep_weight_loads_failed_total"), 0.0);
  }

  // Attached: a plain drop is refused and changes nothing; detaching ends the stream OK.
  EXPECT_EQ(Drop("gpt", false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(SetCount(), 1);
  {
    grpc::ClientContext ctx;
    v1::DetachWeightsRequest req;
    req.set_attachment_id(a.attachment_id());
    v1::DetachWeightsResponse resp;
    ASSERT_TRUE(stub_->DetachWeights(&ctx, req, &resp).ok());
  }
  // Detached is no longer attached, also before the attach stream has ended (Drop agrees).
  EXPECT_EQ(Attachments("gpt"), 0u);
  EXPECT_FALSE(attach->Read(&a));
  EXPECT_TRUE(attach->Finish().ok());
  EXPECT_EQ(Attachments("gpt"), 0u);
  uint64_t freed = 0;
  ASSERT_TRUE(Drop("gpt", false, &freed).ok());
  EXPECT_EQ(freed, last.manifest().total_bytes());
  EXPECT_EQ(SetCount(), 0);
  EXPECT_EQ(Resident(), 0u);
  EXPECT_NE(access(a.shm_path().c_str(), F_OK), 0) << "a dropped set's file stays";
  {
    const std::string m = HttpGet(daemon_->metrics_address(), "/metrics");
    EXPECT_EQ(MetricValue(m, "wprep_weight_set_resident_bytes", {{"set", "gpt"}}), std::nullopt);
    EXPECT_EQ(MetricValue(m, "wprep_weight_attachments"), 0.0);
  }
  EXPECT_EQ(Drop("gpt", false).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Elements [start, start + length) along `axis` of `t`, gathered here by index (the
// daemon reads them as runs of the file).
Tensor Sliced(const Tensor& t, int axis, int64_t start, int64_t length) {
  int64_t outer = 1, inner = static_cast<int64_t>(t.bytes.size());
  for (int i = 0; i < axis; ++i) outer *= t.shape[static_cast<size_t>(i)];
  const int64_t dim = t.shape[static_cast<size_t>(axis)];
  inner /= outer * dim;  // bytes of one index along the axis
  Tensor out = t;
  out.shape[static_cast<size_t>(axis)] = length;
  out.bytes.clear();
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = start; i < start + length; ++i) {
      for (int64_t b = 0; b < inner; ++b) out.bytes.push_back(t.bytes[static_cast<size_t>((o * dim + i) * inner + b)]);
    }
  }
  return out;
}

v1::WeightSlice SliceProto(int axis, int64_t start, int64_t length) {
  v1::WeightSlice sl;
  sl.set_axis(axis);
  sl.set_start(start);
  sl.set_length(length);
  return sl;
}

// An expert-parallel rank's experts, converted; a tensor-parallel rank's columns of a copy
// (a negative axis); rows of a tensor matched by a rule with a slice and no action.
TEST_F(WeightsTest, RulesKeepARanksSliceOfEachMatchedTensor) {
  StartDaemon();
  const std::vector<Tensor> cp = {
      {"layers.0.experts_blocks", "U8", {4, 256, 128}, Pattern(4 * 256 * 128, 11)},
      {"layers.0.experts_scales", "U8", {4, 256, 8}, Pattern(4 * 256 * 8, 12)},
      {"proj.weight", "BF16", {6, 10}, Pattern(6 * 10 * 2, 13)},
      {"embed.weight", "BF16", {16, 8}, Pattern(16 * 8 * 2, 14)},
  };
  WriteSafetensors(root_ + "/model.safetensors", cp);
  std::vector<v1::WeightRule> rules(4);
  rules[0].set_pattern("*_blocks");
  *rules[0].mutable_convert() = SpecToProto(HopperValue());
  *rules[0].mutable_slice() = SliceProto(0, 2, 2);
  rules[1].set_pattern("*_scales");
  *rules[1].mutable_convert() = SpecToProto(HopperScale());
  *rules[1].mutable_slice() = SliceProto(0, 2, 2);
  rules[2].set_pattern("proj.weight");
  rules[2].set_verbatim(true);
  *rules[2].mutable_slice() = SliceProto(-1, 3, 4);
  rules[3].set_pattern("embed.*");
  *rules[3].mutable_slice() = SliceProto(0, 4, 8);
  const LoadResult r = Load("rank1", "model.safetensors", rules);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << daemon_->Log();
  ASSERT_TRUE(r.messages.back().has_manifest());
  const v1::WeightManifest& m = r.messages.back().manifest();
  ASSERT_EQ(m.tensors_size(), 4);
  grpc::ClientContext ctx;
  auto stream = Attach(&ctx, "rank1");
  v1::AttachWeightsResponse first;
  ASSERT_TRUE(stream->Read(&first)) << daemon_->Log();
  ASSERT_FALSE(first.shm_path().empty()) << first.DebugString();
  const struct {
    int rule, axis;
    int64_t start, length;
    std::optional<ConversionSpec> spec;
  } want[] = {{0, 0, 2, 2, HopperValue()}, {1, 0, 2, 2, HopperScale()}, {2, 1, 3, 4, std::nullopt},
              {3, 0, 4, 8, std::nullopt}};
  for (int i = 0; i < 4; ++i) {
    const v1::WeightTensor& t = m.tensors(i);
    SCOPED_TRACE(t.name());
    ASSERT_EQ(t.name(), cp[static_cast<size_t>(i)].name);
    EXPECT_EQ(t.rule(), want[i].rule);
    ASSERT_TRUE(t.has_slice());
    EXPECT_EQ(t.slice().axis(), want[i].axis);
    EXPECT_EQ(t.slice().start(), want[i].start);
    EXPECT_EQ(t.slice().length(), want[i].length);
    const Tensor part = Sliced(cp[static_cast<size_t>(i)], want[i].axis, want[i].start, want[i].length);
    const std::vector<uint8_t> got = ReadShm(first.shm_path(), t.offset(), t.bytes());
    if (want[i].spec.has_value()) {
      Plan plan;
      const std::vector<uint8_t> converted = Converted(*want[i].spec, part, &plan);
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), plan.output_shape);
      EXPECT_TRUE(got == converted) << "the slice's conversion differs from the CPU engine's";
    } else {
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), part.shape);
      EXPECT_EQ(t.dtype(), "BF16");
      EXPECT_TRUE(got == part.bytes) << "the copied slice differs from the file's";
    }
  }
  ctx.TryCancel();
}

// Rules with `checkpoint` read gpt-oss's pairs as stored: *_blocks [E, N, K/32, 16] as the
// checkpoint order (packing -2) of the logical [E, K, N], *_scales [E, N, K/32] through the
// transposed view [E, K/32, N]. The oracle spells those out itself: the blocks' bytes are the
// [E, N, K/2] storage of the packing -2 swizzle, the scales a strided view for the CPU engine.
// An expert slice (EP rank) is cut from the stored tensors first.
TEST_F(WeightsTest, CheckpointRulesReadMxfp4PairsAsStored) {
  StartDaemon();
  const int64_t e = 4, n = 96, k = 256;
  const std::vector<Tensor> cp = {
      {"model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", {e, n, k / 32, 16}, Pattern(e * n * k / 2, 21)},
      {"model.layers.0.mlp.experts.gate_up_proj_scales", "U8", {e, n, k / 32}, Pattern(e * n * k / 32, 22)},
  };
  WriteSafetensors(root_ + "/model.safetensors", cp);
  ConversionSpec values = HopperValue();
  values.hopper.mma_version = 2;
  ConversionSpec scales = HopperScale();
  scales.hopper_scale.num_warps = 4;
  scales.hopper_scale.align_k = 4;
  std::vector<v1::WeightRule> rules(2);
  rules[0].set_pattern("*_blocks");
  *rules[0].mutable_convert() = SpecToProto(values);
  rules[0].set_checkpoint(true);
  *rules[0].mutable_slice() = SliceProto(0, 1, 2);
  rules[1].set_pattern("*_scales");
  *rules[1].mutable_convert() = SpecToProto(scales);
  rules[1].set_checkpoint(true);
  *rules[1].mutable_slice() = SliceProto(0, 1, 2);
  const LoadResult r = Load("ep1", "model.safetensors", rules);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << daemon_->Log();
  const v1::WeightManifest& m = r.messages.back().manifest();
  ASSERT_EQ(m.tensors_size(), 2);
  grpc::ClientContext ctx;
  auto stream = Attach(&ctx, "ep1");
  v1::AttachWeightsResponse first;
  ASSERT_TRUE(stream->Read(&first)) << daemon_->Log();
  for (int i = 0; i < 2; ++i) {
    const v1::WeightTensor& t = m.tensors(i);
    SCOPED_TRACE(t.name());
    const Tensor part = Sliced(cp[static_cast<size_t>(i)], 0, 1, 2);
    ConversionSpec spec = i == 0 ? values : scales;
    std::vector<int64_t> logical = {2, i == 0 ? k : k / 32, n};
    InputBinding binding;
    if (i == 0) {
      spec.packing_axis = -2;  // [E, N, K/32, 16] is [E, N, K/2]: packing -2 of [E, K, N]
    } else {
      binding.strides = {n * (k / 32), 1, k / 32};  // the view [E, K/32, N] of [E, N, K/32]
    }
    absl::StatusOr<Plan> plan = MakePlan(spec, logical, binding);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<uint8_t> want(plan->output_bytes);
    ASSERT_TRUE(ConvertOnCpu(*plan, part.bytes.data(), part.bytes.size(), want.data(), want.size()).ok());
    EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), plan->output_shape);
    EXPECT_EQ(std::vector<int64_t>(t.strides().begin(), t.strides().end()), plan->output_strides);
    EXPECT_EQ(t.identity().layout(), IdentityToProto(spec).layout());
    EXPECT_TRUE(ReadShm(first.shm_path(), t.offset(), t.bytes()) == want)
        << "differs from the checkpoint pair's conversion";
  }
  ctx.TryCancel();
  // checkpoint on a rule without a conversion is refused naming the field.
  std::vector<v1::WeightRule> bad(1);
  bad[0].set_pattern("*");
  bad[0].set_checkpoint(true);
  const LoadResult refused = Load("bad", "model.safetensors", bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("rules[0].checkpoint"), std::string::npos)
      << refused.status.error_message();
}

TEST_F(WeightsTest, SlicesOutsideTheirTensorAreRefusedAndNothingStays) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  auto with_slice = [](int axis, int64_t start, int64_t length) {
    std::vector<v1::WeightRule> rules = Rules();
    *rules[1].mutable_slice() = SliceProto(axis, start, length);
    return rules;
  };
  ExpectRefused(Load("a", "model.safetensors", with_slice(3, 0, 1)), grpc::StatusCode::INVALID_ARGUMENT,
                {"layers.0.experts_blocks", "rule 1", "slice axis 3", "rank 3"});
  ExpectRefused(Load("b", "model.safetensors", with_slice(-4, 0, 1)), grpc::StatusCode::INVALID_ARGUMENT,
                {"slice axis -4"});
  ExpectRefused(Load("c", "model.safetensors", with_slice(0, 1, 2)), grpc::StatusCode::INVALID_ARGUMENT,
                {"layers.0.experts_blocks", "passes axis 0 of size 2"});
  ExpectRefused(Load("d", "model.safetensors", with_slice(0, 0, 0)), grpc::StatusCode::INVALID_ARGUMENT,
                {"rules[1].slice", "length >= 1"});
  ExpectRefused(Load("e", "model.safetensors", with_slice(0, -1, 1)), grpc::StatusCode::INVALID_ARGUMENT,
                {"rules[1].slice"});
  // A slice whose shape the conversion cannot take (Hopper values need rows in whole tiles).
  ExpectRefused(Load("f", "model.safetensors", with_slice(1, 0, 7)), grpc::StatusCode::INVALID_ARGUMENT,
                {"layers.0.experts_blocks", "rule 1"});
}

// --preload: the file's sets load once the daemon serves, as LoadWeights would load them; a
// set whose checkpoint is missing is logged and the daemon serves on.
TEST_F(WeightsTest, PreloadLoadsTheFilesSetsOnceServing) {
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  v1::WeightPreload preload;
  v1::LoadWeightsRequest* a = preload.add_sets();
  a->set_name("pre");
  a->set_path("model.safetensors");
  for (const v1::WeightRule& r : Rules()) *a->add_rules() = r;
  v1::LoadWeightsRequest* b = preload.add_sets();
  b->set_name("missing");
  b->set_path("absent.safetensors");
  v1::LoadWeightsRequest* c = preload.add_sets();  // a GPU by index, on a daemon without GPUs
  c->set_name("ongpu");
  c->set_path("model.safetensors");
  c->set_device_index(0);
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(preload, &text));
  const std::string file = dir_ + "/preload.txtpb";
  std::ofstream(file) << text;
  StartDaemon(0, true, {"--preload=" + file});
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (absl::Now() < end && daemon_->Log().find("event=weights_preload_failed set=ongpu") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::string log = daemon_->Log();
  EXPECT_NE(log.find("event=weights_preloaded set=pre "), std::string::npos) << log;
  EXPECT_NE(log.find("event=weights_preload_failed set=missing "), std::string::npos) << log;
  EXPECT_NE(log.find("event=weights_preload_failed set=ongpu "), std::string::npos) << log;
  EXPECT_NE(log.find("code=FAILED_PRECONDITION"), std::string::npos) << log;
  const v1::ListWeightsResponse list = List();
  ASSERT_EQ(list.sets_size(), 1) << list.DebugString();
  EXPECT_EQ(list.sets(0).manifest().name(), "pre");
  ExpectAttachedPrepared("pre", Checkpoint());
  EXPECT_EQ(daemon_->Health(), 1);
}

TEST_F(WeightsTest, AMalformedPreloadFileStopsTheStartNamingTheEntry) {
  const std::string file = dir_ + "/preload.txtpb";
  const struct {
    std::string text;
    std::vector<std::string> names;
  } cases[] = {
      {"sets { name: \"a\" path: \"m\" ", {"preload.txtpb", "not a text-format wprep.v1.WeightPreload", "line"}},
      {"sets { name: \"a\" path: \"m\" rules { pattern: \"\" verbatim: true } }", {"sets[0].rules[0].pattern"}},
      {"sets { name: \"a\" path: \"m\" } sets { name: \"a\" path: \"n\" }", {"sets[1].name 'a' is given twice"}},
      {"sets { name: \"a b\" path: \"m\" }", {"sets[0].name 'a b'"}},
      {"sets { name: \"a\" path: \"m\" rules { pattern: \"x\" slice { length: 0 } } }", {"sets[0].rules[0].slice"}},
      {"sets { name: \"a\" path: \"m\" device_uuid: \"abc\" }", {"sets[0].device_uuid"}},
      {"sets { name: \"a\" path: \"m\" device_uuid: \"0123456789abcdef\" device_index: 0 }",
       {"sets[0].device_index", "not both"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    std::ofstream(file, std::ios::trunc) << c.text;
    std::string error;
    std::unique_ptr<Daemon> d =
        Daemon::Start({"--devices=cpu", "--weights-root=" + root_, "--weights-shm-dir=" + shm_, "--preload=" + file},
                      &error);
    EXPECT_EQ(d, nullptr);
    for (const std::string& n : c.names) EXPECT_NE(error.find(n), std::string::npos) << error << " lacks " << n;
  }
  std::string error;
  EXPECT_EQ(Daemon::Start({"--devices=cpu", "--preload=" + dir_ + "/none.txtpb"}, &error), nullptr);
  EXPECT_NE(error.find("none.txtpb: cannot be read"), std::string::npos) << error;
}

TEST_F(WeightsTest, ShardedCheckpointGivesTheSameTensors) {
  StartDaemon();
  const std::vector<Tensor> cp = Checkpoint();
  ASSERT_EQ(mkdir((root_ + "/sharded").c_str(), 0755), 0);
  const std::string h1 = WriteSafetensors(root_ + "/sharded/model-00001-of-00002.safetensors", {cp[0], cp[2]});
  const std::string h2 = WriteSafetensors(root_ + "/sharded/model-00002-of-00002.safetensors", {cp[1], cp[3]});
  std::ofstream(root_ + "/sharded/model.safetensors.index.json")
      << R"({"metadata":{"total_size":1},"weight_map":{)"
      << R"("layers.0.experts_blocks":"model-00001-of-00002.safetensors",)"
      << R"("lm_head_blocks":"model-00001-of-00002.safetensors",)"
      << R"("layers.0.experts_scales":"model-00002-of-00002.safetensors",)"
      << R"("embed.weight":"model-00002-of-00002.safetensors"}})";
  const LoadResult r = Load("sharded", "sharded");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const v1::WeightManifest& m = r.messages.back().manifest();
  EXPECT_EQ(m.source_checksum(), Sha256(Sha256(h1) + Sha256(h2)));
  grpc::ClientContext actx;
  auto attach = Attach(&actx, "sharded");
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a));
  ExpectPrepared(cp, a.manifest(), a.shm_path());
  actx.TryCancel();
  EXPECT_EQ(attach->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitAttachments("sharded", 0));

  // An index naming a tensor its shard lacks, and one naming a shard outside the root.
  std::ofstream(root_ + "/sharded/model.safetensors.index.json")
      << R"({"weight_map":{"ghost":"model-00001-of-00002.safetensors"}})";
  const LoadResult ghost = Load("ghost", "sharded");
  EXPECT_EQ(ghost.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(ghost.status.error_message().find("ghost"), std::string::npos) << ghost.status.error_message();
  WriteSafetensors(outside_ + "/evil.safetensors", {cp[3]});
  std::ofstream(root_ + "/sharded/model.safetensors.index.json")
      << R"({"weight_map":{"embed.weight":"../../outside/evil.safetensors"}})";
  EXPECT_EQ(Load("evil", "sharded").status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(SetCount(), 1);
}

TEST_F(WeightsTest, OverBudgetIsRefusedBeforeAnythingChanges) {
  const std::vector<Tensor> cp = Checkpoint();
  WriteSafetensors(root_ + "/model.safetensors", cp);
  // Room for one set, not two.
  StartDaemon();
  const LoadResult probe = Load("probe", "model.safetensors");
  ASSERT_TRUE(probe.status.ok()) << probe.status.error_message();
  const uint64_t one = probe.messages.back().manifest().total_bytes();
  daemon_.reset();
  StartDaemon(one + one / 2);

  ASSERT_TRUE(Load("a", "model.safetensors").status.ok());
  const std::string shm_prefix = absl::StrCat("wprep-weights-", daemon_->pid(), "-");
  auto shm_files = [&] {
    int n = 0;
    std::unique_ptr<FILE, int (*)(FILE*)> ls(popen(("ls " + shm_).c_str(), "r"), pclose);
    char line[512];
    while (ls && fgets(line, sizeof line, ls.get()) != nullptr) n += std::string(line).rfind(shm_prefix, 0) == 0;
    return n;
  };
  const int files_before = shm_files();
  EXPECT_EQ(files_before, 1);
  const LoadResult b = Load("b", "model.safetensors");
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << b.status.error_message();
  EXPECT_TRUE(b.messages.empty()) << "progress before the budget check";
  EXPECT_EQ(shm_files(), files_before) << "a refused load allocated";
  const v1::ListWeightsResponse list = List();
  ASSERT_EQ(list.sets_size(), 1);
  EXPECT_EQ(list.sets(0).manifest().name(), "a");
  EXPECT_EQ(list.resident_bytes(), one);
  EXPECT_EQ(list.budget_bytes(), one + one / 2);
  EXPECT_EQ(MetricValue(HttpGet(daemon_->metrics_address(), "/metrics"), "wprep_weight_loads_failed_total"), 1.0);
  // Freed room is usable again.
  ASSERT_TRUE(Drop("a", false).ok());
  EXPECT_TRUE(Load("b", "model.safetensors").status.ok());
  EXPECT_EQ(daemon_->Health(), 1);
}

TEST_F(WeightsTest, PathsOutOfTheRootAreRefused) {
  StartDaemon();
  const std::vector<Tensor> cp = Checkpoint();
  WriteSafetensors(outside_ + "/model.safetensors", cp);
  WriteSafetensors(root_ + "/inside.safetensors", cp);
  ASSERT_EQ(symlink((outside_ + "/model.safetensors").c_str(), (root_ + "/link_out.safetensors").c_str()), 0);
  ASSERT_EQ(symlink(outside_.c_str(), (root_ + "/dir_out").c_str()), 0);
  ASSERT_EQ(symlink((root_ + "/inside.safetensors").c_str(), (root_ + "/link_in.safetensors").c_str()), 0);

  ExpectRefused(Load("x", "../outside/model.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {"'..'"});
  ExpectRefused(Load("x", "sub/../../outside/model.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {});
  ExpectRefused(Load("x", outside_ + "/model.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {"absolute"});
  ExpectRefused(Load("x", "link_out.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {"link_out"});
  ExpectRefused(Load("x", "dir_out/model.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {"dir_out"});
  ExpectRefused(Load("x", "missing.safetensors"), grpc::StatusCode::NOT_FOUND, {"missing"});
  ExpectRefused(Load("x", ""), grpc::StatusCode::INVALID_ARGUMENT, {});
  // A symlink that stays inside is followed.
  EXPECT_TRUE(Load("x", "link_in.safetensors").status.ok());
}

TEST_F(WeightsTest, NoRootMeansNoLoadingFromFiles) {
  StartDaemon(0, /*with_root=*/false);
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  ExpectRefused(Load("x", "model.safetensors"), grpc::StatusCode::PERMISSION_DENIED, {"--weights-root"});
}

// The C++ client (wprep/client/weights.h): load with progress, list, attach (the same
// bytes), a plain drop refused while attached, detach, a forced drop ending another
// attachment ABORTED, and an attachment dropped with its object detached.
TEST_F(WeightsTest, TheCppClientLoadsListsAttachesDetachesAndDrops) {
  StartDaemon();
  const std::vector<Tensor> cp = Checkpoint();
  WriteSafetensors(root_ + "/model.safetensors", cp);
  client::WeightSets sets(daemon_->unix_target());
  v1::LoadWeightsRequest req;
  req.set_name("cpp");
  req.set_path("model.safetensors");
  for (const auto& r : Rules()) *req.add_rules() = r;
  int messages = 0;
  absl::StatusOr<v1::LoadWeightsResponse> loaded =
      sets.Load(req, [&](const v1::LoadWeightsResponse& m) { ++messages; EXPECT_LE(m.bytes_done(), m.bytes_total()); });
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(messages, static_cast<int>(cp.size()) + 2);  // after planning, per tensor, the manifest
  EXPECT_EQ(loaded->manifest().name(), "cpp");
  EXPECT_EQ(sets.Load(req).status().code(), absl::StatusCode::kAlreadyExists);

  absl::StatusOr<v1::ListWeightsResponse> list = sets.List(/*with_tensors=*/true);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->sets_size(), 1);
  EXPECT_EQ(list->sets(0).manifest().tensors_size(), static_cast<int>(cp.size()));

  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> a = sets.Attach("cpp");
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectPrepared(cp, (*a)->info().manifest(), (*a)->info().shm_path());
  EXPECT_EQ(Attachments("cpp"), 1u);
  EXPECT_EQ(sets.Drop("cpp").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*a)->Detach().ok());
  EXPECT_TRUE((*a)->ended().ok());
  EXPECT_EQ(Attachments("cpp"), 0u);

  absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> b = sets.Attach("cpp");
  ASSERT_TRUE(b.ok()) << b.status();
  {
    absl::StatusOr<std::unique_ptr<client::WeightSets::Attachment>> c = sets.Attach("cpp");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(Attachments("cpp"), 2u);
  }  // its end cancels the stream: the daemon detaches it
  EXPECT_TRUE(WaitAttachments("cpp", 1));
  absl::StatusOr<uint64_t> freed = sets.Drop("cpp", /*force=*/true);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, loaded->manifest().total_bytes());
  EXPECT_EQ((*b)->ended().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE((*b)->Detach().ok()) << "detaching an ended attachment is not an error";
  EXPECT_EQ(sets.Attach("cpp").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(daemon_->Health(), 1);
}

// A daemon on the CPU engine keeps sets in host memory only; a malformed UUID is refused
// before that. Nothing is loaded either way, and the daemon serves on.
TEST_F(WeightsTest, AGpuSetOnACpuDaemonOrABadUuidIsRefused) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  ExpectRefused(Load("g", "model.safetensors", Rules(), std::string(16, '\x11')),
                grpc::StatusCode::FAILED_PRECONDITION, {"device_uuid", "CPU engine"});
  ExpectRefused(Load("g", "model.safetensors", Rules(), "short"), grpc::StatusCode::INVALID_ARGUMENT,
                {"device_uuid", "16 bytes"});
  {
    v1::LoadWeightsRequest req;
    req.set_name("g");
    req.set_path("model.safetensors");
    req.set_device_index(0);
    ExpectRefused(LoadRequest(req), grpc::StatusCode::FAILED_PRECONDITION, {"device_index", "CPU engine"});
    req.set_device_uuid(std::string(16, '\x11'));
    ExpectRefused(LoadRequest(req), grpc::StatusCode::INVALID_ARGUMENT, {"device_uuid or device_index"});
  }
  EXPECT_EQ(SetCount(), 0);
  EXPECT_TRUE(Load("g", "model.safetensors").status.ok());
}

TEST_F(WeightsTest, MalformedCheckpointsAreInvalidArgumentNamingFileAndTensor) {
  StartDaemon();
  const std::vector<uint8_t> data = Pattern(64, 9);
  const std::string ok_tensor = R"("t":{"dtype":"U8","shape":[8,8],"data_offsets":[0,64]})";
  // Header length past the end of the file.
  WriteRaw(root_ + "/long.safetensors", "{" + ok_tensor + "}", data, 1 << 20);
  ExpectRefused(Load("x", "long.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"long.safetensors"});
  // Not JSON.
  WriteRaw(root_ + "/json.safetensors", "{\"t\":{\"dtype\":", data);
  ExpectRefused(Load("x", "json.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"json.safetensors"});
  // Offsets past the data.
  WriteRaw(root_ + "/range.safetensors", R"({"t":{"dtype":"U8","shape":[8,16],"data_offsets":[0,128]}})", data);
  ExpectRefused(Load("x", "range.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"range.safetensors", "t"});
  // Two tensors over the same bytes.
  WriteRaw(root_ + "/overlap.safetensors",
           R"({"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},"b":{"dtype":"U8","shape":[32],"data_offsets":[32,64]}})",
           data);
  ExpectRefused(Load("x", "overlap.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"overlap.safetensors"});
  // Shape x dtype against the bytes.
  WriteRaw(root_ + "/shape.safetensors", R"({"w":{"dtype":"BF16","shape":[8,8],"data_offsets":[0,64]}})", data);
  ExpectRefused(Load("x", "shape.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"shape.safetensors", "w"});
  // Shorter than the length word.
  WriteRaw(root_ + "/tiny.safetensors", "", {}, 0);
  truncate((root_ + "/tiny.safetensors").c_str(), 3);
  ExpectRefused(Load("x", "tiny.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"tiny.safetensors"});
  // A sound file whose tensor a rule cannot convert (BF16; and a shape the layout refuses).
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  std::vector<v1::WeightRule> rules(1);
  rules[0].set_pattern("embed.*");
  *rules[0].mutable_convert() = SpecToProto(HopperValue());
  ExpectRefused(Load("x", "model.safetensors", rules), grpc::StatusCode::INVALID_ARGUMENT,
                {"model.safetensors", "embed.weight", "BF16"});
  // Rules and names the edge refuses.
  rules[0].set_pattern("");
  ExpectRefused(Load("x", "model.safetensors", rules), grpc::StatusCode::INVALID_ARGUMENT, {"rules[0].pattern"});
  ConversionSpec unswizzle = HopperValue();
  unswizzle.direction = Direction::kUnswizzle;
  rules[0].set_pattern("*");
  *rules[0].mutable_convert() = SpecToProto(unswizzle);
  ExpectRefused(Load("x", "model.safetensors", rules), grpc::StatusCode::INVALID_ARGUMENT,
                {"rules[0].convert.direction"});
  ExpectRefused(Load("bad/name", "model.safetensors"), grpc::StatusCode::INVALID_ARGUMENT, {"name"});
  // After all that, a good load still works, once.
  ASSERT_TRUE(Load("x", "model.safetensors").status.ok());
  EXPECT_EQ(Load("x", "model.safetensors").status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

TEST_F(WeightsTest, ForcedDropEndsAttachmentsAborted) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  ASSERT_TRUE(Load("s", "model.safetensors").status.ok());
  grpc::ClientContext actx;
  auto attach = Attach(&actx, "s");
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a));
  EXPECT_EQ(Drop("s", false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Drop("s", true).ok());
  EXPECT_FALSE(attach->Read(&a));
  EXPECT_EQ(attach->Finish().error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(SetCount(), 0);
  // Unknown names and ids.
  grpc::ClientContext ctx2;
  auto gone = Attach(&ctx2, "s");
  EXPECT_FALSE(gone->Read(&a));
  EXPECT_EQ(gone->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx3;
  v1::DetachWeightsRequest dreq;
  dreq.set_attachment_id(12345);
  v1::DetachWeightsResponse dresp;
  EXPECT_EQ(stub_->DetachWeights(&ctx3, dreq, &dresp).error_code(), grpc::StatusCode::NOT_FOUND);
}

// The child of KilledClientIsDetached: attaches to $WPREP_WEIGHTS_CHILD_SET on
// $WPREP_WEIGHTS_CHILD_TARGET, says so on stdout and waits to be killed.
TEST(WeightsChild, AttachAndWait) {
  const char* target = std::getenv("WPREP_WEIGHTS_CHILD_TARGET");
  const char* set = std::getenv("WPREP_WEIGHTS_CHILD_SET");
  if (target == nullptr || set == nullptr) GTEST_SKIP() << "run by KilledClientIsDetached only";
  auto stub = v1::WeightSets::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::AttachWeightsRequest req;
  req.set_name(set);
  auto attach = stub->AttachWeights(&ctx, req);
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a));
  std::printf("attached %llu\n", static_cast<unsigned long long>(a.attachment_id()));
  std::fflush(stdout);
  for (;;) pause();
}

TEST_F(WeightsTest, KilledClientIsDetached) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  ASSERT_TRUE(Load("s", "model.safetensors").status.ok());
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  // Set before fork: the child only execs.
  setenv("WPREP_WEIGHTS_CHILD_TARGET", daemon_->unix_target().c_str(), 1);
  setenv("WPREP_WEIGHTS_CHILD_SET", "s", 1);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dup2(out[1], 1);
    execl("/proc/self/exe", "weights_test", "--gtest_filter=WeightsChild.AttachAndWait", nullptr);
    _exit(127);
  }
  unsetenv("WPREP_WEIGHTS_CHILD_TARGET");
  unsetenv("WPREP_WEIGHTS_CHILD_SET");
  close(out[1]);
  // gtest prints its own lines first.
  std::string said;
  char c;
  while (said.find("attached ") == std::string::npos && read(out[0], &c, 1) == 1) said.push_back(c);
  close(out[0]);
  ASSERT_NE(said.find("attached "), std::string::npos) << said;
  EXPECT_EQ(Attachments("s"), 1u);
  EXPECT_EQ(Drop("s", false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WaitAttachments("s", 0)) << "the killed client is still attached";
  EXPECT_TRUE(Drop("s", false).ok());
  EXPECT_EQ(daemon_->Health(), 1);
}

// SIGTERM with an engine attached: the attachment ends UNAVAILABLE and the daemon exits
// (an attachment holds its handler, which must not hold up the drain).
TEST_F(WeightsTest, DrainEndsAttachments) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  ASSERT_TRUE(Load("s", "model.safetensors").status.ok());
  grpc::ClientContext actx;
  auto attach = Attach(&actx, "s");
  v1::AttachWeightsResponse a;
  ASSERT_TRUE(attach->Read(&a));
  daemon_->Signal(SIGTERM);
  EXPECT_FALSE(attach->Read(&a));
  EXPECT_EQ(attach->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  const int status = daemon_->WaitExit();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << daemon_->Log();
  EXPECT_NE(access(a.shm_path().c_str(), F_OK), 0) << "a stopped daemon's set file stays";
}

// Runs `wprep ARGS` and returns its exit status and what it printed (stdout and stderr).
int RunCli(const std::string& args, std::string* output) {
  const char* env = std::getenv("WPREP_CLI");  // set where the build tree moved (GPU bundle)
  const std::string cmd =
      absl::StrCat(env != nullptr && *env != '\0' ? env : WPREP_CLI_PATH, " ", args, " 2>&1");
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  char buf[4096];
  size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p.get())) > 0) output->append(buf, n);
  const int status = pclose(p.release());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(WeightsTest, CliLoadsListsShowsAndDrops) {
  StartDaemon();
  WriteSafetensors(root_ + "/model.safetensors", Checkpoint());
  const std::string target = "--target " + daemon_->unix_target();
  std::string out;
  ASSERT_EQ(RunCli(absl::StrCat("weights load cli model.safetensors ", target,
                                " --progress none --rules 'lm_head*=verbatim;*_blocks=hopper_value;"
                                "*.experts_scales=hopper_scale:mx_axis=-2'"),
                   &out),
            0)
      << out;
  EXPECT_NE(out.find("cli  model.safetensors"), std::string::npos) << out;
  // The same rules as Rules(): the same set.
  ExpectAttachedPrepared("cli", Checkpoint());
  ASSERT_TRUE(WaitAttachments("cli", 0));
  out.clear();
  ASSERT_EQ(RunCli("weights list " + target, &out), 0) << out;
  EXPECT_NE(out.find("cli  model.safetensors"), std::string::npos) << out;
  EXPECT_NE(out.find("budget unlimited"), std::string::npos) << out;
  out.clear();
  ASSERT_EQ(RunCli("weights show cli " + target, &out), 0) << out;
  EXPECT_NE(out.find("HopperMXValueLayout"), std::string::npos) << out;
  EXPECT_NE(out.find("embed.weight"), std::string::npos) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x ../escape " + target, &out), 2);
  EXPECT_EQ(out.rfind("PERMISSION_DENIED", 0), 0u) << out;
  out.clear();
  // --gpu: an index goes as device_index, a UUID as its bytes; this daemon has no GPU.
  EXPECT_EQ(RunCli("weights load x model.safetensors --gpu 0 " + target, &out), 2);
  EXPECT_EQ(out.rfind("FAILED_PRECONDITION: device_index", 0), 0u) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x model.safetensors --gpu GPU-00112233-4455-6677-8899-aabbccddeeff " + target, &out), 2);
  EXPECT_EQ(out.rfind("FAILED_PRECONDITION: device_uuid", 0), 0u) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x model.safetensors --gpu GPU-zz " + target, &out), 2);
  EXPECT_EQ(out.rfind("INVALID_ARGUMENT: --gpu", 0), 0u) << out;
  out.clear();
  // --vmm: refused without --gpu before any call; with it, the daemon's GPU refusal.
  EXPECT_EQ(RunCli("weights load x model.safetensors --vmm " + target, &out), 2);
  EXPECT_EQ(out.rfind("INVALID_ARGUMENT: --vmm is for load --gpu", 0), 0u) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x model.safetensors --gpu 0 --vmm " + target, &out), 2);
  EXPECT_EQ(out.rfind("FAILED_PRECONDITION: device_index", 0), 0u) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x model.safetensors --rules 'a=nolayout' " + target, &out), 2);
  EXPECT_EQ(out.rfind("INVALID_ARGUMENT", 0), 0u) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights load x model.safetensors --rules 'a=verbatim:slice=0/1' " + target, &out), 2);
  EXPECT_EQ(out.rfind("INVALID_ARGUMENT", 0), 0u) << out;
  EXPECT_NE(out.find("slice=AXIS/START/LENGTH"), std::string::npos) << out;
  out.clear();
  // A slice in the rules: rows 4..11 of the BF16 copy, the second expert converted.
  ASSERT_EQ(RunCli(absl::StrCat("weights load sliced model.safetensors ", target,
                                " --progress none --rules 'embed.*=verbatim:slice=0/4/8;"
                                "*experts_blocks=hopper_value:slice=0/1/1'"),
                   &out),
            0)
      << out;
  {
    grpc::ClientContext actx;
    auto attach = Attach(&actx, "sliced");
    v1::AttachWeightsResponse a;
    ASSERT_TRUE(attach->Read(&a));
    for (const v1::WeightTensor& t : a.manifest().tensors()) {
      if (t.name() == "embed.weight") {
        EXPECT_EQ(t.slice().start(), 4);
        EXPECT_EQ(ReadShm(a.shm_path(), t.offset(), t.bytes()), Sliced(Checkpoint()[3], 0, 4, 8).bytes);
      } else if (t.name() == "layers.0.experts_blocks") {
        EXPECT_EQ(t.slice().length(), 1);
        EXPECT_EQ(ReadShm(a.shm_path(), t.offset(), t.bytes()), Converted(HopperValue(), Sliced(Checkpoint()[0], 0, 1, 1)));
      } else {
        EXPECT_FALSE(t.has_slice()) << t.name();
      }
    }
    actx.TryCancel();
    attach->Finish();
  }
  ASSERT_TRUE(WaitAttachments("sliced", 0));
  out.clear();
  ASSERT_EQ(RunCli("weights drop sliced " + target, &out), 0) << out;
  out.clear();
  ASSERT_EQ(RunCli("weights drop cli " + target, &out), 0) << out;
  out.clear();
  EXPECT_EQ(RunCli("weights show cli " + target, &out), 2);
  EXPECT_EQ(out.rfind("NOT_FOUND", 0), 0u) << out;
}

}  // namespace
}  // namespace wprep::testing
