// C++ client of wprep.v1.WeightSets: resident weight sets (load, list, attach, detach,
// drop), returning absl::Status with the daemon's code and message. The attached memory
// is what AttachWeightsResponse names: a host set's shared-memory file (shm_path, mapped
// read-only) or a GPU set's CUDA IPC handle (ipc_handle, opened with cudaIpcOpenMemHandle
// on the GPU whose UUID manifest.device_uuid gives); tensor t lies at
// manifest.tensors[t].offset. Opening it is the caller's. A GPU set loaded with vmm gives
// instead a token (AttachWeightsResponse.vmm) for FetchVmmDescriptor.
#ifndef WPREP_CLIENT_WEIGHTS_H_
#define WPREP_CLIENT_WEIGHTS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "wprep/client/client.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::client {

// Thread-safe; one WeightSets may serve many threads. No call is retried: a load that
// failed half way left nothing behind, so the caller may simply call again.
class WeightSets {
 public:
  explicit WeightSets(std::shared_ptr<grpc::Channel> channel);
  explicit WeightSets(const std::string& target);

  // LoadWeights: `progress` (may be empty) sees every message, the first after planning,
  // one per tensor, the last with the manifest; returns the last.
  absl::StatusOr<wprep::v1::LoadWeightsResponse> Load(
      const wprep::v1::LoadWeightsRequest& request,
      const std::function<void(const wprep::v1::LoadWeightsResponse&)>& progress = {},
      const CallOptions& options = {});
  absl::StatusOr<wprep::v1::ListWeightsResponse> List(bool with_tensors = false, const CallOptions& options = {});
  // DropWeights: the bytes freed. FAILED_PRECONDITION while attached unless `force`.
  absl::StatusOr<uint64_t> Drop(const std::string& name, bool force = false, const CallOptions& options = {});

  // An open attachment: the AttachWeights stream, held open until Detach() or the
  // object's end (which cancels it: the daemon detaches a cancelled stream as it does a
  // client that exits).
  class Attachment {
   public:
    ~Attachment();
    Attachment(const Attachment&) = delete;
    Attachment& operator=(const Attachment&) = delete;
    // The manifest and where the set's memory is.
    const wprep::v1::AttachWeightsResponse& info() const { return info_; }
    // DetachWeights, then waits for the daemon to end the stream, so that ListWeights no
    // longer counts the attachment when it returns. OK if it had ended already (a forced
    // drop): the status the stream ended with is ended().
    absl::Status Detach(const CallOptions& options = {});
    // How the stream ended (OK after Detach, ABORTED after a forced drop, UNAVAILABLE
    // when the daemon stopped); blocks until it has.
    absl::Status ended();

   private:
    friend class WeightSets;
    Attachment(WeightSets* owner, std::unique_ptr<grpc::ClientContext> ctx,
               std::unique_ptr<grpc::ClientReader<wprep::v1::AttachWeightsResponse>> reader,
               wprep::v1::AttachWeightsResponse info)
        : owner_(owner), ctx_(std::move(ctx)), reader_(std::move(reader)), info_(std::move(info)) {}
    WeightSets* owner_;
    std::unique_ptr<grpc::ClientContext> ctx_;
    std::unique_ptr<grpc::ClientReader<wprep::v1::AttachWeightsResponse>> reader_;
    wprep::v1::AttachWeightsResponse info_;
    std::optional<absl::Status> end_;
  };
  // AttachWeights; NOT_FOUND for an unknown set. The WeightSets must outlive the result.
  absl::StatusOr<std::unique_ptr<Attachment>> Attach(const std::string& name, const CallOptions& options = {});

  wprep::v1::WeightSets::Stub& stub() { return *stub_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<wprep::v1::WeightSets::Stub> stub_;
};

// The descriptor of a GPU set in CUDA virtual memory: a POSIX fd of its one physical
// chunk of `chunk_bytes`, to map with cuMemImportFromShareableHandle, cuMemAddressReserve,
// cuMemMap and cuMemSetAccess. The caller closes fd.
struct VmmDescriptor {
  int fd = -1;
  uint64_t chunk_bytes = 0;
};

// Fetches it from the daemon's handle socket, the sibling "<socket_path>.handles" of the
// Unix API socket the attachment came over, with the token of AttachWeightsResponse.vmm.
// Once per attachment, from the attaching process; the daemon's refusals come back with
// their code and message (PERMISSION_DENIED for a token that is spent, ended or not this
// process's), UNAVAILABLE when the socket cannot be reached.
absl::StatusOr<VmmDescriptor> FetchVmmDescriptor(const std::string& socket_path, const std::string& token);

}  // namespace wprep::client

#endif  // WPREP_CLIENT_WEIGHTS_H_
