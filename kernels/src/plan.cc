#include "wprep/kernels/plan.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

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

#define WPREP_CONCAT_INNER(a, b) a##b
#define WPREP_CONCAT(a, b) WPREP_CONCAT_INNER(a, b)
#define WPREP_ASSIGN_OR_RETURN(lhs, expr) \
  WPREP_ASSIGN_OR_RETURN_IMPL(WPREP_CONCAT(status_or_, __LINE__), lhs, expr)
#define WPREP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = *std::move(tmp)

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

absl::Status CheckSpec(const ConversionSpec& spec) {
  switch (spec.layout) {
    case Layout::kHopperValue:
      if (spec.hopper.mx_axis != -1 && spec.hopper.mx_axis != -2) {
        return Invalid(absl::StrFormat("hopper_value: mx_axis must be -1 or -2, got %d",
                                       spec.hopper.mx_axis));
      }
      if (spec.hopper.mma_version != 2 && spec.hopper.mma_version != 3) {
        return Invalid(absl::StrFormat("hopper_value: mma_version must be 2 or 3, got %d",
                                       spec.hopper.mma_version));
      }
      if (spec.direction == Direction::kRetile) {
        return Invalid("retile is defined only for blackwell_shuffled_value");
      }
      if (spec.direction != Direction::kSwizzle && spec.direction != Direction::kUnswizzle) {
        return Invalid(absl::StrFormat("unknown direction %d",
                                       static_cast<int>(spec.direction)));
      }
      return absl::OkStatus();
    case Layout::kBlackwellShuffledValue: {
      const bool retile = spec.direction == Direction::kRetile;
      if (!retile && spec.direction != Direction::kSwizzle &&
          spec.direction != Direction::kUnswizzle) {
        return Invalid(absl::StrFormat("unknown direction %d",
                                       static_cast<int>(spec.direction)));
      }
      if (auto s = CheckBlackwellParams(spec.blackwell, retile ? "retile source " : "");
          !s.ok()) {
        return s;
      }
      if (retile) return CheckBlackwellParams(spec.blackwell_to, "retile target ");
      return absl::OkStatus();
    }
  }
  return Invalid(absl::StrFormat("unknown layout %d", static_cast<int>(spec.layout)));
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

// Validates the binding against the input storage shape and fills the plan's input view.
// `contiguous_dim` is the dim whose default stride is 1.
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
  if (binding.strides[contiguous_dim] != 1) {
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

}  // namespace

std::vector<int64_t> DenseStrides(absl::Span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
  return strides;
}

absl::StatusOr<Plan> MakePlan(const ConversionSpec& spec, absl::Span<const int64_t> shape,
                              const InputBinding& binding) {
  if (auto s = CheckSpec(spec); !s.ok()) return s;

  const int rank = static_cast<int>(shape.size());
  if (rank < 2 || rank > kMaxRank) {
    return Invalid(absl::StrFormat("logical shape %s must have between 2 and %d dims, got %d",
                                   ShapeString(shape), kMaxRank, rank));
  }
  for (int i = 0; i < rank; ++i) {
    if (shape[i] < 0) {
      return Invalid(absl::StrFormat("logical shape %s: dim %d must be >= 0, got %d",
                                     ShapeString(shape), i, shape[i]));
    }
  }
  const int64_t d0 = shape[rank - 2], d1 = shape[rank - 1];
  // Canonical storage packs along the last dim in every layout; odd sizes are rejected
  // even when another dim is 0.
  if (d1 % 2 != 0) {
    return Invalid(absl::StrFormat(
        "FP4 packing dimension -1 must have an even size, got %d (logical shape %s)", d1,
        ShapeString(shape)));
  }
  const bool packs_d0 = spec.layout == Layout::kBlackwellShuffledValue ||
                        spec.hopper.mx_axis == -2;
  if (packs_d0 && d0 % 2 != 0) {
    return Invalid(absl::StrFormat(
        "FP4 packing dimension -2 must have an even size for %s, got %d (logical shape %s)",
        Describe(spec), d0, ShapeString(shape)));
  }

  Plan plan;
  plan.spec = spec;
  plan.logical_shape.assign(shape.begin(), shape.end());
  Geometry& g = plan.geometry;
  const std::vector<int64_t> lead(shape.begin(), shape.end() - 2);
  int64_t num_matrices = 1;
  for (int64_t d : lead) {
    WPREP_ASSIGN_OR_RETURN(num_matrices, Mul(num_matrices, d, "product of leading dims", shape));
  }
  g.num_matrices = num_matrices;
  g.d0 = d0;
  g.d1b = d1 / 2;
  int64_t canonical_matrix = 0;
  WPREP_ASSIGN_OR_RETURN(canonical_matrix, Mul(d0, g.d1b, "canonical matrix size", shape));
  int64_t canonical_bytes = 0;
  WPREP_ASSIGN_OR_RETURN(canonical_bytes,
                         Mul(num_matrices, canonical_matrix, "canonical tensor size", shape));
  (void)canonical_bytes;

  std::vector<int64_t> canonical_shape = lead;
  canonical_shape.push_back(d0);
  canonical_shape.push_back(g.d1b);

  int contiguous_dim = 0;  // of the input storage shape
  bool blackwell_storage_input = false;

  if (spec.layout == Layout::kHopperValue) {
    const int mx = spec.hopper.mx_axis;
    g.mx_axis = mx;
    g.mma_version = spec.hopper.mma_version;
    g.hopper = MakeHopperTiling(mx, d0, d1);
    int64_t matrix = 0;
    WPREP_ASSIGN_OR_RETURN(matrix, Mul(g.hopper.rows_pad, g.hopper.cols_pad, "hopper storage size", shape));
    int64_t total = 0;
    WPREP_ASSIGN_OR_RETURN(total, Mul(num_matrices, matrix, "hopper storage size", shape));
    (void)total;
    // Storage: O = [..., R/4, 4C] in memory; mx_axis -2 reports its transpose.
    std::vector<int64_t> mem_shape = lead;
    mem_shape.push_back(g.hopper.out_rows);
    mem_shape.push_back(g.hopper.out_cols);
    std::vector<int64_t> storage_shape = mem_shape;
    std::vector<int64_t> storage_strides = DenseStrides(mem_shape);
    if (mx == -2) {
      std::swap(storage_shape[rank - 2], storage_shape[rank - 1]);
      std::swap(storage_strides[rank - 2], storage_strides[rank - 1]);
    }
    if (spec.direction == Direction::kSwizzle) {
      g.op = Op::kHopperSwizzle;
      plan.input_shape = canonical_shape;
      plan.input_strides = DenseStrides(canonical_shape);
      contiguous_dim = rank - 1;
      plan.output_shape = storage_shape;
      plan.output_strides = storage_strides;
      g.out_matrix_bytes = matrix;
    } else {
      g.op = Op::kHopperUnswizzle;
      plan.input_shape = storage_shape;
      plan.input_strides = storage_strides;
      contiguous_dim = mx == -1 ? rank - 1 : rank - 2;
      plan.output_shape = canonical_shape;
      plan.output_strides = DenseStrides(canonical_shape);
      g.out_matrix_bytes = canonical_matrix;
    }
  } else {
    g.kp = d0 / 2;
    g.n = d1;
    auto storage_shape = [&](const BlackwellTiling& t) {
      return std::vector<int64_t>{num_matrices, t.ntk, t.ntn, t.tile_n, t.tile_k};
    };
    auto check_size = [&](const BlackwellTiling& t) -> absl::StatusOr<int64_t> {
      int64_t m = 0;
      WPREP_ASSIGN_OR_RETURN(m, Mul(t.ntk * t.tile_k, t.ntn * t.tile_n, "blackwell storage size",
                                    shape));
      int64_t total = 0;
      WPREP_ASSIGN_OR_RETURN(total, Mul(num_matrices, m, "blackwell storage size", shape));
      (void)total;
      return m;
    };
    const BlackwellTiling first =
        MakeBlackwellTiling(spec.blackwell.block_k, spec.blackwell.block_n, g.kp, g.n);
    int64_t first_bytes = 0;
    WPREP_ASSIGN_OR_RETURN(first_bytes, check_size(first));
    if (spec.direction == Direction::kSwizzle) {
      g.op = Op::kBlackwellSwizzle;
      g.out_tiling = first;
      plan.input_shape = canonical_shape;
      plan.input_strides = DenseStrides(canonical_shape);
      contiguous_dim = rank - 1;
      g.out_matrix_bytes = first_bytes;
    } else {
      g.in_tiling = first;
      blackwell_storage_input = true;
      plan.input_shape = storage_shape(first);
      plan.input_strides = DenseStrides(plan.input_shape);
      contiguous_dim = 4;
      if (spec.direction == Direction::kUnswizzle) {
        g.op = Op::kBlackwellUnswizzle;
        g.out_matrix_bytes = canonical_matrix;
      } else {
        g.op = Op::kBlackwellRetile;
        g.out_tiling = MakeBlackwellTiling(spec.blackwell_to.block_k, spec.blackwell_to.block_n,
                                           g.kp, g.n);
        WPREP_ASSIGN_OR_RETURN(g.out_matrix_bytes, check_size(g.out_tiling));
      }
    }
    if (g.op == Op::kBlackwellUnswizzle) {
      plan.output_shape = canonical_shape;
      plan.output_strides = DenseStrides(canonical_shape);
    } else {
      plan.output_shape = storage_shape(g.out_tiling);
      plan.output_strides = BlackwellReportedStrides(plan.output_shape);
    }
  }
  plan.output_bytes = static_cast<uint64_t>(num_matrices * g.out_matrix_bytes);

  // The engines index inside one matrix with 32-bit arithmetic.
  for (int64_t extent :
       {g.d0, d1, g.hopper.rows_pad, g.hopper.out_cols, g.in_tiling.kpad, g.out_tiling.kpad,
        g.in_tiling.ntn * g.in_tiling.tile_n, g.out_tiling.ntn * g.out_tiling.tile_n}) {
    if (extent >= kMaxMatrixExtent) {
      return Invalid(absl::StrFormat(
          "logical shape %s: the last two dims must stay below 2^31 after padding, got %d",
          ShapeString(shape), extent));
    }
  }
  if (num_matrices >= kMaxMatrixExtent) {
    return Invalid(absl::StrFormat("logical shape %s: at most 2^31 - 1 matrices (product of the "
                                   "leading dims), got %d",
                                   ShapeString(shape), num_matrices));
  }
  if (std::max(canonical_matrix, g.out_matrix_bytes) >= kMaxMatrixBytes) {
    return Invalid(absl::StrFormat("logical shape %s: one matrix (the last two dims) must hold "
                                   "less than 64 GiB",
                                   ShapeString(shape)));
  }

  if (auto s = BindInput(binding, contiguous_dim, plan); !s.ok()) return s;

  // Geometry of the input view: leading dims and the inner strides the engines use.
  const std::vector<int64_t>& st = plan.input_strides;
  if (blackwell_storage_input) {
    g.lead_rank = 1;
    g.lead_shape[0] = num_matrices;
    g.in_lead_stride[0] = st[0];
    g.in_stride[0] = st[1];
    g.in_stride[1] = st[2];
    g.in_stride[2] = st[3];
  } else {
    g.lead_rank = rank - 2;
    for (int i = 0; i < rank - 2; ++i) {
      g.lead_shape[i] = lead[i];
      g.in_lead_stride[i] = st[i];
      if (i > 0 && lead[i] > 0) g.lead_div[i] = FastDivisor(static_cast<uint32_t>(lead[i]));
    }
    // Row stride: canonical and Hopper mx_axis -1 storage rows are dim -2; Hopper
    // mx_axis -2 storage is reported transposed, so its memory rows are dim -1.
    g.in_stride[0] = contiguous_dim == rank - 1 ? st[rank - 2] : st[rank - 1];
  }
  return plan;
}

}  // namespace wprep
