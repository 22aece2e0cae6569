// Safetensors files written by hand for the weight-set tests: the format (8-byte
// little-endian header length, the JSON, the data) with nothing of the daemon's code, so a
// parser bug cannot hide in both sides.
#ifndef WPREP_TESTS_SERVER_SAFETENSORS_FILES_H_
#define WPREP_TESTS_SERVER_SAFETENSORS_FILES_H_

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace wprep::testing {

struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// `n` bytes of a linear congruential sequence seeded by `seed`.
inline std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

inline std::string ShapeJson(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? "," : "", shape[i]);
  return s + "]";
}

// The JSON padded to 8 bytes after its length word (`announced` instead of its true length
// when given), then `data`.
inline void WriteRaw(const std::string& path, const std::string& json, const std::vector<uint8_t>& data,
                     uint64_t announced = UINT64_MAX) {
  std::string header = json;
  while (header.size() % 8 != 0) header.push_back(' ');
  const uint64_t n = announced == UINT64_MAX ? header.size() : announced;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// `tensors` back to back; returns the header bytes (length word and JSON) written, for the
// checksum.
inline std::string WriteSafetensors(const std::string& path, const std::vector<Tensor>& tensors) {
  std::string json = "{";
  std::vector<uint8_t> data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    absl::StrAppend(&json, i ? "," : "", "\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":",
                    ShapeJson(t.shape), ",\"data_offsets\":[", data.size(), ",", data.size() + t.bytes.size(), "]}");
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
  }
  json += "}";
  WriteRaw(path, json, data);
  std::ifstream f(path, std::ios::binary);
  std::string head(8, '\0');
  f.read(head.data(), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(head[i]);
  head.resize(8 + n);
  f.read(head.data() + 8, static_cast<std::streamsize>(n));
  return head;
}

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_SAFETENSORS_FILES_H_
