#include "rpc/rpc_warmup.h"

#include <sys/random.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "rpc/status.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/spec/status_macros.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::server {
namespace {

namespace v1 = wprep::v1;

// A connection to one of our own listeners is made at once or not at all.
constexpr absl::Duration kConnectBound = absl::Seconds(2);
// One Hopper tile: microseconds of work on any engine. Streams send two of them, so
// the stream path slices by matrix as it does for real tensors.
constexpr int64_t kShape[] = {256, 128};
constexpr int64_t kStreamShape[] = {2, 256, 128};

ConversionSpec HopperSwizzle(int mx_axis) {
  ConversionSpec s;
  s.layout = Layout::kHopperValue;
  s.direction = Direction::kSwizzle;
  s.hopper.mx_axis = mx_axis;
  return s;
}

ConversionSpec BlackwellSwizzle() {
  ConversionSpec s;
  s.layout = Layout::kBlackwellShuffledValue;
  s.direction = Direction::kSwizzle;
  return s;
}

// The failure of the warm-up: which call, with the status it got.
absl::Status CallFailed(absl::string_view call, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(call, ": ", s.message()));
}

// The planned output size, and a zero input of the planned size.
struct Sized {
  std::string input;
  uint64_t output_bytes = 0;
};
absl::StatusOr<Sized> SizeFor(const ConversionSpec& spec, absl::Span<const int64_t> shape) {
  absl::StatusOr<Plan> plan = MakePlan(spec, shape);
  if (!plan.ok()) return CallFailed(absl::StrCat("plan of ", Describe(spec)), plan.status());
  return Sized{std::string(plan->input_bytes, '\0'), plan->output_bytes};
}

absl::Status CheckBytes(absl::string_view call, uint64_t got, uint64_t want) {
  if (got == want) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(call, ": ", got, " output bytes, expected ", want));
}

}  // namespace

std::string NewWarmupToken() {
  uint8_t bytes[16];
  // getrandom(2) does not return short for 16 bytes; were it unavailable, random_device
  // is still unpredictable to other processes.
  if (getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
    std::random_device rd;
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rd());
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

std::string WarmupTarget(const std::string& listen_address, int bound_port) {
  if (absl::StartsWith(listen_address, "unix://")) return listen_address;
  std::string host = listen_address.substr(0, listen_address.rfind(':'));
  if (host == "0.0.0.0") host = "127.0.0.1";
  if (host == "[::]") host = "[::1]";
  return absl::StrCat(host, ":", bound_port);
}

namespace {

// One unary call on the warm-up's stub with its metadata and deadline.
template <typename Request, typename Response>
absl::Status Call(v1::WeightPrep::Stub& stub,
                  grpc::Status (v1::WeightPrep::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                  const Request& req, Response* resp, const std::string& token, absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kWarmupMetadataKey, token);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  return FromGrpc((stub.*method)(&ctx, req, resp));
}

// One ConvertStream of `input` in one chunk; the output bytes received.
absl::StatusOr<uint64_t> Stream(v1::WeightPrep::Stub& stub, const v1::StreamRequestHeader& header,
                                const std::string& input, const std::string& token, absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kWarmupMetadataKey, token);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  auto stream = stub.ConvertStream(&ctx);
  v1::ConvertStreamRequest msg;
  *msg.mutable_header() = header;
  bool ok = stream->Write(msg);
  if (ok && !input.empty()) {
    msg.mutable_chunk()->set_offset(0);
    msg.mutable_chunk()->set_data(input);
    ok = stream->Write(msg);
  }
  if (ok) stream->WritesDone();
  uint64_t got = 0;
  v1::ConvertStreamResponse resp;
  while (stream->Read(&resp)) {
    if (resp.has_chunk()) got += resp.chunk().data().size();
  }
  WPREP_RETURN_IF_ERROR(FromGrpc(stream->Finish()));
  return got;
}

}  // namespace

