// quantize_mxfp4 on the GPU.
//
// bf16 rows of whole groups (Q a multiple of 32, the common case) take Bf16GroupKernel: four
// lanes per group, each with 16 contiguous bytes, so a warp's loads are 512 contiguous
// bytes; the group's amax is two shuffles; the e2m1 codes come from packed bf16x2 compares
// (below), about 9 instructions an element where the scalar encoder takes some 27. Groups
// it cannot encode exactly that way (a NaN or inf, or a scale so extreme that a product
// would leave bf16's normal range) fall back, group by group, to the scalar math.
// Everything else (fp16, fp32, ragged Q, unaligned rows) takes one thread per group.
// The scalar math is quantize_math.h, shared with the CPU engine.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "wprep/kernels/cuda_status.h"
#include "layout_math.h"
#include "wprep/kernels/quantize.h"
#include "wprep/spec/status_macros.h"
#include "moe_geometry.h"
#include "quantize_math.h"

namespace wprep {
namespace {

template <QuantDtype D>
__device__ __forceinline__ float Load(const uint8_t* row, int64_t i) {
  if constexpr (D == QuantDtype::kFloat32) {
    return reinterpret_cast<const float*>(row)[i];
  } else {
    const uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
    return D == QuantDtype::kBfloat16 ? qmath::Bf16ToFloat(h) : qmath::Fp16ToFloat(h);
  }
}

template <QuantDtype D>
__global__ void QuantizeKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ values,
                               uint8_t* __restrict__ scales, int64_t rows, int64_t q, bool up,
                               int64_t vrow_bytes) {
  // vrow_bytes: ceil(q/2) for canonical values, Kpad for blackwell_value (the row's last
  // group also zeroes the padding). scales == nullptr: the scale layout is written apart.
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  const int64_t sq = (q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t vq = vrow_bytes;
  const int64_t total = rows * sq;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / sq, g = t - r * sq;
    const uint8_t* row = in + r * q * kEsize;
    const int64_t begin = g * qmath::kGroup;
    const int n = q - begin < qmath::kGroup ? static_cast<int>(q - begin) : qmath::kGroup;
    float x[qmath::kGroup];
    const uint8_t* src = row + begin * kEsize;
    if (n == qmath::kGroup && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      // Full aligned group: vector loads, then the same per-element conversion.
      uint4 raw[qmath::kGroup * kEsize / 16];
      WPREP_UNROLL
      for (int k = 0; k < qmath::kGroup * kEsize / 16; ++k) {
        raw[k] = reinterpret_cast<const uint4*>(src)[k];
      }
      const uint8_t* b = reinterpret_cast<const uint8_t*>(raw);
      WPREP_UNROLL
      for (int i = 0; i < qmath::kGroup; ++i) x[i] = Load<D>(b, i);
    } else {
      WPREP_UNROLL
      for (int i = 0; i < qmath::kGroup; ++i) x[i] = i < n ? Load<D>(src, i) : 0.0f;
    }
    float amax = 0.0f;
    WPREP_UNROLL
    for (int i = 0; i < qmath::kGroup; ++i) amax = qmath::AbsMaxNum(amax, x[i]);  // pads are 0
    const uint32_t e = qmath::ScaleBits(amax, up);
    if (scales != nullptr) scales[r * sq + g] = static_cast<uint8_t>(e >> 23);
    const float qs = qmath::ScaleMultiplier(e);
    uint8_t out[qmath::kGroup / 2];
    WPREP_UNROLL
    for (int j = 0; j < qmath::kGroup / 2; ++j) {
      const uint32_t lo = 2 * j < n ? qmath::EncodeE2m1(x[2 * j] * qs) : 0u;
      const uint32_t hi = 2 * j + 1 < n ? qmath::EncodeE2m1(x[2 * j + 1] * qs) : 0u;
      out[j] = static_cast<uint8_t>(lo | hi << 4);
    }
    uint8_t* dst = values + r * vq + begin / 2;
    const int nbytes = (n + 1) / 2;
    if (nbytes == qmath::kGroup / 2 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
    } else {
      for (int j = 0; j < nbytes; ++j) dst[j] = out[j];
    }
    if (g == sq - 1) {
      for (int64_t j = (q + 1) / 2; j < vrow_bytes; ++j) values[r * vq + j] = 0;
    }
  }
}

// blackwell_scale of the transposed scale view: each destination byte finds its group with
// BlackwellScaleSource and recomputes that group's scale from the input (32 elements).
template <QuantDtype D>
__global__ void BlackwellScaleKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ scales,
                                     int64_t mats, int64_t n, int64_t q, bool up,
                                     BlackwellScaleTiling t) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  const int64_t per_mat = t.kpad * t.npad;
  const int64_t total = mats * per_mat;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / per_mat;
    int64_t k = 0, col = 0;
    BlackwellScaleSource(t, i - m * per_mat, &k, &col);
    uint8_t byte = 0;
    if (k < t.k && col < n) {
      const uint8_t* src = in + ((m * n + col) * q + k * qmath::kGroup) * kEsize;
      const int nel = q - k * qmath::kGroup < qmath::kGroup ? static_cast<int>(q - k * qmath::kGroup)
                                                            : qmath::kGroup;
      float amax = 0.0f;
      for (int j = 0; j < nel; ++j) amax = qmath::AbsMaxNum(amax, Load<D>(src, j));
      byte = static_cast<uint8_t>(qmath::ScaleBits(amax, up) >> 23);
    }
    scales[i] = byte;
  }
}

