#include "rpc/service.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "net/log.h"
#include "net/peer_credentials.h"
#include "rpc/moe_item.h"
#include "rpc/quantize_item.h"
#include "rpc/proto_translate.h"
#include "rpc/rpc_warmup.h"
#include "rpc/status.h"
#include "rpc/stream_pipeline.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace v1 = wprep::v1;

absl::Status RunGuarded(absl::FunctionRef<absl::Status()> body, uint64_t request_id) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    LogLine(LogLevel::kError, "handler_exception", absl::StrCat("id=", request_id, " what=bad_alloc"));
    return absl::ResourceExhaustedError("the daemon ran out of host memory serving this request; retry later");
  } catch (const std::exception& e) {
    LogLine(LogLevel::kError, "handler_exception", absl::StrCat("id=", request_id, " what=", LogQuote(e.what())));
    return absl::InternalError(absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    LogLine(LogLevel::kError, "handler_exception", absl::StrCat("id=", request_id, " what=unknown"));
    return absl::InternalError("internal error: an unknown exception");
  }
}

absl::Status BoundMessage(const absl::Status& status) {
  if (status.message().size() <= kMaxErrorBytes) return status;
  const size_t keep = kMaxErrorBytes - 64;
  return WithFieldViolation(absl::Status(status.code(), absl::StrCat(status.message().substr(0, keep), "... (",
                                                                     status.message().size() - keep, " more bytes)")),
                            FieldViolationOf(status));
}

namespace {

// kSelfWarmup when the call carries the daemon's own warm-up token (rpc_warmup.h); a
// wrong token makes an ordinary client request.
Caller CallerOf(const grpc::ServerContext& ctx, const std::string& token) {
  if (token.empty()) return Caller::kClient;
  const auto& md = ctx.client_metadata();
  const auto it = md.find(kWarmupMetadataKey);
  return it != md.end() && absl::string_view(it->second.data(), it->second.size()) == token
             ? Caller::kSelfWarmup
             : Caller::kClient;
}

const OperandFields kConvertFields{"source_ipc", "destination_ipc", "device_uuid"};
const OperandFields kStreamFields{"", "", "header.device_uuid"};
const OperandFields kBatchFields{"convert.source.ipc", "convert.destination.ipc", "device_uuid"};

Transport TransportOf(const ConvertJob& job) {
  return job.source_ipc ? (job.destination_ipc ? Transport::kIpcToIpc : Transport::kIpcToBytes)
                        : (job.destination_ipc ? Transport::kBytesToIpc : Transport::kBytesToBytes);
}

// How close to its deadline a cancelled call counts as having run out of time. The
// daemon's copy of a deadline runs late by however long the request's headers took to
// arrive and be read, which on a loaded host is more than 100 ms.
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(500);

}  // namespace

// One RPC from arrival to final status: its id, what it asked for and what ran (as
// learned), and the single exit that names operand errors by their field, logs, records
// the request's and its engine's metrics, and translates the status. The daemon's own
// warm-up calls run the same path but leave no trace: no id from the public sequence
// (they answer id 0), no log line, no metrics.
class CallReport {
 public:
  // `announce_id`: send the id as the call's x-wprep-request-id metadata (once per call;
  // a stream's batches report theirs in their answers instead).
  CallReport(Method method, grpc::ServerContext* ctx, Metrics* metrics, const std::string& warmup_token,
             IdleSpinners* spinners, bool announce_id = true)
      : ctx_(ctx),
        metrics_(metrics),
        spinners_(spinners),
        caller_(CallerOf(*ctx, warmup_token)),
        id_(caller_ == Caller::kClient ? NextRequestId() : 0),
        start_(absl::Now()) {
    if (spinners_ != nullptr) spinners_->Touch();
    record_.method = method;
    if (announce_id) ctx_->AddInitialMetadata("x-wprep-request-id", std::to_string(id_));
  }

  Caller caller() const { return caller_; }
  uint64_t id() const { return id_; }
  void SetSpec(const ConversionSpec& spec) {
    record_.layout = spec.layout;
    record_.direction = spec.direction;
  }
  void SetTransport(Transport t) { record_.transport = t; }
  // What a conversion did: bytes in and out, the engine that ran it and its time.
  void SetConversion(uint64_t bytes_in, uint64_t bytes_out, const std::string& engine,
                     DeviceMetrics* engine_metrics, std::optional<double> kernel_seconds,
                     uint64_t peak_extra_device_bytes) {
    bytes_in_ = bytes_in;
    bytes_out_ = bytes_out;
    engine_ = engine;
    engine_metrics_ = engine_metrics;
    kernel_seconds_ = kernel_seconds;
    record_.peak_extra_device_bytes = peak_extra_device_bytes;
  }

