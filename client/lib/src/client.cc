#include "wprep/client/client.h"

#include <malloc.h>

#include <algorithm>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace wprep::client {
namespace {

using Clock = std::chrono::system_clock;
using Deadline = std::optional<Clock::time_point>;

Deadline DeadlineOf(const CallOptions& o) {
  if (!o.timeout) return std::nullopt;
  return Clock::now() + *o.timeout;
}

void ApplyOptions(const CallOptions& o, const Deadline& deadline, grpc::ClientContext* ctx) {
  if (deadline) ctx->set_deadline(*deadline);
  for (const auto& [key, value] : o.metadata) ctx->AddMetadata(key, value);
}

// Runs `attempt` until it succeeds, fails with a code other than UNAVAILABLE, or the
// policy's attempts or the deadline run out (see RetryPolicy for why every method may be
// retried). A failure after retries says how many attempts it made.
//
// The wait between attempts is spent in `channel`'s WaitForConnected, not asleep: a
// channel whose connection failed is in TRANSIENT_FAILURE, where calls fail at once
// without driving the new connection's handshake, which then completes only on gRPC's
// backup poller (every 5 s). Waiting for the connection drives it, and ends the wait as
// soon as the daemon answers.
template <typename T, typename Attempt>
absl::StatusOr<T> WithRetry(const RetryPolicy& policy, const Deadline& deadline, grpc::Channel* channel,
                            Attempt&& attempt) {
  thread_local std::minstd_rand rng(std::random_device{}());
  const int attempts = std::max(1, policy.max_attempts);
  double backoff_ms = static_cast<double>(std::max<int64_t>(0, policy.initial_backoff.count()));
  const double max_ms = static_cast<double>(std::max<int64_t>(0, policy.max_backoff.count()));
  for (int i = 1;; ++i) {
    absl::StatusOr<T> r = attempt();
    bool last = r.ok() || r.status().code() != absl::StatusCode::kUnavailable || i >= attempts;
    std::chrono::microseconds wait{0};
    if (!last) {
      const double jitter = std::uniform_real_distribution<double>(0.75, 1.0)(rng);
      wait = std::chrono::microseconds(static_cast<int64_t>(std::min(backoff_ms, max_ms) * jitter * 1e3));
      last = deadline && Clock::now() + wait >= *deadline;
    }
    if (last) {
      if (r.ok() || i == 1) return r;
      return absl::Status(r.status().code(),
                          absl::StrCat(r.status().message(), " (after ", i, " attempts)"));
    }
    const Clock::time_point until = Clock::now() + wait;
    if (channel == nullptr || !channel->WaitForConnected(until)) std::this_thread::sleep_until(until);
    backoff_ms = std::min(backoff_ms * std::max(1.0, policy.multiplier), max_ms);
  }
}

// One unary call of `method` on `stub` with these options and deadline, its grpc::Status
// translated, retried as the options say.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(wprep::v1::WeightPrep::Stub& stub, grpc::Channel* channel,
                               grpc::Status (wprep::v1::WeightPrep::Stub::*method)(
                                   grpc::ClientContext*, const Request&, Response*),
                               const Request& request, const CallOptions& options,
                               const Deadline& deadline) {
  return WithRetry<Response>(options.retry, deadline, channel, [&]() -> absl::StatusOr<Response> {
    grpc::ClientContext ctx;
    ApplyOptions(options, deadline, &ctx);
    Response resp;
    grpc::Status s = (stub.*method)(&ctx, request, &resp);
    if (!s.ok()) return FromGrpcStatus(s);
    return resp;
  });
}

template <typename Request, typename Response>
absl::StatusOr<Response> Unary(wprep::v1::WeightPrep::Stub& stub, grpc::Channel* channel,
                               grpc::Status (wprep::v1::WeightPrep::Stub::*method)(
                                   grpc::ClientContext*, const Request&, Response*),
                               const Request& request, const CallOptions& options) {
  return Unary(stub, channel, method, request, options, DeadlineOf(options));
}

}  // namespace

