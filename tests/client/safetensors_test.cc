// The safetensors header parser and writer (client/cli/safetensors.h): every check the
// parser makes, on headers written by hand, and the writer's bytes against the
// reference implementation's own test vectors.
#include "safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace wprep::cli {
namespace {

// A file: the 8-byte length, `json` padded with spaces to `pad_to`, then `data` bytes.
std::vector<uint8_t> File(const std::string& json, uint64_t data, size_t pad_to = 8) {
  std::string h = json;
  while (h.size() % pad_to != 0) h.push_back(' ');
  std::string bytes;
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(n >> (8 * i)));
  bytes += h;
  bytes.append(data, '\xAB');
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

absl::StatusOr<SafetensorsHeader> Parse(const std::vector<uint8_t>& f) { return ParseSafetensorsHeader(f, f.size()); }

// The message of a header that must be refused as InvalidArgument.
std::string Refusal(const std::vector<uint8_t>& f) {
  absl::StatusOr<SafetensorsHeader> h = Parse(f);
  EXPECT_FALSE(h.ok());
  if (h.ok()) return "";
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_EQ(std::string(h.status().message()).find('\n'), std::string::npos);
  return std::string(h.status().message());
}

TEST(SafetensorsHeader, ParsesTensorsInDataOrderWithMetadata) {
  const auto f = File(R"({"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]},)"
                      R"("__metadata__":{"format":"pt","x":"y"},)"
                      R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                      16);
  absl::StatusOr<SafetensorsHeader> h = Parse(f);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[0].dtype, Dtype::kU8);
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->tensors[1].dtype, Dtype::kBF16);
  EXPECT_EQ(h->tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h->tensors[1].begin, 4u);
  EXPECT_EQ(h->tensors[1].end, 16u);
  ASSERT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata[0], (std::pair<std::string, std::string>{"format", "pt"}));
  EXPECT_EQ(h->data_offset() % 8, 0u);
  EXPECT_EQ(h->data_offset() + 16, f.size());
}

TEST(SafetensorsHeader, AcceptsEmptyFilesZeroSizeTensorsAndSubByteDtypes) {
  EXPECT_TRUE(Parse(File("{}", 0)).ok());
  const auto f = File(R"({"e":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]},)"
                      R"("f4":{"dtype":"F4","shape":[6],"data_offsets":[0,3]},)"
                      R"("s":{"dtype":"F8_E8M0","shape":[],"data_offsets":[3,4]}})",
                      4);
  absl::StatusOr<SafetensorsHeader> h = Parse(f);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 3u);
}

TEST(SafetensorsHeader, RefusesTruncatedFiles) {
  EXPECT_NE(Refusal({1, 2, 3}).find("truncated"), std::string::npos);
  auto f = File(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4);
  std::vector<uint8_t> cut(f.begin(), f.begin() + 20);  // inside the header
  EXPECT_NE(Refusal(cut).find("truncated"), std::string::npos);
  cut.assign(f.begin(), f.end() - 1);  // inside the data
  EXPECT_NE(Refusal(cut).find("out of range"), std::string::npos);
}

TEST(SafetensorsHeader, RefusesAnAbsurdHeaderSize) {
  std::vector<uint8_t> f(64, ' ');
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) f[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  EXPECT_NE(Refusal(f).find("absurd"), std::string::npos);
  for (int i = 0; i < 8; ++i) f[static_cast<size_t>(i)] = 0xFF;
  EXPECT_NE(Refusal(f).find("absurd"), std::string::npos);
}

TEST(SafetensorsHeader, RefusesBadJson) {
  for (const std::string& json : {std::string("{\"a\":"), std::string("{\"a\":{\"dtype\":\"U8\",}}"),
                                  std::string("{} trailing"), std::string("{\"a\":{\"dtype\":\"U8\xff\"}}"),
                                  std::string("{}\0\0\0\0\0\0", 8)}) {
    SCOPED_TRACE(json);
    const std::string why = Refusal(File(json, 0));
    EXPECT_NE(why.find("bad header JSON"), std::string::npos) << why;
  }
  EXPECT_NE(Refusal(File("[1,2]", 0)).find("does not begin with '{'"), std::string::npos);
  EXPECT_NE(Refusal(File(" {}", 0)).find("does not begin with '{'"), std::string::npos);
}

TEST(SafetensorsHeader, RefusesWhatTheFormatDoesNotHave) {
  struct Case {
    std::string json, reason;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"a":5})", "is a number, not an object"},
           {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", "unknown field 'extra'"},
           {R"({"a":{"dtype":"U8","shape":[1]}})", "needs dtype, shape and data_offsets"},
           {R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "the field 'dtype' twice"},
           {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
            "names 'a' twice"},
           {R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "a negative number"},
           {R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "a fraction"},
           {R"({"a":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", "an array"},
           {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "[begin, end]"},
           {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "[begin, end]"},
           {R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", "dtype is a number"},
           {R"({"__metadata__":{"k":1}})", "values must be strings"},
           {R"({"__metadata__":[]})", "'__metadata__' is an array"},
           {R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "empty name"},
       }) {
    SCOPED_TRACE(c.json);
    const std::string why = Refusal(File(c.json, 1));
    EXPECT_NE(why.find(c.reason), std::string::npos) << why;
  }
}

