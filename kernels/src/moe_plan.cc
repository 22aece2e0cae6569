// PlanMoe: the contract's validation rules (docs/TRTLLM_GEN.md sections 5, 10.5, 11)
// and the derivation of every output's shape and pass, before any memory is touched.
#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moe_geometry.h"
#include "wprep/kernels/moe.h"

namespace wprep {
namespace {

using moe::Geometry;
using moe::OutputPass;
using moe::RowMap;

// Byte counts and offsets stay far below int64 overflow so that kernels can form any
// offset of a planned tensor in 64 bits without checking.
constexpr int64_t kMaxBytes = int64_t{1} << 60;

absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Invalid(absl::string_view operand, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat(operand, ": ", msg));
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// a * b, or an error naming the operand when it leaves [0, kMaxBytes].
absl::StatusOr<int64_t> Mul(int64_t a, int64_t b, absl::string_view operand) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r) || r > kMaxBytes) {
    return Invalid(operand, "size overflows (limit 2^60 bytes)");
  }
  return r;
}

absl::StatusOr<int64_t> RoundUpChecked(int64_t x, int64_t a, absl::string_view operand) {
  int64_t r = 0;
  if (__builtin_add_overflow(x, a - 1, &r) || r / a * a > kMaxBytes) {
    return Invalid(operand, "padded size overflows (limit 2^60 bytes)");
  }
  return r / a * a;
}

#define MOE_ASSIGN_OR_RETURN(lhs, expr) \
  auto lhs##_or = (expr);               \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const int64_t lhs = *lhs##_or

struct OpInfo {
  MoeOp op;
  absl::string_view name;
  uint32_t params;  // the MoeParamBit set the op reads
};

constexpr OpInfo kOps[] = {
    {MoeOp::kSwapPairs, "swap_pairs", kMoeParamAxis},
    {MoeOp::kGatedActReorder, "gated_act_reorder", 0},
    {MoeOp::kRowShuffle, "row_shuffle", kMoeParamEpilogueTileM},
    {MoeOp::kScaleRowShuffle, "scale_row_shuffle", kMoeParamEpilogueTileM | kMoeParamNumEltsPerSf},
    {MoeOp::kBlockScaleInterleave, "block_scale_interleave", 0},
    {MoeOp::kShuffleSfA, "shuffle_sf_a", kMoeParamEpilogueTileM | kMoeParamNumEltsPerSf},
    {MoeOp::kBiasShuffle, "bias_shuffle", kMoeParamEpilogueTileM},
    {MoeOp::kSwapHalves, "swap_halves", kMoeParamAxis},
    {MoeOp::kBlockLayout, "block_layout", kMoeParamBlockK},
    {MoeOp::kPrepareW13, "prepare_w13", 0},  // per format: FormatParams
    {MoeOp::kPrepareW2, "prepare_w2", 0},
};

struct ParamName {
  uint32_t bit;
  absl::string_view name;
};
constexpr ParamName kParamNames[] = {
    {kMoeParamFormat, "format"},
    {kMoeParamGated, "gated"},
    {kMoeParamAlign, "align"},
    {kMoeParamAlignH, "align_h"},
    {kMoeParamAlignI, "align_i"},
    {kMoeParamBlockK, "block_k"},
    {kMoeParamAxis, "axis"},
    {kMoeParamEpilogueTileM, "epilogue_tile_m"},
    {kMoeParamNumEltsPerSf, "num_elts_per_sf"},
};

std::string ParamList(uint32_t bits) {
  std::vector<absl::string_view> names;
  for (const ParamName& p : kParamNames) {
    if (bits & p.bit) names.push_back(p.name);
  }
  return absl::StrCat("[", absl::StrJoin(names, ", "), "]");
}

constexpr absl::string_view kFormatNames[] = {"mxfp4", "nvfp4", "mxfp8", "fp8", "fp8_block", "bf16"};

// The parameters prepare_* of `format` takes (section 10.1); mxfp4's are section 4's.
uint32_t FormatParams(MoeOp op, MoeFormat format) {
  const bool w13 = op == MoeOp::kPrepareW13;
  const uint32_t gated = w13 ? static_cast<uint32_t>(kMoeParamGated) : 0u;
  switch (format) {
    case MoeFormat::kMxfp4:
      return kMoeParamFormat | kMoeParamAlign;
    case MoeFormat::kNvfp4:
      return kMoeParamFormat | gated | kMoeParamAlignH | kMoeParamAlignI;
    case MoeFormat::kMxfp8:
    case MoeFormat::kFp8Block:
      return kMoeParamFormat | gated;
    case MoeFormat::kFp8:
    case MoeFormat::kBf16:
      return kMoeParamFormat | gated | kMoeParamAlignI;
  }
  return 0;
}

// S3's block for a tile, after checking the tile.
absl::StatusOr<int64_t> ShuffleBlock(int64_t epilogue_tile_m) {
  if (epilogue_tile_m <= 0) {
    return Invalid("epilogue_tile_m",
                   absl::StrCat("must be a positive integer, got ", epilogue_tile_m));
  }
  return epilogue_tile_m % 128 == 0 ? 32 : 16;
}

