#include "progress.h"

#include <unistd.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace wprep::cli {

absl::StatusOr<ProgressMode> ParseProgressMode(const std::string& flag, FILE* out) {
  if (flag == "auto") return isatty(fileno(out)) ? ProgressMode::kBar : ProgressMode::kLines;
  if (flag == "bar") return ProgressMode::kBar;
  if (flag == "lines") return ProgressMode::kLines;
  if (flag == "none") return ProgressMode::kNone;
  return absl::InvalidArgumentError(
      absl::StrCat("--progress must be auto, bar, lines or none, got '", flag, "'"));
}

Progress::Progress(ProgressMode mode, uint64_t total_bytes, int total_items, FILE* out)
    : mode_(mode), total_bytes_(total_bytes), total_items_(total_items), out_(out), start_(absl::Now()) {
  if (mode_ != ProgressMode::kBar) return;
  redraw_ = std::thread([this] {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      Draw();
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
    }
  });
}

Progress::~Progress() { Finish(); }

void Progress::Finish() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    if (mode_ == ProgressMode::kBar) {
      Draw();
      std::fputc('\n', out_);
      std::fflush(out_);
    }
  }
  if (redraw_.joinable()) redraw_.join();
}

double Progress::Rate() const {
  const double s = absl::ToDoubleSeconds(absl::Now() - start_);
  return s > 0 ? static_cast<double>(done_.load(std::memory_order_relaxed)) / s : 0;
}

std::string Progress::Bytes(uint64_t n) {
  const double v = static_cast<double>(n);
  if (n >= (1ull << 30)) return absl::StrFormat("%.2f GiB", v / (1ull << 30));
  if (n >= (1ull << 20)) return absl::StrFormat("%.1f MiB", v / (1ull << 20));
  if (n >= (1ull << 10)) return absl::StrFormat("%.1f KiB", v / (1ull << 10));
  return absl::StrCat(n, " B");
}

std::string Progress::PerSecond(double r) {
  if (r >= 1e9) return absl::StrFormat("%.2f GB/s", r / 1e9);
  return absl::StrFormat("%.1f MB/s", r / 1e6);
}

void Progress::ItemDone(const std::string& what) {
  absl::MutexLock lock(&mu_);
  ++items_;
  if (mode_ != ProgressMode::kLines) return;
  const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_bytes_);
  const double pct = total_bytes_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_bytes_) : 100.0;
  std::fprintf(out_, "[%d/%d] %5.1f%% %s (%s)\n", items_, total_items_, pct, what.c_str(), PerSecond(Rate()).c_str());
  std::fflush(out_);
}

void Progress::Draw() {
  constexpr int kWidth = 30;
  const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_bytes_);
  const double frac = total_bytes_ > 0 ? static_cast<double>(done) / static_cast<double>(total_bytes_) : 1.0;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kWidth - filled), ' ');
  // \r and "erase to end of line": the bar redraws itself in place.
  std::fprintf(out_, "\r%5.1f%% [%s] %s / %s  %s  %d/%d tensors\033[K", 100.0 * frac, bar.c_str(),
               Bytes(done).c_str(), Bytes(total_bytes_).c_str(), PerSecond(Rate()).c_str(), items_,
               total_items_);
  std::fflush(out_);
}

}  // namespace wprep::cli