// Sums the progress of a ConvertStream's stripes and reports it, one report at a time.
class Client::ProgressTracker {
 public:
  ProgressTracker(const std::function<void(const StreamProgress&)>& report, uint64_t input_bytes,
                  int stripes, uint64_t output_bytes)
      : report_(report), sent_(static_cast<size_t>(stripes)), received_(static_cast<size_t>(stripes)) {
    totals_.input_bytes = input_bytes;
    totals_.output_bytes = output_bytes;
    output_known_ = output_bytes > 0;
  }
  // The daemon's header of an unstriped stream: the output's size.
  void Announced(uint64_t output_bytes) {
    absl::MutexLock lock(&mu_);
    if (output_known_) return;
    totals_.output_bytes = output_bytes;
    report_(totals_);
  }
  void Sent(int stripe, uint64_t so_far) { Update(&sent_, &totals_.bytes_sent, stripe, so_far); }
  void Received(int stripe, uint64_t so_far) { Update(&received_, &totals_.bytes_received, stripe, so_far); }

 private:
  void Update(std::vector<uint64_t>* per, uint64_t* total, int stripe, uint64_t so_far)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    uint64_t& mine = (*per)[static_cast<size_t>(stripe)];
    *total = *total - mine + so_far;
    mine = so_far;
    report_(totals_);
  }

  const std::function<void(const StreamProgress&)>& report_;
  absl::Mutex mu_;
  std::vector<uint64_t> sent_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> received_ ABSL_GUARDED_BY(mu_);
  StreamProgress totals_ ABSL_GUARDED_BY(mu_);
  bool output_known_ ABSL_GUARDED_BY(mu_) = false;
};

void TuneHeapForStreaming() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int max_message_bytes,
                                           int connection) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  // Channels whose arguments differ get their own subchannel, hence their own connection.
  args.SetInt("wprep.connection", connection);
  // The daemon is local: reconnecting costs little, and gRPC's default backoff (1 s,
  // growing to 2 min) would keep a channel failing fast long after a restarted daemon
  // listens again, whatever RetryPolicy the calls have. (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS
  // stays at its 20 s: it is also how long a connection may take to answer, and a busy
  // daemon can take more than a short backoff.)
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

Client::Client(std::shared_ptr<grpc::Channel> channel) {
  stubs_.push_back(wprep::v1::WeightPrep::NewStub(channel));
  channels_.push_back(std::move(channel));
}

Client::Client(const std::string& target, int connections, int max_message_bytes) {
  for (int i = 0; i < std::max(1, connections); ++i) {
    channels_.push_back(MakeChannel(target, max_message_bytes, i));
    stubs_.push_back(wprep::v1::WeightPrep::NewStub(channels_.back()));
  }
}

absl::StatusOr<wprep::v1::PlanResponse> Client::Plan(const wprep::v1::PlanRequest& request,
                                                     const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::Plan, request, options);
}

