// wprep_ipc_client: the GPU tests' client process. It allocates with cudaMalloc in its
// own process and sends CUDA IPC handles to a running wprepd, checking every output
// byte for byte against the reference vectors. Prints "OK ..." lines; exit 0 when every
// check passed, 1 on a failed check, 2 on bad usage, 3 when it has no GPU.
//
//   wprep_ipc_client --target=unix:///path --mode=ipc2ipc|bytes2ipc|ipc2bytes
//       [--alloc-device=N] [--current-device=M] [--repeat=R] [--no-release] [--register]
//   wprep_ipc_client --target=... --mode=bad-garbage|bad-beyond|bad-wrong-uuid
//   wprep_ipc_client --target=... --mode=loop-big      (converts until killed)
//   wprep_ipc_client --target=... --mode=batch|batch-bad  (every case in one ConvertBatch;
//       batch-bad: one item's range reaches past its allocation, so nothing may be written)
//   wprep_ipc_client --target=... --mode=shared-source [--parallel=N]
//       (N requests at once share one new source handle, each with its own destination)
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "golden.h"
#include "wprep/client/client.h"
#include "wprep/kernels/plan.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

namespace v1 = wprep::v1;
using wprep::testing::GoldenCase;

[[maybe_unused]] int Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  std::fflush(stdout);
  return 1;
}

#if WPREP_HAVE_CUDA
#define CHECK_CUDA(call)                                                               \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) return Fail(absl::StrCat(#call, ": ", cudaGetErrorString(e_))); \
  } while (0)

struct Args {
  std::string target, mode;
  int alloc_device = 0, current_device = -1, repeat = 1, parallel = 8;
  bool release = true;
  bool register_first = false;  // RegisterIpcHandles (twice) before converting
};

// One device allocation with a tensor at `offset`, and its IPC handle.
struct DeviceBuffer {
  void* base = nullptr;
  uint64_t offset = 0, size = 0, alloc = 0;
  std::string handle;
};

int Alloc(uint64_t size, uint64_t offset, DeviceBuffer* b) {
  b->offset = offset;
  b->size = size;
  b->alloc = size + offset + 4096;
  CHECK_CUDA(cudaMalloc(&b->base, b->alloc));
  CHECK_CUDA(cudaMemset(b->base, 0xEE, b->alloc));
  cudaIpcMemHandle_t h;
  CHECK_CUDA(cudaIpcGetMemHandle(&h, b->base));
  b->handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return 0;
}

v1::CudaIpcBuffer Ipc(const DeviceBuffer& b, const std::string& uuid) {
  v1::CudaIpcBuffer r;
  r.set_handle(b.handle);
  r.set_offset(b.offset);
  r.set_size(b.size);
  r.set_device_uuid(uuid);
  return r;
}

std::string Expected(const GoldenCase& c) {
  if (!c.output_file.empty()) {
    std::vector<uint8_t> v = wprep::testing::ReadFile(c.output_file);
    return std::string(v.begin(), v.end());
  }
  return "";  // compared by sha256
}

bool Matches(const GoldenCase& c, const std::string& got) {
  if (got.size() != c.output_bytes) return false;
  if (!c.output_file.empty()) return got == Expected(c);
  return wprep::testing::Sha256Hex(std::vector<uint8_t>(got.begin(), got.end())) == c.output_sha256;
}

// Every case of the three reference sets: values, scales, checkpoint order.
const std::vector<GoldenCase>& AllCases() {
  static const std::vector<GoldenCase>& all = *[] {
    auto* v = new std::vector<GoldenCase>();
    for (auto set : {wprep::testing::GoldenSet::kValues, wprep::testing::GoldenSet::kScales,
                     wprep::testing::GoldenSet::kPacking}) {
      for (const GoldenCase& c : wprep::testing::GoldenCases(set)) v->push_back(c);
    }
    return v;
  }();
  return all;
}

// One case's input (copied in at offset 256) and output buffers on the current device.
struct CaseBuffers {
  const GoldenCase* c;
  DeviceBuffer in, out;
};

