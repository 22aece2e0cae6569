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
//   HopperScaleColumnsTile: S columns contiguous (mx_axis -2 of a dense tensor): a run's
//     column is 16 contiguous bytes, so registers suffice.
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
// the loader's words 0..3.
template <class Ld>
WPREP_HD void LoadScaleRun(const Geometry& g, const uint8_t* base, int64_t r, int64_t col,
                           int64_t valid, bool vec, Ld& ld) {
  if (g.scale_access == ScaleAccess::kRows) {
    ld.template Row<4>(0, valid > 0 ? base + r * g.scale_stride[0] + col : base, valid, vec);
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
    ld.Set(i, word);
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
// Hopper scale through shared memory. A tile is one O row segment of 64 blocks (4 KiB):
// ctx.a0 = O row, ctx.b0 = first block k0; it takes S rows (32, the O row's two runs) x
// columns 2k0.. (128). The window holds them row-major, 128 bytes a row, with the 16-byte
// chunks of row p XOR-ed by HopperScaleSmemXor(p): the S-row side then writes whole rows
// and the O side reads halfwords of rows 16a + 4h + i (four (a, h) per warp instruction)
// from four different chunks, so neither side conflicts on banks.

WPREP_HD int HopperScaleSmemXor(int p) { return (p & 7) ^ ((p >> 3) & 2); }
WPREP_HD int HopperScaleSmemByte(int p, int col) {
  return 128 * p + ((((col >> 4) ^ HopperScaleSmemXor(p)) & 7) << 4) + (col & 15);
}

inline constexpr int kScaleSegmentBlocks = 64;  // O blocks (k0) per Hopper scale tile

// Unswizzles fetch kScaleUnswizzleAhead tiles ahead (the cp.async kernel): at 8 MiB they
// are bound by load latency, and 48 bytes in flight a thread instead of 16 (or 32) take
// them from 2.05-2.10x a device copy to 1.84-1.86x on an H200. The swizzles gain nothing
// from it (or lose), and keep the register pipeline.
inline constexpr int kScaleUnswizzleAhead = 3;

template <Op kOp>
struct HopperScaleRowsTile {
  static_assert(kOp == Op::kHopperScaleSwizzle || kOp == Op::kHopperScaleUnswizzle);
  static constexpr bool kSwizzle = kOp == Op::kHopperScaleSwizzle;
  using Fetched = RegsOf<4>;
  static constexpr bool kTwoStage = true;
  static constexpr int kSmemWords = 32 * 128 / 4;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = kSwizzle ? 0 : kScaleUnswizzleAhead;

  WPREP_HD static int64_t TilesAlongB(const Geometry& g) {
    return CeilDiv(g.hopper_scale.cols_pad / 2, kScaleSegmentBlocks);
  }
  WPREP_HD static int64_t TilesPerMatrix(const Geometry& g) {
    return g.hopper_scale.out_rows * TilesAlongB(g);
  }
  WPREP_HD static TileCtx Context(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t e,
                                  int64_t a, int64_t b) {
    return MakeCtx(g, in, out, e, a, b * kScaleSegmentBlocks);
  }

  // S side of virtual thread vt: window row p, chunk j (16 columns).
  struct SRun {
    int p, j;
    int64_t r, col, valid;
  };
  WPREP_HD static SRun GetSRun(const Geometry& g, const TileCtx& ctx, int vt) {
    SRun s;
    s.p = vt >> 3;
    s.j = vt & 7;
    s.r = HopperScaleRunRow(g.hopper_scale, ctx.a0, s.p >> 4) + (s.p & 15);
    s.col = 2 * ctx.b0 + 16 * s.j;
    s.valid = s.r < g.hopper_scale.rows ? ValidBytes(s.col, g.hopper_scale.cols, kChunk) : 0;
    return s;
  }
  // O side of vt: block k0, run a, half h; false past the row's last block.
  struct OChunk {
    int k0l, a, h;
    int64_t k0;
  };
  WPREP_HD static bool GetOChunk(const Geometry& g, const TileCtx& ctx, int vt, OChunk* o) {
    o->k0l = vt >> 2;
    o->a = (vt >> 1) & 1;
    o->h = vt & 1;
    o->k0 = ctx.b0 + o->k0l;
    return o->k0 < g.hopper_scale.cols_pad / 2;
  }
  // The chunk's byte in its O row.
  WPREP_HD static int64_t OOffset(const OChunk& o) { return 64 * o.k0 + 32 * o.a + 16 * o.h; }

  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    if constexpr (kSwizzle) {
      const SRun s = GetSRun(g, ctx, vt);
      LoadScaleRun(g, ctx.in, s.r, s.col, s.valid, access.vec_in, ld);
    } else {
      OChunk o;
      // Runs wholly in the padding are never stored: skip their loads.
      const bool needed = GetOChunk(g, ctx, vt, &o) &&
                          HopperScaleRunRow(g.hopper_scale, ctx.a0, o.a) < g.hopper_scale.rows;
      const uint8_t* p = ctx.in + ctx.a0 * g.in_stride[0] + OOffset(o);
      ld.template Row<4>(0, needed ? p : ctx.in, needed ? kChunk : 0, access.vec_in);
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access,
                             const Fetched& r, uint32_t* smem) {
    auto* window = reinterpret_cast<uint8_t*>(smem);
    if constexpr (kSwizzle) {
      const SRun s = GetSRun(g, ctx, vt);
      Store4Words(window + HopperScaleSmemByte(s.p, 16 * s.j), r.w);
    } else {
      OChunk o;
      if (!GetOChunk(g, ctx, vt, &o)) return;
      WPREP_UNROLL
      for (int i = 0; i < 4; ++i) {
        uint32_t lo, hi;
        HopperScaleHalves(r.w[i], &lo, &hi);
        const int p = 16 * o.a + 4 * o.h + i;
        StoreHalf(window + HopperScaleSmemByte(p, 2 * o.k0l), lo);
        StoreHalf(window + HopperScaleSmemByte(p + 8, 2 * o.k0l), hi);
      }
    }
  }

  WPREP_HD static void Store(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             uint32_t* smem) {
    const auto* window = reinterpret_cast<const uint8_t*>(smem);
    if constexpr (kSwizzle) {
      OChunk o;
      if (!GetOChunk(g, ctx, vt, &o)) return;
      uint32_t w[4];
      WPREP_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int p = 16 * o.a + 4 * o.h + i;
        w[i] = HopperScaleWord(LoadHalf(window + HopperScaleSmemByte(p, 2 * o.k0l)),
                               LoadHalf(window + HopperScaleSmemByte(p + 8, 2 * o.k0l)));
      }
      StoreRowWords<4>(ctx.out + ctx.a0 * g.hopper_scale.out_cols + OOffset(o), kChunk, w,
                       access.vec_out);
    } else {
      const SRun s = GetSRun(g, ctx, vt);
      if (s.valid == 0) return;
      uint32_t w[4];
      Load4Words(w, window + HopperScaleSmemByte(s.p, 16 * s.j));
      StoreScaleRun(g, ctx.out, s.r, s.col, s.valid, access.vec_out, w);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Hopper scale with S columns contiguous, registers only. A tile is two O rows (ctx.a0,
// ctx.a0 + 1) x 64 blocks from ctx.b0; virtual thread vt takes O row ctx.a0 + (vt & 1),
// run a = (vt >> 1) & 1 and block k0: S columns 2k0 and 2k0 + 1 of the run (16 bytes
// each) <-> the 32 O bytes of (k0, a). Lanes 2i, 2i + 1 take the two O rows, whose runs
// are adjacent in S (16 rows apart), so each pair of lanes reads one 32-byte sector; the
// 8 blocks of a warp write 512 contiguous bytes of each row.

template <Op kOp>
struct HopperScaleColumnsTile {
  static_assert(kOp == Op::kHopperScaleSwizzle || kOp == Op::kHopperScaleUnswizzle);
  static constexpr bool kSwizzle = kOp == Op::kHopperScaleSwizzle;
  using Fetched = RegsOf<8>;
  static constexpr bool kTwoStage = false;
  static constexpr int kSmemWords = 1;
  static constexpr int kMinBlocks = 4;
  static constexpr int kPrefetchTiles = kSwizzle ? 0 : kScaleUnswizzleAhead;

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
    int64_t orow, k0, r0;  // O row, block, first S row of the run
    int a;
    int64_t rows;          // S rows of the run that exist
  };
  // False past the storage (O rows, blocks) or, for unswizzle, for runs in the padding.
  WPREP_HD static bool GetUnit(const Geometry& g, const TileCtx& ctx, int vt, Unit* u) {
    const HopperScaleTiling& t = g.hopper_scale;
    u->orow = ctx.a0 + (vt & 1);
    u->a = (vt >> 1) & 1;
    u->k0 = ctx.b0 + (((vt >> 2) & 7) | ((vt >> 5) << 3));
    if (u->orow >= t.out_rows || u->k0 >= t.cols_pad / 2) return false;
    u->r0 = HopperScaleRunRow(t, u->orow, u->a);
    u->rows = ValidBytes(u->r0, t.rows, kChunk);
    return kSwizzle || u->rows > 0;
  }
  // S column col of the run: 16 bytes (rows r0..) from the strided view.
  WPREP_HD static int64_t ColumnOffset(const Geometry& g, const Unit& u, int64_t col) {
    return col * g.scale_stride[1] + u.r0;
  }

  template <class Ld>
  WPREP_HD static void Fetch(const Geometry& g, const TileCtx& ctx, int vt, Access access, Ld& ld) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    if constexpr (kSwizzle) {
      WPREP_UNROLL
      for (int d = 0; d < 2; ++d) {
        const int64_t col = 2 * u.k0 + d;
        const int64_t valid = col < g.hopper_scale.cols ? u.rows : 0;
        ld.template Row<4>(4 * d, valid > 0 ? ctx.in + ColumnOffset(g, u, col) : ctx.in, valid,
                           access.vec_in);
      }
    } else {
      ld.template Row<8>(0, ctx.in + u.orow * g.in_stride[0] + 64 * u.k0 + 32 * u.a, 32,
                         access.vec_in);
    }
  }

  WPREP_HD static void Stage(const Geometry& g, const TileCtx& ctx, int vt, Access access,
                             const Fetched& r, uint32_t*) {
    Unit u;
    if (!GetUnit(g, ctx, vt, &u)) return;
    // Column words x[q] (rows 4q..4q + 3 of column 2k0) and y[q] (column 2k0 + 1); O word
    // c = (x.c, x.8 + c, y.c, y.8 + c): for c < 4 the transpose of (x0, x2, y0, y2), for
    // c >= 4 of (x1, x3, y1, y3). The transpose is its own inverse.
    uint32_t w[8];
    if constexpr (kSwizzle) {
      const uint32_t* x = r.w;
      const uint32_t* y = r.w + 4;
      uint32_t lo[4] = {x[0], x[2], y[0], y[2]}, hi[4] = {x[1], x[3], y[1], y[3]};
      Transpose4x4Bytes(lo);
      Transpose4x4Bytes(hi);
      WPREP_UNROLL
      for (int i = 0; i < 4; ++i) {
        w[i] = lo[i];
        w[4 + i] = hi[i];
      }
      StoreRowWords<8>(ctx.out + u.orow * g.hopper_scale.out_cols + 64 * u.k0 + 32 * u.a, 32, w,
                       access.vec_out);
    } else {
      uint32_t lo[4] = {r.w[0], r.w[1], r.w[2], r.w[3]}, hi[4] = {r.w[4], r.w[5], r.w[6], r.w[7]};
      Transpose4x4Bytes(lo);
      Transpose4x4Bytes(hi);
      const uint32_t x[4] = {lo[0], hi[0], lo[1], hi[1]}, y[4] = {lo[2], hi[2], lo[3], hi[3]};
      WPREP_UNROLL
      for (int d = 0; d < 2; ++d) {
        const int64_t col = 2 * u.k0 + d;
        const int64_t valid = col < g.hopper_scale.cols ? u.rows : 0;
        StoreRowWords<4>(valid > 0 ? ctx.out + ColumnOffset(g, u, col) : ctx.out, valid,
                         d == 0 ? x : y, access.vec_out);
      }
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
