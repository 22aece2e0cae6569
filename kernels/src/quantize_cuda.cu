// quantize_mxfp4 on the GPU.
//
// Rows of whole groups (Q a multiple of 32, the common case) take Group16Kernel: four lanes
// per group, each with 8 contiguous elements (16 bytes of bf16 or fp16, 32 of fp32), so a
// warp's loads are contiguous; the group's amax is two shuffles. For bf16 and fp16 the e2m1
// codes come from packed bf16x2 / half2 lines (below), a few instructions an element where
// the scalar encoder takes some 27; groups they cannot encode exactly (a NaN or inf, or a
// scale so extreme that a product would leave the type's normal range) fall back, group by
// group, to the scalar math. fp32 takes the scalar steps with the three-line code
// (EncodeE2m1Lines). Everything else (ragged Q, unaligned rows) takes one thread per group.
// The scalar math is quantize_math.h, shared with the CPU engine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// ---------------------------------------------------------------------------------------
// The packed encoder of 16-bit inputs (bf16 and fp16; Packed<D> below). With the scale
// exponent E in [kMinE, kMaxE], the multiplier 2^(127-E) is a normal number of the type and
// q = |x| * 2^(127-E) is exact wherever it is normal; where it is not (below the type's smallest
// normal, which is far below 0.25), the code is 0 however the hardware rounds or flushes it.
// The e2m1 grid is three lines: steps of 0.5 below 2, of 1 up to 4, of 2 above. So the code of
// |q| under round-to-nearest-even is
//   min(RN(2q), RN(q + 2), RN(q/2 + 4), 7),
// each line's ties falling on the even code as e2m1's do (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0,
// 5 -> 4.0; 0.75, 1.75 and 3.5 up), and RN being monotone, the min of the rounded lines is the
// rounded min. Each RN is one FMA of the type with kBias added (a power of two whose ulp is 1,
// so the sum rounds to the integers with ties to even and its last fraction bits are the
// code): two FMAs, an add and three mins a pair, where counting the seven thresholds took 7
// compares and 7 adds; the integer pipe, the quantizers' bottleneck, only packs the result.
// tests/kernels/internals_test.cc holds the identity for every non-negative finite bf16 and
// fp16 q.
template <QuantDtype D>
struct Packed;

template <>
struct Packed<QuantDtype::kBfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMinE = 8, kMaxE = 253;
  static constexpr uint32_t kBias = 0x4300u;  // 128.0; kBias + n is n's bits above it
  static constexpr uint32_t kTwo = 0x4000u, kHalf = 0x3F00u;
  // 2^(127 - e); for e = 0 (a zero group) 2^127, a finite multiplier of zeros.
  __device__ static uint32_t Multiplier(uint32_t e) { return (254u - e) << 7; }
  __device__ static uint32_t ScaleByte(uint32_t h, bool up) { return qmath::Bf16ScaleByte(h, up, kMinE, kMaxE); }
  __device__ static float ToFloat(uint16_t h) { return qmath::Bf16ToFloat(h); }
};

template <>
struct Packed<QuantDtype::kFloat16> {
  using T2 = __half2;
  static constexpr uint32_t kMinE = 112, kMaxE = 141;  // 2^(127 - E) in fp16's normals
  static constexpr uint32_t kBias = 0x6400u;  // 1024.0
  static constexpr uint32_t kTwo = 0x4000u, kHalf = 0x3800u;
  __device__ static uint32_t Multiplier(uint32_t e) { return e != 0 ? (142u - e) << 10 : 0u; }  // 0 for zeros
  __device__ static uint32_t ScaleByte(uint32_t h, bool up) { return qmath::Fp16ScaleByte(h, up, kMinE, kMaxE); }
  __device__ static float ToFloat(uint16_t h) { return qmath::Fp16ToFloat(h); }
};

__device__ __forceinline__ uint32_t Pair(uint32_t h) { return h | h << 16; }

