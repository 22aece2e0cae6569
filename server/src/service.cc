#include "wprep/server/service.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "wprep/server/log.h"
#include "wprep/server/proto_translate.h"
#include "wprep/server/rpc_warmup.h"
#include "wprep/server/status.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

// True when the call carries the daemon's own warm-up token (rpc_warmup.h). A wrong
// token makes an ordinary request.
bool IsSelfWarmup(const grpc::ServerContext& ctx, const std::string& token) {
  if (token.empty()) return false;
  const auto& md = ctx.client_metadata();
  const auto it = md.find(kWarmupMetadataKey);
  return it != md.end() && absl::string_view(it->second.data(), it->second.size()) == token;
}

}  // namespace

// One RPC from arrival to final status: its id, what it asked for (as learned), and the
// single exit that logs, records metrics and translates the status. The daemon's own
// warm-up calls run the same path but are not counted: no id from the public sequence
// (they answer id 0), no log line, no metrics, no idle-trim bookkeeping.
class WeightPrepService::Scope {
 public:
  Scope(Method method, grpc::ServerContext* ctx, Metrics* metrics, const std::string& warmup_token)
      : ctx_(ctx),
        metrics_(metrics),
        counted_(!IsSelfWarmup(*ctx, warmup_token)),
        id_(counted_ ? NextRequestId() : 0),
        start_(absl::Now()) {
    record_.method = method;
    ctx_->AddInitialMetadata("x-wprep-request-id", std::to_string(id_));
  }

  // False for the daemon's own warm-up calls.
  bool counted() const { return counted_; }

  void SetSpec(const ConversionSpec& spec) {
    record_.layout = spec.layout;
    record_.direction = spec.direction;
  }
  void SetTransport(Transport t) { record_.transport = t; }
  void SetKernelSeconds(std::optional<double> s) { kernel_seconds_ = s; }
  void SetResult(uint64_t bytes_in, uint64_t bytes_out, const std::string& engine,
                 std::optional<uint64_t> peak) {
    bytes_in_ = bytes_in;
    bytes_out_ = bytes_out;
    engine_ = engine;
    record_.peak_extra_device_bytes = peak;
  }

  // The request's deadline as absl::Time (InfiniteFuture when none).
  absl::Time deadline() const {
    const auto d = ctx_->deadline();
    if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
    return absl::FromChrono(d);
  }

  grpc::Status Finish(absl::Status status) {
    if (!status.ok() && ctx_->IsCancelled() && status.code() != absl::StatusCode::kDeadlineExceeded) {
      status = absl::CancelledError(absl::StrCat("client cancelled the call (", status.message(), ")"));
    }
    if (!counted_) return ToGrpcStatus(status);
    record_.code = status.code();
    record_.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    if (!status.ok()) record_.peak_extra_device_bytes.reset();
    metrics_->RecordRequest(record_);
    std::string fields = absl::StrCat(
        "id=", id_, " method=", MethodName(record_.method),
        " layout=", record_.layout ? std::string(LayoutName(*record_.layout)) : "none",
        " direction=", record_.direction ? std::string(DirectionName(*record_.direction)) : "none",
        " transport=", TransportName(record_.transport),
        " code=", absl::StatusCodeToString(status.code()),
        " seconds=", record_.seconds, " bytes_in=", bytes_in_, " bytes_out=", bytes_out_);
    if (!engine_.empty()) absl::StrAppend(&fields, " engine=", engine_);
    if (kernel_seconds_) absl::StrAppend(&fields, " kernel_seconds=", *kernel_seconds_);
    if (!status.ok()) absl::StrAppend(&fields, " error=", LogQuote(status.message()));
    LogLine(status.ok() ? LogLevel::kInfo : LogLevel::kWarning, "request", fields);
    return ToGrpcStatus(status);
  }

 private:
  grpc::ServerContext* ctx_;
  Metrics* metrics_;
  const bool counted_;
  const uint64_t id_;
  const absl::Time start_;
  RequestRecord record_;
  uint64_t bytes_in_ = 0, bytes_out_ = 0;
  std::string engine_;
  std::optional<double> kernel_seconds_;
};

