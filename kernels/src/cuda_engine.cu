// The CUDA engine: one fused launch per conversion, the tile body from tiles.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda_stream.h"
#include "buffers.h"
#include "hopper_scale_runs.h"
#include "moe_geometry.h"
#include "occupancy.h"
#include "tiles.h"
#include "wprep/kernels/cuda_engine.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/spec/status_macros.h"

namespace wprep {
namespace async_fetch {

// Asynchronous fetch (sm_80+ cp.async): each thread copies the words its Fetch names
// into its own slot of shared memory, kAhead tiles ahead, so loads stay in flight
// through the interleave and the stores of the tiles before them without holding
// registers. Slots are thread-private (no barrier guards them): a thread reads its slot
// back after cp.async.wait_group, and refills it only after the words were consumed.

__device__ __forceinline__ void CpAsync16(uint32_t* dst, const uint8_t* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsync4(uint32_t* dst, const uint8_t* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsync8(uint32_t* dst, const uint8_t* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// One slot: every thread's fetched words (T::Fetched), in 16-byte chunks.
template <class T>
constexpr int SlotWords() {
  static_assert(sizeof(typename T::Fetched) % 16 == 0, "slots hold whole 16-byte chunks");
  return static_cast<int>(sizeof(typename T::Fetched) / 4) * kTileThreads;
}

// The loader of tiles::RegsOf's interface that targets a slot: 16-byte chunk c of
// thread vt at words (c * kTileThreads + vt) * 4, so a warp's 16-byte copies and
// read-backs are contiguous.
struct SlotLoader {
  uint32_t* slot;
  int vt;
  __device__ uint32_t* At(int k) const { return slot + ((k >> 2) * kTileThreads + vt) * 4 + (k & 3); }
  template <int kWords>
  __device__ void Row(int k, const uint8_t* src, int64_t valid, bool vec) {
    if (vec && valid >= 4 * kWords) {
      if constexpr (kWords % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kWords / 4; ++i) CpAsync16(At(k + 4 * i), src + 16 * i);
      } else {  // vec: 4-byte aligned at least
#pragma unroll
        for (int i = 0; i < kWords; ++i) CpAsync4(At(k + i), src + 4 * i);
      }
      return;
    }
    uint32_t w[kWords];  // edges and unaligned views: plain loads, as Regs does
    tiles::LoadRowWords<kWords>(src, valid, w, vec);
#pragma unroll
    for (int i = 0; i < kWords; ++i) *At(k + i) = w[i];
  }
  __device__ void Word(int k, const uint8_t* p) { CpAsync4(At(k), p); }
  __device__ void Pair(int k, const uint8_t* p) { CpAsync8(At(k), p); }
  __device__ void Set(int k, uint32_t word) { *At(k) = word; }  // the thread's own slot
  template <int kCount>
  __device__ void Read(tiles::RegsOf<kCount>& r) const {
#pragma unroll
    for (int c = 0; c < kCount / 4; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(At(4 * c));
      r.w[4 * c] = v.x;
      r.w[4 * c + 1] = v.y;
      r.w[4 * c + 2] = v.z;
      r.w[4 * c + 3] = v.w;
    }
  }
};

}  // namespace async_fetch

namespace {

// Tile t of the launch: tile indices fit 32 bits (ConvertOnCuda checks), so splitting
// them with the grid's multiply-shift divisors is cheap.
template <class T>
__device__ __forceinline__ tiles::TileCtx TileContext(const Geometry& g, const uint8_t* in,
                                                      uint8_t* out, const tiles::TileGrid& grid,
                                                      uint32_t t) {
  uint32_t e, a, b;
  grid.Split(t, &e, &a, &b);
  return T::Context(g, in, out, e, a, b);
}

// Dynamic shared memory of ConvertKernel<T>: its two windows where they exceed the 48 KiB
// a kernel may declare statically, else none.
template <class T>
constexpr size_t DynamicWindowBytes() {
  constexpr size_t bytes = sizeof(uint32_t) * (T::kTwoStage ? 2 : 1) * T::kSmemWords;
  return bytes > 48 * 1024 ? bytes : 0;
}

template <class T>
__global__ void __launch_bounds__(kTileThreads, T::kMinBlocks)
    ConvertKernel(const Geometry g, const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                  tiles::Access access, tiles::TileGrid grid, uint32_t num_tiles,
                  int parts_log2) {
  // Two-stage tiles alternate between two buffers, so one barrier per tile suffices: a
  // warp staging tile t+1 into one buffer has passed the barrier of tile t, which every
  // warp reaches only after storing tile t-1 from that buffer.
  constexpr int kBuffers = T::kTwoStage ? 2 : 1;
  // Windows beyond the 48 KiB of static shared memory live in dynamic shared memory.
  constexpr bool kDynamic = DynamicWindowBytes<T>() > 0;
  __shared__ alignas(16) uint32_t static_smem[kDynamic ? 1 : kBuffers][kDynamic ? 1 : T::kSmemWords];
  extern __shared__ uint4 dynamic_smem[];
  auto window = [&](int buf) {
    if constexpr (kDynamic) {
      return reinterpret_cast<uint32_t*>(dynamic_smem) + buf * T::kSmemWords;
    } else {
      return static_smem[buf];
    }
  };
  // Single-stage tiles of small tensors run in 2^parts_log2 blocks of kTileThreads >>
  // parts_log2 threads each (Launch), so a tensor of a few tiles still spreads over
  // many multiprocessors; block b runs part b % parts of tile b / parts.
  const uint32_t part = blockIdx.x & ((1u << parts_log2) - 1);
  const int vt = static_cast<int>(part * blockDim.x + threadIdx.x);
  auto context = [&](uint32_t t) { return TileContext<T>(g, in, out, grid, t); };
  uint32_t t = blockIdx.x >> parts_log2;
  const uint32_t step = gridDim.x >> parts_log2;
  if (t >= num_tiles) return;
  tiles::TileCtx ctx = context(t);
  typename T::Fetched cur, next;
  T::Fetch(g, ctx, vt, access, cur);
  // The next tile's loads are issued before this tile's stores, so each thread keeps
  // global loads in flight while it writes.
  for (int buf = 0;; buf ^= kBuffers - 1) {
    const uint32_t tn = t + step;
    const bool more = tn < num_tiles;
    tiles::TileCtx next_ctx = ctx;
    if (more) next_ctx = context(tn);
    if constexpr (T::kTwoStage) {
      T::Stage(g, ctx, vt, access, cur, window(buf));
      __syncthreads();
      if (more) T::Fetch(g, next_ctx, vt, access, next);
      T::Store(g, ctx, vt, access, window(buf));
    } else {
      if (more) T::Fetch(g, next_ctx, vt, access, next);
      T::Stage(g, ctx, vt, access, cur, window(buf));
    }
    if (!more) break;
    t = tn;
    ctx = next_ctx;
    cur = next;
  }
}

// Dynamic shared memory of ConvertKernelPrefetch<T, kAhead>: two windows, kAhead slots.
template <class T>
constexpr int WindowWords() {
  return T::kTwoStage ? (T::kSmemWords + 3) / 4 * 4 : 0;
}
template <class T, int kAhead>
constexpr size_t PrefetchSmemBytes() {
  return sizeof(uint32_t) * (2 * WindowWords<T>() + kAhead * async_fetch::SlotWords<T>());
}

// Resident blocks the register budget must allow: as many as shared memory admits, up to
// three (an H200 SM has 228 KiB: two windows and two slots take 66 KiB a block).
template <class T, int kAhead>
constexpr int PrefetchMinBlocks() {
  if constexpr (sizeof(typename T::Fetched) < sizeof(tiles::Regs)) return T::kMinBlocks;  // small slots
  return T::kTwoStage && kAhead > 2 ? 2 : 3;
}

template <class T, int kAhead>
__global__ void __launch_bounds__(kTileThreads, (PrefetchMinBlocks<T, kAhead>()))
    ConvertKernelPrefetch(const Geometry g, const uint8_t* __restrict__ in,
                       uint8_t* __restrict__ out, tiles::Access access, tiles::TileGrid grid,
                       uint32_t num_tiles) {
  extern __shared__ uint4 dynamic_smem[];
  uint32_t* const windows = reinterpret_cast<uint32_t*>(dynamic_smem);
  uint32_t* const slots = windows + 2 * WindowWords<T>();
  const int vt = threadIdx.x;
  auto context = [&](uint32_t t) { return TileContext<T>(g, in, out, grid, t); };
  // Every thread commits one group per call, fetched or not, so wait_group counts match.
  auto fetch = [&](uint32_t t, int slot) {
    if (t < num_tiles) {
      async_fetch::SlotLoader ld{slots + slot * async_fetch::SlotWords<T>(), vt};
      T::Fetch(g, context(t), vt, access, ld);
    }
    async_fetch::CpAsyncCommit();
  };
  uint32_t t = blockIdx.x;
  if (t >= num_tiles) return;
#pragma unroll
  for (int slot = 0; slot < kAhead; ++slot) fetch(t + slot * gridDim.x, slot);
  int buf = 0, slot = 0;
  for (; t < num_tiles; t += gridDim.x) {
    async_fetch::CpAsyncWait<kAhead - 1>();
    typename T::Fetched cur;
    async_fetch::SlotLoader{slots + slot * async_fetch::SlotWords<T>(), vt}.Read(cur);
    const tiles::TileCtx ctx = context(t);
    uint32_t* const window = windows + buf * WindowWords<T>();
    T::Stage(g, ctx, vt, access, cur, window);
    // Same double-buffer argument as ConvertKernel: one barrier per tile.
    if constexpr (T::kTwoStage) __syncthreads();
    // Stage has consumed the slot's words (its stores depend on them), so refill it.
    fetch(t + kAhead * gridDim.x, slot);
    if constexpr (T::kTwoStage) T::Store(g, ctx, vt, access, window);
    buf ^= 1;
    slot = slot + 1 == kAhead ? 0 : slot + 1;
  }
}

constexpr uint64_t kTouchStride = 64 << 10;

// One volatile byte load per kTouchStride bytes (volatile: the load is the point).
__global__ void TouchKernel(const uint8_t* p, uint64_t bytes) {
  for (uint64_t i = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kTouchStride; i < bytes;
       i += uint64_t{gridDim.x} * blockDim.x * kTouchStride) {
    (void)*static_cast<const volatile uint8_t*>(p + i);
  }
}

// Tiles of one launch: indices stay below 2^31 (2^31 tiles of >= 4 KiB is 8 TiB).
constexpr int64_t kMaxTiles = (int64_t{1} << 31) - 1;

// Launches that ran below the residency their kernel was built for (CudaReducedOccupancyLaunches).
std::atomic<uint64_t> reduced_occupancy_launches{0};

// T's kernel with kAhead, by name, for the warning below.
template <class T, int kAhead>
const char* KernelName() {
  return __PRETTY_FUNCTION__;
}

// Queries how many blocks of `kernel` (kTileThreads threads, `smem` bytes of dynamic
// shared memory) `device`, the current device, keeps resident, and raises the kernel's
// dynamic shared memory limit there.
template <class Kernel>
Residency QueryResidency(int device, Kernel kernel, size_t smem, int wanted_per_sm) {
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    sms = 0;
  }
  if ((smem > 0 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)) != cudaSuccess) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kTileThreads, smem) !=
          cudaSuccess) {
    cudaGetLastError();
    per_sm = 0;
  }
  return MakeResidency(sms, per_sm, wanted_per_sm);
}

