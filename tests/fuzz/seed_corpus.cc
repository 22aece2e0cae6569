// wprep_fuzz_seeds DIR: writes the seed corpora of the fuzz targets into DIR/request and
// DIR/stream (the committed ones are tests/fuzz/corpus). Each seed is a real request:
// the soak's and the reference vectors' conversions over every layout and direction, in
// each transport's message, at sizes of a few KiB, plus a few valid-but-odd ones (strided
// views, IPC buffers, empty tensors).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "wprep/kernels/plan.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

namespace {

namespace v1 = wprep::v1;
using wprep::ConversionSpec;
using wprep::Direction;
using wprep::Layout;

struct Conversion {
  const char* name;
  ConversionSpec spec;
  std::vector<int64_t> shape;
};

wprep::Plan PlanOf(const Conversion& c) {
  absl::StatusOr<wprep::Plan> p = wprep::MakePlan(c.spec, c.shape);
  if (!p.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name, p.status().ToString().c_str());
    std::exit(1);
  }
  return *p;
}

ConversionSpec Hopper(Direction d, int mx, int mma) { return {Layout::kHopperValue, d, {mx, mma}, {}, {}}; }
ConversionSpec Blackwell(Direction d, int64_t bk, int64_t bn, int64_t to_bk = 256, int64_t to_bn = 128) {
  return {Layout::kBlackwellShuffledValue, d, {}, {bk, bn}, {to_bk, to_bn}};
}

// Small conversions over every layout and direction.
const std::vector<Conversion>& Conversions() {
  static const std::vector<Conversion> c = {
      {"hopper_swizzle_64x128_mx1_mma2", Hopper(Direction::kSwizzle, -1, 2), {64, 128}},
      {"hopper_swizzle_2x64x64_mx2_mma3", Hopper(Direction::kSwizzle, -2, 3), {2, 64, 64}},
      {"hopper_swizzle_5x256_mx1_mma2", Hopper(Direction::kSwizzle, -1, 2), {5, 256}},
      {"hopper_unswizzle_64x128_mx1_mma3", Hopper(Direction::kUnswizzle, -1, 3), {64, 128}},
      {"hopper_unswizzle_2x16x256_mx2_mma2", Hopper(Direction::kUnswizzle, -2, 2), {2, 16, 256}},
      {"blackwell_swizzle_64x64_bk64_bn64", Blackwell(Direction::kSwizzle, 64, 64), {64, 64}},
      {"blackwell_swizzle_2x30x20_bk128_bn256", Blackwell(Direction::kSwizzle, 128, 256), {2, 30, 20}},
      {"blackwell_unswizzle_64x64_bk64_bn64", Blackwell(Direction::kUnswizzle, 64, 64), {64, 64}},
      {"blackwell_retile_64x128_bk64_bn64", Blackwell(Direction::kRetile, 64, 64, 32, 128), {64, 128}},
      {"blackwell_swizzle_edge_0x0", Blackwell(Direction::kSwizzle, 128, 256), {0, 0}},
      {"hopper_swizzle_edge_0x256x512", Hopper(Direction::kSwizzle, -2, 3), {0, 256, 512}},
  };
  return c;
}

template <typename M>
M With(const Conversion& c) {
  M m;
  *m.mutable_spec() = wprep::SpecToProto(c.spec);
  for (int64_t d : c.shape) m.add_logical_shape(d);
  return m;
}

std::string Bytes(uint64_t n, uint64_t seed) {
  std::string s(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (char& ch : s) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    ch = static_cast<char>(x);
  }
  return s;
}

v1::CudaIpcBuffer Ipc(uint64_t size, uint64_t offset = 0) {
  v1::CudaIpcBuffer b;
  b.set_handle(Bytes(64, size));
  b.set_offset(offset);
  b.set_size(size);
  b.set_device_uuid(Bytes(16, 3));
  return b;
}

bool Write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) std::fprintf(stderr, "cannot write %s\n", path.c_str());
  return static_cast<bool>(f);
}

