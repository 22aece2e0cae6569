// One-line structured logs (logfmt) on stderr: "ts=... level=info event=... key=value ...".
#ifndef WPREP_SERVER_SRC_LOG_H_
#define WPREP_SERVER_SRC_LOG_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace wprep::server {

enum class LogLevel { kInfo, kWarning, kError };

// Writes one line: timestamp, level, event and `fields` (already "k=v k=v"). Thread-safe;
// lines never interleave.
void LogLine(LogLevel level, absl::string_view event, absl::string_view fields);

// Quotes a free-text value for logfmt when needed ("a b" -> "\"a b\"").
std::string LogQuote(absl::string_view value);

// A process-unique id for a request, also sent to the client as x-wprep-request-id.
uint64_t NextRequestId();

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_LOG_H_
