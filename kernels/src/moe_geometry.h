// What the MoE engines consume: one pass per output tensor (moe_math.h), derived from a
// MoePlan by the same code that validated it, so the engines never trust a hand-built
// geometry.
#ifndef WPREP_KERNELS_SRC_MOE_GEOMETRY_H_
#define WPREP_KERNELS_SRC_MOE_GEOMETRY_H_

#include "absl/status/statusor.h"
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
// The uint8 128x4 interleave of pass `p` (the MoE engine's scale pass) on `cuda_stream`;
// `out` 16-byte aligned. The CUDA engine's blackwell_scale swizzle of a checkpoint's
// transposed view is this pass with the plain row map.
void LaunchInterleave16OnCuda(const InterleavePass& p, const uint8_t* in, uint8_t* out, void* cuda_stream);

}  // namespace moe
}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_MOE_GEOMETRY_H_
