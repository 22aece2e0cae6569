// RunMoeCuda: one grid-stride kernel launch per output tensor (the largest on the caller's
// stream, the others beside it on a side stream; see Launch), with the index math of
// moe_math.h (the CPU engine's). Rows pass: one warp per output row, the row map
// computed once per row, and the row's bytes moved in the widest word (16 bytes where
// row lengths, BlockMajorK chunks and pointers allow). Interleave pass: for uint8 scales
// into 16-byte aligned memory, one thread per 4 rows x 16 columns of the input (4 output
// words of the 128x4 layout); otherwise one thread per 4 output elements.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cuda_stream.h"
#include "moe_geometry.h"
#include "wprep/kernels/cuda_status.h"
#include "wprep/kernels/moe.h"

namespace wprep {
namespace {

using moe::InterleavePass;
using moe::OutputPass;
using moe::RowsPass;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

template <int U>
struct Word;
template <>
struct Word<16> {
  using T = uint4;
  static __device__ __forceinline__ T Zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct Word<8> {
  using T = uint2;
  static __device__ __forceinline__ T Zero() { return make_uint2(0, 0); }
};
template <>
struct Word<4> {
  using T = uint32_t;
  static __device__ __forceinline__ T Zero() { return 0; }
};
template <>
struct Word<2> {
  using T = uint16_t;
  static __device__ __forceinline__ T Zero() { return 0; }
};
template <>
struct Word<1> {
  using T = uint8_t;
  static __device__ __forceinline__ T Zero() { return 0; }
};

// Copy rows in U-byte words; kUnroll words per lane in flight before their stores.
template <int U>
__global__ void __launch_bounds__(kThreads) RowsCopyKernel(RowsPass p, const uint8_t* __restrict__ in,
                                                           uint8_t* __restrict__ out) {
  using W = typename Word<U>::T;
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t total = p.experts * p.rows_out;
  const int64_t words = p.out_row_bytes / U;
  // (e, n) of row g, advanced by the grid stride without dividing per row.
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  int64_t e = moe::Div(first, p.rows_out), n = first - e * p.rows_out;
  const int64_t step_e = moe::Div(warps, p.rows_out), step_n = warps - step_e * p.rows_out;
  for (int64_t g = first; g < total; g += warps) {
    if (g != first) {
      e += step_e;
      n += step_n;
      if (n >= p.rows_out) {
        n -= p.rows_out;
        ++e;
      }
    }
    const int64_t src = moe::RowsSrcRowOffset(p, e, n);
    const uint8_t* row = src < 0 ? nullptr : in + src;
    for (int64_t w0 = lane; w0 < words; w0 += 32 * kUnroll) {
      W v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t x = (w0 + 32 * k) * U;
        v[k] = Word<U>::Zero();
        if (row != nullptr && w0 + 32 * k < words && x < p.in_row_bytes) {
          v[k] = __ldg(reinterpret_cast<const W*>(row + x));
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (w0 + 32 * k < words) {
          const int64_t x = (w0 + 32 * k) * U;
          *reinterpret_cast<W*>(out + moe::RowsOutOffset(p, e, n, x)) = v[k];
        }
      }
    }
  }
}

// Rows of a few words (biases: one element a row): a thread per output word, where a warp
// per row would leave most of its lanes idle.
template <int U>
__global__ void __launch_bounds__(kThreads) RowsSmallKernel(RowsPass p, const uint8_t* __restrict__ in,
                                                            uint8_t* __restrict__ out) {
  using W = typename Word<U>::T;
  const int64_t words = p.out_row_bytes / U;
  const int64_t total = p.experts * p.rows_out * words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t g = i / words, x = (i - g * words) * U;
    const int64_t e = g / p.rows_out, n = g - e * p.rows_out;
    const int64_t src = moe::RowsSrcRowOffset(p, e, n);
    W v = Word<U>::Zero();
    if (src >= 0 && x < p.in_row_bytes) v = __ldg(reinterpret_cast<const W*>(in + src + x));
    *reinterpret_cast<W*>(out + moe::RowsOutOffset(p, e, n, x)) = v;
  }
}

// 4-byte output words that widen bf16 or clamp float32 (biases, fp8_block scales: small).
__global__ void __launch_bounds__(kThreads) RowsWordKernel(RowsPass p, const uint8_t* __restrict__ in,
                                                           uint8_t* __restrict__ out) {
  const int64_t words = p.out_row_bytes / 4;
  const int64_t total = p.experts * p.rows_out * words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t g = i / words, x = (i - g * words) * 4;
    const int64_t e = g / p.rows_out, n = g - e * p.rows_out;
    const int64_t src = moe::RowsSrcRowOffset(p, e, n);
    const int64_t s = src < 0 ? -1 : moe::RowsSrcByte(p, x);
    // Byte loads and stores: these tensors are small, and callers' buffers (IPC
    // offsets) need not be word-aligned.
    uint32_t word = 0;
    if (s >= 0 && p.elem == moe::kElemWidenBf16) {
      word = (static_cast<uint32_t>(in[src + s]) | static_cast<uint32_t>(in[src + s + 1]) << 8)
             << 16;
    } else if (s >= 0) {
      const uint8_t* b = in + src + s;
      word = moe::ClampBlockScale(static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
                                  static_cast<uint32_t>(b[2]) << 16 |
                                  static_cast<uint32_t>(b[3]) << 24);
    }
    uint8_t* d = out + moe::RowsOutOffset(p, e, n, x);
    for (int k = 0; k < 4; ++k) d[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

template <int ES>
struct Elem;
template <>
struct Elem<1> {
  using T = uint8_t;
  using T4 = uchar4;
  static __device__ __forceinline__ T4 Make(T a, T b, T c, T d) { return make_uchar4(a, b, c, d); }
};
template <>
struct Elem<2> {
  using T = uint16_t;
  using T4 = ushort4;
  static __device__ __forceinline__ T4 Make(T a, T b, T c, T d) { return make_ushort4(a, b, c, d); }
};

// kVector: `out` is aligned for one 4-element store; else element stores.
template <int ES, bool kVector>
__global__ void __launch_bounds__(kThreads) InterleaveKernel(InterleavePass p,
                                                             const uint8_t* __restrict__ in,
                                                             uint8_t* __restrict__ out) {
  using T = typename Elem<ES>::T;
  const int64_t per_expert = p.rows_p * p.cols_p / 4;
  const int64_t total = p.experts * per_expert;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < total; g += stride) {
    const int64_t e = g / per_expert, o = 4 * (g - e * per_expert);
    int64_t s = 0;
    int valid = 0;
    moe::InterleaveSrcGroup(p, e, o, &s, &valid);
    T v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k >= valid) {
        v[k] = T(0);
      } else if constexpr (ES == 1) {
        v[k] = in[s + k];
      } else {
        v[k] = static_cast<T>(in[2 * (s + k)] | in[2 * (s + k) + 1] << 8);
      }
    }
    if constexpr (kVector) {
      reinterpret_cast<typename Elem<ES>::T4*>(out)[g] = Elem<ES>::Make(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int k = 0; k < 4 * ES; ++k) {
        out[g * 4 * ES + k] = static_cast<uint8_t>(v[k / ES] >> (8 * (k % ES)));
      }
    }
  }
}

// 16 bytes [a, a + valid) of `in` (a >= 0, valid in [1, 16]) as 4 little-endian words,
// zero past `valid`. Loads the aligned 8-byte words that cover them (one 16-byte word when
// aligned), or single bytes where those words would reach outside the input's
// [in, in + in_bytes).
__device__ __forceinline__ void Load16(const uint8_t* __restrict__ in, int64_t in_bytes, int64_t a,
                                       int valid, uint32_t w[4]) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(in + a);
  if (valid == 16 && at % 16 == 0) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    return;
  }
  const int sh = static_cast<int>(at % 8);
  const int words = (sh + valid + 7) / 8;  // 1 to 3
  const uintptr_t base = at - sh;
  if (base >= reinterpret_cast<uintptr_t>(in) &&
      base + 8 * words <= reinterpret_cast<uintptr_t>(in) + static_cast<uint64_t>(in_bytes)) {
    uint32_t u[6];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const uint2 v = k < words ? __ldg(reinterpret_cast<const uint2*>(base) + k) : make_uint2(0, 0);
      u[2 * k] = v.x, u[2 * k + 1] = v.y;
    }
    const bool skip = sh >= 4;
    const unsigned bits = 8 * (sh % 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = __funnelshift_r(skip ? u[k + 1] : u[k], skip ? u[k + 2] : u[k + 1], bits);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kept = valid - 4 * k;
      if (kept <= 0) {
        w[k] = 0;
      } else if (kept < 4) {
        w[k] &= (1u << (8 * kept)) - 1;
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (k < valid) w[k / 4] |= static_cast<uint32_t>(__ldg(in + a + k)) << (8 * (k % 4));
  }
}

