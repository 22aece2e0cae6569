#include "wprep/server/rpc_warmup.h"

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
#include "wprep/client/client.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.pb.h"

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

absl::StatusOr<int> WarmUpRpcPath(const std::string& target, const std::string& token,
                                  absl::Duration bound, const std::atomic<bool>& stop) {
  const absl::Time deadline = absl::Now() + bound;
  std::shared_ptr<grpc::Channel> channel = client::MakeChannel(target);
  if (!channel->WaitForConnected(absl::ToChronoTime(std::min(deadline, absl::Now() + kConnectBound)))) {
    return absl::UnavailableError("could not connect");
  }
  client::Client client(channel);
  int calls = 0;
  // Options of the next call: the token and what is left of `bound`; Cancelled on stop.
  client::StreamOptions options;
  options.metadata = {{kWarmupMetadataKey, token}};
  auto next = [&]() -> absl::Status {
    if (stop.load()) return absl::CancelledError("shutting down");
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("took longer than ", absl::FormatDuration(bound)));
    }
    options.timeout = std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(left)));
    ++calls;
    return absl::OkStatus();
  };

  if (absl::Status s = next(); !s.ok()) return s;
  absl::StatusOr<v1::ListDevicesResponse> devices = client.ListDevices(options);
  if (!devices.ok()) return CallFailed("ListDevices", devices.status());
  // Every GPU by UUID; requests that name none go to the CPU engine when there is no GPU.
  std::vector<std::string> engines;
  for (const v1::DeviceInfo& d : devices->devices()) engines.push_back(d.uuid());
  if (engines.empty()) engines.push_back("");

  absl::StatusOr<Sized> sized = SizeFor(HopperSwizzle(-2), kShape);
  if (!sized.ok()) return sized.status();
  v1::PlanRequest plan_req;
  *plan_req.mutable_spec() = client::SpecToProto(HopperSwizzle(-2));
  for (int64_t d : kShape) plan_req.add_logical_shape(d);
  if (absl::Status s = next(); !s.ok()) return s;
  absl::StatusOr<v1::PlanResponse> plan = client.Plan(plan_req, options);
  if (!plan.ok()) return CallFailed("Plan", plan.status());
  if (absl::Status s = CheckBytes("Plan", plan->output_bytes(), sized->output_bytes); !s.ok()) return s;

  for (const std::string& uuid : engines) {
    for (const ConversionSpec& spec : {HopperSwizzle(-1), HopperSwizzle(-2), BlackwellSwizzle()}) {
      sized = SizeFor(spec, kShape);
      if (!sized.ok()) return sized.status();
      v1::ConvertRequest req;
      *req.mutable_spec() = client::SpecToProto(spec);
      for (int64_t d : kShape) req.add_logical_shape(d);
      req.set_source_bytes(std::move(sized->input));
      req.set_device_uuid(uuid);
      const std::string call = absl::StrCat("Convert ", Describe(spec));
      if (absl::Status s = next(); !s.ok()) return s;
      absl::StatusOr<v1::ConvertResponse> resp = client.Convert(req, options);
      if (!resp.ok()) return CallFailed(call, resp.status());
      if (absl::Status s = CheckBytes(call, resp->output_bytes_inline().size(), sized->output_bytes);
          !s.ok()) {
        return s;
      }
    }
    sized = SizeFor(HopperSwizzle(-2), kStreamShape);
    if (!sized.ok()) return sized.status();
    v1::StreamRequestHeader header;
    *header.mutable_spec() = client::SpecToProto(HopperSwizzle(-2));
    for (int64_t d : kStreamShape) header.add_logical_shape(d);
    header.set_device_uuid(uuid);
    std::string out;
    if (absl::Status s = next(); !s.ok()) return s;
    absl::StatusOr<v1::StreamResponseHeader> rh = client.ConvertStream(
        header,
        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(sized->input.data()),
                                  sized->input.size()),
        &out, options);
    if (!rh.ok()) return CallFailed("ConvertStream", rh.status());
    if (absl::Status s = CheckBytes("ConvertStream", out.size(), sized->output_bytes); !s.ok()) return s;
  }

  // No handles: both handlers validate and answer an empty list without touching a GPU.
  if (absl::Status s = next(); !s.ok()) return s;
  absl::StatusOr<v1::RegisterIpcHandlesResponse> reg =
      client.RegisterIpcHandles(v1::RegisterIpcHandlesRequest(), options);
  if (!reg.ok()) return CallFailed("RegisterIpcHandles", reg.status());
  if (absl::Status s = next(); !s.ok()) return s;
  absl::StatusOr<v1::ReleaseIpcHandlesResponse> rel =
      client.ReleaseIpcHandles(v1::ReleaseIpcHandlesRequest(), options);
  if (!rel.ok()) return CallFailed("ReleaseIpcHandles", rel.status());
  return calls;
}

}  // namespace wprep::server
