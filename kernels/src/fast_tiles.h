// Word-level tiles: every conversion moves 4- and 16-byte words and rearranges them with
// the micro-tile forms of layout_math.h (PairTranspose8x4, HopperPackBlock), so a byte
// costs a few instructions. Each tile is written for kTileThreads cooperating threads;
// thread t of a CUDA block runs virtual thread t, the CPU engine runs them in turn.
//
// Two-stage tiles stage 128 x 128 bytes in `smem` as 128 rows of 32 words with a pitch
// of kPitch = 33 words (the odd pitch spreads both access patterns over the banks):
//   Hopper mx_axis -2: Q rows x Q columns;  Blackwell: storage n x k.
// Micro-tile threads cover (jg, rg): 16 groups of 4 bytes along a canonical row x 32
// groups of 8 canonical rows; neighbouring threads take neighbouring jg so global
// accesses along canonical rows coalesce.
#ifndef WPREP_KERNELS_SRC_FAST_TILES_H_
#define WPREP_KERNELS_SRC_FAST_TILES_H_

#include "tile_common.h"

namespace wprep::tiles {

inline constexpr int kPitch = 33;
inline constexpr int kWindow = 128;  // rows and bytes of a two-stage window
inline constexpr int kWindowWords = kWindow * kPitch;

// Micro-tile `mt` (0..511) of a window: 4-byte group jg (0..15) and 8-row group rg (0..31).
WPREP_HD void MicroTileCoords(int mt, int* jg, int* rg) {
  *jg = (mt & 7) | (((mt >> 5) & 1) << 3);
  *rg = ((mt >> 3) & 3) | ((mt >> 6) << 2);
}

// Loads canonical rows row0 + 0..7 at bytes col..col+3 and turns them into the 8 rows of
// the pair-transposed side, stored at smem rows 8*jg + m, word column rg.
WPREP_HD void CanonicalMicroTileToSmem(const Geometry& g, const uint8_t* mat, int64_t row0,
                                       int64_t col, int jg, int rg, uint32_t* smem, bool word) {
  uint32_t w[8], p[8];
  WPREP_UNROLL
  for (int m = 0; m < 8; ++m) {
    const int64_t row = row0 + m;
    const int64_t valid = row < g.d0 ? ValidBytes(col, g.d1b, 4) : 0;
    LoadRowWords<1>(valid > 0 ? mat + row * g.in_stride[0] + col : mat, valid, &w[m], word);
  }
  PairTranspose8x4(w, p);
  WPREP_UNROLL
  for (int m = 0; m < 8; ++m) smem[(8 * jg + m) * kPitch + rg] = p[m];
}

// The inverse: smem rows 8*jg + m, word column rg -> canonical rows row0 + 0..7 at
// bytes col..col+3 (clipped to the matrix).
WPREP_HD void SmemMicroTileToCanonical(const Geometry& g, uint8_t* mat, int64_t row0, int64_t col,
                                       int jg, int rg, const uint32_t* smem, bool word) {
  uint32_t p[8], w[8];
  WPREP_UNROLL
  for (int m = 0; m < 8; ++m) p[m] = smem[(8 * jg + m) * kPitch + rg];
  PairTranspose8x4(p, w);
  WPREP_UNROLL
  for (int m = 0; m < 8; ++m) {
    const int64_t row = row0 + m;
    const int64_t valid = row < g.d0 ? ValidBytes(col, g.d1b, 4) : 0;
    StoreRowWords<1>(valid > 0 ? mat + row * g.d1b + col : mat, valid, &w[m], word);
  }
}

// Byte offset of (n, k) in a Blackwell matrix; 32-bit arithmetic (MakePlan bounds every
// in-matrix extent by 2^31).
WPREP_HD int64_t StorageOffset(const BlackwellTiling& t, const int64_t* strides, int64_t n,
                               int64_t k) {
  const uint32_t tk = static_cast<uint32_t>(t.tile_k), tn = static_cast<uint32_t>(t.tile_n);
  const uint32_t kt = static_cast<uint32_t>(k) / tk, nt = static_cast<uint32_t>(n) / tn;
  const int64_t kk = k - int64_t{kt} * tk, nn = n - int64_t{nt} * tn;
  if (strides == nullptr) return ((int64_t{kt} * t.ntn + nt) * t.tile_n + nn) * t.tile_k + kk;
  return kt * strides[0] + nt * strides[1] + nn * strides[2] + kk;
}

// ---------------------------------------------------------------------------------------
// Hopper, mx_axis -1: Q is the canonical matrix, so each thread moves one 64-byte O block
// straight between global memory and registers.

template <Op kOp, int kMma>
struct HopperMx1Tile {
  static constexpr int kSmemWords = 1;
  static constexpr bool kTwoStage = false;
  static constexpr bool kSwizzle = kOp == Op::kHopperSwizzle;