// uint8 scales, a thread per 4 source rows (m, m + 32, m + 64, m + 96) x 16 columns: it
// reads each row's 16 bytes in a few aligned words and writes the 4 output words of the
// 128x4 layout they make (one per column group, 4 rows x 4 columns each). A warp's 32
// lanes (m % 32) write 4 runs of 512 contiguous bytes. Where a thread per output word
// reads 16 single bytes from 4 rows, a row's bytes come here in 2-3 loads. `out` 16-byte
// aligned.
__global__ void __launch_bounds__(kThreads) Interleave16Kernel(InterleavePass p,
                                                               const uint8_t* __restrict__ in,
                                                               uint8_t* __restrict__ out) {
  const int64_t groups = p.cols_p / 4, chunks = (groups + 3) / 4;
  const int64_t per_expert = p.rows_p / 128 * chunks;  // warps of work
  const int64_t total = p.experts * per_expert * 32;
  const int64_t in_bytes = p.experts * p.rows_in * p.cols_in;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < total; g += stride) {
    const int lane = static_cast<int>(g & 31);
    const int64_t u = g >> 5;
    const int64_t e = moe::Div(u, per_expert), rem = u - e * per_expert;
    const int64_t mt = moe::Div(rem, chunks), ch = rem - mt * chunks;
    const int64_t left = p.cols_in - 16 * ch;
    const int valid = left <= 0 ? 0 : (left < 16 ? static_cast<int>(left) : 16);
    uint32_t w[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = valid ? moe::SrcRow(p.map, 128 * mt + 32 * i + lane) : -1;
      if (r < 0) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[i][k] = 0;
      } else {
        Load16(in, in_bytes, (e * p.rows_in + r) * p.cols_in + 16 * ch, valid, w[i]);
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(out + e * p.rows_p * p.cols_p + mt * groups * 512 + ch * 2048) + lane;
    const int64_t here = groups - 4 * ch;  // column groups in this chunk: 1 to 4
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < here) dst[32 * j] = make_uint4(w[0][j], w[1][j], w[2][j], w[3][j]);
    }
  }
}

