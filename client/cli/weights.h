// `wprep weights load|list|show|drop`: a running wprepd's resident weight sets
// (wprep.v1.WeightSets).
#ifndef WPREP_CLIENT_CLI_WEIGHTS_H_
#define WPREP_CLIENT_CLI_WEIGHTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::cli {

// "PATTERN=LAYOUT[:param=value...];PATTERN=verbatim;..." -> rules, in order. Params are
// the conversion flags without their dashes, '-' or '_' alike (mx_axis=-2,
// packing_axis=-2, num_warps=8, block_k=..., ...). InvalidArgument naming the rule.
absl::StatusOr<std::vector<wprep::v1::WeightRule>> ParseWeightRules(const std::string& text);

// The arguments after `weights`; exit status 0, or 2 with one line on stderr.
int WeightsCommand(const std::vector<std::string>& args);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_WEIGHTS_H_
