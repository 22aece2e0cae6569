#include "exec/client_fence.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {

namespace {

absl::Status Invalid(Operand role, absl::string_view part, absl::string_view message) {
  return OperandError(role, part, absl::InvalidArgumentError(message));
}

// The one GPU of the jobs with IPC memory (nullptr when none has any); a fence orders one
// GPU's work, so jobs on two are refused, naming `role`'s `part`.
absl::StatusOr<Gpu*> OneGpu(Operand role, absl::string_view part, const std::vector<Gpu*>& gpus,
                            const std::vector<bool>& has_ipc) {
  Gpu* one = nullptr;
  size_t first = 0;
  for (size_t i = 0; i < gpus.size(); ++i) {
    if (!has_ipc[i]) continue;
    if (one != nullptr && gpus[i] != one) {
      return Invalid(role, part,
                     absl::StrCat("orders one GPU's work, but item ", first, " is on GPU ",
                                  FormatUuid(one->info().uuid), " and item ", i, " on GPU ",
                                  FormatUuid(gpus[i]->info().uuid), ": send one batch per GPU"));
    }
    if (one == nullptr) first = i;
    one = gpus[i];
  }
  return one;
}

}  // namespace

absl::StatusOr<ClientFence> ClientFence::Open(const Deps& deps, const BatchFences* fences,
                                              const std::vector<Gpu*>& gpus, const std::vector<bool>& has_ipc) {
  ClientFence f;
  f.deps_ = deps;
  f.fences_ = fences;
  if (fences == nullptr) return f;
  // The signal first: with one event for both ends, it is opened once.
  const FenceRef& signal = fences->signal;
  if (fences->queued_answer) {
    if (signal.event) {
      WPREP_RETURN_IF_ERROR(
          f.OpenEvent(Operand::kSignalFence, *signal.event, gpus, has_ipc, &f.queued_gpu_, &f.signal_event_));
    } else {
      WPREP_ASSIGN_OR_RETURN(f.queued_gpu_, OneGpu(Operand::kSignalFence, "word", gpus, has_ipc));
    }
    if (f.queued_gpu_ == nullptr) {
      return Invalid(Operand::kSignalFence, "", "a batch answered once queued needs an item on a GPU");
    }
    if (signal.word) {
      WPREP_ASSIGN_OR_RETURN(f.words_.signal, f.MapWord(Operand::kSignalFence, *f.queued_gpu_, *signal.word));
    }
  }
  const FenceRef& wait = fences->wait;
  if (wait.event) {
    if (signal.event && wait.event->handle == signal.event->handle && wait.event->gpu == signal.event->gpu &&
        f.signal_event_ != nullptr) {
      f.wait_event_ = f.signal_event_;  // one event, waited for and then recorded
      f.wait_gpu_ = f.queued_gpu_;
    } else {
      WPREP_RETURN_IF_ERROR(f.OpenEvent(Operand::kWaitFence, *wait.event, gpus, has_ipc, &f.wait_gpu_, &f.wait_event_));
    }
  } else if (wait.word) {
    // The word orders the work of the one GPU that holds the jobs' IPC memory (a GPU word
    // must live there too); a batch without IPC memory has nothing of the client's to order.
    WPREP_ASSIGN_OR_RETURN(f.wait_gpu_, OneGpu(Operand::kWaitFence, "word", gpus, has_ipc));
    if (f.wait_gpu_ != nullptr) {
      WPREP_ASSIGN_OR_RETURN(f.words_.wait, f.MapWord(Operand::kWaitFence, *f.wait_gpu_, *wait.word));
    }
  }
  return f;
}

ClientFence::ClientFence(ClientFence&& o) noexcept { *this = std::move(o); }

ClientFence& ClientFence::operator=(ClientFence&& o) noexcept {
  if (this == &o) return *this;
  Close();
  deps_ = o.deps_;
  fences_ = std::exchange(o.fences_, nullptr);
  wait_gpu_ = std::exchange(o.wait_gpu_, nullptr);
  wait_event_ = std::exchange(o.wait_event_, nullptr);
  queued_gpu_ = std::exchange(o.queued_gpu_, nullptr);
  signal_event_ = std::exchange(o.signal_event_, nullptr);
  words_ = std::move(o.words_);
  return *this;
}

ClientFence::~ClientFence() { Close(); }

void ClientFence::Close() {
  // The work that waits for or records them is queued by now (or never will be): a
  // client's event may be closed before that work runs.
  if (wait_event_ != nullptr && wait_event_ != signal_event_) {
    wait_gpu_->runtime().DestroyEvent(wait_gpu_->ordinal(), wait_event_);
  }
  if (signal_event_ != nullptr) queued_gpu_->runtime().DestroyEvent(queued_gpu_->ordinal(), signal_event_);
  wait_event_ = signal_event_ = nullptr;
}

