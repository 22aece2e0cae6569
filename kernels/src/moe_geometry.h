// What the MoE engines consume: one pass per output tensor (moe_math.h), derived from a
// MoePlan by the same code that validated it, so the engines never trust a hand-built
// geometry.
#ifndef WPREP_KERNELS_SRC_MOE_GEOMETRY_H_
#define WPREP_KERNELS_SRC_MOE_GEOMETRY_H_

#include <optional>

#include "absl/status/statusor.h"
#include "layout_math.h"
#include "moe_math.h"
#include "wprep/kernels/moe.h"

namespace wprep {
namespace moe {

struct OutputPass {
  bool interleave = false;  // InterleavePass, else RowsPass
  int input = 0;            // index into the plan's inputs
  RowsPass rows;
  InterleavePass il;
};

struct Geometry {
  int num_outputs = 0;
  OutputPass outputs[3];
};

// The plan (validated by PlanMoe) and its geometry; PlanMoe is this without the geometry.
absl::StatusOr<MoePlan> PlanWithGeometry(MoeOp op, const MoeParams& params,
                                         std::vector<MoeTensorDesc> inputs, Geometry* geometry);

// The geometry of a plan PlanMoe returned; Internal if the plan was altered since.
absl::StatusOr<Geometry> GeometryOf(const MoePlan& plan);

// One rows pass of a geometry alone, as the engines run it for a plan: on the CPU, every
// row on this thread (moe_cpu.cc); or queued on `cuda_stream` (a cudaStream_t, nullptr the
// legacy stream) of the current device, the launch's error left for cudaGetLastError
// (moe_cuda.cu, CUDA builds only). For callers that prepare an operand beside work of
// their own, such as the fused quantizers' bias.
void RunRowsOnCpu(const RowsPass& p, const uint8_t* in, uint8_t* out);
void LaunchRowsOnCuda(const RowsPass& p, const uint8_t* in, uint8_t* out, void* cuda_stream);
// The uint8 128x4 interleave of pass `p` (the MoE engine's scale pass): on the CPU with
// up to `threads` threads (0: one per core), or on `cuda_stream` with `out` 16-byte
// aligned.
void RunInterleave16OnCpu(const InterleavePass& p, const uint8_t* in, uint8_t* out, int threads);
void LaunchInterleave16OnCuda(const InterleavePass& p, const uint8_t* in, uint8_t* out, void* cuda_stream);

// blackwell_scale's swizzle of a checkpoint's scales [..., N, K/32] through their
// transposed view [..., K/32, N] (what loaders pass) is the 128x4 interleave of the
// checkpoint's [N, K/32] rows, padded to [Np, Kp]: the scale pass above with the plain
// row map. That pass for a conversion's geometry when its input is exactly that view of
// dense matrices; else nullopt (the layout's own tiles run).
inline std::optional<InterleavePass> BlackwellScaleViewPass(const ::wprep::Geometry& g) {
  const BlackwellScaleTiling& t = g.blackwell_scale;
  if (g.op != Op::kBlackwellScaleSwizzle || g.scale_access != ScaleAccess::kColumns || g.scale_stride[0] != 1 ||
      g.scale_stride[1] != t.k || g.out_matrix_bytes != t.npad * t.kpad || t.npad % 128 != 0 || t.kpad % 4 != 0) {
    return std::nullopt;
  }
  if (!InputMatricesBackToBack(g, t.n * t.k)) return std::nullopt;
  InterleavePass p;
  p.experts = g.num_matrices;
  p.rows_in = t.n;
  p.cols_in = t.k;
  p.rows_p = t.npad;
  p.cols_p = t.kpad;
  p.elem_bytes = 1;
  p.map.limit = t.n;
  return p;
}

}  // namespace moe
}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_MOE_GEOMETRY_H_