absl::Status NeedDType(const MoeTensorDesc& t, std::initializer_list<MoeDType> allowed) {
  for (MoeDType d : allowed) {
    if (t.dtype == d) return absl::OkStatus();
  }
  std::vector<absl::string_view> names;
  for (MoeDType d : allowed) names.push_back(A(MoeDTypeName(d)));
  return Invalid(t.name, absl::StrCat("dtype must be one of [", absl::StrJoin(names, ", "),
                                      "], got ", A(MoeDTypeName(t.dtype))));
}

absl::Status NeedRank(const MoeTensorDesc& t, std::initializer_list<size_t> ranks) {
  for (size_t r : ranks) {
    if (t.shape.size() == r) return absl::OkStatus();
  }
  return Invalid(t.name, absl::StrCat("rank must be ", absl::StrJoin(ranks, " or "), ", got rank ",
                                      t.shape.size(), " (shape ", ShapeStr(t.shape), ")"));
}

// The plan being built.
struct Builder {
  MoePlan plan;
  Geometry geo;

  absl::Status AddOutput(std::string name, MoeDType dtype, std::vector<int64_t> shape,
                         OutputPass pass) {
    int64_t elems = 1;
    for (int64_t d : shape) {
      auto e = Mul(elems, d, name);
      if (!e.ok()) return e.status();
      elems = *e;
    }
    auto bytes = Mul(elems, MoeDTypeSize(dtype), name);
    if (!bytes.ok()) return bytes.status();
    std::vector<int64_t> strides(shape.size(), 1);
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) {
      strides[i] = strides[i + 1] * std::max<int64_t>(shape[i + 1], 1);
    }
    if (!pass.interleave && pass.rows.block_bytes > 0 &&
        (pass.rows.block_bytes & (pass.rows.block_bytes - 1)) == 0) {
      pass.rows.block_shift = __builtin_ctzll(static_cast<uint64_t>(pass.rows.block_bytes));
    }
    plan.outputs.push_back({std::move(name), dtype, std::move(shape)});
    plan.output_strides.push_back(std::move(strides));
    plan.output_bytes.push_back(static_cast<uint64_t>(*bytes));
    geo.outputs[geo.num_outputs++] = pass;
    return absl::OkStatus();
  }
};

// [outer, axis, inner] of a tensor around one axis, inner in bytes.
struct Around {
  int64_t outer = 1, len = 0, inner_bytes = 0;
};

absl::StatusOr<Around> AroundAxis(const MoeTensorDesc& t, int64_t axis) {
  Around a;
  const int rank = static_cast<int>(t.shape.size());
  const int ax = rank + static_cast<int>(axis);
  int64_t inner = MoeDTypeSize(t.dtype);
  for (int i = 0; i < rank; ++i) {
    if (i < ax) {
      MOE_ASSIGN_OR_RETURN(o, Mul(a.outer, t.shape[i], t.name));
      a.outer = o;
    } else if (i > ax) {
      MOE_ASSIGN_OR_RETURN(n, Mul(inner, t.shape[i], t.name));
      inner = n;
    }
  }
  a.len = t.shape[ax];
  a.inner_bytes = inner;
  return a;
}

// swap_pairs / swap_halves.
absl::Status PlanSwap(Builder& b, const MoeTensorDesc& x, int64_t axis, bool halves) {
  const absl::string_view op = halves ? "swap_halves" : "swap_pairs";
  if (auto s = NeedDType(x, {MoeDType::kUint8, MoeDType::kBfloat16, MoeDType::kFloat32}); !s.ok()) {
    return s;
  }
  if (!(axis == -1 || axis == -2) || static_cast<int64_t>(x.shape.size()) < -axis) {
    return Invalid("axis", absl::StrCat("must be -1 or -2 within rank ", x.shape.size(), ", got ",
                                        axis));
  }
  auto around = AroundAxis(x, axis);
  if (!around.ok()) return around.status();
  if (around->len % 2 != 0) {
    return Invalid(x.name, absl::StrCat(op, ": dimension ", axis, " must be even, got ",
                                        around->len));
  }
  OutputPass pass;
  pass.rows = {around->outer, around->len, around->len, around->inner_bytes, around->inner_bytes,
               0, moe::kElemCopy,
               RowMap{0, halves ? moe::kRowRotate : moe::kRowXor1, around->len / 2, around->len}};
  return b.AddOutput("y", x.dtype, x.shape, pass);
}

// [E, M, K] of a rank-2 or rank-3 matrix input (E = 1 for rank 2), K in elements.
struct Mat {
  int64_t e = 1, m = 0, k = 0;
};
Mat AsMat(const MoeTensorDesc& t) {
  if (t.shape.size() == 3) return {t.shape[0], t.shape[1], t.shape[2]};
  return {1, t.shape[0], t.shape[1]};
}

