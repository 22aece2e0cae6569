// The gRPC handlers of wprep.v1.WeightSets: the wire edge of the weight store
// (exec/weight_store.h). Every request field is checked here, errors naming it; the
// store sees no protobuf type.
#ifndef WPREP_SERVER_SRC_RPC_WEIGHTS_SERVICE_H_
#define WPREP_SERVER_SRC_RPC_WEIGHTS_SERVICE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "exec/weight_store.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::server {

// A set of a --preload file, checked as LoadWeights checks its request.
struct PreloadSet {
  std::string name;
  std::string path;
  std::vector<WeightRuleSpec> rules;
  WeightPlacement place;
};
// The sets of `path`, a text-format wprep.v1.WeightPreload; INVALID_ARGUMENT naming the file
// and the entry (sets[i].rules[j]...) for a file that cannot be read or parsed or a set
// LoadWeights would refuse before reading its checkpoint.
absl::StatusOr<std::vector<PreloadSet>> ReadWeightPreload(const std::string& path);

// The store's manifest as the wire has it (tensors left out unless `with_tensors`).
void WeightManifestToProto(const WeightManifestData& manifest, bool with_tensors, wprep::v1::WeightManifest* out);

class WeightSetsService final : public wprep::v1::WeightSets::Service {
 public:
  // Borrows `store`, which must outlive the service.
  explicit WeightSetsService(WeightStore* store) : store_(store) {}

  grpc::Status LoadWeights(grpc::ServerContext* ctx, const wprep::v1::LoadWeightsRequest* req,
                           grpc::ServerWriter<wprep::v1::LoadWeightsResponse>* writer) override;
  grpc::Status ListWeights(grpc::ServerContext* ctx, const wprep::v1::ListWeightsRequest* req,
                           wprep::v1::ListWeightsResponse* resp) override;
  // Holds the handler (one gRPC thread) for as long as the attachment lasts.
  grpc::Status AttachWeights(grpc::ServerContext* ctx, const wprep::v1::AttachWeightsRequest* req,
                             grpc::ServerWriter<wprep::v1::AttachWeightsResponse>* writer) override;
  grpc::Status DetachWeights(grpc::ServerContext* ctx, const wprep::v1::DetachWeightsRequest* req,
                             wprep::v1::DetachWeightsResponse* resp) override;
  grpc::Status DropWeights(grpc::ServerContext* ctx, const wprep::v1::DropWeightsRequest* req,
                           wprep::v1::DropWeightsResponse* resp) override;

 private:
  WeightStore* const store_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_RPC_WEIGHTS_SERVICE_H_
