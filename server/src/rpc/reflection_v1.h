// grpc.reflection.v1.ServerReflection, served beside the v1alpha one of Debian's
// libgrpc++_reflection 1.51, which has no v1: current grpcurl and Postman ask v1 first
// and, on UNIMPLEMENTED, some do not fall back. It answers as gRPC's own v1 service does
// (src/cpp/ext/proto_server_reflection.cc), from protobuf's generated pool, which holds
// every file linked into the daemon. Built on the callback API: an open reflection
// stream holds no thread.
#ifndef WPREP_SERVER_SRC_REFLECTION_V1_H_
#define WPREP_SERVER_SRC_REFLECTION_V1_H_

#include <set>
#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace wprep::server {

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::CallbackService {
 public:
  // `services`: the full names list_services answers (the server's services; gRPC's
  // public API does not list a server's services, so the daemon names them).
  explicit ReflectionV1Service(std::vector<std::string> services);

  grpc::ServerBidiReactor<grpc::reflection::v1::ServerReflectionRequest,
                          grpc::reflection::v1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* ctx) override;

  // The answer to one request; `sent` holds the files this stream has already sent,
  // which are not sent again as dependencies (as gRPC's service does).
  void Answer(const grpc::reflection::v1::ServerReflectionRequest& req, std::set<std::string>* sent,
              grpc::reflection::v1::ServerReflectionResponse* resp) const;

 private:
  const std::vector<std::string> services_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_REFLECTION_V1_H_
