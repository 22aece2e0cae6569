// The Hopper scale swizzle on the CPU, an output row at a time with 16-byte SIMD shuffles
// instead of the tiles' per-byte gathers (the tiles emulate a GPU block's threads, which
// a CPU pays for byte by byte).
//
// One output row (orow) of 32*C bytes takes, for each half a in {0, 1}, the 16 S rows
// r0 + 8b + c (r0 = HopperScaleRunRow) and two columns 2k0 + d per 64-byte block:
// O[orow, 64*k0 + 32*a + 4*c + 2*d + b] = S[r0 + 8*b + c, 2*k0 + d] (layout_math.h).
// With v_d the 16 bytes S[r0 + i, 2k0 + d] (i = 8b + c), the block's 32 bytes of half a are
// [v0[c], v0[8 + c], v1[c], v1[8 + c]] for c = 0..7: two byte unpacks and two 16-bit ones.
// - S columns contiguous (a transposed view, or mx_axis -2 of a dense tensor): v_d is one
//   16-byte load.
// - S rows contiguous: the 16 rows' 16-byte pieces (8 blocks) unpack into u32 lanes that a
//   4x4 transpose puts in block order.
// Rows or columns past S (the padding) and blocks at S's edges go byte by byte.
#ifndef WPREP_KERNELS_SRC_SCALE_CPU_H_
#define WPREP_KERNELS_SRC_SCALE_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "layout_math.h"
#include "simd_cpu.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace wprep::cpu_scale {

// True when HopperScaleRows serves `g` (a Hopper scale swizzle or unswizzle whose S rows
// or columns are contiguous, on a CPU with SSE2).
inline bool ServesHopperScale(const Geometry& g) {
#if defined(__SSE2__)
  return (g.op == Op::kHopperScaleSwizzle || g.op == Op::kHopperScaleUnswizzle) &&
         ((g.scale_access == ScaleAccess::kRows && g.scale_stride[1] == 1) ||
          (g.scale_access == ScaleAccess::kColumns && g.scale_stride[0] == 1));
#else
  (void)g;
  return false;
#endif
}

// Half a of the 64-byte block k0 of output row `orow`, byte by byte: zeros past S.
inline void HopperScaleBlockBytes(const HopperScaleTiling& t, const int64_t* stride, const uint8_t* s,
                                  int64_t r0, int64_t k0, uint8_t* dst) {
  for (int c = 0; c < 8; ++c) {
    for (int d = 0; d < 2; ++d) {
      for (int b = 0; b < 2; ++b) {
        const int64_t r = r0 + 8 * b + c, col = 2 * k0 + d;
        dst[4 * c + 2 * d + b] = r < t.rows && col < t.cols ? s[r * stride[0] + col * stride[1]] : 0;
      }
    }
  }
}

// The inverse: S bytes of half a of block k0 from its 32 bytes, those past S skipped.
inline void HopperScaleBlockBytesBack(const HopperScaleTiling& t, const int64_t* stride, const uint8_t* src,
                                      int64_t r0, int64_t k0, uint8_t* s) {
  for (int c = 0; c < 8; ++c) {
    for (int d = 0; d < 2; ++d) {
      for (int b = 0; b < 2; ++b) {
        const int64_t r = r0 + 8 * b + c, col = 2 * k0 + d;
        if (r < t.rows && col < t.cols) s[r * stride[0] + col * stride[1]] = src[4 * c + 2 * d + b];
      }
    }
  }
}

#if defined(__SSE2__)
// The 32 bytes of a block's half from v0 = S[r0 + i, 2k0] and v1 = S[r0 + i, 2k0 + 1].
inline void StoreHalfBlock(__m128i v0, __m128i v1, uint8_t* dst) {
  const __m128i t0 = _mm_unpacklo_epi8(v0, _mm_srli_si128(v0, 8));  // (v0[c], v0[8 + c])
  const __m128i t1 = _mm_unpacklo_epi8(v1, _mm_srli_si128(v1, 8));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi16(t0, t1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_unpackhi_epi16(t0, t1));
}

using cpu::Transpose4;

