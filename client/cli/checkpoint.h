// The MXFP4 tensors of a gpt-oss-style checkpoint: NAME_blocks / NAME_scales pairs,
// found, checked and turned into the conversions wprepd runs.
#ifndef WPREP_CLIENT_CLI_CHECKPOINT_H_
#define WPREP_CLIENT_CLI_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "safetensors.h"
#include "wprep/client/batch.h"
#include "wprep/spec/spec.h"

namespace wprep::cli {

struct Mxfp4Tensor {
  size_t index = 0;    // in the list FindMxfp4Tensors was given
  bool values = true;  // NAME_blocks (values) or NAME_scales
  client::TensorConversion conversion;  // the whole tensor's
  int64_t experts = 0;  // matrices: the product of the leading dims of the logical shape
};

// Every tensor of `tensors` (a checkpoint's, from all its shards) named NAME_blocks or
// NAME_scales, in the given order, with its conversion to `values` or `scales`
// (client::CheckpointValues / CheckpointScales). InvalidArgument, naming the tensors,
// for "unsupported dtype" (blocks U8; scales U8 or F8_E8M0) and for "shape mismatch"
// (a NAME_blocks without its NAME_scales or the other way round, or shapes that are not
// [..., N, K/32, 16] and [..., N, K/32]).
absl::StatusOr<std::vector<Mxfp4Tensor>> FindMxfp4Tensors(absl::Span<const SafetensorsTensor* const> tensors,
                                                          const ConversionSpec& values,
                                                          const ConversionSpec& scales);

}  // namespace wprep::cli

#endif  // WPREP_CLIENT_CLI_CHECKPOINT_H_
