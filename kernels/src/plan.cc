#include "wprep/kernels/plan.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "layout_math.h"
#include "wprep/spec/status_macros.h"

namespace wprep {
namespace {

// Every byte count and offset must stay far from int64 overflow so that kernels can
// index with plain int64 arithmetic.
constexpr int64_t kMaxBytes = int64_t{1} << 60;

// Limits of one matrix (the last two dims), so kernels can index inside it in 32 bits.
constexpr int64_t kMaxMatrixExtent = int64_t{1} << 31;
constexpr int64_t kMaxMatrixBytes = int64_t{1} << 36;

// Largest Blackwell block edge accepted (values); upstream uses 64..256.
constexpr int64_t kMaxBlock = 4096;

// Largest Hopper scale num_warps: a CUDA block holds at most 32 warps.
constexpr int32_t kMaxNumWarps = 32;
constexpr int32_t kMaxAlignK = 64;  // hopper_scale: scale groups a matmul K tile reads, and more

// InputBinding's contiguous dim when the input takes any strides.
constexpr int kAnyStrides = -1;

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError(what); }

// a * b, or an error naming `what` when it exceeds kMaxBytes.
absl::StatusOr<int64_t> Mul(int64_t a, int64_t b, const char* what,
                            absl::Span<const int64_t> shape) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r > kMaxBytes) {
    return Invalid(absl::StrFormat("%s overflows for logical shape %s (limit 2^60 bytes)", what,
                                   ShapeString(shape)));
  }
  return r;
}

absl::Status CheckMxAxis(const char* layout, int32_t mx_axis) {
  if (mx_axis != -1 && mx_axis != -2) {
    return Invalid(absl::StrFormat("%s: mx_axis must be -1 or -2, got %d", layout, mx_axis));
  }
  return absl::OkStatus();
}

absl::Status CheckSpec(const ConversionSpec& spec) {
  const Direction d = spec.direction;
  if (d != Direction::kSwizzle && d != Direction::kUnswizzle && d != Direction::kRetile) {
    return Invalid(absl::StrFormat("unknown direction %d", static_cast<int>(d)));
  }
  switch (spec.layout) {
    case Layout::kHopperValue:
      WPREP_RETURN_IF_ERROR(CheckMxAxis("hopper_value", spec.hopper.mx_axis));
      if (spec.hopper.mma_version != 2 && spec.hopper.mma_version != 3) {
        return Invalid(absl::StrFormat("hopper_value: mma_version must be 2 or 3, got %d",
                                       spec.hopper.mma_version));
      }
      break;
    case Layout::kBlackwellShuffledValue:
      WPREP_RETURN_IF_ERROR(
          CheckBlackwellParams(spec.blackwell, d == Direction::kRetile ? "retile source " : ""));
      if (d == Direction::kRetile) {
        WPREP_RETURN_IF_ERROR(CheckBlackwellParams(spec.blackwell_to, "retile target "));
      }
      break;
    case Layout::kBlackwellValue:
    case Layout::kBlackwellScale:
      break;
    case Layout::kHopperScale: {
      WPREP_RETURN_IF_ERROR(CheckMxAxis("hopper_scale", spec.hopper_scale.mx_axis));
      const int32_t nw = spec.hopper_scale.num_warps;
      if (nw < 1 || nw > kMaxNumWarps || (nw & (nw - 1)) != 0) {
        return Invalid(absl::StrFormat(
            "hopper_scale: num_warps must be a power of two in [1, %d], got %d", kMaxNumWarps, nw));
      }
      const int32_t ak = spec.hopper_scale.align_k;
      if (ak < 2 || ak > kMaxAlignK || (ak & (ak - 1)) != 0) {
        return Invalid(absl::StrFormat(
            "hopper_scale: align_k must be a power of two in [2, %d], got %d", kMaxAlignK, ak));
      }
      break;
    }
    default:
      return Invalid(absl::StrFormat("unknown layout %d", static_cast<int>(spec.layout)));
  }
  if (d == Direction::kRetile && spec.layout != Layout::kBlackwellShuffledValue) {
    return Invalid("retile is defined only for blackwell_shuffled_value");
  }
  if (spec.packing_axis != -1 && spec.packing_axis != -2) {
    return Invalid(
        absl::StrFormat("packing_axis must be -1 or -2, got %d", spec.packing_axis));
  }
  if (spec.packing_axis == -2 && !IsValueLayout(spec.layout)) {
    return Invalid(absl::StrFormat(
        "%s has no packed FP4 axis: packing_axis must be -1, got -2", LayoutName(spec.layout)));
  }
  if (spec.packing_axis == -2 && d == Direction::kRetile) {
    return Invalid(
        "retile has no canonical side to take packing_axis -2 (both sides are storage); "
        "packing_axis must be -1");
  }
  return absl::OkStatus();
}