template <class T2>
__device__ __forceinline__ T2 As2(uint32_t u) {
  return *reinterpret_cast<const T2*>(&u);
}
template <class T2>
__device__ __forceinline__ uint32_t Bits2(T2 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The e2m1 codes (no sign) of |x| * qs for the pair `w`: the low byte of each half (the
// high bytes hold the bias's bits).
template <QuantDtype D>
__device__ __forceinline__ uint32_t EncodePair(uint32_t w, uint32_t qs2) {
  using T2 = typename Packed<D>::T2;
  using P = Packed<D>;
  const T2 q = __hmul2(As2<T2>(w & 0x7FFF7FFFu), As2<T2>(qs2));
  const T2 fine = __hfma2(q, As2<T2>(Pair(P::kTwo)), As2<T2>(Pair(P::kBias)));  // RN(2q)
  const T2 unit = __hadd2(q, As2<T2>(Pair(P::kBias + 2)));                       // RN(q + 2)
  const T2 coarse = __hfma2(q, As2<T2>(Pair(P::kHalf)), As2<T2>(Pair(P::kBias + 4)));  // RN(q/2 + 4)
  const T2 code = __hmin2(__hmin2(fine, unit), __hmin2(coarse, As2<T2>(Pair(P::kBias + 7))));
  return Bits2(code);
}

template <QuantDtype D>
__device__ __forceinline__ uint32_t MaxNan(uint32_t a, uint32_t b) {
  using T2 = typename Packed<D>::T2;
  return Bits2(__hmax2_nan(As2<T2>(a), As2<T2>(b)));
}

// Where one group's outputs go. Canonical: values and scales flat ([rows, ceil(Q/2)] and
// [rows, ceil(Q/32)]). Blackwell pairs (FusedBlackwellGeometry): row r = (m, n) of the
// quantized rows goes to matrix m of the value tiling at BlackwellOffset, with the row's
// padding bytes [kp, kpad) written by its last group; scale (n, k) to its blackwell_scale
// place. The rows past N and the scale padding are PadKernel's.
struct GroupSink {
  uint32_t sq = 0;           // groups of a row
  FastDivisor div_sq;
  int64_t vrow = 0;          // canonical and blackwell_value: value bytes of a row
  bool blackwell = false;
  bool tiled = false;        // Blackwell shuffled tiles; else value rows of vrow bytes
  FastDivisor div_n;         // by N
  uint32_t n = 0;
  BlackwellTiling vt;
  int64_t v_mat = 0, s_mat = 0, kp = 0;
  BlackwellScaleTiling st;
  bool words = false;        // tile_k % 4 == 0: a lane's 4 value bytes stay in one tile

  __device__ __forceinline__ void Split(int64_t r, int64_t* m, uint32_t* col) const {
    *m = r < (int64_t{1} << 32) ? int64_t{div_n.Div(static_cast<uint32_t>(r))} : r / n;
    *col = static_cast<uint32_t>(r - *m * n);
  }
  __device__ __forceinline__ uint8_t* ValueAt(int64_t m, uint32_t col, int64_t byte, uint8_t* values) const {
    return values + m * v_mat + BlackwellOffset(vt, nullptr, col, byte);
  }
  // Bytes [byte, byte + count) of row r (count <= 16, within the row's kp bytes).
  __device__ __forceinline__ void Values(int64_t r, int64_t byte, const uint8_t* b, int count,
                                         uint8_t* values) const {
    if (!tiled) {
      uint8_t* dst = values + r * vrow + byte;
      if (count == 16 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(b);
      } else {
        for (int j = 0; j < count; ++j) dst[j] = b[j];
      }
      return;
    }
    int64_t m;
    uint32_t col;
    Split(r, &m, &col);
    for (int j = 0; j < count; ++j) *ValueAt(m, col, byte + j, values) = b[j];
  }
  // A lane's word: value bytes 16k + 4sub .. +3 of row r (whole groups; values 4-aligned).
  __device__ __forceinline__ void Word(int64_t r, uint32_t k, uint32_t sub, uint32_t w, uint8_t* values) const {
    const int64_t byte = 16 * int64_t{k} + 4 * sub;
    if (!tiled) {
      *reinterpret_cast<uint32_t*>(values + r * vrow + byte) = w;
    } else if (words) {
      int64_t m;
      uint32_t col;
      Split(r, &m, &col);
      *reinterpret_cast<uint32_t*>(ValueAt(m, col, byte, values)) = w;
    } else {
      const uint8_t b[4] = {static_cast<uint8_t>(w), static_cast<uint8_t>(w >> 8), static_cast<uint8_t>(w >> 16),
                            static_cast<uint8_t>(w >> 24)};
      Values(r, byte, b, 4, values);
    }
  }
  __device__ __forceinline__ void Scale(int64_t r, uint32_t k, uint8_t byte, uint8_t* scales) const {
    if (!blackwell) {
      scales[r * sq + k] = byte;
      return;
    }
    int64_t m;
    uint32_t col;
    Split(r, &m, &col);
    scales[m * s_mat + BlackwellScaleOffset(st, k, col)] = byte;
  }
  // Where row r's groups go, found once a row: its value bytes (canonical and blackwell_value:
  // the row; shuffled tiles: the row's place in tile kt = 0, tile_k bytes of a tile further
  // for each kt) and its scale bytes (canonical: the row; Blackwell: group k's byte is
  // at (k / 4) * 512 + k % 4 from the row's).
  struct RowPlace {
    uint8_t* v;
    uint8_t* s;
  };
  __device__ __forceinline__ RowPlace Place(int64_t r, uint8_t* values, uint8_t* scales) const {
    if (!blackwell) return {values + r * vrow, scales + r * sq};
    int64_t m;
    uint32_t col;
    Split(r, &m, &col);
    uint8_t* s = scales + m * s_mat + BlackwellScaleOffset(st, 0, col);
    if (!tiled) return {values + r * vrow, s};
    return {values + m * v_mat + BlackwellOffset(vt, nullptr, col, 0), s};
  }
  // A lane's word (value bytes 16k + 4sub .. +3) and a group's scale byte at a row's place.
  __device__ __forceinline__ void WordAt(const RowPlace& p, int64_t r, uint32_t k, uint32_t sub, uint32_t w,
                                         uint8_t* values) const {
    const uint32_t byte = 16 * k + 4 * sub;
    if (!tiled) {
      *reinterpret_cast<uint32_t*>(p.v + byte) = w;
    } else if (words) {
      // Tiles along K are ntn * tile_n * tile_k bytes apart; a row's bytes in one are contiguous.
      const uint32_t kt = vt.div_k.Div(byte);
      *reinterpret_cast<uint32_t*>(p.v + kt * (vt.ntn * vt.tile_n * vt.tile_k) + (byte - kt * vt.tile_k)) = w;
    } else {
      Word(r, k, sub, w, values);
    }
  }
  __device__ __forceinline__ void ScaleAt(const RowPlace& p, uint32_t k, uint8_t byte) const {
    p.s[blackwell ? (k >> 2) * kBlackwellScaleBlock + (k & 3) : k] = byte;
  }
  // Row r's padding (Blackwell only), lane `lane` of `lanes`: its value bytes [kp, kpad) (a
  // word a lane where the tiles allow it) and its scale bytes k in [ceil(K/32), Kp).
  __device__ __forceinline__ void PadRow(int64_t r, int lane, int lanes, uint8_t* values, uint8_t* scales) const {
    if (!blackwell) return;
    int64_t m;
    uint32_t col;
    Split(r, &m, &col);
    for (int64_t k = sq + lane; k < st.kpad; k += lanes) scales[m * s_mat + BlackwellScaleOffset(st, k, col)] = 0;
    if (!tiled) {
      uint8_t* row = values + r * vrow;
      if (kp % 4 == 0 && (reinterpret_cast<uintptr_t>(row) & 3) == 0) {
        for (int64_t b = kp + 4 * lane; b < vrow; b += 4 * lanes) *reinterpret_cast<uint32_t*>(row + b) = 0;
      } else {
        for (int64_t b = kp + lane; b < vrow; b += lanes) row[b] = 0;
      }
      return;
    }
    if (words && kp % 4 == 0) {
      for (int64_t b = kp + 4 * lane; b < vt.kpad; b += 4 * lanes) {
        *reinterpret_cast<uint32_t*>(ValueAt(m, col, b, values)) = 0;
      }
    } else {
      for (int64_t b = kp + lane; b < vt.kpad; b += lanes) *ValueAt(m, col, b, values) = 0;
    }
  }
};

// The CPU engine's steps for one lane's 8 elements (element i is element(i)) of a group that
// four lanes (`group_lanes`) quantize: amax (maxnum) over the lanes, the scale exponent bits
// (set in *e_out, not shifted) and the lane's 8 codes (code i in bits 4i..4i+3), from
// EncodeE2m1 or, with kLines, its three-line form.
template <bool kLines, typename Element>
__device__ __forceinline__ uint32_t ScalarLaneCodes(Element element, uint32_t group_lanes, bool up, uint32_t* e_out) {
  float x[8];
  float a = 0.0f;
  WPREP_UNROLL
  for (int i = 0; i < 8; ++i) {
    x[i] = element(i);
    a = qmath::AbsMaxNum(a, x[i]);
  }
  a = fmaxf(a, __shfl_xor_sync(group_lanes, a, 1));
  a = fmaxf(a, __shfl_xor_sync(group_lanes, a, 2));
  const uint32_t e = qmath::ScaleBits(a, up);
  const float qs = qmath::ScaleMultiplier(e);
  uint32_t out = 0;
  WPREP_UNROLL
  for (int i = 0; i < 8; ++i) {
    out |= (kLines ? qmath::EncodeE2m1Lines(x[i] * qs) : qmath::EncodeE2m1(x[i] * qs)) << (4 * i);
  }
  *e_out = e;
  return out;
}

// One lane's share of a 16-bit group quantized by four lanes (`group_lanes`, the mask of
// lanes 4j..4j+3): `raw` is its 8 elements as pairs (zeros past the group's end encode as
// zeros). Returns the lane's 8 codes (code i in bits 4i..4i+3) and sets *e to the group's
// scale exponent bits (not shifted). The packed encoder where the scale allows it, else, for
// the whole group, the scalar math of the CPU engine (amax ignores NaNs: maxnum).
// kWarpAll: every lane of the warp calls it together, so the amax shuffles name the whole
// warp (a four-lane mask costs a convergence check a shuffle); the scalar fallback, taken
// group by group, keeps the group's mask either way.
template <QuantDtype D, bool kWarpAll = false>
__device__ __forceinline__ uint32_t LaneCodes(const uint4& raw, uint32_t group_lanes, bool up, uint32_t* e_out) {
  constexpr uint32_t kAll = 0xFFFFFFFFu;
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t m = MaxNan<D>(MaxNan<D>(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu),
                         MaxNan<D>(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
  m = MaxNan<D>(m, __shfl_xor_sync(kWarpAll ? kAll : group_lanes, m, 1));
  m = MaxNan<D>(m, __shfl_xor_sync(kWarpAll ? kAll : group_lanes, m, 2));
  m = MaxNan<D>(m, m >> 16);
  const uint32_t eb = Packed<D>::ScaleByte(m & 0xFFFFu, up);  // no float division
  uint32_t e = eb << 23;
  uint32_t out = 0;
  // A group of zeros (the layouts' padding among them) takes the packed encoder too: its scale
  // is ScaleBits(0) = 0, and with any finite multiplier its codes are the elements' signs.
  if (eb != 0 || (m & 0xFFFFu) == 0) {
    const uint32_t qs2 = Pair(Packed<D>::Multiplier(eb));
    // Byte moves (PRMT) instead of shifts and masks: each half's four codes as bytes, the
    // signs (bit 7 of the elements' high bytes) moved to bit 3, then byte pairs folded into
    // nibbles (byte 2i+1's code into byte 2i's high nibble) and the folded bytes gathered.
    uint32_t half[2];
    WPREP_UNROLL
    for (int h = 0; h < 2; ++h) {
      const uint32_t codes = __byte_perm(EncodePair<D>(w[2 * h], qs2), EncodePair<D>(w[2 * h + 1], qs2), 0x6420u);
      const uint32_t signs = __byte_perm(w[2 * h], w[2 * h + 1], 0x7531u);
      const uint32_t b = codes | ((signs >> 4) & 0x08080808u);
      half[h] = b | (b >> 4);
    }
    out = __byte_perm(half[0], half[1], 0x6420u);
  } else {
    auto element = [&](int i) { return Packed<D>::ToFloat(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)))); };
    out = ScalarLaneCodes<false>(element, group_lanes, up, &e);
  }
  *e_out = e;
  return out;
}

// A lane's 8 elements of a group as 16-byte words: one for the 16-bit types, two for fp32.
template <QuantDtype D>
struct LaneRaw {
  static constexpr int kWords = D == QuantDtype::kFloat32 ? 2 : 1;
  uint4 w[kWords];
};

// Lane `sub`'s words of group g of a tensor whose rows are whole groups (in 16-byte aligned).
template <QuantDtype D>
__device__ __forceinline__ LaneRaw<D> LoadLane(const uint4* __restrict__ in, int64_t g, uint32_t sub) {
  LaneRaw<D> r;
  WPREP_UNROLL
  for (int i = 0; i < LaneRaw<D>::kWords; ++i) r.w[i] = in[(g * 4 + sub) * LaneRaw<D>::kWords + i];
  return r;
}

// LaneCodes for every input type: the 16-bit types take the packed encoder; fp32 takes the
// steps of the CPU engine with the code from EncodeE2m1Lines (equal to EncodeE2m1, in fewer
// instructions).
template <QuantDtype D>
__device__ __forceinline__ uint32_t LaneCodesOf(const LaneRaw<D>& raw, uint32_t group_lanes, bool up,
                                                uint32_t* e_out) {
  if constexpr (D != QuantDtype::kFloat32) {
    return LaneCodes<D, true>(raw.w[0], group_lanes, up, e_out);  // its callers: every lane
  } else {
    const uint32_t b[8] = {raw.w[0].x, raw.w[0].y, raw.w[0].z, raw.w[0].w,
                           raw.w[1].x, raw.w[1].y, raw.w[1].z, raw.w[1].w};
    return ScalarLaneCodes<true>([&](int i) { return __uint_as_float(b[i]); }, group_lanes, up, e_out);
  }
}

// A 16-bit lane's 8 elements at src, `valid` of them (zeros past), as pairs: one 16-byte
// load where it can.
__device__ __forceinline__ uint4 LaneLoad16(const uint8_t* src, int valid) {
  if (valid == 8 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) return __ldg(reinterpret_cast<const uint4*>(src));
  uint32_t w[4] = {0, 0, 0, 0};
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  for (int i = 0; i < valid; ++i) w[i / 2] |= static_cast<uint32_t>(__ldg(h + i)) << (16 * (i % 2));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Groups [0, groups) of a tensor whose rows are whole groups; in is 16-byte aligned,
// values 4-byte aligned, groups < 2^31. Each warp takes 32 consecutive groups at a time.
// kMode: the sink's destinations, a template argument so that each kernel carries only its
// own registers: 0 canonical, 1 blackwell_value rows, 2 shuffled Blackwell tiles.
template <QuantDtype D, int kMode>
__global__ void __launch_bounds__(256, 4) Group16Kernel(const uint4* __restrict__ in, uint8_t* __restrict__ values,
                                                          uint8_t* __restrict__ scales, uint32_t groups, bool up,
                                                          GroupSink sink) {
  sink.blackwell = kMode != 0;
  sink.tiled = kMode == 2;
  const uint32_t lane = threadIdx.x & 31, sub = lane & 3;
  const uint32_t group_lanes = 0xFu << (lane & ~3u);
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  for (uint32_t base = warp * 32; base < groups; base += warps * 32) {
    LaneRaw<D> raw[4];
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) {
      const uint32_t g = base + 8 * u + (lane >> 2);
      raw[u] = g < groups ? LoadLane<D>(in, g, sub) : LaneRaw<D>{};
    }
    // The lane's group of step 0, its row and place; each step moves on by 8 groups, and the
    // place is found again only where that crosses into another row.
    uint32_t g = base + (lane >> 2);
    uint32_t r = sink.div_sq.Div(g), k = g - r * sink.sq;
    typename GroupSink::RowPlace place = sink.Place(r, values, scales);
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) {
      if (u > 0) {
        g += 8;
        k += 8;
        if (k >= sink.sq) {
          do {
            k -= sink.sq;
            ++r;
          } while (k >= sink.sq);
          place = sink.Place(r, values, scales);
        }
      }
      uint32_t e = 0;
      const uint32_t out = LaneCodesOf<D>(raw[u], group_lanes, up, &e);  // every lane: the shuffles
      if (g >= groups) continue;  // all four lanes of a group agree
      sink.WordAt(place, r, k, sub, out, values);
      if (sub == 0) sink.ScaleAt(place, k, static_cast<uint8_t>(e >> 23));
      if (k == sink.sq - 1) sink.PadRow(r, static_cast<int>(sub), 4, values, scales);
    }
  }
}

