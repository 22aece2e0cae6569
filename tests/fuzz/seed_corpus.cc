// wprep_fuzz_seeds DIR: writes the seed corpora of the fuzz targets into DIR/request,
// DIR/stream and DIR/batch (the committed ones are tests/fuzz/corpus). Each seed is a real
// request: every conversion the engines dispatch to (KernelVariantSpecs: every layout,
// direction and packing axis) at a small shape, in each transport's message, plus a few
// valid but unusual ones (strided views, IPC buffers, empty tensors, batches).
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "wprep/kernels/plan.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

namespace {

namespace v1 = wprep::v1;

struct Conversion {
  std::string name;
  wprep::ConversionSpec spec;
  std::vector<int64_t> shape;
  wprep::Plan plan;
};

// A file name for a spec and shape: "hopper_value_swizzle_mx_axis-2_mma3_2x64x64".
std::string Name(const wprep::ConversionSpec& spec, const std::vector<int64_t>& shape) {
  std::string n;
  for (char c : wprep::Describe(spec)) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '-';
    if (keep || (!n.empty() && n.back() != '_')) n.push_back(keep ? c : '_');
  }
  for (size_t i = 0; i < shape.size(); ++i) n += (i == 0 ? "_" : "x") + std::to_string(shape[i]);
  return n;
}

