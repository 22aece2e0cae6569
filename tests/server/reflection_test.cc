// gRPC server reflection as a client such as grpcurl sees it: a real wprepd process on the
// CPU engine, asked over its Unix socket through grpc.reflection.v1alpha and, at the end,
// grpc.reflection.v1 (which current grpcurl and Postman ask first). The descriptors
// are read from the bytes the daemon sends, never from this binary's own generated code,
// so the test shows what the daemon serves.
//
// This binary links its own copy of reflection.proto and so must not link wprep::server
// or gRPC::grpc++_reflection (see tests/server/CMakeLists.txt).
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon_harness.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/descriptor_database.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace wprep::testing {
namespace {

using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

constexpr char kWeightPrep[] = "wprep.v1.WeightPrep";

// One ServerReflectionInfo stream. The server answers each request on a stream with one
// response, in order, so Ask pairs a Write with a Read.
class ReflectionCall {
 public:
  explicit ReflectionCall(const std::string& target)
      : stub_(ServerReflection::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {
    // A bound, so a daemon that never answers fails the test instead of hanging it.
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stream_ = stub_->ServerReflectionInfo(&context_);
  }
  // A test that stops at a failed ASSERT leaves the call open: cancel it so that Finish
  // returns at once.
  ~ReflectionCall() {
    if (!finished_) {
      context_.TryCancel();
      stream_->Finish().IgnoreError();
    }
  }

  // Sends `request` and reads its answer; false when the stream broke.
  bool Ask(const ServerReflectionRequest& request, ServerReflectionResponse* response) {
    return stream_->Write(request) && stream_->Read(response);
  }

  // Half-closes the stream and returns the call's status.
  grpc::Status Finish() {
    finished_ = true;
    stream_->WritesDone();
    return stream_->Finish();
  }

 private:
  std::unique_ptr<ServerReflection::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
      stream_;
  bool finished_ = false;
};

// One daemon for the whole suite: reflection is read-only, so the tests cannot disturb
// each other, and starting wprepd once keeps the suite quick.
class Reflection : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    // --devices=cpu as in daemon_test, so a GPU machine tests the same thing; few CPU
    // threads because nothing here converts.
    daemon_ = Daemon::Start({"--devices=cpu", "--cpu-threads=1"}, &error).release();
    start_error_ = error;
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr) << start_error_;
    ASSERT_TRUE(daemon_->WaitServing()) << daemon_->Log();
  }

  // Asks for the file that declares `symbol` on a fresh stream. Fails the test (and
  // returns false) unless the stream carries one answer and then ends OK.
  static bool AskForSymbol(const std::string& symbol, ServerReflectionResponse* response) {
    ReflectionCall call(daemon_->unix_target());
    ServerReflectionRequest request;
    request.set_file_containing_symbol(symbol);
    const bool answered = call.Ask(request, response);
    EXPECT_TRUE(answered) << daemon_->Log();
    const grpc::Status status = call.Finish();
    EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
    // The server echoes the request so a client with several in flight can pair them.
    EXPECT_EQ(response->original_request().file_containing_symbol(), symbol);
    return answered && status.ok();
  }

  // Parses every FileDescriptorProto of a file_descriptor_response (the file asked for and
  // its dependencies), failing the test on bytes that do not parse.
  static std::vector<google::protobuf::FileDescriptorProto> Files(
      const ServerReflectionResponse& response) {
    std::vector<google::protobuf::FileDescriptorProto> files;
    for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      EXPECT_TRUE(file.ParseFromString(bytes));
      files.push_back(std::move(file));
    }
    return files;
  }

  static Daemon* daemon_;
  static std::string start_error_;
};

Daemon* Reflection::daemon_ = nullptr;
std::string Reflection::start_error_;

TEST_F(Reflection, ListsWeightPrepHealthAndReflection) {
  ReflectionCall call(daemon_->unix_target());
  ServerReflectionRequest request;
  request.set_list_services("");  // the value is ignored; setting it picks the request
  ServerReflectionResponse response;
  ASSERT_TRUE(call.Ask(request, &response)) << daemon_->Log();
  ASSERT_TRUE(response.has_list_services_response())
      << "answer case " << response.message_response_case();
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  for (const char* want :
       {kWeightPrep, "wprep.v1.WeightSets", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end())
        << want << " not listed; got " << ::testing::PrintToString(names);
  }
  const grpc::Status status = call.Finish();
  EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
}