// gated_act_reorder, row_shuffle, scale_row_shuffle: a row permutation of [E?, M, K].
absl::Status PlanRowOp(Builder& b, MoeOp op, const MoeTensorDesc& x, const MoeParams& p) {
  const bool scales = op == MoeOp::kScaleRowShuffle;
  if (auto s = scales ? NeedDType(x, {MoeDType::kUint8})
                      : NeedDType(x, {MoeDType::kUint8, MoeDType::kBfloat16});
      !s.ok()) {
    return s;
  }
  if (scales && p.num_elts_per_sf != 16 && p.num_elts_per_sf != 32) {
    return Invalid("num_elts_per_sf", absl::StrCat("must be 16 or 32, got ", p.num_elts_per_sf));
  }
  if (auto s = NeedRank(x, {2, 3}); !s.ok()) return s;
  const Mat mat = AsMat(x);
  RowMap map{0, moe::kRowPlain, 0, mat.m};
  if (op == MoeOp::kGatedActReorder) {
    if (mat.m % 2 != 0) {
      return Invalid(x.name, absl::StrCat("gated_act_reorder: rows must be even, got ", mat.m));
    }
    map.mode = moe::kRowGatedReorder;
    map.half = mat.m / 2;
  } else {
    auto block = ShuffleBlock(p.epilogue_tile_m);
    if (!block.ok()) return block.status();
    if (scales && mat.m % 128 != 0) {
      return Invalid(x.name, absl::StrCat("scale rows must be a multiple of 128, got ", mat.m));
    }
    if (mat.m % *block != 0) {
      return Invalid(x.name, absl::StrCat("row count must be a multiple of ", *block,
                                          " (epilogue_tile_m=", p.epilogue_tile_m, "), got ",
                                          mat.m));
    }
    map.shuffle_b = static_cast<int32_t>(*block);
  }
  MOE_ASSIGN_OR_RETURN(row_bytes, Mul(mat.k, MoeDTypeSize(x.dtype), x.name));
  OutputPass pass;
  pass.rows = {mat.e, mat.m, mat.m, row_bytes, row_bytes, 0, moe::kElemCopy, map};
  return b.AddOutput("y", x.dtype, x.shape, pass);
}

absl::Status PlanBiasShuffle(Builder& b, const MoeTensorDesc& x, const MoeParams& p) {
  if (auto s = NeedDType(x, {MoeDType::kFloat32, MoeDType::kBfloat16}); !s.ok()) return s;
  if (auto s = NeedRank(x, {1, 2}); !s.ok()) return s;
  auto block = ShuffleBlock(p.epilogue_tile_m);
  if (!block.ok()) return block.status();
  const int64_t e = x.shape.size() == 2 ? x.shape[0] : 1;
  const int64_t n = x.shape.back();
  if (n % *block != 0) {
    return Invalid(x.name, absl::StrCat("row count must be a multiple of ", *block,
                                        " (epilogue_tile_m=", p.epilogue_tile_m, "), got ", n));
  }
  const bool widen = x.dtype == MoeDType::kBfloat16;
  OutputPass pass;
  pass.rows = {e, n, n, widen ? 2 : 4, 4, 0, widen ? moe::kElemWidenBf16 : moe::kElemCopy,
               RowMap{static_cast<int32_t>(*block), moe::kRowPlain, 0, n}};
  return b.AddOutput("y", MoeDType::kFloat32, x.shape, pass);
}

// block_scale_interleave, shuffle_sf_a.
absl::Status PlanInterleave(Builder& b, MoeOp op, const MoeTensorDesc& x, const MoeParams& p) {
  const bool shuffle = op == MoeOp::kShuffleSfA;
  if (auto s = shuffle ? NeedDType(x, {MoeDType::kUint8})
                       : NeedDType(x, {MoeDType::kUint8, MoeDType::kBfloat16});
      !s.ok()) {
    return s;
  }
  if (shuffle && p.num_elts_per_sf != 16 && p.num_elts_per_sf != 32) {
    return Invalid("num_elts_per_sf", absl::StrCat("must be 16 or 32, got ", p.num_elts_per_sf));
  }
  if (auto s = NeedRank(x, {2, 3}); !s.ok()) return s;
  const Mat mat = AsMat(x);
  RowMap map{0, moe::kRowPlain, 0, mat.m};
  if (shuffle) {
    auto block = ShuffleBlock(p.epilogue_tile_m);
    if (!block.ok()) return block.status();
    if (mat.m % 128 != 0) {
      return Invalid(x.name, absl::StrCat("scale rows must be a multiple of 128, got ", mat.m));
    }
    map.shuffle_b = static_cast<int32_t>(*block);
  }
  MOE_ASSIGN_OR_RETURN(mp, RoundUpChecked(mat.m, 128, x.name));
  MOE_ASSIGN_OR_RETURN(cp, RoundUpChecked(mat.k, 4, x.name));
  MOE_ASSIGN_OR_RETURN(per_expert, Mul(mp, cp, x.name));
  MOE_ASSIGN_OR_RETURN(total, Mul(mat.e, per_expert, x.name));
  OutputPass pass;
  pass.interleave = true;
  // M = 0 or C = 0: nothing to write (the output has 0 elements).
  const bool empty = mat.m == 0 || mat.k == 0;
  pass.il = {mat.e, mat.m, mat.k, empty ? 0 : mp, empty ? 0 : cp, MoeDTypeSize(x.dtype), map};
  return b.AddOutput("y", x.dtype, {empty ? 0 : total}, pass);
}