// Half a of eight blocks (k0 .. k0 + 7: bytes [64j, 64j + 32) of dst for block k0 + j) from
// 16 S rows whose 16 bytes at columns 2k0 .. 2k0 + 15 are rows[i]. Pairing row c with row 8 + c byte by byte makes u32 lane j of the
// low (high) unpack the 4 bytes of block j (4 + j) for that c; a transpose over c groups them
// per block.
inline void StoreEightBlocks(const __m128i* rows, uint8_t* dst) {
  __m128i lo[8], hi[8];
  for (int c = 0; c < 8; ++c) {
    lo[c] = _mm_unpacklo_epi8(rows[c], rows[8 + c]);
    hi[c] = _mm_unpackhi_epi8(rows[c], rows[8 + c]);
  }
  Transpose4(lo[0], lo[1], lo[2], lo[3]);
  Transpose4(lo[4], lo[5], lo[6], lo[7]);
  Transpose4(hi[0], hi[1], hi[2], hi[3]);
  Transpose4(hi[4], hi[5], hi[6], hi[7]);
  for (int j = 0; j < 4; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * j), lo[j]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * j + 16), lo[4 + j]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * (4 + j)), hi[j]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * (4 + j) + 16), hi[4 + j]);
  }
}

// The inverse of StoreHalfBlock: v0 and v1 from a block half's 32 bytes.
inline void LoadHalfBlock(const uint8_t* src, __m128i* v0, __m128i* v1) {
  // u16 lanes (v0[c], v0[8 + c]) and (v1[c], v1[8 + c]) alternate: gather each kind.
  auto split = [](__m128i x) {
    x = _mm_shufflehi_epi16(_mm_shufflelo_epi16(x, _MM_SHUFFLE(3, 1, 2, 0)), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_shuffle_epi32(x, _MM_SHUFFLE(3, 1, 2, 0));  // [v0 pairs of 4 c | v1 pairs of 4 c]
  };
  const __m128i x = split(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));       // c = 0..3
  const __m128i y = split(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));  // c = 4..7
  const __m128i even = _mm_set1_epi16(0x00ff);
  const __m128i t0 = _mm_unpacklo_epi64(x, y), t1 = _mm_unpackhi_epi64(x, y);
  *v0 = _mm_packus_epi16(_mm_and_si128(t0, even), _mm_srli_epi16(t0, 8));
  *v1 = _mm_packus_epi16(_mm_and_si128(t1, even), _mm_srli_epi16(t1, 8));
}

// The inverse of StoreEightBlocks: the 16 S rows' 16 bytes from half a of eight blocks.
inline void LoadEightBlocks(const uint8_t* src, __m128i* rows) {
  __m128i lo[8], hi[8];
  for (int j = 0; j < 4; ++j) {
    lo[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * j));
    lo[4 + j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * j + 16));
    hi[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * (4 + j)));
    hi[4 + j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * (4 + j) + 16));
  }
  Transpose4(lo[0], lo[1], lo[2], lo[3]);
  Transpose4(lo[4], lo[5], lo[6], lo[7]);
  Transpose4(hi[0], hi[1], hi[2], hi[3]);
  Transpose4(hi[4], hi[5], hi[6], hi[7]);
  const __m128i even = _mm_set1_epi16(0x00ff);
  for (int c = 0; c < 8; ++c) {  // lo[c], hi[c]: bytes of rows c and 8 + c, alternating
    rows[c] = _mm_packus_epi16(_mm_and_si128(lo[c], even), _mm_and_si128(hi[c], even));
    rows[8 + c] = _mm_packus_epi16(_mm_srli_epi16(lo[c], 8), _mm_srli_epi16(hi[c], 8));
  }
}
#endif

