#include "golden.h"

#include "gtest/gtest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>

#include "nlohmann/json.hpp"

namespace wprep::testing {

std::string TestDataDir(const std::string& name) {
  const char* env_root = std::getenv("WPREP_TEST_DATA_DIR");
  const std::string root = env_root != nullptr && *env_root != '\0' ? env_root : WPREP_TEST_DATA_DIR;
  return root + "/" + name;
}

std::string GoldenDir(GoldenSet set) {
  // $WPREP_GOLDEN_DIR still names the value set alone.
  switch (set) {
    case GoldenSet::kValues:
      if (const char* env = std::getenv("WPREP_GOLDEN_DIR"); env != nullptr && *env != '\0') {
        return env;
      }
      return TestDataDir("golden");
    case GoldenSet::kScales:
      return TestDataDir("golden_scales");
    case GoldenSet::kPacking:
      return TestDataDir("golden_packing");
  }
  std::abort();
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::abort();
  }
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

namespace {

std::vector<int64_t> Dims(const nlohmann::json& j) { return j.get<std::vector<int64_t>>(); }

BlackwellParams Blackwell(const nlohmann::json& p) {
  return BlackwellParams{p.at("block_k").get<int64_t>(), p.at("block_n").get<int64_t>()};
}

std::vector<int64_t> OptionalDims(const nlohmann::json& c, const char* key) {
  return c.contains(key) ? Dims(c.at(key)) : std::vector<int64_t>{};
}

std::vector<GoldenCase> Load(GoldenSet set) {
  const std::string dir = GoldenDir(set);
  const auto text = ReadFile(dir + "/manifest.json");
  const auto manifest = nlohmann::json::parse(text.begin(), text.end());
  std::vector<GoldenCase> cases;
  for (const auto& c : manifest.at("cases")) {
    GoldenCase g;
    g.set = set;
    g.name = c.at("name");
    auto layout = ParseLayout(c.at("layout").get<std::string>());
    auto direction = ParseDirection(c.at("direction").get<std::string>());
    if (!layout.ok() || !direction.ok()) {
      std::fprintf(stderr, "manifest case %s: unknown layout or direction\n", g.name.c_str());
      std::abort();
    }
    g.spec.layout = *layout;
    g.spec.direction = *direction;
    if (c.contains("packing_axis")) g.spec.packing_axis = c.at("packing_axis");
    const auto& p = c.at("params");
    switch (g.spec.layout) {
      case Layout::kHopperValue:
        g.spec.hopper.mx_axis = p.at("mx_axis");
        g.spec.hopper.mma_version = p.at("mma_version");
        break;
      case Layout::kBlackwellShuffledValue:
        if (g.spec.direction == Direction::kRetile) {
          g.spec.blackwell = Blackwell(p.at("from"));
          g.spec.blackwell_to = Blackwell(p.at("to"));
        } else {
          g.spec.blackwell = Blackwell(p);
        }
        break;
      case Layout::kHopperScale:
        g.spec.hopper_scale.mx_axis = p.at("mx_axis");
        g.spec.hopper_scale.num_warps = p.at("num_warps");
        if (p.contains("align_k")) g.spec.hopper_scale.align_k = p.at("align_k");
        break;
      case Layout::kBlackwellValue:
      case Layout::kBlackwellScale:
        break;
    }
    g.logical_shape = Dims(c.at("logical_shape"));
    if (c.contains("error")) {
      g.error = c.at("error").get<std::string>();
    } else {
      g.input_seed = c.at("input_splitmix64_seed");
      g.input_bytes = c.at("input_bytes");
      g.input_sha256 = c.at("input_sha256");
      g.input_shape = Dims(c.at("input_shape"));
      g.input_strides = OptionalDims(c, "input_strides");
      if (c.contains("input_rule")) {
        if (c.at("input_rule") != "packing2_of_canonical_splitmix64") {
          std::fprintf(stderr, "manifest case %s: unknown input_rule\n", g.name.c_str());
          std::abort();
        }
        g.input_packing2_of_canonical = true;
        g.canonical_input_bytes = c.at("canonical_input_bytes");
      }
      // Files absent from the manifest or null there are not stored.
      if (c.contains("input") && c.at("input").is_string()) {
        g.input_file = dir + "/" + c.at("input").get<std::string>();
      }
      g.output_shape = Dims(c.at("output_shape"));
      g.output_strides = OptionalDims(c, "output_strides");
      g.output_bytes = c.at("output_bytes");
      g.output_sha256 = c.at("output_sha256");
      if (c.contains("output") && c.at("output").is_string()) {
        g.output_file = dir + "/" + c.at("output").get<std::string>();
      }
    }
    cases.push_back(std::move(g));
  }
  return cases;
}

// Row-major strides of `shape` (a dim of size 0 counts as 1), written here rather than
// taken from the planner, whose strides the tests check.
std::vector<int64_t> RowMajor(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

// torch's is_non_overlapping_and_dense (c10/core/Contiguity.h). The planner has the same
// rule (NonOverlappingAndDense); it is written again here on purpose, so that the strides
// the tests expect do not come from the code under test.
bool TorchDense(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  std::vector<size_t> perm(shape.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
    if (shape[a] < 2) return false;
    if (shape[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t required = 1;
  for (size_t i : perm) {
    if (shape[i] < 2) return true;
    if (strides[i] != required) return false;
    required *= shape[i];
  }
  return true;
}

}  // namespace

const std::vector<GoldenCase>& GoldenCases(GoldenSet set) {
  // Each set loads on first use only, so a binary that reads one set (the daemon tests,
  // with $WPREP_GOLDEN_DIR) needs no other set's folder.
  switch (set) {
    case GoldenSet::kValues: {
      static const std::vector<GoldenCase> values = Load(GoldenSet::kValues);
      return values;
    }
    case GoldenSet::kScales: {
      static const std::vector<GoldenCase> scales = Load(GoldenSet::kScales);
      return scales;
    }
    case GoldenSet::kPacking: {
      static const std::vector<GoldenCase> packing = Load(GoldenSet::kPacking);
      return packing;
    }
  }
  std::abort();
}

std::vector<uint8_t> RepackToPacking2(const std::vector<uint8_t>& canonical,
                                      const std::vector<int64_t>& logical_shape) {
  const size_t rank = logical_shape.size();
  const int64_t d0 = logical_shape[rank - 2], d1 = logical_shape[rank - 1];
  int64_t e_count = 1;
  for (size_t i = 0; i + 2 < rank; ++i) e_count *= logical_shape[i];
  std::vector<uint8_t> out(canonical.size());
  const int64_t in_row = d1 / 2, out_row = d0 / 2;
  for (int64_t e = 0; e < e_count; ++e) {
    const uint8_t* m = canonical.data() + e * d0 * in_row;
    uint8_t* o = out.data() + e * d1 * out_row;
    auto nib = [&](int64_t i, int64_t j) { return (m[i * in_row + j / 2] >> (4 * (j & 1))) & 15; };
    for (int64_t j = 0; j < d1; ++j) {
      for (int64_t i = 0; i < out_row; ++i) {
        o[j * out_row + i] = static_cast<uint8_t>(nib(2 * i, j) | nib(2 * i + 1, j) << 4);
      }
    }
  }
  return out;
}

std::vector<uint8_t> GoldenInput(const GoldenCase& c) {
  std::vector<uint8_t> in =
      c.input_packing2_of_canonical
          ? RepackToPacking2(SplitMix64Bytes(c.input_seed, c.canonical_input_bytes), c.logical_shape)
          : SplitMix64Bytes(c.input_seed, c.input_bytes);
  // A regenerated input is only as good as its checksum.
  if (!c.input_sha256.empty()) {
    EXPECT_EQ(Sha256Hex(in), c.input_sha256) << c.name;
  }
  return in;
}

std::vector<int64_t> ExpectedOutputStrides(const GoldenCase& c) {
  if (c.output_strides.empty() || !TorchDense(c.output_shape, c.output_strides)) {
    return RowMajor(c.output_shape);
  }
  return c.output_strides;
}

std::vector<uint8_t> SplitMix64Bytes(uint64_t seed, uint64_t n) {
  std::vector<uint8_t> out(n);
  uint64_t state = seed;
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    for (uint64_t j = 0; j < 8 && i + j < n; ++j) out[i + j] = static_cast<uint8_t>(z >> (8 * j));
  }
  return out;
}

std::string Sha256Hex(const std::vector<uint8_t>& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 15]);
  }
  return out;
}

std::vector<uint8_t> RandomBytes(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

std::vector<int64_t> CheckpointScaleViewStrides(const std::vector<int64_t>& shape) {
  const size_t r = shape.size();
  const int64_t g = shape[r - 2], n = shape[r - 1];
  std::vector<int64_t> strides(r);
  strides[r - 2] = 1;
  strides[r - 1] = g;
  int64_t inner = n * g;
  for (size_t i = r - 2; i-- > 0;) {
    strides[i] = inner;
    inner *= shape[i];
  }
  return strides;
}

StridedInput MakeStridedInput(const Plan& dense_plan, const std::vector<uint8_t>& dense,
                              int64_t pad) {
  const std::vector<int64_t>& shape = dense_plan.input_shape;
  const std::vector<int64_t>& dense_strides = dense_plan.input_strides;
  // The dim the layout keeps contiguous: stride 1 (the last dim unless all are size 1).
  int contiguous_dim = static_cast<int>(shape.size()) - 1;
  for (size_t i = 0; i < dense_strides.size(); ++i) {
    if (dense_strides[i] == 1 && shape[i] > 1) contiguous_dim = static_cast<int>(i);
  }
  StridedInput result;
  std::vector<int64_t>* strides = &result.strides;
  const int rank = static_cast<int>(shape.size());
  // Memory order of the dense tensor, outermost first; the contiguous dim innermost.
  std::vector<int> order(rank);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (a == contiguous_dim || b == contiguous_dim) return b == contiguous_dim && a != b;
    return dense_strides[a] > dense_strides[b];
  });
  strides->assign(rank, 0);
  int64_t s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    (*strides)[order[i]] = s;
    s = s * std::max<int64_t>(shape[order[i]], 1) + pad;
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  int64_t span = numel == 0 ? 0 : 1;
  for (int i = 0; i < rank && numel > 0; ++i) span += (shape[i] - 1) * (*strides)[i];
  std::vector<uint8_t>& out = result.buffer;
  out.assign(static_cast<size_t>(span), 0xA5);  // poison between rows
  std::vector<int64_t> idx(rank, 0);
  for (int64_t n = 0; n < numel; ++n) {
    int64_t src = 0, dst = 0;
    for (int i = 0; i < rank; ++i) {
      src += idx[i] * dense_strides[i];
      dst += idx[i] * (*strides)[i];
    }
    out[dst] = dense[src];
    for (int i = rank - 1; i >= 0; --i) {
      if (++idx[i] < shape[i]) break;
      idx[i] = 0;
    }
  }
  return result;
}

