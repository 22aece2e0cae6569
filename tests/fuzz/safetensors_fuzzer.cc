// libFuzzer target: the safetensors header parser (client/cli/safetensors.h), which
// `wprep convert-safetensors` and `wprep inspect` feed untrusted files.
//
// Input: the whole file. The harness checks, independently of the parser:
// - a refusal is INVALID_ARGUMENT (the whole file was given, so never OUT_OF_RANGE) with
//   a message of bounded length;
// - an accepted header lies inside the file; its tensors have unique names, are ordered
//   by offset and tile the data section exactly, each holding shape x dtype bits in whole
//   bytes;
// - every prefix of the file that stops inside the announced header is OUT_OF_RANGE;
// - the header written back (SerializeSafetensorsHeader) parses to the same tensors and
//   metadata, with an 8-byte aligned data section.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "fuzz_support.h"
#include "safetensors.h"

namespace wprep::fuzz {

int FuzzSafetensors(const uint8_t* data, size_t size) {
  using cli::ParseSafetensorsHeader;
  using cli::SafetensorsHeader;
  const absl::Span<const uint8_t> file(data, size);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(file, size);
  if (!h.ok()) {
    WPREP_FUZZ_CHECK(h.status().code() == absl::StatusCode::kInvalidArgument, "%s",
                     h.status().ToString().c_str());
    WPREP_FUZZ_CHECK(h.status().message().size() <= 2048, "a %zu-byte message", h.status().message().size());
    return 0;
  }
  WPREP_FUZZ_CHECK(h->data_offset() <= size, "header of %llu bytes in a %zu-byte file",
                   static_cast<unsigned long long>(h->header_bytes), size);
  const uint64_t data_bytes = size - h->data_offset();
  uint64_t next = 0;
  std::set<std::string> names;
  for (const cli::SafetensorsTensor& t : h->tensors) {
    WPREP_FUZZ_CHECK(names.insert(t.name).second, "tensor %s twice", t.name.c_str());
    WPREP_FUZZ_CHECK(t.begin == next && t.end >= t.begin, "%s at [%llu, %llu), expected from %llu", t.name.c_str(),
                     static_cast<unsigned long long>(t.begin), static_cast<unsigned long long>(t.end),
                     static_cast<unsigned long long>(next));
    unsigned __int128 bits = static_cast<unsigned>(cli::DtypeBits(t.dtype));
    for (int64_t d : t.shape) {
      WPREP_FUZZ_CHECK(d >= 0, "%s: dim %lld", t.name.c_str(), static_cast<long long>(d));
      bits *= static_cast<uint64_t>(d);
      if (bits > (static_cast<unsigned __int128>(1) << 80)) break;
    }
    WPREP_FUZZ_CHECK(bits % 8 == 0 && bits / 8 == t.bytes(), "%s: shape x dtype is not its %llu bytes", t.name.c_str(),
                     static_cast<unsigned long long>(t.bytes()));
    next = t.end;
  }
  WPREP_FUZZ_CHECK(next == data_bytes, "tensors end at %llu of a %llu-byte data section",
                   static_cast<unsigned long long>(next), static_cast<unsigned long long>(data_bytes));
  // Prefixes that stop inside the header: the caller must read more.
  for (uint64_t k : {uint64_t{8}, h->data_offset() / 2, h->data_offset() - 1}) {
    if (k < 8 || k >= h->data_offset()) continue;
    absl::StatusOr<SafetensorsHeader> p = ParseSafetensorsHeader(file.first(k), size);
    WPREP_FUZZ_CHECK(p.status().code() == absl::StatusCode::kOutOfRange, "prefix of %llu bytes: %s",
                     static_cast<unsigned long long>(k), p.status().ToString().c_str());
  }
  // Written back, it reads the same.
  const std::string again = cli::SerializeSafetensorsHeader(h->metadata, h->tensors);
  WPREP_FUZZ_CHECK(again.size() % 8 == 0, "a %zu-byte header", again.size());
  const auto* bytes = reinterpret_cast<const uint8_t*>(again.data());
  absl::StatusOr<SafetensorsHeader> r = ParseSafetensorsHeader(absl::MakeConstSpan(bytes, again.size()),
                                                               again.size() + data_bytes);
  WPREP_FUZZ_CHECK(r.ok(), "the written header: %s", r.status().ToString().c_str());
  WPREP_FUZZ_CHECK(r->metadata == h->metadata, "metadata changed");
  WPREP_FUZZ_CHECK(r->tensors.size() == h->tensors.size(), "tensor count changed");
  for (size_t i = 0; i < r->tensors.size(); ++i) {
    const cli::SafetensorsTensor &a = h->tensors[i], &b = r->tensors[i];
    WPREP_FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin &&
                         a.end == b.end,
                     "tensor %s changed", a.name.c_str());
  }
  return 0;
}

}  // namespace wprep::fuzz

#ifndef WPREP_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return wprep::fuzz::FuzzSafetensors(data, size);
}
#endif
