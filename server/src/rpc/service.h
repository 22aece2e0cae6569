// The gRPC handlers of wprep.v1.WeightPrep: admission, the wire edge (proto_translate.h),
// one call into the executor, then one exit (CallReport::Finish) that logs, records
// metrics and translates the status.
#ifndef WPREP_SERVER_SRC_SERVICE_H_
#define WPREP_SERVER_SRC_SERVICE_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

#include "exec/admission.h"
#include "device/device_manager.h"
#include "exec/executor.h"
#include "rpc/host_budget.h"
#include "net/idle_spinners.h"
#include "device/ipc_cache.h"
#include "net/metrics.h"
#include "rpc/vmm_import.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::server {

class CallReport;

// What one request may use.
struct RequestLimits {
  int64_t max_message_bytes = 64ll << 20;  // a unary request, and an inline output
  uint64_t max_tensor_bytes = 64ull << 30;  // the input and the output of one conversion
  uint64_t max_batch_items = 4096;           // items of one ConvertBatch
};

// An error message as it goes on the wire and into the log: at most kMaxErrorBytes (a
// message that echoes a huge request would overflow gRPC's trailer limit, and turn one
// bad request into megabytes of log).
inline constexpr size_t kMaxErrorBytes = 1024;
absl::Status BoundMessage(const absl::Status& status);

// Runs a handler's body. An exception that escapes it (a bug, or host memory running out)
// becomes INTERNAL or RESOURCE_EXHAUSTED with a log line naming `request_id`, and so is
// counted like any other outcome, rather than ending as gRPC's bare UNKNOWN.
absl::Status RunGuarded(absl::FunctionRef<absl::Status()> body, uint64_t request_id);

class WeightPrepService final : public wprep::v1::WeightPrep::Service {
 public:
  // Borrows everything; all must outlive the service. Calls whose x-wprep-warmup
  // metadata equals `warmup_token` (the daemon's own warm-up; see rpc_warmup.h) are
  // served but not counted anywhere; an empty token disables that. Every call touches
  // `spinners` (may be null) when it starts and ends (--keep-cpus-awake).
  WeightPrepService(Admission* admission, DeviceManager* devices, IpcCache* ipc,
                    Executor* executor, Metrics* metrics, HostBudget* buffers,
                    const RequestLimits& limits, std::string warmup_token,
                    IdleSpinners* spinners = nullptr);

  grpc::Status Plan(grpc::ServerContext* ctx, const wprep::v1::PlanRequest* req,
                    wprep::v1::PlanResponse* resp) override;
  grpc::Status Convert(grpc::ServerContext* ctx, const wprep::v1::ConvertRequest* req,
                       wprep::v1::ConvertResponse* resp) override;
  grpc::Status ConvertStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<wprep::v1::ConvertStreamResponse, wprep::v1::ConvertStreamRequest>* stream)
      override;
  grpc::Status ConvertBatch(grpc::ServerContext* ctx, const wprep::v1::ConvertBatchRequest* req,
                            wprep::v1::ConvertBatchResponse* resp) override;
  // One batch at a time, in order: each gets its own admission ticket, CallReport (metrics
  // and log line under method ConvertBatches) and answer; only UNAVAILABLE from admission
  // (warming up, draining) or a failed write ends the stream.
  grpc::Status ConvertBatches(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<wprep::v1::ConvertBatchesResponse, wprep::v1::ConvertBatchRequest>* stream) override;
  grpc::Status ListDevices(grpc::ServerContext* ctx, const wprep::v1::ListDevicesRequest* req,
                           wprep::v1::ListDevicesResponse* resp) override;
  grpc::Status RegisterIpcHandles(grpc::ServerContext* ctx,
                                  const wprep::v1::RegisterIpcHandlesRequest* req,
                                  wprep::v1::RegisterIpcHandlesResponse* resp) override;
  grpc::Status ReleaseIpcHandles(grpc::ServerContext* ctx,
                                 const wprep::v1::ReleaseIpcHandlesRequest* req,
                                 wprep::v1::ReleaseIpcHandlesResponse* resp) override;

 private:
  absl::Status DoConvert(grpc::ServerContext* ctx, const wprep::v1::ConvertRequest& req,
                         wprep::v1::ConvertResponse* resp, CallReport& report);
  absl::Status DoConvertStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<wprep::v1::ConvertStreamResponse, wprep::v1::ConvertStreamRequest>* stream,
      CallReport& report);
  // `ticket` moves into work answered once queued (ANSWER_WHEN_QUEUED), so that a
  // drain waits for that work. The host memory charged for inline data is held until the
  // call ends, or, with `inline_charge`, moved there (a stream's batch frees it once its
  // answer is written).
  // `stream_id`: the ConvertBatches stream's (0 for ConvertBatch), whose wait words the
  // daemon writes if that stream ends cancelled.
  absl::Status DoConvertBatch(grpc::ServerContext* ctx, const wprep::v1::ConvertBatchRequest& req,
                              wprep::v1::ConvertBatchResponse* resp, CallReport& report, Admission::Ticket& ticket,
                              HostBudget::Charge* inline_charge = nullptr, uint64_t stream_id = 0);
  // DoConvertBatch's batch of MoE items (moe_item.h): inline bytes on the CPU engine, IPC
  // memory on its GPU.
  absl::Status DoMoeBatch(grpc::ServerContext* ctx, const wprep::v1::ConvertBatchRequest& req,
                          wprep::v1::ConvertBatchResponse* resp, CallReport& report,
                          HostBudget::Charge* inline_charge);
  // DoConvertBatch's batch of quantize items (quantize_item.h), the same way.
  absl::Status DoQuantizeBatch(grpc::ServerContext* ctx, const wprep::v1::ConvertBatchRequest& req,
                               wprep::v1::ConvertBatchResponse* resp, CallReport& report,
                               HostBudget::Charge* inline_charge);
  // Takes `bytes` of the host budget for a batch's inline data, held by `inline_charge`
  // (ConvertBatches) or until the call ends.
  absl::Status TakeInline(grpc::ServerContext* ctx, uint64_t bytes, HostBudget::Charge* inline_charge);
  // The daemon ordinal of the GPU an IpcHandleRef names, after checking its fields.
  absl::StatusOr<int> HandleOrdinal(const wprep::v1::IpcHandleRef& h, const std::string& field);

  // Constant after construction.
  Admission* const admission_;
  DeviceManager* const devices_;
  IpcCache* const ipc_;
  VmmImporter vmm_;  // CUDA virtual-memory buffers, resolved into ipc_'s handles
  Executor* const executor_;
  Metrics* const metrics_;
  HostBudget* const buffers_;
  const RequestLimits limits_;
  const std::string warmup_token_;
  IdleSpinners* const spinners_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_SERVICE_H_
