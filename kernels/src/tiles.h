// One tile of one conversion: the body shared by the CUDA kernels (a block of
// kTileThreads threads) and the CPU engine (one thread). A tile is two phases:
//   Load:  stage a kTileBytes piece of the input in `smem` (16-byte chunks, zero-filled
//          outside the tensor);
//   Store: compute each 16-byte output chunk from `smem` with the layout_math.h
//          mappings and write it.
// Thread `tid` of `nthreads` handles chunks tid, tid + nthreads, ...; the caller puts a
// barrier between the phases (and after Store, before the buffer is reused).
#ifndef WPREP_KERNELS_SRC_TILES_H_
#define WPREP_KERNELS_SRC_TILES_H_

#include <cstdint>
#include <cstring>

#include "wprep/kernels/layout_math.h"

namespace wprep::tiles {

inline constexpr int kChunk = 16;
inline constexpr int kChunks = kTileBytes / kChunk;

// Whether 16-byte accesses are aligned for the input and output of one launch.
struct Access {
  bool vec_in = false;
  bool vec_out = false;
};

inline bool Aligned16(int64_t v) { return v % kChunk == 0; }
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % kChunk == 0; }

// Decides 16-byte access for `g` with these buffers. Chunks that straddle a tensor edge
// or a Blackwell tile edge fall back to bytes regardless.
inline Access ChooseAccess(const Geometry& g, const void* in, const void* out) {
  Access a;
  a.vec_in = Aligned16(in);
  for (int i = 0; i < g.lead_rank; ++i) a.vec_in = a.vec_in && Aligned16(g.in_lead_stride[i]);
  const int inner = (g.op == Op::kBlackwellUnswizzle || g.op == Op::kBlackwellRetile) ? 3 : 1;
  for (int i = 0; i < inner; ++i) a.vec_in = a.vec_in && Aligned16(g.in_stride[i]);
  if (inner == 3) a.vec_in = a.vec_in && Aligned16(g.in_tiling.tile_k);
  a.vec_out = Aligned16(out) && Aligned16(g.out_matrix_bytes);
  if (g.op == Op::kHopperUnswizzle || g.op == Op::kBlackwellUnswizzle) {
    a.vec_out = a.vec_out && Aligned16(g.d1b);
  } else if (g.op != Op::kHopperSwizzle) {
    a.vec_out = a.vec_out && Aligned16(g.out_tiling.tile_k);
  }
  return a;
}

// 16-byte and 4-byte moves. Device code uses native vector types; host code memcpy
// (no aliasing assumptions; compilers emit single moves).
WPREP_HD void Copy16(uint8_t* dst, const uint8_t* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#else
  std::memcpy(dst, src, kChunk);
#endif
}
WPREP_HD uint32_t LoadWord(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
#endif
}
WPREP_HD void StoreWord(uint8_t* p, uint32_t w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = w;
#else
  std::memcpy(p, &w, 4);
#endif
}

// Writes a finished 16-byte chunk: one vector store when allowed, else `valid` bytes.
WPREP_HD void PutChunk(uint8_t* dst, const uint8_t* chunk, int valid, bool vec) {
  if (vec && valid == kChunk) {
    Copy16(dst, chunk);
  } else {
    for (int j = 0; j < valid; ++j) dst[j] = chunk[j];
  }
}

struct TileCoord {
  int64_t e, a, b;
};

WPREP_HD TileCoord DecodeTile(const Geometry& g, int64_t t) {
  TileCoord c;
  c.b = t % g.tiles_b;
  t /= g.tiles_b;
  c.a = t % g.tiles_a;
  c.e = t / g.tiles_a;
  return c;
}

// ---------------------------------------------------------------------------------------
// Canonical side: a kRows x kWidth window of one canonical matrix at (row0, col0).