// Blocks of one wave of `kernel` (T's kernel with kAhead) on `device`, and whether they
// fill every multiprocessor as the kernel was built to (wanted_per_sm blocks each).
// Queried once per kernel and device; a kernel that falls short says so on stderr, once.
struct Wave {
  int64_t blocks = 1;
  bool full = false;
};
constexpr int kMaxDevices = 64;
template <class T, int kAhead, class Kernel>
Wave ResidentWave(int device, Kernel kernel, size_t smem, int wanted_per_sm) {
  static std::atomic<int64_t> cache[kMaxDevices];  // blocks << 1 | full; 0: not queried
  static std::atomic<bool> warned_uncached{false};
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable) {
    const int64_t c = cache[device].load(std::memory_order_relaxed);
    if (c != 0) return Wave{c >> 1, (c & 1) != 0};
  }
  const Residency r = QueryResidency(device, kernel, smem, wanted_per_sm);
  // The first thread to record a kernel's result on a device is the one that warns.
  bool first = false;
  if (cacheable) {
    int64_t expected = 0;
    first = cache[device].compare_exchange_strong(expected, r.blocks << 1 | (r.full() ? 1 : 0),
                                                  std::memory_order_relaxed);
  } else {
    first = !warned_uncached.exchange(true, std::memory_order_relaxed);
  }
  if (!r.full() && first) {
    std::fprintf(stderr, "%s\n", ResidencyWarning(r, KernelName<T, kAhead>(), device).c_str());
  }
  return Wave{r.blocks, r.full()};
}