namespace {

absl::Status CheckLive(grpc::ServerContext* ctx, absl::Time deadline) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the request's deadline passed before its work started");
  }
  if (ctx->IsCancelled()) return absl::CancelledError("client cancelled the call");
  return absl::OkStatus();
}

// One stage of the stream pipeline: a thread that takes items from a bounded queue and
// works on each; the first error stops it and is returned to whoever pushes next. Items
// are recycled (TakeBuffer) so a long stream allocates its buffers once.
template <typename T>
class Stage {
 public:
  using Work = std::function<absl::Status(T& item)>;

  Stage(size_t depth, Work work) : depth_(depth), work_(std::move(work)), thread_([this] { Run(); }) {}
  ~Stage() { Stop(); }

  // A recycled item (its old contents kept, string capacity included) or a new one.
  T TakeBuffer() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return T();
    T b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  // Queues an item; waits while `depth` are queued. The stage's error, if any.
  absl::Status Push(T item) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.size() < depth_ || !status_.ok(); });
    if (!status_.ok()) return status_;
    queue_.push_back(std::move(item));
    cv_.notify_all();
    return absl::OkStatus();
  }
  // No more items: waits until every queued one is done; the first error, if any.
  absl::Status Finish() {
    Stop();
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  // Drops what is queued, stops, and returns `why` (or the stage's own earlier error).
  absl::Status Abort(absl::Status why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok()) status_ = why;
      queue_.clear();
      cv_.notify_all();
    }
    return Finish();
  }

 private:
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }
  void Run() {
    for (;;) {
      T item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty() || closed_ || !status_.ok(); });
        if (!status_.ok() || queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status s = work_(item);
      std::lock_guard<std::mutex> lock(mu_);
      if (free_.size() < depth_ + 1) free_.push_back(std::move(item));
      if (!s.ok() && status_.ok()) status_ = s;
      cv_.notify_all();
    }
  }

  const size_t depth_;
  Work work_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<T> free_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once every member above exists
};

// Receiving, converting and sending overlap: the RPC's thread reads chunks into whole input
// slices, a converter thread converts each slice and cuts its output into chunk messages,
// and a sender thread writes those. Memory held: kSlicesQueued input slices and
// kChunksQueued output chunks, plus one of each in the works.
class StreamPipeline {
 public:
  static constexpr size_t kSlicesQueued = 4;
  static constexpr size_t kChunksQueued = 16;
  using Convert = std::function<absl::StatusOr<absl::Span<const uint8_t>>(const std::string& in)>;

  StreamPipeline(Convert convert,
                 grpc::ServerReaderWriter<v1::ConvertStreamResponse, v1::ConvertStreamRequest>* stream)
      : sender_(kChunksQueued,
                [this, stream](v1::ConvertStreamResponse& msg) -> absl::Status {
                  if (!stream->Write(msg)) return absl::CancelledError("client went away mid-stream");
                  sent_ += msg.chunk().data().size();  // only the sender thread writes it
                  return absl::OkStatus();
                }),
        converter_(kSlicesQueued, [this, convert = std::move(convert)](std::string& in) -> absl::Status {
          absl::StatusOr<absl::Span<const uint8_t>> out = convert(in);
          if (!out.ok()) return out.status();
          for (uint64_t off = 0; off < out->size(); off += kOutputChunkBytes) {
            const uint64_t n = std::min<uint64_t>(kOutputChunkBytes, out->size() - off);
            v1::ConvertStreamResponse msg = sender_.TakeBuffer();
            v1::DataChunk* dc = msg.mutable_chunk();
            dc->set_offset(produced_);
            dc->set_data(out->data() + off, n);
            produced_ += n;
            if (absl::Status s = sender_.Push(std::move(msg)); !s.ok()) return s;
          }
          return absl::OkStatus();
        }) {}