absl::StatusOr<int> WarmUpRpcPath(const std::string& target, const std::string& token,
                                  absl::Duration bound, const std::atomic<bool>& stop) {
  const absl::Time deadline = absl::Now() + bound;
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(absl::ToChronoTime(std::min(deadline, absl::Now() + kConnectBound)))) {
    return absl::UnavailableError("could not connect");
  }
  std::unique_ptr<v1::WeightPrep::Stub> stub = v1::WeightPrep::NewStub(channel);
  int calls = 0;
  // Before each call: Cancelled on stop, DeadlineExceeded once `bound` is spent.
  auto next = [&]() -> absl::Status {
    if (stop.load()) return absl::CancelledError("shutting down");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("took longer than ", absl::FormatDuration(bound)));
    }
    ++calls;
    return absl::OkStatus();
  };

  WPREP_RETURN_IF_ERROR(next());
  v1::ListDevicesResponse devices;
  if (absl::Status s = Call(*stub, &v1::WeightPrep::Stub::ListDevices, v1::ListDevicesRequest(), &devices,
                            token, deadline);
      !s.ok()) {
    return CallFailed("ListDevices", s);
  }
  // Every GPU by UUID; requests that name none go to the CPU engine when there is no GPU.
  std::vector<std::string> engines;
  for (const v1::DeviceInfo& d : devices.devices()) engines.push_back(d.uuid());
  if (engines.empty()) engines.push_back("");

  WPREP_ASSIGN_OR_RETURN(Sized sized, SizeFor(HopperSwizzle(-2), kShape));
  v1::PlanRequest plan_req;
  *plan_req.mutable_spec() = SpecToProto(HopperSwizzle(-2));
  for (int64_t d : kShape) plan_req.add_logical_shape(d);
  WPREP_RETURN_IF_ERROR(next());
  v1::PlanResponse plan;
  if (absl::Status s = Call(*stub, &v1::WeightPrep::Stub::Plan, plan_req, &plan, token, deadline); !s.ok()) {
    return CallFailed("Plan", s);
  }
  WPREP_RETURN_IF_ERROR(CheckBytes("Plan", plan.output_bytes(), sized.output_bytes));

  for (const std::string& uuid : engines) {
    for (const ConversionSpec& spec : {HopperSwizzle(-1), HopperSwizzle(-2), BlackwellSwizzle()}) {
      WPREP_ASSIGN_OR_RETURN(sized, SizeFor(spec, kShape));
      v1::ConvertRequest req;
      *req.mutable_spec() = SpecToProto(spec);
      for (int64_t d : kShape) req.add_logical_shape(d);
      req.set_source_bytes(std::move(sized.input));
      req.set_device_uuid(uuid);
      const std::string call = absl::StrCat("Convert ", Describe(spec));
      WPREP_RETURN_IF_ERROR(next());
      v1::ConvertResponse resp;
      if (absl::Status s = Call(*stub, &v1::WeightPrep::Stub::Convert, req, &resp, token, deadline); !s.ok()) {
        return CallFailed(call, s);
      }
      WPREP_RETURN_IF_ERROR(CheckBytes(call, resp.output_bytes_inline().size(), sized.output_bytes));
    }
    WPREP_ASSIGN_OR_RETURN(sized, SizeFor(HopperSwizzle(-2), kStreamShape));
    v1::StreamRequestHeader header;
    *header.mutable_spec() = SpecToProto(HopperSwizzle(-2));
    for (int64_t d : kStreamShape) header.add_logical_shape(d);
    header.set_device_uuid(uuid);
    WPREP_RETURN_IF_ERROR(next());
    absl::StatusOr<uint64_t> out = Stream(*stub, header, sized.input, token, deadline);
    if (!out.ok()) return CallFailed("ConvertStream", out.status());
    WPREP_RETURN_IF_ERROR(CheckBytes("ConvertStream", *out, sized.output_bytes));
  }

  // No handles: both handlers validate and answer an empty list without touching a GPU.
  WPREP_RETURN_IF_ERROR(next());
  v1::RegisterIpcHandlesResponse reg;
  if (absl::Status s = Call(*stub, &v1::WeightPrep::Stub::RegisterIpcHandles, v1::RegisterIpcHandlesRequest(),
                            &reg, token, deadline);
      !s.ok()) {
    return CallFailed("RegisterIpcHandles", s);
  }
  WPREP_RETURN_IF_ERROR(next());
  v1::ReleaseIpcHandlesResponse rel;
  if (absl::Status s = Call(*stub, &v1::WeightPrep::Stub::ReleaseIpcHandles, v1::ReleaseIpcHandlesRequest(),
                            &rel, token, deadline);
      !s.ok()) {
    return CallFailed("ReleaseIpcHandles", s);
  }
  return calls;
}

}  // namespace wprep::server