  // Blocks per O row and O rows visited: all of O for swizzle; for unswizzle only blocks
  // that hold some of the tensor.
  WPREP_HD static int64_t BlocksPerRow(const Geometry& g) {
    return kSwizzle ? g.q_cols_pad / 16 : 2 * CeilDiv(g.q_cols, 32);
  }
  WPREP_HD static int64_t Rows(const Geometry& g) {
    return kSwizzle ? g.q_rows_pad / 4 : RoundUp(g.q_rows, 16) / 4;
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(Rows(g) * BlocksPerRow(g), kTileThreads);
  }

  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                            int64_t tile, uint32_t*, int tid, int nthreads, Access acc) {
    const int32_t nblk = static_cast<int32_t>(BlocksPerRow(g));
    const int64_t units = Rows(g) * nblk;
    const uint8_t* src_mat = in + g.InputMatrixOffset(e);
    uint8_t* dst_mat = out + e * g.out_matrix_bytes;
    const int64_t o_pitch = 4 * g.q_cols_pad;
    for (int t = tid; t < kTileThreads; t += nthreads) {
      const int64_t u = tile * kTileThreads + t;
      if (u >= units) break;
      const int32_t orow = static_cast<int32_t>(u) / nblk;
      const int32_t blk = static_cast<int32_t>(u) - orow * nblk;
      const int64_t r0 = 16 * (orow >> 2) + 2 * (orow & 3) + (blk & 1), r1 = r0 + 8;
      const int64_t c0 = 32 * (blk >> 1);
      const int64_t v0 = r0 < g.d0 ? ValidBytes(c0, g.d1b, 32) : 0;
      const int64_t v1 = r1 < g.d0 ? ValidBytes(c0, g.d1b, 32) : 0;
      uint32_t q0[8], q1[8], o[16];
      if constexpr (kSwizzle) {
        LoadRowWords<8>(v0 > 0 ? src_mat + r0 * g.in_stride[0] + c0 : src_mat, v0, q0, acc.vec_in);
        LoadRowWords<8>(v1 > 0 ? src_mat + r1 * g.in_stride[0] + c0 : src_mat, v1, q1, acc.vec_in);
        HopperPackBlock<kMma>(q0, q1, o);
        StoreRowWords<16>(dst_mat + orow * o_pitch + 64 * blk, 64, o, acc.vec_out);
      } else {
        LoadRowWords<16>(src_mat + orow * g.in_stride[0] + 64 * blk, 64, o, acc.vec_in);
        HopperUnpackBlock<kMma>(o, q0, q1);
        StoreRowWords<8>(v0 > 0 ? dst_mat + r0 * g.d1b + c0 : dst_mat, v0, q0, acc.vec_out);
        StoreRowWords<8>(v1 > 0 ? dst_mat + r1 * g.d1b + c0 : dst_mat, v1, q1, acc.vec_out);
      }
    }
  }
  WPREP_HD static void Store(const Geometry&, const uint8_t*, uint8_t*, int64_t, int64_t,
                             uint32_t*, int, int, Access) {}
};

// ---------------------------------------------------------------------------------------
// Hopper, mx_axis -2: Q is the pair transpose of the canonical matrix. A tile is a
// 128 x 128 window of Q (Q rows qr0.., Q columns qc0..), held in smem.

template <Op kOp, int kMma>
struct HopperMx2Tile {
  static constexpr int kSmemWords = kWindowWords;
  static constexpr bool kTwoStage = true;
  static constexpr bool kSwizzle = kOp == Op::kHopperSwizzle;

  WPREP_HD static int64_t TilesAlongCols(const Geometry& g) {
    return CeilDiv(kSwizzle ? g.q_cols_pad : g.q_cols, kWindow);
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(kSwizzle ? g.q_rows_pad : g.q_rows, kWindow) * TilesAlongCols(g);
  }

  // Canonical side of the window: rows 2*qc0 + 8*rg.., bytes qr0/2 + 4*jg.
  WPREP_HD static void CanonicalSide(const Geometry& g, int64_t tile, int64_t* qr0, int64_t* qc0) {
    *qr0 = tile / TilesAlongCols(g) * kWindow;
    *qc0 = tile % TilesAlongCols(g) * kWindow;
  }