// ---------------------------------------------------------------------------------------
// The packed bf16 encoder. With the scale exponent E in [kFastMinE, kFastMaxE], the
// multiplier 2^(127-E) is a normal bf16 and |x| * 2^(127-E) is exact wherever it is normal;
// where it is not (|q| < 2^-126, including subnormal x, which E >= 8 keeps below 2^-7),
// the code is 0 however the hardware rounds or flushes it. The e2m1 code of |q| under
// round-to-nearest-even is the number of thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
// it passes, strictly for the ties that round down (0.25, 1.25, 2.5, 5: written as the
// next bf16 up, so every compare is >=) and inclusively for those that round up; values
// above 6 pass all seven (code 7, saturation). The thresholds are nested, so three
// compares find the count, a binary search per bf16 half.
inline constexpr uint32_t kFastMinE = 8, kFastMaxE = 253;

__device__ __forceinline__ uint32_t Pair(uint32_t h) { return h | h << 16; }

__device__ __forceinline__ uint32_t GeMask(uint32_t a, uint32_t b) {
  return __hge2_mask(*reinterpret_cast<const __nv_bfloat162*>(&a),
                     *reinterpret_cast<const __nv_bfloat162*>(&b));
}

// Two e2m1 codes (sign in bit 3) of |x| * qs from bf16x2 `w`, in bits 0-3 and 16-19.
__device__ __forceinline__ uint32_t EncodePair(uint32_t w, uint32_t qs2) {
  const uint32_t a = w & 0x7FFF7FFFu;
  const __nv_bfloat162 prod = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                      *reinterpret_cast<const __nv_bfloat162*>(&qs2));
  const uint32_t q = *reinterpret_cast<const uint32_t*>(&prod);
  // bf16 bits of the thresholds: 1.75; 0.75 | 3.5; 0.25+ | 1.25+ | 2.5+ | 5+.
  const uint32_t m4 = GeMask(q, Pair(0x3FE0u));
  const uint32_t t2 = (m4 & Pair(0x4060u)) | (~m4 & Pair(0x3F40u));
  const uint32_t m2 = GeMask(q, t2);
  const uint32_t lo = (m2 & Pair(0x3FA1u)) | (~m2 & Pair(0x3E81u));
  const uint32_t hi = (m2 & Pair(0x40A1u)) | (~m2 & Pair(0x4021u));
  const uint32_t m1 = GeMask(q, (m4 & hi) | (~m4 & lo));
  return (m4 & 0x00040004u) | (m2 & 0x00020002u) | (m1 & 0x00010001u) | ((w >> 12) & 0x00080008u);
}

__device__ __forceinline__ uint32_t Bf16MaxNan(uint32_t a, uint32_t b) {
  const __nv_bfloat162 m = __hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                       *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&m);
}

// Where one group's outputs go. Canonical: values and scales are flat ([rows, Q/2] and
// [rows, Q/32]). Blackwell: value rows padded to vrow bytes, and each scale byte at its
// blackwell_scale position (docs/LAYOUTS.md) in the [E, N, K/32] view.
struct GroupSink {
  int64_t vrow = 0;          // value bytes of a destination row
  uint32_t sq = 0;           // groups of a row
  FastDivisor div_sq, div_n;
  bool blackwell = false;
  int64_t per_mat = 0;       // blackwell_scale bytes of one matrix
  int64_t k_blocks = 0;      // Kp / 4
};

__device__ __forceinline__ int64_t ScaleDest(const GroupSink& s, uint32_t r, uint32_t k) {
  const uint32_t m = s.div_n.Div(r), col = r - m * s.div_n.divisor;
  return m * s.per_mat + ((static_cast<int64_t>(col >> 7) * s.k_blocks + (k >> 2)) * 32 + (col & 31)) * 16 +
         4 * ((col >> 5) & 3) + (k & 3);
}