template <int kRows, int kWidth>
WPREP_HD void LoadCanonical(const Geometry& g, const uint8_t* in, int64_t e, int64_t row0,
                            int64_t col0, uint8_t* smem, int tid, int nthreads, bool vec) {
  static_assert(kRows * kWidth == kTileBytes && kWidth % kChunk == 0);
  constexpr int kPerRow = kWidth / kChunk;
  const uint8_t* base = in + g.InputMatrixOffset(e);
  for (int q = tid; q < kChunks; q += nthreads) {
    const int rl = q / kPerRow, cl = (q % kPerRow) * kChunk;
    const int64_t row = row0 + rl, col = col0 + cl;
    int64_t valid = row < g.d0 ? g.d1b - col : 0;
    valid = valid < 0 ? 0 : (valid > kChunk ? kChunk : valid);
    uint8_t* dst = smem + rl * kWidth + cl;
    const uint8_t* src = base + row * g.in_stride[0] + col;
    if (vec && valid == kChunk) {
      Copy16(dst, src);
    } else {
      for (int j = 0; j < kChunk; ++j) dst[j] = j < valid ? src[j] : 0;
    }
  }
}

// Writes the part of the window inside the matrix; byte_fn(rl, cl) gives each byte.
template <int kRows, int kWidth, class ByteFn>
WPREP_HD void StoreCanonical(const Geometry& g, uint8_t* out, int64_t e, int64_t row0,
                             int64_t col0, ByteFn byte_fn, int tid, int nthreads, bool vec) {
  static_assert(kRows * kWidth == kTileBytes && kWidth % kChunk == 0);
  constexpr int kPerRow = kWidth / kChunk;
  uint8_t* base = out + e * g.out_matrix_bytes;
  for (int q = tid; q < kChunks; q += nthreads) {
    const int rl = q / kPerRow, cl = (q % kPerRow) * kChunk;
    const int64_t row = row0 + rl, col = col0 + cl;
    int64_t valid = row < g.d0 ? g.d1b - col : 0;
    if (valid <= 0) continue;
    valid = valid > kChunk ? kChunk : valid;
    alignas(16) uint8_t chunk[kChunk];
    for (int j = 0; j < kChunk; ++j) chunk[j] = byte_fn(rl, cl + j);
    PutChunk(base + row * g.d1b + col, chunk, static_cast<int>(valid), vec);
  }
}

// ---------------------------------------------------------------------------------------
// Hopper storage side: O rows [orow0, orow0 + kTileBytes / kWidth), bytes
// [ocol0, ocol0 + kWidth), always inside the padded storage.

template <int kWidth>
WPREP_HD void LoadHopperStorage(const Geometry& g, const uint8_t* in, int64_t e, int64_t orow0,
                                int64_t ocol0, uint8_t* smem, int tid, int nthreads, bool vec) {
  constexpr int kPerRow = kWidth / kChunk;
  const uint8_t* base = in + g.InputMatrixOffset(e);
  for (int q = tid; q < kChunks; q += nthreads) {
    const int rl = q / kPerRow, cl = (q % kPerRow) * kChunk;
    const uint8_t* src = base + (orow0 + rl) * g.in_stride[0] + ocol0 + cl;
    alignas(16) uint8_t chunk[kChunk];
    if (vec) {
      Copy16(chunk, src);
    } else {
      for (int j = 0; j < kChunk; ++j) chunk[j] = src[j];
    }
    uint8_t* dst = smem + rl * kWidth + cl;
    for (int w = 0; w < kChunk; w += 4) StoreWord(dst + w, HopperDeinterleaveWord(LoadWord(chunk + w)));
  }
}

// Writes the whole window; q_fn(r, c) gives the Q byte at tile-local (r, c).
template <int kWidth, int kMma, class QFn>
WPREP_HD void StoreHopperStorage(const Geometry& g, uint8_t* out, int64_t e, int64_t orow0,
                                 int64_t ocol0, QFn q_fn, int tid, int nthreads, bool vec) {
  constexpr int kPerRow = kWidth / kChunk;
  const int64_t row_bytes = 4 * g.q_cols_pad;
  uint8_t* base = out + e * g.out_matrix_bytes + orow0 * row_bytes + ocol0;
  for (int q = tid; q < kChunks; q += nthreads) {
    const int orl = q / kPerRow, ocl = (q % kPerRow) * kChunk;
    alignas(16) uint8_t chunk[kChunk];
    for (int w = 0; w < kChunk; w += 4) {
      uint32_t x = 0;
      for (int j = 0; j < 4; ++j) {
        int r, c;
        HopperSource<int>(orl, ocl + w + j, kMma, &r, &c);
        x |= static_cast<uint32_t>(q_fn(r, c)) << (8 * j);
      }
      StoreWord(chunk + w, HopperInterleaveWord(x));
    }
    PutChunk(base + orl * row_bytes + ocl, chunk, kChunk, vec);
  }
}