StridedInput MakePermutedInput(const std::vector<int64_t>& shape, const std::vector<uint8_t>& dense,
                               const std::vector<int>& inner_first, int64_t step, int64_t pad) {
  const int rank = static_cast<int>(shape.size());
  StridedInput result;
  result.strides.assign(rank, 0);
  int64_t s = step;
  for (int k = 0; k < rank; ++k) {
    const int d = inner_first[k];
    result.strides[d] = s;
    s = s * std::max<int64_t>(shape[d], 1) + pad;
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  int64_t span = numel == 0 ? 0 : 1;
  for (int i = 0; i < rank && numel > 0; ++i) span += (shape[i] - 1) * result.strides[i];
  result.buffer.assign(static_cast<size_t>(span), 0xA5);
  const std::vector<int64_t> dense_strides = RowMajor(shape);
  std::vector<int64_t> idx(rank, 0);
  for (int64_t n = 0; n < numel; ++n) {
    int64_t src = 0, dst = 0;
    for (int i = 0; i < rank; ++i) {
      src += idx[i] * dense_strides[i];
      dst += idx[i] * result.strides[i];
    }
    result.buffer[dst] = dense[src];
    for (int i = rank - 1; i >= 0; --i) {
      if (++idx[i] < shape[i]) break;
      idx[i] = 0;
    }
  }
  return result;
}

std::vector<ConversionSpec> SweepSpecs() {
  std::vector<ConversionSpec> specs;
  for (Direction d : {Direction::kSwizzle, Direction::kUnswizzle}) {
    for (int packing : {-1, -2}) {
      for (int mx : {-1, -2}) {
        for (int mma : {2, 3}) {
          ConversionSpec s;
          s.layout = Layout::kHopperValue;
          s.direction = d;
          s.hopper = {mx, mma};
          s.packing_axis = packing;
          specs.push_back(s);
        }
      }
      for (auto [bk, bn] : std::vector<std::pair<int, int>>{
               {128, 256}, {256, 128}, {64, 64}, {6, 10}, {384, 48}, {128, 20}}) {
        ConversionSpec s;
        s.layout = Layout::kBlackwellShuffledValue;
        s.direction = d;
        s.blackwell = {bk, bn};
        s.packing_axis = packing;
        specs.push_back(s);
      }
      ConversionSpec v;
      v.layout = Layout::kBlackwellValue;
      v.direction = d;
      v.packing_axis = packing;
      specs.push_back(v);
    }
    for (int mx : {-1, -2}) {
      for (int nw : {1, 2, 4, 8, 16}) {
        ConversionSpec s;
        s.layout = Layout::kHopperScale;
        s.direction = d;
        s.hopper_scale = {mx, nw, 2};
        specs.push_back(s);
      }
      // Zero groups appended along the mx axis: vLLM's sm_90 call (4), and a wide one.
      for (auto [nw, align_k] : {std::pair{8, 4}, std::pair{2, 8}}) {
        ConversionSpec s;
        s.layout = Layout::kHopperScale;
        s.direction = d;
        s.hopper_scale = {mx, nw, align_k};
        specs.push_back(s);
      }
    }
    ConversionSpec b;
    b.layout = Layout::kBlackwellScale;
    b.direction = d;
    specs.push_back(b);
  }
  for (auto [from, to] : std::vector<std::pair<BlackwellParams, BlackwellParams>>{
           {{128, 256}, {256, 128}}, {{6, 10}, {128, 128}}, {{384, 48}, {64, 32}}}) {
    ConversionSpec s;
    s.layout = Layout::kBlackwellShuffledValue;
    s.direction = Direction::kRetile;
    s.blackwell = from;
    s.blackwell_to = to;
    specs.push_back(s);
  }
  return specs;
}

std::vector<int64_t> RandomShapeFor(const ConversionSpec& spec, uint64_t seed, int64_t max_dim) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> shape;
  const int lead = static_cast<int>(rng() % 3);
  for (int i = 0; i < lead; ++i) shape.push_back(static_cast<int64_t>(rng() % 3) + 1);
  const bool value = spec.layout == Layout::kHopperValue ||
                     spec.layout == Layout::kBlackwellShuffledValue ||
                     spec.layout == Layout::kBlackwellValue;
  const bool storage_packs_d1 = spec.layout == Layout::kHopperValue && spec.hopper.mx_axis == -1;
  const bool even_d0 = value && (spec.packing_axis == -2 || !storage_packs_d1);
  const bool even_d1 = value && (spec.packing_axis == -1 || storage_packs_d1);
  auto dim = [&](bool even) {
    const int64_t x = static_cast<int64_t>(rng() % max_dim) + 1;
    return even ? 2 * ((x + 1) / 2) : x;
  };
  shape.push_back(dim(even_d0));
  shape.push_back(dim(even_d1));
  return shape;
}