TEST_F(Reflection, WeightPrepDescriptorHasItsMethods) {
  ServerReflectionResponse response;
  ASSERT_TRUE(AskForSymbol(kWeightPrep, &response));
  ASSERT_TRUE(response.has_file_descriptor_response())
      << "answer case " << response.message_response_case() << ": "
      << response.error_response().error_message();
  const std::vector<google::protobuf::FileDescriptorProto> files = Files(response);
  // The file that declares the service; searched for rather than taken as files[0],
  // because the order of files in the answer is not part of the protocol.
  const google::protobuf::FileDescriptorProto* declaring = nullptr;
  const google::protobuf::ServiceDescriptorProto* service = nullptr;
  for (const auto& file : files) {
    for (const auto& s : file.service()) {
      if (s.name() == "WeightPrep") {
        declaring = &file;
        service = &s;
      }
    }
  }
  ASSERT_NE(service, nullptr) << "no file in the answer declares WeightPrep";
  EXPECT_EQ(declaring->package(), "wprep.v1");

  // Every method of the API; later additions do not break the test.
  struct Streaming {
    bool client, server;
  };
  const std::map<std::string, Streaming> want = {
      {"Plan", {false, false}},
      {"Convert", {false, false}},
      {"ConvertStream", {true, true}},
      {"ListDevices", {false, false}},
      {"RegisterIpcHandles", {false, false}},
      {"ReleaseIpcHandles", {false, false}},
  };
  std::map<std::string, const google::protobuf::MethodDescriptorProto*> methods;
  for (const auto& m : service->method()) methods[m.name()] = &m;
  for (const auto& [name, streaming] : want) {
    SCOPED_TRACE(name);
    auto it = methods.find(name);
    ASSERT_NE(it, methods.end()) << "method missing";
    EXPECT_EQ(it->second->client_streaming(), streaming.client);
    EXPECT_EQ(it->second->server_streaming(), streaming.server);
  }

  // The answer must be complete: a pool built from these files alone resolves every
  // method's request and response type, as a reflection client would need.
  google::protobuf::SimpleDescriptorDatabase database;
  for (const auto& file : files) ASSERT_TRUE(database.Add(file)) << file.name();
  google::protobuf::DescriptorPool pool(&database);
  const google::protobuf::ServiceDescriptor* resolved = pool.FindServiceByName(kWeightPrep);
  ASSERT_NE(resolved, nullptr);
  EXPECT_EQ(resolved->file()->package(), "wprep.v1");
  for (int i = 0; i < resolved->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = resolved->method(i);
    EXPECT_NE(m->input_type(), nullptr) << m->full_name();
    EXPECT_NE(m->output_type(), nullptr) << m->full_name();
  }
  const google::protobuf::MethodDescriptor* stream = resolved->FindMethodByName("ConvertStream");
  ASSERT_NE(stream, nullptr);
  EXPECT_TRUE(stream->client_streaming());
  EXPECT_TRUE(stream->server_streaming());
}

TEST_F(Reflection, ConvertRequestDescriptorIsServed) {
  ServerReflectionResponse response;
  ASSERT_TRUE(AskForSymbol("wprep.v1.ConvertRequest", &response));
  ASSERT_TRUE(response.has_file_descriptor_response())
      << "answer case " << response.message_response_case() << ": "
      << response.error_response().error_message();
  google::protobuf::SimpleDescriptorDatabase database;
  for (const auto& file : Files(response)) ASSERT_TRUE(database.Add(file)) << file.name();
  google::protobuf::DescriptorPool pool(&database);
  const google::protobuf::Descriptor* message =
      pool.FindMessageTypeByName("wprep.v1.ConvertRequest");
  ASSERT_NE(message, nullptr);
  EXPECT_EQ(message->file()->package(), "wprep.v1");
  // A message with no fields would mean the daemon served a stub, not the real type.
  EXPECT_GT(message->field_count(), 0);
}

TEST_F(Reflection, UnknownSymbolIsNotFound) {
  ServerReflectionResponse response;
  ASSERT_TRUE(AskForSymbol("wprep.v1.NoSuchThing", &response));
  ASSERT_TRUE(response.has_error_response())
      << "answer case " << response.message_response_case();
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND)
      << response.error_response().error_message();
}

