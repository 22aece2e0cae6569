// wprep_fault_client MODE TARGET: a client process for fault_test.cc to kill with
// SIGKILL mid-request, so that the daemon sees its connection drop with no cancel sent.
// It starts a ConvertStream of a 64 MiB tensor, waits for the daemon's response header
// (the stream is admitted and holds its buffers), prints "admitted" on stdout and then:
//   stall-send  sends half the input and stops (the daemon waits for input);
//   stall-read  sends the input and never reads (the daemon blocks sending output).
// It never exits by itself.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "wprep/client/client.h"
#include "wprep/proto/spec_codec.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: wprep_fault_client stall-send|stall-read TARGET\n");
    return 2;
  }
  const std::string mode = argv[1];
  wprep::client::Client client(wprep::client::MakeChannel(argv[2]));
  wprep::ConversionSpec spec;  // hopper_value swizzle; mx_axis -1 keeps it unpadded
  spec.hopper.mx_axis = -1;
  const int64_t matrices = 16;
  const uint64_t matrix_bytes = 2048 * 2048;  // [2048, 4096] FP4 values
  grpc::ClientContext ctx;
  auto stream = client.stub().ConvertStream(&ctx);
  wprep::v1::ConvertStreamRequest msg;
  *msg.mutable_header()->mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : {matrices, int64_t{2048}, int64_t{4096}}) msg.mutable_header()->add_logical_shape(d);
  if (!stream->Write(msg)) return 1;
  wprep::v1::ConvertStreamResponse resp;
  if (!stream->Read(&resp) || !resp.has_header()) return 1;
  std::printf("admitted\n");
  std::fflush(stdout);
  const uint64_t total = matrices * matrix_bytes;
  const uint64_t send = mode == "stall-send" ? total / 2 : total;
  const std::string chunk(1 << 20, '\x5a');
  for (uint64_t off = 0; off < send; off += chunk.size()) {
    msg.mutable_chunk()->set_offset(off);
    msg.mutable_chunk()->set_data(chunk);
    if (!stream->Write(msg)) break;
  }
  for (;;) pause();
}
