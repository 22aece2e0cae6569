#include "rpc/proto_translate.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "device/host_words.h"
#include "rpc/status.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

// An IPC buffer's region, after checking its handle and GPU fields.
absl::StatusOr<IpcRegion> IpcFromProto(const v1::CudaIpcBuffer& b, absl::string_view field) {
  if (b.handle().size() != kIpcHandleBytes) {
    return WithFieldViolation(absl::InvalidArgumentError(absl::StrCat(field, ".handle must be the 64 bytes of a "
                                                                      "cudaIpcMemHandle_t, got ",
                                                                      b.handle().size(), " bytes")),
                              absl::StrCat(field, ".handle"));
  }
  IpcRegion r;
  WPREP_ASSIGN_OR_RETURN(r.gpu, UuidFromWire(b.device_uuid(), absl::StrCat(field, ".device_uuid")));
  r.handle = b.handle();
  r.offset = b.offset();
  r.size = b.size();
  return r;
}

// Bound on the other dims of an empty tensor (one with a zero dim): see CheckEmptyShape.
constexpr uint64_t kMaxEmptyExtent = uint64_t{1} << 36;

// A shape with a zero dim plans an empty tensor, so the planner's size checks pass
// whatever its other dims; but it still multiplies those dims (zeros counted as ones)
// into the storage's dense strides, which overflow int64 past 2^63 (found by
// wprep_fuzz_request). Refused here when they multiply past 2^36: layout padding grows
// that by at most 2^24, far from an overflow, and no empty tensor needs more.
absl::Status CheckEmptyShape(const google::protobuf::RepeatedField<int64_t>& shape, absl::string_view field) {
  if (std::find(shape.begin(), shape.end(), 0) == shape.end()) return absl::OkStatus();
  uint64_t extent = 1;
  for (int64_t d : shape) {
    if (d <= 0) continue;  // zeros are the point; negative dims the planner refuses
    if (__builtin_mul_overflow(extent, static_cast<uint64_t>(d), &extent) || extent > kMaxEmptyExtent) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has a dim of size 0 and other dims that multiply past 2^36; give an empty tensor "
                 "dims of ordinary sizes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Uuid>> OptionalUuid(absl::string_view bytes, absl::string_view field) {
  if (bytes.empty()) return std::optional<Uuid>();
  WPREP_ASSIGN_OR_RETURN(Uuid u, UuidFromWire(bytes, field));
  return std::optional<Uuid>(u);
}

}  // namespace

absl::StatusOr<Uuid> UuidFromWire(absl::string_view bytes, absl::string_view field) {
  if (bytes.size() != 16) {
    return WithFieldViolation(absl::InvalidArgumentError(absl::StrCat(
                                  field, " must be the 16 bytes of cudaDeviceProp.uuid, got ", bytes.size(), " bytes")),
                              field);
  }
  Uuid u{};
  std::memcpy(u.data(), bytes.data(), 16);
  return u;
}

absl::StatusOr<Plan> PlanFromProto(const v1::PlanRequest& req, const ConversionSpec& spec) {
  InputBinding binding;
  binding.strides.assign(req.input_strides().begin(), req.input_strides().end());
  if (req.has_input_buffer_bytes()) binding.buffer_bytes = req.input_buffer_bytes();
  WPREP_RETURN_IF_ERROR(CheckEmptyShape(req.logical_shape(), "logical_shape"));
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
  *out->mutable_identity() = IdentityToProto(plan.spec);
}

