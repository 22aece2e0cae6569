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
}

}  // namespace

void TuneHeapForStreaming() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

wprep::v1::ConversionSpec SpecToProto(const ConversionSpec& spec) {
  wprep::v1::ConversionSpec p;
  p.set_layout(spec.layout == Layout::kHopperValue ? wprep::v1::LAYOUT_HOPPER_VALUE
                                                   : wprep::v1::LAYOUT_BLACKWELL_SHUFFLED_VALUE);
  switch (spec.direction) {
    case Direction::kSwizzle: p.set_direction(wprep::v1::DIRECTION_SWIZZLE); break;
    case Direction::kUnswizzle: p.set_direction(wprep::v1::DIRECTION_UNSWIZZLE); break;
    case Direction::kRetile: p.set_direction(wprep::v1::DIRECTION_RETILE); break;
  }
  p.mutable_hopper()->set_mx_axis(spec.hopper.mx_axis);
  p.mutable_hopper()->set_mma_version(spec.hopper.mma_version);
  p.mutable_blackwell()->set_block_k(spec.blackwell.block_k);
  p.mutable_blackwell()->set_block_n(spec.blackwell.block_n);
  p.mutable_blackwell_to()->set_block_k(spec.blackwell_to.block_k);
  p.mutable_blackwell_to()->set_block_n(spec.blackwell_to.block_n);
  return p;
}

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : stub_(wprep::v1::WeightPrep::NewStub(std::move(channel))) {}

absl::StatusOr<wprep::v1::PlanResponse> Client::Plan(const wprep::v1::PlanRequest& request,
                                                     const CallOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  wprep::v1::PlanResponse resp;
  grpc::Status s = stub_->Plan(&ctx, request, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<wprep::v1::ConvertResponse> Client::Convert(const wprep::v1::ConvertRequest& request,
                                                           const CallOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  wprep::v1::ConvertResponse resp;
  grpc::Status s = stub_->Convert(&ctx, request, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<wprep::v1::StreamResponseHeader> Client::ConvertStream(
    const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
    std::string* output, const StreamOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  auto stream = stub_->ConvertStream(&ctx);
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
  uint64_t got = 0;
  while (stream->Read(&msg)) {
    if (msg.has_header()) {
      rh = msg.header();
      have_header = true;
      output->resize(rh.output_bytes());
    } else if (msg.has_chunk()) {
      const auto& c = msg.chunk();
      if (!have_header || c.offset() != got || c.data().size() > output->size() - got) {
        local = absl::DataLossError(absl::StrCat("daemon sent an out-of-order chunk at offset ",
                                                 c.offset(), " after ", got, " bytes"));
        ctx.TryCancel();
        break;
      }
      std::copy(c.data().begin(), c.data().end(), output->begin() + static_cast<int64_t>(got));
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

absl::StatusOr<wprep::v1::ListDevicesResponse> Client::ListDevices(const CallOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  wprep::v1::ListDevicesResponse resp;
  grpc::Status s = stub_->ListDevices(&ctx, wprep::v1::ListDevicesRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<wprep::v1::ReleaseIpcHandlesResponse> Client::ReleaseIpcHandles(
    const wprep::v1::ReleaseIpcHandlesRequest& request, const CallOptions& options) {
  grpc::ClientContext ctx;
  ApplyOptions(options, &ctx);
  wprep::v1::ReleaseIpcHandlesResponse resp;
  grpc::Status s = stub_->ReleaseIpcHandles(&ctx, request, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

}  // namespace wprep::client
