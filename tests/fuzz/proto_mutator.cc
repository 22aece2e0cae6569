#include "proto_mutator.h"

#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"

namespace wprep::fuzz {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr int64_t kEdges[] = {0,
                              1,
                              2,
                              4,
                              64,
                              65536,
                              (int64_t{1} << 31) - 1,
                              int64_t{1} << 31,
                              int64_t{1} << 32,
                              (int64_t{1} << 32) + 1,
                              int64_t{1} << 62,
                              INT64_MAX,
                              -1,
                              -2,
                              INT32_MIN,
                              INT64_MIN};

uint32_t Below(std::minstd_rand& rng, uint32_t n) { return n == 0 ? 0 : static_cast<uint32_t>(rng() % n); }

// Every field of `m`'s type, set or not, at this level.
std::vector<const FieldDescriptor*> Fields(const Message& m) {
  std::vector<const FieldDescriptor*> out;
  const auto* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) out.push_back(d->field(i));
  return out;
}

void SetInt(Message* m, const FieldDescriptor* f, int index, int64_t v) {
  const Reflection* r = m->GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      rep ? r->SetRepeatedInt64(m, f, index, v) : r->SetInt64(m, f, v);
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      rep ? r->SetRepeatedUInt64(m, f, index, static_cast<uint64_t>(v)) : r->SetUInt64(m, f, static_cast<uint64_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_INT32:
      rep ? r->SetRepeatedInt32(m, f, index, static_cast<int32_t>(v)) : r->SetInt32(m, f, static_cast<int32_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      rep ? r->SetRepeatedUInt32(m, f, index, static_cast<uint32_t>(v)) : r->SetUInt32(m, f, static_cast<uint32_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      rep ? r->SetRepeatedBool(m, f, index, v & 1) : r->SetBool(m, f, v & 1);
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      // proto3 enums are open: an unknown value reaches the handler as it is.
      rep ? r->SetRepeatedEnumValue(m, f, index, static_cast<int>(v)) : r->SetEnumValue(m, f, static_cast<int>(v));
      break;
    default:
      break;
  }
}

void AddDefault(Message* m, const FieldDescriptor* f) {
  const Reflection* r = m->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64: r->AddInt64(m, f, 64); break;
    case FieldDescriptor::CPPTYPE_UINT64: r->AddUInt64(m, f, 64); break;
    case FieldDescriptor::CPPTYPE_INT32: r->AddInt32(m, f, 64); break;
    case FieldDescriptor::CPPTYPE_UINT32: r->AddUInt32(m, f, 64); break;
    case FieldDescriptor::CPPTYPE_BOOL: r->AddBool(m, f, false); break;
    case FieldDescriptor::CPPTYPE_ENUM: r->AddEnumValue(m, f, 1); break;
    case FieldDescriptor::CPPTYPE_STRING: r->AddString(m, f, std::string()); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: r->AddMessage(m, f); break;
    default: break;
  }
}

// A value for an integer field: an edge, a small number, or an enum's value (known or one
// past the last).
int64_t Value(const FieldDescriptor* f, std::minstd_rand& rng) {
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_ENUM && Below(rng, 4) != 0) {
    const auto* e = f->enum_type();
    const uint32_t i = Below(rng, static_cast<uint32_t>(e->value_count()) + 2);
    if (i < static_cast<uint32_t>(e->value_count())) return e->value(static_cast<int>(i))->number();
    return i == static_cast<uint32_t>(e->value_count()) ? -1 : e->value(e->value_count() - 1)->number() + 1;
  }
  return ExtremeInt(rng);
}

