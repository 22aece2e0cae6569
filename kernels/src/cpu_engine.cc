#include "wprep/kernels/cpu_engine.h"

#include <optional>

#include "absl/strings/str_format.h"
#include "buffers.h"
#include "cpu_parallel.h"
#include "hopper_cpu.h"
#include "moe_geometry.h"
#include "nibble_cpu.h"
#include "retile_cpu.h"
#include "scale_cpu.h"
#include "tiles.h"

namespace wprep {
absl::Status ConvertOnCpu(const Plan& plan, const uint8_t* in, size_t in_size, uint8_t* out,
                          size_t out_size, const CpuOptions& options) {
  if (in_size < plan.input_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "input buffer holds %d bytes; the planned input spans %d", in_size, plan.input_bytes));
  }
  if (out_size < plan.output_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "output buffer holds %d bytes; the planned output needs %d", out_size, plan.output_bytes));
  }
  if (plan.empty()) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("input and output buffers must not be null");
  }
  if (auto s = CheckDisjoint(plan, in, out); !s.ok()) return s;
  if (auto s = CheckPlanned(plan); !s.ok()) return s;

  const Geometry& g = *plan.geometry;
  // blackwell_scale's swizzle of a checkpoint's transposed view: the MoE engine's scale
  // pass, a checkpoint row at a time (the tiles would gather each column's bytes).
  if (std::optional<moe::InterleavePass> p = moe::BlackwellScaleViewPass(g); p.has_value()) {
    moe::RunInterleave16OnCpu(*p, in, out, options.threads);
    return absl::OkStatus();
  }
  // Every pass splits its units of work over the threads the same way (cpu_parallel.h).
  auto parallel = [&](int64_t units, const auto& fn) { cpu::Parallel(units, plan.output_bytes, options.threads, fn); };
  if (cpu_hopper::Serves(g)) {
    parallel(cpu_hopper::UnitCount(g), [&](int64_t b, int64_t e) { cpu_hopper::Units(g, in, out, b, e); });
    return absl::OkStatus();
  }
  if (cpu_hopper::ServesCross(g)) {
    parallel(cpu_hopper::CrossUnitCount(g), [&](int64_t b, int64_t e) { cpu_hopper::CrossUnits(g, in, out, b, e); });
    return absl::OkStatus();
  }
  if (cpu_nibble::ServesBlackwell(g)) {
    parallel(cpu_nibble::BlackwellUnitCount(g),
             [&](int64_t b, int64_t e) { cpu_nibble::BlackwellUnits(g, in, out, b, e); });
    return absl::OkStatus();
  }
  if (cpu_retile::Serves(g)) {
    cpu_retile::Run(g, in, out, parallel);
    return absl::OkStatus();
  }
  if (cpu_scale::ServesBlackwellScale(g)) {
    parallel(cpu_scale::BlackwellScaleBlockCount(g),
             [&](int64_t b, int64_t e) { cpu_scale::BlackwellScaleBlocks(g, in, out, b, e); });
    return absl::OkStatus();
  }
  if (cpu_scale::ServesHopperScale(g)) {
    parallel(g.num_matrices * g.hopper_scale.out_rows,
             [&](int64_t b, int64_t e) { cpu_scale::HopperScaleRows(g, in, out, b, e); });
    return absl::OkStatus();
  }
  const tiles::Access access = tiles::ChooseAccess(g, in, out);
  int64_t tiles_per_matrix = 0;
  if (!tiles::DispatchTile(g, [&]<class T>() { tiles_per_matrix = T::TilesPerMatrix(g); })) {
    return tiles::UnsupportedGeometry(g);
  }
  const int64_t num_tiles = g.num_matrices * tiles_per_matrix;

  // Each worker runs whole tiles: Fetch and Stage for every virtual thread, then Store.
  auto run_range = [&](int64_t begin, int64_t end) {
    tiles::DispatchTile(g, [&]<class T>() {
      alignas(16) uint32_t smem[T::kSmemWords];
      const int64_t tiles_b = T::TilesAlongB(g);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t e = t / tiles_per_matrix, r = t - e * tiles_per_matrix;
        const tiles::TileCtx ctx = T::Context(g, in, out, e, r / tiles_b, r % tiles_b);
        for (int vt = 0; vt < kTileThreads; ++vt) {
          typename T::Fetched regs;
          T::Fetch(g, ctx, vt, access, regs);
          T::Stage(g, ctx, vt, access, regs, smem);
        }
        if constexpr (T::kTwoStage) {
          for (int vt = 0; vt < kTileThreads; ++vt) T::Store(g, ctx, vt, access, smem);
        }
      }
    });
  };
  parallel(num_tiles, run_range);
  return absl::OkStatus();
}

}  // namespace wprep
