// The safetensors file format (huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON describing every tensor, then the data section. A strict
// parser with no I/O (it is fed untrusted files, and fuzzed), and the header writer.
#ifndef WPREP_CLIENT_CLI_SAFETENSORS_H_
#define WPREP_CLIENT_CLI_SAFETENSORS_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wprep::cli {

// The element types of the format (its reference implementation's list).
enum class Dtype {
  kBool, kF4, kF6E2M3, kF6E3M2, kU8, kI8, kF8E5M2, kF8E4M3, kF8E8M0, kI16, kU16, kF16,
  kBF16, kI32, kU32, kF32, kC64, kF64, kI64, kU64,
};
// "U8", "BF16", ... as the header spells them.
absl::string_view DtypeName(Dtype dtype);
// Bits per element (4 for F4, 6 for the F6 types).
int DtypeBits(Dtype dtype);
std::optional<Dtype> ParseDtype(absl::string_view name);

struct SafetensorsTensor {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  // Byte range [begin, end) in the data section (after the header).
  uint64_t begin = 0, end = 0;

  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  // N: the JSON bytes after the 8-byte length, padding included.
  uint64_t header_bytes = 0;
  // `__metadata__`, in file order (empty when absent).
  std::vector<std::pair<std::string, std::string>> metadata;
  // Every tensor, ordered by data offset.
  std::vector<SafetensorsTensor> tensors;

  // Where the data section starts in the file.
  uint64_t data_offset() const { return 8 + header_bytes; }
};

// The largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and validates the header of a safetensors file of `file_size` bytes whose first
// bytes are `bytes` (at least 8 + N of them, or the whole file). Pure: no I/O, no
// exceptions, bounded work for any input. Checks, each failing with InvalidArgument and
// a message naming the tensor and the numbers:
//  - the file holds the 8-byte length and N is at most kMaxSafetensorsHeaderBytes and
//    within the file (else "truncated" or "absurd");
//  - the header is one JSON object (UTF-8, trailing spaces allowed): `__metadata__`, an
//    object of strings, and tensors {"dtype", "shape", "data_offsets": [begin, end]} with
//    no other fields, no duplicate names, integer dims and offsets;
//  - a known dtype ("unsupported dtype"); shape x dtype equals end - begin, without
//    overflow, in whole bytes;
//  - the tensors tile the data section exactly: none ends past it ("out of range"),
//    none overlaps another, no gap between them, nothing after the last (as the
//    reference implementation requires).
// OutOfRange when `bytes` is shorter than the header it announces (the caller passed too
// few bytes; the file itself may be fine).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::Span<const uint8_t> bytes,
                                                         uint64_t file_size);

// The first bytes of a safetensors file: the 8-byte length, then the JSON of `metadata`
// (as `__metadata__`, left out when empty) and `tensors` in the order given, padded with
// spaces to a multiple of 8 bytes as the reference implementation pads it, so that the
// data section is 8-byte aligned. Offsets are written as given.
std::string SerializeSafetensorsHeader(const std::vector<std::pair<std::string, std::string>>& metadata,
                                       const std::vector<SafetensorsTensor>& tensors);

// The number of bytes `shape` of `dtype` occupies; InvalidArgument on overflow or a bit
// count that is not whole bytes.
absl::StatusOr<uint64_t> TensorBytes(Dtype dtype, absl::Span<const int64_t> shape);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_SAFETENSORS_H_