// The Blackwell sinks (kMode 1, 2) of rows of 32 groups or more: each warp takes a chunk of
// 32 groups of one row (a row's last chunk may be shorter), `chunks` a row, so it finds the
// row's destinations once, and the warp of a row's last chunk writes the row's padding with
// all its lanes. Where a row's groups are not a multiple of 32, the flat runs of
// Group16Kernel cross rows every few lanes, and every crossing finds a row's places again
// (divisions and tile offsets) and writes its padding with four lanes while the warp waits.
template <QuantDtype D, int kMode>
__global__ void __launch_bounds__(256, 4) RowChunk16Kernel(const uint4* __restrict__ in, uint8_t* __restrict__ values,
                                                             uint8_t* __restrict__ scales, uint32_t units,
                                                             uint32_t chunks, FastDivisor div_chunks, bool up,
                                                             GroupSink sink) {
  sink.blackwell = true;
  sink.tiled = kMode == 2;
  const uint32_t lane = threadIdx.x & 31, sub = lane & 3;
  const uint32_t group_lanes = 0xFu << (lane & ~3u);
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  for (uint32_t unit = warp; unit < units; unit += warps) {
    const uint32_t r = div_chunks.Div(unit), c = unit - r * chunks;
    const uint32_t k0 = 32 * c + (lane >> 2);
    const int64_t g0 = int64_t{r} * sink.sq + k0;
    LaneRaw<D> raw[4];
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) raw[u] = k0 + 8 * u < sink.sq ? LoadLane<D>(in, g0 + 8 * u, sub) : LaneRaw<D>{};
    const typename GroupSink::RowPlace place = sink.Place(r, values, scales);
    WPREP_UNROLL
    for (int u = 0; u < 4; ++u) {
      const uint32_t k = k0 + 8 * u;
      uint32_t e = 0;
      const uint32_t out = LaneCodesOf<D>(raw[u], group_lanes, up, &e);  // every lane: the shuffles
      if (k >= sink.sq) continue;  // all four lanes of a group agree
      sink.WordAt(place, r, k, sub, out, values);
      if (sub == 0) sink.ScaleAt(place, k, static_cast<uint8_t>(e >> 23));
    }
    if (c == chunks - 1) sink.PadRow(r, static_cast<int>(lane), 32, values, scales);
  }
}

