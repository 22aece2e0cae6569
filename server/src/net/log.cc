#include "net/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wprep::server {

void LogLine(LogLevel level, absl::string_view event, absl::string_view fields) {
  const char* lvl = level == LogLevel::kInfo ? "info" : level == LogLevel::kWarning ? "warn" : "error";
  std::string line = absl::StrCat(
      "ts=", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()),
      " level=", lvl, " event=", event, fields.empty() ? "" : " ", fields, "\n");
  // One fwrite per line: stdio locks the stream, so concurrent lines do not interleave.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

std::string LogQuote(absl::string_view value) {
  if (value.find_first_of(" \"=\n\t") == absl::string_view::npos && !value.empty()) {
    return std::string(value);
  }
  return absl::StrCat("\"",
                      absl::StrReplaceAll(value, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}}),
                      "\"");
}

uint64_t NextRequestId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace wprep::server
