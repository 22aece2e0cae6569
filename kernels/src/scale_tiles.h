// Tiles of the MX scale layouts (LAYOUTS.md, "MX scale layouts"): whole bytes move, in
// 16- and 4-byte words wherever the views allow, with the same Fetch / Stage / Store
// steps as fast_tiles.h. The plain side (the scale tensor) may be any strided view
// (Geometry::scale_stride); its access path is Geometry::scale_access.
//
// Hopper: a storage row O[orow] of 32C bytes takes the 32 S rows of two 16-row runs
// (HopperScaleRunRow), two S columns per 64-byte block. Byte 32a + 4c + 2d + b of block
// k0 is S[run a row 8b + c, 2k0 + d], so its 16-byte chunk (a, h) is the 4 x 4 byte
// transpose of the run's rows 4h..4h+3 and 8 + 4h..8 + 4h + 3 at columns 2k0, 2k0 + 1.
//   HopperScaleRowsTile: S rows contiguous (mx_axis -1 of a dense tensor, or mx_axis -2
//     of a transposed view) or no stride 1 at all; S rows through shared memory.
//   HopperScaleColumnsSwizzleTile / HopperScaleColumnsUnswizzleTile: S columns contiguous
//     (mx_axis -2 of a dense tensor): a run's column is 16 contiguous bytes, so registers
//     suffice.
// Blackwell: a 512-byte block (n0, k0) holds word (b, a) = x[4k0 .. 4k0 + 3, 128n0 + 32a
// + b]: for dense x a 4 x 4 byte transpose of four rows' words, for a transposed view
// (x columns contiguous) one aligned word of a column as it is.
#ifndef WPREP_KERNELS_SRC_SCALE_TILES_H_
#define WPREP_KERNELS_SRC_SCALE_TILES_H_

#include "fast_tiles.h"

namespace wprep::tiles {

// Byte `i` of an S view at (r, col): the per-byte path of every scale tile.
WPREP_HD uint8_t* ScaleByte(uint8_t* base, const int64_t* stride, int64_t r, int64_t col) {
  return base + r * stride[0] + col * stride[1];
}
WPREP_HD const uint8_t* ScaleByte(const uint8_t* base, const int64_t* stride, int64_t r,
                                  int64_t col) {
  return base + r * stride[0] + col * stride[1];
}

// `valid` bytes of S row r from column col on (zero beyond), through the strides, into
// the loader's words k..k + 3.
template <class Ld>
WPREP_HD void LoadScaleRun(const Geometry& g, const uint8_t* base, int64_t r, int64_t col,
                           int64_t valid, bool vec, Ld& ld, int k = 0) {
  if (g.scale_access == ScaleAccess::kRows) {
    ld.template Row<4>(k, valid > 0 ? base + r * g.scale_stride[0] + col : base, valid, vec);
    return;
  }
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) {
    uint32_t word = 0;
    WPREP_UNROLL
    for (int j = 0; j < 4; ++j) {
      if (4 * i + j < valid) {
        word |= uint32_t{*ScaleByte(base, g.scale_stride, r, col + 4 * i + j)} << (8 * j);
      }
    }
    ld.Set(k + i, word);
  }
}

WPREP_HD void StoreScaleRun(const Geometry& g, uint8_t* base, int64_t r, int64_t col,
                            int64_t valid, bool vec, const uint32_t* w) {
  if (g.scale_access == ScaleAccess::kRows) {
    StoreRowWords<4>(valid > 0 ? base + r * g.scale_stride[0] + col : base, valid, w, vec);
    return;
  }
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) {
    WPREP_UNROLL
    for (int j = 0; j < 4; ++j) {
      if (4 * i + j < valid) {
        *ScaleByte(base, g.scale_stride, r, col + 4 * i + j) = static_cast<uint8_t>(w[i] >> (8 * j));
      }
    }
  }
}