// Torch's is_contiguous: sizes of 1 are skipped; an empty tensor is contiguous.
bool TorchContiguous(absl::Span<const int64_t> shape, absl::Span<const int64_t> strides) {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) return true;
  }
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// The strides upstream reports for Blackwell storage: a dense [E, ntn, tile_n, ntk, tile_k]
// permuted to [E, ntk, ntn, tile_n, tile_k], then made contiguous (which torch skips when
// it already counts as contiguous).
std::vector<int64_t> BlackwellReportedStrides(const std::vector<int64_t>& shape) {
  const std::vector<int64_t> pre = {shape[0], shape[2], shape[3], shape[1], shape[4]};
  const std::vector<int64_t> ps = DenseStrides(pre);
  std::vector<int64_t> strides = {ps[0], ps[3], ps[1], ps[2], ps[4]};
  if (!TorchContiguous(shape, strides)) strides = DenseStrides(shape);
  return strides;
}

// The output strides of an unswizzle whose reference result is the view `reference`
// (strides of a slice of a padded tensor): those where the view is dense, else the
// row-major ones (Plan::output_strides).
std::vector<int64_t> ClonedStrides(const std::vector<int64_t>& shape,
                                   const std::vector<int64_t>& reference) {
  return NonOverlappingAndDense(shape, reference) ? reference : DenseStrides(shape);
}

// What every MakePlan step below shares.
struct Ctx {
  absl::Span<const int64_t> shape;
  int rank = 0;
  std::vector<int64_t> lead;  // leading dims
  int64_t num_matrices = 1;
  int64_t d0 = 0, d1 = 0;  // the last two logical dims
};

// How the input binds: which dim must keep stride 1 (kAnyStrides: none), and how the
// input view's strides become the engines' geometry.
enum class InputKind {
  kRows,              // rows of bytes: lead dims, then rows (dim -2), bytes (dim -1)
  kTransposedRows,    // reported transposed: lead dims, then bytes (dim -2), rows (dim -1)
  kShuffledStorage,   // [E, ntk, ntn, tile_n, tile_k]
  kScaleTensor,       // the scale tensor [..., rows, cols], any strides
  kBlackwellScaleStorage,  // [1, E*Np/128, Kp/4, 2, 256]
};

struct InputPlan {
  InputKind kind = InputKind::kRows;
  int contiguous_dim = 0;
};

absl::Status CheckPadded(const Ctx& c, int64_t rows, int64_t cols, const char* what,
                         int64_t* matrix) {
  WPREP_ASSIGN_OR_RETURN(*matrix, Mul(rows, cols, what, c.shape));
  WPREP_ASSIGN_OR_RETURN(int64_t total, Mul(c.num_matrices, *matrix, what, c.shape));
  (void)total;
  return absl::OkStatus();
}

std::vector<int64_t> WithLead(const Ctx& c, std::initializer_list<int64_t> inner) {
  std::vector<int64_t> v = c.lead;
  v.insert(v.end(), inner);
  return v;
}

// The canonical side as stored: [..., D0, D1/2] (packing -1) or [..., D1, D0/2].
std::vector<int64_t> CanonicalShape(const Ctx& c, int packing_axis) {
  return packing_axis == -1 ? WithLead(c, {c.d0, c.d1 / 2}) : WithLead(c, {c.d1, c.d0 / 2});
}

