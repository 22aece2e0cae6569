#include "fake_runtime.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "wprep/kernels/cpu_engine.h"

namespace wprep::testing {

namespace {

class WallTimer final : public server::DeviceTimer {
 public:
  void Start(Stream) override { start_ = absl::Now(); }
  void Stop(Stream) override { stop_ = absl::Now(); }
  std::optional<double> Seconds() override { return absl::ToDoubleSeconds(stop_ - start_); }

 private:
  absl::Time start_, stop_;
};

}  // namespace

FakeRuntime::FakeRuntime(int gpus) : gpus_(gpus) {
  absl::MutexLock lock(&mu_);
  counts_.resize(static_cast<size_t>(gpus));
  capacity_.resize(static_cast<size_t>(gpus), 0);
}

FakeRuntime::~FakeRuntime() {
  absl::MutexLock lock(&mu_);
  for (auto& [p, gb] : device_) ::operator delete(p);
  for (auto& [p, b] : pinned_) ::operator delete(p);
}

server::Uuid FakeRuntime::FakeUuid(int ordinal) {
  server::Uuid u{};
  for (int i = 0; i < 16; ++i) u[i] = static_cast<uint8_t>(0xF0 ^ (ordinal * 16 + i));
  return u;
}

absl::Status FakeRuntime::CheckGpu(int gpu) const {
  if (gpu < 0 || gpu >= gpus_) return absl::InvalidArgumentError(absl::StrCat("no fake GPU ", gpu));
  return absl::OkStatus();
}

FakeRuntime::Exported FakeRuntime::ExportHandle(int gpu, uint64_t bytes) {
  auto a = std::make_shared<Allocation>();
  a->gpu = gpu;
  a->size = bytes;
  a->bytes.reset(new uint8_t[bytes == 0 ? 1 : bytes]);
  a->data = a->bytes.get();
  absl::MutexLock lock(&mu_);
  std::string handle(server::kIpcHandleBytes, '\0');
  const uint64_t id = next_handle_++;
  std::memcpy(handle.data(), &id, sizeof(id));
  handle[32] = static_cast<char>(gpu);
  exported_[handle] = a;
  return Exported{a->data, handle};
}

void FakeRuntime::FreeExported(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = exported_.find(handle);
  if (it != exported_.end()) it->second->freed_by_owner = true;
}

void FakeRuntime::SetDeviceCapacity(int gpu, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  capacity_[static_cast<size_t>(gpu)] = bytes;
}

void FakeRuntime::SetPinnedFails(bool fail) {
  absl::MutexLock lock(&mu_);
  pinned_fails_ = fail;
}

FakeRuntime::Counts FakeRuntime::counts(int gpu) const {
  absl::MutexLock lock(&mu_);
  return counts_[static_cast<size_t>(gpu)];
}

FakeRuntime::Counts FakeRuntime::totals() const {
  absl::MutexLock lock(&mu_);
  Counts t;
  for (const Counts& c : counts_) {
    t.converts += c.converts;
    t.ipc_opens += c.ipc_opens;
    t.ipc_closes += c.ipc_closes;
    t.touches += c.touches;
    t.events_alive += c.events_alive;
    t.ipc_events_alive += c.ipc_events_alive;
    t.ipc_event_opens += c.ipc_event_opens;
    t.ipc_event_records += c.ipc_event_records;
    t.ipc_event_waits += c.ipc_event_waits;
    t.converts_after_ipc_wait += c.converts_after_ipc_wait;
    t.value_waits += c.value_waits;
    t.converts_after_value_wait += c.converts_after_value_wait;
    t.flag_writes += c.flag_writes;
    t.device_bytes_now += c.device_bytes_now;
    t.device_bytes_peak += c.device_bytes_peak;
    t.vmm_opens += c.vmm_opens;
    t.vmm_open_failures += c.vmm_open_failures;
    t.vmm_closes += c.vmm_closes;
    t.vmm_mapped_now += c.vmm_mapped_now;
  }
  for (const auto& [p, b] : pinned_) t.pinned_bytes_now += b;
  return t;
}

absl::StatusOr<std::vector<GpuInfo>> FakeRuntime::ListGpus() {
  std::vector<GpuInfo> out;
  for (int i = 0; i < gpus_; ++i) {
    GpuInfo g;
    g.ordinal = i;
    g.uuid = FakeUuid(i);
    g.name = "Fake GPU";
    g.cc_major = 9;
    g.total_memory = 1ull << 30;
    out.push_back(g);
  }
  return out;
}

absl::StatusOr<Stream> FakeRuntime::CreateStream(int gpu) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  return reinterpret_cast<Stream>(static_cast<uintptr_t>(next_stream_++ * 16));
}

