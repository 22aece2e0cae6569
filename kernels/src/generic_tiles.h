// Per-byte Blackwell tiles for tilings whose tile_k is not a multiple of 16 (a 16-byte
// chunk may then straddle two storage tiles). Correct for every tiling, slower than
// fast_tiles.h, which serves the common ones. A tile covers kBlackwellTileN value
// columns x kBlackwellTileK bytes along K, staged through a 4 KiB buffer.
#ifndef WPREP_KERNELS_SRC_GENERIC_TILES_H_
#define WPREP_KERNELS_SRC_GENERIC_TILES_H_

#include "fast_tiles.h"

namespace wprep::tiles {

inline constexpr int kBlackwellTileN = 64;
inline constexpr int kBlackwellTileK = 64;
inline constexpr int kGenericTileBytes = kBlackwellTileN * kBlackwellTileK;

// Canonical rows [row0, row0 + kRows) x bytes [col0, col0 + kWidth) <-> buf[kRows][kWidth].
template <int kRows, int kWidth>
WPREP_HD void GenericLoadCanonical(const Geometry& g, const uint8_t* base, int64_t row0,
                                   int64_t col0, uint8_t* buf, int tid, int nthreads) {
  for (int q = tid; q < kRows * kWidth; q += nthreads) {
    const int64_t row = row0 + q / kWidth, col = col0 + q % kWidth;
    buf[q] = row < g.d0 && col < g.d1b ? base[row * g.in_stride[0] + col] : 0;
  }
}

template <int kRows, int kWidth, class ByteFn>
WPREP_HD void GenericStoreCanonical(const Geometry& g, uint8_t* base, int64_t row0,
                                    int64_t col0, ByteFn byte_fn, int tid, int nthreads) {
  for (int q = tid; q < kRows * kWidth; q += nthreads) {
    const int rl = q / kWidth, cl = q % kWidth;
    const int64_t row = row0 + rl, col = col0 + cl;
    if (row < g.d0 && col < g.d1b) base[row * g.d1b + col] = byte_fn(rl, cl);
  }
}

// Input-tiling bytes with n < N and k < K/2 (zero elsewhere: input padding is ignored).
WPREP_HD void GenericLoadStorage(const Geometry& g, const uint8_t* base, int64_t n0,
                                 int64_t k0, uint8_t* buf, int tid, int nthreads) {
  for (int q = tid; q < kGenericTileBytes; q += nthreads) {
    const int64_t n = n0 + q / kBlackwellTileK, k = k0 + q % kBlackwellTileK;
    buf[q] = n < g.n && k < g.kp ? base[BlackwellOffset(g.in_tiling, g.in_stride, n, k)] : 0;
  }
}

// Output-tiling bytes of the window inside the padded extent; byte_fn(nl, kl).
template <class ByteFn>
WPREP_HD void GenericStoreStorage(const Geometry& g, uint8_t* base, int64_t n0,
                                  int64_t k0, ByteFn byte_fn, int tid, int nthreads) {
  const BlackwellTiling& t = g.out_tiling;
  for (int q = tid; q < kGenericTileBytes; q += nthreads) {
    const int nl = q / kBlackwellTileK, kl = q % kBlackwellTileK;
    const int64_t n = n0 + nl, k = k0 + kl;
    if (n < t.ntn * t.tile_n && k < t.kpad) base[BlackwellOffset(t, nullptr, n, k)] = byte_fn(nl, kl);
  }
}

template <Op kOp>
struct GenericTile {
  using Fetched = Regs;
  static constexpr int kSmemWords = kGenericTileBytes / 4;
  static constexpr bool kTwoStage = true;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = 0;  // all loads happen in Stage
  static constexpr int kWidth = kBlackwellTileN / 2;  // canonical bytes per window row

  // Windows over (n, k): the output tiling's padded extent for swizzle and retile, the
  // tensor for unswizzle.
  WPREP_HD static int64_t TilesN(const Geometry& g) {
    return CeilDiv(kOp == Op::kBlackwellUnswizzle ? g.n : g.out_tiling.ntn * g.out_tiling.tile_n,
                   kBlackwellTileN);
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    const int64_t k_extent = kOp == Op::kBlackwellUnswizzle ? g.kp : g.out_tiling.kpad;
    return TilesN(g) * CeilDiv(k_extent, kBlackwellTileK);
  }

  // Grid rows walk K, columns N.
  WPREP_HD static int64_t TilesAlongB(const Geometry& g) { return TilesN(g); }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, b * kBlackwellTileN, a * kBlackwellTileK);
  }

  // The fast-tile steps (fast_tiles.h): all input is read in Stage.
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry&, const TileCtx&, int, Access, Ld&) {}
  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access, const Regs&,
                             uint32_t* smem) {
    const int tid = vt, nthreads = kTileThreads;
    const int64_t n0 = ctx.a0, k0 = ctx.b0;
    auto* buf = reinterpret_cast<uint8_t*>(smem);
    if constexpr (kOp == Op::kBlackwellSwizzle) {
      GenericLoadCanonical<2 * kBlackwellTileK, kWidth>(g, ctx.in, 2 * k0, n0 / 2, buf, tid, nthreads);
    } else {
      GenericLoadStorage(g, ctx.in, n0, k0, buf, tid, nthreads);
    }
  }

  WPREP_HD static void Store(const Geometry& g, const TileCtx& ctx, int vt, Access,
                             uint32_t* smem) {
    const int tid = vt, nthreads = kTileThreads;
    const int64_t n0 = ctx.a0, k0 = ctx.b0;
    const auto* buf = reinterpret_cast<const uint8_t*>(smem);
    if constexpr (kOp == Op::kBlackwellSwizzle) {
      // Storage (n, k) = PairNibbles(canonical (2k, n/2), (2k + 1, n/2), n & 1).
      auto byte = [buf](int nl, int kl) -> uint8_t {
        return PairNibbles(buf[2 * kl * kWidth + (nl >> 1)], buf[(2 * kl + 1) * kWidth + (nl >> 1)],
                           nl & 1);
      };
      GenericStoreStorage(g, ctx.out, n0, k0, byte, tid, nthreads);
    } else if constexpr (kOp == Op::kBlackwellUnswizzle) {
      // Canonical (i, jb) = PairNibbles(storage (2jb, i/2), (2jb + 1, i/2), i & 1).
      auto byte = [buf](int il, int jbl) -> uint8_t {
        return PairNibbles(buf[2 * jbl * kBlackwellTileK + (il >> 1)],
                           buf[(2 * jbl + 1) * kBlackwellTileK + (il >> 1)], il & 1);
      };
      GenericStoreCanonical<2 * kBlackwellTileK, kWidth>(g, ctx.out, 2 * k0, n0 / 2, byte, tid,
                                                         nthreads);
    } else {
      auto byte = [buf](int nl, int kl) -> uint8_t { return buf[nl * kBlackwellTileK + kl]; };
      GenericStoreStorage(g, ctx.out, n0, k0, byte, tid, nthreads);
    }
  }
};

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_GENERIC_TILES_H_