// Output rows [begin, end) of all matrices (row u is matrix u / out_rows, row u % out_rows).
inline void HopperScaleSwizzleRows(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
#if defined(__SSE2__)
  const HopperScaleTiling& t = g.hopper_scale;
  const int64_t* st = g.scale_stride;
  const bool columns = g.scale_access == ScaleAccess::kColumns;  // st[0] == 1
  const int64_t blocks = t.cols_pad / 2;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / t.out_rows, orow = u - e * t.out_rows;
    const uint8_t* s = in + g.InputMatrixOffset(e);
    uint8_t* row = out + e * g.out_matrix_bytes + orow * t.out_cols;
    for (int a = 0; a < 2; ++a) {
      const int64_t r0 = HopperScaleRunRow(t, orow, a);
      uint8_t* half = row + 32 * a;  // block k0's half at half + 64 * k0
      if (r0 >= t.rows) {  // all padding
        const __m128i zero = _mm_setzero_si128();
        for (int64_t k0 = 0; k0 < blocks; ++k0) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(half + 64 * k0), zero);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(half + 64 * k0 + 16), zero);
        }
        continue;
      }
      const int valid = static_cast<int>(std::min<int64_t>(16, t.rows - r0));  // S rows in this run
      const int64_t full_blocks = t.cols / 2;  // blocks with both columns in S
      int64_t k0 = 0;
      if (columns) {
        alignas(16) uint8_t part[2][16] = {};
        for (; k0 < full_blocks; ++k0) {
          const uint8_t* p = s + r0 + 2 * k0 * st[1];
          if (valid == 16) {
            StoreHalfBlock(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + st[1])), half + 64 * k0);
          } else {  // the last run: rows past S read as zeros
            std::memcpy(part[0], p, static_cast<size_t>(valid));
            std::memcpy(part[1], p + st[1], static_cast<size_t>(valid));
            StoreHalfBlock(_mm_load_si128(reinterpret_cast<const __m128i*>(part[0])),
                           _mm_load_si128(reinterpret_cast<const __m128i*>(part[1])), half + 64 * k0);
          }
        }
      } else {
        __m128i rows[16];
        for (int i = valid; i < 16; ++i) rows[i] = _mm_setzero_si128();
        for (; k0 + 8 <= full_blocks; k0 += 8) {
          for (int i = 0; i < valid; ++i) {
            rows[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (r0 + i) * st[0] + 2 * k0));
          }
          StoreEightBlocks(rows, half + 64 * k0);
        }
      }
      for (; k0 < blocks; ++k0) HopperScaleBlockBytes(t, st, s, r0, k0, half + 64 * k0);
    }
  }
#else
  (void)g, (void)in, (void)out, (void)begin, (void)end;
#endif
}

// The unswizzle of O rows [begin, end) of all matrices into S: the swizzle's shuffles
// undone; S bytes only (padding is not read back).
inline void HopperScaleUnswizzleRows(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin,
                                     int64_t end) {
#if defined(__SSE2__)
  const HopperScaleTiling& t = g.hopper_scale;
  const int64_t* st = g.scale_stride;
  const bool columns = g.scale_access == ScaleAccess::kColumns;  // st[0] == 1
  const int64_t blocks = t.cols_pad / 2;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / t.out_rows, orow = u - e * t.out_rows;
    const uint8_t* row = in + g.InputMatrixOffset(e) + orow * g.in_stride[0];
    uint8_t* s = out + e * g.out_matrix_bytes;
    for (int a = 0; a < 2; ++a) {
      const int64_t r0 = HopperScaleRunRow(t, orow, a);
      if (r0 >= t.rows) continue;  // all padding
      const uint8_t* half = row + 32 * a;
      const int valid = static_cast<int>(std::min<int64_t>(16, t.rows - r0));
      const int64_t full_blocks = t.cols / 2;
      int64_t k0 = 0;
      if (columns) {
        alignas(16) uint8_t part[2][16];
        for (; k0 < full_blocks; ++k0) {
          uint8_t* p = s + r0 + 2 * k0 * st[1];
          __m128i v0, v1;
          LoadHalfBlock(half + 64 * k0, &v0, &v1);
          if (valid == 16) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v0);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(p + st[1]), v1);
          } else {
            _mm_store_si128(reinterpret_cast<__m128i*>(part[0]), v0);
            _mm_store_si128(reinterpret_cast<__m128i*>(part[1]), v1);
            std::memcpy(p, part[0], static_cast<size_t>(valid));
            std::memcpy(p + st[1], part[1], static_cast<size_t>(valid));
          }
        }
      } else {
        __m128i rows[16];
        for (; k0 + 8 <= full_blocks; k0 += 8) {
          LoadEightBlocks(half + 64 * k0, rows);
          for (int i = 0; i < valid; ++i) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(s + (r0 + i) * st[0] + 2 * k0), rows[i]);
          }
        }
      }
      for (; k0 < blocks; ++k0) HopperScaleBlockBytesBack(t, st, half + 64 * k0, r0, k0, s);
    }
  }
#else
  (void)g, (void)in, (void)out, (void)begin, (void)end;
#endif
}

// The swizzle or unswizzle `g` of O rows [begin, end) of all matrices.
inline void HopperScaleRows(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  if (g.op == Op::kHopperScaleSwizzle) {
    HopperScaleSwizzleRows(g, in, out, begin, end);
  } else {
    HopperScaleUnswizzleRows(g, in, out, begin, end);
  }
}