void FakeRuntime::DestroyStream(int, Stream stream) {
  absl::MutexLock lock(&mu_);
  waited_streams_.erase(stream);
  value_waited_streams_.erase(stream);
}

absl::Status FakeRuntime::ConfigurePool(int gpu, uint64_t) { return CheckGpu(gpu); }

absl::StatusOr<void*> FakeRuntime::AllocateAsync(int gpu, uint64_t bytes, Stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  Counts& c = counts_[static_cast<size_t>(gpu)];
  const uint64_t cap = capacity_[static_cast<size_t>(gpu)];
  if (cap != 0 && c.device_bytes_now + bytes > cap) {
    return absl::ResourceExhaustedError(absl::StrCat("fake GPU ", gpu, " is out of memory"));
  }
  void* p = ::operator new(bytes, std::nothrow);
  if (p == nullptr) return absl::ResourceExhaustedError("fake device allocation failed");
  device_[p] = {gpu, bytes};
  c.device_bytes_now += bytes;
  c.device_bytes_peak = std::max(c.device_bytes_peak, c.device_bytes_now);
  return p;
}

absl::Status FakeRuntime::FreeAsync(int gpu, void* ptr, Stream) {
  absl::MutexLock lock(&mu_);
  auto it = device_.find(ptr);
  if (it == device_.end() || it->second.first != gpu) {
    return absl::InternalError("free of memory this fake GPU did not allocate");
  }
  counts_[static_cast<size_t>(gpu)].device_bytes_now -= it->second.second;
  ::operator delete(ptr);
  device_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<void*> FakeRuntime::AllocateShared(int gpu, uint64_t bytes) {
  return AllocateAsync(gpu, bytes, nullptr);
}

void FakeRuntime::FreeShared(int gpu, void* ptr) {
  {
    absl::MutexLock lock(&mu_);
    auto vmm = shared_vmm_.find(ptr);
    if (vmm != shared_vmm_.end()) {
      munmap(ptr, vmm->second.bytes);
      close(vmm->second.memfd);
      counts_[static_cast<size_t>(vmm->second.gpu)].device_bytes_now -= vmm->second.bytes;
      shared_vmm_.erase(vmm);
      return;
    }
    for (auto& [handle, a] : exported_) {
      if (a->bytes == nullptr && a->data == ptr) a->freed_by_owner = true;
    }
  }
  (void)FreeAsync(gpu, ptr, nullptr);
}

absl::StatusOr<void*> FakeRuntime::AllocateSharedVmm(int gpu, uint64_t bytes) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  constexpr uint64_t kGranularity = 2u << 20;
  const uint64_t size = (std::max<uint64_t>(bytes, 1) + kGranularity - 1) / kGranularity * kGranularity;
  absl::MutexLock lock(&mu_);
  Counts& c = counts_[static_cast<size_t>(gpu)];
  const uint64_t cap = capacity_[static_cast<size_t>(gpu)];
  if (cap != 0 && c.device_bytes_now + size > cap) {
    return absl::ResourceExhaustedError(absl::StrCat("fake GPU ", gpu, " is out of memory"));
  }
  const int fd = memfd_create("wprep-fake-vmm", MFD_CLOEXEC);
  if (fd < 0) return absl::ResourceExhaustedError("memfd_create failed");
  void* p = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
    p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (p == MAP_FAILED) {
    close(fd);
    return absl::ResourceExhaustedError("fake VMM allocation failed");
  }
  shared_vmm_[p] = SharedVmm{gpu, fd, size};
  c.device_bytes_now += size;
  c.device_bytes_peak = std::max(c.device_bytes_peak, c.device_bytes_now);
  return p;
}

absl::StatusOr<server::VmmExport> FakeRuntime::ExportVmm(int gpu, void* ptr) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = shared_vmm_.find(ptr);
  if (it == shared_vmm_.end() || it->second.gpu != gpu) return absl::NotFoundError("no fake VMM allocation there");
  const int fd = fcntl(it->second.memfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return absl::ResourceExhaustedError("dup of the memfd failed");
  return server::VmmExport{fd, it->second.bytes};
}