void Varint(std::string* out, uint64_t v) {
  do {
    uint8_t b = v & 0x7f;
    v >>= 7;
    if (v != 0) b |= 0x80;
    out->push_back(static_cast<char>(b));
  } while (v != 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: wprep_fuzz_seeds DIR\n");
    return 2;
  }
  const std::string req = std::string(argv[1]) + "/request/", str = std::string(argv[1]) + "/stream/";
  bool ok = true;
  auto request = [&](const std::string& name, char kind, const google::protobuf::Message& m) {
    ok = Write(req + name, std::string(1, kind) + m.SerializeAsString()) && ok;
  };
  int seed = 1;
  for (const Conversion& c : Conversions()) {
    v1::ConvertRequest convert = With<v1::ConvertRequest>(c);
    const wprep::Plan plan = PlanOf(c);
    convert.set_source_bytes(Bytes(plan.input_bytes, seed++));
    request(std::string("convert_") + c.name, 0, convert);
    request(std::string("plan_") + c.name, 1, With<v1::PlanRequest>(c));
    request(std::string("header_") + c.name, 2, With<v1::StreamRequestHeader>(c));

    // A stream of the same tensor: header, then in-order chunks of 1000 bytes, then
    // the half-close (mode 1, slice target 1024, no failed push).
    std::string s(1, '\x01');
    const std::string header = With<v1::StreamRequestHeader>(c).SerializeAsString();
    Varint(&s, header.size());
    s += header;
    Varint(&s, 1023);
    Varint(&s, 0);
    for (uint64_t off = 0; off < plan.input_bytes; off += 1000) {
      s.push_back('\x01');
      Varint(&s, std::min<uint64_t>(1000, plan.input_bytes - off));
    }
    s.push_back('\x06');
    ok = Write(str + "planned_" + c.name, s) && ok;
  }
  // Valid but odd: a strided IPC source with an offset, an IPC destination, a device
  // UUID; a Plan of a strided view inside a larger buffer.
  {
    const Conversion& c = Conversions()[0];  // [64, 128] -> canonical [64, 64] bytes
    v1::ConvertRequest r = With<v1::ConvertRequest>(c);
    *r.mutable_source_ipc() = Ipc(64 * 80, 256);
    r.mutable_source_ipc()->add_strides(80);
    r.mutable_source_ipc()->add_strides(1);
    *r.mutable_destination_ipc() = Ipc(4096);
    request("convert_ipc_strided_to_ipc", 0, r);
    v1::ConvertRequest b = With<v1::ConvertRequest>(c);
    b.set_source_bytes(Bytes(4096, 99));
    b.set_device_uuid(Bytes(16, 4));
    request("convert_bytes_on_a_named_gpu", 0, b);
    // Hopper mx -2 storage (reported transposed), every non-contiguous stride doubled.
    const Conversion& t = Conversions()[4];
    v1::PlanRequest p = With<v1::PlanRequest>(t);
    for (int64_t st : PlanOf(t).input_strides) p.add_input_strides(st == 1 ? 1 : 2 * st);
    p.set_input_buffer_bytes(2 * PlanOf(t).input_bytes);
    request("plan_strided_view_in_a_larger_buffer", 1, p);
  }
  // Bare framing: 10 bytes in slices of 4 sent as 3 + 7; and one of each refusal.
  {
    std::string s(1, '\0');
    Varint(&s, 10);
    Varint(&s, 3);  // slice 1 + 3 % 10 = 4
    Varint(&s, 0);
    s += "\x01\x03\x01\x07\x06";
    ok = Write(str + "bare_10_in_slices_of_4", s) && ok;
    v1::ConvertStreamRequest chunk;
    chunk.mutable_chunk()->set_offset(0);
    chunk.mutable_chunk()->set_data("abcdef");
    const std::string wire = chunk.SerializeAsString();
    std::string raw(1, '\0');
    Varint(&raw, 6);
    Varint(&raw, 5);
    Varint(&raw, 0);
    raw.push_back('\0');
    Varint(&raw, wire.size());
    raw += wire;
    ok = Write(str + "bare_raw_chunk_message", raw) && ok;
    for (char op : {'\x02', '\x03', '\x04', '\x05'}) {
      std::string e(1, '\0');
      Varint(&e, 100);
      Varint(&e, 9);
      Varint(&e, 0);
      e.push_back(op);
      Varint(&e, 5);
      Varint(&e, 5);
      ok = Write(str + "bare_refused_op" + std::to_string(static_cast<int>(op)), e) && ok;
    }
    std::string fail(1, '\0');
    Varint(&fail, 100);
    Varint(&fail, 9);
    Varint(&fail, 2);  // the second push fails
    fail += "\x01\x64\x06";
    ok = Write(str + "bare_second_push_fails", fail) && ok;
  }
  return ok ? 0 : 1;
}