// The 16-byte O chunk (run a, half h) from / to the four halfword pairs it is made of:
// lo[i] = S[run row 4h + i, 2k0 .. 2k0 + 1], hi[i] = the same 8 rows further. Chunk word
// i is (lo.byte0, hi.byte0, lo.byte1, hi.byte1): bytes 2d + b of c = 4h + i.
WPREP_HD uint32_t HopperScaleWord(uint32_t lo, uint32_t hi) { return BytePerm(lo, hi, 0x5140); }
WPREP_HD void HopperScaleHalves(uint32_t w, uint32_t* lo, uint32_t* hi) {
  *lo = (w & 0xFFu) | ((w >> 8) & 0xFF00u);
  *hi = ((w >> 8) & 0xFFu) | ((w >> 16) & 0xFF00u);
}

// ---------------------------------------------------------------------------------------
// Hopper scale through shared memory. A tile is run a of two O rows, 2q and 2q + 1 (ctx.a0
// = 2q + a), over 64 kChunks blocks from ctx.b0 = first block k0: the 32 bytes (k0, a) of
// each of those blocks, made of S rows (the two rows' runs a, 32 rows) x columns 2k0..
// (128 kChunks); each virtual thread moves kChunks 16-byte pieces of either side. The
// window holds the S rows row-major, 128 kChunks bytes a row, with the low three bits of
// the 16-byte chunk index of row p XOR-ed by HopperScaleSmemXor(p): the S-row side then
// writes whole rows and the O side reads halfwords of rows 16o + 4h + i (four (o, h) per
// warp instruction) from four different bank groups, so neither side conflicts on banks.
//
// Where every run a = 1 is padding (S rows <= 16 num_warps: gpt-oss's 90 groups, or 128,
// with num_warps 8) the swizzle's tiles are the runs a = 0 alone, and each also writes its
// blocks' zero halves: half the tiles, none of them without loads. Tiles of both runs of
// one O row took 2.2x a device copy on an H200 there.

WPREP_HD int HopperScaleSmemXor(int p) { return (p & 7) ^ ((p >> 3) & 2); }
template <int kChunks>
WPREP_HD int HopperScaleSmemByte(int p, int col) {
  return 128 * kChunks * p + (((col >> 4) ^ HopperScaleSmemXor(p)) << 4) + (col & 15);
}

inline constexpr int kScaleSegmentBlocks = 64;  // O blocks (k0) per Hopper scale tile and chunk

// Unswizzles fetch kScaleUnswizzleAhead tiles ahead (the cp.async kernel): at 8 MiB they
// are bound by load latency, and 48 bytes in flight a thread instead of 16 (or 32) take
// them from 2.05-2.10x a device copy to 1.84-1.86x on an H200. The swizzles gain nothing
// from it (or lose), and keep the register pipeline.
inline constexpr int kScaleUnswizzleAhead = 3;

template <Op kOp, int kChunks = 1>
struct HopperScaleRowsTile {
  static_assert(kOp == Op::kHopperScaleSwizzle || kOp == Op::kHopperScaleUnswizzle);
  static_assert(kChunks == 1 || kChunks == 2);
  static constexpr bool kSwizzle = kOp == Op::kHopperScaleSwizzle;
  using Fetched = RegsOf<4 * kChunks>;
  static constexpr bool kTwoStage = true;
  static constexpr int kSmemWords = 32 * 128 * kChunks / 4;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = kSwizzle ? 0 : kScaleUnswizzleAhead;
  static constexpr int kTileBlocks = kScaleSegmentBlocks * kChunks;