  // An empty buffer (recycled when possible) with room for a `slice`-byte input slice.
  std::string TakeBuffer(uint64_t slice) {
    std::string b = converter_.TakeBuffer();
    b.clear();
    b.reserve(slice);
    return b;
  }
  absl::Status Push(std::string slice) { return converter_.Push(std::move(slice)); }
  // No more input: waits until everything is converted and sent; the output bytes sent.
  absl::StatusOr<uint64_t> Finish() {
    absl::Status s = converter_.Finish();
    if (!s.ok()) return sender_.Abort(s);
    if (s = sender_.Finish(); !s.ok()) return s;
    return sent_;
  }
  // Stops both threads (the sender first, so a converter waiting for room wakes up).
  absl::Status Abort(absl::Status why) {
    absl::Status s = sender_.Abort(why);
    return converter_.Abort(s);
  }

 private:
  uint64_t produced_ = 0;  // converter thread only
  uint64_t sent_ = 0;      // sender thread only; read after it stopped
  Stage<v1::ConvertStreamResponse> sender_;  // before converter_: it outlives it
  Stage<std::string> converter_;
};

}  // namespace

WeightPrepService::WeightPrepService(Admission* admission, DeviceManager* devices, IpcCache* ipc,
                                     Executor* executor, Metrics* metrics, int64_t max_message_bytes,
                                     std::string warmup_token)
    : admission_(admission),
      devices_(devices),
      ipc_(ipc),
      executor_(executor),
      metrics_(metrics),
      max_message_bytes_(max_message_bytes),
      warmup_token_(std::move(warmup_token)) {}

grpc::Status WeightPrepService::Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req,
                                     v1::PlanResponse* resp) {
  Scope scope(Method::kPlan, ctx, metrics_, warmup_token_);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
  absl::StatusOr<ConversionSpec> spec = SpecFromProto(req->spec(), "spec");
  if (!spec.ok()) return scope.Finish(spec.status());
  scope.SetSpec(*spec);
  InputBinding binding;
  binding.strides.assign(req->input_strides().begin(), req->input_strides().end());
  if (req->has_input_buffer_bytes()) binding.buffer_bytes = req->input_buffer_bytes();
  absl::StatusOr<wprep::Plan> plan = MakePlan(*spec, ShapeFromProto(req->logical_shape()), binding);
  if (!plan.ok()) return scope.Finish(plan.status());
  PlanToProto(*plan, resp);
  return scope.Finish(absl::OkStatus());
}

grpc::Status WeightPrepService::Convert(grpc::ServerContext* ctx, const v1::ConvertRequest* req,
                                        v1::ConvertResponse* resp) {
  Scope scope(Method::kConvert, ctx, metrics_, warmup_token_);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
  return scope.Finish(DoConvert(ctx, *req, resp, scope));
}