// ---------------------------------------------------------------------------------------
// Blackwell scales. Block (n0, k0) of 512 bytes holds x[4k0 + c, 128n0 + 32a + b] at
// 16b + 4a + c: four x rows of 128 bytes each, interleaved byte by byte (c), then 32-bit
// words (a) transposed into 16-byte groups per b.

// True when BlackwellScaleBlocks serves `g`: a swizzle whose x rows are contiguous, or an
// unswizzle of dense storage into such rows, on a CPU with SSE2.
inline bool ServesBlackwellScale(const Geometry& g) {
#if defined(__SSE2__)
  const BlackwellScaleTiling& t = g.blackwell_scale;
  const bool rows = g.scale_access == ScaleAccess::kRows && g.scale_stride[1] == 1;
  if (g.op == Op::kBlackwellScaleSwizzle) return rows;
  return g.op == Op::kBlackwellScaleUnswizzle && rows && g.in_stride[0] == t.kpad / 4 * kBlackwellScaleBlock &&
         g.in_stride[1] == kBlackwellScaleBlock && g.in_stride[2] == kBlackwellScaleBlock / 2;
#else
  (void)g;
  return false;
#endif
}

// Blocks go in bands of this many k-blocks (BlackwellScaleBlocks).
inline constexpr int64_t kBlackwellScaleBand = 8;

inline int64_t BlackwellScaleBlockCount(const Geometry& g) {
  return g.num_matrices * (g.blackwell_scale.npad / 128) * (g.blackwell_scale.kpad / 4);
}

#if defined(__SSE2__)
// One block from its four x rows (rows[c][n] for n = 0..127).
inline void SwizzleBlackwellBlock(const uint8_t* const* rows, uint8_t* dst) {
  __m128i w[4][8];  // w[a][j], u32 lane l: x[4k0 + c, 32a + 4j + l] for c = 0..3
  for (int a = 0; a < 4; ++a) {
    for (int h = 0; h < 2; ++h) {
      const int at = 32 * a + 16 * h;
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + at));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + at));
      const __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2] + at));
      const __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[3] + at));
      const __m128i p01l = _mm_unpacklo_epi8(x0, x1), p01h = _mm_unpackhi_epi8(x0, x1);
      const __m128i p23l = _mm_unpacklo_epi8(x2, x3), p23h = _mm_unpackhi_epi8(x2, x3);
      w[a][4 * h + 0] = _mm_unpacklo_epi16(p01l, p23l);
      w[a][4 * h + 1] = _mm_unpackhi_epi16(p01l, p23l);
      w[a][4 * h + 2] = _mm_unpacklo_epi16(p01h, p23h);
      w[a][4 * h + 3] = _mm_unpackhi_epi16(p01h, p23h);
    }
  }
  for (int j = 0; j < 8; ++j) {  // b = 4j + l: its 16 bytes are lane l of w[0..3][j]
    Transpose4(w[0][j], w[1][j], w[2][j], w[3][j]);
    for (int l = 0; l < 4; ++l) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * (4 * j + l)), w[l][j]);
  }
}

