// The Hopper scale swizzle of S with dense rows (mx_axis -1 of a dense scale tensor, and
// mx_axis -2 of the transposed view [..., K/32, N] of a checkpoint's [..., N, K/32], the
// call loaders make on sm_90) as a pass of its own on the GPU, and the unswizzle into S
// with dense rows (mx_axis -1, and mx_axis -2 where upstream's result is that view).
//
// An output row O[orow] (32C bytes) takes two 16-row runs of S (HopperScaleRunRow), and
// with dense rows a run is 16 * cols contiguous bytes that start 16-byte aligned wherever
// the matrix does: whatever cols is, the pass reads its input in aligned 16-byte words.
// The tiles (scale_tiles.h) read S a row at a time instead, and rows of cols bytes that
// are not a multiple of 4 (gpt-oss's 90 groups) are gathered byte by byte there.
#ifndef WPREP_KERNELS_SRC_HOPPER_SCALE_RUNS_H_
#define WPREP_KERNELS_SRC_HOPPER_SCALE_RUNS_H_

#include <cstdint>
#include <optional>

#include "layout_math.h"

namespace wprep {

// What both passes take of the geometry: S and its padding, per matrix.
struct HopperScaleShape {
  int64_t matrices = 0;  // E
  int64_t rows = 0, cols = 0;
  int64_t rows_pad = 0, cols_pad = 0;  // R, C
  int32_t num_warps = 1;
};

inline HopperScaleShape HopperScaleShapeOf(const Geometry& g) {
  const HopperScaleTiling& t = g.hopper_scale;
  return {g.num_matrices, t.rows, t.cols, t.rows_pad, t.cols_pad, t.num_warps};
}

// A launch takes at most this many blocks (grid x); a pass that needs more leaves the
// conversion to the tiles, which refuse it with the reason.
inline constexpr int64_t kHopperScalePassMaxBlocks = (int64_t{1} << 31) - 1;

struct HopperScaleRunsPass : HopperScaleShape {
  bool swizzle = true;         // S -> O; else O -> S (the unswizzle, padding not read back)
  int32_t rows_per_block = 1;  // O rows one thread block moves at a time
  int64_t Blocks() const { return (matrices * (rows_pad / 32) + rows_per_block - 1) / rows_per_block; }
};

// The widest S row (in groups) the pass stages: a block holds rows_per_block x 32 rows of
// cols bytes in shared memory, and keeps its loads at <= kHopperScaleRunsPieces 16-byte
// words a thread.
inline constexpr int kHopperScaleRunsThreads = 256;
inline constexpr int kHopperScaleRunsPieces = 4;
inline constexpr int64_t kHopperScaleRunsMaxCols =
    int64_t{kHopperScaleRunsThreads} * kHopperScaleRunsPieces / 2;  // 512

// The pass for a conversion's geometry when it is the Hopper scale swizzle from, or the
// unswizzle into, dense S rows of at most 512 groups, the input's matrices back to back and
// both buffers 16-byte aligned (each run then is); else nullopt (the tiles run).
inline std::optional<HopperScaleRunsPass> HopperScaleRunsPassOf(const Geometry& g, const void* in,
                                                               const void* out) {
  const HopperScaleTiling& t = g.hopper_scale;
  const bool swizzle = g.op == Op::kHopperScaleSwizzle;
  if ((!swizzle && g.op != Op::kHopperScaleUnswizzle) || g.scale_access != ScaleAccess::kRows ||
      g.scale_stride[1] != 1 || g.scale_stride[0] != t.cols || t.cols < 1 || t.cols > kHopperScaleRunsMaxCols ||
      t.rows < 1 || t.cols_pad % 2 != 0 || reinterpret_cast<uintptr_t>(in) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return std::nullopt;
  }
  // S side: matrices of rows x cols bytes, each a 16-byte multiple where there are several.
  const int64_t matrix = t.rows * t.cols, storage = t.out_rows * t.out_cols;
  if (g.num_matrices > 1 && matrix % 16 != 0) return std::nullopt;
  if (g.out_matrix_bytes != (swizzle ? storage : matrix)) return std::nullopt;
  // The input: S (swizzle) or the storage O with rows of out_cols bytes (unswizzle), its
  // matrices back to back.
  if (!swizzle && g.in_stride[0] != t.out_cols) return std::nullopt;
  if (!InputMatricesBackToBack(g, swizzle ? matrix : storage)) return std::nullopt;
  HopperScaleRunsPass p;
  static_cast<HopperScaleShape&>(p) = HopperScaleShapeOf(g);
  p.swizzle = swizzle;
  // A run is cols 16-byte words: as many O rows (2 runs each) as keep every thread at
  // kHopperScaleRunsPieces loads or fewer.
  const int64_t per_block = int64_t{kHopperScaleRunsThreads} * kHopperScaleRunsPieces / (2 * t.cols);
  p.rows_per_block = static_cast<int32_t>(per_block < 1 ? 1 : (per_block > 16 ? 16 : per_block));
  if (p.Blocks() > kHopperScalePassMaxBlocks) return std::nullopt;
  return p;
}

// The Hopper scale swizzle of S with dense columns (mx_axis -1 of the transposed view, and
// mx_axis -2 of a dense tensor): a block takes the num_warps O rows of one 32*num_warps-row
// band of S over cols_per_block columns, whose S bytes are each column's rows of the band:
// with the band holding every row (rows <= 32 * num_warps) that is one contiguous run of
// the input, staged as it lies (smem_stride = rows); otherwise runs of 32 * num_warps
// bytes a column (rows a multiple of 16), staged smem_stride = 32 * num_warps apart.
struct HopperScaleColumnsPass : HopperScaleShape {
  int32_t cols_per_block = 16;
  int32_t smem_stride = 0;
  bool one_band = false;
  int64_t Blocks() const {
    return matrices * (rows_pad / (32 * int64_t{num_warps})) * ((cols_pad + cols_per_block - 1) / cols_per_block);
  }
};

inline constexpr int64_t kHopperScaleColumnsSmem = 16 * 1024;

inline std::optional<HopperScaleColumnsPass> HopperScaleColumnsPassOf(const Geometry& g, const void* in,
                                                                     const void* out) {
  const HopperScaleTiling& t = g.hopper_scale;
  const int64_t band = 32 * int64_t{t.num_warps};
  if (g.op != Op::kHopperScaleSwizzle || g.scale_access != ScaleAccess::kColumns || g.scale_stride[0] != 1 ||
      g.scale_stride[1] != t.rows || t.rows < 2 || t.rows % 2 != 0 || t.cols < 1 || band > 512 ||
      g.out_matrix_bytes != t.out_rows * t.out_cols || t.cols_pad % 2 != 0 ||
      reinterpret_cast<uintptr_t>(in) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return std::nullopt;
  }
  // Columns of at most 256 rows (the scale groups of the mx_axis -1 views loaders would
  // pass): there the pass measured 1.2-1.8x faster than the tiles on an H100. Columns of a
  // multiple of 128 rows would put every staged column on the same shared-memory bank, and
  // longer ones (mx_axis -2 of a dense tensor: N rows) measured slower than the tiles.
  if (t.rows > 256 || t.rows % 128 == 0) return std::nullopt;
  const bool one_band = t.rows <= band;
  if (!one_band && t.rows % 16 != 0) return std::nullopt;
  const int64_t matrix = t.rows * t.cols;
  if (g.num_matrices > 1 && matrix % 16 != 0) return std::nullopt;
  if (!InputMatricesBackToBack(g, matrix)) return std::nullopt;
  HopperScaleColumnsPass p;
  static_cast<HopperScaleShape&>(p) = HopperScaleShapeOf(g);
  p.one_band = one_band;
  p.smem_stride = static_cast<int32_t>(one_band ? t.rows : band);
  // A multiple of 16 columns (the staged run of a one-band block starts 16-byte aligned),
  // at most 512, whose bytes fit the staging.
  const int64_t fit = kHopperScaleColumnsSmem / p.smem_stride / 16 * 16;
  p.cols_per_block = static_cast<int32_t>(fit < 16 ? 16 : (fit > 512 ? 512 : fit));
  if (p.Blocks() > kHopperScalePassMaxBlocks) return std::nullopt;
  return p;
}

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_HOPPER_SCALE_RUNS_H_