// Bytes of a size that matters: empty, a few, a power of two or one off it. A `string`
// field gets printable ASCII (protobuf refuses to parse invalid UTF-8 there, so raw bytes
// would only test the parser).
std::string Bytes(const FieldDescriptor* f, std::minstd_rand& rng) {
  static constexpr size_t kSizes[] = {0, 1, 2, 3, 7, 8, 64, 127, 128, 255, 256, 1024, 2048, 4096, 8192, 16384};
  size_t n = kSizes[Below(rng, sizeof(kSizes) / sizeof(kSizes[0]))];
  if (Below(rng, 4) == 0) n = Below(rng, 1 << 14);
  std::string s(n, '\0');
  const bool text = f->type() == FieldDescriptor::TYPE_STRING;
  for (auto& c : s) c = text ? static_cast<char>(' ' + rng() % 95) : static_cast<char>(rng());
  return s;
}

void MutateField(Message* m, const FieldDescriptor* f, std::minstd_rand& rng, int depth) {
  const Reflection* r = m->GetReflection();
  if (f->is_repeated()) {
    const int size = r->FieldSize(*m, f);
    switch (Below(rng, 6)) {
      case 0:  // resize: ranks 0 to 9
      {
        const int want = static_cast<int>(Below(rng, 10));
        while (r->FieldSize(*m, f) > want) r->RemoveLast(m, f);
        while (r->FieldSize(*m, f) < want) AddDefault(m, f);
        return;
      }
      case 1:  // one more element
        AddDefault(m, f);
        if (size < 16) return;
        r->RemoveLast(m, f);
        return;
      case 2:  // one fewer
        if (size > 0) r->RemoveLast(m, f);
        return;
      default:  // edit an element
        if (size == 0) {
          AddDefault(m, f);
          return;
        }
        const int i = static_cast<int>(Below(rng, static_cast<uint32_t>(size)));
        if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          if (depth < 8) MutateMessage(r->MutableRepeatedMessage(m, f, i), rng);
        } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
          r->SetRepeatedString(m, f, i, Bytes(f, rng));
        } else {
          SetInt(m, f, i, Value(f, rng));
        }
        return;
    }
  }
  // Singular: unset it (an optional field, a oneof member, a submessage) or edit it.
  if (Below(rng, 6) == 0) {
    r->ClearField(m, f);
    return;
  }
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    if (depth < 8) MutateMessage(r->MutableMessage(m, f), rng);
  } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
    r->SetString(m, f, Bytes(f, rng));
  } else {
    SetInt(m, f, 0, Value(f, rng));
  }
}

void MutateAt(Message* m, std::minstd_rand& rng, int depth) {
  const std::vector<const FieldDescriptor*> fields = Fields(*m);
  if (fields.empty()) return;
  // A field already set three times in four, so deep fields (spec.blackwell.block_n,
  // items[i].convert.logical_shape) are edited about as often as top-level ones; any
  // field of the type otherwise, so unset ones get set.
  std::vector<const FieldDescriptor*> set;
  m->GetReflection()->ListFields(*m, &set);
  const FieldDescriptor* f = fields[Below(rng, static_cast<uint32_t>(fields.size()))];
  if (!set.empty() && Below(rng, 4) != 0) f = set[Below(rng, static_cast<uint32_t>(set.size()))];
  MutateField(m, f, rng, depth + 1);
}

}  // namespace

int64_t ExtremeInt(std::minstd_rand& rng) {
  const uint32_t pick = Below(rng, 8);
  if (pick < 5) return kEdges[Below(rng, sizeof(kEdges) / sizeof(kEdges[0]))];
  if (pick == 5) return static_cast<int64_t>(Below(rng, 300));  // small and ordinary
  if (pick == 6) {                                              // a power of two, or one off it
    const int64_t p = int64_t{1} << Below(rng, 63);
    return p + static_cast<int64_t>(Below(rng, 3)) - 1;
  }
  return static_cast<int64_t>((static_cast<uint64_t>(rng()) << 32) ^ rng());
}

void MutateMessage(Message* m, std::minstd_rand& rng) {
  const int edits = 1 + static_cast<int>(Below(rng, 4));
  for (int i = 0; i < edits; ++i) MutateAt(m, rng, 0);
}

}  // namespace wprep::fuzz
