#include "safetensors.h"

#include <algorithm>
#include <array>
#include <exception>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace wprep::cli {
namespace {

using json = nlohmann::json;

struct DtypeInfo {
  Dtype dtype;
  absl::string_view name;
  int bits;
};
constexpr std::array<DtypeInfo, 20> kDtypes = {{
    {Dtype::kBool, "BOOL", 8},       {Dtype::kF4, "F4", 4},           {Dtype::kF6E2M3, "F6_E2M3", 6},
    {Dtype::kF6E3M2, "F6_E3M2", 6},  {Dtype::kU8, "U8", 8},           {Dtype::kI8, "I8", 8},
    {Dtype::kF8E5M2, "F8_E5M2", 8},  {Dtype::kF8E4M3, "F8_E4M3", 8},  {Dtype::kF8E8M0, "F8_E8M0", 8},
    {Dtype::kI16, "I16", 16},        {Dtype::kU16, "U16", 16},        {Dtype::kF16, "F16", 16},
    {Dtype::kBF16, "BF16", 16},      {Dtype::kI32, "I32", 32},        {Dtype::kU32, "U32", 32},
    {Dtype::kF32, "F32", 32},        {Dtype::kC64, "C64", 64},        {Dtype::kF64, "F64", 64},
    {Dtype::kI64, "I64", 64},        {Dtype::kU64, "U64", 64},
}};

constexpr size_t kMaxRank = 64;
constexpr uint64_t kMaxDim = uint64_t{1} << 62;

absl::Status Bad(absl::string_view msg) { return absl::InvalidArgumentError(msg); }

// A name from the file, fit for a one-line message: escaped, and cut when long.
std::string Quote(absl::string_view name) {
  constexpr size_t kMax = 96;
  std::string s = absl::CHexEscape(name.substr(0, kMax));
  if (name.size() > kMax) s += "...";
  return absl::StrCat("'", s, "'");
}

// Builds the header from the parser's events, refusing anything but the format's shape
// at the first event that breaks it (so no input makes it hold more than the header).
class HeaderSax : public json::json_sax_t {
 public:
  bool null() override { return Wrong("null"); }
  bool boolean(bool) override { return Wrong("a boolean"); }
  bool number_integer(number_integer_t) override { return Wrong("a negative number"); }
  bool number_unsigned(number_unsigned_t v) override {
    if (depth_ != 3) return Wrong("a number");
    if (field_ == Field::kShape) {
      if (v >= kMaxDim) return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": dim ", v, " is absurd"));
      if (tensor_.shape.size() >= kMaxRank) {
        return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": rank above ", kMaxRank));
      }
      tensor_.shape.push_back(static_cast<int64_t>(v));
    } else {
      if (offsets_.size() >= 2) return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": data_offsets must be [begin, end]"));
      offsets_.push_back(v);
    }
    return true;
  }
  bool number_float(number_float_t, const string_t&) override { return Wrong("a fraction"); }
  bool binary(binary_t&) override { return Wrong("binary"); }
  bool string(string_t& s) override {
    if (depth_ == 2 && section_ == Section::kMetadata) {
      header_.metadata.emplace_back(std::move(meta_key_), std::move(s));
      return true;
    }
    if (depth_ == 2 && section_ == Section::kTensor && field_ == Field::kDtype) {
      dtype_ = std::move(s);
      return true;
    }
    return Wrong("a string");
  }
  bool start_object(std::size_t) override {
    switch (depth_) {
      case 0:
        break;
      case 1:
        section_ = key_ == "__metadata__" ? Section::kMetadata : Section::kTensor;
        if (section_ == Section::kTensor) {
          tensor_ = SafetensorsTensor();
          tensor_.name = key_;
          dtype_.reset();
          offsets_.clear();
          fields_seen_.clear();
          have_shape_ = false;
        }
        break;
      default:
        return Wrong("an object");
    }
    ++depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) {
      if (k.empty()) return Fail("a tensor with an empty name");
      if (!names_.insert(k).second) return Fail(absl::StrCat("the header names ", Quote(k), " twice"));
      key_ = std::move(k);
      return true;
    }
    // depth 2
    if (section_ == Section::kMetadata) {
      if (!meta_keys_.insert(k).second) return Fail(absl::StrCat("__metadata__ has the key ", Quote(k), " twice"));
      meta_key_ = std::move(k);
      return true;
    }
    if (k == "dtype") field_ = Field::kDtype;
    else if (k == "shape") field_ = Field::kShape;
    else if (k == "data_offsets") field_ = Field::kOffsets;
    else return Fail(absl::StrCat("tensor ", Quote(tensor_.name), " has an unknown field ", Quote(k)));
    if (!fields_seen_.insert(k).second) {
      return Fail(absl::StrCat("tensor ", Quote(tensor_.name), " has the field ", Quote(k), " twice"));
    }
    return true;
  }
  bool end_object() override {
    --depth_;
    if (depth_ == 1 && section_ == Section::kTensor) {
      if (!dtype_ || !have_shape_ || offsets_.size() != 2) {
        return Fail(absl::StrCat("tensor ", Quote(tensor_.name), " needs dtype, shape and data_offsets [begin, end]"));
      }
      const std::optional<Dtype> d = ParseDtype(*dtype_);
      if (!d) return Fail(absl::StrCat("tensor ", Quote(tensor_.name), " has an unsupported dtype ", Quote(*dtype_)));
      tensor_.dtype = *d;
      tensor_.begin = offsets_[0];
      tensor_.end = offsets_[1];
      header_.tensors.push_back(std::move(tensor_));
    }
    section_ = Section::kNone;
    field_ = Field::kNone;
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ != 2 || section_ != Section::kTensor || field_ == Field::kDtype || field_ == Field::kNone) {
      return Wrong("an array");
    }
    if (field_ == Field::kShape) have_shape_ = true;
    ++depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    if (field_ == Field::kOffsets && offsets_.size() != 2) {
      return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": data_offsets must be [begin, end]"));
    }
    field_ = Field::kNone;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    std::string what = ex.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 7: ..." -> the reason.
    if (const size_t colon = what.find(": "); what.rfind("[json.exception", 0) == 0 && colon != std::string::npos) {
      what = what.substr(colon + 2);
    }
    // nlohmann's reason quotes what it last read ("last read: '...'"), as long as the file makes it.
    constexpr size_t kMaxReason = 160;
    if (what.size() > kMaxReason) {
      what.resize(kMaxReason);
      what += "...";
    }
    return Fail(absl::StrCat("bad header JSON near byte ", position, ": ", what));
  }

  SafetensorsHeader& header() { return header_; }
  const std::string& error() const { return error_; }

 private:
  enum class Section { kNone, kMetadata, kTensor };
  enum class Field { kNone, kDtype, kShape, kOffsets };

  bool Fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }
  // A value of the wrong type where the format wants something else.
  bool Wrong(absl::string_view what) {
    if (depth_ == 0) return Fail(absl::StrCat("the header is ", what, ", not a JSON object"));
    if (depth_ == 1) return Fail(absl::StrCat("header entry ", Quote(key_), " is ", what, ", not an object"));
    if (section_ == Section::kMetadata) {
      return Fail(absl::StrCat("__metadata__ value ", Quote(meta_key_), " is ", what, "; values must be strings"));
    }
    switch (field_) {
      case Field::kDtype:
        return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": dtype is ", what, ", not a string"));
      case Field::kShape:
        return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": shape holds ", what,
                                 "; it must be an array of non-negative integers"));
      case Field::kOffsets:
        return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": data_offsets holds ", what,
                                 "; it must be [begin, end], non-negative integers"));
      case Field::kNone:
        break;
    }
    return Fail(absl::StrCat("tensor ", Quote(tensor_.name), ": unexpected ", what));
  }

  SafetensorsHeader header_;
  std::string error_;
  int depth_ = 0;
  Section section_ = Section::kNone;
  Field field_ = Field::kNone;
  std::string key_, meta_key_;
  std::set<std::string> names_, meta_keys_, fields_seen_;
  SafetensorsTensor tensor_;
  std::optional<std::string> dtype_;
  std::vector<uint64_t> offsets_;
  bool have_shape_ = false;
};

}  // namespace