// Groups [0, groups) of a bf16 tensor whose rows are whole groups; in is 16-byte aligned,
// values 4-byte aligned, groups < 2^31. Each warp takes 32 consecutive groups at a time.
__global__ void Bf16GroupKernel(const uint4* __restrict__ in, uint8_t* __restrict__ values,
                                uint8_t* __restrict__ scales, uint32_t groups, bool up, GroupSink sink) {
  const uint32_t lane = threadIdx.x & 31, sub = lane & 3;
  const uint32_t group_lanes = 0xFu << (lane & ~3u);
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  for (uint32_t base = warp * 32; base < groups; base += warps * 32) {
    uint4 raw[4];
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) {
      const uint32_t g = base + 8 * u + (lane >> 2);
      raw[u] = g < groups ? in[static_cast<int64_t>(g) * 4 + sub] : make_uint4(0, 0, 0, 0);
    }
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) {
      const uint32_t g = base + 8 * u + (lane >> 2);
      if (g >= groups) continue;  // all four lanes of a group agree
      const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      uint32_t m = Bf16MaxNan(Bf16MaxNan(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu),
                              Bf16MaxNan(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
      m = Bf16MaxNan(m, __shfl_xor_sync(group_lanes, m, 1));
      m = Bf16MaxNan(m, __shfl_xor_sync(group_lanes, m, 2));
      m = Bf16MaxNan(m, m >> 16);
      const float amax = qmath::Bf16ToFloat(static_cast<uint16_t>(m));
      uint32_t e = qmath::ScaleBits(amax, up);
      uint32_t out = 0;
      if (amax == amax && (e >> 23) >= kFastMinE && (e >> 23) <= kFastMaxE) {
        const uint32_t qs2 = Pair((254u - (e >> 23)) << 7);
        WPREP_UNROLL
        for (int p = 0; p < 4; ++p) {
          const uint32_t c = EncodePair(w[p], qs2);
          out |= ((c | c >> 12) & 0xFFu) << (8 * p);
        }
      } else {
        // The scalar path of the CPU engine: amax ignores NaNs (maxnum).
        float x[8];
        float a = 0.0f;
        WPREP_UNROLL
        for (int i = 0; i < 8; ++i) {
          x[i] = qmath::Bf16ToFloat(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
          a = qmath::AbsMaxNum(a, x[i]);
        }
        a = fmaxf(a, __shfl_xor_sync(group_lanes, a, 1));
        a = fmaxf(a, __shfl_xor_sync(group_lanes, a, 2));
        e = qmath::ScaleBits(a, up);
        const float qs = qmath::ScaleMultiplier(e);
        WPREP_UNROLL
        for (int i = 0; i < 8; ++i) out |= qmath::EncodeE2m1(x[i] * qs) << (4 * i);
      }
      const uint32_t r = sink.div_sq.Div(g), k = g - r * sink.sq;
      *reinterpret_cast<uint32_t*>(values + r * sink.vrow + 16 * k + 4 * sub) = out;
      if (sub == 0) {
        const uint8_t sbyte = static_cast<uint8_t>(e >> 23);
        if (sink.blackwell) {
          scales[ScaleDest(sink, r, k)] = sbyte;
        } else {
          scales[g] = sbyte;
        }
        if (k == sink.sq - 1) {  // the row's padding, Blackwell values only
          for (int64_t j = 16 * static_cast<int64_t>(sink.sq); j < sink.vrow; ++j) values[r * sink.vrow + j] = 0;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Fused quantize + hopper_value(mx_axis=-2) + hopper_scale(mx_axis=-2). A weight stored
// [..., N, K] quantizes along K into the checkpoint-order MXFP4 of the logical [..., K, N],
// whose Hopper matrix Q (LAYOUTS.md step 1, mx_axis -2 from packing -2) is the quantized rows
// as they are: Q[e, n, c] = codes of elements 2c, 2c+1 of row n. The scale tensor's S is
// likewise the groups' scales [e, n, g]. A block takes a tile of 64 Q rows x 64 Q bytes
// (4 groups): it quantizes the tile into shared memory (4 lanes a group, 8 elements a
// lane), then writes the tile's 16 O rows x 256 bytes of hopper_value as whole words and
// its 256 scale bytes at their hopper_scale places. Tiles past N or K write the layouts'
// zero padding.
// One lane's share of a group quantized by four lanes (lanes 4j..4j+3 of the warp, each with
// 8 consecutive elements): this lane's elements [src, src + valid), zeros past them; the
// group's amax over its four lanes; and, when the group is `live`, this lane's 8 codes (code
// i in bits 4i..4i+3; none past `valid`) and the group's scale byte. Every lane of the warp
// calls it (the shuffles), live or not.
template <QuantDtype D>
__device__ __forceinline__ void QuantizeLaneOf8(const uint8_t* src, int valid, bool live, bool up, uint32_t* word,
                                                uint32_t* sbyte) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  float x[8];
  // 16-bit types: the lane's 8 elements in one 16-byte load where aligned.
  uint4 raw = make_uint4(0, 0, 0, 0);
  const bool vec = kEsize == 2 && valid == 8 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec) raw = __ldg(reinterpret_cast<const uint4*>(src));
  const auto* rb = reinterpret_cast<const uint8_t*>(&raw);
  float amax = 0.0f;
  WPREP_UNROLL
  for (int i = 0; i < 8; ++i) {
    x[i] = vec ? Load<D>(rb, i) : (i < valid ? Load<D>(src, i) : 0.0f);
    amax = qmath::AbsMaxNum(amax, x[i]);
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  *word = 0;
  *sbyte = 0;
  if (!live) return;
  const uint32_t eb = qmath::ScaleBits(amax, up);
  const float qs = qmath::ScaleMultiplier(eb);
  WPREP_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < valid) *word |= qmath::EncodeE2m1(x[i] * qs) << (4 * i);
  }
  *sbyte = eb >> 23;
}

constexpr int kHopperTileRows = kFusedHopperTileRows;
constexpr int kHopperTileBytes = kFusedHopperTileBytes;  // Q columns: 4 groups
constexpr int kHopperTilePitch = kHopperTileBytes / 4 + 1;  // words; +1 spreads the banks

template <QuantDtype D>
__global__ void __launch_bounds__(256) HopperFusedKernel(const uint8_t* __restrict__ in,
                                                         uint8_t* __restrict__ values,
                                                         uint8_t* __restrict__ scales,
                                                         FusedHopperGeometry g, bool up) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  __shared__ uint32_t q[kHopperTileRows * kHopperTilePitch];
  __shared__ uint8_t s[kHopperTileRows * 4];
  const int sub = threadIdx.x & 3;
  const int64_t total = g.mats * g.tiles_per_mat;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t e = t / g.tiles_per_mat, rest = t - e * g.tiles_per_mat;
    const int64_t tr = rest / g.tile_cols, row0 = tr * kHopperTileRows;
    const int64_t c0 = (rest - tr * g.tile_cols) * kHopperTileBytes;
    // 1. Quantize: pass p takes groups 64p .. 64p+63 of the tile (row 16p + i/4, group i%4).
    for (int p = 0; p < 4; ++p) {
      const int tg = 64 * p + (threadIdx.x >> 2);
      const int lr = tg >> 2, j = tg & 3;
      const int64_t n = row0 + lr, grp = c0 / 16 + j;
      const bool live = n < g.n && grp < g.sq;
      const int64_t k0 = grp * 32 + 8 * sub;  // this lane's first element
      const uint8_t* src = in + ((e * g.n + n) * g.k + k0) * kEsize;
      int valid = 0;
      if (live) valid = g.k - k0 >= 8 ? 8 : (g.k - k0 > 0 ? static_cast<int>(g.k - k0) : 0);
      uint32_t word = 0, sbyte = 0;
      QuantizeLaneOf8<D>(src, valid, live, up, &word, &sbyte);
      q[lr * kHopperTilePitch + 4 * j + sub] = word;
      if (sub == 0) s[lr * 4 + j] = static_cast<uint8_t>(sbyte);
    }
    __syncthreads();
    // 2. Values: O rows row0/4 .. +16, bytes 4*c0 .. +256, one word a thread per step.
    if (row0 < g.vt.rows_pad && c0 < g.vt.cols_pad) {
      const auto* qb = reinterpret_cast<const uint8_t*>(q);
      uint8_t* vmat = values + e * g.v_mat_bytes;
      for (int w = threadIdx.x; w < 16 * 64; w += 256) {
        const int orl = w >> 6, ow = w & 63;
        uint32_t o = 0;
        WPREP_UNROLL
        for (int b = 0; b < 4; ++b) {
          int r = 0, c = 0;
          HopperSource<int>(orl, 4 * ow + b, g.mma_version, &r, &c);
          o |= static_cast<uint32_t>(qb[(r * kHopperTilePitch) * 4 + c]) << (8 * b);
        }
        const uint32_t word = HopperInterleaveWord(o);
        uint8_t* dst = vmat + (row0 / 4 + orl) * g.vt.out_cols + 4 * c0 + 4 * ow;
        if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
          *reinterpret_cast<uint32_t*>(dst) = word;
        } else {  // a caller's buffer at an odd offset: bytes, the same result
          for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(word >> (8 * b));
        }
      }
    }
    // 3. Scales: S[n, grp] to its hopper_scale place.
    {
      const int lr = threadIdx.x >> 2, j = threadIdx.x & 3;
      const int64_t r = row0 + lr, col = c0 / 16 + j;
      if (r < g.st.rows_pad && col < g.st.cols_pad) {
        scales[e * g.s_mat_bytes + HopperScaleOffset(g.st, r, col)] = s[lr * 4 + j];
      }
    }
    __syncthreads();
  }
}