namespace {

// The parts of a conversion on the wire, and the field names its errors use.
struct JobWire {
  const v1::ConversionSpec* spec_proto = nullptr;
  const google::protobuf::RepeatedField<int64_t>* shape = nullptr;
  const std::string* source_bytes = nullptr;  // when inline
  const google::protobuf::RepeatedField<int64_t>* source_strides = nullptr;  // of the inline source
  const v1::CudaIpcBuffer* source_ipc = nullptr;
  const v1::CudaIpcBuffer* destination_ipc = nullptr;
  std::string prefix;  // "" or "items[3].convert." before every field name below
  std::string source_bytes_field, source_strides_field, source_ipc_field, destination_ipc_field;
};

// One job from its wire parts: IPC fields checked, planned with the source's binding,
// and the destination checked against the plan. `max_inline_output` bounds an inline
// output (the answer must fit one message).
absl::StatusOr<ConvertJob> JobFromWire(const JobWire& w, const ConversionSpec& spec, uint64_t max_inline_output) {
  ConvertJob job;
  InputBinding binding;
  const std::string src_ipc = w.prefix + w.source_ipc_field, dst_ipc = w.prefix + w.destination_ipc_field;
  if (w.source_ipc != nullptr) {
    WPREP_ASSIGN_OR_RETURN(job.source_ipc, IpcFromProto(*w.source_ipc, src_ipc));
    binding.strides.assign(w.source_ipc->strides().begin(), w.source_ipc->strides().end());
    binding.buffer_bytes = job.source_ipc->size;
    if (w.source_strides != nullptr && !w.source_strides->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(w.prefix, w.source_strides_field, " apply to ", w.prefix,
                                                     w.source_bytes_field, "; give IPC strides in ", src_ipc,
                                                     ".strides"));
    }
  } else {
    job.source_bytes = *w.source_bytes;
    binding.buffer_bytes = job.source_bytes.size();
    if (w.source_strides != nullptr) binding.strides.assign(w.source_strides->begin(), w.source_strides->end());
  }
  if (w.destination_ipc != nullptr) {
    WPREP_ASSIGN_OR_RETURN(job.destination_ipc, IpcFromProto(*w.destination_ipc, dst_ipc));
  }
  WPREP_RETURN_IF_ERROR(CheckEmptyShape(*w.shape, w.prefix + "logical_shape"));
  absl::StatusOr<Plan> plan = MakePlan(spec, ShapeFromProto(*w.shape), binding);
  if (!plan.ok()) {
    if (w.prefix.empty()) return plan.status();
    return absl::Status(plan.status().code(), absl::StrCat(w.prefix.substr(0, w.prefix.size() - 1), ": ",
                                                           plan.status().message()));
  }
  job.plan = *std::move(plan);
  if (w.destination_ipc == nullptr) {
    // Refuse before converting when the answer could not be sent.
    if (job.plan.output_bytes > max_inline_output) {
      return absl::ResourceExhaustedError(absl::StrCat(
          w.prefix, "the output has ", job.plan.output_bytes, " bytes, more than ", max_inline_output,
          " allowed inline (--max-message-bytes); give ", dst_ipc, " (CUDA IPC), or use ConvertStream"));
    }
  } else {
    if (w.destination_ipc->strides_size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(dst_ipc, ".strides must be empty: outputs are always written densely"));
    }
    if (job.destination_ipc->size < job.plan.output_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(dst_ipc, ".size is ", job.destination_ipc->size,
                                                     " bytes but the output needs ", job.plan.output_bytes,
                                                     " (see Plan)"));
    }
  }
  return job;
}

}  // namespace

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
  JobWire w;
  w.spec_proto = &req.spec();
  w.shape = &req.logical_shape();
  w.source_bytes = &req.source_bytes();
  w.source_strides = &req.source_strides();
  w.source_ipc = req.has_source_ipc() ? &req.source_ipc() : nullptr;
  w.destination_ipc = req.has_destination_ipc() ? &req.destination_ipc() : nullptr;
  w.source_bytes_field = "source_bytes";
  w.source_strides_field = "source_strides";
  w.source_ipc_field = "source_ipc";
  w.destination_ipc_field = "destination_ipc";
  WPREP_ASSIGN_OR_RETURN(std::optional<Uuid> gpu, OptionalUuid(req.device_uuid(), "device_uuid"));
  WPREP_ASSIGN_OR_RETURN(ConvertJob job, JobFromWire(w, spec, max_bytes));
  job.gpu = gpu;
  return job;
}

absl::StatusOr<std::vector<ConvertJob>> BatchJobsFromProto(const v1::ConvertBatchRequest& req,
                                                           const BatchLimits& limits) {
  if (req.items_size() == 0) return absl::InvalidArgumentError("items is empty: give at least one item");
  if (static_cast<uint64_t>(req.items_size()) > limits.max_items) {
    return absl::ResourceExhaustedError(absl::StrCat("the batch has ", req.items_size(), " items, more than --max-batch-items=",
                                                     limits.max_items, "; split it into several batches"));
  }
  const uint64_t max_bytes = static_cast<uint64_t>(limits.max_message_bytes);
  if (const uint64_t n = req.ByteSizeLong(); n > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("ConvertBatch request of ", n, " bytes exceeds --max-message-bytes=",
                                                     limits.max_message_bytes,
                                                     "; send large tensors as CUDA IPC buffers"));
  }
  WPREP_ASSIGN_OR_RETURN(std::optional<Uuid> gpu, OptionalUuid(req.device_uuid(), "device_uuid"));
  std::vector<ConvertJob> jobs;
  jobs.reserve(static_cast<size_t>(req.items_size()));
  uint64_t inline_out = 0;
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::BatchItem& item = req.items(i);
    const std::string prefix = absl::StrCat("items[", i, "].");
    if (item.kind_case() != v1::BatchItem::kConvert) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "kind is not set: give convert or moe"));
    }
    const v1::ConvertItem& c = item.convert();
    WPREP_ASSIGN_OR_RETURN(ConversionSpec spec, SpecFromProto(c.spec(), prefix + "convert.spec"));
    if (c.source().kind_case() == v1::TensorSource::KIND_NOT_SET) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "convert.source is not set: give inline_bytes or ipc"));
    }
    JobWire w;
    w.spec_proto = &c.spec();
    w.shape = &c.logical_shape();
    w.source_bytes = &c.source().inline_bytes();
    w.source_strides = &c.source().inline_strides();
    w.source_ipc = c.source().has_ipc() ? &c.source().ipc() : nullptr;
    w.destination_ipc = c.destination().has_ipc() ? &c.destination().ipc() : nullptr;
    w.prefix = prefix + "convert.";
    w.source_bytes_field = "source.inline_bytes";
    w.source_strides_field = "source.inline_strides";
    w.source_ipc_field = "source.ipc";
    w.destination_ipc_field = "destination.ipc";
    WPREP_ASSIGN_OR_RETURN(ConvertJob job, JobFromWire(w, spec, max_bytes));
    job.gpu = gpu;
    if (!job.destination_ipc) inline_out += job.plan.output_bytes;
    if (inline_out > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the inline outputs reach ", inline_out, " bytes at items[", i, "], more than --max-message-bytes=",
          limits.max_message_bytes, " allows in one answer; send outputs to CUDA IPC destinations or split the batch"));
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