// Buffers for every case of the three sets with bytes on both sides; 0 or Fail's code.
int AllocateCases(std::vector<CaseBuffers>* items) {
  for (const GoldenCase& c : AllCases()) {
    if (c.error || c.input_bytes == 0 || c.output_bytes == 0) continue;
    CaseBuffers it{&c, {}, {}};
    const std::vector<uint8_t> in = wprep::testing::GoldenInput(c);
    if (int r = Alloc(c.input_bytes, 256, &it.in); r != 0) return r;
    CHECK_CUDA(cudaMemcpy(static_cast<uint8_t*>(it.in.base) + 256, in.data(), in.size(), cudaMemcpyHostToDevice));
    if (int r = Alloc(c.output_bytes, 512, &it.out); r != 0) return r;
    items->push_back(std::move(it));
  }
  return 0;
}

// Every case as one ConvertBatch, IPC -> IPC: byte exact, no extra device bytes. With
// `spoil`, one item (in the middle) has a source range beyond its allocation: the batch
// must fail naming that item, and no destination may have been written.
int RunBatch(const Args& a, wprep::client::Client& client, const std::string& uuid, bool spoil) {
  std::vector<CaseBuffers> items;
  if (int r = AllocateCases(&items); r != 0) return r;
  v1::ConvertBatchRequest batch;
  for (const CaseBuffers& it : items) {
    v1::ConvertItem* ci = batch.add_items()->mutable_convert();
    *ci->mutable_spec() = wprep::SpecToProto(it.c->spec);
    for (int64_t d : it.c->logical_shape) ci->add_logical_shape(d);
    *ci->mutable_source()->mutable_ipc() = Ipc(it.in, uuid);
    for (int64_t st : it.c->input_strides) ci->mutable_source()->mutable_ipc()->add_strides(st);
    *ci->mutable_destination()->mutable_ipc() = Ipc(it.out, uuid);
  }
  const size_t bad = items.size() / 2;
  if (spoil) {
    // A range that passes every field check but reaches past the real allocation: only
    // the daemon's mapping of the handle can tell, after the edge checked every item.
    v1::CudaIpcBuffer* src = batch.mutable_items(static_cast<int>(bad))->mutable_convert()->mutable_source()->mutable_ipc();
    src->set_offset(items[bad].in.alloc);
  }
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(batch);
  int rc = 0;
  if (spoil) {
    const std::string want = absl::StrCat("items[", bad, "]");
    if (resp.ok() || resp.status().code() != absl::StatusCode::kInvalidArgument ||
        resp.status().message().find(want) == absl::string_view::npos) {
      rc = Fail(absl::StrCat("a batch with a range beyond its allocation at ", want, " answered ",
                             resp.status().ToString()));
    }
    for (size_t i = 0; rc == 0 && i < items.size(); ++i) {
      std::string got(items[i].c->output_bytes, '\0');
      CHECK_CUDA(cudaMemcpy(got.data(), static_cast<uint8_t*>(items[i].out.base) + items[i].out.offset, got.size(),
                            cudaMemcpyDeviceToHost));
      if (got.find_first_not_of('\xEE') != std::string::npos) rc = Fail(absl::StrCat(items[i].c->name, ": written"));
    }
    if (rc == 0) std::printf("OK batch refused %s and wrote nothing\n", want.c_str());
  } else if (!resp.ok()) {
    rc = Fail(absl::StrCat("ConvertBatch: ", resp.status().ToString()));
  } else if (resp->peak_extra_device_bytes() != 0) {
    rc = Fail(absl::StrCat("an IPC->IPC batch used ", resp->peak_extra_device_bytes(), " extra device bytes"));
  } else {
    for (size_t i = 0; rc == 0 && i < items.size(); ++i) {
      const GoldenCase& c = *items[i].c;
      std::string got(c.output_bytes, '\0');
      CHECK_CUDA(cudaMemcpy(got.data(), static_cast<uint8_t*>(items[i].out.base) + items[i].out.offset, got.size(),
                            cudaMemcpyDeviceToHost));
      const v1::BatchItemResult& r = resp->items(static_cast<int>(i));
      if (!Matches(c, got)) rc = Fail(absl::StrCat(c.name, ": batch output differs from the reference"));
      else if (r.outputs(0).identity().layout() != wprep::LayoutIdentity(c.spec)) rc = Fail(c.name + ": identity");
      else if (r.engine().rfind("cuda:", 0) != 0) rc = Fail(c.name + ": engine " + r.engine());
    }
    if (rc == 0) std::printf("OK batch items=%zu\n", items.size());
  }
  (void)a;
  for (CaseBuffers& it : items) {
    cudaFree(it.in.base);
    cudaFree(it.out.base);
  }
  return rc;
}