TEST(SafetensorsHeader, RefusesAnUnsupportedDtype) {
  const std::string why = Refusal(File(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", 2));
  EXPECT_NE(why.find("unsupported dtype 'Q4_K'"), std::string::npos) << why;
}

TEST(SafetensorsHeader, RefusesOffsetsThatDisagreeWithTheShapeOrTheFile) {
  struct Case {
    std::string json;
    uint64_t data;
    std::string reason;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,4]}})", 4, "needs 8 bytes"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}})", 4, "run backwards"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 2, "out of range"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
            6, "overlapping tensors: 'a' [0, 4) and 'b' [2, 6)"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
            4, "overlapping"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6, "gap of 2 bytes"},
           {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 9, "5 bytes after the last tensor"},
           {R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2, "whole number of bytes"},
           {R"({"a":{"dtype":"U64","shape":[4611686018427387903,4611686018427387903],"data_offsets":[0,8]}})", 8,
            "overflows"},
       }) {
    SCOPED_TRACE(c.json);
    const std::string why = Refusal(File(c.json, c.data));
    EXPECT_NE(why.find(c.reason), std::string::npos) << why;
  }
}

TEST(SafetensorsHeader, AskForMoreBytesWhenGivenOnlyTheLength) {
  const auto f = File(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(absl::MakeConstSpan(f).subspan(0, 8), f.size());
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kOutOfRange);
}

TEST(SafetensorsHeader, LongNamesAreCutInMessages) {
  const std::string name(5000, 'n');
  const std::string why = Refusal(File("{\"" + name + "\":3}", 0));
  EXPECT_LT(why.size(), 300u);
  EXPECT_NE(why.find("..."), std::string::npos);
}

// Every prefix of a valid file is refused cleanly, and so is every single-byte change
// of its header that breaks it (no crash, no hang: what a fuzzer checks first).
TEST(SafetensorsHeader, EveryTruncationAndByteFlipIsHandled) {
  const auto f = File(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}})",
                      8);
  for (size_t n = 0; n < f.size(); ++n) {
    std::vector<uint8_t> cut(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_FALSE(Parse(cut).ok()) << n;
  }
  for (size_t i = 0; i < f.size() - 8; ++i) {
    for (uint8_t x : {uint8_t{0x01}, uint8_t{0x20}, uint8_t{0x80}}) {
      std::vector<uint8_t> g = f;
      g[i] ^= x;
      (void)Parse(g);  // either verdict; it must return
    }
  }
}

// The reference implementation's test_empty vectors: an empty file, and one with
// {"framework": "pt"} as metadata, byte for byte (spaces pad to 8).
TEST(SafetensorsWriter, MatchesTheReferenceBytes) {
  const std::string empty = SerializeSafetensorsHeader({}, {});
  EXPECT_EQ(std::vector<uint8_t>(empty.begin(), empty.end()),
            (std::vector<uint8_t>{8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32}));
  const std::string meta = SerializeSafetensorsHeader({{"framework", "pt"}}, {});
  const std::string want_json = R"({"__metadata__":{"framework":"pt"}})";
  ASSERT_EQ(meta.size(), 8u + 40u);
  EXPECT_EQ(meta[0], 40);
  EXPECT_EQ(meta.substr(8, want_json.size()), want_json);
  EXPECT_EQ(meta.substr(8 + want_json.size()), std::string(40 - want_json.size(), ' '));
}

TEST(SafetensorsWriter, RoundTripsThroughTheParser) {
  std::vector<SafetensorsTensor> t(2);
  t[0] = {"x.weight\n\"quoted\"", Dtype::kBF16, {3, 5}, 0, 30};
  t[1] = {"y", Dtype::kU8, {7}, 30, 37};
  const std::string h = SerializeSafetensorsHeader({{"k", "v\x01"}}, t);
  EXPECT_EQ(h.size() % 8, 0u);
  std::vector<uint8_t> f(h.begin(), h.end());
  f.resize(f.size() + 37);
  absl::StatusOr<SafetensorsHeader> back = Parse(f);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].name, t[0].name);
  EXPECT_EQ(back->tensors[0].shape, t[0].shape);
  EXPECT_EQ(back->tensors[1].begin, 30u);
  EXPECT_EQ(back->metadata.front().second, "v\x01");
}

}  // namespace
}  // namespace wprep::cli
