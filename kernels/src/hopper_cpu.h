// The Hopper value swizzle and unswizzle on the CPU when Q is the canonical side as it is
// (mx_axis -1 with packing -1, mx_axis -2 with checkpoint order): a unit of 16 Q rows makes
// (or is made from) 4 whole O rows, each 64-byte block packed by the word-level
// HopperPackBlock from its two 32-byte Q pieces (HopperUnpackBlock the other way), instead of
// the tiles' emulation of a GPU block's threads.
#ifndef WPREP_KERNELS_SRC_HOPPER_CPU_H_
#define WPREP_KERNELS_SRC_HOPPER_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "layout_math.h"
#include "nibble_cpu.h"

namespace wprep::cpu_hopper {

inline bool Serves(const Geometry& g) {
  return (g.op == Op::kHopperSwizzle || g.op == Op::kHopperUnswizzle) && g.hopper_q_is_canonical &&
         (g.mma_version == 2 || g.mma_version == 3);
}

inline int64_t UnitCount(const Geometry& g) { return g.num_matrices * (g.hopper.rows_pad / 16); }

// Q row r's bytes [c0, c0 + 32) as 8 words, zeros past Q.
inline void LoadPiece(const HopperTiling& t, const uint8_t* q, int64_t rs, int64_t r, int64_t c0, uint32_t* w) {
  if (r < t.q_rows && c0 + 32 <= t.q_cols) {
    std::memcpy(w, q + r * rs + c0, 32);
    return;
  }
  uint8_t bytes[32] = {};
  if (r < t.q_rows && c0 < t.q_cols) std::memcpy(bytes, q + r * rs + c0, static_cast<size_t>(t.q_cols - c0));
  std::memcpy(w, bytes, 32);
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
      for (int s0 = 0; s0 < 2; ++s0) {
        const int64_t ra = 16 * r0 + 2 * t0 + s0;  // w0 = 0; the w0 = 1 row is 8 below
        for (int64_t cr = 0; cr < crs; ++cr) {
          uint32_t q0[8], q1[8], packed[16];
          LoadPiece(t, q, rs, ra, 32 * cr, q0);
          LoadPiece(t, q, rs, ra + 8, 32 * cr, q1);
          HopperPackBlock<kMma>(q0, q1, packed);
          std::memcpy(row + 128 * cr + 64 * s0, packed, 64);
        }
      }
    }
  }
}

// The unswizzle: each O block unpacked (HopperUnpackBlock) into its two Q pieces, written
// where they lie inside Q (dense rows of q_cols bytes); padding is not read back.
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
      for (int s0 = 0; s0 < 2; ++s0) {
        const int64_t ra = 16 * r0 + 2 * t0 + s0;
        for (int64_t cr = 0; cr < crs && 32 * cr < t.q_cols; ++cr) {
          uint32_t packed[16], q0[8], q1[8];
          std::memcpy(packed, row + 128 * cr + 64 * s0, 64);
          HopperUnpackBlock<kMma>(packed, q0, q1);
          if (32 * cr + 32 <= t.q_cols && ra + 8 < t.q_rows) {  // whole pieces: fixed-size copies
            std::memcpy(q + ra * t.q_cols + 32 * cr, q0, 32);
            std::memcpy(q + (ra + 8) * t.q_cols + 32 * cr, q1, 32);
            continue;
          }
          const size_t n = static_cast<size_t>(std::min<int64_t>(32, t.q_cols - 32 * cr));
          if (ra < t.q_rows) std::memcpy(q + ra * t.q_cols + 32 * cr, q0, n);
          if (ra + 8 < t.q_rows) std::memcpy(q + (ra + 8) * t.q_cols + 32 * cr, q1, n);
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
// blocks, and the band's 32 O rows' 128 bytes are packed from it by HopperPackBlock. The
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
      for (int s0 = 0; s0 < 2; ++s0) {
        uint8_t* q0 = piece + 32 * (16 * r0 + 2 * t0 + s0);  // w0 = 0; the w0 = 1 row is 8 below
        uint32_t w0[8], w1[8], packed[16];
        if constexpr (kSwizzle) {
          std::memcpy(w0, q0, 32);
          std::memcpy(w1, q0 + 8 * 32, 32);
          HopperPackBlock<kMma>(w0, w1, packed);
          std::memcpy(row + 64 * s0, packed, 64);
        } else {
          std::memcpy(packed, row + 64 * s0, 64);
          HopperUnpackBlock<kMma>(packed, w0, w1);
          std::memcpy(q0, w0, 32);
          std::memcpy(q0 + 8 * 32, w1, 32);
        }
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
