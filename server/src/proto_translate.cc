#include "proto_translate.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

// An IPC buffer's region, after checking its handle and GPU fields.
absl::StatusOr<IpcRegion> IpcFromProto(const v1::CudaIpcBuffer& b, absl::string_view field) {
  if (b.handle().size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".handle must be the 64 bytes of a "
                                                   "cudaIpcMemHandle_t, got ",
                                                   b.handle().size(), " bytes"));
  }
  IpcRegion r;
  WPREP_ASSIGN_OR_RETURN(r.gpu, UuidFromWire(b.device_uuid(), absl::StrCat(field, ".device_uuid")));
  r.handle = b.handle();
  r.offset = b.offset();
  r.size = b.size();
  return r;
}

absl::StatusOr<std::optional<Uuid>> OptionalUuid(absl::string_view bytes, absl::string_view field) {
  if (bytes.empty()) return std::optional<Uuid>();
  WPREP_ASSIGN_OR_RETURN(Uuid u, UuidFromWire(bytes, field));
  return std::optional<Uuid>(u);
}

}  // namespace

absl::StatusOr<Uuid> UuidFromWire(absl::string_view bytes, absl::string_view field) {
  if (bytes.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be the 16 bytes of cudaDeviceProp.uuid, got ", bytes.size(), " bytes"));
  }
  Uuid u{};
  std::memcpy(u.data(), bytes.data(), 16);
  return u;
}

absl::StatusOr<Plan> PlanFromProto(const v1::PlanRequest& req, const ConversionSpec& spec) {
  InputBinding binding;
  binding.strides.assign(req.input_strides().begin(), req.input_strides().end());
  if (req.has_input_buffer_bytes()) binding.buffer_bytes = req.input_buffer_bytes();
  return MakePlan(spec, ShapeFromProto(req.logical_shape()), binding);
}

void PlanToProto(const Plan& plan, v1::PlanResponse* out) {
  for (int64_t d : plan.input_shape) out->add_input_shape(d);
  for (int64_t d : plan.input_strides) out->add_input_strides(d);
  out->set_input_bytes(plan.input_bytes);
  for (int64_t d : plan.output_shape) out->add_output_shape(d);
  for (int64_t d : plan.output_strides) out->add_output_strides(d);
  out->set_output_bytes(plan.output_bytes);
  out->set_description(Describe(plan.spec));
}

absl::StatusOr<ConvertJob> ConvertJobFromProto(const v1::ConvertRequest& req, const ConversionSpec& spec,
                                               int64_t max_message_bytes) {
  // The transport's own limit may be higher (streams need 4 MiB chunks): enforce ours.
  const uint64_t max_bytes = static_cast<uint64_t>(max_message_bytes);
  if (const uint64_t n = req.ByteSizeLong(); n > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Convert request of ", n, " bytes exceeds --max-message-bytes=", max_message_bytes,
        "; send large tensors with ConvertStream or as CUDA IPC buffers"));
  }
  if (req.source_case() == v1::ConvertRequest::SOURCE_NOT_SET) {
    return absl::InvalidArgumentError("source is not set: give source_bytes or source_ipc");
  }
  ConvertJob job;
  InputBinding binding;
  if (req.has_source_ipc()) {
    WPREP_ASSIGN_OR_RETURN(job.source_ipc, IpcFromProto(req.source_ipc(), "source_ipc"));
    binding.strides.assign(req.source_ipc().strides().begin(), req.source_ipc().strides().end());
    binding.buffer_bytes = job.source_ipc->size;
  } else {
    job.source_bytes = req.source_bytes();
    binding.buffer_bytes = job.source_bytes.size();
  }
  if (req.has_destination_ipc()) {
    WPREP_ASSIGN_OR_RETURN(job.destination_ipc, IpcFromProto(req.destination_ipc(), "destination_ipc"));
  }
  WPREP_ASSIGN_OR_RETURN(job.gpu, OptionalUuid(req.device_uuid(), "device_uuid"));
  WPREP_ASSIGN_OR_RETURN(job.plan, MakePlan(spec, ShapeFromProto(req.logical_shape()), binding));
  const Plan& plan = job.plan;
  if (!job.destination_ipc) {
    // Refuse before converting when the answer could not be sent.
    if (plan.output_bytes > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the output has ", plan.output_bytes, " bytes, more than --max-message-bytes=",
          max_message_bytes, " allows inline; use ConvertStream or destination_ipc"));
    }
  } else {
    if (req.destination_ipc().strides_size() != 0) {
      return absl::InvalidArgumentError(
          "destination_ipc.strides must be empty: outputs are always written densely");
    }
    if (job.destination_ipc->size < plan.output_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("destination_ipc.size is ", job.destination_ipc->size,
                                                     " bytes but the output needs ", plan.output_bytes,
                                                     " (see Plan)"));
    }
  }
  return job;
}

void OutcomeToProto(const ConvertJob& job, const ConvertOutcome& outcome, v1::ConvertResponse* resp) {
  for (int64_t d : job.plan.output_shape) resp->add_output_shape(d);
  for (int64_t d : job.plan.output_strides) resp->add_output_strides(d);
  resp->set_output_bytes(job.plan.output_bytes);
  resp->set_engine(outcome.engine);
  resp->set_peak_extra_device_bytes(outcome.peak_extra_device_bytes);
}

absl::StatusOr<StreamStart> StreamStartFromProto(const v1::StreamRequestHeader& h,
                                                 const ConversionSpec& spec) {
  StreamStart start;
  WPREP_ASSIGN_OR_RETURN(start.gpu, OptionalUuid(h.device_uuid(), "header.device_uuid"));
  WPREP_ASSIGN_OR_RETURN(start.plan, MakePlan(spec, ShapeFromProto(h.logical_shape())));
  return start;
}

absl::Status CheckTensorBytes(const Plan& plan, uint64_t max_tensor_bytes) {
  const uint64_t larger = std::max(plan.input_bytes, plan.output_bytes);
  if (larger <= max_tensor_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "this conversion's ", plan.output_bytes >= plan.input_bytes ? "output" : "input", " has ", larger,
      " bytes, more than --max-tensor-bytes=", max_tensor_bytes, " allows; split the tensor along its leading dims"));
}

absl::Status NameOperandField(const absl::Status& status, const OperandFields& fields) {
  std::optional<OperandPath> path = OperandPathOf(status);
  if (!path) return status;
  const std::string& base = path->operand == Operand::kSource        ? fields.source
                            : path->operand == Operand::kDestination ? fields.destination
                                                                     : fields.device;
  std::string field = path->item >= 0 ? absl::StrCat("items[", path->item, "].", base) : base;
  if (!path->part.empty()) absl::StrAppend(&field, field.empty() ? "" : ".", path->part);
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

}  // namespace wprep::server
