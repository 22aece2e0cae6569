// Planning and the CPU engine for quantize_mxfp4. The per-group math lives in
// quantize_math.h (shared with the device code); this file only walks groups.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "wprep/kernels/quantize.h"
#include "layout_math.h"
#include "moe_geometry.h"
#include "quantize_math.h"
#include "wprep/kernels/moe.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/status_macros.h"

namespace wprep {
namespace {

bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

float LoadElement(QuantDtype dtype, const uint8_t* p) {
  switch (dtype) {
    case QuantDtype::kBfloat16: {
      uint16_t h = static_cast<uint16_t>(p[0] | p[1] << 8);
      return qmath::Bf16ToFloat(h);
    }
    case QuantDtype::kFloat16: {
      uint16_t h = static_cast<uint16_t>(p[0] | p[1] << 8);
      return qmath::Fp16ToFloat(h);
    }
    case QuantDtype::kFloat32: {
      uint32_t u = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                   static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
      return qmath::BitsFloat(u);
    }
  }
  return 0.0f;
}

// One group of `nel` (<= 32) elements at `src`: its scale byte, and when `codes` is set its
// e2m1 codes packed two a byte (the even element low; an odd last element's high nibble 0),
// (nel + 1) / 2 bytes. The steps of docs/LAYOUTS.md, "Quantization to MXFP4".
uint8_t QuantizeGroup(QuantDtype dtype, const uint8_t* src, int nel, bool up, uint8_t* codes) {
  const int esize = QuantDtypeBytes(dtype);
  float group[qmath::kGroup];
  float amax = 0.0f;
  for (int i = 0; i < nel; ++i) {
    group[i] = LoadElement(dtype, src + i * esize);
    amax = qmath::AbsMaxNum(amax, group[i]);
  }
  const uint32_t e = qmath::ScaleBits(amax, up);
  if (codes != nullptr) {
    const float qs = qmath::ScaleMultiplier(e);
    for (int i = 0; i < nel; i += 2) {
      const uint32_t lo = qmath::EncodeE2m1(group[i] * qs);
      const uint32_t hi = i + 1 < nel ? qmath::EncodeE2m1(group[i + 1] * qs) : 0u;
      codes[i / 2] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
  return static_cast<uint8_t>(e >> 23);
}

bool PowerOfTwoIn(int v, int lo, int hi) { return v >= lo && v <= hi && (v & (v - 1)) == 0; }

// Elements of group `g` of a row of `q`.
int GroupSize(int64_t q, int64_t g) {
  return static_cast<int>(q - g * qmath::kGroup < qmath::kGroup ? q - g * qmath::kGroup : qmath::kGroup);
}

// The fused pairs' common shape rule: a matrix [..., N, K] with an even K.
absl::Status CheckFusedShape(const QuantizePlan& plan, const char* layout) {
  if (plan.input_shape.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape: a fused ", layout, " layout needs a matrix [..., N, K] (rank >= 2)"));
  }
  if (plan.q % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("shape: K (the last dim) is ", plan.q, "; the ", layout,
                                                   " value layout needs it even"));
  }
  return absl::OkStatus();
}

// Buffers of exactly the sizes `plan` in and `values` / `scales` bytes out.
absl::Status CheckBuffers(const QuantizePlan& plan, int64_t values, int64_t scales, size_t in_size,
                          size_t values_size, size_t scales_size) {
  if (static_cast<int64_t>(in_size) != plan.input_bytes || static_cast<int64_t>(values_size) != values ||
      static_cast<int64_t>(scales_size) != scales) {
    return absl::InvalidArgumentError(absl::StrCat("buffers: ", in_size, "/", values_size, "/", scales_size,
                                                   " bytes, the plan needs ", plan.input_bytes, "/", values, "/",
                                                   scales));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<QuantDtype> ParseQuantDtype(const std::string& name) {
  if (name == "bfloat16") return QuantDtype::kBfloat16;
  if (name == "float16") return QuantDtype::kFloat16;
  if (name == "float32") return QuantDtype::kFloat32;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", name, "' is not one of bfloat16, float16, float32"));
}

absl::StatusOr<ScaleRounding> ParseScaleRounding(const std::string& name) {
  if (name == "up") return ScaleRounding::kUp;
  if (name == "down") return ScaleRounding::kDown;
  return absl::InvalidArgumentError(
      absl::StrCat("scale_rounding: '", name, "' is not one of up, down"));
}

int QuantDtypeBytes(QuantDtype dtype) { return dtype == QuantDtype::kFloat32 ? 4 : 2; }

absl::StatusOr<QuantizePlan> MakeQuantizePlan(QuantDtype dtype, absl::Span<const int64_t> shape,
                                              ScaleRounding rounding) {
  if (shape.empty()) {
    return absl::InvalidArgumentError(
        "shape: quantize_mxfp4 needs rank >= 1 (groups run along the last axis)");
  }
  QuantizePlan plan;
  plan.dtype = dtype;
  plan.rounding = rounding;
  plan.input_shape.assign(shape.begin(), shape.end());
  int64_t rows = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("shape: dim ", i, " is ", shape[i],
                                                     "; dims must be >= 0 in [",
                                                     absl::StrJoin(shape, ","), "]"));
    }
    if (i + 1 < shape.size() && !CheckedMul(rows, shape[i], &rows)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape: element count of [", absl::StrJoin(shape, ","), "] overflows 64 bits"));
    }
  }
  plan.rows = rows;
  plan.q = shape.back();
  const int64_t vq = (plan.q + 1) / 2;
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  int64_t elems = 0;
  if (!CheckedMul(rows, plan.q, &elems) ||
      !CheckedMul(elems, QuantDtypeBytes(dtype), &plan.input_bytes) ||
      !CheckedMul(rows, vq, &plan.values_bytes) || !CheckedMul(rows, sq, &plan.scales_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape: byte size of [", absl::StrJoin(shape, ","), "] overflows 64 bits"));
  }
  plan.values_shape = plan.input_shape;
  plan.values_shape.back() = vq;
  plan.scales_shape = plan.input_shape;
  plan.scales_shape.back() = sq;
  return plan;
}

absl::Status QuantizeOnCpu(const QuantizePlan& plan, const uint8_t* in, size_t in_size,
                           uint8_t* values, size_t values_size, uint8_t* scales,
                           size_t scales_size) {
  if (static_cast<int64_t>(in_size) != plan.input_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("input: ", in_size, " bytes, the shape needs ",
                                                   plan.input_bytes));
  }
  if (static_cast<int64_t>(values_size) != plan.values_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "values: ", values_size, " bytes, the shape needs ", plan.values_bytes));
  }
  if (static_cast<int64_t>(scales_size) != plan.scales_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scales: ", scales_size, " bytes, the shape needs ", plan.scales_bytes));
  }
  const int esize = QuantDtypeBytes(plan.dtype);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const int64_t vq = (plan.q + 1) / 2;
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  for (int64_t r = 0; r < plan.rows; ++r) {
    const uint8_t* row = in + r * plan.q * esize;
    for (int64_t g = 0; g < sq; ++g) {
      scales[r * sq + g] = QuantizeGroup(plan.dtype, row + g * qmath::kGroup * esize, GroupSize(plan.q, g), up,
                                         values + r * vq + g * (qmath::kGroup / 2));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<FusedBlackwellGeometry> FusedBlackwellGeometryOf(const QuantizePlan& plan,
                                                                const QuantLayoutSpec& spec) {
  const bool shuffled = spec.layout == QuantLayout::kBlackwellShuffled;
  if (absl::Status s = CheckFusedShape(plan, shuffled ? "blackwell_shuffled_value" : "Blackwell"); !s.ok()) return s;
  if (shuffled) WPREP_RETURN_IF_ERROR(CheckBlackwellParams(BlackwellParams{spec.block_k, spec.block_n}));
  FusedBlackwellGeometry g;
  g.n = plan.input_shape[plan.input_shape.size() - 2];
  g.k = plan.q;
  g.kp = plan.q / 2;
  g.sq = CeilDiv(plan.q, qmath::kGroup);
  g.mats = g.n == 0 ? 0 : plan.rows / g.n;
  auto too_large = [&] {
    return absl::InvalidArgumentError(absl::StrCat("shape: [..., N, K] = [..., ", g.n, ", ", g.k,
                                                   "]; the Blackwell layouts need N and the padded K/2 below 2^31"));
  };
  if (g.n >= (int64_t{1} << 31) || g.kp >= (int64_t{1} << 31)) return too_large();
  g.vt = shuffled ? MakeBlackwellTiling(spec.block_k, spec.block_n, g.kp, g.n)
                  : MakeRowTiling(RoundUp(g.kp, kBlackwellValueKAlign), g.n);
  if (g.vt.kpad >= (int64_t{1} << 31)) return too_large();
  g.st = MakeBlackwellScaleTiling(g.sq, g.n);
  int64_t v = 0, sc = 0;
  if (!CheckedMul(g.vt.ntk * g.vt.tile_k, g.vt.ntn * g.vt.tile_n, &g.v_mat_bytes) ||
      !CheckedMul(g.v_mat_bytes, g.mats, &v) || !CheckedMul(g.st.kpad, g.st.npad, &g.s_mat_bytes) ||
      !CheckedMul(g.s_mat_bytes, g.mats, &sc)) {
    return absl::InvalidArgumentError("shape: the Blackwell layout's byte size overflows 64 bits");
  }
  return g;
}

absl::StatusOr<FusedHopperGeometry> FusedHopperGeometryOf(const QuantizePlan& plan, const QuantLayoutSpec& spec) {
  if (absl::Status s = CheckFusedShape(plan, "Hopper"); !s.ok()) return s;
  if (spec.mma_version != 2 && spec.mma_version != 3) {
    return absl::InvalidArgumentError(absl::StrCat("mma_version: ", spec.mma_version, " is not 2 or 3"));
  }
  if (!PowerOfTwoIn(spec.num_warps, 1, 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_warps: ", spec.num_warps, " is not a power of two in [1, 32]"));
  }
  if (!PowerOfTwoIn(spec.align_k, 2, 64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("align_k: ", spec.align_k, " is not a power of two in [2, 64]"));
  }
  const int64_t n = plan.input_shape[plan.input_shape.size() - 2];
  // Bounds that keep every product below in 64 bits (rows and bytes of a matrix < 2^40).
  if (n > (int64_t{1} << 40) || plan.q > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError("shape: the Hopper layout's byte size overflows 64 bits");
  }
  FusedHopperGeometry g =
      MakeFusedHopperGeometry(n == 0 ? 0 : plan.rows / n, n, plan.q, spec.mma_version, spec.num_warps, spec.align_k);
  int64_t v = 0, sc = 0;
  if (!CheckedMul(g.vt.rows_pad, g.vt.cols_pad, &v) || !CheckedMul(v, g.mats, &v) ||
      !CheckedMul(g.st.rows_pad, g.st.cols_pad, &sc) || !CheckedMul(sc, g.mats, &sc)) {
    return absl::InvalidArgumentError("shape: the Hopper layout's byte size overflows 64 bits");
  }
  // The GPU kernel numbers its tiles (64 rows x 128 elements) in 32 bits: 2^44 elements, far
  // past any device's memory.
  int64_t tiles = 0;
  if (!CheckedMul(g.mats, g.tiles_per_mat, &tiles) || tiles >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        "shape: the fused Hopper layout takes at most 2^31 - 1 tiles of 64 rows x 128 elements (about 2^44 elements); "
        "quantize the tensor in parts");
  }
  return g;
}

namespace {

// The trtllm layouts' sizes and shapes, from their geometry.
QuantOutputSizes TrtllmSizes(const FusedTrtllmGeometry& g) {
  QuantOutputSizes sizes;
  const int64_t e = g.values.experts, rows = g.values.rows_out;
  sizes.values_shape = {e, rows, g.values.out_row_bytes};
  sizes.scales_shape = {e, rows, g.scales.cols_p};
  sizes.bias_shape = {e, rows};
  sizes.values_bytes = e * rows * g.values.out_row_bytes;
  sizes.scales_bytes = e * rows * g.scales.cols_p;
  sizes.bias_bytes = e * rows * 4;
  sizes.moe_plan = g.plan;
  return sizes;
}

}  // namespace

absl::StatusOr<FusedTrtllmGeometry> FusedTrtllmGeometryOf(const QuantizePlan& plan, const QuantLayoutSpec& spec,
                                                          bool bias_bf16) {
  const bool w13 = spec.layout == QuantLayout::kTrtllmW13;
  const char* op = w13 ? "prepare_w13" : "prepare_w2";
  if (plan.input_shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("shape: the trtllm ", op, " layout takes expert weights [E, R, K] ",
                                                   "(rank 3), got [", absl::StrJoin(plan.input_shape, ","), "]"));
  }
  if (plan.q % 32 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape: K (the last dim) is ", plan.q, "; the trtllm MXFP4 layout needs a multiple of 32"));
  }
  MoeParams params;
  if (absl::Status s = SetMoeParam(params, "align", absl::StrCat(spec.align)); !s.ok()) return s;
  const int64_t e = plan.input_shape[0], r = plan.input_shape[1];
  std::vector<MoeTensorDesc> inputs = {{"values", MoeDType::kUint8, {e, r, plan.q / 2}},
                                       {"scales", MoeDType::kUint8, {e, r, plan.q / 32}},
                                       {"bias", bias_bf16 ? MoeDType::kBfloat16 : MoeDType::kFloat32, {e, r}}};
  moe::Geometry geo;
  absl::StatusOr<MoePlan> moe_plan =
      moe::PlanWithGeometry(w13 ? MoeOp::kPrepareW13 : MoeOp::kPrepareW2, params, std::move(inputs), &geo);
  if (!moe_plan.ok()) {
    // The planner names its own operands: the quantized values are the weights here.
    return absl::InvalidArgumentError(absl::StrCat("the trtllm ", op, " layout: ", moe_plan.status().message()));
  }
  FusedTrtllmGeometry g;
  g.values = geo.outputs[0].rows;
  g.scales = geo.outputs[1].il;
  g.bias = geo.outputs[2].rows;
  g.k = plan.q;
  g.plan = *std::move(moe_plan);
  return g;
}

ConversionSpec QuantLayoutConversion(const QuantLayoutSpec& spec, bool values) {
  ConversionSpec c;
  c.direction = Direction::kSwizzle;
  if (spec.layout == QuantLayout::kHopper) {
    if (values) {
      c.layout = Layout::kHopperValue;
      c.hopper.mx_axis = -2;
      c.hopper.mma_version = spec.mma_version;
      c.packing_axis = -2;
    } else {
      c.layout = Layout::kHopperScale;
      c.hopper_scale.mx_axis = -2;
      c.hopper_scale.num_warps = spec.num_warps;
      c.hopper_scale.align_k = spec.align_k;
    }
    return c;
  }
  const bool shuffled = spec.layout == QuantLayout::kBlackwellShuffled;
  c.layout = !values ? Layout::kBlackwellScale : shuffled ? Layout::kBlackwellShuffledValue : Layout::kBlackwellValue;
  if (values) c.packing_axis = -2;
  if (values && shuffled) {
    c.blackwell.block_k = spec.block_k;
    c.blackwell.block_n = spec.block_n;
  }
  return c;
}

namespace {

// An output's shape and strides as QuantLayoutConversion's swizzle of the logical
// [..., K, N] (or [..., ceil(K/32), N]) reports them; its bytes must be `bytes`.
absl::Status ReportedAsSwizzle(const QuantizePlan& plan, const QuantLayoutSpec& spec, bool values, int64_t bytes,
                               std::vector<int64_t>* shape, std::vector<int64_t>* strides) {
  std::vector<int64_t> logical = plan.input_shape;
  const size_t r = logical.size();
  const int64_t n = logical[r - 2], k = logical[r - 1];
  logical[r - 2] = values ? k : CeilDiv(k, qmath::kGroup);
  logical[r - 1] = n;
  absl::StatusOr<Plan> p = MakePlan(QuantLayoutConversion(spec, values), logical);
  if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("shape: ", p.status().message()));
  if (p->output_bytes != static_cast<uint64_t>(bytes)) {
    return absl::InternalError("the layout's conversion plan and the fused quantizer disagree on its size");
  }
  *shape = p->output_shape;
  *strides = p->output_strides;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<QuantOutputSizes> PlanQuantizeLayout(const QuantizePlan& plan, const QuantLayoutSpec& spec) {
  QuantOutputSizes sizes;
  switch (spec.layout) {
    case QuantLayout::kCanonical:
      sizes.values_bytes = plan.values_bytes;
      sizes.scales_bytes = plan.scales_bytes;
      sizes.values_shape = plan.values_shape;
      sizes.scales_shape = plan.scales_shape;
      break;
    case QuantLayout::kBlackwell:
    case QuantLayout::kBlackwellShuffled: {
      auto g = FusedBlackwellGeometryOf(plan, spec);
      if (!g.ok()) return g.status();
      sizes.values_bytes = g->mats * g->v_mat_bytes;
      sizes.scales_bytes = g->mats * g->s_mat_bytes;
      sizes.values_shape.assign(plan.input_shape.begin(), plan.input_shape.end() - 1);  // [..., N, Kpad]
      sizes.values_shape.push_back(g->vt.kpad);
      sizes.scales_shape = {g->mats, g->mats == 0 ? 0 : g->s_mat_bytes};
      if (spec.layout == QuantLayout::kBlackwellShuffled) {
        sizes.scales_strides = DenseStrides(sizes.scales_shape);
        WPREP_RETURN_IF_ERROR(
            ReportedAsSwizzle(plan, spec, true, sizes.values_bytes, &sizes.values_shape, &sizes.values_strides));
        return sizes;
      }
      break;
    }
    case QuantLayout::kHopper: {
      auto g = FusedHopperGeometryOf(plan, spec);
      if (!g.ok()) return g.status();
      sizes.values_bytes = g->mats * g->v_mat_bytes;
      sizes.scales_bytes = g->mats * g->s_mat_bytes;
      WPREP_RETURN_IF_ERROR(
          ReportedAsSwizzle(plan, spec, true, sizes.values_bytes, &sizes.values_shape, &sizes.values_strides));
      WPREP_RETURN_IF_ERROR(
          ReportedAsSwizzle(plan, spec, false, sizes.scales_bytes, &sizes.scales_shape, &sizes.scales_strides));
      return sizes;
    }
    case QuantLayout::kTrtllmW13:
    case QuantLayout::kTrtllmW2: {
      auto g = FusedTrtllmGeometryOf(plan, spec);
      if (!g.ok()) return g.status();
      sizes = TrtllmSizes(*g);
      break;
    }
    default:
      return absl::InvalidArgumentError("layout: unknown quantize layout");
  }
  sizes.values_strides = DenseStrides(sizes.values_shape);
  sizes.scales_strides = DenseStrides(sizes.scales_shape);
  return sizes;
}

namespace {

// Blackwell pairs on the CPU, a row at a time: the row is quantized into a scratch of the
// padded row (never the whole tensor), copied into its tiles, and its scale bytes placed;
// the rows past N of the last row of tiles, and the scale padding, are zeros.
void QuantizeBlackwellOnCpu(const QuantizePlan& plan, const FusedBlackwellGeometry& g, const uint8_t* in,
                            uint8_t* values, uint8_t* scales) {
  const int esize = QuantDtypeBytes(plan.dtype);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const BlackwellTiling& t = g.vt;
  std::vector<uint8_t> row(static_cast<size_t>(t.kpad), 0);  // bytes past kp stay 0
  std::memset(scales, 0, static_cast<size_t>(g.mats * g.s_mat_bytes));
  const int64_t pad_rows = t.ntn * t.tile_n - g.n;
  for (int64_t m = 0; m < g.mats; ++m) {
    uint8_t* vmat = values + m * g.v_mat_bytes;
    uint8_t* smat = scales + m * g.s_mat_bytes;
    for (int64_t n = 0; n < g.n; ++n) {
      const uint8_t* src = in + (m * g.n + n) * g.k * esize;
      for (int64_t grp = 0; grp < g.sq; ++grp) {
        smat[BlackwellScaleOffset(g.st, grp, n)] = QuantizeGroup(plan.dtype, src + grp * qmath::kGroup * esize,
                                                                 GroupSize(g.k, grp), up, &row[grp * (qmath::kGroup / 2)]);
      }
      for (int64_t kt = 0; kt < t.ntk; ++kt) {
        std::memcpy(vmat + BlackwellOffset(t, nullptr, n, kt * t.tile_k), &row[kt * t.tile_k], t.tile_k);
      }
    }
    for (int64_t kt = 0; kt < t.ntk && pad_rows > 0; ++kt) {  // the last row of tiles, rows N..
      std::memset(vmat + ((kt * t.ntn + t.ntn - 1) * t.tile_n + (t.tile_n - pad_rows)) * t.tile_k, 0,
                  static_cast<size_t>(pad_rows * t.tile_k));
    }
  }
}

// Hopper pair on the CPU, 16 Q rows at a time (one O row block of 4 rows): the rows are
// quantized into a scratch of 16 rows (never the whole tensor), then every O word of those
// rows is gathered from it and interleaved, and every scale byte placed.
absl::Status QuantizeHopperOnCpu(const QuantizePlan& plan, const FusedHopperGeometry& g, const uint8_t* in,
                                 uint8_t* values, uint8_t* scales) {
  const int esize = QuantDtypeBytes(plan.dtype);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const int64_t qcols = g.tile_cols * kFusedHopperTileBytes, scols = qcols / 16;
  std::vector<uint8_t> q(static_cast<size_t>(16 * qcols)), sc(static_cast<size_t>(16 * scols));
  const int64_t rows = g.tile_rows * kFusedHopperTileRows;
  for (int64_t e = 0; e < g.mats; ++e) {
    for (int64_t rb = 0; rb < rows; rb += 16) {
      std::fill(q.begin(), q.end(), uint8_t{0});
      std::fill(sc.begin(), sc.end(), uint8_t{0});
      for (int64_t i = 0; i < 16 && rb + i < g.n; ++i) {
        const uint8_t* row = in + ((e * g.n + rb + i) * g.k) * esize;
        for (int64_t grp = 0; grp < g.sq; ++grp) {
          sc[static_cast<size_t>(i * scols + grp)] =
              QuantizeGroup(plan.dtype, row + grp * qmath::kGroup * esize, GroupSize(g.k, grp), up,
                            &q[static_cast<size_t>(i * qcols + grp * (qmath::kGroup / 2))]);
        }
      }
      if (rb < g.vt.rows_pad) {
        uint8_t* vmat = values + e * g.v_mat_bytes;
        for (int64_t orow = rb / 4; orow < rb / 4 + 4; ++orow) {
          for (int64_t ocol = 0; ocol < g.vt.out_cols; ocol += 4) {
            uint32_t o = 0;
            for (int b = 0; b < 4; ++b) {
              int64_t r = 0, c = 0;
              HopperSource<int64_t>(orow, ocol + b, g.mma_version, &r, &c);
              o |= static_cast<uint32_t>(q[static_cast<size_t>((r - rb) * qcols + c)]) << (8 * b);
            }
            const uint32_t w = HopperInterleaveWord(o);
            std::memcpy(vmat + orow * g.vt.out_cols + ocol, &w, 4);  // little-endian hosts
          }
        }
      }
      uint8_t* smat = scales + e * g.s_mat_bytes;
      for (int64_t i = 0; i < 16 && rb + i < g.st.rows_pad; ++i) {
        for (int64_t col = 0; col < g.st.cols_pad; ++col) {
          smat[HopperScaleOffset(g.st, rb + i, col)] = sc[static_cast<size_t>(i * scols + col)];
        }
      }
    }
  }
  return absl::OkStatus();
}

// The trtllm values and scales on the CPU, an output row at a time: the row's source weight
// row (the prepare's row map) is quantized into a row scratch, written padded, and its scale
// bytes placed in the 128x4 layout.
void QuantizeTrtllmOnCpu(const QuantizePlan& plan, const FusedTrtllmGeometry& g, const uint8_t* in,
                         uint8_t* values, uint8_t* scales, const QuantBias& bias) {
  const int esize = QuantDtypeBytes(plan.dtype);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const moe::RowsPass& vp = g.values;
  const moe::InterleavePass& sp = g.scales;
  const int64_t sq = g.k / qmath::kGroup;
  std::vector<uint8_t> codes(static_cast<size_t>(g.k / 2)), sc(static_cast<size_t>(sq));
  for (int64_t e = 0; e < vp.experts; ++e) {
    for (int64_t n = 0; n < vp.rows_out; ++n) {
      const int64_t src = moe::SrcRow(vp.map, n);
      std::fill(codes.begin(), codes.end(), uint8_t{0});
      std::fill(sc.begin(), sc.end(), uint8_t{0});
      if (src >= 0) {
        const uint8_t* row = in + (e * vp.rows_in + src) * g.k * esize;
        for (int64_t grp = 0; grp < sq; ++grp) {
          sc[static_cast<size_t>(grp)] = QuantizeGroup(plan.dtype, row + grp * qmath::kGroup * esize, qmath::kGroup,
                                                       up, &codes[static_cast<size_t>(grp * (qmath::kGroup / 2))]);
        }
      }
      uint8_t* vrow = values + (e * vp.rows_out + n) * vp.out_row_bytes;
      std::memcpy(vrow, codes.data(), codes.size());
      std::memset(vrow + codes.size(), 0, static_cast<size_t>(vp.out_row_bytes) - codes.size());
      uint8_t* smat = scales + e * sp.rows_p * sp.cols_p;
      for (int64_t c = 0; c < sp.cols_p; ++c) smat[moe::SfOffset(n, c, sp.cols_p)] = c < sq ? sc[static_cast<size_t>(c)] : 0;
    }
  }
  // The bias: the MoE engine's own rows pass of the prepare plan.
  if (bias.in != nullptr) {
    moe::RunRowsOnCpu(g.bias, static_cast<const uint8_t*>(bias.in), static_cast<uint8_t*>(bias.out));
  }
}

}  // namespace

absl::Status QuantizeLayoutOnCpu(const QuantizePlan& plan, const QuantLayoutSpec& spec, const uint8_t* in,
                                 size_t in_size, uint8_t* values, size_t values_size, uint8_t* scales,
                                 size_t scales_size, const QuantBias& bias) {
  const bool trtllm = spec.layout == QuantLayout::kTrtllmW13 || spec.layout == QuantLayout::kTrtllmW2;
  if ((bias.in == nullptr) != (bias.out == nullptr) || (bias.in != nullptr && !trtllm)) {
    return absl::InvalidArgumentError("bias: give both its input and output, for a trtllm layout only");
  }
  switch (spec.layout) {
    case QuantLayout::kCanonical:
      return QuantizeOnCpu(plan, in, in_size, values, values_size, scales, scales_size);
    case QuantLayout::kBlackwell:
    case QuantLayout::kBlackwellShuffled: {
      auto g = FusedBlackwellGeometryOf(plan, spec);
      if (!g.ok()) return g.status();
      WPREP_RETURN_IF_ERROR(CheckBuffers(plan, g->mats * g->v_mat_bytes, g->mats * g->s_mat_bytes, in_size,
                                         values_size, scales_size));
      QuantizeBlackwellOnCpu(plan, *g, in, values, scales);
      return absl::OkStatus();
    }
    case QuantLayout::kTrtllmW13:
    case QuantLayout::kTrtllmW2: {
      auto g = FusedTrtllmGeometryOf(plan, spec, bias.bfloat16);
      if (!g.ok()) return g.status();
      const QuantOutputSizes sizes = TrtllmSizes(*g);
      WPREP_RETURN_IF_ERROR(
          CheckBuffers(plan, sizes.values_bytes, sizes.scales_bytes, in_size, values_size, scales_size));
      QuantizeTrtllmOnCpu(plan, *g, in, values, scales, bias);
      return absl::OkStatus();
    }
    case QuantLayout::kHopper: {
      auto g = FusedHopperGeometryOf(plan, spec);
      if (!g.ok()) return g.status();
      WPREP_RETURN_IF_ERROR(CheckBuffers(plan, g->mats * g->v_mat_bytes, g->mats * g->s_mat_bytes, in_size,
                                         values_size, scales_size));
      return QuantizeHopperOnCpu(plan, *g, in, values, scales);
    }
  }
  return absl::InvalidArgumentError("layout: unknown quantize layout");
}

}  // namespace wprep