  // O side: thread t owns 64-byte block blk = t & 7 of O row qr0/4 + (t >> 3); its Q rows
  // are r0 (and r0 + 8), Q columns 32*cr.. within the window.
  WPREP_HD static bool OBlock(const Geometry& g, int64_t qc0, int t, int* orow_l, int* blk,
                              int* r0) {
    *blk = t & 7;
    *orow_l = t >> 3;
    *r0 = 16 * (*orow_l >> 2) + 2 * (*orow_l & 3) + (*blk & 1);
    return qc0 + 32 * (*blk >> 1) < g.q_cols_pad;  // block exists in storage
  }

  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, uint8_t*, int64_t e,
                            int64_t tile, uint32_t* smem, int tid, int nthreads, Access acc) {
    int64_t qr0, qc0;
    CanonicalSide(g, tile, &qr0, &qc0);
    const uint8_t* mat = in + g.InputMatrixOffset(e);
    for (int t = tid; t < kTileThreads; t += nthreads) {
      if constexpr (kSwizzle) {
        WPREP_UNROLL
        for (int i = 0; i < 2; ++i) {
          int jg, rg;
          MicroTileCoords(t + kTileThreads * i, &jg, &rg);
          CanonicalMicroTileToSmem(g, mat, 2 * qc0 + 8 * rg, qr0 / 2 + 4 * jg, jg, rg, smem,
                                   acc.word_in);
        }
      } else {
        int orow_l, blk, r0;
        if (!OBlock(g, qc0, t, &orow_l, &blk, &r0)) continue;
        uint32_t o[16], q0[8], q1[8];
        LoadRowWords<16>(mat + (qr0 / 4 + orow_l) * g.in_stride[0] + 4 * qc0 + 64 * blk, 64, o,
                         acc.vec_in);
        HopperUnpackBlock<kMma>(o, q0, q1);
        const int cw = 8 * (blk >> 1);
        WPREP_UNROLL
        for (int i = 0; i < 8; ++i) {
          smem[r0 * kPitch + cw + i] = q0[i];
          smem[(r0 + 8) * kPitch + cw + i] = q1[i];
        }
      }
    }
  }

  WPREP_HD static void Store(const Geometry& g, const uint8_t*, uint8_t* out, int64_t e,
                             int64_t tile, uint32_t* smem, int tid, int nthreads, Access acc) {
    int64_t qr0, qc0;
    CanonicalSide(g, tile, &qr0, &qc0);
    uint8_t* mat = out + e * g.out_matrix_bytes;
    for (int t = tid; t < kTileThreads; t += nthreads) {
      if constexpr (kSwizzle) {
        int orow_l, blk, r0;
        if (!OBlock(g, qc0, t, &orow_l, &blk, &r0)) continue;
        uint32_t q0[8], q1[8], o[16];
        const int cw = 8 * (blk >> 1);
        WPREP_UNROLL
        for (int i = 0; i < 8; ++i) {
          q0[i] = smem[r0 * kPitch + cw + i];
          q1[i] = smem[(r0 + 8) * kPitch + cw + i];
        }
        HopperPackBlock<kMma>(q0, q1, o);
        StoreRowWords<16>(mat + (qr0 / 4 + orow_l) * (4 * g.q_cols_pad) + 4 * qc0 + 64 * blk, 64,
                          o, acc.vec_out);
      } else {
        WPREP_UNROLL
        for (int i = 0; i < 2; ++i) {
          int jg, rg;
          MicroTileCoords(t + kTileThreads * i, &jg, &rg);
          SmemMicroTileToCanonical(g, mat, 2 * qc0 + 8 * rg, qr0 / 2 + 4 * jg, jg, rg, smem,
                                   acc.word_out);
        }
      }
    }
  }
};

// ---------------------------------------------------------------------------------------
// Blackwell (tile_k a multiple of 16): a tile is 128 value columns (n0..) x 128 K bytes
// (k0..); swizzle and unswizzle stage storage rows [n][k] in smem, retile moves 16-byte
// chunks straight from one tiling to the other.

template <Op kOp>
struct BlackwellTile {
  static constexpr int kSmemWords = kOp == Op::kBlackwellRetile ? 1 : kWindowWords;
  static constexpr bool kTwoStage = kOp != Op::kBlackwellRetile;
  static constexpr int kChunksPerThread = kWindow * kWindow / kChunk / kTileThreads;  // 4

