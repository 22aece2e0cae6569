// Word-level tiles: every conversion moves 4- and 16-byte words and rearranges them with
// the micro-tile forms of layout_math.h (PairTranspose8x4, HopperPackBlock), so a byte
// costs a few instructions. Each tile is written for kTileThreads cooperating threads;
// thread t of a CUDA block runs virtual thread t, the CPU engine runs them in turn.
//
// Two-stage tiles stage a window in `smem`. Blackwell unswizzle holds 128 rows of 32
// words at a pitch of kPitch = 33 words (the odd pitch spreads both access patterns over
// the banks): storage n x k. Blackwell swizzle holds its 256 canonical rows x 128 bytes
// as loaded (SwizzleWindowWord). The Hopper value tiles need no shared memory. The
// Blackwell tiles take any K-packed tiling (BlackwellTiling): shuffled tiles, and the
// single-tile rows of blackwell_value and of checkpoint order.
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

// Where one tile works, computed once per tile: its matrix, the base of that matrix in
// the input view and in the output, and the tile's origin (a0, b0) in the tile type's own
// coordinates.
struct TileCtx {
  const uint8_t* in;
  uint8_t* out;
  int64_t a0, b0;
};

// Input and output bases of matrix e, and the tile's origin (a0, b0).
WPREP_HD TileCtx MakeCtx(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                         int64_t a0, int64_t b0) {
  TileCtx c;
  c.in = in + g.InputMatrixOffset(e);
  c.out = out + e * g.out_matrix_bytes;
  c.a0 = a0;
  c.b0 = b0;
  return c;
}

// The tiles of one matrix form a grid TilesPerMatrix(g) / TilesAlongB(g) rows by
// TilesAlongB(g) columns; tile t of a conversion is tile (a, b) of matrix e, so b walks
// fastest: tiles that run at the same time neighbour each other along b, and each tile
// type picks which of its dimensions that is. The divisions are by launch constants, so
// they multiply (FastDivisor) instead of taking ~20 instructions each per tile.
struct TileGrid {
  FastDivisor per_matrix;  // tiles of one matrix
  FastDivisor along_b;     // tiles in one row of the grid
  // Tile t (< 2^31) -> matrix e, row a, column b.
  WPREP_HD void Split(uint32_t t, uint32_t* e, uint32_t* a, uint32_t* b) const {
    *e = per_matrix.Div(t);
    const uint32_t r = t - *e * per_matrix.divisor;
    *a = along_b.Div(r);
    *b = r - *a * along_b.divisor;
  }
};
template <class T>
TileGrid MakeTileGrid(const Geometry& g) {
  TileGrid grid;
  grid.per_matrix = FastDivisor(static_cast<uint32_t>(T::TilesPerMatrix(g)));
  grid.along_b = FastDivisor(static_cast<uint32_t>(T::TilesAlongB(g)));
  return grid;
}

// Every tile type has TilesPerMatrix(g), TilesAlongB(g) and Context(g, in, out, e, a, b)
// -> TileCtx, and three steps per virtual thread `vt`, so a kernel can fetch the next
// tile while it finishes the current one:
//   Fetch(g, ctx, vt, access, regs)         global loads into registers;
//   Stage(g, ctx, vt, access, regs, smem)   registers -> smem (two-stage tiles) or -> the
//                                        output (single-stage tiles);
//   Store(g, ctx, vt, access, smem)         smem -> the output (two-stage tiles).
// A tile's Fetch writes its words (T::Fetched: 16, or 32 for Hopper mx_axis -2 and
// Blackwell swizzle) through a loader: RegsOf loads them into registers now; the CUDA
// engine's asynchronous loader (cuda_engine.cu, 16 words) copies them into shared memory
// for a later tile iteration, so the same Fetch serves both.
//   Row<kWords>(k, src, valid, vec)  words k.. from a row, as LoadRowWords;
//   Word(k, p)                       word k from a 4-byte aligned, existing word;
//   Pair(k, p)                       words k, k + 1 from 8 existing bytes, 8-byte aligned.
template <int kCount>
struct RegsOf {
  uint32_t w[kCount];
  template <int kWords>
  WPREP_HD void Row(int k, const uint8_t* src, int64_t valid, bool vec) {
    LoadRowWords<kWords>(src, valid, w + k, vec);
  }
  WPREP_HD void Word(int k, const uint8_t* p) { w[k] = LoadWord(p); }
  WPREP_HD void Pair(int k, const uint8_t* p) { Load2Words(w + k, p); }
  WPREP_HD void Set(int k, uint32_t word) { w[k] = word; }  // a word put together byte by byte
};
using Regs = RegsOf<16>;

