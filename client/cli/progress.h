// Progress of a long CLI job on stderr: on a terminal a bar redrawn in place with the
// bytes per second; otherwise one plain line per finished item (logs, CI).
#ifndef WPREP_CLIENT_CLI_PROGRESS_H_
#define WPREP_CLIENT_CLI_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace wprep::cli {

enum class ProgressMode { kBar, kLines, kNone };

// "auto" (a bar when `out` is a terminal, else lines), "bar", "lines" or "none".
absl::StatusOr<ProgressMode> ParseProgressMode(const std::string& flag, FILE* out);

// Thread-safe: workers report bytes and finished items from any thread.
class Progress {
 public:
  Progress(ProgressMode mode, uint64_t total_bytes, int total_items, FILE* out = stderr);
  ~Progress();  // Finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `n` more bytes are done.
  void AddBytes(uint64_t n) { done_.fetch_add(n, std::memory_order_relaxed); }
  // One more item is done; in lines mode prints "[i/n] pct% what (rate)".
  void ItemDone(const std::string& what);
  // Stops the redraw; the bar's last state stays on its line, then a newline.
  void Finish();

  // Bytes per second since the start.
  double Rate() const;
  // "1.5 GiB", "340.2 MB/s": the units the lines and the bar print.
  static std::string Bytes(uint64_t n);
  static std::string PerSecond(double bytes_per_second);

 private:
  void Draw() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ProgressMode mode_;
  const uint64_t total_bytes_;
  const int total_items_;
  FILE* const out_;
  const absl::Time start_;
  std::atomic<uint64_t> done_{0};

  absl::Mutex mu_;
  int items_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread redraw_;  // bar mode only
};

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_PROGRESS_H_