// ---------------------------------------------------------------------------------------
// Fused quantize + the trtllm-gen MXFP4 preparation (values and scales of prepare_w13 /
// prepare_w2). A block takes a tile of 128 output rows (one row tile of the 128x4 scale
// layout) x 4 groups (64 value bytes, one 512-byte scale block): it finds each output row's
// source weight row through the prepare's row map, quantizes the tile into shared memory (4
// lanes a group, 8 elements a lane), then writes the 128 value row pieces and the scale block.
// Rows the map leaves empty and groups past K are the load-time zero padding.
template <QuantDtype D>
__global__ void __launch_bounds__(256) TrtllmFusedKernel(const uint8_t* __restrict__ in,
                                                         uint8_t* __restrict__ values,
                                                         uint8_t* __restrict__ scales, moe::RowsPass vp,
                                                         int64_t k, int64_t cols_p, bool up) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  constexpr int kRows = kFusedTrtllmTileRows, kGroups = kFusedTrtllmTileGroups;
  constexpr int kPitch = 4 * kGroups + 1;  // words of a row's 64 value bytes, +1 for the banks
  __shared__ uint32_t q[kRows * kPitch];
  __shared__ uint32_t s[kRows];  // the row's 4 scale bytes, little-endian
  __shared__ int64_t src_row[kRows];
  const int sub = threadIdx.x & 3;
  const int64_t sq = k / qmath::kGroup;
  const int64_t row_tiles = vp.rows_out / kRows, col_tiles = cols_p / kGroups;
  const int64_t per_expert = row_tiles * col_tiles, total = vp.experts * per_expert;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t e = t / per_expert, rest = t - e * per_expert;
    const int64_t mt = rest / col_tiles, cg = rest - mt * col_tiles;
    if (threadIdx.x < kRows) {
      const int64_t r = moe::SrcRow(vp.map, kRows * mt + threadIdx.x);
      src_row[threadIdx.x] = r < 0 ? -1 : (e * vp.rows_in + r) * k;
      s[threadIdx.x] = 0;
    }
    __syncthreads();
    // 1. Quantize: pass p takes groups 64p .. 64p+63 of the tile (row 16p + i/4, group i%4).
    for (int p = 0; p < kRows * kGroups / 64; ++p) {
      const int tg = 64 * p + (threadIdx.x >> 2);
      const int lr = tg >> 2, j = tg & 3;
      const int64_t grp = kGroups * cg + j;
      const int64_t base = src_row[lr];
      const bool live = base >= 0 && grp < sq;
      const uint8_t* src = live ? in + (base + grp * qmath::kGroup + 8 * sub) * kEsize : in;
      uint32_t word = 0, sbyte = 0;
      QuantizeLaneOf8<D>(src, live ? 8 : 0, live, up, &word, &sbyte);
      q[lr * kPitch + 4 * j + sub] = word;
      if (sub == 0 && sbyte != 0) atomicOr(&s[lr], sbyte << (8 * j));
    }
    __syncthreads();
    // 2. Values: 128 rows x 16 words at bytes 64 * cg of each row.
    for (int w = threadIdx.x; w < kRows * 16; w += 256) {
      const int r = w >> 4, c = w & 15;
      uint8_t* dst = values + (e * vp.rows_out + kRows * mt + r) * vp.out_row_bytes + 64 * cg + 4 * c;
      const uint32_t v = q[r * kPitch + c];
      if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
        *reinterpret_cast<uint32_t*>(dst) = v;
      } else {
        for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(v >> (8 * b));
      }
    }
    // 3. Scales: the block's 512 bytes, word i of 16-byte unit u = row u + 32 i.
    uint8_t* block = scales + e * vp.rows_out * cols_p + mt * (cols_p / 4) * 512 + cg * 512;
    for (int w = threadIdx.x; w < kRows; w += 256) {
      const uint32_t v = s[(w >> 2) + 32 * (w & 3)];
      uint8_t* dst = block + 4 * w;
      if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
        *reinterpret_cast<uint32_t*>(dst) = v;
      } else {
        for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(v >> (8 * b));
      }
    }
    __syncthreads();
  }
}

