#include "fake_checkpoint.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "golden.h"
#include "nlohmann/json.hpp"

namespace wprep::testing {
namespace {

uint64_t Bytes(const std::string& dtype, const std::vector<int64_t>& shape) {
  uint64_t n = dtype == "BF16" ? 2 : 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fake checkpoint: %s\n", what.c_str());
  std::abort();
}

}  // namespace

std::vector<FakeTensor> FakeCheckpointTensors(const FakeCheckpointOptions& o) {
  std::vector<FakeTensor> t;
  const int64_t e = o.experts, h = o.hidden, i2 = 2 * o.intermediate, im = o.intermediate;
  auto add = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape, int layer) {
    FakeTensor f;
    f.name = name;
    f.dtype = dtype;
    f.shape = std::move(shape);
    f.bytes = Bytes(dtype, f.shape);
    f.seed = o.seed * 1000003 + t.size() + 1;
    const int shard = o.shards <= 1 ? 0 : (layer < 0 ? 0 : layer % o.shards);
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", shard + 1, o.shards);
    f.file = o.shards <= 1 ? "model.safetensors" : file;
    t.push_back(std::move(f));
  };
  add("model.embed_tokens.weight", "BF16", {o.vocab, h}, -1);
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", "BF16", {h}, l);
    add(p + "mlp.experts.down_proj_bias", "BF16", {e, h}, l);
    add(p + "mlp.experts.down_proj_blocks", "U8", {e, h, im / 32, 16}, l);
    add(p + "mlp.experts.down_proj_scales", "U8", {e, h, im / 32}, l);
    add(p + "mlp.experts.gate_up_proj_bias", "BF16", {e, i2}, l);
    add(p + "mlp.experts.gate_up_proj_blocks", "U8", {e, i2, h / 32, 16}, l);
    add(p + "mlp.experts.gate_up_proj_scales", "U8", {e, i2, h / 32}, l);
    add(p + "mlp.router.bias", "BF16", {e}, l);
    add(p + "mlp.router.weight", "BF16", {e, h}, l);
    add(p + "post_attention_layernorm.weight", "BF16", {h}, l);
    add(p + "self_attn.q_proj.weight", "BF16", {h, h}, l);
    add(p + "self_attn.sinks", "BF16", {8}, l);
    if (o.split_a_pair && o.shards > 1 && l == o.layers - 1) {
      for (FakeTensor& f : t) {
        if (f.name != p + "mlp.experts.down_proj_scales") continue;
        char file[64];
        std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", (l + 1) % o.shards + 1, o.shards);
        f.file = file;
      }
    }
  }
  add("model.norm.weight", "BF16", {h}, -1);
  add("lm_head.weight", "BF16", {o.vocab, h}, -1);
  return t;
}

std::vector<uint8_t> FakeTensorBytes(const FakeTensor& t) { return SplitMix64Bytes(t.seed, t.bytes); }

std::vector<FakeTensor> WriteFakeCheckpoint(const std::string& path, const FakeCheckpointOptions& o) {
  const std::vector<FakeTensor> tensors = FakeCheckpointTensors(o);
  std::map<std::string, std::vector<const FakeTensor*>> files;
  for (const FakeTensor& t : tensors) files[t.file].push_back(&t);
  namespace fs = std::filesystem;
  if (o.shards > 1) fs::create_directories(path);
  nlohmann::ordered_json index;
  uint64_t total = 0;
  for (const auto& [name, list] : files) {
    nlohmann::ordered_json header;
    header["__metadata__"] = {{"format", "pt"}};
    uint64_t at = 0;
    for (const FakeTensor* t : list) {
      header[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {at, at + t->bytes}}};
      at += t->bytes;
      index["weight_map"][t->name] = name;
    }
    total += at;
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::string file = o.shards > 1 ? (fs::path(path) / name).string() : path;
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    if (!f) Die("cannot create " + file);
    const uint64_t n = text.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>(n >> (8 * i));
    f.write(len, 8);
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const FakeTensor* t : list) {
      const std::vector<uint8_t> b = FakeTensorBytes(*t);
      f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    if (!f.flush()) Die("cannot write " + file);
  }
  if (o.shards > 1) {
    nlohmann::ordered_json doc;
    doc["metadata"] = {{"total_size", total}};
    doc["weight_map"] = index["weight_map"];
    std::ofstream f(fs::path(path) / "model.safetensors.index.json");
    f << doc.dump(2) << "\n";
    if (!f.flush()) Die("cannot write the index");
  }
  return tensors;
}

}  // namespace wprep::testing