  // Windows cover the output tiling's padded extent (swizzle, retile) or the tensor.
  WPREP_HD static int64_t ExtentN(const Geometry& g) {
    return kOp == Op::kBlackwellUnswizzle ? g.n : g.out_tiling.ntn * g.out_tiling.tile_n;
  }
  WPREP_HD static int64_t ExtentK(const Geometry& g) {
    return kOp == Op::kBlackwellUnswizzle ? g.kp : g.out_tiling.kpad;
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(ExtentN(g), kWindow) * CeilDiv(ExtentK(g), kWindow);
  }
  WPREP_HD static void Origin(const Geometry& g, int64_t tile, int64_t* n0, int64_t* k0) {
    const int64_t tiles_k = CeilDiv(ExtentK(g), kWindow);
    *n0 = tile / tiles_k * kWindow;
    *k0 = tile % tiles_k * kWindow;
  }
  // Chunk i of thread t: storage row nl, 16-byte column kc.
  WPREP_HD static void Chunk(int t, int i, int* nl, int* kc) {
    const int q = t + kTileThreads * i;
    *kc = q & 7;
    *nl = q >> 3;
  }
  // Input storage chunk at (n, k): the bytes with n < N and k < K/2 (padding reads as 0).
  WPREP_HD static void LoadStorageChunk(const Geometry& g, const uint8_t* mat, int64_t n,
                                        int64_t k, uint32_t* w, bool vec) {
    const int64_t valid = n < g.n ? ValidBytes(k, g.kp, kChunk) : 0;
    LoadRowWords<4>(valid > 0 ? mat + StorageOffset(g.in_tiling, g.in_stride, n, k) : mat, valid,
                    w, vec);
  }

  WPREP_HD static void Load(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                            int64_t tile, uint32_t* smem, int tid, int nthreads, Access acc) {
    int64_t n0, k0;
    Origin(g, tile, &n0, &k0);
    const uint8_t* mat = in + g.InputMatrixOffset(e);
    for (int t = tid; t < kTileThreads; t += nthreads) {
      if constexpr (kOp == Op::kBlackwellSwizzle) {
        WPREP_UNROLL
        for (int i = 0; i < 2; ++i) {
          int jg, rg;
          MicroTileCoords(t + kTileThreads * i, &jg, &rg);
          CanonicalMicroTileToSmem(g, mat, 2 * k0 + 8 * rg, n0 / 2 + 4 * jg, jg, rg, smem,
                                   acc.word_in);
        }
      } else {
        uint32_t w[kChunksPerThread][4];
        WPREP_UNROLL
        for (int i = 0; i < kChunksPerThread; ++i) {
          int nl, kc;
          Chunk(t, i, &nl, &kc);
          LoadStorageChunk(g, mat, n0 + nl, k0 + 16 * kc, w[i], acc.vec_in);
        }
        WPREP_UNROLL
        for (int i = 0; i < kChunksPerThread; ++i) {
          int nl, kc;
          Chunk(t, i, &nl, &kc);
          if constexpr (kOp == Op::kBlackwellUnswizzle) {
            WPREP_UNROLL
            for (int j = 0; j < 4; ++j) smem[nl * kPitch + 4 * kc + j] = w[i][j];
          } else {  // retile: straight to the output tiling
            const int64_t n = n0 + nl, k = k0 + 16 * kc;
            if (n >= ExtentN(g) || k >= ExtentK(g)) continue;
            StoreRowWords<4>(out + e * g.out_matrix_bytes + StorageOffset(g.out_tiling, nullptr, n, k),
                             kChunk, w[i], acc.vec_out);
          }
        }
      }
    }
  }

  WPREP_HD static void Store(const Geometry& g, const uint8_t*, uint8_t* out, int64_t e,
                             int64_t tile, uint32_t* smem, int tid, int nthreads, Access acc) {
    if constexpr (kOp == Op::kBlackwellRetile) return;
    int64_t n0, k0;
    Origin(g, tile, &n0, &k0);
    uint8_t* mat = out + e * g.out_matrix_bytes;
    for (int t = tid; t < kTileThreads; t += nthreads) {
      if constexpr (kOp == Op::kBlackwellSwizzle) {
        WPREP_UNROLL
        for (int i = 0; i < kChunksPerThread; ++i) {
          int nl, kc;
          Chunk(t, i, &nl, &kc);
          const int64_t n = n0 + nl, k = k0 + 16 * kc;
          if (n >= ExtentN(g) || k >= ExtentK(g)) continue;
          uint32_t w[4];
          WPREP_UNROLL
          for (int j = 0; j < 4; ++j) w[j] = smem[nl * kPitch + 4 * kc + j];
          StoreRowWords<4>(mat + StorageOffset(g.out_tiling, nullptr, n, k), kChunk, w,
                           acc.vec_out);
        }
      } else {
        WPREP_UNROLL
        for (int i = 0; i < 2; ++i) {
          int jg, rg;
          MicroTileCoords(t + kTileThreads * i, &jg, &rg);
          SmemMicroTileToCanonical(g, mat, 2 * k0 + 8 * rg, n0 / 2 + 4 * jg, jg, rg, smem,
                                   acc.word_out);
        }
      }
    }
  }
};

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_FAST_TILES_H_
