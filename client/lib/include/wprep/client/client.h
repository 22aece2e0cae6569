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
// `connection` numbers never share a connection. A lost connection is retried within
// 0.1 s to 1 s (gRPC's default waits up to 2 minutes).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           int max_message_bytes = 256 << 20, int connection = 0);

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Retries of a call that ends with UNAVAILABLE: no daemon listening yet (it is starting,
// or restarting), a connection lost, a daemon draining. Every wprep.v1 method is safe to
// retry: Plan and ListDevices read only; a conversion's output is a pure function of its
// spec and input bytes, so running it again writes the same bytes into the same
// destination (inline or CUDA IPC), even where an attempt that failed had written part
// of them or still runs in the daemon; RegisterIpcHandles opens a mapping or keeps it,
// and ReleaseIpcHandles ignores handles it does not know. What the caller must keep
// (as for any call): the source unchanged, and the destination unread, until the call
// returns. Other codes are never retried: INVALID_ARGUMENT and RESOURCE_EXHAUSTED say
// the same thing again, and DEADLINE_EXCEEDED means the time is up.
struct RetryPolicy {
  // Attempts in all, the first included; 1 = no retry.
  int max_attempts = 1;
  // Wait before the second attempt; each later wait is `multiplier` times the one before,
  // at most `max_backoff`. Each wait is drawn from [75%, 100%] of that, so clients that
  // lost the same daemon do not come back in step.
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{2000};
  double multiplier = 2.0;
};

struct CallOptions {
  // Deadline of the whole call from now, its retries and their waits included; unset =
  // none. A call past it ends with DEADLINE_EXCEEDED (or the last attempt's UNAVAILABLE
  // when the deadline falls in a wait).
  std::optional<std::chrono::milliseconds> timeout;
  // Extra request metadata (keys lower-case), sent with every call made with these options.
  std::vector<std::pair<std::string, std::string>> metadata;
  // Retries on UNAVAILABLE (default: none).
  RetryPolicy retry;
};

// How far a ConvertStream has come, counted over all its stripes.
struct StreamProgress {
  uint64_t bytes_sent = 0;      // input bytes handed to gRPC so far
  uint64_t bytes_received = 0;  // output bytes received so far
  uint64_t input_bytes = 0;     // input bytes in all
  uint64_t output_bytes = 0;    // output bytes in all; 0 until the daemon announced them
};

struct StreamOptions : CallOptions {
  // Input chunk size; the daemon accepts up to 4 MiB.
  uint64_t chunk_bytes = 1ull << 20;
  // A tensor of at least this many input bytes, with a leading dim, is striped: its
  // first dim is cut into one part per connection of the Client, each part its own
  // ConvertStream on its own connection, all at once. One connection moves about
  // 1.4 GB/s on an H200 host whatever the engine; two move about 2 (docs/PERFORMANCE.md).
  uint64_t stripe_min_bytes = 16ull << 20;
  // Called after every chunk sent or received (and once when the output size is known),
  // with the call's totals so far. Calls never overlap (they are serialized) but come
  // from the call's own threads, so keep it short. A retried attempt starts its
  // stripe's counts again from 0, so the counts may go back once.
  std::function<void(const StreamProgress&)> progress;
};

// Thread-safe (gRPC stubs are); one Client may serve many threads.
class Client {
 public:
  // One connection.
  explicit Client(std::shared_ptr<grpc::Channel> channel);
  // `connections` connections to `target` (at least one): unary calls use the first,
  // large ConvertStreams stripe over all of them.
  explicit Client(const std::string& target, int connections = 2, int max_message_bytes = 256 << 20);

  // Every method returns the daemon's status (code and message) or a local one
  // (DATA_LOSS for a stream that broke its own contract), after the retries `options`
  // allow.
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
  // The same, writing the output into `output` (e.g. pinned memory, or a mapped file),
  // which must hold exactly the output's bytes: the daemon's announcement of another
  // size ends the call with DATA_LOSS (InvalidArgument when striped, from the plan),
  // before anything is written.
  absl::StatusOr<wprep::v1::StreamResponseHeader> ConvertStream(
      const wprep::v1::StreamRequestHeader& header, absl::Span<const uint8_t> input,
      absl::Span<uint8_t> output, const StreamOptions& options = {});
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
  class ProgressTracker;
  using PlaceOutput = std::function<uint8_t*(uint64_t total)>;
  // Both ConvertStreams: `whole(total)` returns where the tensor's `total` output bytes
  // go, or nullptr when they do not fit.
  absl::StatusOr<wprep::v1::StreamResponseHeader> StreamTo(const wprep::v1::StreamRequestHeader& header,
                                                           absl::Span<const uint8_t> input, const PlaceOutput& whole,
                                                           const StreamOptions& options);
  // One ConvertStream attempt on `stub` with deadline `deadline`; `place(total)` returns
  // where the `total` output bytes go. Reports to `progress` as stripe `stripe`.
  absl::StatusOr<wprep::v1::StreamResponseHeader> StreamOne(
      wprep::v1::WeightPrep::Stub& stub, const wprep::v1::StreamRequestHeader& header,
      absl::Span<const uint8_t> input, const PlaceOutput& place, const StreamOptions& options,
      std::optional<std::chrono::system_clock::time_point> deadline, ProgressTracker* progress,
      int stripe);

  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // one per connection
  std::vector<std::unique_ptr<wprep::v1::WeightPrep::Stub>> stubs_;  // on channels_
};

}  // namespace wprep::client

#endif  // WPREP_CLIENT_CLIENT_H_
