// wprep_fake_checkpoint: writes a gpt-oss-shaped checkpoint of random bytes (for
// scripts/safetensors_bench.sh).
//   wprep_fake_checkpoint OUT [--layers=N] [--experts=E] [--hidden=H] [--intermediate=I]
//                             [--vocab=V] [--shards=S]
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "fake_checkpoint.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: wprep_fake_checkpoint OUT [--layers=N] [--experts=E] [--hidden=H] "
                         "[--intermediate=I] [--vocab=V] [--shards=S]\n");
    return 2;
  }
  wprep::testing::FakeCheckpointOptions o;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    int64_t v = 0;
    if (eq == std::string::npos || !absl::SimpleAtoi(a.substr(eq + 1), &v) || v < 1) {
      std::fprintf(stderr, "bad argument %s\n", a.c_str());
      return 2;
    }
    const std::string k = a.substr(0, eq);
    if (k == "--layers") o.layers = static_cast<int>(v);
    else if (k == "--experts") o.experts = v;
    else if (k == "--hidden") o.hidden = v;
    else if (k == "--intermediate") o.intermediate = v;
    else if (k == "--vocab") o.vocab = v;
    else if (k == "--shards") o.shards = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (o.hidden % 32 != 0 || o.intermediate % 32 != 0) {
    std::fprintf(stderr, "--hidden and --intermediate must be multiples of 32\n");
    return 2;
  }
  uint64_t total = 0;
  for (const auto& t : wprep::testing::WriteFakeCheckpoint(argv[1], o)) total += t.bytes;
  std::printf("%s: %llu tensor bytes\n", argv[1], static_cast<unsigned long long>(total));
  return 0;
}