// ---------------------------------------------------------------------------------------
// Blackwell storage side: value columns [n0, n0 + kBlackwellTileN), K bytes
// [k0, k0 + kBlackwellTileK); staged as smem[n][k].

// Reads the input tiling's bytes with n < N and k < K/2 (zero elsewhere: padding is
// ignored on input).
WPREP_HD void LoadBlackwellStorage(const Geometry& g, const uint8_t* in, int64_t e, int64_t n0,
                                   int64_t k0, uint8_t* smem, int tid, int nthreads, bool vec) {
  constexpr int kPerRow = kBlackwellTileK / kChunk;
  const uint8_t* base = in + g.InputMatrixOffset(e);
  for (int q = tid; q < kChunks; q += nthreads) {
    const int nl = q / kPerRow, kl = (q % kPerRow) * kChunk;
    const int64_t n = n0 + nl, k = k0 + kl;
    uint8_t* dst = smem + nl * kBlackwellTileK + kl;
    if (vec && n < g.n && k + kChunk <= g.kp) {
      Copy16(dst, base + BlackwellStridedOffset(g.in_tiling, g.in_stride, n, k));
    } else {
      for (int j = 0; j < kChunk; ++j) {
        dst[j] = n < g.n && k + j < g.kp
                     ? base[BlackwellStridedOffset(g.in_tiling, g.in_stride, n, k + j)]
                     : 0;
      }
    }
  }
}

// Writes the window's part of the output tiling's padded extent; byte_fn(nl, kl).
template <class ByteFn>
WPREP_HD void StoreBlackwellStorage(const Geometry& g, uint8_t* out, int64_t e, int64_t n0,
                                    int64_t k0, ByteFn byte_fn, int tid, int nthreads, bool vec) {
  constexpr int kPerRow = kBlackwellTileK / kChunk;
  const BlackwellTiling& t = g.out_tiling;
  const int64_t n_extent = t.ntn * t.tile_n;
  uint8_t* base = out + e * g.out_matrix_bytes;
  for (int q = tid; q < kChunks; q += nthreads) {
    const int nl = q / kPerRow, kl = (q % kPerRow) * kChunk;
    const int64_t n = n0 + nl, k = k0 + kl;
    if (n >= n_extent) continue;
    alignas(16) uint8_t chunk[kChunk];
    for (int j = 0; j < kChunk; ++j) chunk[j] = byte_fn(nl, kl + j);
    if (vec) {
      Copy16(base + BlackwellOffset(t, n, k), chunk);
    } else {
      for (int j = 0; j < kChunk; ++j) base[BlackwellOffset(t, n, k + j)] = chunk[j];
    }
  }
}

// ---------------------------------------------------------------------------------------
// The tiles of each conversion.

template <int kMx>
struct HopperShape {
  static constexpr int kRows = HopperTileRows(kMx);  // Q rows per tile
  static constexpr int kCols = HopperTileCols(kMx);  // Q cols per tile
  static constexpr int kOWidth = 4 * kCols;          // O bytes per row per tile
};

template <Op kOp, int kMx, int kMma>
struct Tile;

