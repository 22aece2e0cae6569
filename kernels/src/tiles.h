// A tile is the unit of work of one CUDA block (kTileThreads threads) and of one CPU
// task: the body is written once (fast_tiles.h, generic_tiles.h, scale_tiles.h) and runs
// in both engines. Every tile type T provides T::kSmemWords, T::kTwoStage, T::Fetched (the
// registers one Fetch fills), its tile grid (TilesPerMatrix, TilesAlongB, Context) and the
// per-virtual-thread steps Fetch, Stage and Store described in fast_tiles.h. A CUDA block
// runs one virtual thread per thread (kTileThreads); the CPU engine runs them in turn.
#ifndef WPREP_KERNELS_SRC_TILES_H_
#define WPREP_KERNELS_SRC_TILES_H_

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "fast_tiles.h"
#include "generic_tiles.h"
#include "scale_tiles.h"

namespace wprep::tiles {

// Calls fn.template operator()<T>() with the tile type for g's conversion (a closed
// set, FlashInfer style). Returns false for a geometry outside the set. Checkpoint order
// adds no tile: MakePlan expresses it as the Hopper tiles on the stored matrix and as
// Blackwell retiles between single-tile arrangements (Geometry::hopper_q_is_canonical,
// MakeRowTiling); blackwell_value is the Blackwell tiles on its single-tile tiling.
// The Hopper tiles exist for mma versions 2 and 3 only: any other version is refused,
// never served by the tiles of another.
template <class Fn>
bool DispatchTile(const Geometry& g, Fn&& fn) {
  const bool along = g.hopper_q_is_canonical;
  const bool mma2 = g.mma_version == 2;
  const bool mma_known = mma2 || g.mma_version == 3;
  const bool in16 = ChunksStayInTiles(g.in_tiling), out16 = ChunksStayInTiles(g.out_tiling);
  const bool columns = g.scale_access == ScaleAccess::kColumns;
  // Hopper scale O rows of 128 blocks or more, a whole tile's width of the wide tiles.
  const bool wide = g.hopper_scale.cols_pad / 2 >= HopperScaleColumnsSwizzleTile<2>::kTileBlocks;
  switch (g.op) {
    case Op::kHopperSwizzle:
      if (!mma_known) return false;
      if (along) {
        mma2 ? fn.template operator()<HopperMxAlongPackingTile<Op::kHopperSwizzle, 2>>()
             : fn.template operator()<HopperMxAlongPackingTile<Op::kHopperSwizzle, 3>>();
      } else {
        mma2 ? fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperSwizzle, 2>>()
             : fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperSwizzle, 3>>();
      }
      return true;
    case Op::kHopperUnswizzle:
      if (!mma_known) return false;
      if (along) {
        mma2 ? fn.template operator()<HopperMxAlongPackingTile<Op::kHopperUnswizzle, 2>>()
             : fn.template operator()<HopperMxAlongPackingTile<Op::kHopperUnswizzle, 3>>();
      } else {
        mma2 ? fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperUnswizzle, 2>>()
             : fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperUnswizzle, 3>>();
      }
      return true;
    case Op::kBlackwellSwizzle:
      g.out_tiling.tile_k % 16 == 0 ? fn.template operator()<BlackwellSwizzleTile>()
            : fn.template operator()<GenericTile<Op::kBlackwellSwizzle>>();
      return true;
    case Op::kBlackwellUnswizzle:
      in16 ? fn.template operator()<BlackwellTile<Op::kBlackwellUnswizzle>>()
           : fn.template operator()<GenericTile<Op::kBlackwellUnswizzle>>();
      return true;
    case Op::kBlackwellRetile:
      in16 && out16 ? fn.template operator()<BlackwellTile<Op::kBlackwellRetile>>()
                    : fn.template operator()<GenericTile<Op::kBlackwellRetile>>();
      return true;
    case Op::kHopperScaleSwizzle:
      if (!columns) {
        // Two chunks a thread halve the tiles of wide O rows; narrow ones would leave half
        // the threads of each tile idle.
        wide ? fn.template operator()<HopperScaleRowsTile<Op::kHopperScaleSwizzle, 2>>()
             : fn.template operator()<HopperScaleRowsTile<Op::kHopperScaleSwizzle, 1>>();
      } else if (wide || g.hopper_scale.out_rows < 16) {
        fn.template operator()<HopperScaleColumnsSwizzleTile<2>>();  // wide O rows
      } else {
        fn.template operator()<HopperScaleColumnsSwizzleTile<16>>();  // few blocks a row
      }
      return true;
    case Op::kHopperScaleUnswizzle:
      columns ? fn.template operator()<HopperScaleColumnsUnswizzleTile>()
              : fn.template operator()<HopperScaleRowsTile<Op::kHopperScaleUnswizzle>>();
      return true;
    case Op::kBlackwellScaleSwizzle:
      fn.template operator()<BlackwellScaleTile<Op::kBlackwellScaleSwizzle>>();
      return true;
    case Op::kBlackwellScaleUnswizzle:
      fn.template operator()<BlackwellScaleTile<Op::kBlackwellScaleUnswizzle>>();
      return true;
  }
  return false;
}

// The engines' error for a geometry DispatchTile refused. MakePlan admits none, so this
// names what a plan made some other way got wrong.
inline absl::Status UnsupportedGeometry(const Geometry& g) {
  if ((g.op == Op::kHopperSwizzle || g.op == Op::kHopperUnswizzle) && g.mma_version != 2 &&
      g.mma_version != 3) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "hopper_value: no tiles for mma_version %d; mma_version must be 2 or 3", g.mma_version));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "conversion op %d is outside the engines' supported set", static_cast<int>(g.op)));
}

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_TILES_H_
