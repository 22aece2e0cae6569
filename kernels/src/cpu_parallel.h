// Work split over threads for the CPU engine's passes.
#ifndef WPREP_KERNELS_SRC_CPU_PARALLEL_H_
#define WPREP_KERNELS_SRC_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace wprep::cpu {

// Below this many output bytes a pass runs on the calling thread: starting threads would
// cost more than the work.
inline constexpr uint64_t kParallelThreshold = 1 << 20;

// Outputs at least this large are written with non-temporal (streaming) stores where a pass
// writes whole aligned 16-byte pieces: they do not fit the caches, so reading their lines in
// before writing them would only cost bandwidth.
inline constexpr uint64_t kStreamingBytes = uint64_t{32} << 20;

// Each thread's share of a pass is cut into this many contiguous chunks, taken in turn
// by whichever thread is free: a thread slowed by others on its core (a shared host, the
// daemon's other requests) then leaves its remaining chunks to the rest, where equal
// ranges would keep the whole pass waiting for it.
inline constexpr int64_t kChunksPerThread = 8;

// fn(begin, end) over [0, units) on `threads` threads (0: one per hardware thread), the
// calling thread among them, as contiguous chunks in order; one range when `bytes` is
// small. A thread that cannot be started leaves its chunks to the others.
template <class Fn>
void Parallel(int64_t units, uint64_t bytes, int threads, const Fn& fn) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads < 1 || bytes < kParallelThreshold) threads = 1;
  threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(units, 1)));
  if (threads == 1) {
    fn(0, units);
    return;
  }
  const int64_t chunks = std::min<int64_t>(units, threads * kChunksPerThread);
  const int64_t per = (units + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c * per < units;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c * per, std::min(units, (c + 1) * per));
    }
  };
  std::vector<std::thread> workers;
  for (int i = 1; i < threads; ++i) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no thread to be had: the others take its chunks
    }
  }
  work();
  for (auto& w : workers) w.join();
}

}  // namespace wprep::cpu

#endif  // WPREP_KERNELS_SRC_CPU_PARALLEL_H_