// The Hopper scale swizzle of dense S rows (hopper_scale_runs.h): a block moves
// rows_per_block O rows. Its 2 x rows_per_block runs (16 S rows, 16 * cols contiguous
// bytes each) come into shared memory in aligned 16-byte words, up to
// kHopperScaleRunsPieces a thread, all in flight before the first is stored; then a thread
// per 16-byte O chunk (k0, a, h) takes its 8 halfword pairs S[4h + i (+ 8), 2k0 .. 2k0 + 1]
// from there. Rows past S and columns past cols read as the zero padding. The unswizzle
// is the same two steps the other way: O chunks into the runs in shared memory, then the
// runs' bytes inside S out in 16-byte words.
template <bool kEvenCols>
__global__ void __launch_bounds__(kHopperScaleRunsThreads)
    HopperScaleRunsKernel(HopperScaleRunsPass p, const uint8_t* __restrict__ in, uint8_t* __restrict__ out) {
  extern __shared__ uint4 runs_smem[];
  __shared__ int64_t run_at[32];  // byte offset of run s in S
  __shared__ int run_rows[32];    // its S rows inside the tensor, 0 to 16
  const int cols = static_cast<int>(p.cols);
  const int64_t orows = p.rows_pad / 32;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * p.rows_per_block;
  const int64_t left = p.matrices * orows - q0;
  const int rows_here = left < p.rows_per_block ? static_cast<int>(left) : p.rows_per_block;
  const int runs = 2 * rows_here;
  if (threadIdx.x < runs) {
    const int64_t q = q0 + (threadIdx.x >> 1);
    const int64_t e = q / orows, orow = q - e * orows;
    const int64_t nw = p.num_warps, w = orow & (nw - 1);
    const int64_t r0 = 32 * (orow - w) + 16 * nw * (threadIdx.x & 1) + 16 * w;
    const int64_t n = p.rows - r0;
    run_rows[threadIdx.x] = n <= 0 ? 0 : (n < 16 ? static_cast<int>(n) : 16);
    run_at[threadIdx.x] = (e * p.rows + r0) * p.cols;
  }
  __syncthreads();
  uint8_t* smem = reinterpret_cast<uint8_t*>(runs_smem);
  const int pieces = runs * cols;  // 16-byte words of the runs
  const int row_chunks = 2 * static_cast<int>(p.cols_pad);  // 32C bytes in 16-byte chunks
  if (p.swizzle) {
    uint4 v[kHopperScaleRunsPieces];
#pragma unroll
    for (int i = 0; i < kHopperScaleRunsPieces; ++i) {
      const int piece = threadIdx.x + i * kHopperScaleRunsThreads;
      v[i] = make_uint4(0, 0, 0, 0);
      if (piece < pieces) {
        const int s = piece / cols, at = 16 * (piece - s * cols);
        const int valid = run_rows[s] * cols;
        const uint8_t* src = in + run_at[s] + at;
        if (at + 16 <= valid) {
          v[i] = __ldg(reinterpret_cast<const uint4*>(src));
        } else if (at < valid) {
          uint8_t b[16] = {};
          for (int k = 0; k < valid - at; ++k) b[k] = src[k];
          v[i] = *reinterpret_cast<const uint4*>(b);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kHopperScaleRunsPieces; ++i) {
      const int piece = threadIdx.x + i * kHopperScaleRunsThreads;
      if (piece < pieces) runs_smem[piece] = v[i];
    }
    __syncthreads();
    uint4* dst = reinterpret_cast<uint4*>(out + q0 * 32 * p.cols_pad);
    for (int ci = threadIdx.x; ci < rows_here * row_chunks; ci += kHopperScaleRunsThreads) {
      const int pr = ci / row_chunks, j = ci - pr * row_chunks;
      const int col = 2 * (j >> 2), h = j & 1, s = 2 * pr + ((j >> 1) & 1);
      const int vrows = run_rows[s];
      const uint8_t* run = smem + s * 16 * cols + col;
      auto pair = [&](int row) -> uint32_t {
        if (row >= vrows || col >= cols) return 0;
        const uint8_t* x = run + row * cols;
        if constexpr (kEvenCols) {
          return *reinterpret_cast<const uint16_t*>(x);
        } else {
          return col + 1 < cols ? (uint32_t{x[0]} | uint32_t{x[1]} << 8) : uint32_t{x[0]};
        }
      };
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = BytePerm(pair(4 * h + i), pair(8 + 4 * h + i), 0x5140);
      dst[ci] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(in + q0 * 32 * p.cols_pad);
  for (int ci = threadIdx.x; ci < rows_here * row_chunks; ci += kHopperScaleRunsThreads) {
    const int pr = ci / row_chunks, j = ci - pr * row_chunks;
    const int col = 2 * (j >> 2), h = j & 1, s = 2 * pr + ((j >> 1) & 1);
    const int vrows = run_rows[s];
    if (col >= cols || 4 * h >= vrows) continue;  // padding, not read back
    const uint4 v = __ldg(src + ci);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint8_t* run = smem + s * 16 * cols + col;
    auto put = [&](int row, uint32_t pair) {
      if (row >= vrows) return;
      uint8_t* x = run + row * cols;
      if constexpr (kEvenCols) {
        *reinterpret_cast<uint16_t*>(x) = static_cast<uint16_t>(pair);
      } else {
        x[0] = static_cast<uint8_t>(pair);
        if (col + 1 < cols) x[1] = static_cast<uint8_t>(pair >> 8);
      }
    };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t lo, hi;
      tiles::HopperScaleHalves(w[i], &lo, &hi);
      put(4 * h + i, lo);
      put(8 + 4 * h + i, hi);
    }
  }
  __syncthreads();
  for (int piece = threadIdx.x; piece < pieces; piece += kHopperScaleRunsThreads) {
    const int s = piece / cols, at = 16 * (piece - s * cols);
    const int valid = run_rows[s] * cols;
    uint8_t* dst = out + run_at[s] + at;
    if (at + 16 <= valid) {
      *reinterpret_cast<uint4*>(dst) = runs_smem[piece];
    } else if (at < valid) {
      for (int k = 0; k < valid - at; ++k) dst[k] = smem[16 * piece + k];
    }
  }
}

void LaunchHopperScaleRuns(const HopperScaleRunsPass& p, const uint8_t* in, uint8_t* out, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(p.Blocks());
  const size_t smem = static_cast<size_t>(32) * p.rows_per_block * p.cols;
  if (p.cols % 2 == 0) {
    HopperScaleRunsKernel<true><<<blocks, kHopperScaleRunsThreads, smem, stream>>>(p, in, out);
  } else {
    HopperScaleRunsKernel<false><<<blocks, kHopperScaleRunsThreads, smem, stream>>>(p, in, out);
  }
}

// The Hopper scale swizzle of dense S columns (hopper_scale_runs.h): block (e, band m0,
// columns c0 ..) stages each column's rows of the band in shared memory with aligned
// 16-byte loads, then a thread per 16-byte O chunk (O row w of the band, block k0, half a,
// quarter h) takes S rows r + 0..3 and r + 8..11 (r = 16 nw a + 16 w + 4 h) of columns 2k0
// and 2k0 + 1 as halfwords, and a 4x4 byte transpose makes the chunk's four words. Rows and
// columns past S read as the zero padding.
__global__ void __launch_bounds__(kHopperScaleRunsThreads)
    HopperScaleColumnsKernel(HopperScaleColumnsPass p, const uint8_t* __restrict__ in, uint8_t* __restrict__ out) {
  extern __shared__ uint4 columns_smem[];
  const int64_t band = 32 * int64_t{p.num_warps};
  const int64_t bands = p.rows_pad / band;
  const int64_t chunks = (p.cols_pad + p.cols_per_block - 1) / p.cols_per_block;
  const int64_t b = blockIdx.x;
  const int64_t e = b / (bands * chunks), rest = b - e * bands * chunks;
  const int64_t m0 = rest / chunks, c0 = (rest - m0 * chunks) * p.cols_per_block;
  const int64_t rbase = m0 * band;
  const int vrows = static_cast<int>(p.rows - rbase <= 0 ? 0 : (p.rows - rbase < band ? p.rows - rbase : band));
  const int vcols = static_cast<int>(p.cols - c0 <= 0 ? 0 : (p.cols - c0 < p.cols_per_block ? p.cols - c0 : p.cols_per_block));
  const int stride = p.smem_stride;
  const uint8_t* src = in + e * p.rows * p.cols;
  uint8_t* smem = reinterpret_cast<uint8_t*>(columns_smem);
  if (vrows > 0 && vcols > 0) {
    if (p.one_band) {  // columns c0 .. c0 + vcols - 1, whole: one run of the input
      const int bytes = vcols * static_cast<int>(p.rows);
      const uint8_t* run = src + c0 * p.rows;
      for (int i = threadIdx.x; 16 * i < bytes; i += kHopperScaleRunsThreads) {
        if (16 * i + 16 <= bytes) {
          columns_smem[i] = __ldg(reinterpret_cast<const uint4*>(run) + i);
        } else {
          for (int k = 16 * i; k < bytes; ++k) smem[k] = run[k];
        }
      }
    } else {  // vrows (a multiple of 16) bytes of each column
      const int per = vrows / 16;
      for (int i = threadIdx.x; i < vcols * per; i += kHopperScaleRunsThreads) {
        const int j = i / per, q = i - j * per;
        reinterpret_cast<uint4*>(smem + j * stride)[q] =
            __ldg(reinterpret_cast<const uint4*>(src + (c0 + j) * p.rows + rbase) + q);
      }
    }
  }
  __syncthreads();
  // Halfword `r` (even) of staged column j, or zero past the staged rows and columns.
  auto half = [&](int j, int r) -> uint32_t {
    return j < vcols && r < vrows ? uint32_t{*reinterpret_cast<const uint16_t*>(smem + j * stride + r)} : 0u;
  };
  auto word = [&](int j, int r) -> uint32_t { return half(j, r) | half(j, r + 2) << 16; };
  const int kc = p.cols_per_block;
  const int64_t row_bytes = 32 * p.cols_pad;
  const int width = static_cast<int>(p.cols_pad - c0 < kc ? p.cols_pad - c0 : kc);  // columns of O here
  uint8_t* band_out = out + e * (p.rows_pad / 32) * row_bytes + m0 * p.num_warps * row_bytes + 32 * c0;
  for (int i = threadIdx.x; i < p.num_warps * 2 * width; i += kHopperScaleRunsThreads) {
    const int w = i / (2 * width), idx = i - w * 2 * width;
    const int j0 = 2 * (idx >> 2), a = (idx >> 1) & 1, h = idx & 1;
    const int r = 16 * p.num_warps * a + 16 * w + 4 * h;
    uint32_t x[4] = {word(j0, r), word(j0, r + 8), word(j0 + 1, r), word(j0 + 1, r + 8)};
    Transpose4x4Bytes(x);
    *reinterpret_cast<uint4*>(band_out + w * row_bytes + 16 * idx) = make_uint4(x[0], x[1], x[2], x[3]);
  }
}

void LaunchHopperScaleColumns(const HopperScaleColumnsPass& p, const uint8_t* in, uint8_t* out, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.smem_stride) * p.cols_per_block;
  HopperScaleColumnsKernel<<<static_cast<unsigned>(p.Blocks()), kHopperScaleRunsThreads, smem, stream>>>(p, in, out);
}

// Launches the kernel for the tile type DispatchTile picks (a functor: CUDA here is C++17).
struct Launcher {
  const Geometry& g;
  const uint8_t* in;
  uint8_t* out;
  tiles::Access access;
  int device;
  cudaStream_t stream;
  int64_t* too_many_tiles;  // set instead of launching when the grid would not fit
  template <class T>
  void operator()() const {
    const int64_t tiles_per_matrix = T::TilesPerMatrix(g);
    const int64_t num_tiles = g.num_matrices * tiles_per_matrix;
    if (num_tiles == 0) return;
    if (num_tiles > kMaxTiles) {
      *too_many_tiles = num_tiles;
      return;
    }
    Launch<T, T::kPrefetchTiles>(num_tiles);
  }
  template <class T, int kAhead>
  void Launch(int64_t num_tiles) const {
    // The register pipeline (ConvertKernel) or fetching kAhead tiles ahead.
    constexpr size_t smem = kAhead > 0 ? PrefetchSmemBytes<T, kAhead>() : DynamicWindowBytes<T>();
    auto* kernel = [] {
      if constexpr (kAhead > 0) {
        return ConvertKernelPrefetch<T, kAhead>;
      } else {
        return ConvertKernel<T>;
      }
    }();
    // One wave of resident blocks; each loops over tiles (no partial last wave).
    constexpr int wanted_per_sm = kAhead > 0 ? PrefetchMinBlocks<T, kAhead>() : T::kMinBlocks;
    const Wave wave = ResidentWave<T, kAhead>(device, kernel, smem, wanted_per_sm);
    if (!wave.full) reduced_occupancy_launches.fetch_add(1, std::memory_order_relaxed);
    const int64_t max_blocks = wave.blocks;
    const tiles::TileGrid grid = tiles::MakeTileGrid<T>(g);
    if constexpr (kAhead > 0) {
      const unsigned blocks = static_cast<unsigned>(std::min(num_tiles, max_blocks));
      kernel<<<blocks, kTileThreads, smem, stream>>>(g, in, out, access, grid,
                                                     static_cast<uint32_t>(num_tiles));
    } else {
      // Fewer tiles than resident blocks: single-stage tiles (no barrier, no shared
      // window) split into up to 8 blocks of one warp or more, as many as fit in one wave.
      // At 32 KiB, one Hopper mx_axis -2 tile, the single block was bound by one SM's
      // instruction latency.
      int parts_log2 = 0;
      if constexpr (!T::kTwoStage) {
        while (parts_log2 < 3 && (num_tiles << (parts_log2 + 1)) <= max_blocks) ++parts_log2;
      }
      const int64_t blocks = std::min(num_tiles, max_blocks) << parts_log2;
      kernel<<<static_cast<unsigned>(blocks), kTileThreads >> parts_log2, smem, stream>>>(
          g, in, out, access, grid, static_cast<uint32_t>(num_tiles), parts_log2);
    }
  }
};

// Makes `device` current for its scope and restores the caller's device after; touches
// nothing when it is current already (the common case costs one cudaGetDevice).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess && previous_ >= 0;
    }
  }
  ~ScopedDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace

bool CudaCompiledIn() { return true; }

uint64_t CudaReducedOccupancyLaunches() {
  return reduced_occupancy_launches.load(std::memory_order_relaxed);
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

absl::StatusOr<int> CudaDeviceOfPointer(const void* ptr) {
  if (ptr == nullptr) return absl::InvalidArgumentError("null device pointer");
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrFormat(
        "pointer %p is not CUDA memory: %s", ptr, cudaGetErrorString(err)));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pointer %p is not device memory (CUDA memory type %d)", ptr,
                        static_cast<int>(attr.type)));
  }
  return attr.device;
}

absl::Status ConvertOnCuda(const Plan& plan, const void* in, void* out, CudaStream stream) {
  if (plan.empty()) return absl::OkStatus();
  auto in_dev = CudaDeviceOfPointer(in);
  if (!in_dev.ok()) return absl::InvalidArgumentError(absl::StrCat("input: ", in_dev.status().message()));
  auto out_dev = CudaDeviceOfPointer(out);
  if (!out_dev.ok()) return absl::InvalidArgumentError(absl::StrCat("output: ", out_dev.status().message()));
  if (*in_dev != *out_dev) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "input is on CUDA device %d but output is on device %d; both must be on one GPU",
        *in_dev, *out_dev));
  }
  if (stream != nullptr) {
    int stream_dev = -1;
    WPREP_CUDA_RETURN_IF_ERROR(StreamDevice(stream, &stream_dev));
    if (stream_dev >= 0 && stream_dev != *in_dev) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stream belongs to CUDA device %d but the data is on device %d", stream_dev, *in_dev));
    }
  }
  if (auto s = CheckDisjoint(plan, in, out); !s.ok()) return s;

  if (auto s = CheckPlanned(plan); !s.ok()) return s;
  const Geometry& g = *plan.geometry;
  const tiles::Access access = tiles::ChooseAccess(g, in, out);

  ScopedDevice scoped(*in_dev);
  WPREP_CUDA_RETURN_IF_ERROR(scoped.status());
  // A failed call of the caller's may have left an error behind; the launch check below
  // must see only the launch's own.
  cudaGetLastError();
  // blackwell_scale's swizzle of a checkpoint's transposed view: the MoE engine's scale
  // pass, which reads each checkpoint row in aligned words (the tiles gather its bytes).
  if (std::optional<moe::InterleavePass> p = moe::BlackwellScaleViewPass(g);
      p.has_value() && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    moe::LaunchInterleave16OnCuda(*p, static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), stream);
    WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  // The Hopper scale swizzle of dense S rows (the sm_90 loaders' transposed view) or
  // columns: passes of their own, which read whole runs of S in aligned words.
  if (std::optional<HopperScaleRunsPass> p = HopperScaleRunsPassOf(g, in, out); p.has_value()) {
    LaunchHopperScaleRuns(*p, static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), stream);
    WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  if (std::optional<HopperScaleColumnsPass> p = HopperScaleColumnsPassOf(g, in, out); p.has_value()) {
    LaunchHopperScaleColumns(*p, static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), stream);
    WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  int64_t too_many_tiles = 0;
  const bool known = tiles::DispatchTile(
      g, Launcher{g, static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), access,
                  *in_dev, stream, &too_many_tiles});
  if (!known) return tiles::UnsupportedGeometry(g);
  if (too_many_tiles > 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor needs %d tiles; one launch takes at most %d (split the leading dims)",
        too_many_tiles, kMaxTiles));
  }
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status TouchOnCuda(const void* ptr, uint64_t bytes, CudaStream stream) {
  if (bytes == 0) return absl::OkStatus();
  auto dev = CudaDeviceOfPointer(ptr);
  if (!dev.ok()) return dev.status();
  ScopedDevice scoped(*dev);
  WPREP_CUDA_RETURN_IF_ERROR(scoped.status());
  cudaGetLastError();
  const uint64_t loads = (bytes + kTouchStride - 1) / kTouchStride;
  const unsigned threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((loads + threads - 1) / threads, 1024));
  TouchKernel<<<blocks, threads, 0, stream>>>(static_cast<const uint8_t*>(ptr), bytes);
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

