// Writes gpt-oss-shaped safetensors checkpoints for the tests and the benchmark: per
// layer the MoE experts' MXFP4 pairs (gate_up_proj and down_proj `_blocks` U8
// [E, N, K/32, 16] and `_scales` U8 [E, N, K/32]) among BF16 tensors (biases, router,
// norms, attention), plus embeddings; random bytes throughout. Its header writer is its
// own (nlohmann::json, padded as the format's reference implementation pads), so the
// tests do not check wprep's writer with itself.
#ifndef WPREP_TESTS_CLIENT_FAKE_CHECKPOINT_H_
#define WPREP_TESTS_CLIENT_FAKE_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace wprep::testing {

struct FakeCheckpointOptions {
  int layers = 2;
  int64_t experts = 4;
  int64_t hidden = 128;        // K of gate_up, N of down; a multiple of 32
  int64_t intermediate = 96;   // N of gate_up is twice this; K of down; a multiple of 32
  int64_t vocab = 64;
  int shards = 1;              // > 1: model-0000i-of-0000n.safetensors + model.safetensors.index.json
  // With shards: put the last layer's down_proj_scales in another shard than its blocks.
  bool split_a_pair = false;
  uint64_t seed = 1;
};

struct FakeTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string file;  // the shard (file name) holding it
  uint64_t bytes = 0;
  uint64_t seed = 0;  // its bytes: SplitMix64Bytes(seed, bytes)
};

// The tensors a checkpoint of `o` holds, in file order.
std::vector<FakeTensor> FakeCheckpointTensors(const FakeCheckpointOptions& o);

// Writes the checkpoint: `path` is the file (one shard) or the folder (several, created).
// Returns the tensors written; aborts the test program on I/O errors.
std::vector<FakeTensor> WriteFakeCheckpoint(const std::string& path, const FakeCheckpointOptions& o);

// The bytes of `t`.
std::vector<uint8_t> FakeTensorBytes(const FakeTensor& t);

}  // namespace wprep::testing

#endif  // WPREP_TESTS_CLIENT_FAKE_CHECKPOINT_H_
