// The daemon's wire edge: wprep.v1 requests -> planned kernel-level jobs, with every wire
// field checked here (InvalidArgument naming the field), and the answers back. Nothing
// below the edge sees a protobuf type or a field name.
#ifndef WPREP_SERVER_SRC_PROTO_TRANSLATE_H_
#define WPREP_SERVER_SRC_PROTO_TRANSLATE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "device/device_runtime.h"
#include "exec/job.h"
#include "exec/operand_error.h"
#include "wprep/kernels/plan.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// A 16-byte protobuf field -> Uuid; InvalidArgument naming `field` otherwise.
absl::StatusOr<Uuid> UuidFromWire(absl::string_view bytes, absl::string_view field);

// Each request's `spec` is its spec field, translated by SpecFromProto.

// PlanRequest -> its plan.
absl::StatusOr<Plan> PlanFromProto(const wprep::v1::PlanRequest& req, const ConversionSpec& spec);
void PlanToProto(const Plan& plan, wprep::v1::PlanResponse* out);

// ConvertRequest -> its job, planned with the source's binding. `max_message_bytes`
// bounds the request and an inline output.
absl::StatusOr<ConvertJob> ConvertJobFromProto(const wprep::v1::ConvertRequest& req,
                                               const ConversionSpec& spec, int64_t max_message_bytes);
void OutcomeToProto(const ConvertJob& job, const ConvertOutcome& outcome,
                    wprep::v1::ConvertResponse* resp);

// ConvertBatchRequest -> one job per item, every field of every item checked and every
// item planned (errors name items[i]....), with the batch's GPU in each job.
struct BatchLimits {
  int64_t max_message_bytes = 64ll << 20;  // the request, and all inline outputs together
  uint64_t max_items = 4096;
};
absl::StatusOr<std::vector<ConvertJob>> BatchJobsFromProto(const wprep::v1::ConvertBatchRequest& req,
                                                           const BatchLimits& limits);
// ConvertBatchRequest's fences (wait_for, signal_when_done, answer_when) into `fences`,
// every rule checked here: a signal only with ANSWER_WHEN_QUEUED and the reverse, at most
// one event and one word to signal, every item IPC -> IPC for a queued answer. Errors are
// INVALID_ARGUMENT with a field violation (WithFieldViolation) naming the field.
absl::Status FencesFromProto(const wprep::v1::ConvertBatchRequest& req, const std::vector<ConvertJob>& jobs,
                             BatchFences* fences);
// An OperandError about a fence (client_fence.h) rendered with its field
// ("signal_when_done[1].word.buffer: ..."); any other status as it is.
absl::Status NameFenceField(const absl::Status& status, const wprep::v1::ConvertBatchRequest& req);
// Fills `item` (whose one output was added, its inline bytes already set) from the job.
void BatchItemToProto(const ConvertJob& job, const ConvertOutcome& outcome, wprep::v1::BatchItemResult* item);

// StreamRequestHeader -> the stream's plan (dense input) and requested GPU.
struct StreamStart {
  Plan plan;
  std::optional<Uuid> gpu;
};
absl::StatusOr<StreamStart> StreamStartFromProto(const wprep::v1::StreamRequestHeader& header,
                                                 const ConversionSpec& spec);

// RESOURCE_EXHAUSTED when the plan's input or output exceeds `max_tensor_bytes`
// (--max-tensor-bytes), whatever the transport.
absl::Status CheckTensorBytes(const Plan& plan, uint64_t max_tensor_bytes);

// The wire fields of a method's operands, to name them in errors.
struct OperandFields {
  std::string source;
  std::string destination;
  std::string device;
};
// An OperandError rendered with the field it is about ("source_ipc.device_uuid: ...");
// any other status as it is.
absl::Status NameOperandField(const absl::Status& status, const OperandFields& fields);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_PROTO_TRANSLATE_H_
