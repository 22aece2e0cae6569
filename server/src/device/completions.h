// Work that a request queued on a GPU and answered for before it finished (a batch
// answered once queued, client_fence.h): what must live until the GPU is done with it
// (the IPC mappings it reads and writes, the admission ticket that makes a drain wait for
// it, its kernel timers) and what to do then (its metrics). One thread waits for each
// piece of work in the order it was queued, runs its `done` and releases what it held.
// Thread-safe.
#ifndef WPREP_SERVER_SRC_COMPLETIONS_H_
#define WPREP_SERVER_SRC_COMPLETIONS_H_

#include <cstddef>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "device/device_runtime.h"

namespace wprep::server {

class Completions {
 public:
  // Work queued before `event` on GPU `gpu`; `done` runs on the completions thread once
  // it finished (with the wait's status), then is destroyed with what it captured. The
  // event stays the caller's (`done` can give it back where it came from).
  struct Work {
    int gpu = 0;
    Event event = nullptr;
    absl::AnyInvocable<void(const absl::Status&) &&> done;
  };

  // At most `max_pending` pieces of work wait at once; Add blocks for room beyond that
  // (the GPU's progress makes room, so the wait is bounded by the work before it).
  Completions(DeviceRuntime* runtime, size_t max_pending);
  // Waits for every piece of work added.
  ~Completions();
  Completions(const Completions&) = delete;
  Completions& operator=(const Completions&) = delete;

  void Add(Work work);
  // Pieces of work added and not yet finished.
  size_t pending() const;

 private:
  void Run();

  DeviceRuntime* const runtime_;
  const size_t max_pending_;
  mutable absl::Mutex mu_;
  std::deque<Work> queue_ ABSL_GUARDED_BY(mu_);
  size_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // queued, or being waited for
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started last
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_COMPLETIONS_H_