absl::Status WeightPrepService::DoConvert(grpc::ServerContext* ctx, const v1::ConvertRequest& req,
                                          v1::ConvertResponse* resp, Scope& scope) {
  const bool src_ipc = req.has_source_ipc();
  const bool dst_ipc = req.has_destination_ipc();
  scope.SetTransport(src_ipc ? (dst_ipc ? Transport::kIpcToIpc : Transport::kIpcToBytes)
                             : (dst_ipc ? Transport::kBytesToIpc : Transport::kBytesToBytes));
  absl::StatusOr<ConversionSpec> spec = SpecFromProto(req.spec(), "spec");
  if (!spec.ok()) return spec.status();
  scope.SetSpec(*spec);
  // The transport's own limit may be higher (streams need 4 MiB chunks): enforce ours.
  const uint64_t req_bytes = req.ByteSizeLong();
  if (req_bytes > static_cast<uint64_t>(max_message_bytes_)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Convert request of ", req_bytes, " bytes exceeds --max-message-bytes=", max_message_bytes_,
        "; send large tensors with ConvertStream or as CUDA IPC buffers"));
  }
  if (req.source_case() == v1::ConvertRequest::SOURCE_NOT_SET) {
    return absl::InvalidArgumentError("source is not set: give source_bytes or source_ipc");
  }
  ConvertInput input;
  ConvertOutput output;
  if (src_ipc) {
    absl::StatusOr<IpcBufferRef> r = IpcFromProto(req.source_ipc(), "source_ipc");
    if (!r.ok()) return r.status();
    input.ipc = *std::move(r);
  } else {
    input.bytes = &req.source_bytes();
  }
  if (dst_ipc) {
    absl::StatusOr<IpcBufferRef> r = IpcFromProto(req.destination_ipc(), "destination_ipc");
    if (!r.ok()) return r.status();
    output.ipc = *std::move(r);
  } else {
    output.bytes = resp->mutable_output_bytes_inline();
  }
  std::optional<Uuid> preferred;
  if (!req.device_uuid().empty()) {
    absl::StatusOr<Uuid> u = UuidFromBytes(req.device_uuid(), "device_uuid");
    if (!u.ok()) return u.status();
    preferred = *u;
  }
  const std::vector<int64_t> shape = ShapeFromProto(req.logical_shape());
  if (!dst_ipc) {
    // Refuse before converting when the answer could not be sent.
    InputBinding binding;
    if (src_ipc) {
      binding.strides = input.ipc->strides;
      binding.buffer_bytes = input.ipc->size;
    } else {
      binding.buffer_bytes = input.bytes->size();
    }
    absl::StatusOr<wprep::Plan> plan = MakePlan(*spec, shape, binding);
    if (!plan.ok()) return plan.status();
    if (plan->output_bytes > static_cast<uint64_t>(max_message_bytes_)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the output has ", plan->output_bytes, " bytes, more than --max-message-bytes=",
          max_message_bytes_, " allows inline; use ConvertStream or destination_ipc"));
    }
  }
  if (absl::Status s = CheckLive(ctx, scope.deadline()); !s.ok()) return s;
  absl::StatusOr<ConvertOutcome> outcome =
      executor_->Convert(*spec, shape, input, output, preferred, scope.deadline(), scope.counted());
  if (!outcome.ok()) return outcome.status();
  for (int64_t d : outcome->plan.output_shape) resp->add_output_shape(d);
  for (int64_t d : outcome->plan.output_strides) resp->add_output_strides(d);
  resp->set_output_bytes(outcome->plan.output_bytes);
  resp->set_engine(outcome->engine);
  resp->set_peak_extra_device_bytes(outcome->peak_extra_device_bytes);
  scope.SetResult(outcome->plan.input_bytes, outcome->plan.output_bytes, outcome->engine,
                  outcome->peak_extra_device_bytes);
  scope.SetKernelSeconds(outcome->kernel_seconds);
  return absl::OkStatus();
}

grpc::Status WeightPrepService::ConvertStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ConvertStreamResponse, v1::ConvertStreamRequest>* stream) {
  Scope scope(Method::kConvertStream, ctx, metrics_, warmup_token_);
  scope.SetTransport(Transport::kStream);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
  return scope.Finish(DoConvertStream(ctx, stream, scope));
}

