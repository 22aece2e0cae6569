#include "net/idle_spinners.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include "absl/strings/str_cat.h"
#include "net/log.h"

namespace wprep::server {
namespace {

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

std::unique_ptr<IdleSpinners> IdleSpinners::Start(absl::Duration linger) {
  std::unique_ptr<IdleSpinners> s(new IdleSpinners(linger));
  if (linger <= absl::ZeroDuration()) return s;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return s;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    try {
      s->threads_.emplace_back([p = s.get(), cpu] { p->Run(cpu); });
    } catch (const std::system_error&) {
      break;  // out of threads: fewer spinners, still correct
    }
  }
  LogLine(LogLevel::kInfo, "keep_cpus_awake",
          absl::StrCat("spinners=", s->threads_.size(), " linger_seconds=", absl::ToDoubleSeconds(linger)));
  return s;
}

IdleSpinners::~IdleSpinners() {
  stop_.store(true);
  {
    absl::MutexLock l(&mu_);
    cv_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void IdleSpinners::Touch() {
  if (threads_.empty()) return;
  awake_until_ns_.store(MonotonicNs() + linger_ns_);
  // Seen by a spinner that is parking: it counts itself in parked_ before it reads
  // awake_until_ns_ again (both sequentially consistent), so it either sees the new time
  // or is counted here and signalled.
  if (parked_.load() > 0) {
    absl::MutexLock l(&mu_);
    cv_.SignalAll();
  }
}

void IdleSpinners::Run(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
  sched_param idle{};
  if (const int err = pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle); err != 0) {
    // Spinning at normal priority would take CPU from real work: this one does not spin.
    if (!warned_.exchange(true)) {
      LogLine(LogLevel::kWarning, "keep_cpus_awake_unavailable",
              absl::StrCat("error=", LogQuote(absl::StrCat(
                                       "the system refused SCHED_IDLE for a spinner thread (errno ", err,
                                       "), so --keep-cpus-awake has no effect here; a seccomp or "
                                       "container policy may forbid it"))));
    }
    return;
  }
  while (!stop_.load(std::memory_order_relaxed)) {
    if (MonotonicNs() < awake_until_ns_.load(std::memory_order_relaxed)) {
      for (int i = 0; i < 64; ++i) CpuRelax();
      continue;
    }
    absl::MutexLock l(&mu_);
    parked_.fetch_add(1);
    while (!stop_.load() && MonotonicNs() >= awake_until_ns_.load()) cv_.Wait(&mu_);
    parked_.fetch_sub(1);
  }
}

}  // namespace wprep::server
