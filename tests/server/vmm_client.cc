// wprep_vmm_client: the client process of the VMM tests (vmm_import_test.cc). It makes
// memfds (standing in for a cuMem allocation's chunks: the fake GPU maps files), fills
// their descriptor numbers and its pid into a ConvertRequest the test wrote, sends it to a
// daemon, prints one "code=N message" line per call, and writes memfds back to files.
//
//   wprep_vmm_client --target=unix:///path --request=FILE --memfd=SIZE[:FILE]...
//       [--out=K:FILE]... [--repeat=N] [--hold]
//
// It prints "memfd K FD" for each memfd first. Without --request it sends nothing.
//
// In the request, a chunk fd of -(k+1) becomes memfd k (in --memfd order, its first bytes
// those of FILE), and pid 0 becomes this process's pid. --hold: after the calls, waits
// until stdin closes (so the test can act while the process lives).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace {

namespace v1 = wprep::v1;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Fill(v1::CudaIpcBuffer* b, const std::vector<int>& memfds) {
  if (!b->has_vmm()) return;
  v1::CudaVmmBuffer* v = b->mutable_vmm();
  if (v->pid() == 0) v->set_pid(getpid());
  for (v1::VmmChunk& c : *v->mutable_chunks()) {
    if (c.fd() < 0 && static_cast<size_t>(-c.fd() - 1) < memfds.size()) c.set_fd(memfds[static_cast<size_t>(-c.fd() - 1)]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string target, request_file;
  std::vector<int> memfds;
  std::vector<std::pair<int, std::string>> outs;
  int repeat = 1;
  bool hold = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (absl::StartsWith(a, "--target=")) {
      target = a.substr(9);
    } else if (absl::StartsWith(a, "--request=")) {
      request_file = a.substr(10);
    } else if (absl::StartsWith(a, "--memfd=")) {
      std::vector<std::string> parts = absl::StrSplit(a.substr(8), absl::MaxSplits(':', 1));
      uint64_t size = 0;
      if (!absl::SimpleAtoi(parts[0], &size)) return 2;
      const int fd = memfd_create("wprep-vmm-test", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) return 3;
      if (parts.size() > 1) {
        const std::string content = ReadAll(parts[1]);
        if (content.size() > size || pwrite(fd, content.data(), content.size(), 0) != static_cast<ssize_t>(content.size())) {
          return 3;
        }
      }
      std::printf("memfd %zu %d\n", memfds.size(), fd);
      memfds.push_back(fd);
    } else if (absl::StartsWith(a, "--out=")) {
      std::vector<std::string> parts = absl::StrSplit(a.substr(6), absl::MaxSplits(':', 1));
      int k = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &k)) return 2;
      outs.emplace_back(k, parts[1]);
    } else if (absl::StartsWith(a, "--repeat=")) {
      if (!absl::SimpleAtoi(a.substr(9), &repeat)) return 2;
    } else if (a == "--hold") {
      hold = true;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  std::fflush(stdout);
  v1::ConvertRequest req;
  if (request_file.empty()) repeat = 0;
  if (!request_file.empty() && !req.ParseFromString(ReadAll(request_file))) return 2;
  Fill(req.mutable_source_ipc(), memfds);
  Fill(req.mutable_destination_ipc(), memfds);
  std::unique_ptr<v1::WeightPrep::Stub> stub;
  if (repeat > 0) stub = v1::WeightPrep::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  for (int r = 0; r < repeat; ++r) {
    grpc::ClientContext ctx;
    v1::ConvertResponse resp;
    grpc::Status s = stub->Convert(&ctx, req, &resp);
    std::printf("code=%d %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
    std::fflush(stdout);
  }
  for (const auto& [k, path] : outs) {
    if (k < 0 || static_cast<size_t>(k) >= memfds.size()) return 2;
    const off_t size = lseek(memfds[static_cast<size_t>(k)], 0, SEEK_END);
    std::string data(static_cast<size_t>(size), '\0');
    if (pread(memfds[static_cast<size_t>(k)], data.data(), data.size(), 0) != size) return 3;
    std::ofstream(path, std::ios::binary) << data;
  }
  if (hold) {
    std::printf("holding\n");
    std::fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {
    }
  }
  return 0;
}
