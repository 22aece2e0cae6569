// wprep: command-line front end. `wprep convert --local ...` converts files in-process;
// `wprep convert --target ADDR ...` has a running wprepd do it; `wprep health` asks a
// running wprepd whether it serves (for probes).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "convert_args.h"
#include "inspect.h"
#include "local_convert.h"
#include "moe.h"
#include "quantize.h"
#if defined(WPREP_CLI_REMOTE)
#include "bench.h"
#include "convert_safetensors.h"
#include "health.h"
#include "remote_convert.h"
#include "weights.h"
#endif

namespace {

constexpr char kUsage[] =
    "usage: wprep <command> [flags]\n"
    "commands:\n"
    "  convert   convert one tensor file between MXFP4 layouts (wprep convert --help)\n"
    "  health    ask a running wprepd whether it is SERVING (wprep health --help)\n"
    "  plan      what a conversion reads and writes, without converting (wprep plan --help)\n"
    "  devices   the GPUs and engines a running wprepd uses (wprep devices --help)\n"
    "  bench     latency and throughput of a running wprepd (wprep bench --help)\n"
    "  convert-safetensors  convert an MXFP4 checkpoint's tensors (wprep convert-safetensors --help)\n"
    "  moe       trtllm-gen MoE weight preparation of raw tensor files (wprep moe --help)\n"
    "  quantize  bf16/fp16/fp32 weights to MXFP4 values and scales (wprep quantize --help)\n"
    "  weights   a running wprepd's resident weight sets: load, list, show, drop (wprep weights --help)\n";

// One line, beginning with the status code name; exit status 2.
int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 2;
}

int Convert(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(wprep::cli::ConvertUsage().c_str(), stdout);
      return 0;
    }
  }
  auto parsed = wprep::cli::ParseConvertArgs(args);
  if (!parsed.ok()) return Fail(parsed.status());
#if defined(WPREP_CLI_REMOTE)
  auto result = parsed->local ? wprep::cli::RunLocalConvert(*parsed)
                              : wprep::cli::RunRemoteConvert(*parsed);
#else
  if (!parsed->local) {
    return Fail(absl::UnimplementedError(
        "this wprep build has no remote mode (built without gRPC); use --local"));
  }
  auto result = wprep::cli::RunLocalConvert(*parsed);
#endif
  if (!result.ok()) return Fail(result.status());
  std::printf("%s\n", wprep::cli::FormatResult(*result).c_str());
  return 0;
}

int Health(const std::vector<std::string>& args) {
#if defined(WPREP_CLI_REMOTE)
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(wprep::cli::HealthUsage().c_str(), stdout);
      return 0;
    }
  }
  auto parsed = wprep::cli::ParseHealthArgs(args);
  if (!parsed.ok()) {
    Fail(parsed.status());
    return wprep::cli::kHealthNoAnswer;
  }
  const wprep::cli::HealthOutcome outcome = wprep::cli::RunHealth(*parsed);
  std::fprintf(outcome.error ? stderr : stdout, "%s\n", outcome.line.c_str());
  return outcome.exit_code;
#else
  (void)args;
  return Fail(absl::UnimplementedError("this wprep build has no gRPC client (built without gRPC)"));
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "convert") return Convert(args);
  if (command == "health") return Health(args);
  if (command == "plan") return wprep::cli::PlanCommand(args);
  if (command == "devices") return wprep::cli::DevicesCommand(args);
  if (command == "moe") return wprep::cli::MoeCommand(args);
  if (command == "quantize") return wprep::cli::QuantizeCommand(args);
#if defined(WPREP_CLI_REMOTE)
  if (command == "bench") return wprep::cli::BenchCommand(args);
  if (command == "convert-safetensors") return wprep::cli::ConvertSafetensorsCommand(args);
  if (command == "weights") return wprep::cli::WeightsCommand(args);
#else
  if (command == "bench" || command == "convert-safetensors" || command == "weights") {
    return Fail(absl::UnimplementedError("this wprep build has no gRPC client (built without gRPC)"));
  }
#endif
  std::fprintf(stderr, "INVALID_ARGUMENT: unknown command '%s'\n%s", command.c_str(), kUsage);
  return 2;
}