absl::Status WeightPrepService::DoConvertStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::ConvertStreamResponse, v1::ConvertStreamRequest>* stream,
    Scope& scope) {
  v1::ConvertStreamRequest msg;
  if (!stream->Read(&msg)) {
    if (ctx->IsCancelled()) return absl::CancelledError("client cancelled before the header");
    return absl::InvalidArgumentError("stream ended before its header; send a header first");
  }
  if (!msg.has_header()) {
    return absl::InvalidArgumentError(
        "the first message of a ConvertStream must be a header, got a data chunk");
  }
  const v1::StreamRequestHeader& h = msg.header();
  absl::StatusOr<ConversionSpec> spec = SpecFromProto(h.spec(), "header.spec");
  if (!spec.ok()) return spec.status();
  scope.SetSpec(*spec);
  std::optional<Uuid> preferred;
  if (!h.device_uuid().empty()) {
    absl::StatusOr<Uuid> u = UuidFromBytes(h.device_uuid(), "header.device_uuid");
    if (!u.ok()) return u.status();
    preferred = *u;
  }
  if (absl::Status s = CheckLive(ctx, scope.deadline()); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StreamConverter>> conv = executor_->StartStream(
      *spec, ShapeFromProto(h.logical_shape()), preferred, scope.deadline(), scope.counted());
  if (!conv.ok()) return conv.status();
  StreamConverter& c = **conv;
  const wprep::Plan& plan = c.plan();
  {
    v1::ConvertStreamResponse r;
    v1::StreamResponseHeader* rh = r.mutable_header();
    for (int64_t d : plan.output_shape) rh->add_output_shape(d);
    for (int64_t d : plan.output_strides) rh->add_output_strides(d);
    rh->set_output_bytes(plan.output_bytes);
    rh->set_input_bytes(plan.input_bytes);
    rh->set_engine(c.engine());
    if (!stream->Write(r)) return absl::CancelledError("client went away before the header was sent");
  }

  const uint64_t expected = plan.input_bytes;
  const uint64_t slice = c.slice_input_bytes();
  uint64_t received = 0;
  StreamPipeline pipeline(
      [&](const std::string& in) -> absl::StatusOr<absl::Span<const uint8_t>> {
        if (absl::Status s = CheckLive(ctx, scope.deadline()); !s.ok()) return s;
        return c.ConvertSlice(
            absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(in.data()), in.size()));
      },
      stream);
  std::string pending = pipeline.TakeBuffer(slice);

  while (stream->Read(&msg)) {
    if (msg.has_header()) {
      return pipeline.Abort(absl::InvalidArgumentError(absl::StrCat(
          "a second header arrived after ", received, " input bytes; a stream carries one header")));
    }
    if (!msg.has_chunk()) {
      return pipeline.Abort(absl::InvalidArgumentError("a stream message carries neither header nor chunk"));
    }
    const v1::DataChunk& ch = msg.chunk();
    const std::string& data = ch.data();
    if (data.size() > kMaxChunkBytes) {
      return pipeline.Abort(absl::InvalidArgumentError(absl::StrCat(
          "chunk of ", data.size(), " bytes exceeds the ", kMaxChunkBytes,
          "-byte (4 MiB) chunk limit; split the input into smaller chunks")));
    }
    if (ch.offset() != received) {
      return pipeline.Abort(absl::InvalidArgumentError(absl::StrCat(
          "chunk at offset ", ch.offset(), " arrived after ", received,
          " bytes; send chunks in order without gaps")));
    }
    if (data.size() > expected - received) {
      return pipeline.Abort(absl::InvalidArgumentError(absl::StrCat(
          "the stream carries more than the ", expected, " input bytes the plan expects (chunk at ",
          received, " has ", data.size(), " bytes)")));
    }
    received += data.size();
    if (pending.empty() && data.size() == slice) {
      // A chunk that is exactly one slice moves through without a copy.
      std::string whole = std::move(*msg.mutable_chunk()->mutable_data());
      if (absl::Status s = pipeline.Push(std::move(whole)); !s.ok()) return pipeline.Abort(s);
      continue;
    }
    absl::string_view rest(data);
    while (!rest.empty()) {
      const size_t take = std::min<size_t>(rest.size(), slice - pending.size());
      pending.append(rest.data(), take);
      rest.remove_prefix(take);
      if (pending.size() == slice) {
        if (absl::Status s = pipeline.Push(std::move(pending)); !s.ok()) return pipeline.Abort(s);
        pending = pipeline.TakeBuffer(slice);
      }
    }
  }
  if (ctx->IsCancelled()) return pipeline.Abort(absl::CancelledError("client cancelled mid-stream"));
  if (received < expected) {
    return pipeline.Abort(absl::InvalidArgumentError(absl::StrCat(
        "stream ended after ", received, " of ", expected,
        " input bytes (truncated); send the whole tensor before closing the stream")));
  }
  if (!pending.empty() || slice == 0) {
    if (absl::Status s = pipeline.Push(std::move(pending)); !s.ok()) return pipeline.Abort(s);
  }
  absl::StatusOr<uint64_t> sent = pipeline.Finish();
  if (!sent.ok()) return sent.status();
  if (*sent != plan.output_bytes) {
    return absl::InternalError(absl::StrCat("stream produced ", *sent, " output bytes, expected ",
                                            plan.output_bytes));
  }
  scope.SetResult(received, *sent, c.engine(), c.peak_extra_device_bytes());
  return absl::OkStatus();
}