// Every kernel variant at the smallest of a few shapes its planner accepts (inputs and
// outputs of a few KiB; padded layouts more), and two empty tensors.
std::vector<Conversion> Conversions() {
  std::vector<Conversion> out;
  const std::vector<std::vector<int64_t>> shapes = {{2, 64, 64}, {64, 128}, {2, 32, 64}, {32, 64}, {64, 64},
                                                    {2, 128, 64}, {1, 128, 256}, {1, 256, 256}};
  for (const wprep::ConversionSpec& spec : wprep::KernelVariantSpecs()) {
    std::optional<Conversion> best;
    for (const auto& shape : shapes) {
      absl::StatusOr<wprep::Plan> p = wprep::MakePlan(spec, shape);
      if (!p.ok()) continue;
      if (!best || p->input_bytes + p->output_bytes < best->plan.input_bytes + best->plan.output_bytes) {
        best = Conversion{Name(spec, shape), spec, shape, *p};
      }
    }
    if (best) out.push_back(*best);
  }
  const wprep::ConversionSpec first = wprep::KernelVariantSpecs().front();
  for (const std::vector<int64_t>& empty : std::vector<std::vector<int64_t>>{{0, 0}, {0, 256, 512}}) {
    absl::StatusOr<wprep::Plan> p = wprep::MakePlan(first, empty);
    if (p.ok()) out.push_back({Name(first, empty), first, empty, *p});
  }
  return out;
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

// The handle and UUID of the allocations batch_fuzzer.cc exports on its fake GPU
// (FakeRuntime: the handle's id in bytes 0-7, its GPU at byte 32; UUID 0xF0 ^ i).
std::string FakeHandle(uint64_t id) {
  std::string h(64, '\0');
  for (int i = 0; i < 8; ++i) h[i] = static_cast<char>(id >> (8 * i));
  return h;
}
std::string FakeUuid() {
  std::string u(16, '\0');
  for (int i = 0; i < 16; ++i) u[i] = static_cast<char>(0xF0 ^ i);
  return u;
}

v1::CudaIpcBuffer Ipc(const std::string& handle, uint64_t size, uint64_t offset = 0) {
  v1::CudaIpcBuffer b;
  b.set_handle(handle);
  b.set_offset(offset);
  b.set_size(size);
  b.set_device_uuid(FakeUuid());
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

// A strided view of `c`'s input: every stride but the contiguous one doubled.
std::vector<int64_t> Doubled(const wprep::Plan& p) {
  std::vector<int64_t> s;
  for (int64_t st : p.input_strides) s.push_back(st == 1 ? 1 : 2 * st);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: wprep_fuzz_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::string req = dir + "/request/", str = dir + "/stream/", bat = dir + "/batch/";
  bool ok = true;
  auto request = [&](const std::string& name, char kind, const google::protobuf::Message& m) {
    ok = Write(req + name, std::string(1, kind) + m.SerializeAsString()) && ok;
  };
  const std::vector<Conversion> all = Conversions();
  int seed = 1;
  for (const Conversion& c : all) {
    v1::ConvertRequest convert = With<v1::ConvertRequest>(c);
    convert.set_source_bytes(Bytes(c.plan.input_bytes, seed++));
    request("convert_" + c.name, 0, convert);
    request("plan_" + c.name, 1, With<v1::PlanRequest>(c));
    request("header_" + c.name, 2, With<v1::StreamRequestHeader>(c));

    // A stream of the same tensor: header, then in-order chunks of 1000 bytes, then
    // the half-close (mode 1, slice target 1024, no failed push).
    std::string s(1, '\x01');
    const std::string header = With<v1::StreamRequestHeader>(c).SerializeAsString();
    Varint(&s, header.size());
    s += header;
    Varint(&s, 1023);
    Varint(&s, 0);
    for (uint64_t off = 0; off < c.plan.input_bytes; off += 1000) {
      s.push_back('\x01');
      Varint(&s, std::min<uint64_t>(1000, c.plan.input_bytes - off));
    }
    s.push_back('\x06');
    ok = Write(str + "planned_" + c.name, s) && ok;
  }

  // Valid but unusual: a strided IPC source with an offset, an IPC destination, a device
  // UUID, an inline strided source; a Plan of a strided view inside a larger buffer.
  {
    const Conversion& c = all.front();
    const std::vector<int64_t> strides = Doubled(c.plan);
    absl::StatusOr<wprep::Plan> strided = wprep::MakePlan(c.spec, c.shape, wprep::InputBinding{strides, std::nullopt});
    const uint64_t span = strided.ok() ? strided->input_bytes : c.plan.input_bytes;
    v1::ConvertRequest r = With<v1::ConvertRequest>(c);
    *r.mutable_source_ipc() = Ipc(FakeHandle(1), span, 256);
    for (int64_t st : strides) r.mutable_source_ipc()->add_strides(st);
    *r.mutable_destination_ipc() = Ipc(FakeHandle(2), c.plan.output_bytes);
    request("convert_ipc_strided_to_ipc", 0, r);
    v1::ConvertRequest b = With<v1::ConvertRequest>(c);
    b.set_source_bytes(Bytes(c.plan.input_bytes, 99));
    b.set_device_uuid(FakeUuid());
    request("convert_bytes_on_a_named_gpu", 0, b);
    v1::ConvertRequest v = With<v1::ConvertRequest>(c);
    v.set_source_bytes(Bytes(span, 98));
    for (int64_t st : strides) v.add_source_strides(st);
    request("convert_inline_strided", 0, v);
    v1::PlanRequest p = With<v1::PlanRequest>(c);
    for (int64_t st : strides) p.add_input_strides(st);
    p.set_input_buffer_bytes(2 * span);
    request("plan_strided_view_in_a_larger_buffer", 1, p);
  }

  // Batches: every conversion inline in one batch, and small mixed ones over the fake
  // GPU's two allocations (source id 1, destination id 2, 256 KiB each).
  {
    auto item = [&](v1::ConvertBatchRequest& batch, const Conversion& c) {
      v1::ConvertItem* it = batch.add_items()->mutable_convert();
      *it->mutable_spec() = wprep::SpecToProto(c.spec);
      for (int64_t d : c.shape) it->add_logical_shape(d);
      return it;
    };
    v1::ConvertBatchRequest every;
    for (const Conversion& c : all) {
      if (c.plan.input_bytes <= (8 << 10)) item(every, c)->mutable_source()->set_inline_bytes(Bytes(c.plan.input_bytes, seed++));
    }
    ok = Write(bat + "every_small_conversion_inline", every.SerializeAsString()) && ok;
    for (size_t k = 0; k + 1 < std::min<size_t>(all.size(), 8); k += 2) {
      const Conversion &a = all[k], &b = all[k + 1];
      v1::ConvertBatchRequest m;
      item(m, a)->mutable_source()->set_inline_bytes(Bytes(a.plan.input_bytes, seed++));
      v1::ConvertItem* ipc = item(m, b);
      *ipc->mutable_source()->mutable_ipc() = Ipc(FakeHandle(1), b.plan.input_bytes);
      *ipc->mutable_destination()->mutable_ipc() = Ipc(FakeHandle(2), b.plan.output_bytes);
      m.set_device_uuid(FakeUuid());
      ok = Write(bat + "mixed_" + a.name + "_and_ipc_" + b.name, m.SerializeAsString()) && ok;
    }
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

  // Extreme values, each refused (issue 26: the first one's header killed the daemon with
  // SIGFPE): dims 2^31, 2^32, 2^32 + 1, 2^63 - 1 and zero around them, blocks of 1 and 4
  // with block_k unset, negative dims, rank 9, an unknown layout.
  {
    v1::ConversionSpec crash;
    crash.set_layout(v1::LAYOUT_BLACKWELL_SHUFFLED_VALUE);
    crash.set_direction(v1::DIRECTION_SWIZZLE);
    crash.mutable_blackwell()->set_block_n(4);
    v1::ConversionSpec hopper = crash;
    hopper.set_layout(v1::LAYOUT_HOPPER_VALUE);
    hopper.clear_blackwell();
    v1::ConversionSpec scale;
    scale.set_layout(v1::LAYOUT_BLACKWELL_SCALE);
    scale.set_direction(v1::DIRECTION_UNSWIZZLE);
    v1::ConversionSpec unknown = crash;
    unknown.set_layout(static_cast<v1::Layout>(6));
    v1::ConversionSpec block1 = crash;
    block1.mutable_blackwell()->set_block_k(2);
    block1.mutable_blackwell()->set_block_n(1);
    const int64_t k31 = int64_t{1} << 31, k32 = int64_t{1} << 32, kMax = INT64_MAX;
    const struct {
      const char* name;
      const v1::ConversionSpec& spec;
      std::vector<int64_t> shape;
    } extremes[] = {
        {"issue26_crash_65536x2p32", crash, {65536, k32}},
        {"block1_2p31x64", block1, {k31, 64}},
        {"hopper_64x2p32p1", hopper, {64, k32 + 1}},
        {"hopper_2p63m1x0x64", hopper, {kMax, 0, 64}},
        {"hopper_0x2p31x64x64", hopper, {0, k31, 64, 64}},
        {"scale_2p32x2p32x2x2", scale, {k32, k32, 2, 2}},
        {"scale_negative_dim", scale, {64, -1}},
        {"rank9", crash, {1, 1, 1, 1, 1, 1, 1, 64, 64}},
        {"unknown_layout_64x2p32", unknown, {64, k32}},
    };
    for (const auto& e : extremes) {
      v1::PlanRequest plan;
      *plan.mutable_spec() = e.spec;
      for (int64_t d : e.shape) plan.add_logical_shape(d);
      request(std::string("extreme_plan_") + e.name, 1, plan);
      v1::ConvertRequest convert;
      *convert.mutable_spec() = e.spec;
      *convert.mutable_logical_shape() = plan.logical_shape();
      convert.set_source_bytes(std::string(64, '\x11'));
      request(std::string("extreme_convert_") + e.name, 0, convert);
      v1::StreamRequestHeader header;
      *header.mutable_spec() = e.spec;
      *header.mutable_logical_shape() = plan.logical_shape();
      request(std::string("extreme_header_") + e.name, 2, header);
      // The header alone on a stream, with the daemon's slice target (0 reads as 4 MiB).
      std::string st(1, '\x01');
      const std::string wire = header.SerializeAsString();
      Varint(&st, wire.size());
      st += wire;
      Varint(&st, 0);
      Varint(&st, 0);
      st.push_back('\x06');
      ok = Write(str + "extreme_" + e.name, st) && ok;
      v1::ConvertBatchRequest batch;
      v1::ConvertItem* item = batch.add_items()->mutable_convert();
      *item->mutable_spec() = e.spec;
      *item->mutable_logical_shape() = plan.logical_shape();
      item->mutable_source()->set_inline_bytes(std::string(64, '\x11'));
      ok = Write(bat + "extreme_" + e.name, batch.SerializeAsString()) && ok;
    }
  }
  return ok ? 0 : 1;
}