  // The swizzle of S whose runs a = 1 are all padding: tiles of runs a = 0 only.
  WPREP_HD static bool ZeroSecondRuns(const Geometry& g) {
    return kSwizzle && g.hopper_scale.rows <= 16 * int64_t{g.hopper_scale.num_warps};
  }
  WPREP_HD static int64_t TilesAlongB(const Geometry& g) { return CeilDiv(g.hopper_scale.cols_pad / 2, kTileBlocks); }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return (ZeroSecondRuns(g) ? 1 : 2) * CeilDiv(g.hopper_scale.out_rows, 2) * TilesAlongB(g);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, ZeroSecondRuns(g) ? 2 * a : a, b * kTileBlocks);
  }
  WPREP_HD static int Run(const TileCtx& ctx) { return static_cast<int>(ctx.a0 & 1); }
  WPREP_HD static int64_t ORow(const TileCtx& ctx, int o) { return (ctx.a0 & ~int64_t{1}) + o; }
  WPREP_HD static int SmemByte(int p, int col) { return HopperScaleSmemByte<kChunks>(p, col); }

  // S side of virtual thread vt, piece n: window row p (O row 2q + (p >> 4), run row
  // p & 15), chunk j (16 columns); valid = 0 for rows in the padding or past the last O row.
  struct SRun {
    int p, j;
    int64_t r, col, valid;
  };
  WPREP_HD static SRun GetSRun(const Geometry& g, const TileCtx& ctx, int vt, int n) {
    SRun s;
    s.p = vt >> 3;
    s.j = (vt & 7) + 8 * n;
    const int64_t orow = ORow(ctx, s.p >> 4);
    s.r = HopperScaleRunRow(g.hopper_scale, orow, Run(ctx)) + (s.p & 15);
    s.col = 2 * ctx.b0 + 16 * s.j;
    s.valid = orow < g.hopper_scale.out_rows && s.r < g.hopper_scale.rows
                  ? ValidBytes(s.col, g.hopper_scale.cols, kChunk)
                  : 0;
    return s;
  }
  // O side of vt, piece n: block k0, O row 2q + o, half h; false past the storage.
  struct OChunk {
    int k0l, o, h;
    int64_t k0, orow;
  };
  WPREP_HD static bool GetOChunk(const Geometry& g, const TileCtx& ctx, int vt, int n, OChunk* c) {
    c->k0l = (vt >> 2) + kScaleSegmentBlocks * n;
    c->o = (vt >> 1) & 1;
    c->h = vt & 1;
    c->k0 = ctx.b0 + c->k0l;
    c->orow = ORow(ctx, c->o);
    return c->k0 < g.hopper_scale.cols_pad / 2 && c->orow < g.hopper_scale.out_rows;
  }
  // The chunk's byte in the matrix's O, whose rows are `row_bytes` apart (the swizzle's
  // dense output, or the unswizzle's input view).
  WPREP_HD static int64_t OOffset(const TileCtx& ctx, const OChunk& c, int64_t row_bytes) {
    return c.orow * row_bytes + 64 * c.k0 + 32 * Run(ctx) + 16 * c.h;
  }

  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    WPREP_UNROLL
    for (int n = 0; n < kChunks; ++n) {
      if constexpr (kSwizzle) {
        const SRun s = GetSRun(g, ctx, vt, n);
        LoadScaleRun(g, ctx.in, s.r, s.col, s.valid, access.vec_in, ld, 4 * n);
      } else {
        OChunk c;
        // Runs wholly in the padding are never stored: skip their loads.
        const bool needed = GetOChunk(g, ctx, vt, n, &c) &&
                            HopperScaleRunRow(g.hopper_scale, c.orow, Run(ctx)) < g.hopper_scale.rows;
        const uint8_t* p = ctx.in + OOffset(ctx, c, g.in_stride[0]);
        ld.template Row<4>(4 * n, needed ? p : ctx.in, needed ? kChunk : 0, access.vec_in);
      }
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access,
                             const Fetched& r, uint32_t* smem) {
    auto* window = reinterpret_cast<uint8_t*>(smem);
    WPREP_UNROLL
    for (int n = 0; n < kChunks; ++n) {
      if constexpr (kSwizzle) {
        const SRun s = GetSRun(g, ctx, vt, n);
        Store4Words(window + SmemByte(s.p, 16 * s.j), r.w + 4 * n);
      } else {
        OChunk c;
        if (!GetOChunk(g, ctx, vt, n, &c)) continue;
        WPREP_UNROLL
        for (int i = 0; i < 4; ++i) {
          uint32_t lo, hi;
          HopperScaleHalves(r.w[4 * n + i], &lo, &hi);
          const int p = 16 * c.o + 4 * c.h + i;
          StoreHalf(window + SmemByte(p, 2 * c.k0l), lo);
          StoreHalf(window + SmemByte(p + 8, 2 * c.k0l), hi);
        }
      }
    }
  }

  WPREP_HD static void Store(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             uint32_t* smem) {
    const auto* window = reinterpret_cast<const uint8_t*>(smem);
    WPREP_UNROLL
    for (int n = 0; n < kChunks; ++n) {
      if constexpr (kSwizzle) {
        OChunk c;
        if (!GetOChunk(g, ctx, vt, n, &c)) continue;
        uint32_t w[4];
        WPREP_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int p = 16 * c.o + 4 * c.h + i;
          w[i] = HopperScaleWord(LoadHalf(window + SmemByte(p, 2 * c.k0l)),
                                 LoadHalf(window + SmemByte(p + 8, 2 * c.k0l)));
        }
        uint8_t* dst = ctx.out + OOffset(ctx, c, g.hopper_scale.out_cols);
        StoreRowWords<4>(dst, kChunk, w, access.vec_out);
        if (ZeroSecondRuns(g)) {
          const uint32_t zero[4] = {0, 0, 0, 0};
          StoreRowWords<4>(dst + 32, kChunk, zero, access.vec_out);
        }
      } else {
        const SRun s = GetSRun(g, ctx, vt, n);
        if (s.valid == 0) continue;
        uint32_t w[4];
        Load4Words(w, window + SmemByte(s.p, 16 * s.j));
        StoreScaleRun(g, ctx.out, s.r, s.col, s.valid, access.vec_out, w);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------
// Hopper scale with S columns contiguous (mx_axis -2 of a dense tensor), registers only:
// a run's column is 16 contiguous bytes. Shared by both directions below.

struct HopperScaleColumnRun {
  int64_t r0;    // first S row of the run
  int64_t rows;  // S rows of the run that exist (0: the run is padding)
};
WPREP_HD HopperScaleColumnRun ColumnRunOf(const HopperScaleTiling& t, int64_t orow, int a) {
  HopperScaleColumnRun run;
  run.r0 = HopperScaleRunRow(t, orow, a);
  run.rows = ValidBytes(run.r0, t.rows, kChunk);
  return run;
}
// The strided view's bytes of S column col from row r0 on.
WPREP_HD int64_t ColumnOffset(const Geometry& g, int64_t r0, int64_t col) { return col * g.scale_stride[1] + r0; }

// Column words x[q] (rows 4q..4q + 3 of column 2k0) and y[q] (column 2k0 + 1) of a run <->
// its 32 O bytes (k0, a): O word c = (x.c, x.8 + c, y.c, y.8 + c), for c < 4 the 4 x 4 byte
// transpose of (x0, x2, y0, y2), for c >= 4 of (x1, x3, y1, y3).
WPREP_HD void HopperScaleRunToO(const uint32_t* x, const uint32_t* y, uint32_t* o) {
  uint32_t lo[4] = {x[0], x[2], y[0], y[2]}, hi[4] = {x[1], x[3], y[1], y[3]};
  Transpose4x4Bytes(lo);
  Transpose4x4Bytes(hi);
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) {
    o[i] = lo[i];
    o[4 + i] = hi[i];
  }
}

// Swizzle. A tile is kRows O rows from ctx.a0 x 256 / kRows blocks from ctx.b0; virtual
// thread vt makes the whole 64-byte block k0 of O row ctx.a0 + ((vt >> 2) & (kRows - 1)):
// both runs' columns 2k0 and 2k0 + 1 (four 16-byte loads, none for a run in the padding).
// A thread a block, rather than a run, keeps the loads per tile the same where half the
// runs are padding (num_warps 8 for 128 S rows: an H200 took 2.2x a device copy of the
// input with a thread per run, bound by the tiles' count). The four lanes of a quad hold
// consecutive blocks of one row (StoreBlock64); lanes 4 apart hold consecutive rows, whose
// runs are adjacent in S, so they read whole sectors. Two rows suit wide O rows; sixteen
// keep the tile full where an O row has few blocks (a gpt-oss scale's 45).
template <int kRows>
struct HopperScaleColumnsSwizzleTile {
  static_assert(kRows == 2 || kRows == 16);
  using Fetched = RegsOf<16>;
  static constexpr bool kTwoStage = false;
  static constexpr int kSmemWords = 1;
  static constexpr int kMinBlocks = 3;
  static constexpr int kPrefetchTiles = 0;
  static constexpr int kTileBlocks = kTileThreads / kRows;
  static constexpr int kRowShift = kRows == 2 ? 1 : 4;

  WPREP_HD static int64_t TilesAlongB(const Geometry& g) { return CeilDiv(g.hopper_scale.cols_pad / 2, kTileBlocks); }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(g.hopper_scale.out_rows, kRows) * TilesAlongB(g);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, kRows * a, b * kTileBlocks);
  }
  // vt's O row and block; false past the storage.
  WPREP_HD static bool GetBlock(const Geometry& g, const TileCtx& ctx, int vt, int64_t* orow, int64_t* k0) {
    *orow = ctx.a0 + ((vt >> 2) & (kRows - 1));
    *k0 = ctx.b0 + ((vt & 3) | ((vt >> (2 + kRowShift)) << 2));
    return *orow < g.hopper_scale.out_rows && *k0 < g.hopper_scale.cols_pad / 2;
  }
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    int64_t orow, k0;
    if (!GetBlock(g, ctx, vt, &orow, &k0)) return;
    // Words 8a + 4d..: column 2k0 + d of run a.
    WPREP_UNROLL
    for (int a = 0; a < 2; ++a) {
      const HopperScaleColumnRun run = ColumnRunOf(g.hopper_scale, orow, a);
      WPREP_UNROLL
      for (int d = 0; d < 2; ++d) {
        const int64_t col = 2 * k0 + d;
        const int64_t valid = col < g.hopper_scale.cols ? run.rows : 0;
        ld.template Row<4>(8 * a + 4 * d, valid > 0 ? ctx.in + ColumnOffset(g, run.r0, col) : ctx.in, valid,
                           access.vec_in);
      }
    }
  }
  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access, const Fetched& r,
                             uint32_t*) {
    int64_t orow, k0;
    const bool active = GetBlock(g, ctx, vt, &orow, &k0);  // every lane reaches StoreBlock64
    uint32_t o[16];
    HopperScaleRunToO(r.w, r.w + 4, o);
    HopperScaleRunToO(r.w + 8, r.w + 12, o + 8);
    StoreBlock64(active ? ctx.out + orow * g.hopper_scale.out_cols + 64 * k0 : ctx.out, o, active, access.vec_out);
  }
  WPREP_HD static void Store(const Geometry&, const TileCtx&, int, Access, uint32_t*) {}
};

