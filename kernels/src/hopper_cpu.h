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

#include "layout_math.h"

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
          const size_t n = static_cast<size_t>(std::min<int64_t>(32, t.q_cols - 32 * cr));
          if (ra < t.q_rows) std::memcpy(q + ra * t.q_cols + 32 * cr, q0, n);
          if (ra + 8 < t.q_rows) std::memcpy(q + (ra + 8) * t.q_cols + 32 * cr, q1, n);
        }
      }
    }
  }
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