absl::Status PlanBlockLayout(Builder& b, const MoeTensorDesc& x, const MoeParams& p) {
  if (auto s = NeedDType(x, {MoeDType::kUint8, MoeDType::kBfloat16}); !s.ok()) return s;
  if (p.block_k <= 0) {
    return Invalid("block_k", absl::StrCat("must be a positive integer, got ", p.block_k));
  }
  if (auto s = NeedRank(x, {2, 3}); !s.ok()) return s;
  const Mat mat = AsMat(x);
  if (mat.k % p.block_k != 0) {
    return Invalid(x.name, absl::StrCat("block_layout: K = ", mat.k,
                                        " must be a multiple of block_k = ", p.block_k));
  }
  const int64_t es = MoeDTypeSize(x.dtype);
  MOE_ASSIGN_OR_RETURN(row_bytes, Mul(mat.k, es, x.name));
  MOE_ASSIGN_OR_RETURN(block_bytes, Mul(p.block_k, es, "block_k"));
  std::vector<int64_t> shape = {mat.k / p.block_k, mat.m, p.block_k};
  if (x.shape.size() == 3) shape.insert(shape.begin(), mat.e);
  OutputPass pass;
  pass.rows = {mat.e, mat.m, mat.m, row_bytes, row_bytes, block_bytes, moe::kElemCopy,
               RowMap{0, moe::kRowPlain, 0, mat.m}};
  return b.AddOutput("y", x.dtype, std::move(shape), pass);
}

