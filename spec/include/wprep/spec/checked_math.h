// Checked arithmetic for sizes that come from a client: a product or sum of numbers a
// request carries must never wrap (a wrapped size is a small buffer for a large copy) and
// a divisor from a request must be checked nonzero before it divides (SIGFPE kills the
// daemon and every call in flight: issue 26).
#ifndef WPREP_SPEC_CHECKED_MATH_H_
#define WPREP_SPEC_CHECKED_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace wprep {

// a * b, or nullopt when it does not fit uint64.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a + b, or nullopt when it does not fit uint64.
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The product of `dims`, or nullopt when a dim is negative or the product does not fit
// uint64. An empty list is 1.
template <typename Range>
std::optional<uint64_t> CheckedProduct(const Range& dims) {
  uint64_t p = 1;
  for (const auto d : dims) {
    if (d < 0 || __builtin_mul_overflow(p, static_cast<uint64_t>(d), &p)) return std::nullopt;
  }
  return p;
}

}  // namespace wprep

#endif  // WPREP_SPEC_CHECKED_MATH_H_
