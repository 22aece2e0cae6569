// Keeps a VM's vCPUs from halting between the requests of a burst (--keep-cpus-awake).
//
// A halted vCPU takes tens to hundreds of microseconds to run again, and a loader's
// layer-by-layer calls pause for about a millisecond each (the GPU work, then the
// client's own), so every round trip pays for waking the daemon's threads and the
// client's. While requests keep coming, one SCHED_IDLE thread per CPU of the process's
// affinity mask spins, with the CPU's pause instruction, until `linger` has passed since
// the last request started or ended, then parks until the next one. SCHED_IDLE threads
// run only on a CPU that has nothing else to run, so they take no time from the daemon or
// its neighbours; what they cost is the CPU's power and its accounting: each shows as a
// busy core while it spins, and under a CPU quota (a Kubernetes CPU limit) it spends the
// quota. Off by default. A thread the system does not let take SCHED_IDLE does not spin
// (logged once as keep_cpus_awake_unavailable): at normal priority it would take CPU time.
#ifndef WPREP_SERVER_SRC_IDLE_SPINNERS_H_
#define WPREP_SERVER_SRC_IDLE_SPINNERS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace wprep::server {

class IdleSpinners {
 public:
  // One spinner per CPU the process may run on, each pinned to its CPU. Never null; with
  // a zero `linger` it starts no thread and Touch() does nothing.
  static std::unique_ptr<IdleSpinners> Start(absl::Duration linger);
  ~IdleSpinners();  // stops and joins the spinners
  IdleSpinners(const IdleSpinners&) = delete;
  IdleSpinners& operator=(const IdleSpinners&) = delete;

  // A request started or ended: spin until `linger` from now. Cheap (one clock read and a
  // relaxed store) unless spinners are parked, which it wakes.
  void Touch();

  int threads() const { return static_cast<int>(threads_.size()); }
  // Spinners waiting for the next Touch (for tests).
  int parked() const { return parked_.load(); }

 private:
  explicit IdleSpinners(absl::Duration linger) : linger_ns_(absl::ToInt64Nanoseconds(linger)) {}
  void Run(int cpu);

  const int64_t linger_ns_;
  std::atomic<int64_t> awake_until_ns_{0};  // monotonic clock
  std::atomic<int> parked_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> warned_{false};  // a spinner could not take SCHED_IDLE (logged once)
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::thread> threads_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_IDLE_SPINNERS_H_
