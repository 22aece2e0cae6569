// The bad-input table: each bad request gets the right gRPC status and a message a user
// can act on, and the daemon keeps serving afterwards.
#include <functional>
#include <thread>

#include "daemon_harness.h"
#include "golden_rpc.h"
#include "gtest/gtest.h"
#include "wprep/client/client.h"

namespace wprep::testing {
namespace {

using wprep::client::Client;
using wprep::client::MakeChannel;
namespace v1 = wprep::v1;

struct BadCase {
  std::string name;
  std::function<absl::Status(Client&)> call;
  absl::StatusCode code;
  std::string message_part;  // the actionable bit the message must contain
};

v1::ConvertRequest GoodRequest() {
  return ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {256, 128}, RandomBytes(256 * 64, 3));
}

// Sends raw stream messages and returns the final status (output is drained).
absl::Status RawStream(Client& client, const std::vector<v1::ConvertStreamRequest>& msgs) {
  grpc::ClientContext ctx;
  auto stream = client.stub().ConvertStream(&ctx);
  for (const auto& m : msgs) {
    if (!stream->Write(m)) break;
  }
  stream->WritesDone();
  v1::ConvertStreamResponse resp;
  while (stream->Read(&resp)) {
  }
  return wprep::client::FromGrpcStatus(stream->Finish());
}

v1::ConvertStreamRequest HeaderMsg(const std::vector<int64_t>& shape) {
  v1::ConvertStreamRequest m;
  *m.mutable_header() = StreamHeaderFor(HopperSpec(Direction::kSwizzle, -1, 2), shape);
  return m;
}

v1::ConvertStreamRequest ChunkMsg(uint64_t offset, uint64_t size) {
  v1::ConvertStreamRequest m;
  m.mutable_chunk()->set_offset(offset);
  m.mutable_chunk()->set_data(std::string(size, '\x5a'));
  return m;
}

std::vector<BadCase> Table() {
  std::vector<BadCase> t;
  t.push_back({"unknown layout", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.mutable_spec()->set_layout(static_cast<v1::Layout>(9));
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "spec.layout has unknown value 9"});
  t.push_back({"unspecified layout", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.mutable_spec()->set_layout(v1::LAYOUT_UNSPECIFIED);
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "LAYOUT_HOPPER_VALUE"});
  t.push_back({"unspecified direction", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.mutable_spec()->set_direction(v1::DIRECTION_UNSPECIFIED);
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "spec.direction is not set"});
  t.push_back({"odd packing dim", [](Client& c) {
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {256, 127},
                                                    RandomBytes(256 * 64, 1)))
                     .status();
               },
               absl::StatusCode::kInvalidArgument, "127"});
  t.push_back({"shape overflow", [](Client& c) {
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2),
                                                    {1ll << 40, 1ll << 40, 1ll << 40}, {}))
                     .status();
               },
               absl::StatusCode::kInvalidArgument, ""});
  t.push_back({"negative dim", [](Client& c) {
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {-256, 128}, {}))
                     .status();
               },
               absl::StatusCode::kInvalidArgument, "-256"});
  t.push_back({"byte count not matching the shape", [](Client& c) {
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {256, 128},
                                                    RandomBytes(100, 1)))
                     .status();
               },
               absl::StatusCode::kInvalidArgument, "100"});
  t.push_back({"strides outside the buffer", [](Client& c) {
                 v1::PlanRequest p;
                 *p.mutable_spec() = wprep::SpecToProto(HopperSpec(Direction::kSwizzle, -1, 2));
                 p.add_logical_shape(256);
                 p.add_logical_shape(128);
                 p.add_input_strides(128);  // rows twice as far apart as dense
                 p.add_input_strides(1);
                 p.set_input_buffer_bytes(256 * 64);
                 return c.Plan(p).status();
               },
               absl::StatusCode::kInvalidArgument, ""});
  t.push_back({"source not set", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.clear_source();
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "source_bytes or source_ipc"});
  t.push_back({"IPC handle of the wrong length", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.mutable_source_ipc()->set_handle("garbage");
                 r.mutable_source_ipc()->set_device_uuid(std::string(16, '\x01'));
                 r.mutable_source_ipc()->set_size(256 * 64);
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "64 bytes of a cudaIpcMemHandle_t"});
  t.push_back({"garbage IPC handle on a GPU this daemon does not have", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.mutable_source_ipc()->set_handle(std::string(64, '\x7f'));
                 r.mutable_source_ipc()->set_device_uuid(std::string(16, '\x01'));
                 r.mutable_source_ipc()->set_size(256 * 64);
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "not a GPU this daemon serves"});
  t.push_back({"UUID of the wrong length", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.set_device_uuid("GPU-0");
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "16 bytes"});
  t.push_back({"unknown UUID for bytes work", [](Client& c) {
                 v1::ConvertRequest r = GoodRequest();
                 r.set_device_uuid(std::string(16, '\x42'));
                 return c.Convert(r).status();
               },
               absl::StatusCode::kInvalidArgument, "ListDevices"});
  t.push_back({"unknown UUID in ReleaseIpcHandles", [](Client& c) {
                 v1::ReleaseIpcHandlesRequest r;
                 r.add_handles()->set_handle(std::string(64, '\x01'));
                 r.mutable_handles(0)->set_device_uuid(std::string(16, '\x42'));
                 return c.ReleaseIpcHandles(r).status();
               },
               absl::StatusCode::kInvalidArgument, "not a GPU this daemon serves"});
  t.push_back({"unknown UUID in RegisterIpcHandles", [](Client& c) {
                 v1::RegisterIpcHandlesRequest r;
                 r.add_handles()->set_handle(std::string(64, '\x01'));
                 r.mutable_handles(0)->set_device_uuid(std::string(16, '\x42'));
                 return c.RegisterIpcHandles(r).status();
               },
               absl::StatusCode::kInvalidArgument, "not a GPU this daemon serves"});
  t.push_back({"short handle in RegisterIpcHandles", [](Client& c) {
                 v1::RegisterIpcHandlesRequest r;
                 r.add_handles()->set_handle("short");
                 r.mutable_handles(0)->set_device_uuid(std::string(16, '\x42'));
                 return c.RegisterIpcHandles(r).status();
               },
               absl::StatusCode::kInvalidArgument, "handles[0].handle must be the 64 bytes"});
  t.push_back({"truncated stream", [](Client& c) {
                 return RawStream(c, {HeaderMsg({256, 128}), ChunkMsg(0, 1000)});
               },
               absl::StatusCode::kInvalidArgument, "truncated"});
  t.push_back({"stream without a header", [](Client& c) { return RawStream(c, {ChunkMsg(0, 1000)}); },
               absl::StatusCode::kInvalidArgument, "must be a header"});
  t.push_back({"empty stream", [](Client& c) { return RawStream(c, {}); },
               absl::StatusCode::kInvalidArgument, "before its header"});
  t.push_back({"out-of-order chunk", [](Client& c) {
                 return RawStream(c, {HeaderMsg({256, 128}), ChunkMsg(0, 1000), ChunkMsg(2000, 1000)});
               },
               absl::StatusCode::kInvalidArgument, "in order without gaps"});
  t.push_back({"second header", [](Client& c) {
                 return RawStream(c, {HeaderMsg({256, 128}), ChunkMsg(0, 1000), HeaderMsg({256, 128})});
               },
               absl::StatusCode::kInvalidArgument, "second header"});
  t.push_back({"stream longer than its shape", [](Client& c) {
                 return RawStream(c, {HeaderMsg({256, 128}), ChunkMsg(0, 256 * 64 + 1)});
               },
               absl::StatusCode::kInvalidArgument, "more than the 16384 input bytes"});
  t.push_back({"oversized chunk", [](Client& c) {
                 return RawStream(c, {HeaderMsg({8192, 2048}), ChunkMsg(0, (4 << 20) + 1)});
               },
               absl::StatusCode::kInvalidArgument, "4 MiB"});
  t.push_back({"bad stream header", [](Client& c) { return RawStream(c, {HeaderMsg({256, -2})}); },
               absl::StatusCode::kInvalidArgument, ""});
  t.push_back({"oversized unary message (above --max-message-bytes)", [](Client& c) {
                 // 2 MiB: below the transport's limit (streams need 4 MiB chunks), above ours.
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {2048, 2048},
                                                    RandomBytes(2048 * 1024, 2)))
                     .status();
               },
               absl::StatusCode::kResourceExhausted, "ConvertStream"});
  t.push_back({"oversized unary message (above the transport limit)", [](Client& c) {
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {8192, 2048},
                                                    RandomBytes(8192 * 1024, 2)))
                     .status();
               },
               absl::StatusCode::kResourceExhausted, ""});
  t.push_back({"output too large to return inline", [](Client& c) {
                 // 0.63 MiB in, but Hopper pads 130 rows to 256 per matrix: 1.25 MiB out.
                 return c.Convert(ConvertRequestFor(HopperSpec(Direction::kSwizzle, -1, 2), {80, 130, 128},
                                                    RandomBytes(80 * 130 * 64, 2)))
                     .status();
               },
               absl::StatusCode::kResourceExhausted, "destination_ipc"});
  t.push_back({"expired deadline", [](Client& c) {
                 wprep::client::CallOptions o;
                 o.timeout = std::chrono::milliseconds(-1);
                 return c.Convert(GoodRequest(), o).status();
               },
               absl::StatusCode::kDeadlineExceeded, ""});
  return t;
}