// ---------------------------------------------------------------------------------------
// Hopper, the mx axis along the input's packing (mx_axis -1 from canonical storage): Q is
// the input matrix as it is, so each virtual thread moves one 64-byte O block straight
// between global memory and registers. ctx.a0 = first unit of the tile.

template <Op kOp, int kMma>
struct HopperMxAlongPackingTile {
  using Fetched = Regs;
  static constexpr int kSmemWords = 1;
  static constexpr bool kTwoStage = false;
  static constexpr bool kSwizzle = kOp == Op::kHopperSwizzle;
  // Resident blocks the register budget must allow: the pack needs registers for both Q
  // pieces and the placed block at once.
  static constexpr int kMinBlocks = 3;
  // Tiles fetched ahead through shared memory on the GPU (cuda_engine.cu). The swizzle's
  // loads are two half-blocks of separate Q rows, and the pack between load and store is
  // long, so loads issued two tiles ahead hide it; the unswizzle's loads are whole O rows
  // that the register pipeline already keeps in flight, and the extra shared-memory round
  // trip would only add latency.
  static constexpr int kPrefetchTiles = kSwizzle ? 2 : 0;

  // Blocks per O row and O rows visited: all of O for swizzle; for unswizzle only blocks
  // that hold some of the tensor.
  WPREP_HD static int32_t BlocksPerRow(const Geometry& g) {
    return static_cast<int32_t>(kSwizzle ? g.hopper.cols_pad / 16 : 2 * CeilDiv(g.hopper.q_cols, 32));
  }
  WPREP_HD static int64_t Rows(const Geometry& g) {
    return kSwizzle ? g.hopper.out_rows : RoundUp(g.hopper.q_rows, 16) / 4;
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(Rows(g) * BlocksPerRow(g), kTileThreads);
  }
  WPREP_HD static int64_t TilesAlongB(const Geometry&) { return 1; }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t) {
    return MakeCtx(g, in, out, e, a * kTileThreads, 0);
  }
  // Unit of virtual thread vt: O row, block, and the Q rows r0, r0 + 8 and columns c0.. it
  // needs. False past the end.
  struct Unit {
    int32_t orow, blk;
    int64_t r0, r1, c0, v0, v1;  // v*: bytes of Q rows r0 / r1 that exist from c0
  };
  WPREP_HD static bool GetUnit(const Geometry& g, const TileCtx& ctx, int vt, Unit* u) {
    const int32_t nblk = BlocksPerRow(g);
    const int64_t id = ctx.a0 + vt;
    if (id >= Rows(g) * nblk) return false;
    u->orow = static_cast<int32_t>(id) / nblk;
    u->blk = static_cast<int32_t>(id) - u->orow * nblk;
    u->r0 = 16 * (u->orow >> 2) + 2 * (u->orow & 3) + (u->blk & 1);
    u->r1 = u->r0 + 8;
    u->c0 = 32 * (u->blk >> 1);
    u->v0 = u->r0 < g.d0 ? ValidBytes(u->c0, g.d1b, 32) : 0;
    u->v1 = u->r1 < g.d0 ? ValidBytes(u->c0, g.d1b, 32) : 0;
    return true;
  }

  // Every lane reaches the block store (StoreBlock64). Loads stay per lane: L1 already
  // merges the four 16-byte loads of a block, so exchanging them between lanes would only
  // add shuffles.
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    Unit u;
    const bool active = GetUnit(g, ctx, vt, &u);
    const int64_t rs = g.in_stride[0];
    if constexpr (kSwizzle) {
      if (!active) return;
      ld.template Row<8>(0, u.v0 > 0 ? ctx.in + u.r0 * rs + u.c0 : ctx.in, u.v0, access.vec_in);
      ld.template Row<8>(8, u.v1 > 0 ? ctx.in + u.r1 * rs + u.c0 : ctx.in, u.v1, access.vec_in);
    } else {
      if (active) ld.template Row<16>(0, ctx.in + u.orow * rs + 64 * u.blk, 64, access.vec_in);
    }
  }
  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Regs& r, uint32_t*) {
    Unit u;
    const bool active = GetUnit(g, ctx, vt, &u);
    uint32_t o[16];
    if constexpr (kSwizzle) {
      HopperPackBlock<kMma>(r.w, r.w + 8, o);
      StoreBlock64(active ? ctx.out + u.orow * g.hopper.out_cols + 64 * u.blk : ctx.out, o, active,
                   access.vec_out);
    } else {
      if (!active) return;
      HopperUnpackBlock<kMma>(r.w, o, o + 8);
      StoreRowWords<8>(u.v0 > 0 ? ctx.out + u.r0 * g.d1b + u.c0 : ctx.out, u.v0, o, access.vec_out);
      StoreRowWords<8>(u.v1 > 0 ? ctx.out + u.r1 * g.d1b + u.c0 : ctx.out, u.v1, o + 8,
                       access.vec_out);
    }
  }
  WPREP_HD static void Store(const Geometry&, const TileCtx&, int, Access, uint32_t*) {}
};