namespace {

absl::Status BadField(absl::string_view field, absl::string_view what) {
  return WithFieldViolation(absl::InvalidArgumentError(absl::StrCat(field, what)), field);
}

// An IpcEventRef's handle (its size checked) and GPU; errors name `field`.
absl::StatusOr<FenceRef::EventRef> EventFromProto(const v1::IpcEventRef& e, const std::string& field) {
  if (e.handle().size() != kIpcEventHandleBytes) {
    return BadField(field + ".handle", absl::StrCat(" must be the ", kIpcEventHandleBytes,
                                                    " bytes of a cudaIpcEventHandle_t, got ", e.handle().size(),
                                                    " bytes"));
  }
  FenceRef::EventRef ref;
  WPREP_ASSIGN_OR_RETURN(ref.gpu, UuidFromWire(e.device_uuid(), field + ".device_uuid"));
  ref.handle = e.handle();
  return ref;
}

// A FenceWord: one of buffer (one aligned 4-byte IPC region) and host_word (a valid name,
// an aligned offset). Errors name `field`.
absl::StatusOr<FenceRef::WordRef> WordFromProto(const v1::FenceWord& w, const std::string& field) {
  FenceRef::WordRef word;
  word.value = w.value();
  if (w.has_host_word()) {
    const v1::SharedHostWord& h = w.host_word();
    const std::string f = field + ".host_word";
    if (absl::Status s = HostWords::CheckName(h.name(), f); !s.ok()) return WithFieldViolation(s, f + ".name");
    if (h.offset() % 4 != 0) {
      return BadField(f + ".offset", absl::StrCat(" must be a multiple of 4; got ", h.offset()));
    }
    word.host_file = h.name();
    word.host_offset = h.offset();
    return word;
  }
  if (!w.has_buffer()) {
    return BadField(field, " must name its word: buffer (a word of GPU memory) or host_word (a word of a file in "
                           "/dev/shm)");
  }
  const v1::CudaIpcBuffer& b = w.buffer();
  const std::string f = field + ".buffer";
  absl::StatusOr<IpcRegion> region = IpcFromProto(b, f);
  if (!region.ok()) return region.status();
  if (b.size() != 4 || b.offset() % 4 != 0 || b.strides_size() != 0) {
    return BadField(f, absl::StrCat(" must name one 4-byte aligned 32-bit word (size 4, offset a multiple of 4, no "
                                    "strides); got size ",
                                    b.size(), ", offset ", b.offset(), ", ", b.strides_size(), " strides"));
  }
  word.gpu_memory = *std::move(region);
  return word;
}

// One Fence into `out` (its event or its word, which must not be set already). Errors
// name `field`.
absl::Status FenceFromProto(const v1::Fence& f, const std::string& field, FenceRef* out) {
  switch (f.kind_case()) {
    case v1::Fence::kEvent: {
      if (out->event) return BadField(field, " is a second event: signal_when_done takes at most one");
      WPREP_ASSIGN_OR_RETURN(out->event, EventFromProto(f.event(), field + ".event"));
      return absl::OkStatus();
    }
    case v1::Fence::kWord: {
      if (out->word) return BadField(field, " is a second word: signal_when_done takes at most one");
      WPREP_ASSIGN_OR_RETURN(out->word, WordFromProto(f.word(), field + ".word"));
      return absl::OkStatus();
    }
    case v1::Fence::KIND_NOT_SET:
      break;
  }
  return BadField(field, " must name its kind: event (an interprocess CUDA event) or word (a 32-bit word)");
}

}  // namespace

