#include "health.h"

#include <chrono>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "flags.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace wprep::cli {

namespace {

// `wprep health`'s flags: the parser and --help.
flags::FlagSet HealthFlags() {
  const HealthArgs d;
  flags::FlagSet fs = CommandFlags(
      "health",
      "usage: wprep health [flags]\n"
      "Calls grpc.health.v1.Health/Check once, plaintext, and prints one line: SERVING,\n"
      "NOT_SERVING, UNKNOWN, or the gRPC error (NOT_FOUND: unknown service, ...).\n");
  fs.String("target", "ADDR", d.target, "the daemon's listener, or its --health-listen address");
  fs.String("service", "NAME", d.service, "\"\" for the whole daemon (the default) or wprep.v1.WeightPrep");
  fs.String("timeout", "DURATION", absl::FormatDuration(d.timeout), "deadline of the check, e.g. 2s or 500ms");
  fs.Footer(
      "Exit status: 0 SERVING; 1 any other answer; 2 usage error, or no answer\n"
      "(UNAVAILABLE, DEADLINE_EXCEEDED).\n");
  return fs;
}

}  // namespace

std::string HealthUsage() { return HealthFlags().Usage(); }

absl::StatusOr<HealthArgs> ParseHealthArgs(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, HealthFlags());
  if (!flags.ok()) return flags.status();
  HealthArgs out;
  if (const std::string* t = flags->Get("--target")) {
    if (t->empty()) return absl::InvalidArgumentError("--target must not be empty");
    out.target = *t;
  }
  if (const std::string* s = flags->Get("--service")) out.service = *s;
  if (const std::string* t = flags->Get("--timeout")) {
    absl::Duration d;
    if (!absl::ParseDuration(*t, &d) || d <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--timeout must be a positive duration such as 2s or 500ms, got '", *t, "'"));
    }
    out.timeout = d;
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