// Everything Group16Kernel does not take (ragged rows, unaligned buffers): one
// thread a group, the scalar math.
template <QuantDtype D>
__global__ void QuantizeKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ values,
                               uint8_t* __restrict__ scales, int64_t rows, int64_t q, bool up, GroupSink sink) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  const int64_t sq = sink.sq;
  const int64_t total = rows * sq;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / sq, g = t - r * sq;
    const int64_t begin = g * qmath::kGroup;
    const int n = q - begin < qmath::kGroup ? static_cast<int>(q - begin) : qmath::kGroup;
    const uint8_t* src = in + (r * q + begin) * kEsize;
    float x[qmath::kGroup];
    if (n == qmath::kGroup && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      // A whole aligned group: 16-byte loads, all in flight, then the same conversion.
      uint4 raw[qmath::kGroup * kEsize / 16];
      WPREP_UNROLL
      for (int k = 0; k < qmath::kGroup * kEsize / 16; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(src) + k);
      const auto* b = reinterpret_cast<const uint8_t*>(raw);
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
    const float qs = qmath::ScaleMultiplier(e);
    alignas(16) uint8_t out[qmath::kGroup / 2];
    WPREP_UNROLL
    for (int j = 0; j < qmath::kGroup / 2; ++j) {
      const uint32_t lo = 2 * j < n ? qmath::EncodeE2m1(x[2 * j] * qs) : 0u;
      const uint32_t hi = 2 * j + 1 < n ? qmath::EncodeE2m1(x[2 * j + 1] * qs) : 0u;
      out[j] = static_cast<uint8_t>(lo | hi << 4);
    }
    sink.Values(r, begin / 2, out, (n + 1) / 2, values);
    sink.Scale(r, static_cast<uint32_t>(g), static_cast<uint8_t>(e >> 23), scales);
    if (g == sq - 1) sink.PadRow(r, 0, 1, values, scales);
  }
}

