#include "rpc/vmm_import.h"

#include <unistd.h>

#include <iterator>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "rpc/proto_translate.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

// Bytes of a CUmemFabricHandle.
constexpr size_t kFabricHandleBytes = 64;
// Identities remembered beyond this many are pruned of those the cache has closed.
constexpr size_t kPruneKeysAbove = 4096;

absl::Status WithField(const absl::Status& s, absl::string_view field) {
  return absl::Status(s.code(), absl::StrCat(field, ".vmm: ", s.message()));
}

// Every buffer of a batch's items that may carry a VMM buffer, with its field name.
template <typename Fn>
void ForEachItemBuffer(v1::ConvertBatchRequest* req, Fn fn) {
  for (int i = 0; i < req->items_size(); ++i) {
    v1::BatchItem* item = req->mutable_items(i);
    const std::string at = absl::StrCat("items[", i, "]");
    if (item->has_convert()) {
      v1::ConvertItem* c = item->mutable_convert();
      if (c->source().has_ipc()) fn(c->mutable_source()->mutable_ipc(), at + ".convert.source.ipc");
      if (c->destination().has_ipc()) fn(c->mutable_destination()->mutable_ipc(), at + ".convert.destination.ipc");
    } else if (item->has_moe()) {
      v1::MoeItem* m = item->mutable_moe();
      for (int k = 0; k < m->inputs_size(); ++k) {
        if (m->inputs(k).source().has_ipc()) {
          fn(m->mutable_inputs(k)->mutable_source()->mutable_ipc(), absl::StrCat(at, ".moe.inputs[", k, "].source.ipc"));
        }
      }
      for (int k = 0; k < m->outputs_size(); ++k) {
        if (m->outputs(k).destination().has_ipc()) {
          fn(m->mutable_outputs(k)->mutable_destination()->mutable_ipc(),
             absl::StrCat(at, ".moe.outputs[", k, "].destination.ipc"));
        }
      }
    } else if (item->has_quantize()) {
      v1::QuantizeItem* q = item->mutable_quantize();
      if (q->source().has_ipc()) fn(q->mutable_source()->mutable_ipc(), at + ".quantize.source.ipc");
      if (q->values().has_ipc()) fn(q->mutable_values()->mutable_ipc(), at + ".quantize.values.ipc");
      if (q->scales().has_ipc()) fn(q->mutable_scales()->mutable_ipc(), at + ".quantize.scales.ipc");
    }
  }
}

}  // namespace

bool HasVmm(const v1::ConvertRequest& req) {
  return (req.has_source_ipc() && req.source_ipc().has_vmm()) ||
         (req.has_destination_ipc() && req.destination_ipc().has_vmm());
}

bool HasVmm(const v1::ConvertBatchRequest& req) {
  for (const v1::BatchItem& item : req.items()) {
    if (item.has_convert()) {
      const v1::ConvertItem& c = item.convert();
      if (c.source().ipc().has_vmm() || c.destination().ipc().has_vmm()) return true;
    } else if (item.has_moe()) {
      for (const v1::MoeInput& in : item.moe().inputs()) {
        if (in.source().ipc().has_vmm()) return true;
      }
      for (const v1::MoeOutput& out : item.moe().outputs()) {
        if (out.destination().ipc().has_vmm()) return true;
      }
    } else if (item.has_quantize()) {
      const v1::QuantizeItem& q = item.quantize();
      if (q.source().ipc().has_vmm() || q.values().ipc().has_vmm() || q.scales().ipc().has_vmm()) return true;
    }
  }
  return false;
}

VmmImporter::VmmImporter(IpcCache* cache, DeviceManager* devices) : cache_(cache), devices_(devices) {}

