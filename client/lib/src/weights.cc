#include "wprep/client/weights.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wprep::client {
namespace {

void Apply(const CallOptions& o, grpc::ClientContext* ctx) {
  if (o.timeout) ctx->set_deadline(std::chrono::system_clock::now() + *o.timeout);
  for (const auto& [key, value] : o.metadata) ctx->AddMetadata(key, value);
}

}  // namespace

WeightSets::WeightSets(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(wprep::v1::WeightSets::NewStub(channel_)) {}

WeightSets::WeightSets(const std::string& target) : WeightSets(MakeChannel(target)) {}

absl::StatusOr<wprep::v1::LoadWeightsResponse> WeightSets::Load(
    const wprep::v1::LoadWeightsRequest& request,
    const std::function<void(const wprep::v1::LoadWeightsResponse&)>& progress, const CallOptions& options) {
  grpc::ClientContext ctx;
  Apply(options, &ctx);
  auto reader = stub_->LoadWeights(&ctx, request);
  wprep::v1::LoadWeightsResponse msg, last;
  bool manifest = false;
  while (reader->Read(&msg)) {
    if (progress) progress(msg);
    if (msg.has_manifest()) {
      last = msg;
      manifest = true;
    }
  }
  if (absl::Status s = FromGrpcStatus(reader->Finish()); !s.ok()) return s;
  if (!manifest) return absl::DataLossError(absl::StrCat("LoadWeights of '", request.name(), "' ended without a manifest"));
  return last;
}

absl::StatusOr<wprep::v1::ListWeightsResponse> WeightSets::List(bool with_tensors, const CallOptions& options) {
  grpc::ClientContext ctx;
  Apply(options, &ctx);
  wprep::v1::ListWeightsRequest req;
  req.set_with_tensors(with_tensors);
  wprep::v1::ListWeightsResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->ListWeights(&ctx, req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<uint64_t> WeightSets::Drop(const std::string& name, bool force, const CallOptions& options) {
  grpc::ClientContext ctx;
  Apply(options, &ctx);
  wprep::v1::DropWeightsRequest req;
  req.set_name(name);
  req.set_force(force);
  wprep::v1::DropWeightsResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->DropWeights(&ctx, req, &resp)); !s.ok()) return s;
  return resp.freed_bytes();
}

absl::StatusOr<std::unique_ptr<WeightSets::Attachment>> WeightSets::Attach(const std::string& name,
                                                                          const CallOptions& options) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  Apply(options, ctx.get());
  wprep::v1::AttachWeightsRequest req;
  req.set_name(name);
  auto reader = stub_->AttachWeights(ctx.get(), req);
  wprep::v1::AttachWeightsResponse first;
  if (!reader->Read(&first)) {
    absl::Status s = FromGrpcStatus(reader->Finish());
    if (s.ok()) s = absl::DataLossError(absl::StrCat("AttachWeights of '", name, "' ended without its message"));
    return s;
  }
  return std::unique_ptr<Attachment>(new Attachment(this, std::move(ctx), std::move(reader), std::move(first)));
}

absl::Status WeightSets::Attachment::ended() {
  if (!end_) {
    wprep::v1::AttachWeightsResponse more;
    while (reader_->Read(&more)) {
    }
    end_ = FromGrpcStatus(reader_->Finish());
  }
  return *end_;
}

absl::Status WeightSets::Attachment::Detach(const CallOptions& options) {
  if (!end_) {
    grpc::ClientContext ctx;
    Apply(options, &ctx);
    wprep::v1::DetachWeightsRequest req;
    req.set_attachment_id(info_.attachment_id());
    wprep::v1::DetachWeightsResponse resp;
    absl::Status s = FromGrpcStatus(owner_->stub_->DetachWeights(&ctx, req, &resp));
    // NOT_FOUND: the attachment had ended already (a forced drop); its stream says how.
    if (!s.ok() && !absl::IsNotFound(s)) return s;
  }
  (void)ended();
  return absl::OkStatus();
}

WeightSets::Attachment::~Attachment() {
  if (end_) return;
  ctx_->TryCancel();
  (void)ended();
}

absl::StatusOr<VmmDescriptor> FetchVmmDescriptor(const std::string& socket_path, const std::string& token) {
  const std::string path = socket_path + ".handles";
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("handle socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  auto fail = [sock](absl::Status s) {
    close(sock);
    return s;
  };
  if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail(absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(errno))));
  }
  if (send(sock, token.data(), token.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(token.size())) {
    return fail(absl::UnavailableError(absl::StrCat("send to ", path, ": ", std::strerror(errno))));
  }
  uint8_t header[16];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{header, sizeof(header)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(sock, &msg, MSG_WAITALL | MSG_CMSG_CLOEXEC);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n != static_cast<ssize_t>(sizeof(header))) {
    if (fd >= 0) close(fd);
    return fail(absl::UnavailableError(absl::StrCat(path, ": the reply ended early")));
  }
  auto le = [&](int at, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | header[at + i];
    return v;
  };
  const auto code = static_cast<absl::StatusCode>(le(0, 4));
  if (code != absl::StatusCode::kOk) {
    if (fd >= 0) close(fd);
    std::string text;
    char buf[512];
    for (ssize_t r; text.size() < 4096 && (r = recv(sock, buf, sizeof(buf), 0)) > 0;) text.append(buf, static_cast<size_t>(r));
    return fail(absl::Status(code, text));
  }
  close(sock);
  if (fd < 0) return absl::InternalError(absl::StrCat(path, ": the reply carried no descriptor"));
  return VmmDescriptor{fd, le(8, 8)};
}

}  // namespace wprep::client