unsigned Blocks(int64_t work_items_per_block_unit, int64_t per_block) {
  // Enough blocks to fill an H200 several times over; grid-stride covers the rest.
  constexpr int64_t kMaxBlocks = 132 * 16;
  int64_t b = (work_items_per_block_unit + per_block - 1) / per_block;
  if (b > kMaxBlocks) b = kMaxBlocks;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b);
}

void LaunchInterleave16(const InterleavePass& p, const uint8_t* in, uint8_t* out, cudaStream_t stream) {
  Interleave16Kernel<<<Blocks(p.experts * p.rows_p / 128 * ((p.cols_p + 15) / 16) * 32, kThreads), kThreads, 0,
                       stream>>>(p, in, out);
}

// Rows with fewer output words than this take a thread per word, not a warp per row.
constexpr int64_t kSmallRowWords = 16;

int WordBytes(const RowsPass& p, const void* in, const void* out) {
  for (int u : {16, 8, 4, 2}) {
    if (p.in_row_bytes % u == 0 && p.out_row_bytes % u == 0 && p.block_bytes % u == 0 &&
        reinterpret_cast<uintptr_t>(in) % u == 0 && reinterpret_cast<uintptr_t>(out) % u == 0) {
      return u;
    }
  }
  return 1;
}

void LaunchRows(const RowsPass& p, const uint8_t* in, uint8_t* out, cudaStream_t stream) {
  if (p.elem != moe::kElemCopy) {
    RowsWordKernel<<<Blocks(p.experts * p.rows_out * (p.out_row_bytes / 4), kThreads), kThreads, 0,
                     stream>>>(p, in, out);
    return;
  }
  const int u = WordBytes(p, in, out);
  if (p.out_row_bytes / u < kSmallRowWords) {
    const unsigned small = Blocks(p.experts * p.rows_out * (p.out_row_bytes / u), kThreads);
    switch (u) {
      case 16:
        RowsSmallKernel<16><<<small, kThreads, 0, stream>>>(p, in, out);
        return;
      case 8:
        RowsSmallKernel<8><<<small, kThreads, 0, stream>>>(p, in, out);
        return;
      case 4:
        RowsSmallKernel<4><<<small, kThreads, 0, stream>>>(p, in, out);
        return;
      case 2:
        RowsSmallKernel<2><<<small, kThreads, 0, stream>>>(p, in, out);
        return;
      default:
        RowsSmallKernel<1><<<small, kThreads, 0, stream>>>(p, in, out);
        return;
    }
  }
  const unsigned blocks = Blocks(p.experts * p.rows_out, kWarpsPerBlock);
  switch (u) {
    case 16:
      RowsCopyKernel<16><<<blocks, kThreads, 0, stream>>>(p, in, out);
      break;
    case 8:
      RowsCopyKernel<8><<<blocks, kThreads, 0, stream>>>(p, in, out);
      break;
    case 4:
      RowsCopyKernel<4><<<blocks, kThreads, 0, stream>>>(p, in, out);
      break;
    case 2:
      RowsCopyKernel<2><<<blocks, kThreads, 0, stream>>>(p, in, out);
      break;
    default:
      RowsCopyKernel<1><<<blocks, kThreads, 0, stream>>>(p, in, out);
      break;
  }
}