// Unswizzle. A tile is two O rows (ctx.a0, ctx.a0 + 1) x 64 blocks from ctx.b0; virtual
// thread vt takes O row ctx.a0 + (vt & 1), run a = (vt >> 1) & 1 and block k0: the 32 O
// bytes of (k0, a) -> S columns 2k0 and 2k0 + 1 of the run (16 bytes each; runs in the
// padding are neither loaded nor stored). Lanes 2i, 2i + 1 take the two O rows, whose runs
// are adjacent in S, so each pair of lanes writes one 32-byte sector.
struct HopperScaleColumnsUnswizzleTile {
  using Fetched = RegsOf<8>;
  static constexpr bool kTwoStage = false;
  static constexpr int kSmemWords = 1;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = kScaleUnswizzleAhead;

  WPREP_HD static int64_t TilesAlongB(const Geometry& g) {
    return CeilDiv(g.hopper_scale.cols_pad / 2, kScaleSegmentBlocks);
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return CeilDiv(g.hopper_scale.out_rows, 2) * TilesAlongB(g);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, 2 * a, b * kScaleSegmentBlocks);
  }

  struct Unit {
    int64_t orow, k0;
    int a;
    HopperScaleColumnRun run;
  };
  // False past the storage (O rows, blocks) and for runs in the padding.
  WPREP_HD static bool GetUnit(const Geometry& g, const TileCtx& ctx, int vt, Unit* u) {
    const HopperScaleTiling& t = g.hopper_scale;
    u->orow = ctx.a0 + (vt & 1);
    u->a = (vt >> 1) & 1;
    u->k0 = ctx.b0 + (((vt >> 2) & 7) | ((vt >> 5) << 3));
    if (u->orow >= t.out_rows || u->k0 >= t.cols_pad / 2) return false;
    u->run = ColumnRunOf(t, u->orow, u->a);
    return u->run.rows > 0;
  }

  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    ld.template Row<8>(0, ctx.in + u.orow * g.in_stride[0] + 64 * u.k0 + 32 * u.a, 32, access.vec_in);
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Fetched& r, uint32_t*) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    // The inverse of HopperScaleRunToO: O words 0..3 and 4..7 transposed give the column
    // words (x0, x2, y0, y2) and (x1, x3, y1, y3).
    uint32_t lo[4] = {r.w[0], r.w[1], r.w[2], r.w[3]}, hi[4] = {r.w[4], r.w[5], r.w[6], r.w[7]};
    Transpose4x4Bytes(lo);
    Transpose4x4Bytes(hi);
    const uint32_t cols[8] = {lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3]};
    WPREP_UNROLL
    for (int d = 0; d < 2; ++d) {
      const int64_t col = 2 * u.k0 + d;
      const int64_t valid = col < g.hopper_scale.cols ? u.run.rows : 0;
      StoreRowWords<4>(valid > 0 ? ctx.out + ColumnOffset(g, u.run.r0, col) : ctx.out, valid, cols + 4 * d,
                       access.vec_out);
    }
  }
  WPREP_HD static void Store(const Geometry&, const TileCtx&, int, Access, uint32_t*) {}
};