absl::Status ClientFence::OpenEvent(Operand role, const FenceRef::EventRef& ref, const std::vector<Gpu*>& gpus,
                                    const std::vector<bool>& has_ipc, Gpu** gpu, Event* event) {
  absl::StatusOr<Gpu*> g = deps_.devices->FindByUuid(ref.gpu);
  if (!g.ok()) return OperandError(role, "event.device_uuid", g.status());
  for (size_t i = 0; i < gpus.size(); ++i) {
    if (has_ipc[i] && gpus[i] != *g) {
      return Invalid(role, "event.device_uuid",
                     absl::StrCat("names GPU ", FormatUuid((*g)->info().uuid), ", but item ", i, " is on GPU ",
                                  FormatUuid(gpus[i]->info().uuid),
                                  "; an event orders one GPU's work: send one batch per GPU"));
    }
  }
  absl::StatusOr<Event> e = deps_.devices->runtime().OpenIpcEvent((*g)->ordinal(), ref.handle);
  if (!e.ok()) {
    return Invalid(role, "event.handle",
                   absl::StrCat("cannot be opened on GPU ", FormatUuid((*g)->info().uuid), ": ", e.status().message(),
                                "; give the cudaIpcGetEventHandle of a live event made with cudaEventInterprocess | "
                                "cudaEventDisableTiming"));
  }
  *gpu = *g;
  *event = *e;
  return absl::OkStatus();
}

absl::StatusOr<ClientFence::MappedWord> ClientFence::MapWord(Operand role, Gpu& gpu, const FenceRef::WordRef& word) {
  MappedWord out;
  out.value = word.value;
  if (word.host_file) {
    absl::StatusOr<HostWords::Word> w =
        deps_.host_words->Acquire(gpu.runtime(), gpu.ordinal(), *word.host_file, word.host_offset, "");
    if (!w.ok()) return OperandError(role, "word.host_word", w.status());
    out.ptr = w->device_ptr;
    out.host_word = w->host;
    out.host = std::move(w->keep);
    return out;
  }
  const IpcRegion& region = *word.gpu_memory;
  if (region.gpu != gpu.info().uuid) {
    return Invalid(role, "word.buffer.device_uuid",
                   absl::StrCat("names GPU ", FormatUuid(region.gpu), ", not the items' GPU ",
                                FormatUuid(gpu.info().uuid), ": the word is used by the work on that GPU, so it "
                                                             "must live there"));
  }
  absl::StatusOr<IpcCache::Lease> l = deps_.ipc->Acquire(gpu.ordinal(), region.handle, region.offset, region.size);
  if (!l.ok()) return OperandError(role, "word.buffer", l.status());
  if (reinterpret_cast<uintptr_t>(l->ptr()) % 4 != 0) {
    return Invalid(role, "word.buffer", "the word is not 4-byte aligned in its allocation");
  }
  out.ptr = l->ptr();
  out.ipc = std::move(*l);
  return out;
}

absl::Status ClientFence::WaitOn(Gpu& gpu, const std::vector<Stream>& streams) {
  if (&gpu != wait_gpu_) return absl::OkStatus();
  if (wait_event_ != nullptr) {
    for (Stream s : streams) WPREP_RETURN_IF_ERROR(gpu.runtime().StreamWaitEvent(gpu.ordinal(), s, wait_event_));
    return absl::OkStatus();
  }
  const MappedWord& w = words_.wait;
  if (w.ptr == nullptr) return absl::OkStatus();
  for (Stream s : streams) WPREP_RETURN_IF_ERROR(gpu.runtime().WaitValue32(gpu.ordinal(), s, w.ptr, w.value));
  // A host word its client may never write: released after the ready timeout, or once
  // its stream ends cancelled.
  if (w.host_word != nullptr) {
    deps_.ready_words->Watch(w.host_word, w.value, w.host, fences_->owner, fences_->request_id);
  }
  return absl::OkStatus();
}

absl::Status ClientFence::SignalAfter(const std::vector<Stream>& streams, Event done, std::vector<Event>* joins) {
  Gpu& gpu = *queued_gpu_;
  std::vector<Event> marks = {done};
  if (signal_event_ != nullptr) marks.insert(marks.begin(), signal_event_);
  WPREP_RETURN_IF_ERROR(gpu.RecordAfter(streams, marks, joins));
  // After the client's event: a client may wait for either.
  if (words_.signal.ptr == nullptr) return absl::OkStatus();
  return gpu.runtime().WriteValue32(gpu.ordinal(), streams[0], words_.signal.ptr, words_.signal.value);
}

}  // namespace wprep::server