absl::StatusOr<InputPlan> PlanHopperValue(const ConversionSpec& spec, const Ctx& c, Plan& plan,
                                          Geometry& g) {
  const int mx = spec.hopper.mx_axis, packing = spec.packing_axis;
  g.mma_version = spec.hopper.mma_version;
  g.hopper = MakeHopperTiling(mx, c.d0, c.d1);
  // From packing -2 the roles swap (LAYOUTS.md, "consequences"): mx_axis -2 finds Q as the
  // input is, mx_axis -1 pairs nibbles of two input rows. The tiles see the stored
  // matrix only, so the same two tiles serve both packings.
  g.hopper_q_is_canonical = mx == packing;
  const std::vector<int64_t> canonical = CanonicalShape(c, packing);
  g.d0 = canonical[c.rank - 2];
  g.d1b = canonical[c.rank - 1];
  int64_t matrix = 0;
  WPREP_RETURN_IF_ERROR(
      CheckPadded(c, g.hopper.rows_pad, g.hopper.cols_pad, "hopper storage size", &matrix));
  // Storage: O = [..., R/4, 4C] in memory; mx_axis -2 reports its transpose.
  const std::vector<int64_t> mem_shape = WithLead(c, {g.hopper.out_rows, g.hopper.out_cols});
  std::vector<int64_t> storage_shape = mem_shape;
  std::vector<int64_t> storage_strides = DenseStrides(mem_shape);
  if (mx == -2) {
    std::swap(storage_shape[c.rank - 2], storage_shape[c.rank - 1]);
    std::swap(storage_strides[c.rank - 2], storage_strides[c.rank - 1]);
  }
  if (spec.direction == Direction::kSwizzle) {
    g.op = Op::kHopperSwizzle;
    plan.input_shape = canonical;
    plan.input_strides = DenseStrides(canonical);
    plan.output_shape = storage_shape;
    plan.output_strides = storage_strides;
    g.out_matrix_bytes = matrix;
    return InputPlan{InputKind::kRows, c.rank - 1};
  }
  g.op = Op::kHopperUnswizzle;
  plan.input_shape = storage_shape;
  plan.input_strides = storage_strides;
  plan.output_shape = canonical;
  plan.output_strides = DenseStrides(canonical);
  g.out_matrix_bytes = g.d0 * g.d1b;
  return mx == -1 ? InputPlan{InputKind::kRows, c.rank - 1}
                  : InputPlan{InputKind::kTransposedRows, c.rank - 2};
}

// Blackwell shuffled and Blackwell value: both are K-packed arrangements (tilings), and
// checkpoint order is one more (MakeRowTiling); canonical storage is the one order that
// pairs nibbles along N.
absl::StatusOr<InputPlan> PlanBlackwellValue(const ConversionSpec& spec, const Ctx& c,
                                             Plan& plan, Geometry& g) {
  const bool shuffled = spec.layout == Layout::kBlackwellShuffledValue;
  const int packing = spec.packing_axis;
  g.kp = c.d0 / 2;
  g.n = c.d1;
  const std::vector<int64_t> canonical = CanonicalShape(c, packing);
  g.d0 = canonical[c.rank - 2];
  g.d1b = canonical[c.rank - 1];

  auto storage_tiling = [&](const BlackwellParams& p) {
    return shuffled ? MakeBlackwellTiling(p.block_k, p.block_n, g.kp, g.n)
                    : MakeRowTiling(RoundUp(g.kp, kBlackwellValueKAlign), g.n);
  };
  auto storage_bytes = [&](const BlackwellTiling& t) -> absl::StatusOr<int64_t> {
    int64_t m = 0;
    WPREP_RETURN_IF_ERROR(
        CheckPadded(c, t.kpad, t.ntn * t.tile_n, "blackwell storage size", &m));
    return m;
  };
  // Shape and strides as upstream reports them.
  auto storage_view = [&](const BlackwellTiling& t, std::vector<int64_t>* shape,
                          std::vector<int64_t>* strides) {
    if (shuffled) {
      *shape = {c.num_matrices, t.ntk, t.ntn, t.tile_n, t.tile_k};
      *strides = BlackwellReportedStrides(*shape);
      return;
    }
    // Memory [..., N, Kpad]; reported as [..., Kpad, N] with strides [..., 1, Kpad].
    std::vector<int64_t> mem = WithLead(c, {c.d1, t.kpad});
    *strides = DenseStrides(mem);
    std::swap((*strides)[c.rank - 2], (*strides)[c.rank - 1]);
    *shape = WithLead(c, {t.kpad, c.d1});
  };
  const BlackwellTiling checkpoint = MakeRowTiling(g.kp, g.n);
  const BlackwellTiling first = storage_tiling(spec.blackwell);
  WPREP_ASSIGN_OR_RETURN(const int64_t first_bytes, storage_bytes(first));
  const InputPlan storage_input = shuffled ? InputPlan{InputKind::kShuffledStorage, 4}
                                           : InputPlan{InputKind::kTransposedRows, c.rank - 2};
  switch (spec.direction) {
    case Direction::kSwizzle:
      g.op = packing == -1 ? Op::kBlackwellSwizzle : Op::kBlackwellRetile;
      g.in_tiling = packing == -1 ? BlackwellTiling{} : checkpoint;
      g.out_tiling = first;
      g.out_matrix_bytes = first_bytes;
      plan.input_shape = canonical;
      plan.input_strides = DenseStrides(canonical);
      storage_view(first, &plan.output_shape, &plan.output_strides);
      return InputPlan{InputKind::kRows, c.rank - 1};
    case Direction::kUnswizzle:
      g.op = packing == -1 ? Op::kBlackwellUnswizzle : Op::kBlackwellRetile;
      g.in_tiling = first;
      g.out_tiling = packing == -1 ? BlackwellTiling{} : checkpoint;
      g.out_matrix_bytes = g.d0 * g.d1b;
      storage_view(first, &plan.input_shape, &plan.input_strides);
      plan.output_shape = canonical;
      plan.output_strides = DenseStrides(canonical);
      return storage_input;
    case Direction::kRetile: {
      g.op = Op::kBlackwellRetile;
      g.in_tiling = first;
      g.out_tiling = storage_tiling(spec.blackwell_to);
      WPREP_ASSIGN_OR_RETURN(g.out_matrix_bytes, storage_bytes(g.out_tiling));
      storage_view(first, &plan.input_shape, &plan.input_strides);
      storage_view(g.out_tiling, &plan.output_shape, &plan.output_strides);
      return storage_input;
    }
  }
  return Invalid("unknown direction");
}