  // One more engine's conversion of a multi-item request (ConvertBatch), recorded in that
  // engine's metrics at the exit; and the items, for wprep_batch_items_total.
  void AddItem(const ConversionSpec& spec, Transport transport, DeviceMetrics* engine_metrics,
               std::optional<double> kernel_seconds, uint64_t bytes_out) {
    items_.push_back({spec.layout, spec.direction, transport, engine_metrics, kernel_seconds, bytes_out});
  }

  // The request's deadline as absl::Time (InfiniteFuture when none).
  absl::Time deadline() const {
    const auto d = ctx_->deadline();
    if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
    return absl::FromChrono(d);
  }
  // OK while the call is live: before its deadline and not cancelled.
  absl::Status CheckLive() const {
    if (absl::Now() >= deadline()) {
      return absl::DeadlineExceededError("the request's deadline passed before its work started");
    }
    if (ctx_->IsCancelled()) return absl::CancelledError("client cancelled the call");
    return absl::OkStatus();
  }

  // Runs a handler body (RunGuarded) and finishes with its status.
  template <class Body>
  grpc::Status Run(Body body, const OperandFields& fields = {}) {
    return Finish(RunGuarded(body, id_), fields);
  }

  grpc::Status Finish(absl::Status status, const OperandFields& fields = {}) {
    if (spinners_ != nullptr) spinners_->Touch();
    const bool converted = status.ok();  // the engine's work ran to the end
    // The handler's own CANCELLED (a read or write that failed as the client left) can come
    // before gRPC marks the call cancelled.
    const bool client_ended = ctx_->IsCancelled() || status.code() == absl::StatusCode::kCancelled;
    // UNAVAILABLE is the daemon's refusal (warming up, draining, stopping): its answer
    // whether or not the call was still open to hear it. A draining daemon's shutdown cuts
    // the calls still arriving on open connections, and one cut while its handler refused
    // it was not cancelled by its client.
    const bool refused = status.code() == absl::StatusCode::kUnavailable;
    if (client_ended && !refused && status.code() != absl::StatusCode::kDeadlineExceeded) {
      // The call ended before its answer could go out: the client cancelled, went away or
      // ran out of time. Record what the client saw, even when the work itself finished.
      const std::string why = status.ok() ? "the answer was ready after the call ended" : std::string(status.message());
      // The client's own timer fires at its deadline, a little before the daemon's copy
      // of it (gRPC sends the timeout rounded up, and it travels): a call cancelled this
      // close to its deadline ran out of time.
      status = absl::Now() + kDeadlineSlack >= deadline()
                   ? absl::DeadlineExceededError(absl::StrCat("the request's deadline passed (", why, ")"))
                   : absl::CancelledError(absl::StrCat("client cancelled the call (", why, ")"));
    }
    status = BoundMessage(NameOperandField(status, fields));
    if (caller_ == Caller::kSelfWarmup) return ToGrpcStatus(status);
    record_.code = status.code();
    record_.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    if (!status.ok()) record_.peak_extra_device_bytes.reset();
    metrics_->RecordRequest(record_);
    if (converted && engine_metrics_ != nullptr) {
      if (kernel_seconds_) engine_metrics_->kernel_seconds->Observe(*kernel_seconds_);
      engine_metrics_->converted_bytes->Increment(static_cast<double>(bytes_out_));
    }
    for (const Item& item : items_) {
      metrics_->RecordBatchItem(item.layout, item.direction, item.transport, status.code());
      if (!status.ok() || item.engine_metrics == nullptr) continue;
      if (item.kernel_seconds) item.engine_metrics->kernel_seconds->Observe(*item.kernel_seconds);
      item.engine_metrics->converted_bytes->Increment(static_cast<double>(item.bytes_out));
    }
    std::string fields_text = absl::StrCat(
        "id=", id_, " method=", MethodName(record_.method),
        " layout=", record_.layout ? std::string(LayoutName(*record_.layout)) : "none",
        " direction=", record_.direction ? std::string(DirectionName(*record_.direction)) : "none",
        " transport=", TransportName(record_.transport), " code=", absl::StatusCodeToString(status.code()),
        " seconds=", record_.seconds, " bytes_in=", bytes_in_, " bytes_out=", bytes_out_);
    if (!engine_.empty()) absl::StrAppend(&fields_text, " engine=", engine_);
    if (kernel_seconds_) absl::StrAppend(&fields_text, " kernel_seconds=", *kernel_seconds_);
    if (!status.ok()) absl::StrAppend(&fields_text, " error=", LogQuote(status.message()));
    LogLine(status.ok() ? LogLevel::kInfo : LogLevel::kWarning, "request", fields_text);
    return ToGrpcStatus(status);
  }

