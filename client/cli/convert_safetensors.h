// `wprep convert-safetensors IN OUT`: a gpt-oss-style MXFP4 checkpoint (one safetensors
// file, or a sharded one with its model.safetensors.index.json) converted by a running
// wprepd into a GPU layout, or the chosen BF16/F16/F32 tensors of a checkpoint quantized
// into gpt-oss MXFP4 pairs in this process (--quantize); every other tensor copied byte
// for byte.
#ifndef WPREP_CLIENT_CLI_CONVERT_SAFETENSORS_H_
#define WPREP_CLIENT_CLI_CONVERT_SAFETENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "progress.h"
#include "wprep/kernels/quantize.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

struct ConvertSafetensorsArgs {
  std::string input;   // a .safetensors file, an index .json, or a folder holding one index
  std::string output;  // the output file (single input) or folder (sharded input)
  std::string target = "unix:///tmp/wprepd.sock";
  bool convert = true;    // --layout given: the MXFP4 pairs are converted through the daemon
  ConversionSpec values;  // the value layout and its parameters (swizzle, packing -2)
  ConversionSpec scales;  // the scale layout and its parameters (swizzle, transposed view)
  // --quantize: fnmatch(3) patterns of the BF16/F16/F32 tensors quantized, on the CPU in
  // this process, into gpt-oss MXFP4 pairs NAME_blocks U8 [..., Q/32, 16] and NAME_scales
  // U8 [..., Q/32] (groups of 32 along the last axis, e8m0 scales rounded `scale_rounding`).
  std::vector<std::string> quantize;
  ScaleRounding scale_rounding = ScaleRounding::kUp;
  int device = -1;  // --device: -1 the CPU, else the CUDA device that quantizes (and converts)
  // --device with --layout: the conversions run in this process on `device`, not in a daemon.
  bool local = false;
  bool verify = false;    // unswizzle every output back and compare with the input
  bool fsync = false;     // fsync the outputs before renaming them into place
  int jobs = 4;           // requests in flight
  ProgressMode progress = ProgressMode::kLines;
  // How the work is cut (see the .cc): a value piece of at least `stream_min_bytes`
  // travels as its own ConvertStream of at most `piece_bytes` (whole experts); smaller
  // pieces, and every scale piece, go in ConvertBatch calls of at most `batch_bytes`
  // inline input plus output.
  uint64_t piece_bytes = 64ull << 20;
  uint64_t stream_min_bytes = 1ull << 20;
  uint64_t batch_bytes = 16ull << 20;
};

// Parses the arguments after `convert-safetensors`; InvalidArgument naming the flag.
absl::StatusOr<ConvertSafetensorsArgs> ParseConvertSafetensorsArgs(const std::vector<std::string>& args);

struct ConvertSafetensorsSummary {
  int files = 0;
  int converted = 0;  // value and scale tensors
  int quantized = 0;  // tensors quantized, each into a NAME_blocks and NAME_scales pair
  int copied = 0;     // every other tensor
  uint64_t input_bytes = 0, output_bytes = 0;
  double seconds = 0;
};

// Converts args.input into args.output. Writes every output under a temporary name and
// renames it into place only when all of it is written (and verified, with --verify):
// on any error nothing is left at args.output. Errors are one line with the gRPC or
// local status code.
absl::StatusOr<ConvertSafetensorsSummary> RunConvertSafetensors(const ConvertSafetensorsArgs& args);

// "converted 48 tensors (...), copied 13, ... in 3.2 s (340.1 MB/s) -> OUT"
std::string FormatSummary(const ConvertSafetensorsArgs& args, const ConvertSafetensorsSummary& s);

// The subcommand: parses, runs, prints the summary (stdout) or one error line (stderr).
// Exit status 0 done, 2 bad usage or an error.
int ConvertSafetensorsCommand(const std::vector<std::string>& args);

std::string ConvertSafetensorsUsage();

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_CONVERT_SAFETENSORS_H_