// The plain side of a scale conversion: how its [row, column] strides can be accessed.
ScaleAccess ScaleAccessOf(int64_t row_stride, int64_t col_stride) {
  if (col_stride == 1) return ScaleAccess::kRows;
  if (row_stride == 1) return ScaleAccess::kColumns;
  return ScaleAccess::kBytes;
}

// The non-unit stride a tile's runs start at multiples of (see Geometry::in_align).
int64_t ScaleRunAlign(ScaleAccess a, const int64_t* strides) {
  switch (a) {
    case ScaleAccess::kRows:
      return strides[0];
    case ScaleAccess::kColumns:
      return strides[1];
    case ScaleAccess::kBytes:
      break;
  }
  return 1;
}

absl::StatusOr<InputPlan> PlanHopperScale(const ConversionSpec& spec, const Ctx& c, Plan& plan,
                                          Geometry& g) {
  const int mx = spec.hopper_scale.mx_axis;
  const HopperScaleTiling t = MakeHopperScaleTiling(mx, spec.hopper_scale.num_warps,
                                                    spec.hopper_scale.align_k, c.d0, c.d1);
  g.hopper_scale = t;
  int64_t matrix = 0;
  WPREP_RETURN_IF_ERROR(CheckPadded(c, t.rows_pad, t.cols_pad, "hopper_scale storage size", &matrix));
  const std::vector<int64_t> mem_shape = WithLead(c, {t.out_rows, t.out_cols});
  std::vector<int64_t> storage_shape = mem_shape;
  std::vector<int64_t> storage_strides = DenseStrides(mem_shape);
  if (mx == -2) {
    std::swap(storage_shape[c.rank - 2], storage_shape[c.rank - 1]);
    std::swap(storage_strides[c.rank - 2], storage_strides[c.rank - 1]);
  }
  const std::vector<int64_t> tensor = WithLead(c, {c.d0, c.d1});
  if (spec.direction == Direction::kSwizzle) {
    g.op = Op::kHopperScaleSwizzle;
    plan.input_shape = tensor;
    plan.input_strides = DenseStrides(tensor);
    plan.output_shape = storage_shape;
    plan.output_strides = storage_strides;
    g.out_matrix_bytes = matrix;
    return InputPlan{InputKind::kScaleTensor, kAnyStrides};
  }
  g.op = Op::kHopperScaleUnswizzle;
  plan.input_shape = storage_shape;
  plan.input_strides = storage_strides;
  plan.output_shape = tensor;
  // Upstream's result: the padded S [..., R, C] sliced to [..., rows, cols], transposed
  // back for mx_axis -2.
  std::vector<int64_t> reference = DenseStrides(WithLead(c, {t.rows_pad, t.cols_pad}));
  if (mx == -2) std::swap(reference[c.rank - 2], reference[c.rank - 1]);
  plan.output_strides = ClonedStrides(tensor, reference);
  // S [r, col] in the output: x row-major, except that mx_axis -2 keeps upstream's
  // transposed view where that view is dense (S row-major: rows K of M bytes).
  if (mx == -1) {
    g.scale_stride[0] = c.d1;
    g.scale_stride[1] = 1;
  } else if (NonOverlappingAndDense(tensor, reference)) {
    g.scale_stride[0] = c.d0;
    g.scale_stride[1] = 1;
  } else {
    g.scale_stride[0] = 1;
    g.scale_stride[1] = c.d1;
  }
  g.scale_access = ScaleAccessOf(g.scale_stride[0], g.scale_stride[1]);
  g.out_matrix_bytes = c.d0 * c.d1;
  return mx == -1 ? InputPlan{InputKind::kRows, c.rank - 1}
                  : InputPlan{InputKind::kTransposedRows, c.rank - 2};
}