 private:
  grpc::ServerContext* const ctx_;
  Metrics* const metrics_;
  IdleSpinners* const spinners_;
  const Caller caller_;
  const uint64_t id_;
  const absl::Time start_;
  RequestRecord record_;
  uint64_t bytes_in_ = 0, bytes_out_ = 0;
  std::string engine_;
  DeviceMetrics* engine_metrics_ = nullptr;
  std::optional<double> kernel_seconds_;
  struct Item {
    Layout layout;
    Direction direction;
    Transport transport;
    DeviceMetrics* engine_metrics;
    std::optional<double> kernel_seconds;
    uint64_t bytes_out;
  };
  std::vector<Item> items_;
};

WeightPrepService::WeightPrepService(Admission* admission, DeviceManager* devices, IpcCache* ipc,
                                     Executor* executor, Metrics* metrics, HostBudget* buffers,
                                     const RequestLimits& limits, std::string warmup_token,
                                     IdleSpinners* spinners)
    : admission_(admission),
      devices_(devices),
      ipc_(ipc),
      vmm_(ipc, devices),
      executor_(executor),
      metrics_(metrics),
      buffers_(buffers),
      limits_(limits),
      warmup_token_(std::move(warmup_token)),
      spinners_(spinners) {}

grpc::Status WeightPrepService::Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req,
                                     v1::PlanResponse* resp) {
  CallReport report(Method::kPlan, ctx, metrics_, warmup_token_, spinners_);
  return report.Run([&]() -> absl::Status {
    WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
    WPREP_ASSIGN_OR_RETURN(ConversionSpec spec, SpecFromProto(req->spec(), "spec"));
    report.SetSpec(spec);
    WPREP_ASSIGN_OR_RETURN(wprep::Plan plan, PlanFromProto(*req, spec));
    WPREP_RETURN_IF_ERROR(CheckTensorBytes(plan, limits_.max_tensor_bytes));
    PlanToProto(plan, resp);
    return absl::OkStatus();
  });
}

grpc::Status WeightPrepService::Convert(grpc::ServerContext* ctx, const v1::ConvertRequest* req,
                                        v1::ConvertResponse* resp) {
  CallReport report(Method::kConvert, ctx, metrics_, warmup_token_, spinners_);
  const bool src_ipc = req->has_source_ipc(), dst_ipc = req->has_destination_ipc();
  report.SetTransport(src_ipc ? (dst_ipc ? Transport::kIpcToIpc : Transport::kIpcToBytes)
                              : (dst_ipc ? Transport::kBytesToIpc : Transport::kBytesToBytes));
  return report.Run(
      [&]() -> absl::Status {
        WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
        if (!HasVmm(*req)) return DoConvert(ctx, *req, resp, report);
        // VMM buffers become handles of the IPC cache, held until the conversion has its leases.
        v1::ConvertRequest resolved = *req;
        std::vector<IpcCache::Lease> vmm_held;
        WPREP_RETURN_IF_ERROR(vmm_.Resolve(UnixPeers::Global().Lookup(ctx->peer()), &resolved, &vmm_held));
        return DoConvert(ctx, resolved, resp, report);
      },
      kConvertFields);
}

