// `wprep quantize`: bf16/fp16/fp32 weights to MXFP4 values + e8m0 scales (issue 28).
#ifndef WPREP_CLIENT_CLI_QUANTIZE_H_
#define WPREP_CLIENT_CLI_QUANTIZE_H_

#include <string>
#include <vector>

namespace wprep::cli {

// Runs the command; returns the process exit status (0, or 2 with one
// "<STATUS_CODE>: message" line on stderr and no output files).
int QuantizeCommand(const std::vector<std::string>& args);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_QUANTIZE_H_