absl::StatusOr<InputPlan> PlanBlackwellScale(const ConversionSpec& spec, const Ctx& c,
                                             Plan& plan, Geometry& g) {
  const BlackwellScaleTiling t = MakeBlackwellScaleTiling(c.d0, c.d1);
  g.blackwell_scale = t;
  int64_t matrix = 0;
  WPREP_RETURN_IF_ERROR(CheckPadded(c, t.kpad, t.npad, "blackwell_scale storage size", &matrix));
  WPREP_ASSIGN_OR_RETURN(const int64_t n_blocks,
                         Mul(c.num_matrices, t.npad / 128, "blackwell_scale storage size", c.shape));
  const std::vector<int64_t> storage = {1, n_blocks, t.kpad / 4, 2, 256};
  const std::vector<int64_t> tensor = WithLead(c, {c.d0, c.d1});
  if (spec.direction == Direction::kSwizzle) {
    g.op = Op::kBlackwellScaleSwizzle;
    plan.input_shape = tensor;
    plan.input_strides = DenseStrides(tensor);
    plan.output_shape = storage;
    plan.output_strides = DenseStrides(storage);
    g.out_matrix_bytes = matrix;
    return InputPlan{InputKind::kScaleTensor, kAnyStrides};
  }
  g.op = Op::kBlackwellScaleUnswizzle;
  plan.input_shape = storage;
  plan.input_strides = DenseStrides(storage);
  plan.output_shape = tensor;
  // Upstream's result: the padded [..., Kp, Np] sliced to [..., K, N].
  plan.output_strides = ClonedStrides(tensor, DenseStrides(WithLead(c, {t.kpad, t.npad})));
  g.scale_stride[0] = c.d1;
  g.scale_stride[1] = 1;
  g.scale_access = ScaleAccess::kRows;
  g.out_matrix_bytes = c.d0 * c.d1;
  return InputPlan{InputKind::kBlackwellScaleStorage, 4};
}

// Validates the binding against the input storage shape and fills the plan's input view.
absl::Status BindInput(const InputBinding& binding, int contiguous_dim, Plan& plan) {
  const std::vector<int64_t>& shape = plan.input_shape;
  const int rank = static_cast<int>(shape.size());
  int64_t dense_bytes = 1;
  for (int64_t d : shape) dense_bytes *= d;  // already checked for overflow by the caller

  if (binding.strides.empty()) {
    plan.input_dense = true;
    plan.input_bytes = static_cast<uint64_t>(dense_bytes);
    if (binding.buffer_bytes.has_value() && *binding.buffer_bytes != plan.input_bytes) {
      return Invalid(absl::StrFormat(
          "input holds %d bytes but input shape %s needs exactly %d bytes", *binding.buffer_bytes,
          ShapeString(shape), dense_bytes));
    }
    return absl::OkStatus();
  }

  if (static_cast<int>(binding.strides.size()) != rank) {
    return Invalid(absl::StrFormat("input strides %s have %d entries; input shape %s has %d dims",
                                   ShapeString(binding.strides), binding.strides.size(),
                                   ShapeString(shape), rank));
  }
  for (int i = 0; i < rank; ++i) {
    if (binding.strides[i] < 0) {
      return Invalid(absl::StrFormat("input stride of dim %d must be >= 0, got %d", i,
                                     binding.strides[i]));
    }
  }
  if (contiguous_dim != kAnyStrides && binding.strides[contiguous_dim] != 1) {
    return Invalid(absl::StrFormat(
        "input dim %d must be contiguous (byte stride 1), got stride %d; copy the tensor "
        "to a dense layout first",
        contiguous_dim, binding.strides[contiguous_dim]));
  }
  // Bytes spanned: one past the largest offset the view reaches.
  int64_t span = 1;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 0) {
      span = 0;
      break;
    }
    int64_t reach = 0;
    if (__builtin_mul_overflow(shape[i] - 1, binding.strides[i], &reach) ||
        __builtin_add_overflow(span, reach, &span) || span > kMaxBytes) {
      return Invalid(absl::StrFormat("input strides %s overflow for input shape %s",
                                     ShapeString(binding.strides), ShapeString(shape)));
    }
  }
  plan.input_dense = false;
  plan.input_strides = binding.strides;
  plan.input_bytes = static_cast<uint64_t>(span);
  if (binding.buffer_bytes.has_value() && *binding.buffer_bytes < plan.input_bytes) {
    return Invalid(absl::StrFormat(
        "input strides %s reach byte %d, outside the %d-byte input buffer (shape %s)",
        ShapeString(binding.strides), span - 1, *binding.buffer_bytes, ShapeString(shape)));
  }
  return absl::OkStatus();
}

