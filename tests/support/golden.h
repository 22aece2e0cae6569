// Test support: the reference vectors of LAYOUTS.md (manifest, regenerated inputs,
// expected outputs) and small helpers shared by the host and GPU tests.
#ifndef WPREP_TESTS_SUPPORT_GOLDEN_H_
#define WPREP_TESTS_SUPPORT_GOLDEN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wprep/kernels/plan.h"
#include "wprep/spec/spec.h"

namespace wprep::testing {

struct GoldenCase {
  std::string name;
  ConversionSpec spec;
  std::vector<int64_t> logical_shape;
  std::optional<std::string> error;  // set for cases that must be rejected

  uint64_t input_seed = 0;
  uint64_t input_bytes = 0;
  std::string input_sha256;
  std::vector<int64_t> input_shape;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> output_strides;
  uint64_t output_bytes = 0;
  std::string output_sha256;
  std::string output_file;  // absolute path, empty when not stored
};

// Folder of the reference vectors kept in the repo (tests/data/golden), or
// $WPREP_GOLDEN_DIR when set.
std::string GoldenDir();

// All cases of GoldenDir()/manifest.json. Aborts the test binary when unreadable.
const std::vector<GoldenCase>& GoldenCases();

// The input byte stream of LAYOUTS.md: successive splitmix64 outputs, little-endian.
std::vector<uint8_t> SplitMix64Bytes(uint64_t seed, uint64_t n);

std::string Sha256Hex(const std::vector<uint8_t>& data);
std::vector<uint8_t> ReadFile(const std::string& path);

// A reproducible random byte vector.
std::vector<uint8_t> RandomBytes(uint64_t n, uint64_t seed);

// A non-dense copy of the input `dense` of `dense_plan` (planned with default strides):
// every dim but the contiguous one gets `pad` extra bytes per step, the gaps are
// poisoned. Plan the same conversion with InputBinding{strides, buffer.size()} to read it.
struct StridedInput {
  std::vector<uint8_t> buffer;
  std::vector<int64_t> strides;
};
StridedInput MakeStridedInput(const Plan& dense_plan, const std::vector<uint8_t>& dense,
                              int64_t pad);

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SUPPORT_GOLDEN_H_