absl::Status WeightPrepService::DoConvert(grpc::ServerContext* ctx, const v1::ConvertRequest& req,
                                          v1::ConvertResponse* resp, CallReport& report) {
  // The spec first, so that even a request refused later is counted under its layout.
  WPREP_ASSIGN_OR_RETURN(ConversionSpec spec, SpecFromProto(req.spec(), "spec"));
  report.SetSpec(spec);
  WPREP_ASSIGN_OR_RETURN(ConvertJob job, ConvertJobFromProto(req, spec, limits_.max_message_bytes));
  WPREP_RETURN_IF_ERROR(CheckTensorBytes(job.plan, limits_.max_tensor_bytes));
  // Inline bytes stay in host memory until the answer has gone out (the call ends): the
  // request's input, and the output twice (the response message and gRPC's serialized
  // copy of it, which a client that does not read leaves unsent).
  const uint64_t inline_bytes = (job.source_ipc ? 0 : job.plan.input_bytes) +
                                (job.destination_ipc ? 0 : 2 * job.plan.output_bytes);
  if (inline_bytes > 0) {
    WPREP_ASSIGN_OR_RETURN(HostBudget::Charge charge,
                           buffers_->Take(inline_bytes, "this Convert's inline data", report.deadline(),
                                          [ctx] { return ctx->IsCancelled(); }));
    buffers_->HoldUntilCallEnds(ctx, std::move(charge));
  }
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  WPREP_ASSIGN_OR_RETURN(ConvertOutcome outcome,
                         executor_->Convert(job, resp->mutable_output_bytes_inline(), report.deadline()));
  OutcomeToProto(job, outcome, resp);
  report.SetConversion(job.plan.input_bytes, job.plan.output_bytes, outcome.engine, outcome.engine_metrics,
                       outcome.kernel_seconds, outcome.peak_extra_device_bytes);
  return absl::OkStatus();
}

grpc::Status WeightPrepService::ConvertStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ConvertStreamResponse, v1::ConvertStreamRequest>* stream) {
  CallReport report(Method::kConvertStream, ctx, metrics_, warmup_token_, spinners_);
  report.SetTransport(Transport::kStream);
  return report.Run(
      [&]() -> absl::Status {
        WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
        return DoConvertStream(ctx, stream, report);
      },
      kStreamFields);
}

absl::Status WeightPrepService::DoConvertStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ConvertStreamResponse, v1::ConvertStreamRequest>* stream,
    CallReport& report) {
  v1::ConvertStreamRequest msg;
  if (!stream->Read(&msg)) {
    if (ctx->IsCancelled()) return absl::CancelledError("client cancelled before the header");
    return absl::InvalidArgumentError("stream ended before its header; send a header first");
  }
  if (!msg.has_header()) {
    return absl::InvalidArgumentError("the first message of a ConvertStream must be a header, got a data chunk");
  }
  WPREP_ASSIGN_OR_RETURN(ConversionSpec spec, SpecFromProto(msg.header().spec(), "header.spec"));
  report.SetSpec(spec);
  WPREP_ASSIGN_OR_RETURN(StreamStart start, StreamStartFromProto(msg.header(), spec));
  WPREP_RETURN_IF_ERROR(CheckTensorBytes(start.plan, limits_.max_tensor_bytes));
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  // Host memory by need (a small tensor's stream reserves its few buffers, not a full
  // slice pipeline), and before the engine: a unary Convert takes host memory and then
  // waits for the GPU, so a stream holding a GPU run while it waited for host memory could
  // stall both until one wait ran out. Every engine slices alike; this one only measures.
  HostBudget::Charge buffers;
  {
    WPREP_ASSIGN_OR_RETURN(std::unique_ptr<StreamConverter> sizing,
                           NewCpuStreamConverter(start.plan, executor_->stream_slicing(), 1, nullptr));
    const uint64_t slice = sizing->slice_input_bytes();
    const uint64_t need = StreamPipeline::HostBytes(start.plan.input_bytes, slice, sizing->SliceOutputBytes(slice));
    WPREP_ASSIGN_OR_RETURN(buffers, buffers_->Take(need, "this ConvertStream's buffers", report.deadline(),
                                                   [ctx] { return ctx->IsCancelled(); }));
  }
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  WPREP_ASSIGN_OR_RETURN(std::unique_ptr<StreamConverter> conv,
                         executor_->StartStream(start.plan, start.gpu, report.deadline()));
  const wprep::Plan& plan = conv->plan();
  const uint64_t slice = conv->slice_input_bytes();
  {
    v1::ConvertStreamResponse r;
    v1::StreamResponseHeader* rh = r.mutable_header();
    for (int64_t d : plan.output_shape) rh->add_output_shape(d);
    for (int64_t d : plan.output_strides) rh->add_output_strides(d);
    rh->set_output_bytes(plan.output_bytes);
    rh->set_input_bytes(plan.input_bytes);
    rh->set_engine(conv->engine());
    *rh->mutable_identity() = IdentityToProto(plan.spec);
    if (!stream->Write(r)) return absl::CancelledError("client went away before the header was sent");
  }
  WPREP_ASSIGN_OR_RETURN(
      std::unique_ptr<StreamPipeline> pipeline,
      StreamPipeline::Start(
          [&](const std::string& in) -> absl::StatusOr<absl::Span<const uint8_t>> {
            WPREP_RETURN_IF_ERROR(report.CheckLive());
            return conv->ConvertSlice(
                absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(in.data()), in.size()));
          },
          [stream](const v1::ConvertStreamResponse& m) { return stream->Write(m); }));
  StreamInputFramer framer(plan.input_bytes, slice, pipeline.get());
  while (stream->Read(&msg)) {
    if (absl::Status s = framer.Add(msg); !s.ok()) return pipeline->Abort(s);
  }
  if (ctx->IsCancelled()) return pipeline->Abort(absl::CancelledError("client cancelled mid-stream"));
  if (absl::Status s = framer.Finish(); !s.ok()) return pipeline->Abort(s);
  WPREP_ASSIGN_OR_RETURN(uint64_t sent, pipeline->Finish());
  if (sent != plan.output_bytes) {
    return absl::InternalError(
        absl::StrCat("stream produced ", sent, " output bytes, expected ", plan.output_bytes));
  }
  report.SetConversion(framer.received(), sent, conv->engine(), conv->engine_metrics(), conv->kernel_seconds(),
                       conv->peak_extra_device_bytes());
  return absl::OkStatus();
}