// The input view's strides as the engines consume them (Geometry's lead dims and
// in_stride / scale_stride), and the alignments that follow.
absl::Status FillInputGeometry(const Ctx& c, InputKind kind, const Plan& plan, Geometry& g) {
  const std::vector<int64_t>& st = plan.input_strides;
  const int r = c.rank;
  auto logical_lead = [&] {
    g.lead_rank = r - 2;
    for (int i = 0; i < r - 2; ++i) {
      g.lead_shape[i] = c.lead[i];
      g.in_lead_stride[i] = st[i];
      if (i > 0 && c.lead[i] > 0) g.lead_div[i] = FastDivisor(static_cast<uint32_t>(c.lead[i]));
    }
  };
  switch (kind) {
    case InputKind::kRows:
      logical_lead();
      g.in_stride[0] = st[r - 2];
      break;
    case InputKind::kTransposedRows:
      logical_lead();
      g.in_stride[0] = st[r - 1];
      break;
    case InputKind::kShuffledStorage:
      g.lead_rank = 1;
      g.lead_shape[0] = c.num_matrices;
      g.in_lead_stride[0] = st[0];
      g.in_stride[0] = st[1];
      g.in_stride[1] = st[2];
      g.in_stride[2] = st[3];
      break;
    case InputKind::kScaleTensor: {
      logical_lead();
      // Hopper: S rows walk the non-mx axis (x's columns for mx_axis -2).
      const bool transposed = g.op == Op::kHopperScaleSwizzle && plan.spec.hopper_scale.mx_axis == -2;
      g.scale_stride[0] = transposed ? st[r - 1] : st[r - 2];
      g.scale_stride[1] = transposed ? st[r - 2] : st[r - 1];
      g.scale_access = ScaleAccessOf(g.scale_stride[0], g.scale_stride[1]);
      break;
    }
    case InputKind::kBlackwellScaleStorage: {
      g.lead_rank = 1;
      g.lead_shape[0] = c.num_matrices;
      WPREP_ASSIGN_OR_RETURN(g.in_lead_stride[0],
                             Mul(g.blackwell_scale.npad / 128, st[1], "input stride", c.shape));
      g.in_stride[0] = st[1];
      g.in_stride[1] = st[2];
      g.in_stride[2] = st[3];
      break;
    }
  }
  // A single-tile Blackwell arrangement (blackwell_value storage, checkpoint order) read
  // by a Blackwell tile: its rows are BlackwellOffset's n' stride.
  const bool bw_rows_in = (g.op == Op::kBlackwellUnswizzle || g.op == Op::kBlackwellRetile) &&
                          kind != InputKind::kShuffledStorage;
  if (bw_rows_in) {
    g.in_stride[2] = g.in_stride[0];
    g.in_stride[0] = 0;
  }
  switch (g.op) {
    case Op::kHopperSwizzle:
    case Op::kBlackwellSwizzle:
    case Op::kHopperUnswizzle:
    case Op::kHopperScaleUnswizzle:
      g.in_align = g.in_stride[0];
      break;
    case Op::kBlackwellUnswizzle:
    case Op::kBlackwellRetile:
      g.in_align = Gcd(Gcd(g.in_stride[0], g.in_stride[1]), g.in_stride[2]);
      // Runs start at multiples of tile_k inside a shuffled matrix; a single-tile
      // arrangement's rows start at multiples of its row stride only.
      if (kind == InputKind::kShuffledStorage) g.in_align = Gcd(g.in_align, g.in_tiling.tile_k);
      break;
    case Op::kHopperScaleSwizzle:
    case Op::kBlackwellScaleSwizzle:
      g.in_align = ScaleRunAlign(g.scale_access, g.scale_stride);
      break;
    case Op::kBlackwellScaleUnswizzle:
      g.in_align = Gcd(Gcd(g.in_stride[0], g.in_stride[1]), g.in_stride[2]);
      break;
  }
  g.out_align = g.out_matrix_bytes;
  switch (g.op) {
    case Op::kHopperUnswizzle:
    case Op::kBlackwellUnswizzle:
      g.out_align = Gcd(g.out_align, g.d1b);
      break;
    case Op::kBlackwellSwizzle:
    case Op::kBlackwellRetile:
      g.out_align = Gcd(g.out_align, g.out_tiling.tile_k);
      break;
    case Op::kHopperScaleSwizzle:
      g.out_align = Gcd(g.out_align, g.hopper_scale.out_cols);
      break;
    case Op::kHopperScaleUnswizzle:
    case Op::kBlackwellScaleUnswizzle:
      g.out_align = Gcd(g.out_align, ScaleRunAlign(g.scale_access, g.scale_stride));
      break;
    case Op::kHopperSwizzle:
    case Op::kBlackwellScaleSwizzle:
      break;
  }
  return absl::OkStatus();
}

