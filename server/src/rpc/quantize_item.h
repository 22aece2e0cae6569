// The quantize batch item (ConvertBatchRequest.items[i].quantize: quantize_mxfp4, canonical
// or fused to the Blackwell or Hopper layouts) at the daemon's wire edge: the item checked and planned
// (MakeQuantizePlan) before any work, errors naming the field (items[2].quantize.shape: ...),
// then run: inline bytes on the CPU engine, CUDA IPC operands on the GPU that owns them (in
// place, no device memory of the daemon's).
#ifndef WPREP_SERVER_SRC_QUANTIZE_ITEM_H_
#define WPREP_SERVER_SRC_QUANTIZE_ITEM_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "exec/executor.h"
#include "rpc/moe_item.h"
#include "wprep/kernels/quantize.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// One quantize item, planned. `input` views the request, which must outlive the job.
struct QuantizeJob {
  QuantizePlan plan;
  QuantLayoutSpec layout;               // canonical, or a fused pair
  uint64_t values_bytes = 0, scales_bytes = 0;
  std::vector<int64_t> values_shape, scales_shape;      // as reported
  std::vector<int64_t> values_strides, scales_strides;  // elements (bytes: uint8 outputs)
  std::optional<MoePlan> moe_plan;      // trtllm layouts: the prepare the outputs equal
  absl::string_view input;              // inline bytes
  IpcRegion input_ipc, values_ipc, scales_ipc;
  bool ipc = false;
  // The trtllm layouts' optional bias: [E, R] in (bias_in_bytes), [E, rows] float32 out.
  bool bias = false, bias_bf16 = false;
  uint64_t bias_in_bytes = 0, bias_out_bytes = 0;
  std::vector<int64_t> bias_shape;
  absl::string_view bias_input;
  IpcRegion bias_ipc, bias_out_ipc;
};

// Whether any item of `req` is a quantize item (the batch is then served by
// QuantizeJobsFromProto and RunQuantizeJobs alone).
bool HasQuantizeItems(const wprep::v1::ConvertBatchRequest& req);

// Every item, checked and planned: INVALID_ARGUMENT naming the field for a malformed one
// (and for an item of another kind in the batch), RESOURCE_EXHAUSTED past a limit. Nothing runs.
absl::StatusOr<std::vector<QuantizeJob>> QuantizeJobsFromProto(const wprep::v1::ConvertBatchRequest& req,
                                                               const MoeLimits& limits);

// Runs every job, appending one BatchItemResult per job ("values", then "scales"). Every IPC
// job's GPU is found and its regions mapped and range-checked before any job runs. IPC jobs
// on one GPU are queued on its streams together and waited for once.
absl::Status RunQuantizeJobs(const std::vector<QuantizeJob>& jobs, const MoeEngines& engines, absl::Time deadline,
                             wprep::v1::ConvertBatchResponse* resp);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_QUANTIZE_ITEM_H_
