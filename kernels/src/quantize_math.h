// Per-group MXFP4 quantization math (docs/LAYOUTS.md, "Quantization to MXFP4"), written once
// for host and device so the CPU and CUDA engines cannot drift apart.
#ifndef WPREP_KERNELS_SRC_QUANTIZE_MATH_H_
#define WPREP_KERNELS_SRC_QUANTIZE_MATH_H_

#include <cstdint>
#include <cstring>

#include "layout_math.h"

namespace wprep {
namespace qmath {

inline constexpr int kGroup = 32;

// Bit casts through memcpy: defined behaviour on host, folded to a move on device.
WPREP_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#endif
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
WPREP_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#endif
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16 is the top half of a float32: widening is exact.
WPREP_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 to float32, exact for every input (subnormals, inf, NaN payloads kept).
WPREP_HD float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsFloat(sign | 0x7F800000u | man << 13);
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal: normalize; each shift lowers the exponent by one.
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    return BitsFloat(sign | exp << 23 | (man & 0x3FFu) << 13);
  }
  return BitsFloat(sign | (exp + 127 - 15) << 23 | man << 13);
}

// Step 1 helper: |x| folded into the running max with maxnum semantics (a NaN operand is
// ignored), which is what upstream's tl.max does by default.
WPREP_HD float AbsMaxNum(float acc, float x) {
  const float a = BitsFloat(FloatBits(x) & 0x7FFFFFFFu);
  if (a != a) return acc;
  return a > acc ? a : acc;
}

// Steps 1-2: the scale exponent bits `e` (not shifted) from the group's amax.
WPREP_HD uint32_t ScaleBits(float amax, bool round_up) {
  const uint32_t ds = FloatBits(amax / 6.0f);
  return round_up ? ((ds + 0x007FFFFFu) & 0x7F800000u) : (ds & 0x7F800000u);
}

// Step 3: the multiplier applied to each value.
WPREP_HD float ScaleMultiplier(uint32_t e) { return e == 0 ? 0.0f : 1.0f / BitsFloat(e); }

// Step 4: e2m1 code (sign in bit 3) of q, round to nearest even, saturating at 6.0.
// A NaN q (NaN input, or inf * 0) is code 7: upstream runs on NVIDIA GPUs, whose float
// multiply returns the canonical NaN 0x7FFFFFFF (positive); x86 would keep the input's sign
// or produce 0xFFC00000, so the sign is fixed here rather than left to the host.
WPREP_HD uint32_t EncodeE2m1(float q) {
  if (q != q) return 7u;
  const uint32_t b = FloatBits(q);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t exp = (b >> 23) & 0xFFu;
  uint32_t m = b & 0x007FFFFFu;
  if (exp < 127) m = (0x400000u | m >> 1) >> (126 - exp > 31 ? 31 : 126 - exp);
  const uint32_t e2 = (exp > 126 ? exp : 126) - 126;
  const uint32_t m2 = m >> 21;
  const uint32_t inc = (m2 & 1u) & (static_cast<uint32_t>((m & 0x1FFFFFu) != 0) | ((m2 >> 1) & 1u));
  uint32_t code = ((e2 << 2 | m2) + inc) >> 1;
  if (code > 7u) code = 7u;
  return code | sign >> 28;
}

}  // namespace qmath
}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_QUANTIZE_MATH_H_