int RunCases(const Args& a, wprep::client::Client& client, const std::string& uuid) {
  std::vector<CaseBuffers> items;
  if (int r = AllocateCases(&items); r != 0) return r;
  const bool src_ipc = a.mode != "bytes2ipc";
  const bool dst_ipc = a.mode != "ipc2bytes";
  if (a.register_first) {
    // Registers the buffers the mode sends as IPC, twice: the first call opens every
    // one, the second finds every one open; both report each allocation's real size.
    v1::RegisterIpcHandlesRequest reg;
    std::vector<const DeviceBuffer*> sent;
    for (const CaseBuffers& it : items) {
      if (src_ipc) sent.push_back(&it.in);
      if (dst_ipc) sent.push_back(&it.out);
    }
    for (const DeviceBuffer* b : sent) {
      v1::IpcHandleRef* h = reg.add_handles();
      h->set_handle(b->handle);
      h->set_device_uuid(uuid);
    }
    for (uint32_t expect_open : {0u, static_cast<uint32_t>(sent.size())}) {
      absl::StatusOr<v1::RegisterIpcHandlesResponse> r = client.RegisterIpcHandles(reg);
      if (!r.ok()) return Fail(absl::StrCat("RegisterIpcHandles: ", r.status().ToString()));
      if (r->already_open() != expect_open || r->allocation_bytes_size() != static_cast<int>(sent.size())) {
        return Fail(absl::StrCat("RegisterIpcHandles: already_open=", r->already_open(), " sizes=",
                                 r->allocation_bytes_size(), ", expected ", expect_open, " and ",
                                 sent.size()));
      }
      for (size_t i = 0; i < sent.size(); ++i) {
        // cudaMalloc may round an allocation up, never down.
        if (r->allocation_bytes(i) < sent[i]->alloc || r->allocation_bytes(i) > sent[i]->alloc + (2 << 20)) {
          return Fail(absl::StrCat("RegisterIpcHandles: allocation ", i, " reported as ",
                                   r->allocation_bytes(i), " bytes, allocated ", sent[i]->alloc));
        }
      }
    }
    std::printf("OK registered=%zu\n", sent.size());
  }
  int converted = 0;
  for (int rep = 0; rep < a.repeat; ++rep) {
    for (CaseBuffers& it : items) {
      const GoldenCase& c = *it.c;
      v1::ConvertRequest req;
      *req.mutable_spec() = wprep::SpecToProto(c.spec);
      for (int64_t d : c.logical_shape) req.add_logical_shape(d);
      if (src_ipc) {
        *req.mutable_source_ipc() = Ipc(it.in, uuid);
        for (int64_t st : c.input_strides) req.mutable_source_ipc()->add_strides(st);
      } else {
        const std::vector<uint8_t> in = wprep::testing::GoldenInput(c);
        req.set_source_bytes(std::string(in.begin(), in.end()));
        for (int64_t st : c.input_strides) req.add_source_strides(st);
      }
      if (dst_ipc) {
        *req.mutable_destination_ipc() = Ipc(it.out, uuid);
        CHECK_CUDA(cudaMemset(static_cast<uint8_t*>(it.out.base) + it.out.offset, 0xEE, c.output_bytes));
      }
      // The client's current device may differ from the buffers' GPU: the daemon goes
      // by the UUID alone.
      if (a.current_device >= 0) CHECK_CUDA(cudaSetDevice(a.current_device));
      absl::StatusOr<v1::ConvertResponse> resp = client.Convert(req);
      CHECK_CUDA(cudaSetDevice(a.alloc_device));
      if (!resp.ok()) return Fail(absl::StrCat(c.name, ": ", resp.status().ToString()));
      std::string got;
      if (dst_ipc) {
        got.resize(c.output_bytes);
        CHECK_CUDA(cudaMemcpy(got.data(), static_cast<uint8_t*>(it.out.base) + it.out.offset,
                              c.output_bytes, cudaMemcpyDeviceToHost));
        // Bytes past the output must be untouched.
        unsigned char after = 0;
        CHECK_CUDA(cudaMemcpy(&after, static_cast<uint8_t*>(it.out.base) + it.out.offset + c.output_bytes,
                              1, cudaMemcpyDeviceToHost));
        if (after != 0xEE) return Fail(absl::StrCat(c.name, ": wrote past the output"));
      } else {
        got = resp->output_bytes_inline();
      }
      if (!Matches(c, got)) return Fail(absl::StrCat(c.name, ": output differs from the reference"));
      if (resp->identity().layout() != wprep::LayoutIdentity(c.spec)) {
        return Fail(absl::StrCat(c.name, ": identity ", resp->identity().layout()));
      }
      if (resp->engine().rfind("cuda:", 0) != 0) return Fail(absl::StrCat(c.name, ": engine ", resp->engine()));
      if (src_ipc && dst_ipc && resp->peak_extra_device_bytes() != 0) {
        return Fail(absl::StrCat(c.name, ": IPC->IPC used ", resp->peak_extra_device_bytes(),
                                 " extra device bytes"));
      }
      ++converted;
    }
  }
  if (a.release) {
    v1::ReleaseIpcHandlesRequest rel;
    for (const CaseBuffers& it : items) {
      for (const DeviceBuffer* b : {&it.in, &it.out}) {
        v1::IpcHandleRef* h = rel.add_handles();
        h->set_handle(b->handle);
        h->set_device_uuid(uuid);
      }
    }
    absl::StatusOr<v1::ReleaseIpcHandlesResponse> r = client.ReleaseIpcHandles(rel);
    if (!r.ok()) return Fail(absl::StrCat("ReleaseIpcHandles: ", r.status().ToString()));
    std::printf("OK released=%u deferred=%u\n", r->released(), r->deferred());
  }
  for (CaseBuffers& it : items) {
    cudaFree(it.in.base);
    cudaFree(it.out.base);
  }
  std::printf("OK mode=%s cases=%zu converted=%d\n", a.mode.c_str(), items.size(), converted);
  return converted > 0 ? 0 : Fail("no case converted");
}