int FakeRuntime::vmm_shared_now() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(shared_vmm_.size());
}

absl::StatusOr<std::string> FakeRuntime::ExportIpc(int gpu, void* ptr) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = device_.find(ptr);
  if (it == device_.end() || it->second.first != gpu) {
    return absl::InvalidArgumentError("cudaErrorInvalidValue (invalid argument)");
  }
  auto a = std::make_shared<Allocation>();
  a->gpu = gpu;
  a->data = static_cast<uint8_t*>(ptr);
  a->size = it->second.second;
  std::string handle(server::kIpcHandleBytes, '\0');
  const uint64_t id = next_handle_++;
  std::memcpy(handle.data(), &id, sizeof(id));
  handle[32] = static_cast<char>(gpu);
  exported_[handle] = a;
  return handle;
}

absl::Status FakeRuntime::CopyToDeviceAsync(int gpu, void* dst, const void* src, uint64_t bytes, Stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status FakeRuntime::CopyToHostAsync(int gpu, void* dst, const void* src, uint64_t bytes, Stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status FakeRuntime::Convert(int gpu, const Plan& plan, const void* in, void* out, Stream stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    Counts& c = counts_[static_cast<size_t>(gpu)];
    c.converts++;
    if (waited_streams_.count(stream) > 0) c.converts_after_ipc_wait++;
    if (value_waited_streams_.count(stream) > 0) c.converts_after_value_wait++;
  }
  return ConvertOnCpu(plan, static_cast<const uint8_t*>(in), plan.input_bytes, static_cast<uint8_t*>(out),
                      plan.output_bytes, CpuOptions{1});
}

absl::Status FakeRuntime::ConvertMoe(int gpu, const MoePlan& plan, absl::Span<const void* const> in,
                                     absl::Span<void* const> out, Stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    counts_[static_cast<size_t>(gpu)].converts++;
  }
  if (in.size() != plan.inputs.size() || out.size() != plan.outputs.size()) {
    return absl::InvalidArgumentError("ConvertMoe: one pointer per plan input and output");
  }
  std::vector<absl::Span<const uint8_t>> ins;
  std::vector<absl::Span<uint8_t>> outs;
  ins.reserve(in.size());
  outs.reserve(out.size());
  for (size_t i = 0; i < in.size(); ++i) ins.emplace_back(static_cast<const uint8_t*>(in[i]), plan.input_bytes[i]);
  for (size_t i = 0; i < out.size(); ++i) outs.emplace_back(static_cast<uint8_t*>(out[i]), plan.output_bytes[i]);
  return RunMoeCpu(plan, ins, outs, 1);
}

absl::Status FakeRuntime::Quantize(int gpu, const QuantizePlan& plan, const QuantLayoutSpec& layout, const void* in,
                                   void* values, void* scales, const QuantBias& bias, Stream) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    counts_[static_cast<size_t>(gpu)].converts++;
  }
  // The fake's device memory is host memory: the CPU engine, with the sizes the plan gives.
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  absl::StatusOr<QuantOutputSizes> sizes = PlanQuantizeLayout(plan, layout);
  if (!sizes.ok()) return sizes.status();
  return QuantizeLayoutOnCpu(plan, layout, src, plan.input_bytes, v, sizes->values_bytes, s, sizes->scales_bytes, bias);
}

absl::Status FakeRuntime::Synchronize(int gpu, Stream) { return CheckGpu(gpu); }

std::unique_ptr<server::DeviceTimer> FakeRuntime::NewTimer(int) { return std::make_unique<WallTimer>(); }

std::string FakeRuntime::ExportEventHandle(int gpu) {
  absl::MutexLock lock(&mu_);
  std::string handle(server::kIpcEventHandleBytes, '\0');
  const uint64_t id = next_handle_++;
  std::memcpy(handle.data(), &id, sizeof(id));
  handle[40] = 'E';
  event_handles_[handle] = gpu;
  return handle;
}

void FakeRuntime::ForgetEventHandle(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  event_handles_.erase(handle);
}

void FakeRuntime::HoldEventWaits(bool hold) {
  absl::MutexLock lock(&mu_);
  hold_event_waits_ = hold;
}

bool FakeRuntime::WaitEventWaiters(int n) {
  absl::MutexLock lock(&mu_);
  auto waiting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return event_waiters_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&waiting), absl::Seconds(20));
}

