// The Hopper value swizzle and unswizzle on the CPU when Q is the canonical side as it is
// (mx_axis -1 with packing -1, mx_axis -2 with checkpoint order): a unit of 16 Q rows makes
// (or is made from) 4 whole O rows, each 64-byte block packed from its two 32-byte Q pieces
// by HopperPackBlock's word operations, two blocks at a time (PackPair; UnpackPair the other
// way), instead of the tiles' emulation of a GPU block's threads.
#ifndef WPREP_KERNELS_SRC_HOPPER_CPU_H_
#define WPREP_KERNELS_SRC_HOPPER_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "layout_math.h"
#include "nibble_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>  // the AVX2 pair forms
#endif

namespace wprep::cpu_hopper {

// The CPU passes pack and unpack an O row's two 64-byte blocks of a 128-byte chunk
// (s0 = 0, 1) at once: O bytes [128 cr, 128 cr + 128) of O row 4 r0 + t0, and the four
// 32-byte Q pieces q[s0][w0] of Q rows 16 r0 + 2 t0 + s0 + 8 w0 at bytes 32 cr.. (LAYOUTS.md).
// With mma 3 a block's four quarters k are the same word operations on different words
// (q0[2k], q0[2k + 1], q1[2k], q1[2k + 1] to out[4 t1 + k]), so with AVX2 the two blocks'
// eight quarters run in the eight lanes of one register: the quarters' inputs are the even
// and odd words of the pieces, and each t1's four outputs are 16 contiguous bytes of a
// block. Otherwise (mma 2, or no AVX2) each block takes HopperPackBlock.
#if defined(WPREP_NIBBLE_AVX2)
using Words8 = uint32_t __attribute__((vector_size(32)));

// 16 bytes at `lo` in the low 128-bit lane and 16 at `hi` in the high one.
__attribute__((target("avx2"))) inline __m256i LoadLanes(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}
__attribute__((target("avx2"))) inline void StoreLanes(__m256i v, uint8_t* lo, uint8_t* hi) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(v, 1));
}

// Pieces a (lanes 0-3) and b (lanes 4-7) as their even words (0, 2, 4, 6) and odd ones.
__attribute__((target("avx2"))) inline void SplitEvenOdd(const uint8_t* a, const uint8_t* b, Words8* even,
                                                         Words8* odd) {
  const __m256 lo = _mm256_castsi256_ps(LoadLanes(a, b)), hi = _mm256_castsi256_ps(LoadLanes(a + 16, b + 16));
  *even = reinterpret_cast<Words8>(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0x88)));
  *odd = reinterpret_cast<Words8>(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0xDD)));
}
__attribute__((target("avx2"))) inline void JoinEvenOdd(const Words8& even, const Words8& odd, uint8_t* a,
                                                        uint8_t* b) {
  const __m256i e = reinterpret_cast<__m256i>(even), o = reinterpret_cast<__m256i>(odd);
  const __m256i first = _mm256_unpacklo_epi32(e, o), second = _mm256_unpackhi_epi32(e, o);
  StoreLanes(first, a, b);
  StoreLanes(second, a + 16, b + 16);
}

__attribute__((target("avx2"))) inline void PackPair3(const uint8_t* q00, const uint8_t* q01, const uint8_t* q10,
                                                      const uint8_t* q11, uint8_t* out) {
  Words8 a_even, a_odd, b_even, b_odd, w[4];  // a: the w0 = 0 pieces, b: w0 = 1
  SplitEvenOdd(q00, q10, &a_even, &a_odd);
  SplitEvenOdd(q01, q11, &b_even, &b_odd);
  PairNibbleWordsOf(a_odd, b_even, &w[0], &w[2]);
  PairNibbleWordsOf(b_odd, a_even, &w[1], &w[3]);
  Transpose4x4BytesBySwaps(w);
  for (int t1 = 0; t1 < 4; ++t1) {
    HopperInterleaveGatheredAt(&w[t1]);
    StoreLanes(reinterpret_cast<__m256i>(w[t1]), out + 16 * t1, out + 64 + 16 * t1);
  }
}