// ---------------------------------------------------------------------------------------
// Blackwell scale, registers only. A tile is 32 blocks (n0 = ctx.a0, k0 = ctx.b0 ..
// ctx.b0 + 31), each 512 bytes: virtual thread (q, k0) moves the 64 bytes of b = 4q ..
// 4q + 3 (all four a), i.e. x rows 4k0 .. 4k0 + 3 at columns 128n0 + 32a + 4q .. + 3.
// Lanes put q fastest for dense x (8 lanes read a 32-byte row piece) and k0 next to q for
// a transposed view (8 lanes read a 32-byte column piece); either way the four lanes of a
// quad hold consecutive 64-byte pieces for StoreBlock64.

inline constexpr int kBlackwellScaleTileBlocks = 32;

template <Op kOp>
struct BlackwellScaleTile {
  static_assert(kOp == Op::kBlackwellScaleSwizzle || kOp == Op::kBlackwellScaleUnswizzle);
  static constexpr bool kSwizzle = kOp == Op::kBlackwellScaleSwizzle;
  using Fetched = RegsOf<16>;
  static constexpr bool kTwoStage = false;
  static constexpr int kSmemWords = 1;
  // 16 words fetched ahead, 16 in flight through the transposes and the quad exchange:
  // three resident blocks (80 registers) would spill.
  static constexpr int kMinBlocks = 2;
  static constexpr int kPrefetchTiles = 0;