absl::StatusOr<server::Event> FakeRuntime::CreateEvent(int gpu) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  counts_[static_cast<size_t>(gpu)].events_alive++;
  return reinterpret_cast<server::Event>(new FakeEvent{gpu, false});
}

absl::StatusOr<server::Event> FakeRuntime::OpenIpcEvent(int gpu, absl::string_view handle) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = event_handles_.find(std::string(handle));
  if (it == event_handles_.end() || it->second != gpu) {
    return absl::InvalidArgumentError("cudaErrorInvalidResourceHandle (invalid resource handle)");
  }
  Counts& c = counts_[static_cast<size_t>(gpu)];
  c.ipc_event_opens++;
  c.events_alive++;
  c.ipc_events_alive++;
  return reinterpret_cast<server::Event>(new FakeEvent{gpu, true});
}

void FakeRuntime::DestroyEvent(int gpu, server::Event event) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  absl::MutexLock lock(&mu_);
  counts_[static_cast<size_t>(gpu)].events_alive--;
  if (e->ipc) counts_[static_cast<size_t>(gpu)].ipc_events_alive--;
  delete e;
}

absl::Status FakeRuntime::RecordEvent(int gpu, server::Event event, Stream) {
  const auto* e = reinterpret_cast<const FakeEvent*>(event);
  if (e->gpu != gpu) return absl::InternalError("an event recorded on another fake GPU");
  absl::MutexLock lock(&mu_);
  Counts& c = counts_[static_cast<size_t>(gpu)];
  if (e->ipc) {
    c.ipc_event_records++;
    c.converts_at_ipc_event_record = c.converts;
  }
  return absl::OkStatus();
}

absl::Status FakeRuntime::StreamWaitEvent(int gpu, Stream stream, server::Event event) {
  const auto* e = reinterpret_cast<const FakeEvent*>(event);
  if (e->gpu != gpu) return absl::InternalError("a wait for an event of another fake GPU");
  if (e->ipc) {
    absl::MutexLock lock(&mu_);
    counts_[static_cast<size_t>(gpu)].ipc_event_waits++;
    waited_streams_.insert(stream);
  }
  return absl::OkStatus();
}

absl::Status FakeRuntime::SynchronizeEvent(int gpu, server::Event) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  ++event_waiters_;
  auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !hold_event_waits_; };
  mu_.Await(absl::Condition(&released));
  --event_waiters_;
  return absl::OkStatus();
}

absl::Status FakeRuntime::WriteValue32(int gpu, Stream, void* ptr, uint32_t value) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  if (reinterpret_cast<uintptr_t>(ptr) % 4 != 0) return absl::InternalError("an unaligned flag write");
  absl::MutexLock lock(&mu_);
  Counts& c = counts_[static_cast<size_t>(gpu)];
  c.flag_writes++;
  c.converts_at_flag_write = c.converts;
  std::memcpy(ptr, &value, sizeof(value));
  return absl::OkStatus();
}

absl::Status FakeRuntime::WaitValue32(int gpu, Stream stream, void* ptr, uint32_t value) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  if (reinterpret_cast<uintptr_t>(ptr) % 4 != 0) return absl::InternalError("an unaligned word wait");
  uint32_t word = 0;
  std::memcpy(&word, ptr, sizeof(word));
  if (static_cast<int32_t>(word - value) < 0) {
    return absl::InternalError(absl::StrCat("fake GPU: a wait for word ", word, " to reach ", value,
                                            " would never end (the fake's work is synchronous)"));
  }
  absl::MutexLock lock(&mu_);
  counts_[static_cast<size_t>(gpu)].value_waits++;
  value_waited_streams_.insert(stream);
  return absl::OkStatus();
}

absl::StatusOr<void*> FakeRuntime::RegisterHost(int gpu, void* ptr, uint64_t bytes) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (!host_registered_.emplace(ptr, bytes).second) return absl::InvalidArgumentError("host memory registered twice");
  ++host_register_calls_;
  return ptr;
}

void FakeRuntime::UnregisterHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  host_registered_.erase(ptr);
}

absl::StatusOr<void*> FakeRuntime::HostDevicePointer(int gpu, void* ptr) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (host_registered_.count(ptr) == 0) return absl::InvalidArgumentError("host memory not registered");
  return ptr;
}

