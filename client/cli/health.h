// `wprep health`: one grpc.health.v1 Check of a running wprepd, shaped for probes (a
// Kubernetes exec probe, a Docker HEALTHCHECK): one line out, and an exit status that
// says SERVING (0), any other answer (1), or no answer / bad usage (2).
#ifndef WPREP_CLIENT_CLI_HEALTH_H_
#define WPREP_CLIENT_CLI_HEALTH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wprep::cli {

// Exit statuses of `wprep health`.
inline constexpr int kHealthServing = 0;    // the answer was SERVING
inline constexpr int kHealthNotServing = 1; // the daemon answered anything else
inline constexpr int kHealthNoAnswer = 2;   // usage error, or no answer within --timeout

struct HealthArgs {
  std::string target = "unix:///tmp/wprepd.sock";  // unix:///path or HOST:PORT
  std::string service;                             // "" = the whole server
  absl::Duration timeout = absl::Seconds(5);       // deadline of the one Check, > 0
};

// Parses the arguments after `health`. Every problem is InvalidArgument naming the flag.
absl::StatusOr<HealthArgs> ParseHealthArgs(const std::vector<std::string>& args);

// The outcome of one Check: the line to print and the exit status.
struct HealthOutcome {
  int exit_code = kHealthNoAnswer;
  std::string line;  // "SERVING", "NOT_SERVING", "UNKNOWN", or "CODE: message"
  bool error = false;  // true when `line` is a gRPC error (printed to stderr)
};

// Calls grpc.health.v1.Health/Check once on args.target, plaintext, with no proxy.
// Thread-compatible; blocks at most args.timeout (plus channel teardown).
HealthOutcome RunHealth(const HealthArgs& args);

// `wprep health --help`, generated from the flags' declarations.
std::string HealthUsage();

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_HEALTH_H_