// The inverse for the two micro-tiles of vt: smem -> canonical rows row_of(rg).., bytes
// col0 + 4*jg, clipped to the matrix.
template <class RowOf>
WPREP_HD void StoreMicroTiles(const Geometry& g, uint8_t* mat, int vt, int64_t col0, RowOf row_of,
                              bool word, const uint32_t* smem) {
  WPREP_UNROLL
  for (int i = 0; i < 2; ++i) {
    int jg, rg;
    MicroTileCoords(vt + kTileThreads * i, &jg, &rg);
    uint32_t p[8], w[8];
    WPREP_UNROLL
    for (int m = 0; m < 8; ++m) p[m] = smem[(8 * jg + m) * kPitch + rg];
    PairTranspose8x4(p, w);
    const int64_t col = col0 + 4 * jg;
    const int64_t valid_col = ValidBytes(col, g.d1b, 4);
    const int64_t row0 = row_of(rg);
    uint8_t* q = mat + row0 * g.d1b + col;
    if (word && valid_col == 4 && row0 + 8 <= g.d0) {  // interior: eight plain word stores
      WPREP_UNROLL
      for (int m = 0; m < 8; ++m) StoreWord(q + m * g.d1b, w[m]);
      continue;
    }
    WPREP_UNROLL
    for (int m = 0; m < 8; ++m) {
      const int64_t valid = row0 + m < g.d0 ? valid_col : 0;
      StoreRowWords<1>(valid > 0 ? q + m * g.d1b : mat, valid, &w[m], word);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Hopper, the mx axis across the input's packing (mx_axis -2 from canonical storage): each
// Q byte pairs nibbles of two input rows. Straight between canonical words and O words:
// no Q, no shared memory (HopperInterleaveCanonical). A thread moves 16 canonical rows x 8 bytes <-> the
// 16-byte pieces at O rows 4*m + t0 (t0 0..3), columns 128*cr + 64*s0 + 16*t1 (s0 0..1)
// of its Q column group cr, O row group m and t1. Lanes are t1 + 4*mm, so each warp
// access fills whole sectors: 64 contiguous bytes of four canonical rows, or of eight O
// rows. A tile is a 256 x 128 window of Q (ctx.a0 = Q row qr0, ctx.b0 = Q column qc0):
// 256 canonical rows x 128 bytes <-> 64 O rows x 512 bytes. Warp w takes Q columns
// qc0 + 32*(w >> 1).. (64 canonical rows) and canonical bytes qr0/2 + 64*(w & 1)...
// Registers only: Q bytes through shared memory would add a round trip and a barrier per
// tile for a transpose the interleave does anyway, and 16-byte pieces (rather than 8)
// keep every warp access on whole 32-byte sectors.

template <Op kOp, int kMma>
struct HopperMxAcrossPackingTile {
  static constexpr int kSmemWords = 1;
  static constexpr bool kTwoStage = false;
  static constexpr bool kSwizzle = kOp == Op::kHopperSwizzle;
  static constexpr int kPieces = 16;  // canonical 8-byte row pieces per thread
  using Fetched = RegsOf<2 * kPieces>;
  // 32 words fetched ahead and 32 in flight through the interleave need 128 registers.
  static constexpr int kMinBlocks = 2;
  static constexpr int kPrefetchTiles = 0;
  static constexpr int kWinRows = 256, kWinCols = 128;  // Q rows and columns of a tile

  WPREP_HD static int64_t RowsLimit(const Geometry& g) { return kSwizzle ? g.hopper.rows_pad : g.hopper.q_rows; }
  WPREP_HD static int64_t ColsLimit(const Geometry& g) { return kSwizzle ? g.hopper.cols_pad : g.hopper.q_cols; }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return TilesAlongB(g) * CeilDiv(ColsLimit(g), kWinCols);
  }
  // Q row windows walk fastest: tiles running together cover neighbouring pieces of the
  // same canonical rows.
  WPREP_HD static int64_t TilesAlongB(const Geometry& g) { return CeilDiv(RowsLimit(g), kWinRows); }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, b * kWinRows, a * kWinCols);
  }

  // Canonical row of the thread's row piece i, relative to its first row. mma 3: rows
  // 2c + {0, 1, 8, 9} for the Q columns c and c + 4 of k = i >> 2; mma 2: rows 2c .. 2c + 7
  // for the Q columns c .. c + 3 of w1 = i >> 3.
  WPREP_HD static constexpr int RowOffset(int i) {
    return kMma == 3 ? (i & 1) + 8 * (i >> 1) : (i & 7) + 32 * (i >> 3);
  }
  // Where the words of O-word group j (word j of each 16-byte piece: k for mma 3,
  // 2*w1 + w0 for mma 2) sit among the thread's canonical words (2 * piece + half):
  // x[i] and y[i] of HopperInterleaveCanonical.
  WPREP_HD static constexpr int XWord(int j, int i) {
    return kMma == 3 ? 8 * j + 4 + i : 16 * (j >> 1) + (j & 1) + 8 + 4 * (i & 1) + 2 * (i >> 1);
  }
  WPREP_HD static constexpr int YWord(int j, int i) {
    return kMma == 3 ? 8 * j + (i ^ 1) : 16 * (j >> 1) + (j & 1) + 4 * ((i & 1) ^ 1) + 2 * (i >> 1);
  }

  // The thread's first canonical row and byte, its first O row and byte column. False if
  // its Q columns or rows lie outside the storage (swizzle) or the tensor (unswizzle).
  struct Unit {
    int64_t row0, col, orow, ocol;
  };
  WPREP_HD static bool GetUnit(const Geometry& g, const TileCtx& ctx, int vt, Unit* u) {
    const int warp = vt >> 5, lane = vt & 31;
    const int t1 = lane & 3, m = 8 * (warp & 1) + (lane >> 2);
    const int64_t qc = ctx.b0 + 32 * (warp >> 1);
    u->row0 = 2 * qc + (kMma == 3 ? 2 * t1 : 8 * t1);
    u->col = ctx.a0 / 2 + 8 * m;
    u->orow = ctx.a0 / 4 + 4 * m;
    u->ocol = 4 * qc + 16 * t1;
    return qc < ColsLimit(g) && ctx.a0 + 16 * m < RowsLimit(g);
  }

  // Swizzle: canonical words 2*i + h = row row0 + RowOffset(i), bytes col + 4*h (zero
  // outside the tensor). Unswizzle: words 4*(2*t0 + s0) + j = word j of O piece (t0, s0).
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    const int64_t rs = g.in_stride[0];
    if constexpr (kSwizzle) {
      const int64_t valid_col = ValidBytes(u.col, g.d1b, 8);
      const uint8_t* p = ctx.in + u.row0 * rs + u.col;
      if (access.vec_in && valid_col == 8 && u.row0 + RowOffset(kPieces - 1) < g.d0) {
        WPREP_UNROLL
        for (int i = 0; i < kPieces; ++i) ld.Pair(2 * i, p + RowOffset(i) * rs);
        return;
      }
      WPREP_UNROLL
      for (int i = 0; i < kPieces; ++i) {
        const int64_t valid = u.row0 + RowOffset(i) < g.d0 ? valid_col : 0;
        ld.template Row<2>(2 * i, valid > 0 ? p + RowOffset(i) * rs : ctx.in, valid, access.word_in);
      }
    } else {
      const uint8_t* p = ctx.in + u.orow * rs + u.ocol;
      WPREP_UNROLL
      for (int t0 = 0; t0 < 4; ++t0) {
        WPREP_UNROLL
        for (int s0 = 0; s0 < 2; ++s0) {
          ld.template Row<4>(4 * (2 * t0 + s0), p + t0 * rs + 64 * s0, kChunk, access.vec_in);
        }
      }
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Fetched& r, uint32_t*) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    if constexpr (kSwizzle) {
      uint32_t o[8][4];  // O piece (t0, s0) = o[2*t0 + s0]
      WPREP_UNROLL
      for (int j = 0; j < 4; ++j) {
        uint32_t x[4], y[4], w[8];
        WPREP_UNROLL
        for (int i = 0; i < 4; ++i) {
          x[i] = r.w[XWord(j, i)];
          y[i] = r.w[YWord(j, i)];
        }
        HopperInterleaveCanonical(x, y, w);
        WPREP_UNROLL
        for (int k = 0; k < 8; ++k) o[k][j] = w[k];
      }
      const int64_t pitch = g.hopper.out_cols;
      uint8_t* const base = ctx.out + u.orow * pitch + u.ocol;
      WPREP_UNROLL
      for (int t0 = 0; t0 < 4; ++t0) {
        WPREP_UNROLL
        for (int s0 = 0; s0 < 2; ++s0) {
          StoreRowWords<4>(base + t0 * pitch + 64 * s0, kChunk, o[2 * t0 + s0], access.vec_out);
        }
      }
    } else {
      uint32_t c[2 * kPieces];
      WPREP_UNROLL
      for (int j = 0; j < 4; ++j) {
        uint32_t in[8], x[4], y[4];
        WPREP_UNROLL
        for (int k = 0; k < 8; ++k) in[k] = r.w[4 * k + j];
        HopperDeinterleaveCanonical(in, x, y);
        WPREP_UNROLL
        for (int i = 0; i < 4; ++i) {
          c[XWord(j, i)] = x[i];
          c[YWord(j, i)] = y[i];
        }
      }
      const int64_t valid_col = ValidBytes(u.col, g.d1b, 8);
      uint8_t* const base = ctx.out + u.row0 * g.d1b + u.col;
      WPREP_UNROLL
      for (int i = 0; i < kPieces; ++i) {
        const int64_t valid = u.row0 + RowOffset(i) < g.d0 ? valid_col : 0;
        uint8_t* dst = base + RowOffset(i) * g.d1b;
        if (access.vec_out && valid == 8) {
          Store2Words(dst, c[2 * i], c[2 * i + 1]);
        } else {
          StoreRowWords<2>(valid > 0 ? dst : ctx.out, valid, c + 2 * i, access.word_out);
        }
      }
    }
  }
  WPREP_HD static void Store(const Geometry&, const TileCtx&, int, Access, uint32_t*) {}
};

