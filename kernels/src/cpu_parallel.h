// Work split over threads for the CPU engine's passes.
#ifndef WPREP_KERNELS_SRC_CPU_PARALLEL_H_
#define WPREP_KERNELS_SRC_CPU_PARALLEL_H_

#include <algorithm>
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

// fn(begin, end) over [0, units) in `threads` contiguous ranges (0: one per hardware
// thread), the calling thread taking the first; one range when `bytes` is small. A thread
// that cannot be started leaves its ranges to the calling thread.
template <class Fn>
void Parallel(int64_t units, uint64_t bytes, int threads, const Fn& fn) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads < 1 || bytes < kParallelThreshold) threads = 1;
  threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(units, 1)));
  if (threads == 1) {
    fn(0, units);
    return;
  }
  const int64_t per = (units + threads - 1) / threads;
  std::vector<std::thread> workers;
  int64_t unstarted = units;
  for (int i = 1; i < threads; ++i) {
    const int64_t begin = std::min(units, i * per), end = std::min(units, begin + per);
    try {
      workers.emplace_back(fn, begin, end);
    } catch (const std::system_error&) {
      unstarted = begin;  // no thread to be had: this thread runs the rest
      break;
    }
  }
  fn(0, std::min(units, per));
  if (unstarted < units) fn(unstarted, units);
  for (auto& w : workers) w.join();
}

}  // namespace wprep::cpu

#endif  // WPREP_KERNELS_SRC_CPU_PARALLEL_H_
