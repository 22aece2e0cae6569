// Shared helpers of the libFuzzer targets: a check that reports and aborts (so libFuzzer
// keeps the input as a crash), and the independent checks of a plan and of a CPU
// conversion that every target applies to what it planned.
#ifndef WPREP_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define WPREP_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "wprep/kernels/plan.h"

// Aborts with the condition and a message when `cond` is false: an invariant broke.
#define WPREP_FUZZ_CHECK(cond, ...)                                                \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n  ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                           \
      std::fprintf(stderr, "\n");                                                  \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

namespace wprep::fuzz {

// The fuzz targets' entry points (request_fuzzer.cc, stream_fuzzer.cc, batch_fuzzer.cc,
// safetensors_fuzzer.cc):
// what libFuzzer calls, and what fuzz_replay_test calls with every committed input.
// Return 0; a broken invariant aborts.
int FuzzRequest(const uint8_t* data, size_t size);
int FuzzStream(const uint8_t* data, size_t size);
int FuzzBatch(const uint8_t* data, size_t size);
int FuzzSafetensors(const uint8_t* data, size_t size);

// Plans whose input, input buffer and output all fit in this many bytes are also run
// through the CPU engine (one thread), on buffers of exactly their size so that
// AddressSanitizer sees any byte read or written outside them.
inline constexpr uint64_t kRunBytes = 256 << 10;

// One past the largest byte offset a view of `shape` with byte `strides` reaches (0 for
// an empty view), computed here rather than by the planner. False when it overflows.
bool ViewSpan(absl::Span<const int64_t> shape, absl::Span<const int64_t> strides, uint64_t* span);

// The plan's own consistency, independent of how it was made: ranks agree, the storage
// shapes hold exactly the byte counts, the views lie inside them, a dense view covers
// exactly its bytes, and the spec names a layout and direction the planner accepts.
void CheckPlan(const Plan& plan, absl::Span<const int64_t> logical_shape);

// Converts `input` (a buffer of `buffer_bytes` bytes that the plan's view lies in) on
// the CPU engine, twice, into outputs first filled with 0x00 and then 0xFF: both runs
// must succeed and agree (every output byte written, nothing read from the output). A
// strided view is also gathered into the dense storage of the same conversion
// (independently, index by index) and converted through the dense plan: the outputs
// must be the same bytes. Plans above kRunBytes are skipped.
void RunOnCpu(const Plan& plan, const uint8_t* input, uint64_t buffer_bytes);

// `n` bytes that depend on `seed`, to fill inputs the fuzzer does not give.
std::vector<uint8_t> Pattern(uint64_t n, uint64_t seed);

// Reads a fuzz input front to back: LEB128 varints and byte strings. Past the end it
// reads zeros and empty strings, so every input is a complete program. The seed
// generator (seed_corpus.cc) writes the same format.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ == end_; }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  uint8_t Byte() { return p_ == end_ ? 0 : *p_++; }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && p_ != end_; shift += 7) {
      const uint8_t b = *p_++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) break;
    }
    return v;
  }
  std::string Bytes(uint64_t n) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, static_cast<uint64_t>(end_ - p_)));
    std::string s(reinterpret_cast<const char*>(p_), take);
    p_ += take;
    return s;
  }

 private:
  const uint8_t* p_;
  const uint8_t* const end_;
};

// Appends `v` as a LEB128 varint (ByteReader::Varint reads it back).
inline void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace wprep::fuzz

#endif  // WPREP_TESTS_FUZZ_FUZZ_SUPPORT_H_