// ---------------------------------------------------------------------------------------
// Blackwell unswizzle and retile (tile_k a multiple of 16): a tile is 128 value columns
// (ctx.a0 = n0) x 128 K bytes (ctx.b0 = k0). Unswizzle stages storage rows [n][k] (16-byte
// chunks in, micro-tiles out); retile moves 16-byte chunks straight from one tiling to the
// other. The unswizzle goes through shared memory because a register-only form leaves one
// side of every access scattered (each thread's bytes of a micro-tile lie in 8 storage
// rows). Swizzle has its own tile below.

// The tile grid of the Blackwell tiles: windows of kWinN value columns x kWinK K bytes
// over T::ExtentN(g) x T::ExtentK(g), N windows fastest, so tiles running together cover
// neighbouring pieces of the same canonical rows and their DRAM pages are open together.
// ctx.a0 = first value column n0, ctx.b0 = first K byte k0.
template <class T, int kWinN, int kWinK>
struct NFastestGrid {
  WPREP_HD static int64_t TilesAlongB(const Geometry& g) { return CeilDiv(T::ExtentN(g), kWinN); }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return TilesAlongB(g) * CeilDiv(T::ExtentK(g), kWinK);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, b * kWinN, a * kWinK);
  }
};

// Chunk i of virtual thread vt in a window of eight 16-byte chunks a row (128 bytes): row
// q >> 3, chunk q & 7 with q = vt + kTileThreads * i, so each warp access covers four
// whole rows.
WPREP_HD void WindowChunk(int vt, int i, int* row, int* chunk) {
  const int q = vt + kTileThreads * i;
  *chunk = q & 7;
  *row = q >> 3;
}