TEST(BadInput, EachGetsTheRightStatusAndTheDaemonKeepsServing) {
  std::string error;
  auto d = Daemon::Start({"--max-message-bytes=1M"}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  const v1::ConvertRequest good = GoodRequest();
  const std::string expected = CpuReference(HopperSpec(Direction::kSwizzle, -1, 2), {256, 128},
                                            RandomBytes(256 * 64, 3));
  for (const BadCase& c : Table()) {
    SCOPED_TRACE(c.name);
    const absl::Status s = c.call(client);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.message_part), absl::string_view::npos) << s;
    EXPECT_FALSE(s.message().empty());
    // Still serving, and still right.
    absl::StatusOr<v1::ConvertResponse> r = client.Convert(good);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << d->Log();
    EXPECT_TRUE(r->output_bytes_inline() == expected);
  }
  EXPECT_EQ(d->Health(), 1);
}

TEST(BadInput, ClientCancellingMidStreamLeavesTheDaemonServing) {
  std::string error;
  auto d = Daemon::Start({}, &error);
  ASSERT_NE(d, nullptr) << error;
  ASSERT_TRUE(d->WaitServing()) << d->Log();
  Client client(MakeChannel(d->unix_target()));
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    auto stream = client.stub().ConvertStream(&ctx);
    ASSERT_TRUE(stream->Write(HeaderMsg({4, 1024, 1024})));
    v1::ConvertStreamResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_TRUE(stream->Write(ChunkMsg(0, 1 << 20)));
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::StatusOr<v1::ConvertResponse> r = client.Convert(GoodRequest());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(d->Health(), 1);
}

}  // namespace
}  // namespace wprep::testing