// The trtllm values and scales of bf16 or fp16 weights, straight from the groups (no tile, no shared
// memory), a warp an output row at a time: the row's source row (the prepare's row map) and
// its places are found once, then the warp walks the row's cols_p groups (a multiple of 4),
// 32 at a time, four lanes a group, loads of 4 groups a lane in flight. Groups past K/32, and
// rows the map leaves empty, are zeros. Each lane stores its value word in place, and the
// first lane of each 4 groups their 4 scale bytes, one word of the 128x4 layout. in 16-byte
// aligned, values and scales 4-byte aligned.
template <QuantDtype D>
__global__ void __launch_bounds__(256) Trtllm16Kernel(const uint4* __restrict__ in, uint8_t* __restrict__ values,
                                                        uint8_t* __restrict__ scales, moe::RowsPass vp,
                                                        uint32_t cols_p, uint32_t sq, bool up) {
  constexpr int kSteps = 4;  // loads of a lane in flight: 4 groups of the row a step
  const uint32_t lane = threadIdx.x & 31, sub = lane & 3, j = lane >> 2;
  const uint32_t group_lanes = 0xFu << (lane & ~3u);
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t rows = vp.experts * vp.rows_out, k16 = int64_t{sq} * 4;  // 16-byte units of a weight row
  for (int64_t row = warp; row < rows; row += warps) {
    const int64_t e = moe::Div(row, vp.rows_out), n = row - e * vp.rows_out;
    const int64_t src = moe::SrcRow(vp.map, n);
    const uint4* srow = in + (src < 0 ? 0 : (e * vp.rows_in + src) * k16);
    const uint32_t groups = src < 0 ? 0u : sq;  // groups read from the source row
    uint8_t* vrow = values + row * vp.out_row_bytes;
    uint8_t* srow_scales = scales + e * vp.rows_out * cols_p + moe::SfOffset(n, 0, cols_p);
    if (src < 0) {  // a padding row: zeros, nothing to quantize
      for (uint32_t w = lane; w < 4 * cols_p; w += 32) reinterpret_cast<uint32_t*>(vrow)[w] = 0;
      for (uint32_t q = lane; q < cols_p / 4; q += 32) *reinterpret_cast<uint32_t*>(srow_scales + q * 512) = 0;
      continue;
    }
    for (uint32_t c0 = 0; c0 < cols_p; c0 += 8 * kSteps) {
      uint4 raw[kSteps];
      WPREP_UNROLL
      for (int u = 0; u < kSteps; ++u) {
        const uint32_t c = c0 + 8 * u + j;
        raw[u] = c < groups ? srow[4 * c + sub] : make_uint4(0, 0, 0, 0);
      }
      WPREP_UNROLL
      for (int u = 0; u < kSteps; ++u) {
        if (c0 + 8 * u >= cols_p) break;  // the same for the whole warp
        const uint32_t c = c0 + 8 * u + j;
        uint32_t eb = 0;
        const uint32_t word = LaneCodes<D>(raw[u], group_lanes, up, &eb);  // every lane: the shuffles
        const uint32_t sb = c < groups ? eb >> 23 : 0u;
        const uint32_t quad = sb | __shfl_down_sync(0xFFFFFFFFu, sb, 4) << 8 |
                              __shfl_down_sync(0xFFFFFFFFu, sb, 8) << 16 | __shfl_down_sync(0xFFFFFFFFu, sb, 12) << 24;
        if (c >= cols_p) continue;
        *reinterpret_cast<uint32_t*>(vrow + 16 * c + 4 * sub) = c < groups ? word : 0u;
        if ((lane & 15) == 0) *reinterpret_cast<uint32_t*>(srow_scales + (c / 4) * 512) = quad;  // c % 4 == 0
      }
    }
  }
}

// The Blackwell pairs' padding no group writes: the rows past N of the last row of value
// tiles (a run of `pad_rows` x tile_k bytes in each (m, kt), stored in `unit`-byte pieces) and
// the blackwell_scale columns n in [N, Np) (every k of them). The groups write the rest.
__global__ void PadKernel(uint8_t* __restrict__ values, uint8_t* __restrict__ scales, GroupSink sink,
                          int64_t mats, int64_t pad_rows, int unit) {
  const BlackwellTiling& t = sink.vt;
  const int64_t run = pad_rows * t.tile_k / unit, runs = mats * t.ntk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < runs * run; i += stride) {
    const int64_t mk = i / run, j = i - mk * run;
    const int64_t m = mk / t.ntk, kt = mk - m * t.ntk;
    uint8_t* dst = values + m * sink.v_mat + ((kt * t.ntn + t.ntn - 1) * t.tile_n + (t.tile_n - pad_rows)) * t.tile_k +
                   j * unit;
    if (unit == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    } else if (unit == 4) {
      *reinterpret_cast<uint32_t*>(dst) = 0;
    } else {
      *dst = 0;
    }
  }
  const BlackwellScaleTiling& st = sink.st;
  const int64_t cols = st.npad - st.n, per_mat = cols * st.kpad;
  for (int64_t i = first; i < mats * per_mat; i += stride) {
    const int64_t m = i / per_mat, j = i - m * per_mat;
    const int64_t col = st.n + j / st.kpad, k = j - (j / st.kpad) * st.kpad;
    scales[m * sink.s_mat + BlackwellScaleOffset(st, k, col)] = 0;
  }
}

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

