// Every committed fuzz input replayed through its target's entry point, in every build
// (the ASan + UBSan build included, where a sanitizer report fails the test): the seed
// corpora (tests/fuzz/corpus/) and the inputs that once broke something
// (tests/fuzz/regressions/). A broken invariant aborts the test with its message.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "gtest/gtest.h"

namespace wprep::fuzz {
namespace {

// Runs `target` on every file under tests/fuzz/<kind>/<name> for each kind; the count.
int Replay(const std::string& name, int (*target)(const uint8_t*, size_t)) {
  int n = 0;
  for (const char* kind : {"corpus", "regressions"}) {
    const std::filesystem::path dir = std::filesystem::path(WPREP_FUZZ_DIR) / kind / name;
    if (!std::filesystem::is_directory(dir)) continue;
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      SCOPED_TRACE(f.string());
      std::ifstream in(f, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++n;
    }
  }
  return n;
}

TEST(FuzzReplay, EveryRequestSeedAndRegression) { EXPECT_GT(Replay("request", FuzzRequest), 30); }

TEST(FuzzReplay, EveryStreamSeedAndRegression) { EXPECT_GT(Replay("stream", FuzzStream), 15); }

TEST(FuzzReplay, EveryBatchSeedAndRegression) { EXPECT_GE(Replay("batch", FuzzBatch), 5); }

TEST(FuzzReplay, EverySafetensorsSeedAndRegression) { EXPECT_GE(Replay("safetensors", FuzzSafetensors), 8); }

}  // namespace
}  // namespace wprep::fuzz