// Odd sizes are rejected along every axis that is packed on either side, even when
// another dim is 0 (LAYOUTS.md, "Validation").
absl::Status CheckPackedDims(const ConversionSpec& spec, const Ctx& c) {
  if (!IsValueLayout(spec.layout)) return absl::OkStatus();
  const bool storage_packs_d1 = spec.layout == Layout::kHopperValue && spec.hopper.mx_axis == -1;
  const bool packs_d1 = spec.packing_axis == -1 || storage_packs_d1;
  const bool packs_d0 = spec.packing_axis == -2 || !storage_packs_d1;
  if (packs_d1 && c.d1 % 2 != 0) {
    return Invalid(absl::StrFormat(
        "FP4 packing dimension -1 must have an even size, got %d (logical shape %s)", c.d1,
        ShapeString(c.shape)));
  }
  if (packs_d0 && c.d0 % 2 != 0) {
    return Invalid(absl::StrFormat(
        "FP4 packing dimension -2 must have an even size for %s, got %d (logical shape %s)",
        Describe(spec), c.d0, ShapeString(c.shape)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckBlackwellParams(const BlackwellParams& p, const char* which) {
  if (p.block_k < 2 || p.block_k > kMaxBlock || p.block_k % 2 != 0) {
    return Invalid(absl::StrFormat("%sblock_k must be an even number in [2, %d], got %d", which,
                                   kMaxBlock, p.block_k));
  }
  if (p.block_n < 1 || p.block_n > kMaxBlock) {
    return Invalid(absl::StrFormat("%sblock_n must be in [1, %d], got %d", which, kMaxBlock,
                                   p.block_n));
  }
  return absl::OkStatus();
}

std::vector<int64_t> DenseStrides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
  return strides;
}

bool NonOverlappingAndDense(absl::Span<const int64_t> shape, absl::Span<const int64_t> strides) {
  const size_t n = shape.size();
  if (n == 1) return shape[0] < 2 || strides[0] == 1;
  std::vector<size_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  // By stride, dims of size 0 and 1 last (c10's compute_non_overlapping_and_dense).
  std::sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
    if (shape[a] < 2) return false;
    if (shape[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t required = 1;
  for (size_t i : perm) {
    if (shape[i] < 2) return true;
    if (strides[i] != required) return false;
    required *= shape[i];
  }
  return true;
}

absl::StatusOr<Plan> MakePlan(const ConversionSpec& spec, absl::Span<const int64_t> shape,
                              const InputBinding& binding) {
  WPREP_RETURN_IF_ERROR(CheckSpec(spec));

  Ctx c;
  c.shape = shape;
  c.rank = static_cast<int>(shape.size());
  if (c.rank < 2 || c.rank > kMaxRank) {
    return Invalid(absl::StrFormat("logical shape %s must have between 2 and %d dims, got %d",
                                   ShapeString(shape), kMaxRank, c.rank));
  }
  for (int i = 0; i < c.rank; ++i) {
    if (shape[i] < 0) {
      return Invalid(absl::StrFormat("logical shape %s: dim %d must be >= 0, got %d",
                                     ShapeString(shape), i, shape[i]));
    }
  }
  c.d0 = shape[c.rank - 2];
  c.d1 = shape[c.rank - 1];
  // Bounded before any geometry is built: tilings divide by these extents in 32 bits, so a
  // dim of 2^32 would read as a zero divisor.
  for (int64_t extent : {c.d0, c.d1}) {
    if (extent >= kMaxMatrixExtent) {
      return Invalid(absl::StrFormat(
          "logical shape %s: the last two dims must stay below 2^31, got %d", ShapeString(shape),
          extent));
    }
  }
  WPREP_RETURN_IF_ERROR(CheckPackedDims(spec, c));
  c.lead.assign(shape.begin(), shape.end() - 2);
  for (int64_t d : c.lead) {
    WPREP_ASSIGN_OR_RETURN(c.num_matrices, Mul(c.num_matrices, d, "product of leading dims", shape));
  }
  // The logical tensor's size (its canonical storage for values): every layout's plain
  // side is at most this big.
  WPREP_ASSIGN_OR_RETURN(const int64_t plain_matrix,
                         Mul(c.d0, IsValueLayout(spec.layout) ? c.d1 / 2 : c.d1,
                             "canonical matrix size", shape));
  WPREP_ASSIGN_OR_RETURN(const int64_t plain_bytes,
                         Mul(c.num_matrices, plain_matrix, "canonical tensor size", shape));
  (void)plain_bytes;

  Plan plan;
  plan.spec = spec;
  plan.logical_shape.assign(shape.begin(), shape.end());
  // Filled here, frozen into the plan once every check has passed.
  auto geometry = std::make_shared<Geometry>();
  Geometry& g = *geometry;
  g.num_matrices = c.num_matrices;

  InputPlan input;
  switch (spec.layout) {
    case Layout::kHopperValue: {
      WPREP_ASSIGN_OR_RETURN(input, PlanHopperValue(spec, c, plan, g));
      break;
    }
    case Layout::kBlackwellShuffledValue:
    case Layout::kBlackwellValue: {
      WPREP_ASSIGN_OR_RETURN(input, PlanBlackwellValue(spec, c, plan, g));
      break;
    }
    case Layout::kHopperScale: {
      WPREP_ASSIGN_OR_RETURN(input, PlanHopperScale(spec, c, plan, g));
      break;
    }
    case Layout::kBlackwellScale: {
      WPREP_ASSIGN_OR_RETURN(input, PlanBlackwellScale(spec, c, plan, g));
      break;
    }
  }
  // Checked: an empty matrix leaves num_matrices bounded only by 2^60, and a layout may
  // pad even an empty matrix.
  WPREP_ASSIGN_OR_RETURN(const int64_t output_bytes,
                         Mul(c.num_matrices, g.out_matrix_bytes, "output size", shape));
  plan.output_bytes = static_cast<uint64_t>(output_bytes);

  // The engines index inside one matrix with 32-bit arithmetic.
  for (int64_t extent :
       {c.d0, c.d1, g.hopper.rows_pad, g.hopper.out_cols, g.in_tiling.kpad, g.out_tiling.kpad,
        g.in_tiling.ntn * g.in_tiling.tile_n, g.out_tiling.ntn * g.out_tiling.tile_n,
        g.hopper_scale.rows_pad, g.hopper_scale.out_cols, g.blackwell_scale.kpad,
        g.blackwell_scale.npad}) {
    if (extent >= kMaxMatrixExtent) {
      return Invalid(absl::StrFormat(
          "logical shape %s: the last two dims must stay below 2^31 after padding, got %d",
          ShapeString(shape), extent));
    }
  }
  if (c.num_matrices >= kMaxMatrixExtent) {
    return Invalid(absl::StrFormat("logical shape %s: at most 2^31 - 1 matrices (product of the "
                                   "leading dims), got %d",
                                   ShapeString(shape), c.num_matrices));
  }
  if (std::max(plain_matrix, g.out_matrix_bytes) >= kMaxMatrixBytes) {
    return Invalid(absl::StrFormat("logical shape %s: one matrix (the last two dims) must hold "
                                   "less than 64 GiB",
                                   ShapeString(shape)));
  }

  WPREP_RETURN_IF_ERROR(BindInput(binding, input.contiguous_dim, plan));
  WPREP_RETURN_IF_ERROR(FillInputGeometry(c, input.kind, plan, g));
  plan.geometry = std::move(geometry);
  return plan;
}

}  // namespace wprep