// prepare_w13 / prepare_w2 of MXFP4 (section 4).
absl::Status PlanPrepareMxfp4(Builder& b, bool w13, const MoeParams& p,
                              const std::vector<MoeTensorDesc>& in) {
  if (p.align <= 0 || p.align % 128 != 0) {
    return Invalid("align", absl::StrCat("must be a positive multiple of 128, got ", p.align));
  }
  const MoeTensorDesc& v = in[0];
  const MoeTensorDesc& s = in[1];
  const MoeTensorDesc* bias = in.size() > 2 ? &in[2] : nullptr;
  if (auto st = NeedDType(v, {MoeDType::kUint8}); !st.ok()) return st;
  if (auto st = NeedDType(s, {MoeDType::kUint8}); !st.ok()) return st;
  if (bias) {
    if (auto st = NeedDType(*bias, {MoeDType::kFloat32, MoeDType::kBfloat16}); !st.ok()) return st;
  }
  if (v.shape.size() != 3) {
    return Invalid(v.name, absl::StrCat("must have rank 3 [E, rows, K/2], got rank ",
                                        v.shape.size()));
  }
  const int64_t e = v.shape[0], r = v.shape[1], kb = v.shape[2];
  if (e < 1) return Invalid(v.name, absl::StrCat("number of experts must be >= 1, got ", e));
  if (r < 1 || kb < 1) {
    return Invalid(v.name, absl::StrCat("dimensions must be non-zero, got ", ShapeStr(v.shape)));
  }
  MOE_ASSIGN_OR_RETURN(k, Mul(kb, 2, v.name));
  if (k % 32 != 0) {
    return Invalid(v.name, absl::StrCat("reduction size K = 2*values.shape[2] must be a "
                                        "multiple of 32, got ",
                                        k));
  }
  const std::vector<int64_t> want_s = {e, r, k / 32};
  if (s.shape != want_s) {
    return Invalid(s.name, absl::StrCat("must have shape ", ShapeStr(want_s), ", got ",
                                        ShapeStr(s.shape)));
  }
  if (bias && bias->shape != std::vector<int64_t>{e, r}) {
    return Invalid(bias->name, absl::StrCat("must have shape ", ShapeStr({e, r}), ", got ",
                                            ShapeStr(bias->shape)));
  }
  if (w13 && r % 2 != 0) {
    return Invalid(v.name, absl::StrCat("w13 rows (2*I) must be even, got ", r));
  }
  // Padded rows and reduction size: w13 rows 2*rup(I), w2 rows rup(H); K to rup(K).
  MOE_ASSIGN_OR_RETURN(rows_half, RoundUpChecked(w13 ? r / 2 : r, p.align, v.name));
  const int64_t rows = w13 ? 2 * rows_half : rows_half;
  MOE_ASSIGN_OR_RETURN(kp, RoundUpChecked(k, p.align, v.name));
  const RowMap map{32, w13 ? moe::kRowXor1 : moe::kRowPlain, 0, r};

  OutputPass vp;
  vp.rows = {e, r, rows, kb, kp / 2, 0, moe::kElemCopy, map};
  vp.input = 0;
  if (auto st = b.AddOutput("values", MoeDType::kUint8, {e, rows, kp / 2}, vp); !st.ok()) return st;
  OutputPass sp;
  sp.interleave = true;
  sp.il = {e, r, k / 32, rows, kp / 32, 1, map};
  sp.input = 1;
  if (auto st = b.AddOutput("scales", MoeDType::kUint8, {e, rows, kp / 32}, sp); !st.ok()) return st;
  if (bias) {
    const bool widen = bias->dtype == MoeDType::kBfloat16;
    OutputPass bp;
    bp.rows = {e, r, rows, widen ? 2 : 4, 4, 0, widen ? moe::kElemWidenBf16 : moe::kElemCopy, map};
    bp.input = 2;
    if (auto st = b.AddOutput("bias", MoeDType::kFloat32, {e, rows}, bp); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// prepare_w13 / prepare_w2 of nvfp4, mxfp8, fp8, fp8_block, bf16 (section 10).
absl::Status PlanPrepareFormat(Builder& b, bool w13, const MoeParams& p,
                               const std::vector<MoeTensorDesc>& in) {
  const MoeFormat fmt = p.format;
  const std::string fname(A(MoeFormatName(fmt)));
  const std::string kind = w13 ? "w13" : "w2";
  for (const char* key : {"align_h", "align_i"}) {
    const bool h = key[6] == 'h';
    const uint32_t bit = h ? kMoeParamAlignH : kMoeParamAlignI;
    const int64_t value = h ? p.align_h : p.align_i;
    if ((FormatParams(w13 ? MoeOp::kPrepareW13 : MoeOp::kPrepareW2, fmt) & bit) && value <= 0) {
      return Invalid(key, absl::StrCat("must be a positive integer, got ", value));
    }
  }
  const MoeTensorDesc& v = in[0];
  const MoeTensorDesc* s = in.size() > 1 ? &in[1] : nullptr;
  if (auto st = NeedDType(v, {fmt == MoeFormat::kBf16 ? MoeDType::kBfloat16 : MoeDType::kUint8});
      !st.ok()) {
    return st;
  }
  if (v.shape.size() != 3) {
    return Invalid(v.name, absl::StrCat("must have rank 3 [E, rows, cols], got rank ",
                                        v.shape.size()));
  }
  const int64_t e = v.shape[0], r = v.shape[1], kb = v.shape[2];
  if (e < 1) return Invalid(v.name, absl::StrCat("number of experts must be >= 1, got ", e));
  if (r < 1 || kb < 1) {
    return Invalid(v.name, absl::StrCat("dimensions must be non-zero, got ", ShapeStr(v.shape)));
  }
  const int64_t es = MoeDTypeSize(v.dtype);
  MOE_ASSIGN_OR_RETURN(k, Mul(kb, fmt == MoeFormat::kNvfp4 ? 2 : 1, v.name));
  const bool sf = fmt == MoeFormat::kNvfp4 || fmt == MoeFormat::kMxfp8;
  const int64_t sfb = fmt == MoeFormat::kNvfp4 ? 16 : 32;
  if (sf) {
    if (k % sfb != 0) {
      return Invalid(v.name, absl::StrCat(fname, ": reduction size K = ", k,
                                          " must be a multiple of ", sfb));
    }
    if (auto st = NeedDType(*s, {MoeDType::kUint8}); !st.ok()) return st;
    const std::vector<int64_t> want = {e, r, k / sfb};
    if (s->shape != want) {
      return Invalid(s->name, absl::StrCat("must have shape ", ShapeStr(want), ", got ",
                                           ShapeStr(s->shape)));
    }
  }
  if (fmt == MoeFormat::kFp8Block) {
    if (r % 128 != 0 || k % 128 != 0) {
      return Invalid(v.name, absl::StrCat("fp8_block: rows and K must be multiples of 128, got ",
                                          r, " x ", k));
    }
    if (auto st = NeedDType(*s, {MoeDType::kFloat32}); !st.ok()) return st;
    const std::vector<int64_t> want = {e, r / 128, k / 128};
    if (s->shape != want) {
      return Invalid(s->name, absl::StrCat("must have shape ", ShapeStr(want), ", got ",
                                           ShapeStr(s->shape)));
    }
  }
  const bool gated = w13 && p.gated;
  if (gated) {
    if (r % 2 != 0) return Invalid(v.name, absl::StrCat("gated w13 rows must be even, got ", r));
    if (fmt == MoeFormat::kFp8Block && (r / 128) % 2 != 0) {
      return Invalid(s->name, absl::StrCat("fp8_block: gated w13 needs an even number of 128-row "
                                           "scale blocks, got ",
                                           r / 128));
    }
  }

  // Padding (section 10.2 step 2): rows_out, the padded row count R'; kp, the padded
  // reduction size in elements.
  int64_t rows_out = r, kp = k;
  RowMap map;
  if (w13) {
    const int64_t i = gated ? r / 2 : r;
    int64_t ip = i;
    if (fmt == MoeFormat::kNvfp4 || fmt == MoeFormat::kFp8 || fmt == MoeFormat::kBf16) {
      MOE_ASSIGN_OR_RETURN(ipp, RoundUpChecked(i, p.align_i, "align_i"));
      ip = ipp;
    }
    if (fmt == MoeFormat::kNvfp4) {
      MOE_ASSIGN_OR_RETURN(hp, RoundUpChecked(k, p.align_h, "align_h"));
      kp = hp;
    }
    MOE_ASSIGN_OR_RETURN(ro, Mul(ip, gated ? 2 : 1, v.name));
    rows_out = ro;
    if (!gated) {
      map = {0, moe::kRowPlain, 0, i};
    } else if (fmt == MoeFormat::kFp8Block) {
      map = {0, moe::kRowRotate, i, r};
    } else {
      map = {0, moe::kRowGatedPrepare, i, r};
    }
  } else {
    if (fmt == MoeFormat::kNvfp4) {
      MOE_ASSIGN_OR_RETURN(hp, RoundUpChecked(r, p.align_h, "align_h"));
      rows_out = hp;
    }
    if (fmt == MoeFormat::kNvfp4 || fmt == MoeFormat::kFp8 || fmt == MoeFormat::kBf16) {
      MOE_ASSIGN_OR_RETURN(ipp, RoundUpChecked(k, p.align_i, "align_i"));
      kp = ipp;
    }
    map = {0, moe::kRowPlain, 0, r};
  }
  const int64_t block = fmt == MoeFormat::kFp8Block ? 16 : 32;
  if (rows_out % block != 0) {
    return Invalid(v.name, absl::StrCat(fname, " ", kind, ": (padded) rows = ", rows_out,
                                        " must be a multiple of ", block));
  }
  map.shuffle_b = static_cast<int32_t>(block);
  const int64_t in_row_bytes = kb * es;
  MOE_ASSIGN_OR_RETURN(kp_bytes, Mul(fmt == MoeFormat::kNvfp4 ? kp / 2 : kp, es, v.name));
  const bool block_major = fmt == MoeFormat::kFp8Block || fmt == MoeFormat::kBf16;
  if (block_major && kp_bytes % 128 != 0) {
    return Invalid(v.name, absl::StrCat(fname, " ", kind, ": K = ", kp, " must be a multiple of ",
                                        128 / es, " for BlockMajorK"));
  }
  if (sf) {
    const int64_t c = kp / sfb;
    if (rows_out % 128 != 0 || c % 4 != 0) {
      return Invalid(s->name, absl::StrCat(fname, " ", kind, ": scale rows ", rows_out,
                                           " must be a multiple of 128 and scale columns ", c,
                                           " a multiple of 4"));
    }
  }

  OutputPass vp;
  vp.rows = {e, r, rows_out, in_row_bytes, kp_bytes, block_major ? 128 : 0, moe::kElemCopy, map};
  std::vector<int64_t> vshape = {e, rows_out, kp_bytes / es};
  if (block_major) vshape = {e, kp_bytes / 128, rows_out, 128 / es};
  if (auto st = b.AddOutput("values", v.dtype, std::move(vshape), vp); !st.ok()) return st;
  if (sf) {
    OutputPass sp;
    sp.interleave = true;
    sp.input = 1;
    sp.il = {e, r, k / sfb, rows_out, kp / sfb, 1, map};
    if (auto st = b.AddOutput("scales", MoeDType::kUint8, {e, rows_out, kp / sfb}, sp); !st.ok()) {
      return st;
    }
  }
  if (fmt == MoeFormat::kFp8Block) {
    const int64_t q = r / 128;
    OutputPass sp;
    sp.input = 1;
    sp.rows = {e, q, q, (k / 128) * 4, (k / 128) * 4, 0, moe::kElemClampF32,
               RowMap{0, gated ? moe::kRowRotate : moe::kRowPlain, q / 2, q}};
    if (auto st = b.AddOutput("scales", MoeDType::kFloat32, s->shape, sp); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// The input names `op` takes, in plan order; `optional_from`: names from this index on
// may be left out.
struct InputNames {
  std::vector<absl::string_view> names;
  size_t required = 0;
};

InputNames NamesFor(MoeOp op, MoeFormat format) {
  if (op != MoeOp::kPrepareW13 && op != MoeOp::kPrepareW2) return {{"x"}, 1};
  switch (format) {
    case MoeFormat::kMxfp4:
      return {{"values", "scales", "bias"}, 2};
    case MoeFormat::kNvfp4:
    case MoeFormat::kMxfp8:
    case MoeFormat::kFp8Block:
      return {{"values", "scales"}, 2};
    case MoeFormat::kFp8:
    case MoeFormat::kBf16:
      return {{"values"}, 1};
  }
  return {};
}

std::string Identity(MoeOp op, const MoeParams& p, uint32_t used) {
  std::string id = absl::StrCat("trtllm_gen:", A(MoeOpName(op)));
  for (const ParamName& n : kParamNames) {
    if (!(used & n.bit)) continue;
    switch (n.bit) {
      case kMoeParamFormat:
        absl::StrAppend(&id, " format=", A(MoeFormatName(p.format)));
        break;
      case kMoeParamGated:
        absl::StrAppend(&id, " gated=", p.gated ? "true" : "false");
        break;
      case kMoeParamAlign:
        absl::StrAppend(&id, " align=", p.align);
        break;
      case kMoeParamAlignH:
        absl::StrAppend(&id, " align_h=", p.align_h);
        break;
      case kMoeParamAlignI:
        absl::StrAppend(&id, " align_i=", p.align_i);
        break;
      case kMoeParamBlockK:
        absl::StrAppend(&id, " block_k=", p.block_k);
        break;
      case kMoeParamAxis:
        absl::StrAppend(&id, " axis=", p.axis);
        break;
      case kMoeParamEpilogueTileM:
        absl::StrAppend(&id, " epilogue_tile_m=", p.epilogue_tile_m);
        break;
      case kMoeParamNumEltsPerSf:
        absl::StrAppend(&id, " num_elts_per_sf=", p.num_elts_per_sf);
        break;
    }
  }
  absl::StrAppend(&id, " contract=", kMoeContractVersion);
  return id;
}

}  // namespace

absl::StatusOr<MoeOp> ParseMoeOp(std::string_view name_in) {
  const absl::string_view name(name_in.data(), name_in.size());
  for (const OpInfo& o : kOps) {
    if (o.name == name) return o.op;
  }
  std::vector<absl::string_view> names;
  for (const OpInfo& o : kOps) names.push_back(o.name);
  return Invalid("op", absl::StrCat("unknown op '", name, "'; known: ",
                                    absl::StrJoin(names, ", ")));
}

std::string_view MoeOpName(MoeOp op) {
  for (const OpInfo& o : kOps) {
    if (o.op == op) return std::string_view(o.name.data(), o.name.size());
  }
  return "unknown";
}

absl::StatusOr<MoeFormat> ParseMoeFormat(std::string_view name_in) {
  const absl::string_view name(name_in.data(), name_in.size());
  for (size_t i = 0; i < std::size(kFormatNames); ++i) {
    if (kFormatNames[i] == name) return static_cast<MoeFormat>(i);
  }
  return Invalid("format", absl::StrCat("must be one of [", absl::StrJoin(kFormatNames, ", "),
                                        "], got '", name, "'"));
}

std::string_view MoeFormatName(MoeFormat format) {
  const size_t i = static_cast<size_t>(format);
  if (i >= std::size(kFormatNames)) return "unknown";
  return std::string_view(kFormatNames[i].data(), kFormatNames[i].size());
}

absl::StatusOr<MoeDType> ParseMoeDType(std::string_view name_in) {
  const absl::string_view name(name_in.data(), name_in.size());
  if (name == "uint8") return MoeDType::kUint8;
  if (name == "float32") return MoeDType::kFloat32;
  if (name == "bfloat16") return MoeDType::kBfloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype must be one of [uint8, float32, bfloat16], got '", name, "'"));
}

std::string_view MoeDTypeName(MoeDType dtype) {
  switch (dtype) {
    case MoeDType::kUint8:
      return "uint8";
    case MoeDType::kFloat32:
      return "float32";
    case MoeDType::kBfloat16:
      return "bfloat16";
  }
  return "unknown";
}

int MoeDTypeSize(MoeDType dtype) {
  switch (dtype) {
    case MoeDType::kUint8:
      return 1;
    case MoeDType::kFloat32:
      return 4;
    case MoeDType::kBfloat16:
      return 2;
  }
  return 1;
}

absl::Status SetMoeParam(MoeParams& params, std::string_view key_in, std::string_view value_in) {
  const absl::string_view key(key_in.data(), key_in.size());
  const absl::string_view value(value_in.data(), value_in.size());
  const ParamName* found = nullptr;
  for (const ParamName& p : kParamNames) {
    if (p.name == key) found = &p;
  }
  if (found == nullptr) {
    return Invalid(key, absl::StrCat("unknown parameter; known: ", ParamList(~0u)));
  }
  if (found->bit == kMoeParamFormat) {
    auto f = ParseMoeFormat(std::string_view(value.data(), value.size()));
    if (!f.ok()) return f.status();
    params.format = *f;
  } else if (found->bit == kMoeParamGated) {
    if (value == "true") {
      params.gated = true;
    } else if (value == "false") {
      params.gated = false;
    } else {
      return Invalid(key, absl::StrCat("must be true or false, got '", value, "'"));
    }
  } else {
    int64_t v = 0;
    // SimpleAtoi takes a leading '+' and surrounding spaces; the contract's integers are
    // plain decimal, so check the characters first.
    bool plain = !value.empty();
    for (size_t i = 0; i < value.size(); ++i) {
      const char c = value[i];
      if (!((c >= '0' && c <= '9') || (c == '-' && i == 0 && value.size() > 1))) plain = false;
    }
    if (!plain || !absl::SimpleAtoi(value, &v)) {
      return Invalid(key, absl::StrCat("must be a decimal integer, got '", value, "'"));
    }
    switch (found->bit) {
      case kMoeParamAlign:
        params.align = v;
        break;
      case kMoeParamAlignH:
        params.align_h = v;
        break;
      case kMoeParamAlignI:
        params.align_i = v;
        break;
      case kMoeParamBlockK:
        params.block_k = v;
        break;
      case kMoeParamAxis:
        params.axis = v;
        break;
      case kMoeParamEpilogueTileM:
        params.epilogue_tile_m = v;
        break;
      case kMoeParamNumEltsPerSf:
        params.num_elts_per_sf = v;
        break;
    }
  }
  params.given |= found->bit;
  return absl::OkStatus();
}

namespace moe {

absl::StatusOr<MoePlan> PlanWithGeometry(MoeOp op, const MoeParams& params,
                                         std::vector<MoeTensorDesc> inputs, Geometry* geometry) {
  const bool prepare = op == MoeOp::kPrepareW13 || op == MoeOp::kPrepareW2;
  const OpInfo* info = nullptr;
  for (const OpInfo& o : kOps) {
    if (o.op == op) info = &o;
  }
  if (info == nullptr) return Invalid("op", "unknown op");
  const std::string op_name(info->name);

  // Parameters: the op's set. prepare_* of every format but mxfp4 takes exactly its set
  // (section 10.1); elsewhere a parameter left out takes its default.
  uint32_t allowed = info->params;
  if (prepare) {
    allowed = FormatParams(op, params.format);
  }
  if (const uint32_t extra = params.given & ~allowed; extra != 0) {
    return Invalid("params", absl::StrCat(op_name,
                                          prepare ? absl::StrCat(" format ",
                                                                 A(MoeFormatName(params.format)))
                                                  : "",
                                          " takes ", ParamList(allowed), ", got extra ",
                                          ParamList(extra)));
  }
  if (prepare && params.format != MoeFormat::kMxfp4) {
    if (const uint32_t missing = allowed & ~params.given; missing != 0) {
      return Invalid("params", absl::StrCat(op_name, " format ", A(MoeFormatName(params.format)),
                                            ": params must be exactly ", ParamList(allowed),
                                            ", missing ", ParamList(missing)));
    }
  }

  // Inputs: by name, reordered into plan order.
  const InputNames want = NamesFor(op, params.format);
  std::vector<MoeTensorDesc> ordered;
  for (size_t i = 0; i < want.names.size(); ++i) {
    int found = -1;
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (inputs[j].name != want.names[i]) continue;
      if (found >= 0) {
        return Invalid(inputs[j].name, "given more than once");
      }
      found = static_cast<int>(j);
    }
    if (found < 0) {
      if (i < want.required) {
        return Invalid(want.names[i], absl::StrCat("missing; ", op_name, " takes inputs [",
                                                   absl::StrJoin(want.names, ", "), "]"));
      }
      continue;
    }
    ordered.push_back(inputs[found]);
  }
  if (ordered.size() != inputs.size()) {
    for (const MoeTensorDesc& t : inputs) {
      if (std::find(want.names.begin(), want.names.end(), t.name) == want.names.end()) {
        return Invalid(t.name.empty() ? std::string("input") : t.name,
                       absl::StrCat("not an input of ", op_name,
                                    prepare ? absl::StrCat(" format ", A(MoeFormatName(params.format)))
                                            : "",
                                    "; it takes [", absl::StrJoin(want.names, ", "), "]"));
      }
    }
  }
  Builder b;
  b.plan.op = op;
  b.plan.params = params;
  for (const MoeTensorDesc& t : ordered) {
    int64_t elems = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return Invalid(t.name, absl::StrCat("dimensions must be >= 0, got ", ShapeStr(t.shape)));
      }
      auto m = Mul(elems, d, t.name);
      if (!m.ok()) return m.status();
      elems = *m;
    }
    if (t.shape.size() > 8) return Invalid(t.name, "rank must be at most 8");
    auto bytes = Mul(elems, MoeDTypeSize(t.dtype), t.name);
    if (!bytes.ok()) return bytes.status();
    b.plan.input_bytes.push_back(static_cast<uint64_t>(*bytes));
  }
  const MoeTensorDesc& x = ordered[0];
  absl::Status st;
  switch (op) {
    case MoeOp::kSwapPairs:
      st = PlanSwap(b, x, params.axis, /*halves=*/false);
      break;
    case MoeOp::kSwapHalves:
      st = PlanSwap(b, x, params.axis, /*halves=*/true);
      break;
    case MoeOp::kGatedActReorder:
    case MoeOp::kRowShuffle:
    case MoeOp::kScaleRowShuffle:
      st = PlanRowOp(b, op, x, params);
      break;
    case MoeOp::kBiasShuffle:
      st = PlanBiasShuffle(b, x, params);
      break;
    case MoeOp::kBlockScaleInterleave:
    case MoeOp::kShuffleSfA:
      st = PlanInterleave(b, op, x, params);
      break;
    case MoeOp::kBlockLayout:
      st = PlanBlockLayout(b, x, params);
      break;
    case MoeOp::kPrepareW13:
    case MoeOp::kPrepareW2:
      st = params.format == MoeFormat::kMxfp4
               ? PlanPrepareMxfp4(b, op == MoeOp::kPrepareW13, params, ordered)
               : PlanPrepareFormat(b, op == MoeOp::kPrepareW13, params, ordered);
      break;
  }
  if (!st.ok()) return st;
  b.plan.inputs = std::move(ordered);
  b.plan.identity = Identity(op, params, allowed);
  if (geometry != nullptr) *geometry = b.geo;
  return std::move(b.plan);
}

absl::StatusOr<Geometry> GeometryOf(const MoePlan& plan) {
  Geometry geo;
  auto again = PlanWithGeometry(plan.op, plan.params, plan.inputs, &geo);
  if (!again.ok()) return again.status();
  if (again->output_bytes != plan.output_bytes || again->input_bytes != plan.input_bytes) {
    return absl::InternalError("the MoE plan was altered after PlanMoe");
  }
  return geo;
}

}  // namespace moe

absl::StatusOr<MoePlan> PlanMoe(MoeOp op, const MoeParams& params,
                                std::vector<MoeTensorDesc> inputs) {
  return moe::PlanWithGeometry(op, params, std::move(inputs), nullptr);
}

}  // namespace wprep
