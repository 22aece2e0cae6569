// C++ client of wprep.v1.WeightPrep: typed helpers over a grpc::Channel that return
// absl::Status (the gRPC code and message preserved) and stream tensors in chunks.
#ifndef WPREP_CLIENT_CLIENT_H_
#define WPREP_CLIENT_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "wprep/kernels/spec.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::client {

// A channel to "unix:///path" or "HOST:PORT" (insecure: wprepd listens on local
// addresses), accepting messages up to `max_message_bytes`.
// For programs that stream large tensors: keeps glibc's multi-MiB buffers (messages,
// chunks) in the heap instead of mapping and unmapping each one, which otherwise costs a
// page fault per 4 KiB on every chunk. Process-wide; call once early in main().
void TuneHeapForStreaming();

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           int max_message_bytes = 256 << 20);

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// wprep::ConversionSpec -> its protobuf form (every parameter set explicitly).
wprep::v1::ConversionSpec SpecToProto(const ConversionSpec& spec);

struct CallOptions {
  // Deadline from now; unset = none.
  std::optional<std::chrono::milliseconds> timeout;
};

struct StreamOptions : CallOptions {
  // Input chunk size; the daemon accepts up to 4 MiB.
  uint64_t chunk_bytes = 1ull << 20;
};

// Thread-safe (gRPC stubs are); one Client may serve many threads.
class Client {
 public:
  explicit Client(std::shared_ptr<grpc::Channel> channel);

  absl::StatusOr<wprep::v1::PlanResponse> Plan(const wprep::v1::PlanRequest& request,
                                               const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ConvertResponse> Convert(const wprep::v1::ConvertRequest& request,
                                                     const CallOptions& options = {});
  // Sends `header` then `input` in chunks, and collects the output into `*output`
  // (resized to the announced size). Returns the response header.
  absl::StatusOr<wprep::v1::StreamResponseHeader> ConvertStream(
      const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
      std::string* output, const StreamOptions& options = {});
  absl::StatusOr<wprep::v1::ListDevicesResponse> ListDevices(const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ReleaseIpcHandlesResponse> ReleaseIpcHandles(
      const wprep::v1::ReleaseIpcHandlesRequest& request, const CallOptions& options = {});

  wprep::v1::WeightPrep::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<wprep::v1::WeightPrep::Stub> stub_;
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_CLIENT_H_
