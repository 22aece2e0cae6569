// wprep_fault_client MODE TARGET: a client process that fault_test.cc kills or stops
// mid-request. It starts a ConvertStream (of a 64 MiB tensor, or 64 KiB in the last mode),
// waits for the daemon's response header (the stream is admitted and holds its buffers),
// prints "admitted" on stdout and then:
//   stall-send      sends half the input and stops (the daemon waits for input);
//   stall-read      sends the input and never reads (the daemon blocks sending output);
//   stop-then-read  sends the input and half-closes, stops itself (SIGSTOP) before
//                   reading any answer, and once continued reads them all and prints
//                   "status CODE bytes N": exit 0 for OK with every byte, 1 otherwise.
// The first two never exit by themselves: the test kills them with SIGKILL, so that the
// daemon sees the connection drop with no cancel sent.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "wprep/client/client.h"
#include "wprep/proto/spec_codec.h"

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "stall-send" && mode != "stall-read" && mode != "stop-then-read") {
    std::fprintf(stderr, "usage: wprep_fault_client stall-send|stall-read|stop-then-read TARGET\n");
    return 2;
  }
  wprep::client::Client client(wprep::client::MakeChannel(argv[2]));
  wprep::ConversionSpec spec;  // hopper_value swizzle; mx_axis -1 keeps it unpadded
  spec.hopper.mx_axis = -1;
  const bool small = mode == "stop-then-read";
  const int64_t matrices = small ? 1 : 16;
  const int64_t rows = small ? 256 : 2048, cols = small ? 512 : 4096;  // FP4 values
  const uint64_t matrix_bytes = rows * cols / 2;
  grpc::ClientContext ctx;
  auto stream = client.stub().ConvertStream(&ctx);
  wprep::v1::ConvertStreamRequest msg;
  *msg.mutable_header()->mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : {matrices, rows, cols}) msg.mutable_header()->add_logical_shape(d);
  if (!stream->Write(msg)) return 1;
  wprep::v1::ConvertStreamResponse resp;
  if (!stream->Read(&resp) || !resp.has_header()) return 1;
  std::printf("admitted\n");
  std::fflush(stdout);
  const uint64_t total = matrices * matrix_bytes;
  const uint64_t send = mode == "stall-send" ? total / 2 : total;
  const std::string chunk(std::min<uint64_t>(1 << 20, total), '\x5a');
  for (uint64_t off = 0; off < send; off += chunk.size()) {
    msg.mutable_chunk()->set_offset(off);
    msg.mutable_chunk()->set_data(chunk);
    if (!stream->Write(msg)) break;
  }
  if (!small) {
    for (;;) pause();
  }
  stream->WritesDone();
  raise(SIGSTOP);
  uint64_t got = 0;
  while (stream->Read(&resp)) got += resp.chunk().data().size();
  const grpc::Status status = stream->Finish();
  std::printf("status %d bytes %llu\n", static_cast<int>(status.error_code()), static_cast<unsigned long long>(got));
  std::fflush(stdout);
  return status.ok() && got == total ? 0 : 1;
}
