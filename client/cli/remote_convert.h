// `wprep convert --target ADDR`: the same conversion, done by a running wprepd.
#ifndef WPREP_CLIENT_CLI_REMOTE_CONVERT_H_
#define WPREP_CLIENT_CLI_REMOTE_CONVERT_H_

#include "absl/status/statusor.h"
#include "convert_args.h"
#include "local_convert.h"

namespace wprep::cli {

// Reads args.input, streams it to the daemon at args.target (ConvertStream, so any size
// works), writes the returned bytes to args.output. Errors carry the daemon's gRPC code
// and message; the output file is not created on error. --device and --threads are the
// daemon's choice in this mode and are ignored.
absl::StatusOr<ConvertResult> RunRemoteConvert(const ConvertArgs& args);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_REMOTE_CONVERT_H_