std::vector<NamedView> ViewsOf(const Plan& dense_plan, const std::vector<uint8_t>& dense) {
  std::vector<NamedView> views;
  views.push_back({"rows padded by 16", MakeStridedInput(dense_plan, dense, 16)});
  views.push_back({"rows padded by 3", MakeStridedInput(dense_plan, dense, 3)});
  const bool scale_tensor = dense_plan.spec.direction == Direction::kSwizzle &&
                            (dense_plan.spec.layout == Layout::kHopperScale ||
                             dense_plan.spec.layout == Layout::kBlackwellScale);
  if (scale_tensor) {
    const std::vector<int64_t>& shape = dense_plan.input_shape;
    const int rank = static_cast<int>(shape.size());
    std::vector<int> transposed = {rank - 2, rank - 1}, natural;
    for (int i = rank - 3; i >= 0; --i) transposed.push_back(i);
    for (int i = rank - 1; i >= 0; --i) natural.push_back(i);
    views.push_back({"transposed", MakePermutedInput(shape, dense, transposed, 1, 0)});
    views.push_back({"transposed, padded by 16", MakePermutedInput(shape, dense, transposed, 1, 16)});
    views.push_back({"every byte 2 apart", MakePermutedInput(shape, dense, natural, 2, 0)});
  }
  return views;
}

}  // namespace wprep::testing
