#include "fuzz_support.h"

#include <algorithm>
#include <cstring>

#include "wprep/kernels/cpu_engine.h"
#include "wprep/spec/spec.h"

namespace wprep::fuzz {

bool ViewSpan(absl::Span<const int64_t> shape, absl::Span<const int64_t> strides, uint64_t* span) {
  if (shape.size() != strides.size()) return false;
  uint64_t reach = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) {
      *span = 0;
      return true;
    }
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || strides[i] < 0) return false;
    uint64_t step = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(shape[i] - 1), static_cast<uint64_t>(strides[i]), &step) ||
        __builtin_add_overflow(reach, step, &reach)) {
      return false;
    }
  }
  *span = reach + 1;
  return true;
}

namespace {

bool Product(absl::Span<const int64_t> shape, uint64_t* out) {
  uint64_t p = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(p, static_cast<uint64_t>(d), &p)) return false;
  }
  *out = p;
  return true;
}

std::string ShapeText(absl::Span<const int64_t> s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

}  // namespace

void CheckPlan(const Plan& plan, absl::Span<const int64_t> logical_shape) {
  const std::string what = Describe(plan.spec) + " " + ShapeText(logical_shape);
  WPREP_FUZZ_CHECK(absl::Span<const int64_t>(plan.logical_shape) == logical_shape, "%s", what.c_str());
  WPREP_FUZZ_CHECK(plan.input_shape.size() == plan.input_strides.size(), "%s", what.c_str());
  WPREP_FUZZ_CHECK(plan.output_shape.size() == plan.output_strides.size(), "%s", what.c_str());
  uint64_t out_elems = 0, in_elems = 0, out_span = 0, in_span = 0;
  WPREP_FUZZ_CHECK(Product(plan.output_shape, &out_elems) && out_elems == plan.output_bytes,
                   "%s: output shape %s, output_bytes %llu", what.c_str(), ShapeText(plan.output_shape).c_str(),
                   static_cast<unsigned long long>(plan.output_bytes));
  WPREP_FUZZ_CHECK(ViewSpan(plan.output_shape, plan.output_strides, &out_span) && out_span == plan.output_bytes,
                   "%s: output strides %s span %llu of %llu bytes", what.c_str(),
                   ShapeText(plan.output_strides).c_str(), static_cast<unsigned long long>(out_span),
                   static_cast<unsigned long long>(plan.output_bytes));
  WPREP_FUZZ_CHECK(Product(plan.input_shape, &in_elems), "%s", what.c_str());
  WPREP_FUZZ_CHECK(ViewSpan(plan.input_shape, plan.input_strides, &in_span) && in_span == plan.input_bytes,
                   "%s: input strides %s span %llu, plan says %llu", what.c_str(),
                   ShapeText(plan.input_strides).c_str(), static_cast<unsigned long long>(in_span),
                   static_cast<unsigned long long>(plan.input_bytes));
  if (plan.input_dense) {
    WPREP_FUZZ_CHECK(in_elems == plan.input_bytes, "%s: dense input shape %s, input_bytes %llu", what.c_str(),
                     ShapeText(plan.input_shape).c_str(), static_cast<unsigned long long>(plan.input_bytes));
  }
  WPREP_FUZZ_CHECK(plan.empty() == (plan.output_bytes == 0), "%s", what.c_str());
}

std::vector<uint8_t> Pattern(uint64_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v[i] = static_cast<uint8_t>(x);
  }
  return v;
}

void RunOnCpu(const Plan& plan, const uint8_t* input, uint64_t buffer_bytes) {
  if (plan.output_bytes > kRunBytes || plan.input_bytes > kRunBytes || buffer_bytes > kRunBytes) return;
  WPREP_FUZZ_CHECK(plan.input_bytes <= buffer_bytes, "view of %llu bytes in a %llu-byte buffer",
                   static_cast<unsigned long long>(plan.input_bytes),
                   static_cast<unsigned long long>(buffer_bytes));
  const std::string what = Describe(plan.spec) + " " + ShapeText(plan.logical_shape);
  // Exactly sized heap buffers: ASan reports any access past either end.
  std::unique_ptr<uint8_t[]> in(new uint8_t[buffer_bytes]);
  if (buffer_bytes > 0) std::memcpy(in.get(), input, buffer_bytes);
  std::unique_ptr<uint8_t[]> a(new uint8_t[plan.output_bytes]), b(new uint8_t[plan.output_bytes]);
  std::memset(a.get(), 0x00, plan.output_bytes);
  std::memset(b.get(), 0xFF, plan.output_bytes);
  const CpuOptions one{1};
  absl::Status s = ConvertOnCpu(plan, in.get(), buffer_bytes, a.get(), plan.output_bytes, one);
  WPREP_FUZZ_CHECK(s.ok(), "%s: the CPU engine refused a valid plan: %s", what.c_str(), s.ToString().c_str());
  s = ConvertOnCpu(plan, in.get(), buffer_bytes, b.get(), plan.output_bytes, one);
  WPREP_FUZZ_CHECK(s.ok(), "%s: %s", what.c_str(), s.ToString().c_str());
  WPREP_FUZZ_CHECK(std::memcmp(a.get(), b.get(), plan.output_bytes) == 0,
                   "%s: output bytes depend on what the output buffer held (not every byte written)", what.c_str());
  if (plan.input_dense) return;
  // The strided view gathered into the dense storage of the same conversion.
  absl::StatusOr<Plan> dense = MakePlan(plan.spec, plan.logical_shape);
  WPREP_FUZZ_CHECK(dense.ok(), "%s: strided plan valid, dense plan not: %s", what.c_str(),
                   dense.status().ToString().c_str());
  WPREP_FUZZ_CHECK(dense->input_shape == plan.input_shape, "%s", what.c_str());
  if (dense->input_bytes > kRunBytes) return;
  std::unique_ptr<uint8_t[]> packed(new uint8_t[dense->input_bytes]);
  const std::vector<int64_t>& shape = plan.input_shape;
  const size_t rank = shape.size();
  if (dense->input_bytes > 0) {
    std::vector<int64_t> idx(rank, 0);
    for (;;) {
      uint64_t from = 0, to = 0;
      for (size_t i = 0; i < rank; ++i) {
        from += static_cast<uint64_t>(idx[i] * plan.input_strides[i]);
        to += static_cast<uint64_t>(idx[i] * dense->input_strides[i]);
      }
      WPREP_FUZZ_CHECK(from < buffer_bytes && to < dense->input_bytes, "%s", what.c_str());
      packed[to] = in[from];
      size_t d = rank;
      while (d > 0 && ++idx[d - 1] == shape[d - 1]) idx[--d] = 0;
      if (d == 0) break;
    }
  }
  std::unique_ptr<uint8_t[]> c(new uint8_t[plan.output_bytes]);
  s = ConvertOnCpu(*dense, packed.get(), dense->input_bytes, c.get(), plan.output_bytes, one);
  WPREP_FUZZ_CHECK(s.ok(), "%s: %s", what.c_str(), s.ToString().c_str());
  WPREP_FUZZ_CHECK(std::memcmp(a.get(), c.get(), plan.output_bytes) == 0,
                   "%s: the strided view converts to other bytes than its dense copy", what.c_str());
}

}  // namespace wprep::fuzz
