// Per-group MXFP4 quantization math (docs/LAYOUTS.md, "Quantization to MXFP4"), written once
// for host and device so the CPU and CUDA engines cannot drift apart.
#ifndef WPREP_KERNELS_SRC_QUANTIZE_MATH_H_
#define WPREP_KERNELS_SRC_QUANTIZE_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "layout_math.h"
#include "moe_math.h"
#include "wprep/kernels/quantize.h"

namespace wprep {
namespace qmath {

inline constexpr int kGroup = 32;

// Bit casts through memcpy: defined behaviour on host, folded to a move on device.
WPREP_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#endif
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
WPREP_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#endif
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16 is the top half of a float32: widening is exact.
WPREP_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 to float32, exact for every input (subnormals, inf, NaN payloads kept).
WPREP_HD float Fp16ToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  // The conversion instruction is exact for every finite input (subnormals included); the
  // bits below keep infinities' and NaNs' signs and payloads, which it need not.
  if ((h & 0x7C00u) != 0x7C00u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsFloat(sign | 0x7F800000u | man << 13);
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal: normalize; each shift lowers the exponent by one.
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    return BitsFloat(sign | exp << 23 | (man & 0x3FFu) << 13);
  }
  return BitsFloat(sign | (exp + 127 - 15) << 23 | man << 13);
}

// Step 1 helper: |x| folded into the running max with maxnum semantics (a NaN operand is
// ignored), which is what upstream's tl.max does by default.
WPREP_HD float AbsMaxNum(float acc, float x) {
  const float a = BitsFloat(FloatBits(x) & 0x7FFFFFFFu);
  if (a != a) return acc;
  return a > acc ? a : acc;
}

// Steps 1-2: the scale exponent bits `e` (not shifted) from the group's amax.
WPREP_HD uint32_t ScaleBits(float amax, bool round_up) {
  const uint32_t ds = FloatBits(amax / 6.0f);
  return round_up ? ((ds + 0x007FFFFFu) & 0x7F800000u) : (ds & 0x7F800000u);
}

// Step 3: the multiplier applied to each value.
WPREP_HD float ScaleMultiplier(uint32_t e) { return e == 0 ? 0.0f : 1.0f / BitsFloat(e); }

// Step 4: e2m1 code (sign in bit 3) of q, round to nearest even, saturating at 6.0.
// A NaN q (NaN input, or inf * 0) is code 7: upstream runs on NVIDIA GPUs, whose float
// multiply returns the canonical NaN 0x7FFFFFFF (positive); x86 would keep the input's sign
// or produce 0xFFC00000, so the sign is fixed here rather than left to the host.
WPREP_HD uint32_t EncodeE2m1(float q) {
  if (q != q) return 7u;
  const uint32_t b = FloatBits(q);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t exp = (b >> 23) & 0xFFu;
  uint32_t m = b & 0x007FFFFFu;
  if (exp < 127) m = (0x400000u | m >> 1) >> (126 - exp > 31 ? 31 : 126 - exp);
  const uint32_t e2 = (exp > 126 ? exp : 126) - 126;
  const uint32_t m2 = m >> 21;
  const uint32_t inc = (m2 & 1u) & (static_cast<uint32_t>((m & 0x1FFFFFu) != 0) | ((m2 >> 1) & 1u));
  uint32_t code = ((e2 << 2 | m2) + inc) >> 1;
  if (code > 7u) code = 7u;
  return code | sign >> 28;
}

// EncodeE2m1 as the least of three lines, for the fp32 GPU path: the code of |q| is
// min(RN(2|q|), RN(|q| + 2), RN(|q|/2 + 4), 7), RN rounding to the nearest integer, ties to
// even. Each line is one fp32 FMA or add with a bias of 2^23, whose ulp is 1, so the sum's
// rounding is RN and the integer sits in the low mantissa bits; |q| is clamped to 8 first (a
// NaN clamps to 8 too: code 7, no sign, as EncodeE2m1). The lines change value only at
// points bf16 represents, so the bf16 encoder's proof over every bf16 (internals_test.cc)
// covers every real |q|. One departure of step 4 from exact rounding is kept: below 1 it
// drops mantissa bits before rounding, which changes a code only in [0.25, 0.5), where the
// two lowest bits go and 0.25 + 1..3 ulps is a tie, rounded to 0. Clearing those two bits
// below 0.5 does the same. tests/kernels hold this form to EncodeE2m1.
WPREP_HD uint32_t EncodeE2m1Lines(float q) {
  constexpr float kBias = 8388608.0f;  // 2^23
  const float c = fminf(fabsf(q), 8.0f);
  const uint32_t cb = FloatBits(c);
  const float a = BitsFloat(cb < 0x3F000000u ? cb & ~3u : cb);  // 0x3F000000: 0.5
  const uint32_t l0 = FloatBits(fmaf(a, 2.0f, kBias));
  const uint32_t l1 = FloatBits(a + (kBias + 2.0f));
  const uint32_t l2 = FloatBits(fmaf(a, 0.5f, kBias + 4.0f));
  const uint32_t l3 = FloatBits(kBias + 7.0f);
  const uint32_t low = l0 < l1 ? l0 : l1, high = l2 < l3 ? l2 : l3;
  const uint32_t code = (low < high ? low : high) - FloatBits(kBias);
  return q != q ? code : code | (FloatBits(q) >> 28 & 8u);
}

// Step 2 for the packed bf16 encoder: the scale byte ScaleBits(amax, up) >> 23 of a group whose
// amax (a magnitude) has bf16 bits `h`, from the bits alone (no division), or 0 where the encoder does not
// take the group (amax zero, subnormal, inf or NaN, or a scale byte outside [lo, hi]). For a
// normal amax = 1.f * 2^(b-127), amax / 6 = (1.f / 1.5) * 2^(b-129) has exponent field b - 2
// when 1.f >= 1.5, else b - 3, and is a power of two only when 1.f == 1.5: bf16's 7 fraction
// bits keep the rounded quotient off the next power of two. tests/kernels/internals_test.cc
// holds it to ScaleBits for every bf16.
WPREP_HD uint32_t Bf16ScaleByte(uint32_t h, bool up, uint32_t lo, uint32_t hi) {
  const uint32_t b = (h >> 7) & 0xFFu, f = h & 0x7Fu;
  const uint32_t eb = b - (f >= 0x40u ? 2u : 3u) + (up && f != 0x40u ? 1u : 0u);
  return b >= 1 && b <= 254 && eb >= lo && eb <= hi ? eb : 0u;
}

// The same for an amax with fp16 bits `h` (the packed fp16 encoder): a normal fp16
// 1.f * 2^(e-15) has the float exponent field b = e + 112, and fp16's 10 fraction bits keep
// the quotient off the next power of two as bf16's 7 do. tests/kernels/internals_test.cc
// holds it to ScaleBits for every fp16.
WPREP_HD uint32_t Fp16ScaleByte(uint32_t h, bool up, uint32_t lo, uint32_t hi) {
  const uint32_t e = (h >> 10) & 0x1Fu, f = h & 0x3FFu, b = e + 112;
  const uint32_t eb = b - (f >= 0x200u ? 2u : 3u) + (up && f != 0x200u ? 1u : 0u);
  return e >= 1 && e <= 30 && eb >= lo && eb <= hi ? eb : 0u;
}

}  // namespace qmath