template <Op kOp>
struct BlackwellTile : NFastestGrid<BlackwellTile<kOp>, kWindow, kWindow> {
  static_assert(kOp == Op::kBlackwellUnswizzle || kOp == Op::kBlackwellRetile);
  using Fetched = Regs;
  static constexpr bool kTwoStage = kOp == Op::kBlackwellUnswizzle;
  static constexpr int kSmemWords = kTwoStage ? kWindowWords : 1;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = 0;
  static constexpr int kChunksPerThread = kWindow * kWindow / kChunk / kTileThreads;  // 4

  // Windows cover the output tiling's padded extent (retile) or the tensor.
  WPREP_HD static int64_t ExtentN(const Geometry& g) {
    return kOp == Op::kBlackwellUnswizzle ? g.n : g.out_tiling.ntn * g.out_tiling.tile_n;
  }
  WPREP_HD static int64_t ExtentK(const Geometry& g) {
    return kOp == Op::kBlackwellUnswizzle ? g.kp : g.out_tiling.kpad;
  }
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    // Input storage bytes with n < N and k < K/2; padding reads as 0.
    WPREP_UNROLL
    for (int i = 0; i < kChunksPerThread; ++i) {
      int nl, kc;
      WindowChunk(vt, i, &nl, &kc);
      const int64_t n = ctx.a0 + nl, k = ctx.b0 + 16 * kc;
      const int64_t valid = n < g.n ? ValidBytes(k, g.kp, kChunk) : 0;
      ld.template Row<4>(4 * i,
                         valid > 0 ? ctx.in + BlackwellOffset(g.in_tiling, g.in_stride, n, k) : ctx.in,
                         valid, access.vec_in);
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Regs& r, uint32_t* smem) {
    WPREP_UNROLL
    for (int i = 0; i < kChunksPerThread; ++i) {
      int nl, kc;
      WindowChunk(vt, i, &nl, &kc);
      if constexpr (kOp == Op::kBlackwellUnswizzle) {
        WPREP_UNROLL
        for (int j = 0; j < 4; ++j) smem[nl * kPitch + 4 * kc + j] = r.w[4 * i + j];
      } else {  // retile: straight to the output tiling
        const int64_t n = ctx.a0 + nl, k = ctx.b0 + 16 * kc;
        // A single-tile output (checkpoint order) ends its rows at K/2 bytes, which need
        // not be a multiple of 16.
        const int64_t valid = n < ExtentN(g) ? ValidBytes(k, ExtentK(g), kChunk) : 0;
        if (valid == 0) continue;
        StoreRowWords<4>(ctx.out + BlackwellOffset(g.out_tiling, nullptr, n, k), valid,
                         r.w + 4 * i, access.vec_out);
      }
    }
  }