grpc::Status WeightPrepService::ConvertBatch(grpc::ServerContext* ctx, const v1::ConvertBatchRequest* req,
                                             v1::ConvertBatchResponse* resp) {
  CallReport report(Method::kConvertBatch, ctx, metrics_, warmup_token_, spinners_);
  report.SetTransport(Transport::kBatch);
  return report.Run(
      [&]() -> absl::Status {
        WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
        if (!HasVmm(*req)) return DoConvertBatch(ctx, *req, resp, report, ticket);
        v1::ConvertBatchRequest resolved = *req;
        std::vector<IpcCache::Lease> vmm_held;
        WPREP_RETURN_IF_ERROR(vmm_.Resolve(UnixPeers::Global().Lookup(ctx->peer()), &resolved, &vmm_held));
        return DoConvertBatch(ctx, resolved, resp, report, ticket);
      },
      kBatchFields);
}

grpc::Status WeightPrepService::ConvertBatches(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::ConvertBatchesResponse, v1::ConvertBatchRequest>* stream) {
  // Its ready words (host words) are the daemon's to write once its client is gone.
  static std::atomic<uint64_t> next_stream_id{1};
  const uint64_t stream_id = next_stream_id.fetch_add(1);
  bool client_gone = false;
  absl::Cleanup release = [&] {
    if (client_gone || ctx->IsCancelled()) executor_->ReleaseReadyWords(stream_id);
  };
  v1::ConvertBatchRequest req;
  for (uint64_t index = 0; stream->Read(&req); ++index) {
    // The inline data's charge outlives the answer that holds the outputs: freed once written.
    HostBudget::Charge inline_charge;
    v1::ConvertBatchesResponse answer;
    answer.set_index(index);
    CallReport report(Method::kConvertBatches, ctx, metrics_, warmup_token_, spinners_, /*announce_id=*/false);
    report.SetTransport(Transport::kBatch);
    bool admitted = false;
    grpc::Status status = report.Run(
        [&]() -> absl::Status {
          WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
          admitted = true;
          std::vector<IpcCache::Lease> vmm_held;
          if (HasVmm(req)) {
            WPREP_RETURN_IF_ERROR(vmm_.Resolve(UnixPeers::Global().Lookup(ctx->peer()), &req, &vmm_held));
          }
          return DoConvertBatch(ctx, req, answer.mutable_batch(), report, ticket, &inline_charge, stream_id);
        },
        kBatchFields);
    // Warming up or draining: this batch and the rest of the stream go elsewhere.
    if (!admitted) return status;
    answer.set_request_id(report.id());
    if (!status.ok()) {
      answer.clear_batch();
      answer.set_code(static_cast<int32_t>(status.error_code()));
      answer.set_message(status.error_message());
    }
    if (!stream->Write(answer)) {
      client_gone = true;
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
    }
  }
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled the stream");
  return grpc::Status::OK;
}