  WPREP_HD static int64_t TilesAlongB(const Geometry& g) {
    return CeilDiv(g.blackwell_scale.kpad / 4, kBlackwellScaleTileBlocks);
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return g.blackwell_scale.npad / 128 * TilesAlongB(g);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, a, b * kBlackwellScaleTileBlocks);
  }

  struct Unit {
    int q;
    int64_t k0, n;  // block row k0, first column 128n0 + 4q (of a = 0)
  };
  WPREP_HD static bool GetUnit(const Geometry& g, const TileCtx& ctx, int vt, Unit* u) {
    int k0l;
    if (kSwizzle && g.scale_access == ScaleAccess::kColumns) {
      u->q = (vt & 3) | (((vt >> 5) & 1) << 2);
      k0l = ((vt >> 2) & 7) | ((vt >> 6) << 3);
    } else {
      u->q = vt & 7;
      k0l = vt >> 3;
    }
    u->k0 = ctx.b0 + k0l;
    u->n = 128 * ctx.a0 + 4 * u->q;
    return u->k0 < g.blackwell_scale.kpad / 4;
  }
  // The 64 storage bytes of the unit: in one 256-byte half of its block.
  WPREP_HD static int64_t StorageOffset(const Geometry& g, const TileCtx& ctx, const Unit& u) {
    const int64_t half = u.q >> 2, inner = 64 * (u.q & 3);
    if constexpr (kSwizzle) {
      return (ctx.a0 * (g.blackwell_scale.kpad / 4) + u.k0) * kBlackwellScaleBlock + 256 * half +
             inner;
    } else {
      return ctx.a0 * g.in_stride[0] + u.k0 * g.in_stride[1] + half * g.in_stride[2] + inner;
    }
  }

  // Swizzle: words 4c + a = x[4k0 + c, n + 32a ..] (rows form) or, for a transposed view,
  // words 4i + a = x[4k0 .., n + 32a + i] (already storage words). Unswizzle: the 16
  // storage words in order.
  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    const BlackwellScaleTiling& t = g.blackwell_scale;
    if constexpr (kSwizzle) {
      const int64_t* s = g.scale_stride;
      if (g.scale_access == ScaleAccess::kColumns) {
        const int64_t valid_k = ValidBytes(4 * u.k0, t.k, 4);
        WPREP_UNROLL
        for (int i = 0; i < 4; ++i) {
          WPREP_UNROLL
          for (int a = 0; a < 4; ++a) {
            const int64_t n = u.n + 32 * a + i;
            const int64_t valid = n < t.n ? valid_k : 0;
            ld.template Row<1>(4 * i + a, valid > 0 ? ctx.in + n * s[1] + 4 * u.k0 : ctx.in, valid,
                               access.word_in);
          }
        }
        return;
      }
      WPREP_UNROLL
      for (int c = 0; c < 4; ++c) {
        const int64_t k = 4 * u.k0 + c;
        WPREP_UNROLL
        for (int a = 0; a < 4; ++a) {
          const int64_t n = u.n + 32 * a;
          const int64_t valid = k < t.k ? ValidBytes(n, t.n, 4) : 0;
          if (g.scale_access == ScaleAccess::kRows) {
            ld.template Row<1>(4 * c + a, valid > 0 ? ctx.in + k * s[0] + n : ctx.in, valid,
                               access.word_in);
          } else {
            uint32_t word = 0;
            for (int j = 0; j < valid; ++j) word |= uint32_t{ctx.in[k * s[0] + (n + j) * s[1]]} << (8 * j);
            ld.Set(4 * c + a, word);
          }
        }
      }
    } else {
      // Blocks wholly outside K x N are never stored: skip their loads.
      const bool needed = 4 * u.k0 < t.k && u.n < t.n;
      ld.template Row<16>(0, needed ? ctx.in + StorageOffset(g, ctx, u) : ctx.in, needed ? 64 : 0,
                          access.vec_in);
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Fetched& r, uint32_t*) {
    Unit u;
    const bool active = GetUnit(g, ctx, vt, &u);
    const BlackwellScaleTiling& t = g.blackwell_scale;
    if constexpr (kSwizzle) {
      // Storage word 4i + a of the unit = (b = 4q + i, a).
      uint32_t o[16];
      if (g.scale_access == ScaleAccess::kColumns) {
        WPREP_UNROLL
        for (int k = 0; k < 16; ++k) o[k] = r.w[k];
      } else {
        WPREP_UNROLL
        for (int a = 0; a < 4; ++a) {
          uint32_t w[4] = {r.w[a], r.w[4 + a], r.w[8 + a], r.w[12 + a]};
          Transpose4x4Bytes(w);
          WPREP_UNROLL
          for (int i = 0; i < 4; ++i) o[4 * i + a] = w[i];
        }
      }
      StoreBlock64(active ? ctx.out + StorageOffset(g, ctx, u) : ctx.out, o, active,
                   access.vec_out);
    } else {
      if (!active) return;
      WPREP_UNROLL
      for (int a = 0; a < 4; ++a) {
        uint32_t w[4] = {r.w[a], r.w[4 + a], r.w[8 + a], r.w[12 + a]};
        Transpose4x4Bytes(w);  // w[c] = x[4k0 + c, n + 32a ..]
        const int64_t n = u.n + 32 * a;
        WPREP_UNROLL
        for (int c = 0; c < 4; ++c) {
          const int64_t k = 4 * u.k0 + c;
          const int64_t valid = k < t.k ? ValidBytes(n, t.n, 4) : 0;
          StoreRowWords<1>(valid > 0 ? ctx.out + k * g.scale_stride[0] + n : ctx.out, valid, &w[c],
                           access.word_out);
        }
      }
    }
  }
  WPREP_HD static void Store(const Geometry&, const TileCtx&, int, Access, uint32_t*) {}
};

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_SCALE_TILES_H_