// --parallel requests, started together, convert one golden case from the same new
// source handle into destinations of their own: the daemon opens the shared handle once
// while the others wait for it (the test checks the cache counters), and every output
// must be exact.
int RunSharedSource(const Args& a, wprep::client::Client& client, const std::string& uuid) {
  const GoldenCase* pick = nullptr;
  for (const GoldenCase& c : wprep::testing::GoldenCases()) {
    if (!c.error && c.output_bytes >= 4096 && !c.output_file.empty()) {
      pick = &c;
      break;
    }
  }
  if (pick == nullptr) return Fail("no golden case of 4 KiB or more with an output file");
  const GoldenCase& c = *pick;
  DeviceBuffer in;
  if (int r = Alloc(c.input_bytes, 0, &in); r != 0) return r;
  const std::vector<uint8_t> host = wprep::testing::SplitMix64Bytes(c.input_seed, c.input_bytes);
  CHECK_CUDA(cudaMemcpy(in.base, host.data(), host.size(), cudaMemcpyHostToDevice));
  std::vector<DeviceBuffer> outs(static_cast<size_t>(a.parallel));
  for (DeviceBuffer& o : outs) {
    if (int r = Alloc(c.output_bytes, 0, &o); r != 0) return r;
  }
  std::vector<absl::Status> results(outs.size());
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  for (size_t i = 0; i < outs.size(); ++i) {
    threads.emplace_back([&, i] {
      v1::ConvertRequest req;
      *req.mutable_spec() = wprep::SpecToProto(c.spec);
      for (int64_t d : c.logical_shape) req.add_logical_shape(d);
      *req.mutable_source_ipc() = Ipc(in, uuid);
      *req.mutable_destination_ipc() = Ipc(outs[i], uuid);
      ready.fetch_add(1);
      while (ready.load() < static_cast<int>(outs.size())) std::this_thread::yield();
      results[i] = client.Convert(req).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!results[i].ok()) return Fail(absl::StrCat("request ", i, ": ", results[i].ToString()));
    std::string got(c.output_bytes, '\0');
    CHECK_CUDA(cudaMemcpy(got.data(), outs[i].base, c.output_bytes, cudaMemcpyDeviceToHost));
    if (!Matches(c, got)) return Fail(absl::StrCat(c.name, ": request ", i, "'s output differs"));
  }
  cudaFree(in.base);
  for (DeviceBuffer& o : outs) cudaFree(o.base);
  std::printf("OK mode=shared-source case=%s parallel=%zu\n", c.name.c_str(), outs.size());
  return 0;
}

int ExpectInvalid(wprep::client::Client& client, const v1::ConvertRequest& req, const char* part) {
  absl::StatusOr<v1::ConvertResponse> r = client.Convert(req);
  if (r.status().code() != absl::StatusCode::kInvalidArgument ||
      r.status().message().find(part) == absl::string_view::npos) {
    return Fail(absl::StrCat("expected INVALID_ARGUMENT with '", part, "', got ", r.status().ToString()));
  }
  std::printf("OK %s\n", r.status().ToString().c_str());
  return 0;
}

int RunBad(const Args& a, wprep::client::Client& client, const std::string& uuid) {
  DeviceBuffer in, out;
  const uint64_t n = 256 * 64;
  if (int r = Alloc(n, 0, &in); r != 0) return r;
  if (int r = Alloc(n, 0, &out); r != 0) return r;
  v1::ConvertRequest req;
  wprep::ConversionSpec spec;
  spec.hopper.mx_axis = -1;
  spec.hopper.mma_version = 2;
  *req.mutable_spec() = wprep::SpecToProto(spec);
  req.add_logical_shape(256);
  req.add_logical_shape(128);
  *req.mutable_source_ipc() = Ipc(in, uuid);
  *req.mutable_destination_ipc() = Ipc(out, uuid);
  int rc = 0;
  if (a.mode == "bad-garbage") {
    std::string garbage(64, '\0');
    for (int i = 0; i < 64; ++i) garbage[i] = static_cast<char>(i * 37 + 11);
    req.mutable_source_ipc()->set_handle(garbage);
    rc = ExpectInvalid(client, req, "could not be opened");
  } else if (a.mode == "bad-beyond") {
    req.mutable_source_ipc()->set_offset(in.alloc - 100);  // n bytes from here overrun it
    rc = ExpectInvalid(client, req, "beyond the allocation");
  } else if (a.mode == "bad-wrong-uuid") {
    int count = 0;
    CHECK_CUDA(cudaGetDeviceCount(&count));
    if (count < 2) return Fail("bad-wrong-uuid needs two GPUs");
    cudaDeviceProp other;
    CHECK_CUDA(cudaGetDeviceProperties(&other, (a.alloc_device + 1) % count));
    req.mutable_source_ipc()->set_device_uuid(std::string(other.uuid.bytes, 16));
    req.mutable_destination_ipc()->set_device_uuid(std::string(other.uuid.bytes, 16));
    // The handle would open on the named GPU over the peer link; the daemon must refuse it
    // before that and name the GPU that holds the memory (the same ordinal here: client and
    // daemon see the same GPUs).
    absl::StatusOr<v1::ConvertResponse> r = client.Convert(req);
    const bool named =
        r.status().message().find(absl::StrCat("exported from memory on the daemon's GPU ordinal ",
                                               a.alloc_device, ",")) != absl::string_view::npos;
    if (r.status().code() != absl::StatusCode::kInvalidArgument || !named) {
      return Fail(absl::StrCat("wrong-uuid: got ", r.status().ToString()));
    }
    std::printf("OK %s\n", r.status().ToString().c_str());
  } else {
    return Fail("unknown mode " + a.mode);
  }
  cudaFree(in.base);
  cudaFree(out.base);
  return rc;
}

// IPC->IPC conversions of a 256 MiB tensor in a loop, until the process is killed.
int RunLoopBig(wprep::client::Client& client, const std::string& uuid) {
  wprep::ConversionSpec spec;  // Hopper mx_axis -2 swizzle
  const std::vector<int64_t> shape = {8, 8192, 8192};
  absl::StatusOr<wprep::Plan> plan = wprep::MakePlan(spec, shape);
  if (!plan.ok()) return Fail(plan.status().ToString());
  DeviceBuffer in, out;
  if (int r = Alloc(plan->input_bytes, 0, &in); r != 0) return r;
  if (int r = Alloc(plan->output_bytes, 0, &out); r != 0) return r;
  v1::ConvertRequest req;
  *req.mutable_spec() = wprep::SpecToProto(spec);
  for (int64_t d : shape) req.add_logical_shape(d);
  *req.mutable_source_ipc() = Ipc(in, uuid);
  *req.mutable_destination_ipc() = Ipc(out, uuid);
  std::printf("STARTED\n");
  std::fflush(stdout);
  for (;;) {
    absl::StatusOr<v1::ConvertResponse> r = client.Convert(req);
    if (!r.ok()) return Fail(r.status().ToString());
  }
}
#endif  // WPREP_HAVE_CUDA

}  // namespace