absl::Status WeightPrepService::DoConvertBatch(grpc::ServerContext* ctx, const v1::ConvertBatchRequest& req,
                                               v1::ConvertBatchResponse* resp, CallReport& report,
                                               Admission::Ticket& ticket, HostBudget::Charge* inline_charge,
                                               uint64_t stream_id) {
  if (HasMoeItems(req)) return DoMoeBatch(ctx, req, resp, report, inline_charge);
  if (HasQuantizeItems(req)) return DoQuantizeBatch(ctx, req, resp, report, inline_charge);
  WPREP_ASSIGN_OR_RETURN(std::vector<ConvertJob> jobs,
                         BatchJobsFromProto(req, BatchLimits{limits_.max_message_bytes, limits_.max_batch_items}));
  BatchFences fences;
  WPREP_RETURN_IF_ERROR(FencesFromProto(req, jobs, &fences));
  fences.owner = stream_id;
  fences.request_id = report.id();
  if (fences.queued_answer) {
    // The work outlives the call: it holds the admission ticket (a drain waits for it), and
    // its kernel times reach the metrics when it is done.
    fences.keep = std::make_shared<Admission::Ticket>(std::move(ticket));
    fences.done = [](const absl::Status& s, DeviceMetrics* engine, const std::vector<std::optional<double>>& seconds) {
      if (!s.ok() || engine == nullptr) return;
      for (const std::optional<double>& k : seconds) {
        if (k) engine->kernel_seconds->Observe(*k);
      }
    };
  }
  uint64_t inline_bytes = 0, bytes_in = 0, bytes_out = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    WPREP_RETURN_IF_ERROR(CheckTensorBytes(jobs[i].plan, limits_.max_tensor_bytes));
    inline_bytes += (jobs[i].source_ipc ? 0 : jobs[i].plan.input_bytes) +
                    (jobs[i].destination_ipc ? 0 : 2 * jobs[i].plan.output_bytes);
    bytes_in += jobs[i].plan.input_bytes;
    bytes_out += jobs[i].plan.output_bytes;
  }
  if (inline_bytes > 0) {
    WPREP_ASSIGN_OR_RETURN(HostBudget::Charge charge,
                           buffers_->Take(inline_bytes, "this ConvertBatch's inline data", report.deadline(),
                                          [ctx] { return ctx->IsCancelled(); }));
    if (inline_charge != nullptr) {
      *inline_charge = std::move(charge);
    } else {
      buffers_->HoldUntilCallEnds(ctx, std::move(charge));
    }
  }
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  std::vector<std::string*> inline_outputs(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    inline_outputs[i] = resp->add_items()->add_outputs()->mutable_inline_bytes();
  }
  absl::StatusOr<Executor::BatchOutcome> ran = executor_->ConvertBatch(jobs, inline_outputs, report.deadline(), &fences);
  if (!ran.ok()) return NameFenceField(ran.status(), req);
  Executor::BatchOutcome& outcome = *ran;
  for (size_t i = 0; i < jobs.size(); ++i) {
    BatchItemToProto(jobs[i], outcome.outcomes[i], resp->mutable_items(static_cast<int>(i)));
    report.AddItem(jobs[i].plan.spec, TransportOf(jobs[i]), outcome.outcomes[i].engine_metrics,
                   outcome.outcomes[i].kernel_seconds, jobs[i].plan.output_bytes);
  }
  resp->set_peak_extra_device_bytes(outcome.peak_extra_device_bytes);
  report.SetConversion(bytes_in, bytes_out, jobs.size() == 1 ? outcome.outcomes[0].engine : "batch", nullptr,
                       std::nullopt, outcome.peak_extra_device_bytes);
  return absl::OkStatus();
}

