// The MoE batch item (ConvertBatchRequest.items[i].moe: trtllm-gen MoE weight
// preparation) at the daemon's wire edge: every operand checked and the op planned
// (PlanMoe) before any work, errors naming the operand (items[3].moe.scales: ...), then
// run: inline bytes on the CPU engine, CUDA IPC operands on the GPU that owns them
// (RunMoeCuda in place, no device memory of the daemon's). Apart from proto_translate.cc and executor.cc because a MoE item
// has up to three inputs and outputs where a convert item has one of each.
#ifndef WPREP_SERVER_SRC_MOE_ITEM_H_
#define WPREP_SERVER_SRC_MOE_ITEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "device/device_manager.h"
#include "exec/executor.h"
#include "device/ipc_cache.h"
#include "wprep/kernels/moe.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// One MoE item, planned. Views into the request, which must outlive it. Either every
// operand is inline (inputs set, outputs returned inline) or every operand is CUDA IPC
// memory of one GPU (input_ipc and output_ipc set).
struct MoeJob {
  MoePlan plan;
  std::vector<absl::string_view> inputs;  // inline bytes, one per plan input, in plan order
  std::vector<IpcRegion> input_ipc, output_ipc;  // IPC: one per plan input / output, plan order
  bool ipc() const { return !input_ipc.empty(); }
  uint64_t input_bytes = 0, output_bytes = 0;  // all inputs, all outputs
};

// A CUDA IPC buffer of a dense operand (MoE and quantize items): its handle and GPU, no
// strides, at least `bytes` long. Errors name `field`.
absl::StatusOr<IpcRegion> DenseRegionFromProto(const wprep::v1::CudaIpcBuffer& b, uint64_t bytes,
                                               const std::string& field);

// The identity every output of `plan` reports (MoE items, and the quantize items whose
// outputs equal a prepare).
wprep::v1::MoeIdentity MoeIdentityOf(const MoePlan& plan);

// Whether [a.offset, +a_bytes) and [b.offset, +b_bytes) of one allocation (same handle) meet.
bool IpcRegionsOverlap(const IpcRegion& a, uint64_t a_bytes, const IpcRegion& b, uint64_t b_bytes);

// Whether any item of `req` is a MoE item (the batch is then served by MoeJobsFromProto and
// RunMoeJobs alone).
bool HasMoeItems(const wprep::v1::ConvertBatchRequest& req);

struct MoeLimits {
  uint64_t max_message_bytes = 64ull << 20;  // all inline outputs together
  uint64_t max_tensor_bytes = 64ull << 30;   // each input and output
  uint64_t max_items = 4096;
};

// The limits every batch of MoE or quantize items is held to before any item is read:
// RESOURCE_EXHAUSTED past --max-batch-items or --max-message-bytes.
absl::Status CheckBatchSize(const wprep::v1::ConvertBatchRequest& req, const MoeLimits& limits);

// Every item of a batch of MoE items, checked and planned: INVALID_ARGUMENT naming the
// field (items[i].moe.inputs[1].dtype, items[i].moe.scales, ...) for a malformed one,
// RESOURCE_EXHAUSTED past a limit, UNIMPLEMENTED for what this daemon does not serve yet
// (completion or ready events on MoE batches). Nothing runs.
absl::StatusOr<std::vector<MoeJob>> MoeJobsFromProto(const wprep::v1::ConvertBatchRequest& req,
                                                     const MoeLimits& limits);

// Where MoE jobs run: inline ones on the CPU engine with `cpu_threads` (0: all), IPC ones on
// the GPU owning their memory.
struct MoeEngines {
  int cpu_threads = 0;
  DeviceManager* devices = nullptr;
  IpcCache* ipc = nullptr;
};

// Runs every job, appending one BatchItemResult per job to `resp`, its outputs in the plan's
// output order (inline, or written to the IPC destinations). Every IPC job's GPU is found and
// every region mapped and range-checked before any job runs, so a bad one (INVALID_ARGUMENT
// naming items[i].moe.<operand>) writes nothing.
absl::Status RunMoeJobs(const std::vector<MoeJob>& jobs, const MoeEngines& engines, absl::Time deadline,
                        wprep::v1::ConvertBatchResponse* resp);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_MOE_ITEM_H_
