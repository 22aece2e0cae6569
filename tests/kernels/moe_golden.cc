#include "moe_golden.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "golden.h"
#include "nlohmann/json.hpp"

namespace wprep::testing {
namespace {

std::string DataDir() {
  if (const char* d = std::getenv("WPREP_TEST_DATA_DIR")) return d;
  return WPREP_MOE_TEST_DATA_DIR;
}

std::string ParamText(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_string()) return v.get<std::string>();
  return v.dump();  // anything else: its JSON text, which the engine must reject
}

}  // namespace

std::vector<MoeGoldenCase> LoadMoeGolden(const std::string& set) {
  const std::string dir = DataDir() + "/" + set;
  const std::vector<uint8_t> text = ReadFile(dir + "/manifest.json");
  std::vector<MoeGoldenCase> cases;
  if (text.empty()) {
    ADD_FAILURE() << "cannot read " << dir << "/manifest.json";
    return cases;
  }
  const auto m = nlohmann::json::parse(text.begin(), text.end());
  for (const auto& j : m.at("cases")) {
    MoeGoldenCase c;
    c.set = set;
    c.name = j.at("name").get<std::string>();
    c.op = j.at("op").get<std::string>();
    for (const auto& [k, v] : j.at("params").items()) c.params.emplace_back(k, ParamText(v));
    for (const auto& t : j.at("inputs")) {
      MoeGoldenInput in;
      in.name = t.at("name").get<std::string>();
      in.dtype = t.at("dtype").get<std::string>();
      in.shape = t.at("shape").get<std::vector<int64_t>>();
      if (t.contains("splitmix64_seed")) {
        in.generated = true;
        in.seed = t.at("splitmix64_seed").get<uint64_t>();
        in.bytes = t.at("bytes").get<uint64_t>();
        in.sha256 = t.at("sha256").get<std::string>();
      }
      c.inputs.push_back(std::move(in));
    }
    if (j.contains("error")) {
      c.error = true;
      c.why = j.value("why", "");
    } else {
      for (const auto& o : j.at("outputs")) {
        MoeGoldenOutput out;
        out.name = o.at("name").get<std::string>();
        out.dtype = o.at("dtype").get<std::string>();
        out.shape = o.at("shape").get<std::vector<int64_t>>();
        out.strides = o.at("strides").get<std::vector<int64_t>>();
        out.bytes = o.at("bytes").get<uint64_t>();
        out.sha256 = o.at("sha256").get<std::string>();
        if (o.contains("file")) out.file = dir + "/" + o.at("file").get<std::string>();
        c.outputs.push_back(std::move(out));
      }
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<std::vector<uint8_t>> MoeGoldenInputs(const MoeGoldenCase& c) {
  std::vector<std::vector<uint8_t>> out;
  for (const MoeGoldenInput& t : c.inputs) {
    if (t.generated) {
      out.push_back(SplitMix64Bytes(t.seed, t.bytes));
      EXPECT_EQ(Sha256Hex(out.back()), t.sha256) << c.name << "." << t.name
                                                  << ": input generator disagrees with the manifest";
    } else {
      uint64_t n = 1;
      auto dt = ParseMoeDType(t.dtype);
      if (dt.ok()) n = MoeDTypeSize(*dt);
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      out.emplace_back(n, 0);
    }
  }
  return out;
}

absl::StatusOr<MoePlan> PlanMoeGolden(const MoeGoldenCase& c) {
  auto op = ParseMoeOp(c.op);
  if (!op.ok()) return op.status();
  MoeParams params;
  for (const auto& [k, v] : c.params) {
    if (absl::Status s = SetMoeParam(params, k, v); !s.ok()) return s;
  }
  std::vector<MoeTensorDesc> descs;
  for (const MoeGoldenInput& t : c.inputs) {
    auto dt = ParseMoeDType(t.dtype);
    if (!dt.ok()) return dt.status();
    descs.push_back({t.name, *dt, t.shape});
  }
  return PlanMoe(*op, params, std::move(descs));
}

std::vector<std::vector<uint8_t>> InPlanOrder(const MoePlan& plan, const MoeGoldenCase& c,
                                              std::vector<std::vector<uint8_t>> inputs) {
  std::vector<std::vector<uint8_t>> ordered;
  for (const MoeTensorDesc& d : plan.inputs) {
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      if (c.inputs[i].name == d.name) ordered.push_back(std::move(inputs[i]));
    }
  }
  return ordered;
}

std::vector<std::vector<uint8_t>> RunMoeCpuFresh(const MoePlan& plan,
                                                 const std::vector<std::vector<uint8_t>>& in,
                                                 int threads) {
  std::vector<std::vector<uint8_t>> out;
  for (uint64_t n : plan.output_bytes) out.emplace_back(n, 0xA5);
  std::vector<absl::Span<const uint8_t>> ins(in.begin(), in.end());
  std::vector<absl::Span<uint8_t>> outs;
  for (auto& o : out) outs.emplace_back(o);
  const absl::Status s = RunMoeCpu(plan, ins, outs, threads);
  EXPECT_TRUE(s.ok()) << plan.identity << ": " << s;
  return out;
}

void ExpectMatchesGolden(const MoeGoldenCase& c, const MoePlan& plan,
                         const std::vector<std::vector<uint8_t>>& outputs, const char* engine) {
  ASSERT_EQ(plan.outputs.size(), c.outputs.size()) << c.name;
  ASSERT_EQ(outputs.size(), c.outputs.size()) << c.name;
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    const MoeGoldenOutput& want = c.outputs[i];
    const std::string where = c.set + "/" + c.name + "." + want.name + " (" + engine + ")";
    EXPECT_EQ(plan.outputs[i].name, want.name) << where;
    EXPECT_EQ(MoeDTypeName(plan.outputs[i].dtype), want.dtype) << where;
    EXPECT_EQ(plan.outputs[i].shape, want.shape) << where;
    EXPECT_EQ(plan.output_strides[i], want.strides) << where;
    EXPECT_EQ(plan.output_bytes[i], want.bytes) << where;
    EXPECT_EQ(outputs[i].size(), want.bytes) << where;
    EXPECT_EQ(Sha256Hex(outputs[i]), want.sha256) << where;
    if (!want.file.empty()) {
      EXPECT_TRUE(ReadFile(want.file) == outputs[i]) << where << ": differs from " << want.file;
    }
  }
}

}  // namespace wprep::testing