int main(int argc, char** argv) {
#if !WPREP_HAVE_CUDA
  (void)argc, (void)argv;
  std::printf("SKIP no CUDA in this build\n");
  return 3;
#else
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto val = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      return s.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = val("--target=")) a.target = v;
    else if (const char* v = val("--mode=")) a.mode = v;
    else if (const char* v = val("--alloc-device=")) a.alloc_device = std::atoi(v);
    else if (const char* v = val("--current-device=")) a.current_device = std::atoi(v);
    else if (const char* v = val("--repeat=")) a.repeat = std::atoi(v);
    else if (const char* v = val("--parallel=")) a.parallel = std::atoi(v);
    else if (s == "--no-release") a.release = false;
    else if (s == "--register") a.register_first = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (a.target.empty() || a.mode.empty()) {
    std::fprintf(stderr, "usage: wprep_ipc_client --target=ADDR --mode=MODE [...]\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIP no GPU\n");
    return 3;
  }
  if (a.alloc_device >= count) return Fail("--alloc-device beyond the GPUs present");
  CHECK_CUDA(cudaSetDevice(a.alloc_device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, a.alloc_device));
  const std::string uuid(prop.uuid.bytes, 16);
  wprep::client::Client client(wprep::client::MakeChannel(a.target));
  if (a.mode == "ipc2ipc" || a.mode == "bytes2ipc" || a.mode == "ipc2bytes") return RunCases(a, client, uuid);
  if (a.mode == "loop-big") return RunLoopBig(client, uuid);
  if (a.mode == "shared-source") return RunSharedSource(a, client, uuid);
  if (a.mode == "batch") return RunBatch(a, client, uuid, false);
  if (a.mode == "batch-bad") return RunBatch(a, client, uuid, true);
  return RunBad(a, client, uuid);
#endif
}
