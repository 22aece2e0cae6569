// The trtllm-gen reference vectors (tests/data/golden_trtllm and golden_trtllm_formats,
// made by the contract's reference trtllm_ref.py): each case's op, params, inputs (made
// from their splitmix64 seeds, their checksums checked) and the outputs' checksums.
#ifndef WPREP_TESTS_CLIENT_MOE_GOLDEN_H_
#define WPREP_TESTS_CLIENT_MOE_GOLDEN_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "golden.h"
#include "nlohmann/json.hpp"

namespace wprep::testing {

struct MoeGoldenTensor {
  std::string name;
  std::string dtype;  // uint8 | float32 | bfloat16
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // outputs: elements
  uint64_t bytes = 0;
  uint64_t seed = 0;  // inputs of success cases
  std::string sha256;
};

struct MoeGoldenCase {
  std::string set;  // golden_trtllm | golden_trtllm_formats
  std::string name;
  std::string op;
  // The params as `wprep moe --param` spells them (booleans true/false, decimal integers).
  std::vector<std::pair<std::string, std::string>> params;
  std::vector<MoeGoldenTensor> inputs, outputs;
  bool error = false;  // the case must be rejected (INVALID_ARGUMENT)
};

inline std::string MoeDataDir() {
  const char* env = std::getenv("WPREP_TEST_DATA_DIR");
  return env != nullptr && *env != '\0' ? env : WPREP_MOE_DATA_DIR;
}

// Every case of both manifests, in manifest order.
inline const std::vector<MoeGoldenCase>& MoeGoldenCases() {
  static const std::vector<MoeGoldenCase>* cases = [] {
    auto* out = new std::vector<MoeGoldenCase>;
    for (const char* set : {"golden_trtllm", "golden_trtllm_formats"}) {
      std::ifstream f(MoeDataDir() + "/" + set + "/manifest.json");
      EXPECT_TRUE(f.good()) << "no manifest in " << MoeDataDir() << "/" << set;
      if (!f.good()) continue;
      const nlohmann::json m = nlohmann::json::parse(f);
      EXPECT_EQ(m.at("format").get<int>(), 1) << set;
      auto tensor = [](const nlohmann::json& t) {
        MoeGoldenTensor x;
        x.name = t.at("name").get<std::string>();
        x.dtype = t.at("dtype").get<std::string>();
        x.shape = t.at("shape").get<std::vector<int64_t>>();
        if (t.contains("strides")) x.strides = t.at("strides").get<std::vector<int64_t>>();
        if (t.contains("bytes")) x.bytes = t.at("bytes").get<uint64_t>();
        if (t.contains("splitmix64_seed")) x.seed = t.at("splitmix64_seed").get<uint64_t>();
        if (t.contains("sha256")) x.sha256 = t.at("sha256").get<std::string>();
        return x;
      };
      for (const nlohmann::json& c : m.at("cases")) {
        MoeGoldenCase g;
        g.set = set;
        g.name = c.at("name").get<std::string>();
        g.op = c.at("op").get<std::string>();
        for (const auto& [k, v] : c.at("params").items()) {
          g.params.emplace_back(k, v.is_boolean() ? (v.get<bool>() ? "true" : "false")
                                   : v.is_string() ? v.get<std::string>()
                                                   : std::to_string(v.get<int64_t>()));
        }
        for (const nlohmann::json& t : c.at("inputs")) g.inputs.push_back(tensor(t));
        if (c.contains("outputs")) {
          for (const nlohmann::json& t : c.at("outputs")) g.outputs.push_back(tensor(t));
        }
        g.error = c.contains("error");
        if (g.error) {
          EXPECT_EQ(c.at("error").get<std::string>(), "invalid_argument") << g.name;
        }
        out->push_back(std::move(g));
      }
    }
    return out;
  }();
  return *cases;
}

inline uint64_t MoeDTypeBytes(const std::string& dtype) { return dtype == "float32" ? 4 : dtype == "bfloat16" ? 2 : 1; }

// An input's bytes: its splitmix64 stream (checked against the manifest's checksum) for a
// success case; zeros of its shape's size for an error case (which gives shapes only).
inline std::vector<uint8_t> MoeGoldenInput(const MoeGoldenTensor& t) {
  if (!t.sha256.empty()) {
    std::vector<uint8_t> in = SplitMix64Bytes(t.seed, t.bytes);
    EXPECT_EQ(Sha256Hex(in), t.sha256) << t.name << ": the input generator disagrees with the manifest";
    return in;
  }
  uint64_t n = MoeDTypeBytes(t.dtype);
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return std::vector<uint8_t>(n, 0);
}

inline std::string JoinDims(const std::vector<int64_t>& v, const char* sep = ",") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += sep;
    s += std::to_string(v[i]);
  }
  return s;
}

}  // namespace wprep::testing

#endif  // WPREP_TESTS_CLIENT_MOE_GOLDEN_H_
