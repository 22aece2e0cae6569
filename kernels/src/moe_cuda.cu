// RunMoeCuda: one grid-stride kernel launch per output tensor (the largest on the caller's
// stream, the others beside it on a side stream; see Launch), with the index math of
// moe_math.h (the CPU engine's). Rows pass: one warp per output row, the row map
// computed once per row, and the row's bytes moved in the widest word (16 bytes where
// row lengths, BlockMajorK chunks and pointers allow). Interleave pass: one thread per
// 4 output elements (4 columns of one row of the 128x4 layout).
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

// uint8 scales, 16 output bytes (4 rows x 4 columns of the 128x4 layout) per thread, one
// 16-byte store; `out` 16-byte aligned.
__global__ void __launch_bounds__(kThreads) Interleave16Kernel(InterleavePass p,
                                                               const uint8_t* __restrict__ in,
                                                               uint8_t* __restrict__ out) {
  const int64_t per_expert = p.rows_p * p.cols_p / 16;
  const int64_t total = p.experts * per_expert;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < total; g += stride) {
    const int64_t e = moe::Div(g, per_expert), o = 16 * (g - e * per_expert);
    int64_t src[4];
    int valid[4];
    moe::InterleaveSrcWord(p, e, o, src, valid);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t v = 0;
      const uint8_t* from = in + src[i];
      if (valid[i] == 4 && reinterpret_cast<uintptr_t>(from) % 4 == 0) {
        v = __ldg(reinterpret_cast<const uint32_t*>(from));  // rows of 4k columns: one load
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k < valid[i]) v |= static_cast<uint32_t>(__ldg(from + k)) << (8 * k);
        }
      }
      w[i] = v;
    }
    reinterpret_cast<uint4*>(out)[g] = make_uint4(w[0], w[1], w[2], w[3]);
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
      Interleave16Kernel<<<Blocks(p.experts * p.rows_p * p.cols_p / 16, kThreads), kThreads, 0, stream>>>(
          p, in, out);
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