__attribute__((target("avx2"))) inline void UnpackPair3(const uint8_t* in, uint8_t* q00, uint8_t* q01, uint8_t* q10,
                                                        uint8_t* q11) {
  Words8 w[4], a_even, a_odd, b_even, b_odd;
  for (int t1 = 0; t1 < 4; ++t1) {
    w[t1] = reinterpret_cast<Words8>(LoadLanes(in + 16 * t1, in + 64 + 16 * t1));
    HopperDeinterleaveGatheredAt(&w[t1]);
  }
  Transpose4x4BytesBySwaps(w);
  PairNibbleWordsOf(w[0], w[2], &a_odd, &b_even);
  PairNibbleWordsOf(w[1], w[3], &b_odd, &a_even);
  JoinEvenOdd(a_even, a_odd, q00, q10);
  JoinEvenOdd(b_even, b_odd, q01, q11);
}
#endif

template <int kMma>
inline void PackPair(const uint8_t* q00, const uint8_t* q01, const uint8_t* q10, const uint8_t* q11, uint8_t* out) {
#if defined(WPREP_NIBBLE_AVX2)
  if (kMma == 3 && cpu_nibble::HasAvx2()) {
    PackPair3(q00, q01, q10, q11, out);
    return;
  }
#endif
  const uint8_t* q[2][2] = {{q00, q01}, {q10, q11}};
  for (int s0 = 0; s0 < 2; ++s0) {
    uint32_t w0[8], w1[8], packed[16];
    std::memcpy(w0, q[s0][0], 32);
    std::memcpy(w1, q[s0][1], 32);
    HopperPackBlock<kMma>(w0, w1, packed);
    std::memcpy(out + 64 * s0, packed, 64);
  }
}

template <int kMma>
inline void UnpackPair(const uint8_t* in, uint8_t* q00, uint8_t* q01, uint8_t* q10, uint8_t* q11) {
#if defined(WPREP_NIBBLE_AVX2)
  if (kMma == 3 && cpu_nibble::HasAvx2()) {
    UnpackPair3(in, q00, q01, q10, q11);
    return;
  }
#endif
  uint8_t* q[2][2] = {{q00, q01}, {q10, q11}};
  for (int s0 = 0; s0 < 2; ++s0) {
    uint32_t packed[16], w0[8], w1[8];
    std::memcpy(packed, in + 64 * s0, 64);
    HopperUnpackBlock<kMma>(packed, w0, w1);
    std::memcpy(q[s0][0], w0, 32);
    std::memcpy(q[s0][1], w1, 32);
  }
}

inline bool Serves(const Geometry& g) {
  return (g.op == Op::kHopperSwizzle || g.op == Op::kHopperUnswizzle) && g.hopper_q_is_canonical &&
         (g.mma_version == 2 || g.mma_version == 3);
}

inline int64_t UnitCount(const Geometry& g) { return g.num_matrices * (g.hopper.rows_pad / 16); }

// Q row r's bytes [c0, c0 + 32): where they lie, or copied into `spare` with zeros past Q.
inline const uint8_t* Piece(const HopperTiling& t, const uint8_t* q, int64_t rs, int64_t r, int64_t c0,
                            uint8_t* spare) {
  if (r < t.q_rows && c0 + 32 <= t.q_cols) return q + r * rs + c0;
  std::memset(spare, 0, 32);
  if (r < t.q_rows && c0 < t.q_cols) std::memcpy(spare, q + r * rs + c0, static_cast<size_t>(t.q_cols - c0));
  return spare;
}