  WPREP_HD static void Store(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             uint32_t* smem) {
    if constexpr (kOp == Op::kBlackwellUnswizzle) {
      const int64_t k0 = ctx.b0;
      StoreMicroTiles(g, ctx.out, vt, ctx.a0 / 2, [k0](int rg) { return 2 * k0 + 8 * rg; },
                      access.word_out, smem);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Blackwell swizzle (tile_k a multiple of 16): a tile is 256 value columns (ctx.a0 = n0)
// x 128 K bytes (ctx.b0 = k0), staged as its 256 canonical rows x 128 bytes as they are
// (16-byte loads in). On the way out a thread pair-transposes word column jw of 32 rows
// (32*rg ..) into storage rows n0 + 8*jw + 0..7 at K bytes k0 + 16*rg..+15, so every
// store is 16 bytes: with 128 K bytes a thread covers 32 canonical rows, twice the rows
// (and so twice the store width) of a 128 x 128 window, and no access of either side is
// narrower than 16 bytes.

// Word w (0..31) of canonical row r (0..255) in the window. Store reads rows 32 apart
// (four row groups per warp) x eight consecutive words: the XOR puts them in 32 distinct
// banks, and keeps 16-byte chunks whole for Stage's 16-byte writes.
WPREP_HD int SwizzleWindowWord(int r, int w) { return 32 * r + (w ^ (8 * ((r >> 5) & 3))); }

struct BlackwellSwizzleTile : NFastestGrid<BlackwellSwizzleTile, 256, 128> {
  using Fetched = RegsOf<32>;
  static constexpr bool kTwoStage = true;
  static constexpr int kSmemWords = 256 * 32;
  static constexpr int kMinBlocks = 2;
  static constexpr int kPrefetchTiles = 0;
  WPREP_HD static int64_t ExtentN(const Geometry& g) { return g.out_tiling.ntn * g.out_tiling.tile_n; }
  WPREP_HD static int64_t ExtentK(const Geometry& g) { return g.out_tiling.kpad; }
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    WPREP_UNROLL
    for (int i = 0; i < 8; ++i) {
      int r, c;
      WindowChunk(vt, i, &r, &c);
      const int64_t row = 2 * ctx.b0 + r, col = ctx.a0 / 2 + kChunk * c;
      const int64_t valid = row < g.d0 ? ValidBytes(col, g.d1b, kChunk) : 0;
      ld.template Row<4>(4 * i, valid > 0 ? ctx.in + row * g.in_stride[0] + col : ctx.in, valid,
                         access.vec_in);
    }
  }
  WPREP_HD static void Stage(const Geometry&, const TileCtx&, int vt, Access, const Fetched& r,
                             uint32_t* smem) {
    WPREP_UNROLL
    for (int i = 0; i < 8; ++i) {
      int row, c;
      WindowChunk(vt, i, &row, &c);
      Store4Words(reinterpret_cast<uint8_t*>(smem + SwizzleWindowWord(row, 4 * c)), r.w + 4 * i);
    }
  }
  // Lanes 4i..4i+3 take four consecutive rg, so each 16-byte store instruction writes 64
  // contiguous bytes of eight storage rows.
  WPREP_HD static void Store(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             uint32_t* smem) {
    const int warp = vt >> 5, lane = vt & 31;
    const int rg = 4 * (warp & 1) + (lane & 3), jw = 8 * (warp >> 1) + (lane >> 2);
    const int64_t n = ctx.a0 + 8 * jw, k = ctx.b0 + 16 * rg;
    const int64_t extent_n = ExtentN(g);
    if (n >= extent_n || k >= ExtentK(g)) return;
    uint32_t t[4][8];
    WPREP_UNROLL
    for (int h = 0; h < 4; ++h) {
      uint32_t w[8];
      WPREP_UNROLL
      for (int i = 0; i < 8; ++i) w[i] = smem[SwizzleWindowWord(32 * rg + 8 * h + i, jw)];
      PairTranspose8x4(w, t[h]);
    }
    // Within one K tile the storage rows of consecutive N tiles are contiguous
    // ([kt][nt][n'][k']), so row n + m lies m * tile_k bytes after row n.
    uint8_t* const base = ctx.out + BlackwellOffset(g.out_tiling, nullptr, n, k);
    WPREP_UNROLL
    for (int m = 0; m < 8; ++m) {
      if (n + m >= extent_n) break;
      const uint32_t piece[4] = {t[0][m], t[1][m], t[2][m], t[3][m]};
      StoreRowWords<4>(base + m * g.out_tiling.tile_k, kChunk, piece, access.vec_out);
    }
  }
};

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_FAST_TILES_H_