// Words w[0..count) at dst + i * stride (stride a multiple of 4): word stores where dst is
// 4-byte aligned, bytes where a caller's buffer sits at an odd offset; the same result.
__device__ __forceinline__ void StoreWords(uint8_t* dst, const uint32_t* w, int count, int stride) {
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) & 3) == 0;
  WPREP_UNROLL
  for (int i = 0; i < count; ++i) {
    if (aligned) {
      *reinterpret_cast<uint32_t*>(dst + i * stride) = w[i];
    } else {
      for (int b = 0; b < 4; ++b) dst[i * stride + b] = static_cast<uint8_t>(w[i] >> (8 * b));
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
// lane), then writes the tile's 16 O rows x 256 bytes of hopper_value (64 HopperPackBlock
// blocks, 4 threads each, from whole Q words) and its 256 scale bytes (a word a thread:
// two rows and two groups). Tiles past N or K write the layouts' zero padding.
constexpr int kHopperTileRows = kFusedHopperTileRows;
constexpr int kHopperTileBytes = kFusedHopperTileBytes;  // Q columns: 4 groups
constexpr int kHopperTilePitch = kHopperTileBytes / 4 + 1;  // words; +1 spreads the banks

template <QuantDtype D>
__global__ void __launch_bounds__(256, 5) HopperFusedKernel(const uint8_t* __restrict__ in,
                                                         uint8_t* __restrict__ values,
                                                         uint8_t* __restrict__ scales,
                                                         FusedHopperGeometry g, bool up) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  __shared__ uint32_t q[kHopperTileRows * kHopperTilePitch];
  __shared__ uint8_t s[kHopperTileRows * 4];
  const int sub = threadIdx.x & 3;
  const uint32_t group_lanes = 0xFu << (threadIdx.x & 28);  // every lane takes part in every pass
  const int64_t total = g.mats * g.tiles_per_mat;
  const bool vec_values = (reinterpret_cast<uintptr_t>(values) & 15) == 0;  // O rows are 128-byte multiples
  // Rows of whole 16-byte lanes (the 16-bit types): the input 16-byte aligned, a row a multiple of 16 bytes.
  [[maybe_unused]] const bool aligned_rows = (reinterpret_cast<uintptr_t>(in) & 15) == 0 && (g.k * kEsize) % 16 == 0;
  const auto tiles_per_mat = static_cast<uint32_t>(g.tiles_per_mat), tile_cols = static_cast<uint32_t>(g.tile_cols);
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    // Tile indices fit 32 bits (FusedHopperGeometryOf): 32-bit divisions, not 64-bit ones.
    const uint32_t t32 = static_cast<uint32_t>(t), e32 = t32 / tiles_per_mat;
    const uint32_t rest = t32 - e32 * tiles_per_mat, tr = rest / tile_cols;
    const int64_t e = e32, row0 = int64_t{tr} * kHopperTileRows;
    const int64_t c0 = int64_t{rest - tr * tile_cols} * kHopperTileBytes;
    // 1. Quantize: pass p takes groups 64p .. 64p+63 of the tile (row 16p + i/4, group i%4).
    auto lane_of = [&](int p, int* lr, int* j, int* valid) -> const uint8_t* {
      const int tg = 64 * p + (threadIdx.x >> 2);
      *lr = tg >> 2;
      *j = tg & 3;
      const int64_t n = row0 + *lr, grp = c0 / 16 + *j;
      const int64_t k0 = grp * 32 + 8 * sub;  // this lane's first element
      *valid = n < g.n && grp < g.sq ? (g.k - k0 >= 8 ? 8 : (g.k - k0 > 0 ? static_cast<int>(g.k - k0) : 0)) : -1;
      return in + ((e * g.n + n) * g.k + k0) * kEsize;
    };
    if constexpr (D != QuantDtype::kFloat32) {  // all loads in flight, then the packed encoder
      uint4 raw[4];
      // A tile inside the rows and whole groups of K (all but a matrix's edges) takes straight
      // 16-byte loads, 16 rows apart from pass to pass, with no bounds to check. The branch is
      // the same for the whole block, and every lane quantizes in either, so the amax shuffles
      // name the whole warp.
      if (aligned_rows && row0 + kHopperTileRows <= g.n && (c0 / 16 + 4) * qmath::kGroup <= g.k) {
        const int lr = threadIdx.x >> 4, j = (threadIdx.x >> 2) & 3;  // pass p: row lr + 16p
        const int64_t k0 = (c0 / 16 + j) * qmath::kGroup + 8 * sub;
        const auto* src = reinterpret_cast<const uint4*>(in + ((e * g.n + row0 + lr) * g.k + k0) * kEsize);
        const int64_t pass_step = g.k * kEsize;  // 16 rows, in 16-byte words
        WPREP_UNROLL
        for (int p = 0; p < 4; ++p) raw[p] = __ldg(src + p * pass_step);
        WPREP_UNROLL
        for (int p = 0; p < 4; ++p) {
          uint32_t eb = 0;
          const uint32_t word = LaneCodes<D, true>(raw[p], group_lanes, up, &eb);
          q[(lr + 16 * p) * kHopperTilePitch + 4 * j + sub] = word;
          if (sub == 0) s[(lr + 16 * p) * 4 + j] = static_cast<uint8_t>(eb >> 23);
        }
      } else {
        WPREP_UNROLL
        for (int p = 0; p < 4; ++p) {
          int lr, j, valid;
          const uint8_t* src = lane_of(p, &lr, &j, &valid);
          raw[p] = valid > 0 ? LaneLoad16(src, valid) : make_uint4(0, 0, 0, 0);
        }
        WPREP_UNROLL
        for (int p = 0; p < 4; ++p) {
          int lr, j, valid;
          lane_of(p, &lr, &j, &valid);
          uint32_t eb = 0;
          const uint32_t word = LaneCodes<D, true>(raw[p], group_lanes, up, &eb);
          q[lr * kHopperTilePitch + 4 * j + sub] = valid >= 0 ? word : 0u;
          if (sub == 0) s[lr * 4 + j] = valid >= 0 ? static_cast<uint8_t>(eb >> 23) : 0;
        }
      }
    } else {
      for (int p = 0; p < 4; ++p) {
        int lr, j, valid;
        const uint8_t* src = lane_of(p, &lr, &j, &valid);
        uint32_t word = 0, sbyte = 0;
        QuantizeLaneOf8<D>(src, valid > 0 ? valid : 0, valid >= 0, up, &word, &sbyte);
        q[lr * kHopperTilePitch + 4 * j + sub] = word;
        if (sub == 0) s[lr * 4 + j] = static_cast<uint8_t>(sbyte);
      }
    }
    __syncthreads();
    // 2. Values: O rows row0/4 .. +16, bytes 4*c0 .. +256: 16 rows of 4 HopperPackBlock
    // blocks, each packed by 4 threads (a quarter each) from words of the tile. A warp's 8
    // blocks are 2 O rows' 256 contiguous bytes.
    if (row0 < g.vt.rows_pad && c0 < g.vt.cols_pad) {
      const int blk = threadIdx.x >> 2, quarter = threadIdx.x & 3;
      const int orl = blk >> 2, bl = blk & 3;  // bl = 2 * cr + s0
      const int lr0 = 16 * (orl >> 2) + 2 * (orl & 3) + (bl & 1);
      const uint32_t* q0 = q + lr0 * kHopperTilePitch + 8 * (bl >> 1);
      const uint32_t* q1 = q0 + 8 * kHopperTilePitch;
      uint8_t* dst = values + e * g.v_mat_bytes + (row0 / 4 + orl) * g.vt.out_cols + 4 * c0 + 64 * bl;
      uint32_t o[4];
      if (g.mma_version == 2) {  // o: block words 4q .. 4q+3
        HopperPackQuarter<2>(q0, q1, quarter, o);
        dst += 16 * quarter;
        if (vec_values) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
        } else {
          StoreWords(dst, o, 4, 4);
        }
      } else {  // o[t]: block word 4t + q
        HopperPackQuarter<3>(q0, q1, quarter, o);
        StoreWords(dst + 4 * quarter, o, 4, 16);
      }
    }
    // 3. Scales: the tile's S rows row0 .. +63, groups c0/16 .. +3. A 16-row run and a pair
    // of groups is 32 contiguous bytes of one hopper_scale row: a word a thread, bytes
    // S[c, 2p], S[c + 8, 2p], S[c, 2p + 1], S[c + 8, 2p + 1] of its run.
    if (threadIdx.x < 64) {
      const int run = threadIdx.x >> 4, pair = (threadIdx.x >> 3) & 1, c = threadIdx.x & 7;
      const int64_t r = row0 + 16 * run, col = c0 / 16 + 2 * pair;  // col even, cols_pad even
      if (r < g.st.rows_pad && col < g.st.cols_pad) {
        const uint8_t* sr = s + (16 * run + c) * 4 + 2 * pair;
        const uint32_t word = sr[0] | uint32_t{sr[32]} << 8 | uint32_t{sr[1]} << 16 | uint32_t{sr[33]} << 24;
        uint8_t* dst = scales + e * g.s_mat_bytes + HopperScaleOffset(g.st, r, col) + 4 * c;
        StoreWords(dst, &word, 1, 4);
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
  const uint32_t group_lanes = 0xFu << (threadIdx.x & 28);
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
    constexpr int kPasses = kRows * kGroups / 64;
    auto lane_of = [&](int p, int* lr, int* j, bool* live) -> const uint8_t* {
      const int tg = 64 * p + (threadIdx.x >> 2);
      *lr = tg >> 2;
      *j = tg & 3;
      const int64_t grp = kGroups * cg + *j;
      const int64_t base = src_row[*lr];
      *live = base >= 0 && grp < sq;
      return *live ? in + (base + grp * qmath::kGroup + 8 * sub) * kEsize : in;
    };
    auto keep = [&](int lr, int j, uint32_t word, uint32_t sbyte) {
      q[lr * kPitch + 4 * j + sub] = word;
      if (sub == 0 && sbyte != 0) atomicOr(&s[lr], sbyte << (8 * j));
    };
    if constexpr (D != QuantDtype::kFloat32) {  // all loads in flight, then the packed encoder
      uint4 raw[kPasses];
      WPREP_UNROLL
      for (int p = 0; p < kPasses; ++p) {
        int lr, j;
        bool live;
        const uint8_t* src = lane_of(p, &lr, &j, &live);
        raw[p] = live ? LaneLoad16(src, 8) : make_uint4(0, 0, 0, 0);
      }
      WPREP_UNROLL
      for (int p = 0; p < kPasses; ++p) {
        int lr, j;
        bool live;
        lane_of(p, &lr, &j, &live);
        uint32_t eb = 0;
        const uint32_t word = LaneCodes<D>(raw[p], group_lanes, up, &eb);
        keep(lr, j, live ? word : 0u, live ? eb >> 23 : 0u);
      }
    } else {
      for (int p = 0; p < kPasses; ++p) {
        int lr, j;
        bool live;
        const uint8_t* src = lane_of(p, &lr, &j, &live);
        uint32_t word = 0, sbyte = 0;
        QuantizeLaneOf8<D>(src, live ? 8 : 0, live, up, &word, &sbyte);
        keep(lr, j, word, sbyte);
      }
    }
    __syncthreads();
    // 2. Values: 128 rows x 16 words at bytes 64 * cg of each row.
    for (int w = threadIdx.x; w < kRows * 16; w += 256) {
      const int r = w >> 4, c = w & 15;
      uint8_t* dst = values + (e * vp.rows_out + kRows * mt + r) * vp.out_row_bytes + 64 * cg + 4 * c;
      StoreWords(dst, &q[r * kPitch + c], 1, 4);
    }
    // 3. Scales: the block's 512 bytes, word i of 16-byte unit u = row u + 32 i.
    uint8_t* block = scales + e * vp.rows_out * cols_p + mt * (cols_p / 4) * 512 + cg * 512;
    for (int w = threadIdx.x; w < kRows; w += 256) {
      StoreWords(block + 4 * w, &s[(w >> 2) + 32 * (w & 3)], 1, 4);
    }
    __syncthreads();
  }
}

unsigned Blocks(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<unsigned>(b < (1 << 30) ? b : (1 << 30));
}

// Group16Kernel of the sink's mode (8 warps of 32 groups a block); the Blackwell sinks of
// rows of 32 groups or more take RowChunk16Kernel (8 warps of a row's chunk a block).
template <QuantDtype D>
void LaunchGroup16(unsigned blocks, CudaStream stream, const uint4* in, uint8_t* v, uint8_t* s, uint32_t groups, bool up,
                   const GroupSink& sink) {
  if (sink.blackwell && sink.sq >= 32) {
    const uint32_t chunks = (sink.sq + 31) / 32;
    const uint32_t units = groups / sink.sq * chunks;  // < 2^31: at most 2 * groups / 32
    const unsigned b = Blocks(units, 8);
    if (sink.tiled) {
      RowChunk16Kernel<D, 2><<<b, 256, 0, stream>>>(in, v, s, units, chunks, FastDivisor(chunks), up, sink);
    } else {
      RowChunk16Kernel<D, 1><<<b, 256, 0, stream>>>(in, v, s, units, chunks, FastDivisor(chunks), up, sink);
    }
    return;
  }
  if (sink.tiled) {
    Group16Kernel<D, 2><<<blocks, 256, 0, stream>>>(in, v, s, groups, up, sink);
  } else if (sink.blackwell) {
    Group16Kernel<D, 1><<<blocks, 256, 0, stream>>>(in, v, s, groups, up, sink);
  } else {
    Group16Kernel<D, 0><<<blocks, 256, 0, stream>>>(in, v, s, groups, up, sink);
  }
}

// Whether Group16Kernel serves this tensor (rows of whole groups, aligned, 32-bit group indices).
bool Group16Fits(const QuantizePlan& plan, const void* in, const void* values) {
  const int64_t sq = plan.q / qmath::kGroup;
  return plan.q % qmath::kGroup == 0 && plan.rows * sq < (int64_t{1} << 31) &&
         (reinterpret_cast<uintptr_t>(in) & 15) == 0 && (reinterpret_cast<uintptr_t>(values) & 3) == 0;
}

// Every group of `plan` into `sink`: Group16Kernel where it fits, else QuantizeKernel.
void LaunchGroups(const QuantizePlan& plan, const void* in, void* values, void* scales, const GroupSink& sink,
                  CudaStream stream) {
  constexpr int kThreads = 256;
  const bool up = plan.rounding == ScaleRounding::kUp;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  const int64_t groups = plan.rows * sink.sq;
  if (Group16Fits(plan, in, values)) {  // 8 warps of 32 groups a block
    const unsigned blocks = Blocks(groups, kThreads);
    const auto* in4 = static_cast<const uint4*>(in);
    const auto n = static_cast<uint32_t>(groups);
    switch (plan.dtype) {
      case QuantDtype::kBfloat16:
        LaunchGroup16<QuantDtype::kBfloat16>(blocks, stream, in4, v, s, n, up, sink);
        break;
      case QuantDtype::kFloat16:
        LaunchGroup16<QuantDtype::kFloat16>(blocks, stream, in4, v, s, n, up, sink);
        break;
      case QuantDtype::kFloat32:
        LaunchGroup16<QuantDtype::kFloat32>(blocks, stream, in4, v, s, n, up, sink);
        break;
    }
    return;
  }
  const unsigned blocks = Blocks(groups, kThreads);
  switch (plan.dtype) {
    case QuantDtype::kBfloat16:
      QuantizeKernel<QuantDtype::kBfloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, sink);
      break;
    case QuantDtype::kFloat16:
      QuantizeKernel<QuantDtype::kFloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, sink);
      break;
    case QuantDtype::kFloat32:
      QuantizeKernel<QuantDtype::kFloat32><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, sink);
      break;
  }
}