// The padding bytes of blackwell_scale (k >= K/32 or n >= N), which no group writes.
__global__ void BlackwellScalePaddingKernel(uint8_t* __restrict__ scales, int64_t total,
                                            BlackwellScaleTiling t) {
  const int64_t per_mat = t.kpad * t.npad;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t k = 0, col = 0;
    BlackwellScaleSource(t, i % per_mat, &k, &col);
    if (k >= t.k || col >= t.n) scales[i] = 0;
  }
}

unsigned Blocks(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<unsigned>(b < (1 << 30) ? b : (1 << 30));
}

// Whether Bf16GroupKernel serves this tensor, and the launch if so.
bool Bf16GroupsFit(const QuantizePlan& plan, const void* in, const void* values) {
  const int64_t sq = plan.q / qmath::kGroup;
  return plan.dtype == QuantDtype::kBfloat16 && plan.q % qmath::kGroup == 0 &&
         plan.rows * sq < (int64_t{1} << 31) && (reinterpret_cast<uintptr_t>(in) & 15) == 0 &&
         (reinterpret_cast<uintptr_t>(values) & 3) == 0;
}

void LaunchBf16Groups(const QuantizePlan& plan, const void* in, void* values, void* scales,
                      const GroupSink& sink, CudaStream stream) {
  constexpr int kThreads = 256;  // 8 warps of 32 groups
  const auto groups = static_cast<uint32_t>(plan.rows * (plan.q / qmath::kGroup));
  Bf16GroupKernel<<<Blocks(groups, kThreads), kThreads, 0, stream>>>(
      static_cast<const uint4*>(in), static_cast<uint8_t*>(values), static_cast<uint8_t*>(scales), groups,
      plan.rounding == ScaleRounding::kUp, sink);
}

}  // namespace

