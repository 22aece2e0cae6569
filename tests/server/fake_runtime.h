// A DeviceRuntime on host memory, for host-only tests of the daemon's GPU paths: its
// GPUs' "device memory" is ordinary memory, conversions run on the CPU engine, work is
// synchronous, and IPC handles name allocations registered with ExportHandle in this
// process. It counts what the daemon asked of it and can be told to fail.
#ifndef WPREP_TESTS_SERVER_FAKE_RUNTIME_H_
#define WPREP_TESTS_SERVER_FAKE_RUNTIME_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "device/device_runtime.h"

namespace wprep::testing {

using server::GpuInfo;
using server::IpcMapping;
using server::Stream;

class FakeRuntime final : public server::DeviceRuntime {
 public:
  // `gpus` GPUs with ordinals 0..gpus-1 and UUIDs FakeUuid(ordinal).
  explicit FakeRuntime(int gpus);
  ~FakeRuntime() override;

  static server::Uuid FakeUuid(int ordinal);

  // Device memory of `gpu` a client owns: `bytes` bytes, and the handle another process
  // would send for it. The memory lives until FreeExported.
  struct Exported {
    uint8_t* ptr = nullptr;
    std::string handle;
  };
  Exported ExportHandle(int gpu, uint64_t bytes);
  // The owner frees the allocation: opening its handle fails from now on (mappings open
  // already keep their memory, as CUDA keeps an opened allocation alive).
  void FreeExported(const std::string& handle);

  // Fault injection: the GPU's pool holds at most `bytes` (0 = unlimited); pinned
  // allocations fail while `fail` is set.
  void SetDeviceCapacity(int gpu, uint64_t bytes);
  void SetPinnedFails(bool fail);

  // An interprocess event of a client on `gpu`: the handle it would send. Opening it
  // fails once ForgetEventHandle was called.
  std::string ExportEventHandle(int gpu);
  void ForgetEventHandle(const std::string& handle);
  // While held, SynchronizeEvent blocks: the fake GPU has not finished the work queued
  // before the event (work itself runs at once, as ever).
  void HoldEventWaits(bool hold);
  // Waits until `n` SynchronizeEvent calls are blocked by HoldEventWaits.
  bool WaitEventWaiters(int n);

  // What the daemon asked for.
  struct Counts {
    int converts = 0;
    int ipc_opens = 0;
    int ipc_closes = 0;
    int touches = 0;
    int events_alive = 0;       // created or opened, not yet destroyed
    int ipc_events_alive = 0;   // of those, opened from a client's handle
    int ipc_event_opens = 0;
    int ipc_event_records = 0;  // records of a client's event
    int converts_at_ipc_event_record = -1;  // `converts` when it was last recorded
    int ipc_event_waits = 0;          // streams made to wait for a client's event
    int converts_after_ipc_wait = 0;  // on a stream that had waited for a client's event
    int flag_writes = 0;              // WriteValue32 calls
    int converts_at_flag_write = -1;  // `converts` at the last one
    int value_waits = 0;               // WaitValue32 calls
    int converts_after_value_wait = 0;  // on a stream that had waited for a word
    uint64_t device_bytes_now = 0;  // allocated and not yet freed, every GPU
    uint64_t device_bytes_peak = 0;  // the most device_bytes_now reached (totals: the GPUs' sum)
    uint64_t pinned_bytes_now = 0;
    int vmm_opens = 0;         // OpenVmm calls that mapped
    int vmm_open_failures = 0;  // OpenVmm calls that failed (nothing stays mapped)
    int vmm_closes = 0;
    int vmm_mapped_now = 0;    // ranges OpenVmm mapped, not yet closed
  };
  Counts counts(int gpu) const;
  Counts totals() const;
  // Host mappings registered now (RegisterHost, not yet unregistered), and RegisterHost
  // calls that succeeded so far.
  size_t host_registrations() const;
  int host_register_calls() const;

