// SSE2 word shuffles the CPU passes share.
#ifndef WPREP_KERNELS_SRC_SIMD_CPU_H_
#define WPREP_KERNELS_SRC_SIMD_CPU_H_

#if defined(__SSE2__)
#include <emmintrin.h>

namespace wprep::cpu {

// 4x4 transpose of u32 lanes: row j of the result is lane j of a0..a3.
inline void Transpose4(__m128i& a0, __m128i& a1, __m128i& a2, __m128i& a3) {
  const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
  const __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
  a0 = _mm_unpacklo_epi64(t0, t1);
  a1 = _mm_unpackhi_epi64(t0, t1);
  a2 = _mm_unpacklo_epi64(t2, t3);
  a3 = _mm_unpackhi_epi64(t2, t3);
}

}  // namespace wprep::cpu

#endif  // __SSE2__

#endif  // WPREP_KERNELS_SRC_SIMD_CPU_H_
