#include "golden.h"

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

std::string GoldenDir() {
  if (const char* env = std::getenv("WPREP_GOLDEN_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return WPREP_GOLDEN_DIR;
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

std::vector<GoldenCase> Load() {
  const std::string dir = GoldenDir();
  const auto text = ReadFile(dir + "/manifest.json");
  const auto manifest = nlohmann::json::parse(text.begin(), text.end());
  std::vector<GoldenCase> cases;
  for (const auto& c : manifest.at("cases")) {
    GoldenCase g;
    g.name = c.at("name");
    auto layout = ParseLayout(c.at("layout").get<std::string>());
    auto direction = ParseDirection(c.at("direction").get<std::string>());
    if (!layout.ok() || !direction.ok()) {
      std::fprintf(stderr, "manifest case %s: unknown layout or direction\n", g.name.c_str());
      std::abort();
    }
    g.spec.layout = *layout;
    g.spec.direction = *direction;
    const auto& p = c.at("params");
    if (g.spec.layout == Layout::kHopperValue) {
      g.spec.hopper.mx_axis = p.at("mx_axis");
      g.spec.hopper.mma_version = p.at("mma_version");
    } else if (g.spec.direction == Direction::kRetile) {
      g.spec.blackwell = Blackwell(p.at("from"));
      g.spec.blackwell_to = Blackwell(p.at("to"));
    } else {
      g.spec.blackwell = Blackwell(p);
    }
    g.logical_shape = Dims(c.at("logical_shape"));
    if (c.contains("error")) {
      g.error = c.at("error").get<std::string>();
    } else {
      g.input_seed = c.at("input_splitmix64_seed");
      g.input_bytes = c.at("input_bytes");
      g.input_sha256 = c.at("input_sha256");
      g.input_shape = Dims(c.at("input_shape"));
      g.output_shape = Dims(c.at("output_shape"));
      g.output_strides = Dims(c.at("output_strides"));
      g.output_bytes = c.at("output_bytes");
      g.output_sha256 = c.at("output_sha256");
      if (c.contains("output")) g.output_file = dir + "/" + c.at("output").get<std::string>();
    }
    cases.push_back(std::move(g));
  }
  return cases;
}

}  // namespace

const std::vector<GoldenCase>& GoldenCases() {
  static const std::vector<GoldenCase> cases = Load();
  return cases;
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

}  // namespace wprep::testing
