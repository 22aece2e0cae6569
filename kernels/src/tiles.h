// A tile is the unit of work of one CUDA block (kTileThreads threads) and of one CPU
// task: the body is written once (fast_tiles.h, generic_tiles.h) and runs in both
// engines. Every tile type T provides T::kSmemWords, T::kTwoStage, T::Fetched (the
// registers one Fetch fills), its tile grid (TilesPerMatrix, TilesAlongB, Context) and the
// per-virtual-thread steps Fetch, Stage and Store described in fast_tiles.h. A CUDA block
// runs one virtual thread per thread (kTileThreads); the CPU engine runs them in turn.
#ifndef WPREP_KERNELS_SRC_TILES_H_
#define WPREP_KERNELS_SRC_TILES_H_

#include "fast_tiles.h"
#include "generic_tiles.h"

namespace wprep::tiles {

// Calls fn.template operator()<T>() with the tile type for g's conversion (a closed
// set, FlashInfer style). Returns false for a geometry outside the set.
template <class Fn>
bool DispatchTile(const Geometry& g, Fn&& fn) {
  const bool mx1 = g.mx_axis == -1;
  const bool mma2 = g.mma_version == 2;
  const bool in16 = g.in_tiling.tile_k % 16 == 0, out16 = g.out_tiling.tile_k % 16 == 0;
  switch (g.op) {
    case Op::kHopperSwizzle:
      if (mx1) {
        mma2 ? fn.template operator()<HopperMxAlongPackingTile<Op::kHopperSwizzle, 2>>()
             : fn.template operator()<HopperMxAlongPackingTile<Op::kHopperSwizzle, 3>>();
      } else {
        mma2 ? fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperSwizzle, 2>>()
             : fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperSwizzle, 3>>();
      }
      return true;
    case Op::kHopperUnswizzle:
      if (mx1) {
        mma2 ? fn.template operator()<HopperMxAlongPackingTile<Op::kHopperUnswizzle, 2>>()
             : fn.template operator()<HopperMxAlongPackingTile<Op::kHopperUnswizzle, 3>>();
      } else {
        mma2 ? fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperUnswizzle, 2>>()
             : fn.template operator()<HopperMxAcrossPackingTile<Op::kHopperUnswizzle, 3>>();
      }
      return true;
    case Op::kBlackwellSwizzle:
      out16 ? fn.template operator()<BlackwellSwizzleTile>()
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
  }
  return false;
}

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_TILES_H_