grpc::Status WeightPrepService::ListDevices(grpc::ServerContext* ctx, const v1::ListDevicesRequest*,
                                            v1::ListDevicesResponse* resp) {
  Scope scope(Method::kListDevices, ctx, metrics_, warmup_token_);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
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
  }
  resp->set_cpu_engine(devices_->cpu_engine());
  resp->set_cpu_threads(devices_->cpu_threads());
  return scope.Finish(absl::OkStatus());
}

namespace {

// The daemon ordinal of the GPU an IpcHandleRef names, after checking its handle length.
absl::StatusOr<int> HandleRefOrdinal(const v1::IpcHandleRef& h, const std::string& field,
                                     DeviceManager& devices) {
  if (absl::Status s = IpcCache::CheckHandleSize(h.handle(), field); !s.ok()) return s;
  absl::StatusOr<Uuid> u = UuidFromBytes(h.device_uuid(), field + ".device_uuid");
  if (!u.ok()) return u.status();
  absl::StatusOr<Gpu*> g = devices.FindByUuid(*u, field + ".device_uuid");
  if (!g.ok()) return g.status();
  return (*g)->info().ordinal;
}

}  // namespace

grpc::Status WeightPrepService::RegisterIpcHandles(grpc::ServerContext* ctx,
                                                   const v1::RegisterIpcHandlesRequest* req,
                                                   v1::RegisterIpcHandlesResponse* resp) {
  Scope scope(Method::kRegisterIpcHandles, ctx, metrics_, warmup_token_);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
  uint32_t already_open = 0;
  for (int i = 0; i < req->handles_size(); ++i) {
    const v1::IpcHandleRef& h = req->handles(i);
    const std::string field = absl::StrCat("handles[", i, "]");
    absl::StatusOr<int> ordinal = HandleRefOrdinal(h, field, *devices_);
    if (!ordinal.ok()) return scope.Finish(ordinal.status());
    absl::StatusOr<IpcCache::Registration> r = ipc_->Register(*ordinal, h.handle(), field);
    if (!r.ok()) return scope.Finish(r.status());
    resp->add_allocation_bytes(r->allocation_bytes);
    already_open += r->was_open ? 1 : 0;
  }
  resp->set_already_open(already_open);
  return scope.Finish(absl::OkStatus());
}

grpc::Status WeightPrepService::ReleaseIpcHandles(grpc::ServerContext* ctx,
                                                  const v1::ReleaseIpcHandlesRequest* req,
                                                  v1::ReleaseIpcHandlesResponse* resp) {
  Scope scope(Method::kReleaseIpcHandles, ctx, metrics_, warmup_token_);
  absl::StatusOr<Admission::Ticket> ticket = admission_->Enter(scope.counted());
  if (!ticket.ok()) return scope.Finish(ticket.status());
  uint32_t released = 0, deferred = 0;
  for (int i = 0; i < req->handles_size(); ++i) {
    absl::StatusOr<int> ordinal =
        HandleRefOrdinal(req->handles(i), absl::StrCat("handles[", i, "]"), *devices_);
    if (!ordinal.ok()) return scope.Finish(ordinal.status());
    auto [r, d] = ipc_->Release(*ordinal, req->handles(i).handle());
    released += r;
    deferred += d;
  }
  resp->set_released(released);
  resp->set_deferred(deferred);
  return scope.Finish(absl::OkStatus());
}

}  // namespace wprep::server