// Hopper swizzle. smem holds the canonical 64x64 window that feeds the tile's Q: for
// mx_axis -1 that window is Q itself; for -2 its rows are Q's column pairs.
template <int kMx, int kMma>
struct Tile<Op::kHopperSwizzle, kMx, kMma> {
  using S = HopperShape<kMx>;
  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, TileCoord t, uint8_t* smem,
                            int tid, int nthreads, Access acc) {
    const int64_t qr0 = t.a * S::kRows, qc0 = t.b * S::kCols;
    if constexpr (kMx == -1) {
      LoadCanonical<64, 64>(g, in, t.e, qr0, qc0, smem, tid, nthreads, acc.vec_in);
    } else {
      LoadCanonical<64, 64>(g, in, t.e, 2 * qc0, qr0 / 2, smem, tid, nthreads, acc.vec_in);
    }
  }
  WPREP_HD static void Store(const Geometry& g, uint8_t* out, TileCoord t, const uint8_t* smem,
                             int tid, int nthreads, Access acc) {
    auto q = [smem](int r, int c) -> uint8_t {
      if constexpr (kMx == -1) {
        return smem[r * 64 + c];
      } else {
        return PairNibbles(smem[2 * c * 64 + (r >> 1)], smem[(2 * c + 1) * 64 + (r >> 1)], r & 1);
      }
    };
    StoreHopperStorage<S::kOWidth, kMma>(g, out, t.e, t.a * S::kRows / 4, t.b * S::kOWidth, q,
                                         tid, nthreads, acc.vec_out);
  }
};

// Hopper unswizzle. smem holds the tile's O window, de-interleaved.
template <int kMx, int kMma>
struct Tile<Op::kHopperUnswizzle, kMx, kMma> {
  using S = HopperShape<kMx>;
  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, TileCoord t, uint8_t* smem,
                            int tid, int nthreads, Access acc) {
    LoadHopperStorage<S::kOWidth>(g, in, t.e, t.a * S::kRows / 4, t.b * S::kOWidth, smem, tid,
                                  nthreads, acc.vec_in);
  }
  WPREP_HD static void Store(const Geometry& g, uint8_t* out, TileCoord t, const uint8_t* smem,
                             int tid, int nthreads, Access acc) {
    auto q = [smem](int r, int c) -> uint8_t {
      int orow, ocol;
      HopperPlace<int>(r, c, kMma, &orow, &ocol);
      return smem[orow * S::kOWidth + ocol];
    };
    const int64_t qr0 = t.a * S::kRows, qc0 = t.b * S::kCols;
    if constexpr (kMx == -1) {
      StoreCanonical<64, 64>(g, out, t.e, qr0, qc0, q, tid, nthreads, acc.vec_out);
    } else {
      // Canonical (i, jb) holds logical (i, 2jb) and (i, 2jb+1) = Q(2jb, i/2), Q(2jb+1, i/2).
      auto byte = [q](int i, int jb) -> uint8_t {
        return PairNibbles(q(2 * jb, i >> 1), q(2 * jb + 1, i >> 1), i & 1);
      };
      StoreCanonical<64, 64>(g, out, t.e, 2 * qc0, qr0 / 2, byte, tid, nthreads, acc.vec_out);
    }
  }
};

// Blackwell swizzle. smem holds canonical rows [2k0, 2k0 + 128) x bytes [n0/2, n0/2 + 32).
template <int kMx, int kMma>
struct Tile<Op::kBlackwellSwizzle, kMx, kMma> {
  static constexpr int kWidth = kBlackwellTileN / 2;
  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, TileCoord t, uint8_t* smem,
                            int tid, int nthreads, Access acc) {
    LoadCanonical<2 * kBlackwellTileK, kWidth>(g, in, t.e, 2 * t.b * kBlackwellTileK,
                                               t.a * kWidth, smem, tid, nthreads, acc.vec_in);
  }
  WPREP_HD static void Store(const Geometry& g, uint8_t* out, TileCoord t, const uint8_t* smem,
                             int tid, int nthreads, Access acc) {
    auto byte = [smem](int nl, int kl) -> uint8_t {
      return PairNibbles(smem[2 * kl * kWidth + (nl >> 1)], smem[(2 * kl + 1) * kWidth + (nl >> 1)],
                         nl & 1);
    };
    StoreBlackwellStorage(g, out, t.e, t.a * kBlackwellTileN, t.b * kBlackwellTileK, byte, tid,
                          nthreads, acc.vec_out);
  }
};

