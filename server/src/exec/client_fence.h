// A batch's ordering against its client's GPU work, below the wire edge: what the batch
// waits for before its first read or write, what it signals after its last write, and
// whether it is answered once queued. The edge (proto_translate.h) checks the rules and
// fills a BatchFences; ClientFence opens it for one batch (the client's events, its words
// of GPU memory and of shared host memory), queues the wait and the signal on the GPU's
// streams, and hands a host word the client can no longer write to ReadyWords, which
// releases it after the ready timeout or once its ConvertBatches stream ends cancelled.
// Errors name roles (the wait fence, the signal fence, item 3), never wire fields: they
// are OperandErrors (operand_error.h) of Operand::kWaitFence / kSignalFence whose part
// starts with "event" or "word".
#ifndef WPREP_SERVER_SRC_EXEC_CLIENT_FENCE_H_
#define WPREP_SERVER_SRC_EXEC_CLIENT_FENCE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "device/device_manager.h"
#include "device/host_words.h"
#include "device/ipc_cache.h"
#include "exec/job.h"
#include "exec/operand_error.h"
#include "exec/ready_words.h"

namespace wprep::server {

// The fences of one batch, opened. Move-only; closes the client's events it opened.
class ClientFence {
 public:
  struct Deps {
    DeviceManager* devices;
    IpcCache* ipc;
    HostWords* host_words;
    ReadyWords* ready_words;
  };
  // Opens `fences` (null: none) for a batch whose job i runs on `gpus[i]` (nullptr: the
  // CPU) and has IPC memory when `has_ipc[i]`. A fence orders one GPU's work: every job
  // with IPC memory must be on the fence's GPU (a signal, on one GPU with every job).
  static absl::StatusOr<ClientFence> Open(const Deps& deps, const BatchFences* fences, const std::vector<Gpu*>& gpus,
                                          const std::vector<bool>& has_ipc);
  ClientFence() = default;
  ClientFence(ClientFence&& o) noexcept;
  ClientFence& operator=(ClientFence&& o) noexcept;
  ~ClientFence();

  // The GPU of a batch answered once queued (its one GPU), or nullptr.
  Gpu* queued_gpu() const { return queued_gpu_; }
  // Queues the wait fence on each of `streams` of `gpu` (nothing when it is another GPU).
  absl::Status WaitOn(Gpu& gpu, const std::vector<Stream>& streams);
  // After the work on `streams` of the queued GPU: records the signal event and the
  // daemon's `done` (joins taken appended to `joins`), then writes the signal word.
  absl::Status SignalAfter(const std::vector<Stream>& streams, Event done, std::vector<Event>* joins);

  // A word mapped: `ptr` is its address on the GPU while the lease or `host` lives.
  struct MappedWord {
    void* ptr = nullptr;
    IpcCache::Lease ipc;               // a word of GPU memory
    std::shared_ptr<const void> host;  // a word of shared host memory
    uint32_t* host_word = nullptr;     // its address in the daemon
    uint32_t value = 0;
  };
  // The word mappings, which queued work holds until it is done.
  struct Words {
    MappedWord wait, signal;
  };
  Words TakeWords() { return std::move(words_); }

 private:
  absl::Status OpenEvent(Operand role, const FenceRef::EventRef& ref, const std::vector<Gpu*>& gpus,
                         const std::vector<bool>& has_ipc, Gpu** gpu, Event* event);
  absl::StatusOr<MappedWord> MapWord(Operand role, Gpu& gpu, const FenceRef::WordRef& word);
  void Close();

  Deps deps_{};
  const BatchFences* fences_ = nullptr;
  Gpu* wait_gpu_ = nullptr;  // the GPU whose streams wait (nullptr: none)
  Event wait_event_ = nullptr;
  Gpu* queued_gpu_ = nullptr;
  Event signal_event_ = nullptr;  // may be wait_event_: one event, waited for and then recorded
  Words words_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_EXEC_CLIENT_FENCE_H_
