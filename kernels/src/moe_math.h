// The index math of the trtllm-gen MoE preparation (docs/TRTLLM_GEN.md), written once:
// every function is WPREP_HD, and the CPU loop (moe_cpu.cc) and the CUDA kernels
// (moe_cuda.cu) call the same ones. Each maps an OUTPUT position to the input position it
// copies, or to "zero" (load-time padding), in closed form: no index tables.
//
// Every output tensor of every op is one of two passes:
//  - a rows pass: output rows are whole input rows (or zero rows), each row's bytes
//    zero-padded on the right, optionally stored BlockMajorK (S8); element modes widen
//    bf16 bias words to float32 or clamp fp8_block scales;
//  - an interleave pass: the 128x4 scale-factor layout (S5) of rows chosen by a row map.
#ifndef WPREP_KERNELS_SRC_MOE_MATH_H_
#define WPREP_KERNELS_SRC_MOE_MATH_H_

#include <cstdint>

#include "layout_math.h"

namespace wprep {
namespace moe {

// What happens to a row index after the optional S3 shuffle (see SrcRow).
enum RowMode : int32_t {
  kRowPlain = 0,         // r = m
  kRowXor1 = 1,          // S1 swap_pairs: r = m ^ 1
  kRowRotate = 2,        // S7 swap_halves: r = (m + half) mod 2*half
  kRowGatedReorder = 3,  // S2 alone: r = (m % 2) * half + m / 2
  kRowGatedPrepare = 4,  // S7 + per-half padding + S2: j = m / 2 < half ? (m odd ? j : half + j)
};

// Output row -> input row. `shuffle_b` 0 (no S3), 16 or 32 (S3's block). Rows whose
// source is >= `limit` (padding) read as zeros.
struct RowMap {
  int32_t shuffle_b = 0;
  int32_t mode = kRowPlain;
  int64_t half = 0;
  int64_t limit = 0;
};

// a / b for a >= 0, b > 0: in 32 bits when both fit (a 64-bit division costs a GPU
// about four times as many instructions, and kernels divide once per row or word).
WPREP_HD int64_t Div(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

// S3: src(n) = B*(n//B) + (B/8)*(n%8) + (n%B)//8, for B = 16 or 32 (shifts, no division).
WPREP_HD int64_t ShuffleSrc(int64_t n, int64_t b) {
  const int64_t lb = b == 32 ? 5 : 4;
  return ((n >> lb) << lb) + (b >> 3) * (n & 7) + ((n & (b - 1)) >> 3);
}

// The input row that output row `n` copies, or -1 for a zero row.
WPREP_HD int64_t SrcRow(const RowMap& map, int64_t n) {
  const int64_t m = map.shuffle_b ? ShuffleSrc(n, map.shuffle_b) : n;
  int64_t r = m;
  switch (map.mode) {
    case kRowXor1:
      r = m ^ 1;
      break;
    case kRowRotate:
      r = m + map.half;
      if (r >= 2 * map.half) r -= 2 * map.half;
      break;
    case kRowGatedReorder:
      r = (m & 1) * map.half + (m >> 1);
      break;
    case kRowGatedPrepare: {
      const int64_t j = m >> 1;
      if (j >= map.half) return -1;
      r = (m & 1) ? j : map.half + j;
      break;
    }
    default:
      break;
  }
  return r < map.limit ? r : -1;
}

// Element handling of a rows pass.
enum ElemMode : int32_t {
  kElemCopy = 0,       // bytes move as they are
  kElemWidenBf16 = 1,  // 2-byte bf16 in, 4-byte float32 out: bits << 16 (exact)
  kElemClampF32 = 2,   // float32 words: x < 1e-10f -> 0x2EDBE6FF (NaNs kept), contract 10.6
};

// Output [experts, rows_out, out_row_bytes] (or BlockMajorK [experts, out_row_bytes /
// block_bytes, rows_out, block_bytes]) from input [experts, rows_in, in_row_bytes].
// Output bytes of a row past the input's (in input units) are zeros.
struct RowsPass {
  int64_t experts = 0;
  int64_t rows_in = 0;
  int64_t rows_out = 0;
  int64_t in_row_bytes = 0;
  int64_t out_row_bytes = 0;
  int64_t block_bytes = 0;  // 0: rows stored whole
  int32_t elem = kElemCopy;
  RowMap map;
  int32_t block_shift = -1;  // log2(block_bytes) when a power of two: no division per word
};

// Byte offset in the output of byte `x` of output row `n` of expert `e`.
WPREP_HD int64_t RowsOutOffset(const RowsPass& p, int64_t e, int64_t n, int64_t x) {
  const int64_t expert = e * p.rows_out * p.out_row_bytes;
  if (p.block_bytes == 0) return expert + n * p.out_row_bytes + x;
  const int64_t b = p.block_shift >= 0 ? x >> p.block_shift : Div(x, p.block_bytes);
  const int64_t t = x - b * p.block_bytes;
  return expert + b * p.rows_out * p.block_bytes + n * p.block_bytes + t;
}

// Byte offset in the input of the row that output row `n` of expert `e` copies, or -1.
WPREP_HD int64_t RowsSrcRowOffset(const RowsPass& p, int64_t e, int64_t n) {
  const int64_t r = SrcRow(p.map, n);
  return r < 0 ? -1 : (e * p.rows_in + r) * p.in_row_bytes;
}

// Input byte (within the source row) that output byte `x` of a row starts from, for
// the element mode; -1 when it lies in the zero padding on the right.
WPREP_HD int64_t RowsSrcByte(const RowsPass& p, int64_t x) {
  const int64_t s = p.elem == kElemWidenBf16 ? x / 2 : x;
  return s < p.in_row_bytes ? s : -1;
}

inline constexpr uint32_t kFp8BlockScaleMin = 0x2EDBE6FFu;  // float32 nearest 1e-10

// The block-scale clamp on bits: below 1e-10f (negatives, -0, -inf, denormals
// included) becomes 1e-10f; NaN compares false and keeps its payload.
WPREP_HD uint32_t ClampBlockScale(uint32_t bits) {
  const bool negative = (bits >> 31) != 0;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  if (nan) return bits;
  if (negative) return kFp8BlockScaleMin;  // -0 and every negative, -inf included
  return bits < kFp8BlockScaleMin ? kFp8BlockScaleMin : bits;  // positive floats order as ints
}

// The 128x4 layout of S5 over one expert's [rows_p, cols_p] (rows_p % 128 == 0,
// cols_p % 4 == 0): off(m, c) = (m/128)*(cols_p/4)*512 + (c/4)*512 + (m%32)*16 +
// ((m%128)/32)*4 + c%4. Inverted here, output-driven: offset `o` -> (m, c).
WPREP_HD void SfSource(int64_t o, int64_t cols_p, int64_t* m, int64_t* c) {
  const int64_t row_tile = (cols_p / 4) * 512;
  const int64_t mt = Div(o, row_tile), rem = o - mt * row_tile;
  const int64_t ct = rem >> 9, q = rem & 511;
  *m = 128 * mt + 32 * ((q % 16) / 4) + q / 16;
  *c = 4 * ct + q % 4;
}

// Forward form, for checks: the offset of (m, c) inside one expert.
WPREP_HD int64_t SfOffset(int64_t m, int64_t c, int64_t cols_p) {
  return (m / 128) * (cols_p / 4) * 512 + (c / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 +
         c % 4;
}

// Output flat [experts * rows_p * cols_p] elements of elem_bytes from input [experts,
// rows_in, cols_in]; output row m of an expert holds input row SrcRow(map, m), columns
// >= cols_in and rows mapped to -1 are zeros.
struct InterleavePass {
  int64_t experts = 0;
  int64_t rows_in = 0;
  int64_t cols_in = 0;
  int64_t rows_p = 0;
  int64_t cols_p = 0;
  int32_t elem_bytes = 1;
  RowMap map;
};

// The 4 output elements [o, o + 4) of expert `e` (o % 4 == 0) are 4 consecutive columns
// of one row: their source is input elements [*src, *src + valid) followed by zeros.
// One SfSource and one SrcRow per 4 elements.
WPREP_HD void InterleaveSrcGroup(const InterleavePass& p, int64_t e, int64_t o, int64_t* src,
                                 int* valid) {
  int64_t m = 0, c = 0;
  SfSource(o, p.cols_p, &m, &c);
  const int64_t r = SrcRow(p.map, m);
  const int64_t left = p.cols_in - c;
  *valid = r < 0 || left <= 0 ? 0 : (left < 4 ? static_cast<int>(left) : 4);
  *src = *valid ? (e * p.rows_in + r) * p.cols_in + c : 0;
}

// The 16 output bytes [o, o + 16) of expert `e` (uint8 elements, o % 16 == 0) are 4
// rows (m, m + 32, m + 64, m + 96) x the same 4 columns: group i is InterleaveSrcGroup
// at o + 4i, with one SfSource for all four.
WPREP_HD void InterleaveSrcWord(const InterleavePass& p, int64_t e, int64_t o, int64_t src[4],
                                int valid[4]) {
  int64_t m = 0, c = 0;
  SfSource(o, p.cols_p, &m, &c);
  const int64_t left = p.cols_in - c;
  const int cols = left <= 0 ? 0 : (left < 4 ? static_cast<int>(left) : 4);
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int64_t r = SrcRow(p.map, m + 32 * i);
    valid[i] = r < 0 ? 0 : cols;
    src[i] = valid[i] ? (e * p.rows_in + r) * p.cols_in + c : 0;
  }
}

}  // namespace moe
}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_MOE_MATH_H_