absl::Status FencesFromProto(const v1::ConvertBatchRequest& req, const std::vector<ConvertJob>& jobs,
                             BatchFences* fences) {
  if (req.has_wait_for()) WPREP_RETURN_IF_ERROR(FenceFromProto(req.wait_for(), "wait_for", &fences->wait));
  for (int i = 0; i < req.signal_when_done_size(); ++i) {
    WPREP_RETURN_IF_ERROR(
        FenceFromProto(req.signal_when_done(i), absl::StrCat("signal_when_done[", i, "]"), &fences->signal));
  }
  switch (req.answer_when()) {
    case v1::ANSWER_WHEN_DONE:
      if (!fences->signal.empty()) {
        return BadField("signal_when_done", " needs answer_when = ANSWER_WHEN_QUEUED: the daemon signals after the "
                                            "work only for a batch it answers once queued");
      }
      return absl::OkStatus();
    case v1::ANSWER_WHEN_QUEUED:
      break;
    default:
      return BadField("answer_when", absl::StrCat(" is ", static_cast<int>(req.answer_when()),
                                                  ", not ANSWER_WHEN_DONE or ANSWER_WHEN_QUEUED"));
  }
  if (fences->signal.empty()) {
    return BadField("answer_when", " = ANSWER_WHEN_QUEUED needs signal_when_done: a fence the client orders its use "
                                   "of the outputs after");
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!jobs[i].source_ipc || !jobs[i].destination_ipc) {
      const std::string field =
          absl::StrCat("items[", i, "].convert.", jobs[i].source_ipc ? "destination" : "source", ".ipc");
      return BadField(field, " is required with answer_when = ANSWER_WHEN_QUEUED: an answer before the work is "
                             "done suits only outputs the client reads on the GPU; answer when done for inline "
                             "bytes");
    }
  }
  fences->queued_answer = true;
  return absl::OkStatus();
}

absl::Status NameFenceField(const absl::Status& status, const v1::ConvertBatchRequest& req) {
  std::optional<OperandPath> path = OperandPathOf(status);
  if (!path || (path->operand != Operand::kWaitFence && path->operand != Operand::kSignalFence)) return status;
  std::string field = "wait_for";
  if (path->operand == Operand::kSignalFence) {
    // The signal fence's event or word: the entry of signal_when_done that holds it.
    field = "signal_when_done";
    const bool event = absl::StartsWith(path->part, "event");
    for (int i = 0; i < req.signal_when_done_size(); ++i) {
      if (req.signal_when_done(i).has_event() == event) {
        field = absl::StrCat("signal_when_done[", i, "]");
        break;
      }
    }
  }
  if (!path->part.empty()) absl::StrAppend(&field, ".", path->part);
  absl::Status named(status.code(), absl::StrCat(field, ": ", status.message()));
  return status.code() == absl::StatusCode::kInvalidArgument ? WithFieldViolation(named, field) : named;
}

void OutcomeToProto(const ConvertJob& job, const ConvertOutcome& outcome, v1::ConvertResponse* resp) {
  for (int64_t d : job.plan.output_shape) resp->add_output_shape(d);
  for (int64_t d : job.plan.output_strides) resp->add_output_strides(d);
  resp->set_output_bytes(job.plan.output_bytes);
  resp->set_engine(outcome.engine);
  resp->set_peak_extra_device_bytes(outcome.peak_extra_device_bytes);
  *resp->mutable_identity() = IdentityToProto(job.plan.spec);
}

void BatchItemToProto(const ConvertJob& job, const ConvertOutcome& outcome, v1::BatchItemResult* item) {
  v1::TensorResult* t = item->mutable_outputs(0);
  for (int64_t d : job.plan.output_shape) t->add_shape(d);
  for (int64_t d : job.plan.output_strides) t->add_strides(d);
  t->set_bytes(job.plan.output_bytes);
  *t->mutable_identity() = IdentityToProto(job.plan.spec);
  item->set_engine(outcome.engine);
  item->set_kernel_seconds(outcome.kernel_seconds.value_or(0));
}

absl::StatusOr<StreamStart> StreamStartFromProto(const v1::StreamRequestHeader& h,
                                                 const ConversionSpec& spec) {
  StreamStart start;
  WPREP_ASSIGN_OR_RETURN(start.gpu, OptionalUuid(h.device_uuid(), "header.device_uuid"));
  WPREP_RETURN_IF_ERROR(CheckEmptyShape(h.logical_shape(), "header.logical_shape"));
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
  absl::Status named(status.code(), absl::StrCat(field, ": ", status.message()));
  return status.code() == absl::StatusCode::kInvalidArgument ? WithFieldViolation(named, field) : named;
}

}  // namespace wprep::server