absl::Status QuantizeOnCuda(const QuantizePlan& plan, const void* in, void* values, void* scales,
                            CudaStream stream) {
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t groups = plan.rows * sq;  // <= scales_bytes, checked by the plan
  if (groups == 0) return absl::OkStatus();
  auto ptr_device = [](const void* p) -> int {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
      (void)cudaGetLastError();  // clear the sticky-free error of a host pointer
      return -1;
    }
    return a.device;
  };
  const int dev = ptr_device(in);
  if (dev < 0 || ptr_device(values) != dev || ptr_device(scales) != dev) {
    return absl::InvalidArgumentError(
        "quantize: input, values and scales must be device memory of one GPU");
  }
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  constexpr int kThreads = 256;
  const int64_t blocks64 = (groups + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < (1 << 30) ? blocks64 : (1 << 30));
  const bool up = plan.rounding == ScaleRounding::kUp;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  if (Bf16GroupsFit(plan, in, values)) {
    GroupSink sink;
    sink.sq = static_cast<uint32_t>(sq);
    sink.vrow = plan.q / 2;
    sink.div_sq = FastDivisor(sink.sq);
    LaunchBf16Groups(plan, in, values, scales, sink, stream);
  } else {
    switch (plan.dtype) {
      case QuantDtype::kBfloat16:
        QuantizeKernel<QuantDtype::kBfloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
        break;
      case QuantDtype::kFloat16:
        QuantizeKernel<QuantDtype::kFloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
        break;
      case QuantDtype::kFloat32:
        QuantizeKernel<QuantDtype::kFloat32><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
        break;
    }
  }
  absl::Status launched = WPREP_CUDA_STATUS(cudaGetLastError());
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return launched;
}