  // DeviceRuntime.
  bool compiled_in() const override { return true; }
  absl::StatusOr<std::vector<GpuInfo>> ListGpus() override;
  absl::StatusOr<Stream> CreateStream(int gpu) override;
  void DestroyStream(int gpu, Stream stream) override;
  absl::Status ConfigurePool(int gpu, uint64_t keep_bytes) override;
  absl::StatusOr<void*> AllocateAsync(int gpu, uint64_t bytes, Stream stream) override;
  absl::Status FreeAsync(int gpu, void* ptr, Stream stream) override;
  absl::Status CopyToDeviceAsync(int gpu, void* dst, const void* src, uint64_t bytes, Stream stream) override;
  absl::Status CopyToHostAsync(int gpu, void* dst, const void* src, uint64_t bytes, Stream stream) override;
  absl::Status Convert(int gpu, const Plan& plan, const void* in, void* out, Stream stream) override;
  absl::Status Synchronize(int gpu, Stream stream) override;
  // The CPU engine on the fake GPU's (host) memory; counted in Counts::converts.
  absl::Status ConvertMoe(int gpu, const MoePlan& plan, absl::Span<const void* const> in, absl::Span<void* const> out,
                          Stream stream) override;
  absl::Status Quantize(int gpu, const QuantizePlan& plan, const QuantLayoutSpec& layout, const void* in,
                        void* values, void* scales, const QuantBias& bias, Stream stream) override;
  std::unique_ptr<server::DeviceTimer> NewTimer(int gpu) override;
  // Shared memory counts as device memory; FreeShared makes its handles fail to open.
  absl::StatusOr<void*> AllocateShared(int gpu, uint64_t bytes) override;
  void FreeShared(int gpu, void* ptr) override;
  absl::StatusOr<std::string> ExportIpc(int gpu, void* ptr) override;
  // A memfd mapped shared stands in for the physical chunk, granularity 2 MiB; its
  // export is a duplicate of the memfd, which a client maps with mmap. Counts as device
  // memory too.
  absl::StatusOr<void*> AllocateSharedVmm(int gpu, uint64_t bytes) override;
  absl::StatusOr<server::VmmExport> ExportVmm(int gpu, void* ptr) override;
  // AllocateSharedVmm allocations not yet freed.
  int vmm_shared_now() const;
  absl::StatusOr<void*> AllocatePinned(uint64_t bytes) override;
  void FreePinned(void* ptr) override;
  absl::StatusOr<server::Event> CreateEvent(int gpu) override;
  absl::StatusOr<server::Event> OpenIpcEvent(int gpu, absl::string_view handle) override;
  void DestroyEvent(int gpu, server::Event event) override;
  absl::Status RecordEvent(int gpu, server::Event event, Stream stream) override;
  absl::Status StreamWaitEvent(int gpu, Stream stream, server::Event event) override;
  absl::Status SynchronizeEvent(int gpu, server::Event event) override;
  // Writes at once (work is synchronous), into mapped or allocated memory of the GPU.
  absl::Status WriteValue32(int gpu, Stream stream, void* ptr, uint32_t value) override;
  // The fake's work is synchronous, so the word must hold the value already: an error
  // otherwise (what would wait forever on a GPU). Later converts on the stream count in
  // converts_after_value_wait.
  absl::Status WaitValue32(int gpu, Stream stream, void* ptr, uint32_t value) override;
  // Host memory is the fake GPUs' memory: its device address is itself.
  absl::StatusOr<void*> RegisterHost(int gpu, void* ptr, uint64_t bytes) override;
  void UnregisterHost(void* ptr) override;
  absl::StatusOr<void*> HostDevicePointer(int gpu, void* ptr) override;
  absl::StatusOr<IpcMapping> OpenIpc(int gpu, absl::string_view handle) override;
  absl::Status CloseIpc(int gpu, void* base) override;
  // POSIX-fd chunks are files the daemon can mmap (a client's memfds, say): mapped shared,
  // back to back, so the fake GPU reads and writes the client's memory. A chunk larger
  // than its file, or a descriptor that is not a file, fails as cuMemMap would. Fabric
  // handles are not supported (VmmImportSupport says so).
  absl::StatusOr<IpcMapping> OpenVmm(int gpu, const server::VmmImportSpec& spec) override;
  absl::Status CloseVmm(int gpu, void* base) override;
  server::VmmSupport VmmImportSupport(int gpu) override;
  absl::Status Touch(int gpu, const void* ptr, uint64_t bytes) override;
  absl::StatusOr<std::vector<std::string>> ExportSampleHandles(int gpu, int count) override;

 private:
  struct Allocation {
    int gpu = 0;
    std::unique_ptr<uint8_t[]> bytes;  // null for the daemon's own (ExportIpc)
    uint8_t* data = nullptr;
    uint64_t size = 0;
    bool freed_by_owner = false;
    int open_mappings = 0;
  };
  absl::Status CheckGpu(int gpu) const;

  const int gpus_;
  mutable absl::Mutex mu_;
  std::vector<Counts> counts_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> capacity_ ABSL_GUARDED_BY(mu_);
  std::map<void*, std::pair<int, uint64_t>> device_ ABSL_GUARDED_BY(mu_);  // ptr -> (gpu, bytes)
  std::map<void*, uint64_t> pinned_ ABSL_GUARDED_BY(mu_);
  std::map<void*, uint64_t> host_registered_ ABSL_GUARDED_BY(mu_);
  std::set<Stream> value_waited_streams_ ABSL_GUARDED_BY(mu_);
  int host_register_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<Allocation>> exported_ ABSL_GUARDED_BY(mu_);
  std::map<void*, std::shared_ptr<Allocation>> mapped_ ABSL_GUARDED_BY(mu_);  // base -> allocation
  struct FakeEvent {
    int gpu = 0;
    bool ipc = false;
  };
  std::map<void*, uint64_t> vmm_ranges_ ABSL_GUARDED_BY(mu_);  // base -> bytes
  struct SharedVmm {
    int gpu = 0;
    int memfd = -1;
    uint64_t bytes = 0;
  };
  std::map<void*, SharedVmm> shared_vmm_ ABSL_GUARDED_BY(mu_);  // base -> its memfd
  std::map<std::string, int> event_handles_ ABSL_GUARDED_BY(mu_);  // handle -> gpu
  std::set<Stream> waited_streams_ ABSL_GUARDED_BY(mu_);  // waited for a client's event
  bool hold_event_waits_ ABSL_GUARDED_BY(mu_) = false;
  int event_waiters_ ABSL_GUARDED_BY(mu_) = 0;
  bool pinned_fails_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_stream_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SERVER_FAKE_RUNTIME_H_