size_t FakeRuntime::host_registrations() const {
  absl::MutexLock lock(&mu_);
  return host_registered_.size();
}

int FakeRuntime::host_register_calls() const {
  absl::MutexLock lock(&mu_);
  return host_register_calls_;
}

absl::StatusOr<void*> FakeRuntime::AllocatePinned(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (pinned_fails_) return absl::ResourceExhaustedError("fake pinned memory is short");
  void* p = ::operator new(bytes, std::nothrow);
  if (p == nullptr) return absl::ResourceExhaustedError("fake pinned allocation failed");
  pinned_[p] = bytes;
  return p;
}

void FakeRuntime::FreePinned(void* ptr) {
  absl::MutexLock lock(&mu_);
  if (pinned_.erase(ptr) == 1) ::operator delete(ptr);
}

absl::StatusOr<IpcMapping> FakeRuntime::OpenIpc(int gpu, absl::string_view handle) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  counts_[static_cast<size_t>(gpu)].ipc_opens++;
  auto it = exported_.find(std::string(handle));
  if (it == exported_.end() || it->second->freed_by_owner) {
    return absl::InvalidArgumentError("cudaErrorInvalidValue (invalid argument)");
  }
  Allocation& a = *it->second;
  a.open_mappings++;
  mapped_[a.data] = it->second;
  return IpcMapping{a.data, a.size};
}

absl::Status FakeRuntime::CloseIpc(int gpu, void* base) {
  absl::MutexLock lock(&mu_);
  auto it = mapped_.find(base);
  if (it == mapped_.end()) return absl::InternalError("close of a mapping that is not open");
  counts_[static_cast<size_t>(gpu)].ipc_closes++;
  if (--it->second->open_mappings == 0) mapped_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<IpcMapping> FakeRuntime::OpenVmm(int gpu, const server::VmmImportSpec& spec) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  auto fail = [&](absl::Status s) {
    absl::MutexLock lock(&mu_);
    counts_[static_cast<size_t>(gpu)].vmm_open_failures++;
    return s;
  };
  if (spec.kind != server::VmmHandleKind::kPosixFd) return fail(absl::FailedPreconditionError("no fabric handles"));
  uint64_t total = 0;
  for (const server::VmmChunkHandle& c : spec.chunks) total += c.bytes;
  if (total == 0) return fail(absl::InvalidArgumentError("no chunks"));
  void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return fail(absl::ResourceExhaustedError("mmap of the range failed"));
  uint64_t at = 0;
  for (const server::VmmChunkHandle& c : spec.chunks) {
    struct stat st;
    if (fstat(c.fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < c.bytes) {
      munmap(base, total);
      return fail(absl::InvalidArgumentError("CUDA_ERROR_INVALID_VALUE: the chunk is not an allocation of that size"));
    }
    if (mmap(static_cast<uint8_t*>(base) + at, c.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, c.fd, 0) ==
        MAP_FAILED) {
      munmap(base, total);
      return fail(absl::InvalidArgumentError("cuMemMap failed (mmap of the chunk)"));
    }
    at += c.bytes;
  }
  absl::MutexLock lock(&mu_);
  Counts& counts = counts_[static_cast<size_t>(gpu)];
  counts.vmm_opens++;
  counts.vmm_mapped_now++;
  vmm_ranges_[base] = total;
  return IpcMapping{base, total};
}

absl::Status FakeRuntime::CloseVmm(int gpu, void* base) {
  absl::MutexLock lock(&mu_);
  auto it = vmm_ranges_.find(base);
  if (it == vmm_ranges_.end()) return absl::InternalError("close of a VMM range that is not mapped");
  munmap(base, it->second);
  vmm_ranges_.erase(it);
  Counts& counts = counts_[static_cast<size_t>(gpu)];
  counts.vmm_closes++;
  counts.vmm_mapped_now--;
  return absl::OkStatus();
}

server::VmmSupport FakeRuntime::VmmImportSupport(int) { return server::VmmSupport{true, false}; }

absl::Status FakeRuntime::Touch(int gpu, const void*, uint64_t) {
  if (absl::Status s = CheckGpu(gpu); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  counts_[static_cast<size_t>(gpu)].touches++;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FakeRuntime::ExportSampleHandles(int gpu, int count) {
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) out.push_back(ExportHandle(gpu, 64).handle);
  return out;
}

}  // namespace wprep::testing