// The canonical sink of `plan`.
GroupSink CanonicalSink(const QuantizePlan& plan) {
  GroupSink sink;
  sink.sq = static_cast<uint32_t>(CeilDiv(plan.q, qmath::kGroup));
  sink.div_sq = FastDivisor(sink.sq > 0 ? sink.sq : 1);
  sink.vrow = (plan.q + 1) / 2;
  return sink;
}

}  // namespace

absl::Status QuantizeOnCuda(const QuantizePlan& plan, const void* in, void* values, void* scales,
                            CudaStream stream) {
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  if (plan.rows * sq == 0) return absl::OkStatus();  // <= scales_bytes, checked by the plan
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
  LaunchGroups(plan, in, values, scales, CanonicalSink(plan), stream);
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

absl::Status QuantizeBlackwellOnCuda(const QuantizePlan& plan, const QuantLayoutSpec& spec, const void* in,
                                     void* values, void* scales, CudaStream stream) {
  auto g = FusedBlackwellGeometryOf(plan, spec);
  if (!g.ok()) return g.status();
  if (g->mats == 0 || g->v_mat_bytes + g->s_mat_bytes == 0) return absl::OkStatus();
  OnInputDevice dev;
  WPREP_RETURN_IF_ERROR(dev.Enter(in));
  GroupSink sink = CanonicalSink(plan);
  sink.blackwell = true;
  sink.n = static_cast<uint32_t>(g->n);
  sink.div_n = FastDivisor(sink.n);
  sink.vt = g->vt;
  sink.v_mat = g->v_mat_bytes;
  sink.s_mat = g->s_mat_bytes;
  sink.kp = g->kp;
  sink.st = g->st;
  const auto vaddr = reinterpret_cast<uintptr_t>(values);
  sink.words = g->vt.tile_k % 4 == 0 && vaddr % 4 == 0;
  sink.tiled = spec.layout == QuantLayout::kBlackwellShuffled;
  sink.vrow = g->vt.kpad;  // blackwell_value: rows of Kpad bytes
  if (plan.rows * sink.sq > 0) LaunchGroups(plan, in, values, scales, sink, stream);
  const int64_t pad_rows = g->vt.ntn * g->vt.tile_n - g->n;
  const int unit = g->vt.tile_k % 16 == 0 && vaddr % 16 == 0 ? 16 : sink.words ? 4 : 1;
  const int64_t pad_work = g->mats * (g->vt.ntk * pad_rows * g->vt.tile_k / unit + (g->st.npad - g->n) * g->st.kpad);
  if (pad_work > 0) {
    PadKernel<<<dev.Wave(CeilDiv(pad_work, 256)), 256, 0, stream>>>(static_cast<uint8_t*>(values),
                                                                    static_cast<uint8_t*>(scales), sink, g->mats,
                                                                    pad_rows, unit);
  }
  return dev.Leave();
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
  const bool aligned = (reinterpret_cast<uintptr_t>(in) & 15) == 0 && (reinterpret_cast<uintptr_t>(values) & 3) == 0 &&
                       (reinterpret_cast<uintptr_t>(scales) & 3) == 0;
  if (tiles > 0 && plan.dtype != QuantDtype::kFloat32 && aligned && g->scales.cols_p < (int64_t{1} << 31)) {
    const unsigned grid = dev.Wave(CeilDiv(vp.experts * vp.rows_out, 8));  // a warp a row, 8 a block
    const auto* in4 = static_cast<const uint4*>(in);
    auto* v = static_cast<uint8_t*>(values);
    auto* s = static_cast<uint8_t*>(scales);
    const auto cols_p = static_cast<uint32_t>(g->scales.cols_p), sq = static_cast<uint32_t>(g->k / qmath::kGroup);
    const bool up = plan.rounding == ScaleRounding::kUp;
    if (plan.dtype == QuantDtype::kBfloat16) {
      Trtllm16Kernel<QuantDtype::kBfloat16><<<grid, 256, 0, stream>>>(in4, v, s, vp, cols_p, sq, up);
    } else {
      Trtllm16Kernel<QuantDtype::kFloat16><<<grid, 256, 0, stream>>>(in4, v, s, vp, cols_p, sq, up);
    }
  } else if (tiles > 0) {
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
    case QuantLayout::kBlackwellShuffled:
      return QuantizeBlackwellOnCuda(plan, spec, in, values, scales, stream);
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
                                       const QuantLayoutSpec& spec, const QuantBias& bias) {
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
  if ((bias.in == nullptr) != (bias.out == nullptr)) {
    return absl::InvalidArgumentError("bias: give both its input and output, for a trtllm layout only");
  }
  if (sizes->scales_bytes == 0 && sizes->values_bytes == 0) return absl::OkStatus();
  const size_t bias_in_size = bias.in == nullptr ? 0 : static_cast<size_t>(plan.rows) * (bias.bfloat16 ? 2 : 4);
  const size_t bias_out_size = bias.in == nullptr ? 0 : static_cast<size_t>(sizes->bias_bytes);
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void *d_in = nullptr, *d_v = nullptr, *d_s = nullptr, *d_bi = nullptr, *d_bo = nullptr;
  absl::Status st = WPREP_CUDA_STATUS(cudaMalloc(&d_in, in_size > 0 ? in_size : 1));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_v, values_size > 0 ? values_size : 1)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_s, scales_size)));
  if (st.ok() && bias.in != nullptr) {
    st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_bi, bias_in_size > 0 ? bias_in_size : 1)));
    if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_bo, bias_out_size > 0 ? bias_out_size : 1)));
    if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(d_bi, bias.in, bias_in_size, cudaMemcpyHostToDevice)));
  }
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(d_in, in, in_size, cudaMemcpyHostToDevice)));
  QuantBias device_bias;
  if (bias.in != nullptr) device_bias = {d_bi, bias.bfloat16, d_bo};
  if (st.ok()) st.Update(QuantizeLayoutOnCuda(plan, spec, d_in, d_v, d_s, nullptr, device_bias));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(values, d_v, values_size, cudaMemcpyDeviceToHost)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(scales, d_s, scales_size, cudaMemcpyDeviceToHost)));
  if (st.ok() && bias.in != nullptr) {
    st.Update(WPREP_CUDA_STATUS(cudaMemcpy(bias.out, d_bo, bias_out_size, cudaMemcpyDeviceToHost)));
  }
  for (void* p : {d_in, d_v, d_s, d_bi, d_bo}) (void)cudaFree(p);
  (void)cudaSetDevice(previous);  // best effort: the status that matters is st
  return st;
}

}  // namespace wprep