template <int kMma>
void UnitsOf(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const HopperTiling& t = g.hopper;
  const int64_t rs = g.in_stride[0];
  const int64_t per_matrix = t.rows_pad / 16, crs = t.cols_pad / 32;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / per_matrix, r0 = u - e * per_matrix;
    const uint8_t* q = in + g.InputMatrixOffset(e);
    uint8_t* o = out + e * g.out_matrix_bytes;
    for (int t0 = 0; t0 < 4; ++t0) {
      uint8_t* row = o + (4 * r0 + t0) * t.out_cols;
      const int64_t ra = 16 * r0 + 2 * t0;  // s0 = 0, w0 = 0; s0 adds 1, w0 adds 8
      for (int64_t cr = 0; cr < crs; ++cr) {
        uint8_t spare[4][32];
        PackPair<kMma>(Piece(t, q, rs, ra, 32 * cr, spare[0]), Piece(t, q, rs, ra + 8, 32 * cr, spare[1]),
                       Piece(t, q, rs, ra + 1, 32 * cr, spare[2]), Piece(t, q, rs, ra + 9, 32 * cr, spare[3]),
                       row + 128 * cr);
      }
    }
  }
}

// The unswizzle: each O chunk unpacked into its four Q pieces, written where they lie
// inside Q (dense rows of q_cols bytes); padding is not read back.
template <int kMma>
void UnswizzleUnitsOf(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const HopperTiling& t = g.hopper;
  const int64_t rs = g.in_stride[0];
  const int64_t per_matrix = t.rows_pad / 16, crs = t.cols_pad / 32;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / per_matrix, r0 = u - e * per_matrix;
    if (16 * r0 >= t.q_rows) continue;  // all padding
    const uint8_t* o = in + g.InputMatrixOffset(e);
    uint8_t* q = out + e * g.out_matrix_bytes;
    for (int t0 = 0; t0 < 4; ++t0) {
      const uint8_t* row = o + (4 * r0 + t0) * rs;
      const int64_t ra = 16 * r0 + 2 * t0;  // s0 = 0, w0 = 0; s0 adds 1, w0 adds 8
      for (int64_t cr = 0; cr < crs && 32 * cr < t.q_cols; ++cr) {
        uint8_t* at = q + ra * t.q_cols + 32 * cr;
        if (32 * cr + 32 <= t.q_cols && ra + 9 < t.q_rows) {  // whole pieces: straight into Q
          UnpackPair<kMma>(row + 128 * cr, at, at + 8 * t.q_cols, at + t.q_cols, at + 9 * t.q_cols);
          continue;
        }
        uint8_t pieces[4][32];
        UnpackPair<kMma>(row + 128 * cr, pieces[0], pieces[1], pieces[2], pieces[3]);
        const size_t n = static_cast<size_t>(std::min<int64_t>(32, t.q_cols - 32 * cr));
        const int64_t rows[4] = {0, 8, 1, 9};
        for (int i = 0; i < 4; ++i) {
          if (ra + rows[i] < t.q_rows) std::memcpy(at + rows[i] * t.q_cols, pieces[i], n);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// The other packing (mx_axis -1 from checkpoint order, mx_axis -2 from canonical order): the
// input as stored, X, is packed along Q's rows, so Q is X's nibble transpose (nibble_cpu.h):
// Q byte (r, c) = X nibble (2c, r) | X nibble (2c + 1, r) << 4. A step is a band of 128 Q rows
// by 32 Q bytes: 64 X rows x 64 bytes, staged, become a 128 x 32 piece of Q by eight nibble
// blocks, and the band's 32 O rows' 128 bytes are packed from it by PackPair. The
// unswizzle runs the same steps backwards (the nibble transpose is its own inverse).

inline bool ServesCross(const Geometry& g) {
#if defined(__SSE2__)
  return (g.op == Op::kHopperSwizzle || g.op == Op::kHopperUnswizzle) && !g.hopper_q_is_canonical &&
         (g.mma_version == 2 || g.mma_version == 3);
#else
  (void)g;
  return false;
#endif
}

inline constexpr int64_t kCrossBandRows = 128;  // Q rows of a band; rows_pad is a multiple
// A unit is up to 8 bands x 8 chunks of 32 Q bytes: X rows written or read in runs of 512
// bytes and O rows in runs of 1 KiB. (A band across all of Q's columns, one 64-byte piece of
// every X row, took twice the tiles' time: each piece a cache and TLB miss.)
inline constexpr int64_t kCrossGroup = 8;

inline int64_t CrossUnitCount(const Geometry& g) {
  return g.num_matrices * CeilDiv(g.hopper.rows_pad / kCrossBandRows, kCrossGroup) *
         CeilDiv(g.hopper.cols_pad / 32, kCrossGroup);
}

#if defined(__SSE2__)
// `rows` runs of `bytes` (at most 64) from src to dst, each side's runs a step apart: whole
// 64-byte runs as fixed-size copies, where a size known only at run time is a call each.
inline void CopyRuns(uint8_t* dst, int64_t dst_step, const uint8_t* src, int64_t src_step, int64_t rows,
                     int64_t bytes) {
  if (bytes == 64) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_step, src + r * src_step, 64);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_step, src + r * src_step, static_cast<size_t>(bytes));
}

// X rows x0 .. x0 + 63, bytes xb .. xb + 63, into 64-byte rows of `stage`, zeros past X. The
// nibble blocks then read lines 64 bytes apart: X's rows, N / 2 bytes apart, fall in a few
// L1 sets (4096 bytes apart: one), and each line would be fetched again for each 16 bytes.
inline void StageRows(const uint8_t* x, int64_t xs, int64_t x0, int64_t xb, int64_t rows, int64_t bytes,
                      uint8_t* stage) {
  if (rows < 64 || bytes < 64) std::memset(stage, 0, 64 * 64);
  CopyRuns(stage, 64, x + x0 * xs + xb, xs, rows, bytes);
}

// One step: Q rows of `band` x Q bytes 32 cr .. 32 cr + 31 (X rows 64 cr .., bytes 64 band ..),
// between X and the band's 32 O rows' 128 bytes at 128 cr.
template <int kMma, bool kSwizzle, class XByte, class OByte>
inline void CrossStep(const HopperTiling& t, XByte* x, int64_t xs, OByte* o, int64_t os, int64_t band, int64_t cr,
                      uint8_t* piece, uint8_t* stage) {
  constexpr int kSub = kCrossBandRows / 32;  // nibble blocks along Q's rows
  const int64_t x_rows = 2 * t.q_cols, x_bytes = t.q_rows / 2;
  const int64_t xb = band * (kCrossBandRows / 2), x0 = 64 * cr;
  const int64_t bytes = std::clamp<int64_t>(x_bytes - xb, 0, kCrossBandRows / 2);  // of each X row here
  const int64_t rows = std::clamp<int64_t>(x_rows - x0, 0, 64);
  o += band * (kCrossBandRows / 4) * os + 128 * cr;  // the band's 32 O rows at this chunk
  if (bytes == 0 || rows == 0) {  // all padding: zeros out, nothing back
    if constexpr (kSwizzle) {
      for (int r = 0; r < kCrossBandRows / 4; ++r) std::memset(o + r * os, 0, 128);
    }
    return;
  }
  // The next chunk's input (this band's, a band group later): lines no prefetcher sees coming.
  if constexpr (kSwizzle) {
    for (int64_t r = x0 + 64; r < std::min(x0 + 128, x_rows); ++r) cpu_nibble::Prefetch(x + r * xs + xb);
  } else if (128 * (cr + 1) < 4 * t.cols_pad) {
    for (int r = 0; r < kCrossBandRows / 4; ++r) {
      cpu_nibble::Prefetch(o + r * os + 128);
      cpu_nibble::Prefetch(o + r * os + 192);
    }
  }
  if constexpr (kSwizzle) {
    StageRows(x, xs, x0, xb, rows, bytes, stage);
    for (int sb = 0; sb < kSub; ++sb) {
      for (int h = 0; h < 2; ++h) {
        cpu_nibble::Block(cpu_nibble::RowsAt<const uint8_t>{stage + 32 * h * 64 + 16 * sb, 64},
                          cpu_nibble::RowsAt<uint8_t>{piece + 32 * 32 * sb + 16 * h, 32});
      }
    }
  }
  for (int r0 = 0; r0 < kCrossBandRows / 16; ++r0) {  // the Hopper units of 16 Q rows
    for (int t0 = 0; t0 < 4; ++t0) {
      auto* row = o + (4 * r0 + t0) * os;
      uint8_t* q0 = piece + 32 * (16 * r0 + 2 * t0);  // s0 = 0, w0 = 0; s0 adds a row, w0 8 rows
      if constexpr (kSwizzle) {
        PackPair<kMma>(q0, q0 + 8 * 32, q0 + 32, q0 + 9 * 32, row);
      } else {
        UnpackPair<kMma>(row, q0, q0 + 8 * 32, q0 + 32, q0 + 9 * 32);
      }
    }
  }
  if constexpr (!kSwizzle) {
    for (int sb = 0; sb < kSub; ++sb) {
      for (int h = 0; h < 2; ++h) {
        cpu_nibble::Block(cpu_nibble::RowsAt<const uint8_t>{piece + 32 * 32 * sb + 16 * h, 32},
                          cpu_nibble::RowsAt<uint8_t>{stage + 32 * h * 64 + 16 * sb, 64});
      }
    }
    CopyRuns(x + x0 * xs + xb, xs, stage, 64, rows, bytes);
  }
}

template <int kMma, bool kSwizzle>
void CrossUnitsOf(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const HopperTiling& t = g.hopper;
  const int64_t bands = t.rows_pad / kCrossBandRows, crs = t.cols_pad / 32;
  const int64_t band_groups = CeilDiv(bands, kCrossGroup), cr_groups = CeilDiv(crs, kCrossGroup);
  const int64_t xs = kSwizzle ? g.in_stride[0] : t.q_rows / 2;  // X's row step
  const int64_t os = kSwizzle ? t.out_cols : g.in_stride[0];    // O's row step
  alignas(64) uint8_t piece[kCrossBandRows * 32];               // Q rows of a band x 32 bytes
  alignas(64) uint8_t stage[64 * 64];                           // X rows of those bytes x 64 bytes
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / (band_groups * cr_groups), rest = u - e * band_groups * cr_groups;
    const int64_t cg = rest / band_groups, bg = rest - cg * band_groups;
    const int64_t band_end = std::min(bands, kCrossGroup * (bg + 1)), cr_end = std::min(crs, kCrossGroup * (cg + 1));
    const uint8_t* src = in + g.InputMatrixOffset(e);
    uint8_t* dst = out + e * g.out_matrix_bytes;
    for (int64_t cr = kCrossGroup * cg; cr < cr_end; ++cr) {
      for (int64_t band = kCrossGroup * bg; band < band_end; ++band) {
        if constexpr (kSwizzle) {
          CrossStep<kMma, true>(t, src, xs, dst, os, band, cr, piece, stage);  // X in, O out
        } else {
          CrossStep<kMma, false>(t, dst, xs, src, os, band, cr, piece, stage);  // O in, X out
        }
      }
    }
  }
}
#endif

inline void CrossUnits(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
#if defined(__SSE2__)
  const bool swizzle = g.op == Op::kHopperSwizzle;
  if (g.mma_version == 2) {
    swizzle ? CrossUnitsOf<2, true>(g, in, out, begin, end) : CrossUnitsOf<2, false>(g, in, out, begin, end);
  } else {
    swizzle ? CrossUnitsOf<3, true>(g, in, out, begin, end) : CrossUnitsOf<3, false>(g, in, out, begin, end);
  }
#else
  (void)g, (void)in, (void)out, (void)begin, (void)end;
#endif
}

inline void Units(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const bool swizzle = g.op == Op::kHopperSwizzle;
  if (g.mma_version == 2) {
    swizzle ? UnitsOf<2>(g, in, out, begin, end) : UnswizzleUnitsOf<2>(g, in, out, begin, end);
  } else {
    swizzle ? UnitsOf<3>(g, in, out, begin, end) : UnswizzleUnitsOf<3>(g, in, out, begin, end);
  }
}

}  // namespace wprep::cpu_hopper

#endif  // WPREP_KERNELS_SRC_HOPPER_CPU_H_
