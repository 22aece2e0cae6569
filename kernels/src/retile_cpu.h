// Blackwell retile on the CPU: every K-packed arrangement to another (shuffled tiles, the
// blackwell_value rows, checkpoint order) moves whole bytes, and an output tile row of
// tile_k bytes is a few contiguous runs of the input (split where the input's own tiles
// split K). So each output row is memcpy'd run by run, zeros past the tensor, instead of
// the tiles' per-byte emulation of a GPU block.
#ifndef WPREP_KERNELS_SRC_RETILE_CPU_H_
#define WPREP_KERNELS_SRC_RETILE_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "layout_math.h"

namespace wprep::cpu_retile {

inline bool Serves(const Geometry& g) { return g.op == Op::kBlackwellRetile; }

// Output row piece (n, [k0, k0 + tile_k)) into dst: the input's runs, zeros past the tensor.
inline void CopyRow(const Geometry& g, const uint8_t* src, int64_t n, int64_t k0, uint8_t* dst) {
  const BlackwellTiling& o = g.out_tiling;
  const BlackwellTiling& i = g.in_tiling;
  const int64_t valid_k = n < g.n ? std::clamp<int64_t>(g.kp - k0, 0, o.tile_k) : 0;
  int64_t k = 0;
  while (k < valid_k) {
    const int64_t at = k0 + k;
    const int64_t run = std::min(valid_k - k, i.tile_k - at % i.tile_k);
    std::memcpy(dst + k, src + BlackwellOffset(i, g.in_stride, n, at), static_cast<size_t>(run));
    k += run;
  }
  if (k < o.tile_k) std::memset(dst + k, 0, static_cast<size_t>(o.tile_k - k));
}

// Output tiles [begin, end) of all matrices (tile u: matrix u / tiles, then kt, nt in the
// output's memory order): what streams the output when the input is tiled along K too.
inline void Tiles(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const BlackwellTiling& o = g.out_tiling;
  const int64_t per_matrix = o.ntk * o.ntn;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / per_matrix, t = u - e * per_matrix;
    const int64_t kt = t / o.ntn, nt = t - kt * o.ntn;
    const uint8_t* src = in + g.InputMatrixOffset(e);
    uint8_t* dst = out + e * g.out_matrix_bytes + t * o.tile_n * o.tile_k;
    for (int64_t nn = 0; nn < o.tile_n; ++nn, dst += o.tile_k) {
      CopyRow(g, src, nt * o.tile_n + nn, kt * o.tile_k, dst);
    }
  }
}

// Rows per unit of work: the output rows nn of one tile column nt, in blocks.
inline constexpr int64_t kRowsPerUnit = 64;

inline int64_t UnitsPerMatrix(const Geometry& g) {
  const BlackwellTiling& o = g.out_tiling;
  return o.ntn * ((o.tile_n + kRowsPerUnit - 1) / kRowsPerUnit);
}

inline int64_t UnitCount(const Geometry& g) { return g.num_matrices * UnitsPerMatrix(g); }

// Row order (Units) when the input holds each row's K bytes in one run (checkpoint order,
// blackwell_value), else tile order (Tiles).
inline bool RowOrder(const Geometry& g) { return g.in_tiling.ntk <= 1; }

// Units [begin, end): unit u is matrix u / UnitsPerMatrix, then a tile column nt and a block
// of its rows. A row n is read along K in order (each of its output tiles kt in turn), so a
// row-major input (checkpoint order, blackwell_value) streams, and the writes land a
// tile's row at a time.
inline void Units(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const BlackwellTiling& o = g.out_tiling;
  const int64_t per_matrix = UnitsPerMatrix(g);
  const int64_t blocks = per_matrix / o.ntn;
  const int64_t tile_bytes = o.tile_n * o.tile_k, kt_stride = o.ntn * tile_bytes;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / per_matrix, t = u - e * per_matrix;
    const int64_t nt = t / blocks, nn0 = (t - nt * blocks) * kRowsPerUnit;
    const uint8_t* src = in + g.InputMatrixOffset(e);
    uint8_t* base = out + e * g.out_matrix_bytes + nt * tile_bytes;
    for (int64_t nn = nn0; nn < std::min(o.tile_n, nn0 + kRowsPerUnit); ++nn) {
      const int64_t n = nt * o.tile_n + nn;
      for (int64_t kt = 0; kt < o.ntk; ++kt) CopyRow(g, src, n, kt * o.tile_k, base + kt * kt_stride + nn * o.tile_k);
    }
  }
}

inline int64_t TileCount(const Geometry& g) { return g.num_matrices * g.out_tiling.ntk * g.out_tiling.ntn; }

// The retile `g`: parallel(units, fn) runs fn(begin, end) over [0, units).
template <class ParallelFn>
void Run(const Geometry& g, const uint8_t* in, uint8_t* out, const ParallelFn& parallel) {
  if (RowOrder(g)) {
    parallel(UnitCount(g), [&](int64_t b, int64_t e) { Units(g, in, out, b, e); });
  } else {
    parallel(TileCount(g), [&](int64_t b, int64_t e) { Tiles(g, in, out, b, e); });
  }
}

}  // namespace wprep::cpu_retile

#endif  // WPREP_KERNELS_SRC_RETILE_CPU_H_