absl::string_view DtypeName(Dtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

int DtypeBits(Dtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.bits;
  }
  return 0;
}

std::optional<Dtype> ParseDtype(absl::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

absl::StatusOr<uint64_t> TensorBytes(Dtype dtype, absl::Span<const int64_t> shape) {
  unsigned __int128 bits = static_cast<unsigned>(DtypeBits(dtype));
  for (int64_t d : shape) {
    if (d < 0) return Bad(absl::StrCat("negative dim ", d));
    bits *= static_cast<uint64_t>(d);
    if (bits > (static_cast<unsigned __int128>(1) << 66)) {
      return Bad(absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] of ", DtypeName(dtype), " overflows"));
    }
  }
  if (bits % 8 != 0) {
    return Bad(absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] of ", DtypeName(dtype),
                            " is not a whole number of bytes"));
  }
  return static_cast<uint64_t>(bits / 8);
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::Span<const uint8_t> bytes,
                                                         uint64_t file_size) {
  if (file_size < 8 || bytes.size() < 8) {
    return Bad(absl::StrCat("truncated: ", std::min<uint64_t>(file_size, bytes.size()),
                            " bytes, fewer than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | bytes[static_cast<size_t>(i)];
  if (n > kMaxSafetensorsHeaderBytes) {
    return Bad(absl::StrCat("header size ", n, " is absurd (the limit is ", kMaxSafetensorsHeaderBytes,
                            " bytes); not a safetensors file?"));
  }
  if (n > file_size - 8) {
    return Bad(absl::StrCat("truncated: the header announces ", n, " bytes but only ", file_size - 8,
                            " follow the length"));
  }
  if (bytes.size() - 8 < n) {
    return absl::OutOfRangeError(absl::StrCat("the header needs ", 8 + n, " bytes, got ", bytes.size()));
  }
  if (n < 2 || bytes[8] != '{') return Bad("the header does not begin with '{': not a safetensors file?");

  // JSON text holds no NUL byte (inside strings too, control characters are escaped);
  // nlohmann's lexer would read one as the end of its input and ignore what follows.
  if (const void* nul = std::memchr(bytes.data() + 8, 0, n); nul != nullptr) {
    return Bad(absl::StrCat("bad header JSON near byte ",
                            static_cast<const uint8_t*>(nul) - (bytes.data() + 8), ": a NUL byte"));
  }
  HeaderSax sax;
  bool parsed = false;
  try {
    const char* begin = reinterpret_cast<const char*>(bytes.data() + 8);
    parsed = json::sax_parse(begin, begin + n, &sax, json::input_format_t::json, /*strict=*/true);
  } catch (const std::exception& e) {  // third-party code: caught at our edge
    return absl::InternalError(absl::StrCat("parsing the header: ", e.what()));
  }
  if (!parsed) return Bad(sax.error().empty() ? std::string("bad header JSON") : sax.error());

  SafetensorsHeader h = std::move(sax.header());
  h.header_bytes = n;
  const uint64_t data = file_size - 8 - n;
  for (const SafetensorsTensor& t : h.tensors) {
    if (t.begin > t.end) {
      return Bad(absl::StrCat("tensor ", Quote(t.name), ": data_offsets [", t.begin, ", ", t.end, "] run backwards"));
    }
    if (t.end > data) {
      return Bad(absl::StrCat("offsets out of range: tensor ", Quote(t.name), " ends at byte ", t.end,
                              " of a data section of ", data, " bytes"));
    }
    absl::StatusOr<uint64_t> want = TensorBytes(t.dtype, t.shape);
    if (!want.ok()) return Bad(absl::StrCat("tensor ", Quote(t.name), ": ", want.status().message()));
    if (*want != t.bytes()) {
      return Bad(absl::StrCat("tensor ", Quote(t.name), ": ", DtypeName(t.dtype), " [", absl::StrJoin(t.shape, ", "),
                              "] needs ", *want, " bytes but data_offsets [", t.begin, ", ", t.end, "] hold ",
                              t.bytes()));
    }
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const SafetensorsTensor* previous = nullptr;
  for (const SafetensorsTensor& t : h.tensors) {
    if (t.begin < at) {
      return Bad(absl::StrCat("overlapping tensors: ", Quote(previous->name), " [", previous->begin, ", ",
                              previous->end, ") and ", Quote(t.name), " [", t.begin, ", ", t.end, ")"));
    }
    if (t.begin > at) {
      return Bad(absl::StrCat("a gap of ", t.begin - at, " bytes before tensor ", Quote(t.name), " at ", t.begin));
    }
    at = t.end;
    if (t.end > t.begin || previous == nullptr) previous = &t;
  }
  if (at != data) {
    return Bad(absl::StrCat(data - at, " bytes after the last tensor (the data section has ", data,
                            " bytes, the tensors ", at, ")"));
  }
  return h;
}

std::string SerializeSafetensorsHeader(const std::vector<std::pair<std::string, std::string>>& metadata,
                                       const std::vector<SafetensorsTensor>& tensors) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  for (const SafetensorsTensor& t : tensors) {
    j[t.name] = {{"dtype", std::string(DtypeName(t.dtype))},
                 {"shape", t.shape},
                 {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i) & 0xFF);
  return out + text;
}

}  // namespace wprep::cli