namespace {

// ConvertHostBuffersOnCuda's two pinned buffers, one pair per calling thread, made on its
// first call and kept for the thread's life (a tool's workers convert piece after piece).
// Pageable copies would go through the driver's own staging, which threads calling side by
// side share.
struct HostStaging {
  static constexpr uint64_t kPiece = 16ull << 20;
  uint8_t* buffer[2] = {nullptr, nullptr};
  absl::Status Ensure() {
    for (uint8_t*& b : buffer) {
      if (b == nullptr) WPREP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&b, kPiece, cudaHostAllocPortable));
    }
    return absl::OkStatus();
  }
  HostStaging() = default;
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  ~HostStaging() {
    for (uint8_t* b : buffer) {
      if (b != nullptr) cudaFreeHost(b);
    }
    cudaGetLastError();  // at process exit the runtime may be gone already
  }
};

HostStaging& ThreadStaging() {
  thread_local HostStaging staging;
  return staging;
}

}  // namespace

absl::Status ConvertHostBuffersOnCuda(const Plan& plan, const uint8_t* in, size_t in_size,
                                      uint8_t* out, size_t out_size, int device) {
  if (in_size < plan.input_bytes || out_size < plan.output_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "buffers of %d and %d bytes are smaller than the plan's %d-byte input and %d-byte output",
        in_size, out_size, plan.input_bytes, plan.output_bytes));
  }
  if (plan.empty()) return absl::OkStatus();
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CUDA device %d does not exist (this machine has %d)", device, count));
  }
  ScopedDevice scoped(device);
  WPREP_CUDA_RETURN_IF_ERROR(scoped.status());
  // A stream of its own and stream-ordered buffers from the device's pool, which keeps
  // them for the next call: threads calling side by side (a tool's workers) neither wait
  // for each other's copies on the legacy stream nor synchronize the device in cudaFree.
  static std::once_flag keep_pool[64];
  if (device < 64) {
    std::call_once(keep_pool[device], [device] {
      cudaMemPool_t pool = nullptr;
      uint64_t keep = UINT64_MAX;
      if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
      cudaGetLastError();
    });
  }
  HostStaging& staging = ThreadStaging();
  WPREP_RETURN_IF_ERROR(staging.Ensure());
  cudaStream_t stream = nullptr;
  WPREP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t done[2] = {nullptr, nullptr};
  void* d_in = nullptr;
  void* d_out = nullptr;
  absl::Status status = [&]() -> absl::Status {
    for (cudaEvent_t& e : done) WPREP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    WPREP_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&d_in, plan.input_bytes, stream));
    WPREP_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&d_out, plan.output_bytes, stream));
    // In: each piece copied into a pinned buffer while the other's copy to the GPU runs.
    bool used[2] = {false, false};
    int k = 0;
    for (uint64_t at = 0; at < plan.input_bytes; at += HostStaging::kPiece, k ^= 1) {
      const uint64_t n = std::min(HostStaging::kPiece, plan.input_bytes - at);
      if (used[k]) WPREP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done[k]));
      std::memcpy(staging.buffer[k], in + at, n);
      WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint8_t*>(d_in) + at, staging.buffer[k], n,
                                                 cudaMemcpyHostToDevice, stream));
      WPREP_CUDA_RETURN_IF_ERROR(cudaEventRecord(done[k], stream));
      used[k] = true;
    }
    if (auto s = ConvertOnCuda(plan, d_in, d_out, stream); !s.ok()) return s;
    // Out: a piece's copy from the GPU queued before the previous piece is copied out of
    // its pinned buffer.
    uint64_t pending_at = 0, pending_n = 0;
    k = 0;
    for (uint64_t at = 0; at < plan.output_bytes; at += HostStaging::kPiece, k ^= 1) {
      const uint64_t n = std::min(HostStaging::kPiece, plan.output_bytes - at);
      WPREP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.buffer[k], static_cast<const uint8_t*>(d_out) + at, n,
                                                 cudaMemcpyDeviceToHost, stream));
      WPREP_CUDA_RETURN_IF_ERROR(cudaEventRecord(done[k], stream));
      if (pending_n > 0) {
        WPREP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done[k ^ 1]));
        std::memcpy(out + pending_at, staging.buffer[k ^ 1], pending_n);
      }
      pending_at = at;
      pending_n = n;
    }
    if (pending_n > 0) {
      WPREP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done[k ^ 1]));
      std::memcpy(out + pending_at, staging.buffer[k ^ 1], pending_n);
    }
    return absl::OkStatus();
  }();
  if (d_in != nullptr) cudaFreeAsync(d_in, stream);
  if (d_out != nullptr) cudaFreeAsync(d_out, stream);
  const cudaError_t synced = cudaStreamSynchronize(stream);
  for (cudaEvent_t e : done) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  cudaStreamDestroy(stream);
  if (synced != cudaSuccess) status.Update(WPREP_CUDA_STATUS(synced));
  cudaGetLastError();
  return status;
}

}  // namespace wprep
