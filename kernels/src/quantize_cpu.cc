// Planning and the CPU engine for quantize_mxfp4. The per-group math lives in
// quantize_math.h (shared with the device code); this file only walks groups.
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "wprep/kernels/quantize.h"
#include "wprep/kernels/quantize_math.h"

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
  float group[qmath::kGroup];
  for (int64_t r = 0; r < plan.rows; ++r) {
    const uint8_t* row = in + r * plan.q * esize;
    uint8_t* vrow = values + r * vq;
    if (vq > 0) vrow[vq - 1] = 0;  // an odd Q leaves the last high nibble zero
    for (int64_t g = 0; g < sq; ++g) {
      const int64_t begin = g * qmath::kGroup;
      const int n = static_cast<int>(plan.q - begin < qmath::kGroup ? plan.q - begin
                                                                      : qmath::kGroup);
      float amax = 0.0f;
      for (int i = 0; i < n; ++i) {
        group[i] = LoadElement(plan.dtype, row + (begin + i) * esize);
        amax = qmath::AbsMaxNum(amax, group[i]);
      }
      const uint32_t e = qmath::ScaleBits(amax, up);
      scales[r * sq + g] = static_cast<uint8_t>(e >> 23);
      const float qs = qmath::ScaleMultiplier(e);
      for (int i = 0; i < n; i += 2) {
        uint32_t lo = qmath::EncodeE2m1(group[i] * qs);
        uint32_t hi = i + 1 < n ? qmath::EncodeE2m1(group[i + 1] * qs) : 0u;
        vrow[(begin + i) / 2] = static_cast<uint8_t>(lo | hi << 4);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace wprep