// The fused Blackwell pairs of a weight stored [mats, N, K]: the checkpoint-order value
// matrix is the quantized rows [N, K/2 bytes] as they are, laid out in `vt`'s tiles
// (blackwell_value: one tile of N rows x rup(K/2, 128) bytes; blackwell_shuffled_value:
// tiles of block_n rows x block_k/2 bytes), and the scales [N, ceil(K/32)] are the transposed
// view [ceil(K/32), N] in blackwell_scale. N and vt.kpad are below 2^31 (32-bit divisions).
struct FusedBlackwellGeometry {
  int64_t mats = 0, n = 0, k = 0, sq = 0, kp = 0;  // kp = K/2 value bytes of a row
  BlackwellTiling vt;
  int64_t v_mat_bytes = 0;  // ntk * ntn * tile_n * tile_k
  BlackwellScaleTiling st;  // MakeBlackwellScaleTiling(sq, N)
  int64_t s_mat_bytes = 0;  // st.kpad * st.npad
};

// The geometry of a kBlackwell or kBlackwellShuffled spec (quantize_cpu.cc): INVALID_ARGUMENT
// as PlanQuantizeLayout.
absl::StatusOr<FusedBlackwellGeometry> FusedBlackwellGeometryOf(const QuantizePlan& plan,
                                                                const QuantLayoutSpec& spec);

