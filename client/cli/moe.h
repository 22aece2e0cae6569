// `wprep moe`: trtllm-gen MoE weight preparation (FlashInfer's Blackwell fused-MoE path)
// of raw tensor files, in this process (--local, the CPU engine or a local GPU) or by a
// running wprepd (--target, one ConvertBatch MoE item with inline bytes).
#ifndef WPREP_CLIENT_CLI_MOE_H_
#define WPREP_CLIENT_CLI_MOE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "wprep/kernels/moe.h"

namespace wprep::cli {

// --input NAME:DTYPE:D0,D1,...=PATH
struct MoeInputArg {
  MoeTensorDesc desc;
  std::string path;
};

// --output NAME=PATH
struct MoeOutputArg {
  std::string name;
  std::string path;
};

struct MoeArgs {
  bool local = false;
  std::string target;          // the daemon's address with --target
  std::string device = "cpu";  // cpu | cuda:N (--local only)
  int threads = 0;             // CPU engine threads (0: all)
  MoeOp op = MoeOp::kSwapPairs;
  std::string op_name;  // as given
  MoeParams params;
  // --param KEY=VALUE, as given (the remote mode sends them typed, see MoeParamsToProto).
  std::vector<std::pair<std::string, std::string>> raw_params;
  std::vector<MoeInputArg> inputs;
  std::vector<MoeOutputArg> outputs;
};

// Parses the arguments after `moe`: every problem is InvalidArgument naming the flag and
// the value. Shapes, dtypes and params are checked against the op later (PlanMoe).
absl::StatusOr<MoeArgs> ParseMoeArgs(const std::vector<std::string>& args);

// One output written.
struct MoeOutputResult {
  std::string name;
  MoeDType dtype = MoeDType::kUint8;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements
  uint64_t bytes = 0;
};
struct MoeResult {
  std::vector<MoeOutputResult> outputs;  // those given with --output, in the op's order
  std::string identity;
};

// Runs the op and writes every --output file, or none: every name, shape, dtype, param
// and input file size is checked before anything is written, and the files are written
// to temporary names renamed into place once all of them are complete.
absl::StatusOr<MoeResult> RunMoe(const MoeArgs& args);

// `wprep moe ARGS`: the exit status (0; 2 with one status line on stderr).
int MoeCommand(const std::vector<std::string>& args);

// `wprep moe --help`, generated from the flags' declarations.
std::string MoeUsage();

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_MOE_H_