absl::Status QuantizeBlackwellOnCuda(const QuantizePlan& plan, const void* in, void* values,
                                     void* scales, CudaStream stream) {
  auto sizes = PlanQuantizeBlackwell(plan);
  if (!sizes.ok()) return sizes.status();
  const int64_t n = plan.input_shape[plan.input_shape.size() - 2];
  if (n == 0 || plan.rows == 0) return absl::OkStatus();
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  cudaPointerAttributes a{};
  WPREP_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&a, in));
  if (a.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("quantize: input must be device memory");
  }
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(a.device));
  constexpr int kThreads = 256;
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t kpad = RoundUp(plan.q / 2, 128);
  const BlackwellScaleTiling t = MakeBlackwellScaleTiling(sq, n);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  const unsigned vb = Blocks(plan.rows * sq, kThreads), sb = Blocks(sizes->scales_bytes, kThreads);
  const int64_t mats = plan.rows / n;
  if (Bf16GroupsFit(plan, in, values) && n < (int64_t{1} << 31)) {
    GroupSink sink;
    sink.sq = static_cast<uint32_t>(sq);
    sink.vrow = kpad;
    sink.div_sq = FastDivisor(sink.sq);
    sink.div_n = FastDivisor(static_cast<uint32_t>(n));
    sink.blackwell = true;
    sink.per_mat = t.kpad * t.npad;
    sink.k_blocks = t.kpad / 4;
    LaunchBf16Groups(plan, in, values, scales, sink, stream);
    if (t.kpad != t.k || t.npad != n) {
      BlackwellScalePaddingKernel<<<sb, kThreads, 0, stream>>>(s, sizes->scales_bytes, t);
    }
  } else {
    switch (plan.dtype) {
#define WPREP_Q_LAUNCH(D)                                                                    \
    QuantizeKernel<D><<<vb, kThreads, 0, stream>>>(src, v, nullptr, plan.rows, plan.q, up, kpad); \
    BlackwellScaleKernel<D><<<sb, kThreads, 0, stream>>>(src, s, mats, n, plan.q, up, t);
      case QuantDtype::kBfloat16: WPREP_Q_LAUNCH(QuantDtype::kBfloat16) break;
      case QuantDtype::kFloat16: WPREP_Q_LAUNCH(QuantDtype::kFloat16) break;
      case QuantDtype::kFloat32: WPREP_Q_LAUNCH(QuantDtype::kFloat32) break;
#undef WPREP_Q_LAUNCH
    }
  }
  absl::Status launched = WPREP_CUDA_STATUS(cudaGetLastError());
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return launched;
}

namespace {

// The fused launches run on the input's GPU: made current for them and the caller's device
// restored after. `Wave` is a resident wave of 256-thread blocks (8 per multiprocessor) that
// grid-strides over `work` tiles.
class OnInputDevice {
 public:
  absl::Status Enter(const void* in) {
    WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    cudaPointerAttributes a{};
    WPREP_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&a, in));
    if (a.type != cudaMemoryTypeDevice) return absl::InvalidArgumentError("quantize: input must be device memory");
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(a.device));
    if (cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, a.device) != cudaSuccess || sms_ <= 0) sms_ = 1;
    return absl::OkStatus();
  }
  unsigned Wave(int64_t work) const {
    const int64_t wave = 8 * int64_t{sms_};
    return static_cast<unsigned>(work < wave ? (work > 0 ? work : 1) : wave);
  }
  // The launches' status (checked first), then the caller's device restored.
  absl::Status Leave() const {
    absl::Status launched = WPREP_CUDA_STATUS(cudaGetLastError());
    WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous_));
    return launched;
  }

 private:
  int previous_ = 0;
  int sms_ = 1;
};

// One launch of `kernel`, templated on the input dtype, for `dtype`.
#define WPREP_LAUNCH_BY_DTYPE(dtype, kernel, grid, stream, ...)                           \
  switch (dtype) {                                                                        \
    case QuantDtype::kBfloat16:                                                           \
      kernel<QuantDtype::kBfloat16><<<grid, 256, 0, stream>>>(__VA_ARGS__);               \
      break;                                                                              \
    case QuantDtype::kFloat16:                                                            \
      kernel<QuantDtype::kFloat16><<<grid, 256, 0, stream>>>(__VA_ARGS__);                \
      break;                                                                              \
    case QuantDtype::kFloat32:                                                            \
      kernel<QuantDtype::kFloat32><<<grid, 256, 0, stream>>>(__VA_ARGS__);                \
      break;                                                                              \
  }

absl::Status QuantizeHopperOnCuda(const QuantizePlan& plan, const QuantLayoutSpec& spec, const void* in, void* values,
                                  void* scales, CudaStream stream) {
  auto g = FusedHopperGeometryOf(plan, spec);
  if (!g.ok()) return g.status();
  const int64_t tiles = g->mats * g->tiles_per_mat;
  if (tiles == 0) return absl::OkStatus();
  OnInputDevice dev;
  WPREP_RETURN_IF_ERROR(dev.Enter(in));
  WPREP_LAUNCH_BY_DTYPE(plan.dtype, HopperFusedKernel, dev.Wave(tiles), stream, static_cast<const uint8_t*>(in),
                        static_cast<uint8_t*>(values), static_cast<uint8_t*>(scales), *g,
                        plan.rounding == ScaleRounding::kUp)
  return dev.Leave();
}

