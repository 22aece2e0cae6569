// `wprep convert` arguments: parsed once, shared by the local and remote modes.
#ifndef WPREP_CLIENT_CLI_CONVERT_ARGS_H_
#define WPREP_CLIENT_CLI_CONVERT_ARGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

struct ConvertArgs {
  ConversionSpec spec;
  std::vector<int64_t> shape;  // logical shape (FP4 values)
  std::vector<int64_t> input_strides;  // byte strides of the input file's view; empty: dense
  bool local = false;
  std::string target;          // remote daemon address (unix:///path or HOST:PORT)
  std::string device = "cpu";  // cpu | cuda:N
  int threads = 0;             // CPU engine threads (0 = all)
  std::string input;
  std::string output;
};

// Parses the arguments after `convert`. Every problem is InvalidArgument with a message
// naming the flag and the value.
absl::StatusOr<ConvertArgs> ParseConvertArgs(const std::vector<std::string>& args);

// `wprep convert --help`, generated from the flags' declarations.
std::string ConvertUsage();

// Parses "cpu" or "cuda:N"; returns -1 for cpu.
absl::StatusOr<int> ParseDevice(const std::string& device);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_CONVERT_ARGS_H_