// Blackwell unswizzle. smem holds storage bytes [n][k].
template <int kMx, int kMma>
struct Tile<Op::kBlackwellUnswizzle, kMx, kMma> {
  static constexpr int kWidth = kBlackwellTileN / 2;
  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, TileCoord t, uint8_t* smem,
                            int tid, int nthreads, Access acc) {
    LoadBlackwellStorage(g, in, t.e, t.a * kBlackwellTileN, t.b * kBlackwellTileK, smem, tid,
                         nthreads, acc.vec_in);
  }
  WPREP_HD static void Store(const Geometry& g, uint8_t* out, TileCoord t, const uint8_t* smem,
                             int tid, int nthreads, Access acc) {
    // Canonical (i, jb) holds logical (i, 2jb) and (i, 2jb+1): nibble i&1 of storage
    // (n = 2jb, k = i/2) and (n = 2jb + 1, k = i/2).
    auto byte = [smem](int il, int jbl) -> uint8_t {
      return PairNibbles(smem[2 * jbl * kBlackwellTileK + (il >> 1)],
                         smem[(2 * jbl + 1) * kBlackwellTileK + (il >> 1)], il & 1);
    };
    StoreCanonical<2 * kBlackwellTileK, kWidth>(g, out, t.e, 2 * t.b * kBlackwellTileK,
                                                t.a * kWidth, byte, tid, nthreads, acc.vec_out);
  }
};

// Blackwell retile: storage bytes move unchanged from one tiling to the other.
template <int kMx, int kMma>
struct Tile<Op::kBlackwellRetile, kMx, kMma> {
  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, TileCoord t, uint8_t* smem,
                            int tid, int nthreads, Access acc) {
    LoadBlackwellStorage(g, in, t.e, t.a * kBlackwellTileN, t.b * kBlackwellTileK, smem, tid,
                         nthreads, acc.vec_in);
  }
  WPREP_HD static void Store(const Geometry& g, uint8_t* out, TileCoord t, const uint8_t* smem,
                             int tid, int nthreads, Access acc) {
    auto byte = [smem](int nl, int kl) -> uint8_t { return smem[nl * kBlackwellTileK + kl]; };
    StoreBlackwellStorage(g, out, t.e, t.a * kBlackwellTileN, t.b * kBlackwellTileK, byte, tid,
                          nthreads, acc.vec_out);
  }
};

// Calls fn.template operator()<kOp, kMx, kMma>() for g's conversion (closed set, FlashInfer
// style). Returns false for a geometry outside the set (never produced by MakePlan).
template <class Fn>
bool DispatchTile(const Geometry& g, Fn&& fn) {
  const bool mx1 = g.mx_axis == -1;
  const bool mma2 = g.mma_version == 2;
  switch (g.op) {
    case Op::kHopperSwizzle:
      if (mx1) {
        mma2 ? fn.template operator()<Op::kHopperSwizzle, -1, 2>()
             : fn.template operator()<Op::kHopperSwizzle, -1, 3>();
      } else {
        mma2 ? fn.template operator()<Op::kHopperSwizzle, -2, 2>()
             : fn.template operator()<Op::kHopperSwizzle, -2, 3>();
      }
      return true;
    case Op::kHopperUnswizzle:
      if (mx1) {
        mma2 ? fn.template operator()<Op::kHopperUnswizzle, -1, 2>()
             : fn.template operator()<Op::kHopperUnswizzle, -1, 3>();
      } else {
        mma2 ? fn.template operator()<Op::kHopperUnswizzle, -2, 2>()
             : fn.template operator()<Op::kHopperUnswizzle, -2, 3>();
      }
      return true;
    case Op::kBlackwellSwizzle:
      fn.template operator()<Op::kBlackwellSwizzle, 0, 0>();
      return true;
    case Op::kBlackwellUnswizzle:
      fn.template operator()<Op::kBlackwellUnswizzle, 0, 0>();
      return true;
    case Op::kBlackwellRetile:
      fn.template operator()<Op::kBlackwellRetile, 0, 0>();
      return true;
  }
  return false;
}

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_TILES_H_