// The fused Hopper pair (quantize + hopper_value + hopper_scale, both mx_axis -2) of a weight
// stored [mats, N, K]: the value matrix Q is the quantized rows [N, K/2] as they are, the
// scale matrix S the groups' scales [N, ceil(K/32)]. Work is cut into tiles of 64 Q rows x
// 64 Q bytes (4 groups) covering both padded matrices.
struct FusedHopperGeometry {
  int64_t mats = 0, n = 0, k = 0, sq = 0;
  HopperTiling vt;       // MakeHopperTiling(-2, K, N)
  HopperScaleTiling st;  // MakeHopperScaleTiling(-2, num_warps, align_k, ceil(K/32), N)
  int64_t v_mat_bytes = 0, s_mat_bytes = 0;
  int64_t tile_rows = 0, tile_cols = 0;  // tiles along rows and along bytes, per matrix
  int64_t tiles_per_mat = 0;
  int32_t mma_version = 3;
};

inline constexpr int kFusedHopperTileRows = 64;
inline constexpr int kFusedHopperTileBytes = 64;

inline FusedHopperGeometry MakeFusedHopperGeometry(int64_t mats, int64_t n, int64_t k, int mma_version,
                                                   int num_warps, int align_k) {
  FusedHopperGeometry g;
  g.mats = mats;
  g.n = n;
  g.k = k;
  g.sq = CeilDiv(k, qmath::kGroup);
  g.mma_version = mma_version;
  g.vt = MakeHopperTiling(-2, k, n);
  g.st = MakeHopperScaleTiling(-2, num_warps, align_k, g.sq, n);
  g.v_mat_bytes = g.vt.rows_pad * g.vt.cols_pad;
  g.s_mat_bytes = g.st.rows_pad * g.st.cols_pad;
  const int64_t rows = g.vt.rows_pad > g.st.rows_pad ? g.vt.rows_pad : g.st.rows_pad;
  const int64_t bytes = g.vt.cols_pad > 16 * g.st.cols_pad ? g.vt.cols_pad : 16 * g.st.cols_pad;
  g.tile_rows = CeilDiv(rows, kFusedHopperTileRows);
  g.tile_cols = CeilDiv(bytes, kFusedHopperTileBytes);
  g.tiles_per_mat = g.tile_rows * g.tile_cols;
  return g;
}

// The geometry of a checked QuantLayout::kHopper spec (quantize_cpu.cc): INVALID_ARGUMENT as
// PlanQuantizeLayout.
absl::StatusOr<FusedHopperGeometry> FusedHopperGeometryOf(const QuantizePlan& plan, const QuantLayoutSpec& spec);

// A trtllm layout (kTrtllmW13 / kTrtllmW2) is the MXFP4 prepare_w13 / prepare_w2 of the
// quantized weights: the planner's own passes for it (values rows, scales 128x4 interleave,
// bias rows; one row map for the three), and the plan.
struct FusedTrtllmGeometry {
  moe::RowsPass values;         // in_row_bytes K/2, out_row_bytes kp/2
  moe::InterleavePass scales;   // cols_in K/32, cols_p kp/32, rows_p = values.rows_out
  moe::RowsPass bias;           // 4-byte words out (elem widens a bf16 input)
  int64_t k = 0;                // elements of a weight row
  MoePlan plan;                 // the prepare plan
};
inline constexpr int kFusedTrtllmTileRows = 128;   // one row tile of the 128x4 layout
inline constexpr int kFusedTrtllmTileGroups = 4;   // one 512-byte scale block, 64 value bytes

// `bias_bf16`: the bias input's type, where one is given (it sets the bias pass's element mode).
absl::StatusOr<FusedTrtllmGeometry> FusedTrtllmGeometryOf(const QuantizePlan& plan, const QuantLayoutSpec& spec,
                                                          bool bias_bf16 = false);

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_QUANTIZE_MATH_H_