// Its inverse: the four x rows of a block.
inline void UnswizzleBlackwellBlock(const uint8_t* src, uint8_t* const* rows) {
  __m128i w[4][8];
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 4; ++l) w[l][j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * (4 * j + l)));
    Transpose4(w[0][j], w[1][j], w[2][j], w[3][j]);
  }
  const __m128i even = _mm_set1_epi16(0x00ff);
  // The low (high) u16 of each word: sign-extended, then packed back (no saturation).
  auto lo16 = [](__m128i v) { return _mm_srai_epi32(_mm_slli_epi32(v, 16), 16); };
  auto hi16 = [](__m128i v) { return _mm_srai_epi32(v, 16); };
  for (int a = 0; a < 4; ++a) {
    for (int h = 0; h < 2; ++h) {
      const int at = 32 * a + 16 * h;
      const __m128i* q = &w[a][4 * h];
      const __m128i p01l = _mm_packs_epi32(lo16(q[0]), lo16(q[1])), p23l = _mm_packs_epi32(hi16(q[0]), hi16(q[1]));
      const __m128i p01h = _mm_packs_epi32(lo16(q[2]), lo16(q[3])), p23h = _mm_packs_epi32(hi16(q[2]), hi16(q[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[0] + at),
                       _mm_packus_epi16(_mm_and_si128(p01l, even), _mm_and_si128(p01h, even)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[1] + at),
                       _mm_packus_epi16(_mm_srli_epi16(p01l, 8), _mm_srli_epi16(p01h, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[2] + at),
                       _mm_packus_epi16(_mm_and_si128(p23l, even), _mm_and_si128(p23h, even)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[3] + at),
                       _mm_packus_epi16(_mm_srli_epi16(p23l, 8), _mm_srli_epi16(p23h, 8)));
    }
  }
}
#endif

// Blocks [begin, end) of all matrices (block u: matrix u / blocks, then band, n0, k0).
// Blocks at the tensor's edges go byte by byte (zeros, or nothing, past it).
inline void BlackwellScaleBlocks(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
#if defined(__SSE2__)
  const BlackwellScaleTiling& t = g.blackwell_scale;
  const int64_t* st = g.scale_stride;
  const bool swizzle = g.op == Op::kBlackwellScaleSwizzle;
  const int64_t k_blocks = t.kpad / 4, n_blocks = t.npad / 128, per_matrix = n_blocks * k_blocks;
  for (int64_t u = begin; u < end; ++u) {
    // Bands of kBlackwellScaleBand k-blocks (4 * kBlackwellScaleBand x rows), each crossed
    // along N: the band's rows are read front to back, a few dozen streams at once, and each
    // n0 writes the band's blocks in one run. Block by block in storage order (a 128-byte
    // piece of every x row, rows N bytes apart) measured up to twice as slow.
    const int64_t e = u / per_matrix, w = u - e * per_matrix;
    const int64_t band = w / (kBlackwellScaleBand * n_blocks), r = w - band * kBlackwellScaleBand * n_blocks;
    const int64_t width = std::min<int64_t>(kBlackwellScaleBand, k_blocks - band * kBlackwellScaleBand);
    const int64_t n0 = r / width, k0 = band * kBlackwellScaleBand + (r - n0 * width);
    const int64_t blk = n0 * k_blocks + k0;
    const int64_t o = e * g.out_matrix_bytes;
    const uint8_t* storage = swizzle ? nullptr : in + g.InputMatrixOffset(e) + blk * kBlackwellScaleBlock;
    uint8_t* block = swizzle ? out + o + blk * kBlackwellScaleBlock : nullptr;
    const uint8_t* x_in = swizzle ? in + g.InputMatrixOffset(e) : nullptr;
    uint8_t* x_out = swizzle ? nullptr : out + o;
    // Rows past the tensor read as zeros (swizzle) or land in scratch (unswizzle); a row cut
    // short by N goes through a 128-byte staging row.
    const int valid_k = static_cast<int>(std::clamp<int64_t>(t.k - 4 * k0, 0, 4));
    const int64_t valid_n = std::clamp<int64_t>(t.n - 128 * n0, 0, 128);
    alignas(16) uint8_t staged[4][128];
    if (swizzle) {
      const uint8_t* rows[4];
      for (int c = 0; c < 4; ++c) {
        const uint8_t* x = c < valid_k ? x_in + (4 * k0 + c) * st[0] + 128 * n0 : nullptr;
        if (x != nullptr && valid_n == 128) {
          rows[c] = x;
        } else {
          std::memset(staged[c], 0, 128);
          if (x != nullptr) std::memcpy(staged[c], x, static_cast<size_t>(valid_n));
          rows[c] = staged[c];
        }
      }
      SwizzleBlackwellBlock(rows, block);
    } else {
      uint8_t* rows[4];
      const bool direct = valid_n == 128;
      for (int c = 0; c < 4; ++c) {
        rows[c] = c < valid_k && direct ? x_out + (4 * k0 + c) * st[0] + 128 * n0 : staged[c];
      }
      UnswizzleBlackwellBlock(storage, rows);
      if (!direct) {
        for (int c = 0; c < valid_k; ++c) {
          std::memcpy(x_out + (4 * k0 + c) * st[0] + 128 * n0, staged[c], static_cast<size_t>(valid_n));
        }
      }
    }
  }
#else
  (void)g, (void)in, (void)out, (void)begin, (void)end;
#endif
}

}  // namespace wprep::cpu_scale

#endif  // WPREP_KERNELS_SRC_SCALE_CPU_H_