// grpc.reflection.v1 over a real socket, on a fresh TCP connection as grpcurl would use:
// one stream asks for the service list, then for the file that declares WeightPrep, then
// for a symbol that does not exist, then for nothing, as gRPC's own v1 service answers.
TEST_F(Reflection, V1ListsServicesAndServesDescriptors) {
  namespace v1 = grpc::reflection::v1;
  auto stub = v1::ServerReflection::NewStub(
      grpc::CreateChannel(daemon_->tcp_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->ServerReflectionInfo(&ctx);

  v1::ServerReflectionRequest list;
  list.set_host("wprepd.example");
  list.set_list_services("");
  v1::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Write(list) && stream->Read(&response)) << daemon_->Log();
  ASSERT_TRUE(response.has_list_services_response())
      << "answer case " << response.message_response_case() << ": "
      << response.error_response().error_message();
  EXPECT_EQ(response.valid_host(), "wprepd.example");
  EXPECT_TRUE(response.original_request().has_list_services());
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) names.push_back(service.name());
  for (const char* want : {kWeightPrep, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end())
        << want << " not listed; got " << ::testing::PrintToString(names);
  }

  v1::ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol(kWeightPrep);
  ASSERT_TRUE(stream->Write(symbol) && stream->Read(&response)) << daemon_->Log();
  ASSERT_TRUE(response.has_file_descriptor_response())
      << "answer case " << response.message_response_case() << ": "
      << response.error_response().error_message();
  EXPECT_EQ(response.original_request().file_containing_symbol(), kWeightPrep);
  // Complete: a pool built from these files alone resolves the service and its types.
  google::protobuf::SimpleDescriptorDatabase database;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    ASSERT_TRUE(database.Add(file)) << file.name();
  }
  google::protobuf::DescriptorPool pool(&database);
  const google::protobuf::ServiceDescriptor* service = pool.FindServiceByName(kWeightPrep);
  ASSERT_NE(service, nullptr);
  const google::protobuf::MethodDescriptor* stream_method = service->FindMethodByName("ConvertStream");
  ASSERT_NE(stream_method, nullptr);
  EXPECT_TRUE(stream_method->client_streaming());
  EXPECT_TRUE(stream_method->server_streaming());
  const google::protobuf::Descriptor* request = pool.FindMessageTypeByName("wprep.v1.ConvertRequest");
  ASSERT_NE(request, nullptr);
  EXPECT_GT(request->field_count(), 0);

  v1::ServerReflectionRequest missing;
  missing.set_file_containing_symbol("wprep.v1.NoSuchThing");
  ASSERT_TRUE(stream->Write(missing) && stream->Read(&response)) << daemon_->Log();
  ASSERT_TRUE(response.has_error_response()) << "answer case " << response.message_response_case();
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);

  v1::ServerReflectionRequest nothing;  // no request kind set
  ASSERT_TRUE(stream->Write(nothing) && stream->Read(&response)) << daemon_->Log();
  ASSERT_TRUE(response.has_error_response()) << "answer case " << response.message_response_case();
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::UNIMPLEMENTED);

  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
}

// v1 describes itself, as grpcurl needs before it can call anything: the file that
// declares grpc.reflection.v1.ServerReflection, found by its file name as well.
TEST_F(Reflection, V1DescribesItselfByNameAndFile) {
  namespace v1 = grpc::reflection::v1;
  auto stub = v1::ServerReflection::NewStub(
      grpc::CreateChannel(daemon_->unix_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->ServerReflectionInfo(&ctx);
  v1::ServerReflectionRequest by_symbol;
  by_symbol.set_file_containing_symbol("grpc.reflection.v1.ServerReflection");
  v1::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Write(by_symbol) && stream->Read(&response)) << daemon_->Log();
  ASSERT_EQ(response.file_descriptor_response().file_descriptor_proto_size(), 1)
      << "answer case " << response.message_response_case();
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(file.ParseFromString(response.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(file.package(), "grpc.reflection.v1");
  ASSERT_EQ(file.service_size(), 1);
  EXPECT_EQ(file.service(0).name(), "ServerReflection");

  // Asked again on the same stream, by file name: the file asked for comes again (only
  // dependencies already sent are left out), so the answer is never empty.
  v1::ServerReflectionRequest by_name;
  by_name.set_file_by_filename(file.name());
  ASSERT_TRUE(stream->Write(by_name) && stream->Read(&response)) << daemon_->Log();
  ASSERT_EQ(response.file_descriptor_response().file_descriptor_proto_size(), 1)
      << "answer case " << response.message_response_case() << ": " << response.error_response().error_message();
  google::protobuf::FileDescriptorProto again;
  ASSERT_TRUE(again.ParseFromString(response.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(again.name(), file.name());
  EXPECT_EQ(again.package(), "grpc.reflection.v1");

  v1::ServerReflectionRequest no_file;
  no_file.set_file_by_filename("no/such/file.proto");
  ASSERT_TRUE(stream->Write(no_file) && stream->Read(&response)) << daemon_->Log();
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace wprep::testing
