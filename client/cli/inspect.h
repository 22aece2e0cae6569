// `wprep plan` (what a conversion takes and gives, without doing it) and `wprep devices`
// (the GPUs and engines a running wprepd serves with).
#ifndef WPREP_CLIENT_CLI_INSPECT_H_
#define WPREP_CLIENT_CLI_INSPECT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace wprep::cli {

// One line beginning with the status code name (newlines in the message become spaces);
// returns 2, the exit status of every error of the subcommands.
int FailLine(const absl::Status& s);

// Each takes the arguments after its subcommand and returns the exit status: 0 done,
// 2 bad usage or an error (one line on stderr, as FailLine prints it).
int PlanCommand(const std::vector<std::string>& args);
int DevicesCommand(const std::vector<std::string>& args);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of 16 UUID bytes, as nvidia-smi names a GPU
// ("(N-byte uuid)" for any other length).
std::string UuidString(const std::string& bytes);


}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_INSPECT_H_
