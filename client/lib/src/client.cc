#include "wprep/client/client.h"

#include <malloc.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace wprep::client {
namespace {

void ApplyOptions(const CallOptions& o, grpc::ClientContext* ctx) {
  if (o.timeout) ctx->set_deadline(std::chrono::system_clock::now() + *o.timeout);
  for (const auto& [key, value] : o.metadata) ctx->AddMetadata(key, value);
}

// One unary call of `method` on `stub`, its grpc::Status translated.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(wprep::v1::WeightPrep::Stub& stub,
                               grpc::Status (wprep::v1::WeightPrep::Stub::*method)(
                                   grpc::ClientContext*, const Request&, Response*),
                               const Request& request, const CallOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  Response resp;
  grpc::Status s = (stub.*method)(&ctx, request, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

}  // namespace

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
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

Client::Client(std::shared_ptr<grpc::Channel> channel) {
  stubs_.push_back(wprep::v1::WeightPrep::NewStub(std::move(channel)));
}

Client::Client(const std::string& target, int connections, int max_message_bytes) {
  for (int i = 0; i < std::max(1, connections); ++i) {
    stubs_.push_back(wprep::v1::WeightPrep::NewStub(MakeChannel(target, max_message_bytes, i)));
  }
}

absl::StatusOr<wprep::v1::PlanResponse> Client::Plan(const wprep::v1::PlanRequest& request,
                                                     const CallOptions& options) {
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::Plan, request, options);
}

absl::StatusOr<wprep::v1::ConvertResponse> Client::Convert(const wprep::v1::ConvertRequest& request,
                                                           const CallOptions& options) {
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::Convert, request, options);
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::ConvertStream(
    const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
    std::string* output, const StreamOptions& options) {
  const PlaceOutput whole = [output](uint64_t total) {
    output->resize(total);
    return reinterpret_cast<uint8_t*>(output->data());
  };
  const int64_t d0 = header.logical_shape_size() >= 3 ? header.logical_shape(0) : 0;
  const int parts = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(stubs_.size()), d0));
  if (parts < 2 || input.size() < options.stripe_min_bytes) {
    return StreamOne(*stubs_.front(), header, input, whole, options);
  }
  // Striped: the full tensor's plan first (its output shape, strides and sizes), then one
  // stream per part of the first dim, each writing its own range of the output.
  wprep::v1::PlanRequest plan_req;
  *plan_req.mutable_spec() = header.spec();
  *plan_req.mutable_logical_shape() = header.logical_shape();
  absl::StatusOr<wprep::v1::PlanResponse> plan = Plan(plan_req, options);
  if (!plan.ok()) return plan.status();
  if (plan->input_bytes() != input.size() || plan->input_bytes() % d0 != 0 ||
      plan->output_bytes() % d0 != 0) {
    return StreamOne(*stubs_.front(), header, input, whole, options);  // the daemon explains
  }
  const uint64_t in_per = plan->input_bytes() / static_cast<uint64_t>(d0);
  const uint64_t out_per = plan->output_bytes() / static_cast<uint64_t>(d0);
  output->resize(plan->output_bytes());
  uint8_t* out = reinterpret_cast<uint8_t*>(output->data());
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
      results[static_cast<size_t>(i)] = StreamOne(
          *stubs_[static_cast<size_t>(i)], h,
          input.subspan(in_per * static_cast<uint64_t>(first), in_per * static_cast<uint64_t>(count)),
          [dst, want](uint64_t total) { return total == want ? dst : nullptr; }, options);
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
  return rh;
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::StreamOne(
    wprep::v1::WeightPrep::Stub& stub, const wprep::v1::StreamRequestHeader& header,
    absl::Span<const uint8_t> input, const PlaceOutput& place, const StreamOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  auto stream = stub.ConvertStream(&ctx);
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
        local = absl::DataLossError(absl::StrCat("daemon announced ", rh.output_bytes(),
                                                 " output bytes for a stripe of another size"));
        ctx.TryCancel();
        break;
      }
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
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::ConvertBatch, request, options);
}

absl::StatusOr<wprep::v1::ListDevicesResponse> Client::ListDevices(const CallOptions& options) {
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::ListDevices,
               wprep::v1::ListDevicesRequest(), options);
}

absl::StatusOr<wprep::v1::RegisterIpcHandlesResponse> Client::RegisterIpcHandles(
    const wprep::v1::RegisterIpcHandlesRequest& request, const CallOptions& options) {
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::RegisterIpcHandles, request, options);
}

absl::StatusOr<wprep::v1::ReleaseIpcHandlesResponse> Client::ReleaseIpcHandles(
    const wprep::v1::ReleaseIpcHandlesRequest& request, const CallOptions& options) {
  return Unary(*stubs_.front(), &wprep::v1::WeightPrep::Stub::ReleaseIpcHandles, request, options);
}

}  // namespace wprep::client
