#include "rpc/reflection_v1.h"

#include <utility>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"

namespace wprep::server {

using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

namespace {

void SetError(grpc::StatusCode code, const std::string& message, ServerReflectionResponse* resp) {
  resp->mutable_error_response()->set_error_code(code);
  resp->mutable_error_response()->set_error_message(message);
}

// `file` and every file it imports, transitively, less the imports already in `sent`: a
// client builds its own pool from the answers, which needs every dependency once. The file
// asked for is always sent: gRPC's service leaves the answer empty (no answer case at all)
// when it was sent before on the stream, which a client cannot tell from a broken answer.
void AddFiles(const FileDescriptor* file, std::set<std::string>* sent, ServerReflectionResponse* resp) {
  std::vector<const FileDescriptor*> todo = {file};
  while (!todo.empty()) {
    const FileDescriptor* f = todo.back();
    todo.pop_back();
    if (!sent->insert(f->name()).second && f != file) continue;
    google::protobuf::FileDescriptorProto proto;
    f->CopyTo(&proto);
    proto.SerializeToString(resp->mutable_file_descriptor_response()->add_file_descriptor_proto());
    for (int i = 0; i < f->dependency_count(); ++i) todo.push_back(f->dependency(i));
  }
}

// One ServerReflectionInfo stream: reads a request, writes its answer, reads the next,
// until the client half-closes.
class InfoReactor final : public grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse> {
 public:
  explicit InfoReactor(const ReflectionV1Service* service) : service_(service) { StartRead(&req_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or went away): the stream ends
      Finish(grpc::Status::OK);
      return;
    }
    resp_.Clear();
    service_->Answer(req_, &sent_, &resp_);
    StartWrite(&resp_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the reflection client went away"));
      return;
    }
    StartRead(&req_);
  }
  void OnDone() override { delete this; }

 private:
  const ReflectionV1Service* const service_;
  ServerReflectionRequest req_;
  ServerReflectionResponse resp_;
  std::set<std::string> sent_;
};

}  // namespace

ReflectionV1Service::ReflectionV1Service(std::vector<std::string> services) : services_(std::move(services)) {}

grpc::ServerBidiReactor<ServerReflectionRequest, ServerReflectionResponse>* ReflectionV1Service::ServerReflectionInfo(
    grpc::CallbackServerContext*) {
  return new InfoReactor(this);
}

void ReflectionV1Service::Answer(const ServerReflectionRequest& req, std::set<std::string>* sent,
                                 ServerReflectionResponse* resp) const {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  resp->set_valid_host(req.host());
  *resp->mutable_original_request() = req;
  switch (req.message_request_case()) {
    case ServerReflectionRequest::kListServices:
      for (const std::string& name : services_) resp->mutable_list_services_response()->add_service()->set_name(name);
      return;
    case ServerReflectionRequest::kFileByFilename: {
      const FileDescriptor* file = pool->FindFileByName(req.file_by_filename());
      if (file == nullptr) return SetError(grpc::StatusCode::NOT_FOUND, "File not found.", resp);
      return AddFiles(file, sent, resp);
    }
    case ServerReflectionRequest::kFileContainingSymbol: {
      const FileDescriptor* file = pool->FindFileContainingSymbol(req.file_containing_symbol());
      if (file == nullptr) return SetError(grpc::StatusCode::NOT_FOUND, "Symbol not found.", resp);
      return AddFiles(file, sent, resp);
    }
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& ext = req.file_containing_extension();
      const google::protobuf::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      if (type == nullptr) return SetError(grpc::StatusCode::NOT_FOUND, "Type not found.", resp);
      const google::protobuf::FieldDescriptor* field = pool->FindExtensionByNumber(type, ext.extension_number());
      if (field == nullptr) return SetError(grpc::StatusCode::NOT_FOUND, "Extension not found.", resp);
      return AddFiles(field->file(), sent, resp);
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const google::protobuf::Descriptor* type = pool->FindMessageTypeByName(req.all_extension_numbers_of_type());
      if (type == nullptr) return SetError(grpc::StatusCode::NOT_FOUND, "Type not found.", resp);
      std::vector<const google::protobuf::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = resp->mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const auto* f : extensions) numbers->add_extension_number(f->number());
      return;
    }
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      break;
  }
  // A kind of request newer than this file (or none), as gRPC's service answers it.
  SetError(grpc::StatusCode::UNIMPLEMENTED,
           "the request sets none of file_by_filename, file_containing_symbol, file_containing_extension, "
           "all_extension_numbers_of_type, list_services",
           resp);
}

}  // namespace wprep::server