absl::Status QuantizeTrtllmOnCuda(const QuantizePlan& plan, const QuantLayoutSpec& spec, const void* in, void* values,
                                  void* scales, CudaStream stream, const QuantBias& bias) {
  auto g = FusedTrtllmGeometryOf(plan, spec, bias.bfloat16);
  if (!g.ok()) return g.status();
  const moe::RowsPass& vp = g->values;
  const int64_t tiles = vp.experts * (vp.rows_out / kFusedTrtllmTileRows) * (g->scales.cols_p / kFusedTrtllmTileGroups);
  OnInputDevice dev;
  WPREP_RETURN_IF_ERROR(dev.Enter(in));
  if (tiles > 0) {
    WPREP_LAUNCH_BY_DTYPE(plan.dtype, TrtllmFusedKernel, dev.Wave(tiles), stream, static_cast<const uint8_t*>(in),
                          static_cast<uint8_t*>(values), static_cast<uint8_t*>(scales), vp, g->k, g->scales.cols_p,
                          plan.rounding == ScaleRounding::kUp)
  }
  if (bias.in != nullptr) {  // the MoE engine's own rows pass of the prepare plan
    moe::LaunchRowsOnCuda(g->bias, static_cast<const uint8_t*>(bias.in), static_cast<uint8_t*>(bias.out), stream);
  }
  return dev.Leave();
}

#undef WPREP_LAUNCH_BY_DTYPE

}  // namespace

absl::Status QuantizeLayoutOnCuda(const QuantizePlan& plan, const QuantLayoutSpec& spec, const void* in,
                                  void* values, void* scales, CudaStream stream, const QuantBias& bias) {
  const bool trtllm = spec.layout == QuantLayout::kTrtllmW13 || spec.layout == QuantLayout::kTrtllmW2;
  if ((bias.in == nullptr) != (bias.out == nullptr) || (bias.in != nullptr && !trtllm)) {
    return absl::InvalidArgumentError("bias: give both its input and output, for a trtllm layout only");
  }
  switch (spec.layout) {
    case QuantLayout::kCanonical:
      return QuantizeOnCuda(plan, in, values, scales, stream);
    case QuantLayout::kBlackwell:
      return QuantizeBlackwellOnCuda(plan, in, values, scales, stream);
    case QuantLayout::kHopper:
      return QuantizeHopperOnCuda(plan, spec, in, values, scales, stream);
    case QuantLayout::kTrtllmW13:
    case QuantLayout::kTrtllmW2:
      return QuantizeTrtllmOnCuda(plan, spec, in, values, scales, stream, bias);
  }
  return absl::InvalidArgumentError("layout: unknown quantize layout");
}

absl::Status QuantizeHostBuffersOnCuda(const QuantizePlan& plan, const uint8_t* in,
                                       size_t in_size, uint8_t* values, size_t values_size,
                                       uint8_t* scales, size_t scales_size, int device,
                                       const QuantLayoutSpec& spec) {
  auto sizes = PlanQuantizeLayout(plan, spec);
  if (!sizes.ok()) return sizes.status();
  if (static_cast<int64_t>(in_size) != plan.input_bytes ||
      static_cast<int64_t>(values_size) != sizes->values_bytes ||
      static_cast<int64_t>(scales_size) != sizes->scales_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize: buffer sizes ", in_size, "/", values_size, "/", scales_size,
        " do not match the plan's ", plan.input_bytes, "/", sizes->values_bytes, "/",
        sizes->scales_bytes));
  }
  if (sizes->scales_bytes == 0 && sizes->values_bytes == 0) return absl::OkStatus();
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void *d_in = nullptr, *d_v = nullptr, *d_s = nullptr;
  absl::Status st = WPREP_CUDA_STATUS(cudaMalloc(&d_in, in_size > 0 ? in_size : 1));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_v, values_size > 0 ? values_size : 1)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_s, scales_size)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(d_in, in, in_size, cudaMemcpyHostToDevice)));
  if (st.ok()) st.Update(QuantizeLayoutOnCuda(plan, spec, d_in, d_v, d_s, nullptr));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(values, d_v, values_size, cudaMemcpyDeviceToHost)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(scales, d_s, scales_size, cudaMemcpyDeviceToHost)));
  (void)cudaFree(d_in);
  (void)cudaFree(d_v);
  (void)cudaFree(d_s);
  (void)cudaSetDevice(previous);  // best effort: the status that matters is st
  return st;
}

}  // namespace wprep
