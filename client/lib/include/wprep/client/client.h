// C++ client of wprep.v1.WeightPrep: typed helpers over a grpc::Channel that return
// absl::Status (the gRPC code and message preserved) and stream tensors in chunks.
#ifndef WPREP_CLIENT_CLIENT_H_
#define WPREP_CLIENT_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "wprep/proto/spec_codec.h"  // SpecToProto for building requests
#include "wprep/spec/spec.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::client {

// For programs that stream large tensors: keeps glibc's multi-MiB buffers (messages,
// chunks) in the heap instead of mapping and unmapping each one, which otherwise costs a
// page fault per 4 KiB on every chunk. Process-wide; call once early in main().
void TuneHeapForStreaming();

// A channel to "unix:///path" or "HOST:PORT" (insecure: wprepd listens on local
// addresses), accepting messages up to `max_message_bytes`. Channels with different
// `connection` numbers never share a connection.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           int max_message_bytes = 256 << 20, int connection = 0);

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

struct CallOptions {
  // Deadline from now; unset = none.
  std::optional<std::chrono::milliseconds> timeout;
  // Extra request metadata (keys lower-case), sent with every call made with these options.
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct StreamOptions : CallOptions {
  // Input chunk size; the daemon accepts up to 4 MiB.
  uint64_t chunk_bytes = 1ull << 20;
  // A tensor of at least this many input bytes, with a leading dim, is striped: its
  // first dim is cut into one part per connection of the Client, each part its own
  // ConvertStream on its own connection, all at once. One connection moves about
  // 1.4 GB/s on an H200 host whatever the engine; two move about 2 (docs/PERFORMANCE.md).
  uint64_t stripe_min_bytes = 16ull << 20;
};

// Thread-safe (gRPC stubs are); one Client may serve many threads.
class Client {
 public:
  // One connection.
  explicit Client(std::shared_ptr<grpc::Channel> channel);
  // `connections` connections to `target` (at least one): unary calls use the first,
  // large ConvertStreams stripe over all of them.
  explicit Client(const std::string& target, int connections = 2, int max_message_bytes = 256 << 20);

  absl::StatusOr<wprep::v1::PlanResponse> Plan(const wprep::v1::PlanRequest& request,
                                               const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ConvertResponse> Convert(const wprep::v1::ConvertRequest& request,
                                                     const CallOptions& options = {});
  // Sends `header` then `input` in chunks, and collects the output into `*output`
  // (resized to the announced size). Returns the response header. Large tensors stripe
  // over the Client's connections (StreamOptions::stripe_min_bytes); the output and the
  // returned header are the same either way.
  absl::StatusOr<wprep::v1::StreamResponseHeader> ConvertStream(
      const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
      std::string* output, const StreamOptions& options = {});
  // Many tensors in one round trip (see the .proto): a projection's values and scales,
  // a layer, a model's experts.
  absl::StatusOr<wprep::v1::ConvertBatchResponse> ConvertBatch(const wprep::v1::ConvertBatchRequest& request,
                                                               const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ListDevicesResponse> ListDevices(const CallOptions& options = {});
  // Maps IPC allocations in the daemon ahead of the Converts that use them (see the
  // .proto): register a pool of buffers once, and no Convert pays for opening them.
  absl::StatusOr<wprep::v1::RegisterIpcHandlesResponse> RegisterIpcHandles(
      const wprep::v1::RegisterIpcHandlesRequest& request, const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ReleaseIpcHandlesResponse> ReleaseIpcHandles(
      const wprep::v1::ReleaseIpcHandlesRequest& request, const CallOptions& options = {});

  wprep::v1::WeightPrep::Stub& stub() { return *stubs_.front(); }

 private:
  // One ConvertStream on `stub`; `place(total)` returns where the `total` output bytes go.
  using PlaceOutput = std::function<uint8_t*(uint64_t total)>;
  absl::StatusOr<wprep::v1::StreamResponseHeader> StreamOne(
      wprep::v1::WeightPrep::Stub& stub, const wprep::v1::StreamRequestHeader& header,
      absl::Span<const uint8_t> input, const PlaceOutput& place, const StreamOptions& options);

  std::vector<std::unique_ptr<wprep::v1::WeightPrep::Stub>> stubs_;
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_CLIENT_H_