absl::Status VmmImporter::Validate(const v1::CudaIpcBuffer& b, absl::string_view field) {
  const v1::CudaVmmBuffer& v = b.vmm();
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".vmm", parts...));
  };
  if (!b.handle().empty()) return bad(": set either handle (a legacy IPC handle) or vmm, not both");
  const bool posix = v.handle_type() == v1::VMM_HANDLE_TYPE_POSIX_FD;
  if (!posix && v.handle_type() != v1::VMM_HANDLE_TYPE_FABRIC) {
    return bad(".handle_type must be VMM_HANDLE_TYPE_POSIX_FD or VMM_HANDLE_TYPE_FABRIC");
  }
  if (posix && v.pid() <= 0) return bad(".pid must be the client's process id, got ", v.pid());
  if (v.chunks().empty()) return bad(".chunks is empty: a VMM allocation has at least one physical chunk");
  if (v.chunks_size() > kMaxVmmChunks) return bad(".chunks has ", v.chunks_size(), " entries, above ", kMaxVmmChunks);
  const uint64_t g = v.granularity();
  if (g == 0 || (g & (g - 1)) != 0) {
    return bad(".granularity must be a power of two (cuMemGetAllocationGranularity), got ", g);
  }
  uint64_t total = 0;
  for (int i = 0; i < v.chunks_size(); ++i) {
    const v1::VmmChunk& c = v.chunks(i);
    if (c.size() == 0 || c.size() % g != 0) {
      return bad(".chunks[", i, "].size must be a positive multiple of the granularity ", g, ", got ", c.size());
    }
    if (posix && c.fd() < 0) return bad(".chunks[", i, "].fd must be a descriptor number, got ", c.fd());
    if (!posix && c.fabric_handle().size() != kFabricHandleBytes) {
      return bad(".chunks[", i, "].fabric_handle must be the 64 bytes of a CUmemFabricHandle, got ",
                 c.fabric_handle().size());
    }
    if (__builtin_add_overflow(total, c.size(), &total)) return bad(".chunks sizes overflow 64 bits");
  }
  if (b.offset() > total || b.size() > total - b.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", b.offset(), " + size ", b.size(),
                                                   " reaches beyond the VMM allocation, whose chunks hold ", total,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

std::string VmmImporter::KeyFor(const std::string& identity) {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(identity);
  if (it != keys_.end()) return it->second;
  if (keys_.size() > kPruneKeysAbove) {
    for (auto k = keys_.begin(); k != keys_.end();) {
      // The key's GPU ordinal leads the identity.
      const int ordinal = std::stoi(k->first.substr(0, k->first.find('/')));
      k = cache_->Contains(ordinal, k->second) ? std::next(k) : keys_.erase(k);
    }
  }
  std::string key = IpcCache::NewVmmKey();
  if (!key.empty()) keys_[identity] = key;
  return key;
}

void VmmImporter::ForgetKey(const std::string& identity, const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(identity);
  if (it != keys_.end() && it->second == key) keys_.erase(it);
}

std::string VmmImporter::ExistingKey(const std::string& identity) {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(identity);
  return it == keys_.end() ? std::string() : it->second;
}

std::string VmmImporter::Identity(int ordinal, const v1::CudaVmmBuffer& v, int peer_pid) {
  const bool posix = v.handle_type() == v1::VMM_HANDLE_TYPE_POSIX_FD;
  std::string identity = absl::StrCat(ordinal, "/", v.handle_type(), "/", peer_pid, "/", v.granularity());
  for (const v1::VmmChunk& c : v.chunks()) {
    if (posix) {
      absl::StrAppend(&identity, "/", c.fd(), ":", c.size());
    } else {
      absl::StrAppend(&identity, "/", absl::BytesToHexString(c.fabric_handle()), ":", c.size());
    }
  }
  return identity;
}

absl::Status VmmImporter::NotOnUnixSocket(absl::string_view field) {
  return absl::PermissionDeniedError(absl::StrCat(
      field, ".vmm: VMM buffers are accepted only on the daemon's Unix socket, where it can check which "
             "process sent them; this connection is TCP or TLS"));
}

absl::StatusOr<int> VmmImporter::CheckedOrdinal(const PeerCredentials& peer, const v1::CudaIpcBuffer& b,
                                                const std::string& field) {
  const v1::CudaVmmBuffer& v = b.vmm();
  const bool posix = v.handle_type() == v1::VMM_HANDLE_TYPE_POSIX_FD;
  if (posix && !InThreadGroup(v.pid(), peer.pid)) {
    return absl::PermissionDeniedError(absl::StrCat(field, ".vmm.pid ", v.pid(),
                                                    " is not the process on the other end of this connection "
                                                    "(pid ", peer.pid, "); send getpid() of the process that holds "
                                                    "the descriptors, on its own connection"));
  }
  WPREP_ASSIGN_OR_RETURN(Uuid uuid, UuidFromWire(b.device_uuid(), absl::StrCat(field, ".device_uuid")));
  WPREP_ASSIGN_OR_RETURN(Gpu * gpu, devices_->FindByUuid(uuid));
  const int ordinal = gpu->ordinal();
  const VmmSupport support = gpu->runtime().VmmImportSupport(ordinal);
  if (posix ? !support.posix_fd : !support.fabric) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ".vmm: the daemon cannot import ", posix ? "POSIX file descriptor" : "fabric",
        " handles on GPU ordinal ", ordinal,
        posix ? " (its driver lacks the virtual-memory API)"
              : " (fabric handles need an IMEX daemon and channel, multi-node NVLink); ListDevices "
                "reports each GPU's import_capabilities"));
  }
  return ordinal;
}