absl::Status Launch(const MoePlan& plan, const moe::Geometry& geo, absl::Span<const void* const> inputs,
                    absl::Span<void* const> outputs, cudaStream_t stream);

}  // namespace

namespace moe {

void LaunchRowsOnCuda(const RowsPass& p, const uint8_t* in, uint8_t* out, void* cuda_stream) {
  LaunchRows(p, in, out, static_cast<cudaStream_t>(cuda_stream));
}

void LaunchInterleave16OnCuda(const InterleavePass& p, const uint8_t* in, uint8_t* out, void* cuda_stream) {
  LaunchInterleave16(p, in, out, static_cast<cudaStream_t>(cuda_stream));
}

}  // namespace moe

absl::Status RunMoeCuda(const MoePlan& plan, absl::Span<const void* const> inputs,
                        absl::Span<void* const> outputs, void* cuda_stream) {
  if (inputs.size() != plan.inputs.size() || outputs.size() != plan.outputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan takes ", plan.inputs.size(), " inputs and ", plan.outputs.size(),
                     " outputs; got ", inputs.size(), " and ", outputs.size()));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (plan.output_bytes[i] > 0 && outputs[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(plan.outputs[i].name, ": null device pointer"));
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (plan.input_bytes[i] > 0 && inputs[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(plan.inputs[i].name, ": null device pointer"));
    }
  }
  // The passes gather: an output overlapping an input would read bytes already moved.
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto o = reinterpret_cast<uintptr_t>(outputs[i]);
    for (size_t j = 0; j < inputs.size(); ++j) {
      const auto in = reinterpret_cast<uintptr_t>(inputs[j]);
      if (plan.output_bytes[i] > 0 && plan.input_bytes[j] > 0 && o < in + plan.input_bytes[j] &&
          in < o + plan.output_bytes[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            plan.outputs[i].name, ": output buffer overlaps input ", plan.inputs[j].name));
      }
    }
  }
  auto geo = moe::GeometryOf(plan);
  if (!geo.ok()) return geo.status();
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  // Launch on the stream's device (or, on the legacy stream, the outputs' device),
  // whatever the caller's current device, and leave the current device as it was.
  int device = -1;
  if (stream != nullptr) {
    WPREP_CUDA_RETURN_IF_ERROR(StreamDevice(stream, &device));
  } else {
    for (size_t i = 0; i < outputs.size() && device < 0; ++i) {
      if (plan.output_bytes[i] == 0) continue;
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, outputs[i]) != cudaSuccess ||
          (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)) {
        cudaGetLastError();
        return absl::InvalidArgumentError(
            absl::StrCat(plan.outputs[i].name, ": not a CUDA device pointer"));
      }
      device = attr.device;
    }
  }
  int previous = -1;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  if (device >= 0 && device != previous) WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  absl::Status launched = Launch(plan, *geo, inputs, outputs, stream);
  if (device >= 0 && device != previous) cudaSetDevice(previous);
  return launched;
}

