#include "health.h"

#include <chrono>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace wprep::cli {

const char kHealthUsage[] =
    "usage: wprep health [--target unix:///path.sock|HOST:PORT] [--service NAME]\n"
    "                    [--timeout DURATION]\n"
    "  --target    the daemon's listener, or its --health-listen address\n"
    "              (default unix:///tmp/wprepd.sock)\n"
    "  --service   \"\" for the whole daemon (default) or wprep.v1.WeightPrep\n"
    "  --timeout   deadline of the check, e.g. 2s or 500ms (default 5s)\n"
    "Calls grpc.health.v1.Health/Check once, plaintext, and prints one line: SERVING,\n"
    "NOT_SERVING, UNKNOWN, or the gRPC error (NOT_FOUND: unknown service, ...).\n"
    "Exit status: 0 SERVING; 1 any other answer; 2 usage error, or no answer\n"
    "(UNAVAILABLE, DEADLINE_EXCEEDED).\n";

absl::StatusOr<HealthArgs> ParseHealthArgs(const std::vector<std::string>& args) {
  HealthArgs out;
  std::map<std::string, std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    std::string value;
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a.resize(eq);
    } else {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat(a, " needs a value"));
      value = args[++i];
    }
    if (seen.count(a)) return absl::InvalidArgumentError(absl::StrCat(a, " given twice"));
    seen[a] = value;
    if (a == "--target") {
      if (value.empty()) return absl::InvalidArgumentError("--target must not be empty");
      out.target = value;
    } else if (a == "--service") {
      out.service = value;
    } else if (a == "--timeout") {
      absl::Duration d;
      if (!absl::ParseDuration(value, &d) || d <= absl::ZeroDuration()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--timeout must be a positive duration such as 2s or 500ms, got '", value, "'"));
      }
      out.timeout = d;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", a, "; see wprep health --help"));
    }
  }
  return out;
}

HealthOutcome RunHealth(const HealthArgs& args) {
  grpc::ChannelArguments channel_args;
  // A probe talks to the daemon beside it: never through an HTTP proxy from the environment.
  channel_args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  auto channel =
      grpc::CreateCustomChannel(args.target, grpc::InsecureChannelCredentials(), channel_args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + args.timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(args.service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = stub->Check(&ctx, request, &response);

  HealthOutcome out;
  if (s.ok()) {
    out.line = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    if (out.line.empty()) out.line = absl::StrCat("status ", static_cast<int>(response.status()));
    out.exit_code = response.status() == grpc::health::v1::HealthCheckResponse::SERVING
                        ? kHealthServing
                        : kHealthNotServing;
    return out;
  }
  out.error = true;
  const absl::StatusCode code = static_cast<absl::StatusCode>(s.error_code());
  out.line = absl::StrCat(absl::StatusCodeToString(code), ": ", s.error_message());
  // UNAVAILABLE and DEADLINE_EXCEEDED: nothing answered. Anything else (NOT_FOUND for an
  // unknown service, UNIMPLEMENTED where no health service runs) is the server's answer.
  out.exit_code = code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded
                      ? kHealthNoAnswer
                      : kHealthNotServing;
  return out;
}

}  // namespace wprep::cli