absl::Status VmmImporter::ResolveBuffer(const std::optional<PeerCredentials>& peer, v1::CudaIpcBuffer* b,
                                        const std::string& field, std::vector<IpcCache::Lease>* held) {
  WPREP_RETURN_IF_ERROR(Validate(*b, field));
  if (!peer) return NotOnUnixSocket(field);
  WPREP_ASSIGN_OR_RETURN(const int ordinal, CheckedOrdinal(*peer, *b, field));
  return MapChecked(*peer, ordinal, b, field, held);
}

absl::Status VmmImporter::MapChecked(const PeerCredentials& peer, int ordinal, v1::CudaIpcBuffer* b,
                                     const std::string& field, std::vector<IpcCache::Lease>* held) {
  const v1::CudaVmmBuffer& v = b->vmm();
  const bool posix = v.handle_type() == v1::VMM_HANDLE_TYPE_POSIX_FD;

  // The client's process, held while this request imports: its exit closes the mapping.
  absl::StatusOr<int> opened = OpenPidfd(peer.pid);
  if (!opened.ok()) return WithField(opened.status(), field);
  const int pidfd = *opened;
  VmmImportSpec spec;
  spec.kind = posix ? VmmHandleKind::kPosixFd : VmmHandleKind::kFabric;
  spec.granularity = v.granularity();
  absl::Cleanup close_fds = [&] {
    for (const VmmChunkHandle& c : spec.chunks) {
      if (c.fd >= 0) close(c.fd);
    }
    close(pidfd);
  };
  const std::string identity = Identity(ordinal, v, peer.pid);
  for (int i = 0; i < v.chunks_size(); ++i) {
    const v1::VmmChunk& c = v.chunks(i);
    VmmChunkHandle h;
    h.bytes = c.size();
    if (posix) {
      absl::StatusOr<int> fd = TakeFd(pidfd, c.fd());
      if (!fd.ok()) return WithField(absl::Status(fd.status().code(), absl::StrCat("chunks[", i, "]: ", fd.status().message())), field);
      h.fd = *fd;
    } else {
      h.fabric = c.fabric_handle();
    }
    spec.chunks.push_back(std::move(h));
  }
  // A cached mapping under the identity's key is checked to be the same allocation (the
  // client may have closed a descriptor and reused its number); if not, it is released
  // and the allocation mapped under a fresh key.
  for (int attempt = 0;; ++attempt) {
    const std::string key = KeyFor(identity);
    if (key.empty()) return absl::InternalError("no random bytes for a VMM mapping key");
    absl::StatusOr<IpcCache::Lease> lease = cache_->AcquireVmm(ordinal, key, spec, pidfd, b->offset(), b->size());
    if (lease.status().code() == absl::StatusCode::kAborted && attempt == 0) {
      ForgetKey(identity, key);
      cache_->Release(ordinal, key);
      continue;
    }
    if (!lease.ok()) return WithField(lease.status(), field);
    b->clear_vmm();
    b->set_handle(key);
    held->push_back(*std::move(lease));
    return absl::OkStatus();
  }
}