namespace {

absl::Status LaunchOne(const OutputPass& pass, const void* input, void* output, cudaStream_t stream) {
  const auto* in = static_cast<const uint8_t*>(input);
  auto* out = static_cast<uint8_t*>(output);
  if (pass.interleave) {
    const InterleavePass& p = pass.il;
    const unsigned blocks = Blocks(p.experts * p.rows_p * p.cols_p / 4, kThreads);
    const bool vector = reinterpret_cast<uintptr_t>(out) % (4 * p.elem_bytes) == 0;
    if (p.elem_bytes == 2) {
      if (vector) {
        InterleaveKernel<2, true><<<blocks, kThreads, 0, stream>>>(p, in, out);
      } else {
        InterleaveKernel<2, false><<<blocks, kThreads, 0, stream>>>(p, in, out);
      }
    } else if (reinterpret_cast<uintptr_t>(out) % 16 == 0) {
      LaunchInterleave16(p, in, out, stream);
    } else if (vector) {
      InterleaveKernel<1, true><<<blocks, kThreads, 0, stream>>>(p, in, out);
    } else {
      InterleaveKernel<1, false><<<blocks, kThreads, 0, stream>>>(p, in, out);
    }
  } else {
    LaunchRows(pass.rows, in, out, stream);
  }
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// A side stream of this thread's on one device, with the two events that fork it from a
// caller's stream and join it back. Created on first use and kept for the thread's life
// (the daemon's stream workers are long-lived), so a call allocates nothing.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

struct SideStreams {
  static constexpr int kMaxDevices = 64;
  SideStream sides[kMaxDevices];
  bool failed[kMaxDevices] = {};
  SideStreams() = default;
  SideStreams(const SideStreams&) = delete;
  SideStreams& operator=(const SideStreams&) = delete;
  ~SideStreams() {
    for (SideStream& s : sides) {
      if (s.stream == nullptr) continue;
      cudaStreamDestroy(s.stream);
      cudaEventDestroy(s.fork);
      cudaEventDestroy(s.join);
    }
    cudaGetLastError();  // at process exit the runtime may be gone already
  }
};

const SideStream* SideStreamOf(int device) {
  thread_local SideStreams all;
  if (device < 0 || device >= SideStreams::kMaxDevices || all.failed[device]) return nullptr;
  SideStream& s = all.sides[device];
  if (s.stream == nullptr) {
    if (cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      if (s.stream != nullptr) cudaStreamDestroy(s.stream);
      if (s.fork != nullptr) cudaEventDestroy(s.fork);
      all.failed[device] = true;
      s = SideStream{};
      return nullptr;
    }
  }
  return &s;
}

// The largest output runs on the caller's stream; the others (scales and biases: small,
// and bound by latency rather than bandwidth) run beside it on a side stream forked from
// and joined back to the caller's, so their time hides under the large pass. Sequential on
// the caller's stream when it is the legacy stream, when it is being captured into a CUDA
// graph, or when no side stream can be had.
absl::Status Launch(const MoePlan& plan, const moe::Geometry& geo, absl::Span<const void* const> inputs,
                    absl::Span<void* const> outputs, cudaStream_t stream) {
  // A failed call of the caller's may have left an error behind; the checks below must
  // see only these launches'.
  cudaGetLastError();
  int largest = -1, launches = 0;
  for (int i = 0; i < geo.num_outputs; ++i) {
    if (plan.output_bytes[i] == 0) continue;
    ++launches;
    if (largest < 0 || plan.output_bytes[i] > plan.output_bytes[largest]) largest = i;
  }
  const SideStream* side = nullptr;
  if (launches > 1 && stream != nullptr && !StreamIsCapturing(stream)) {
    int device = -1;
    if (cudaGetDevice(&device) == cudaSuccess) side = SideStreamOf(device);
    cudaGetLastError();
  }
  if (side != nullptr) {
    WPREP_CUDA_RETURN_IF_ERROR(cudaEventRecord(side->fork, stream));
    WPREP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side->stream, side->fork, 0));
  }
  auto launch_all = [&]() -> absl::Status {
    for (int i = 0; i < geo.num_outputs; ++i) {
      if (plan.output_bytes[i] == 0 || i == largest) continue;
      absl::Status s = LaunchOne(geo.outputs[i], inputs[geo.outputs[i].input], outputs[i],
                                 side != nullptr ? side->stream : stream);
      if (!s.ok()) return s;
    }
    if (largest < 0) return absl::OkStatus();
    return LaunchOne(geo.outputs[largest], inputs[geo.outputs[largest].input], outputs[largest], stream);
  };
  const absl::Status status = launch_all();
  if (side != nullptr) {
    // Joined even after a failed launch, so the caller's stream never runs ahead of work
    // already queued on the side stream.
    cudaError_t joined = cudaEventRecord(side->join, side->stream);
    if (joined == cudaSuccess) joined = cudaStreamWaitEvent(stream, side->join, 0);
    if (status.ok()) WPREP_CUDA_RETURN_IF_ERROR(joined);
  }
  return status;
}

}  // namespace

}  // namespace wprep