namespace {

// Fences are served for convert items only, yet: a batch of `kind` items answers once its
// work is done.
absl::Status RefuseFences(const v1::ConvertBatchRequest& req, absl::string_view kind) {
  const std::pair<const char*, bool> fences[] = {{"wait_for", req.has_wait_for()},
                                                 {"signal_when_done", req.signal_when_done_size() > 0},
                                                 {"answer_when", req.answer_when() != v1::ANSWER_WHEN_DONE}};
  for (const auto& [field, set] : fences) {
    if (!set) continue;
    return absl::UnimplementedError(absl::StrCat(field, ": a batch of ", kind,
                                                 " items answers once its work is done; fences are not served for ",
                                                 kind, " items yet; leave ", field, " unset"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WeightPrepService::DoMoeBatch(grpc::ServerContext* ctx, const v1::ConvertBatchRequest& req,
                                           v1::ConvertBatchResponse* resp, CallReport& report,
                                           HostBudget::Charge* inline_charge) {
  WPREP_RETURN_IF_ERROR(RefuseFences(req, "MoE"));
  WPREP_ASSIGN_OR_RETURN(std::vector<MoeJob> jobs,
                         MoeJobsFromProto(req, MoeLimits{static_cast<uint64_t>(limits_.max_message_bytes),
                                                         limits_.max_tensor_bytes, limits_.max_batch_items}));
  uint64_t bytes_in = 0, bytes_out = 0, inline_bytes = 0;
  for (const MoeJob& job : jobs) {
    bytes_in += job.input_bytes;
    bytes_out += job.output_bytes;
    // The inline inputs, and each inline output twice (built, then serialized), as for convert items.
    if (!job.ipc()) inline_bytes += job.input_bytes + 2 * job.output_bytes;
  }
  WPREP_RETURN_IF_ERROR(TakeInline(ctx, inline_bytes, inline_charge));
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  WPREP_RETURN_IF_ERROR(
      RunMoeJobs(jobs, MoeEngines{devices_->cpu_threads(), devices_, ipc_}, report.deadline(), resp));
  // IPC -> IPC in place: no device memory of the daemon's.
  report.SetConversion(bytes_in, bytes_out, jobs.size() == 1 ? resp->items(0).engine() : "batch", nullptr,
                       std::nullopt, 0);
  return absl::OkStatus();
}

absl::Status WeightPrepService::TakeInline(grpc::ServerContext* ctx, uint64_t bytes,
                                           HostBudget::Charge* inline_charge) {
  if (bytes == 0) return absl::OkStatus();
  WPREP_ASSIGN_OR_RETURN(HostBudget::Charge charge, buffers_->Take(bytes, "this ConvertBatch's inline data"));
  if (inline_charge != nullptr) {
    *inline_charge = std::move(charge);
  } else {
    buffers_->HoldUntilCallEnds(ctx, std::move(charge));
  }
  return absl::OkStatus();
}

absl::Status WeightPrepService::DoQuantizeBatch(grpc::ServerContext* ctx, const v1::ConvertBatchRequest& req,
                                                v1::ConvertBatchResponse* resp, CallReport& report,
                                                HostBudget::Charge* inline_charge) {
  WPREP_RETURN_IF_ERROR(RefuseFences(req, "quantize"));
  WPREP_ASSIGN_OR_RETURN(std::vector<QuantizeJob> jobs,
                         QuantizeJobsFromProto(req, MoeLimits{static_cast<uint64_t>(limits_.max_message_bytes),
                                                              limits_.max_tensor_bytes, limits_.max_batch_items}));
  uint64_t bytes_in = 0, bytes_out = 0, inline_bytes = 0;
  for (const QuantizeJob& job : jobs) {
    const uint64_t in = static_cast<uint64_t>(job.plan.input_bytes), out = job.values_bytes + job.scales_bytes;
    bytes_in += in;
    bytes_out += out;
    if (!job.ipc) inline_bytes += in + 2 * out;  // each inline output built, then serialized
  }
  WPREP_RETURN_IF_ERROR(TakeInline(ctx, inline_bytes, inline_charge));
  WPREP_RETURN_IF_ERROR(report.CheckLive());
  WPREP_RETURN_IF_ERROR(
      RunQuantizeJobs(jobs, MoeEngines{devices_->cpu_threads(), devices_, ipc_}, report.deadline(), resp));
  // IPC -> IPC in place: no device memory of the daemon's.
  report.SetConversion(bytes_in, bytes_out, jobs.size() == 1 ? resp->items(0).engine() : "batch", nullptr,
                       std::nullopt, 0);
  return absl::OkStatus();
}

grpc::Status WeightPrepService::ListDevices(grpc::ServerContext* ctx, const v1::ListDevicesRequest*,
                                            v1::ListDevicesResponse* resp) {
  CallReport report(Method::kListDevices, ctx, metrics_, warmup_token_, spinners_);
  return report.Run([&]() -> absl::Status {
    WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
    for (size_t i = 0; i < devices_->num_gpus(); ++i) {
      Gpu& g = devices_->gpu(i);
      v1::DeviceInfo* d = resp->add_devices();
      d->set_uuid(std::string(reinterpret_cast<const char*>(g.info().uuid.data()), 16));
      d->set_name(g.info().name);
      d->set_ordinal(g.info().ordinal);
      d->set_compute_capability_major(g.info().cc_major);
      d->set_compute_capability_minor(g.info().cc_minor);
      d->set_total_memory_bytes(g.info().total_memory);
      d->set_warm(g.warm());
      d->set_streams(g.streams());
      d->set_in_flight(g.in_flight());
      d->set_allocated_bytes(g.allocator().allocated());
      const VmmSupport vmm = g.runtime().VmmImportSupport(g.ordinal());
      v1::ImportCapabilities* caps = d->mutable_import_capabilities();
      caps->set_legacy_ipc(true);
      caps->set_posix_fd(vmm.posix_fd);
      caps->set_fabric(vmm.fabric);
    }
    resp->set_cpu_engine(devices_->cpu_engine());
    resp->set_cpu_threads(devices_->cpu_threads());
    return absl::OkStatus();
  });
}

absl::StatusOr<int> WeightPrepService::HandleOrdinal(const v1::IpcHandleRef& h, const std::string& field) {
  if (h.handle().size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".handle must be the 64 bytes of a cudaIpcMemHandle_t, got ", h.handle().size(), " bytes"));
  }
  WPREP_ASSIGN_OR_RETURN(Uuid u, UuidFromWire(h.device_uuid(), field + ".device_uuid"));
  absl::StatusOr<Gpu*> g = devices_->FindByUuid(u);
  if (!g.ok()) return absl::Status(g.status().code(), absl::StrCat(field, ".device_uuid: ", g.status().message()));
  return (*g)->ordinal();
}

grpc::Status WeightPrepService::RegisterIpcHandles(grpc::ServerContext* ctx,
                                                   const v1::RegisterIpcHandlesRequest* req,
                                                   v1::RegisterIpcHandlesResponse* resp) {
  CallReport report(Method::kRegisterIpcHandles, ctx, metrics_, warmup_token_, spinners_);
  return report.Run([&]() -> absl::Status {
    WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
    uint32_t already_open = 0;
    for (int i = 0; i < req->handles_size(); ++i) {
      const std::string field = absl::StrCat("handles[", i, "]");
      if (req->handles(i).has_vmm()) {
        bool was_open = false;
        WPREP_ASSIGN_OR_RETURN(uint64_t bytes, vmm_.Register(UnixPeers::Global().Lookup(ctx->peer()),
                                                             req->handles(i), field, &was_open));
        resp->add_allocation_bytes(bytes);
        already_open += was_open ? 1 : 0;
        continue;
      }
      WPREP_ASSIGN_OR_RETURN(int ordinal, HandleOrdinal(req->handles(i), field));
      absl::StatusOr<IpcCache::Registration> r = ipc_->Register(ordinal, req->handles(i).handle());
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(field, ": ", r.status().message()));
      resp->add_allocation_bytes(r->allocation_bytes);
      already_open += r->was_open ? 1 : 0;
    }
    resp->set_already_open(already_open);
    return absl::OkStatus();
  });
}

grpc::Status WeightPrepService::ReleaseIpcHandles(grpc::ServerContext* ctx,
                                                  const v1::ReleaseIpcHandlesRequest* req,
                                                  v1::ReleaseIpcHandlesResponse* resp) {
  CallReport report(Method::kReleaseIpcHandles, ctx, metrics_, warmup_token_, spinners_);
  return report.Run([&]() -> absl::Status {
    WPREP_ASSIGN_OR_RETURN(Admission::Ticket ticket, admission_->Enter(report.caller()));
    uint32_t released = 0, deferred = 0;
    for (int i = 0; i < req->handles_size(); ++i) {
      if (req->handles(i).has_vmm()) {
        WPREP_ASSIGN_OR_RETURN(auto closed, vmm_.Release(UnixPeers::Global().Lookup(ctx->peer()), req->handles(i),
                                                         absl::StrCat("handles[", i, "]")));
        released += closed.first;
        deferred += closed.second;
        continue;
      }
      WPREP_ASSIGN_OR_RETURN(int ordinal, HandleOrdinal(req->handles(i), absl::StrCat("handles[", i, "]")));
      auto [r, d] = ipc_->Release(ordinal, req->handles(i).handle());
      released += r;
      deferred += d;
    }
    resp->set_released(released);
    resp->set_deferred(deferred);
    return absl::OkStatus();
  });
}

}  // namespace wprep::server