namespace {

// The buffer of a whole VMM allocation that `ref` names.
v1::CudaIpcBuffer WholeAllocation(const v1::IpcHandleRef& ref) {
  v1::CudaIpcBuffer b;
  *b.mutable_vmm() = ref.vmm();
  b.set_device_uuid(ref.device_uuid());
  uint64_t total = 0;
  for (const v1::VmmChunk& c : ref.vmm().chunks()) {
    if (__builtin_add_overflow(total, c.size(), &total)) total = UINT64_MAX;  // Validate refuses it
  }
  b.set_size(total);
  return b;
}

}  // namespace

absl::StatusOr<int> VmmImporter::CheckedAllocation(const std::optional<PeerCredentials>& peer,
                                                   const v1::IpcHandleRef& ref, const std::string& field,
                                                   v1::CudaIpcBuffer* b) {
  if (!ref.handle().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": set either handle (a legacy IPC handle) or vmm, not both"));
  }
  *b = WholeAllocation(ref);
  WPREP_RETURN_IF_ERROR(Validate(*b, field));
  if (!peer) return NotOnUnixSocket(field);
  return CheckedOrdinal(*peer, *b, field);
}

absl::StatusOr<uint64_t> VmmImporter::Register(const std::optional<PeerCredentials>& peer,
                                               const v1::IpcHandleRef& ref, const std::string& field,
                                               bool* was_open) {
  v1::CudaIpcBuffer b;
  WPREP_ASSIGN_OR_RETURN(const int ordinal, CheckedAllocation(peer, ref, field, &b));
  const std::string before = ExistingKey(Identity(ordinal, b.vmm(), peer->pid));
  *was_open = !before.empty() && cache_->Contains(ordinal, before);
  std::vector<IpcCache::Lease> held;  // let go at once: the mapping stays cached
  WPREP_RETURN_IF_ERROR(MapChecked(*peer, ordinal, &b, field, &held));
  return b.size();
}

absl::StatusOr<std::pair<int, int>> VmmImporter::Release(const std::optional<PeerCredentials>& peer,
                                                         const v1::IpcHandleRef& ref, const std::string& field) {
  v1::CudaIpcBuffer b;
  WPREP_ASSIGN_OR_RETURN(const int ordinal, CheckedAllocation(peer, ref, field, &b));
  const std::string identity = Identity(ordinal, b.vmm(), peer->pid);
  const std::string key = ExistingKey(identity);
  if (key.empty()) return std::make_pair(0, 0);
  ForgetKey(identity, key);
  return cache_->Release(ordinal, key);
}

absl::Status VmmImporter::Resolve(const std::optional<PeerCredentials>& peer, v1::ConvertRequest* req,
                                  std::vector<IpcCache::Lease>* held) {
  if (req->has_source_ipc() && req->source_ipc().has_vmm()) {
    WPREP_RETURN_IF_ERROR(ResolveBuffer(peer, req->mutable_source_ipc(), "source_ipc", held));
  }
  if (req->has_destination_ipc() && req->destination_ipc().has_vmm()) {
    WPREP_RETURN_IF_ERROR(ResolveBuffer(peer, req->mutable_destination_ipc(), "destination_ipc", held));
  }
  return absl::OkStatus();
}

absl::Status VmmImporter::Resolve(const std::optional<PeerCredentials>& peer, v1::ConvertBatchRequest* req,
                                  std::vector<IpcCache::Lease>* held) {
  absl::Status status;
  ForEachItemBuffer(req, [&](v1::CudaIpcBuffer* b, const std::string& field) {
    if (status.ok() && b->has_vmm()) status = ResolveBuffer(peer, b, field, held);
  });
  return status;
}

}  // namespace wprep::server