absl::StatusOr<wprep::v1::ConvertResponse> Client::Convert(const wprep::v1::ConvertRequest& request,
                                                           const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::Convert, request, options);
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::ConvertStream(
    const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
    std::string* output, const StreamOptions& options) {
  return StreamTo(header, input, [output](uint64_t total) {
    output->resize(total);
    return reinterpret_cast<uint8_t*>(output->data());
  }, options);
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::ConvertStream(
    const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
    absl::Span<uint8_t> output, const StreamOptions& options) {
  return StreamTo(header, input, [output](uint64_t total) {
    return total == output.size() ? output.data() : nullptr;
  }, options);
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::StreamTo(
    const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input, const PlaceOutput& whole,
    const StreamOptions& options) {
  const Deadline deadline = DeadlineOf(options);
  // One ConvertStream of `h` on `stub`, retried as the options say.
  auto stream = [&](size_t connection, const wprep::v1::StreamRequestHeader& h, absl::Span<const uint8_t> in,
                    const PlaceOutput& place, ProgressTracker* tracker, int stripe) {
    return WithRetry<wprep::v1::StreamResponseHeader>(
        options.retry, deadline, channels_[connection].get(),
        [&] { return StreamOne(*stubs_[connection], h, in, place, options, deadline, tracker, stripe); });
  };
  const int64_t d0 = header.logical_shape_size() >= 3 ? header.logical_shape(0) : 0;
  const int parts = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(stubs_.size()), d0));
  if (parts < 2 || input.size() < options.stripe_min_bytes) {
    std::optional<ProgressTracker> tracker;
    if (options.progress) tracker.emplace(options.progress, input.size(), 1, 0);
    return stream(0, header, input, whole, tracker ? &*tracker : nullptr, 0);
  }
  // Striped: the full tensor's plan first (its output shape, strides and sizes), then one
  // stream per part of the first dim, each writing its own range of the output.
  wprep::v1::PlanRequest plan_req;
  *plan_req.mutable_spec() = header.spec();
  *plan_req.mutable_logical_shape() = header.logical_shape();
  absl::StatusOr<wprep::v1::PlanResponse> plan =
      Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::Plan, plan_req, options, deadline);
  if (!plan.ok()) return plan.status();
  if (plan->input_bytes() != input.size() || plan->input_bytes() % d0 != 0 ||
      plan->output_bytes() % d0 != 0) {
    std::optional<ProgressTracker> tracker;
    if (options.progress) tracker.emplace(options.progress, input.size(), 1, 0);
    return stream(0, header, input, whole, tracker ? &*tracker : nullptr, 0);  // the daemon explains
  }
  const uint64_t in_per = plan->input_bytes() / static_cast<uint64_t>(d0);
  const uint64_t out_per = plan->output_bytes() / static_cast<uint64_t>(d0);
  uint8_t* out = whole(plan->output_bytes());
  if (out == nullptr && plan->output_bytes() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the output buffer does not hold the ", plan->output_bytes(), " bytes this conversion writes"));
  }
  std::optional<ProgressTracker> tracker;
  if (options.progress) tracker.emplace(options.progress, input.size(), parts, plan->output_bytes());
  std::vector<absl::StatusOr<wprep::v1::StreamResponseHeader>> results(
      static_cast<size_t>(parts), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  int64_t first = 0;
  for (int i = 0; i < parts; ++i) {
    const int64_t count = d0 / parts + (i < d0 % parts ? 1 : 0);
    threads.emplace_back([&, i, first, count] {
      wprep::v1::StreamRequestHeader h = header;
      h.set_logical_shape(0, count);
      const uint64_t want = out_per * static_cast<uint64_t>(count);
      uint8_t* dst = out + out_per * static_cast<uint64_t>(first);
      results[static_cast<size_t>(i)] = stream(
          static_cast<size_t>(i), h,
          input.subspan(in_per * static_cast<uint64_t>(first), in_per * static_cast<uint64_t>(count)),
          [dst, want](uint64_t total) { return total == want ? dst : nullptr; },
          tracker ? &*tracker : nullptr, i);
    });
    first += count;
  }
  for (std::thread& t : threads) t.join();
  for (const auto& r : results) {
    if (!r.ok()) return r.status();
  }
  wprep::v1::StreamResponseHeader rh;
  *rh.mutable_output_shape() = plan->output_shape();
  *rh.mutable_output_strides() = plan->output_strides();
  rh.set_output_bytes(plan->output_bytes());
  rh.set_input_bytes(plan->input_bytes());
  rh.set_engine(results.front()->engine());
  *rh.mutable_identity() = plan->identity();
  return rh;
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::StreamOne(
    wprep::v1::WeightPrep::Stub& stub, const wprep::v1::StreamRequestHeader& header,
    absl::Span<const uint8_t> input, const PlaceOutput& place, const StreamOptions& options,
    std::optional<std::chrono::system_clock::time_point> deadline, ProgressTracker* progress,
    int stripe) {
  grpc::ClientContext ctx;
  ApplyOptions(options, deadline, &ctx);
  auto stream = stub.ConvertStream(&ctx);
  if (progress != nullptr) {
    progress->Sent(stripe, 0);  // an attempt starts its counts again
    progress->Received(stripe, 0);
  }
  // The writer runs beside the reader: the daemon answers slices while input still flows,
  // and a full window in one direction must not block the other.
  std::thread writer([&] {
    wprep::v1::ConvertStreamRequest msg;
    *msg.mutable_header() = header;
    if (!stream->Write(msg)) return;
    const uint64_t chunk = std::max<uint64_t>(1, options.chunk_bytes);
    wprep::v1::ConvertStreamRequest c;  // reused: its data buffer is allocated once
    for (uint64_t off = 0; off < input.size(); off += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, input.size() - off);
      c.mutable_chunk()->set_offset(off);
      c.mutable_chunk()->set_data(input.data() + off, n);
      if (!stream->Write(c)) return;
      if (progress != nullptr) progress->Sent(stripe, off + n);
    }
    stream->WritesDone();
  });
  wprep::v1::ConvertStreamResponse msg;
  wprep::v1::StreamResponseHeader rh;
  bool have_header = false;
  absl::Status local;
  uint8_t* out = nullptr;
  uint64_t got = 0;
  while (stream->Read(&msg)) {
    if (msg.has_header()) {
      rh = msg.header();
      have_header = true;
      out = place(rh.output_bytes());
      if (out == nullptr && rh.output_bytes() > 0) {
        local = absl::DataLossError(absl::StrCat("the daemon announced ", rh.output_bytes(),
                                                 " output bytes, more or fewer than the output buffer holds"));
        ctx.TryCancel();
        break;
      }
      if (progress != nullptr) progress->Announced(rh.output_bytes());
    } else if (msg.has_chunk()) {
      const auto& c = msg.chunk();
      if (!have_header || c.offset() != got || c.data().size() > rh.output_bytes() - got) {
        local = absl::DataLossError(absl::StrCat("daemon sent an out-of-order chunk at offset ",
                                                 c.offset(), " after ", got, " bytes"));
        ctx.TryCancel();
        break;
      }
      std::copy(c.data().begin(), c.data().end(), out + got);
      got += c.data().size();
      if (progress != nullptr) progress->Received(stripe, got);
    }
  }
  writer.join();
  grpc::Status s = stream->Finish();
  if (!local.ok()) return local;
  if (!s.ok()) return FromGrpcStatus(s);
  if (!have_header || got != rh.output_bytes()) {
    return absl::DataLossError(absl::StrCat("stream ended with ", got, " of ", rh.output_bytes(),
                                            " output bytes"));
  }
  return rh;
}

absl::StatusOr<wprep::v1::ConvertBatchResponse> Client::ConvertBatch(const wprep::v1::ConvertBatchRequest& request,
                                                                     const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::ConvertBatch, request, options);
}

absl::StatusOr<wprep::v1::ListDevicesResponse> Client::ListDevices(const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::ListDevices,
               wprep::v1::ListDevicesRequest(), options);
}

absl::StatusOr<wprep::v1::RegisterIpcHandlesResponse> Client::RegisterIpcHandles(
    const wprep::v1::RegisterIpcHandlesRequest& request, const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::RegisterIpcHandles, request, options);
}

absl::StatusOr<wprep::v1::ReleaseIpcHandlesResponse> Client::ReleaseIpcHandles(
    const wprep::v1::ReleaseIpcHandlesRequest& request, const CallOptions& options) {
  return Unary(*stubs_.front(), channels_.front().get(), &wprep::v1::WeightPrep::Stub::ReleaseIpcHandles, request, options);
}

}  // namespace wprep::client
