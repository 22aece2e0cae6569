// Pieces shared by every tile (see tiles.h): how buffers may be accessed, and 16-byte,
// 4-byte and per-byte moves that run the same on the host and the device.
#ifndef WPREP_KERNELS_SRC_TILE_COMMON_H_
#define WPREP_KERNELS_SRC_TILE_COMMON_H_

#include <cstdint>
#include <cstring>

#include "layout_math.h"

namespace wprep::tiles {

inline constexpr int kChunk = 16;

// Widest access every run of the input / output allows: the pointers, the leading
// strides and what the planner found every access start inside a matrix to be a
// multiple of (Geometry::in_align, out_align: row pitches, tile_k, strides).
struct Access {
  bool vec_in = false;   // 16-byte loads
  bool word_in = false;  // 4-byte loads
  bool vec_out = false;  // 16-byte stores
  bool word_out = false; // 4-byte stores
};

inline Access ChooseAccess(const Geometry& g, const void* in, const void* out) {
  int64_t a_in = static_cast<int64_t>(reinterpret_cast<uintptr_t>(in) % 64);
  for (int i = 0; i < g.lead_rank; ++i) a_in = Gcd(a_in, g.in_lead_stride[i]);
  a_in = Gcd(a_in, g.in_align);
  const int64_t a_out = Gcd(static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % 64),
                              g.out_align);
  Access a;
  a.vec_in = a_in % 16 == 0;
  a.word_in = a_in % 4 == 0;
  a.vec_out = a_out % 16 == 0;
  a.word_out = a_out % 4 == 0;
  return a;
}

// Device code uses native vector types; host code memcpy (no aliasing assumptions;
// compilers emit single moves).
WPREP_HD uint32_t LoadWord(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
#endif
}
WPREP_HD void StoreWord(uint8_t* p, uint32_t w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = w;
#else
  std::memcpy(p, &w, 4);
#endif
}
WPREP_HD void Load4Words(uint32_t* w, const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
#else
  std::memcpy(w, p, kChunk);
#endif
}
WPREP_HD void Store4Words(uint8_t* p, const uint32_t* w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
#else
  std::memcpy(p, w, kChunk);
#endif
}

// A halfword (low 16 bits of the result) from / to a 2-byte aligned `p`.
WPREP_HD uint32_t LoadHalf(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
#endif
}
WPREP_HD void StoreHalf(uint8_t* p, uint32_t h) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(h);
#else
  const uint16_t v = static_cast<uint16_t>(h);
  std::memcpy(p, &v, 2);
#endif
}

// Two words from an 8-byte aligned `p`.
WPREP_HD void Load2Words(uint32_t* w, const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  w[0] = v.x;
  w[1] = v.y;
#else
  std::memcpy(w, p, 8);
#endif
}

// Two words to an 8-byte aligned `p`.
WPREP_HD void Store2Words(uint8_t* p, uint32_t w0, uint32_t w1) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint2*>(p) = make_uint2(w0, w1);
#else
  const uint32_t w[2] = {w0, w1};
  std::memcpy(p, w, 8);
#endif
}

// Reads kWords little-endian words from `src`, of which only the first `valid` bytes
// exist (the rest read as zero; `src` is not touched when valid <= 0). `vec`: src is
// 16-byte aligned (kWords % 4 == 0) or 4-byte aligned (otherwise).
template <int kWords>
WPREP_HD void LoadRowWords(const uint8_t* src, int64_t valid, uint32_t* w, bool vec) {
  if (vec && valid >= 4 * kWords) {
    if constexpr (kWords % 4 == 0) {
      WPREP_UNROLL
      for (int i = 0; i < kWords / 4; ++i) Load4Words(w + 4 * i, src + 16 * i);
    } else {
      WPREP_UNROLL
      for (int i = 0; i < kWords; ++i) w[i] = LoadWord(src + 4 * i);
    }
    return;
  }
  WPREP_UNROLL
  for (int i = 0; i < kWords; ++i) {
    uint32_t word = 0;
    WPREP_UNROLL
    for (int j = 0; j < 4; ++j) {
      if (4 * i + j < valid) word |= static_cast<uint32_t>(src[4 * i + j]) << (8 * j);
    }
    w[i] = word;
  }
}

// Writes the first `valid` bytes of kWords words to `dst` (nothing when valid <= 0).
template <int kWords>
WPREP_HD void StoreRowWords(uint8_t* dst, int64_t valid, const uint32_t* w, bool vec) {
  if (vec && valid >= 4 * kWords) {
    if constexpr (kWords % 4 == 0) {
      WPREP_UNROLL
      for (int i = 0; i < kWords / 4; ++i) Store4Words(dst + 16 * i, w + 4 * i);
    } else {
      WPREP_UNROLL
      for (int i = 0; i < kWords; ++i) StoreWord(dst + 4 * i, w[i]);
    }
    return;
  }
  // Constant indices only, so `w` can stay in registers on the device.
  WPREP_UNROLL
  for (int i = 0; i < kWords; ++i) {
    WPREP_UNROLL
    for (int j = 0; j < 4; ++j) {
      if (4 * i + j < valid) dst[4 * i + j] = static_cast<uint8_t>(w[i] >> (8 * j));
    }
  }
}

// ---------------------------------------------------------------------------------------
// 64-byte blocks per thread (Hopper O blocks, Blackwell scale blocks). Written chunk by
// chunk, the 16-byte stores of one warp instruction would land 64 bytes apart: half a
// 32-byte sector each, so every sector is written twice and L2 write traffic doubles. On
// the device the 4 lanes of a quad therefore swap chunks so that each store instruction
// writes 64 contiguous bytes per quad. Every lane of the warp must call StoreBlock64 (lanes
// without a block pass active = false); on the host it stores the block directly.

#if defined(__CUDA_ARCH__)
// Lanes of the quads in `mask` exchange 16-byte chunks: afterwards chunk i of lane q
// holds what chunk q of the quad's lane i held (an involution).
__device__ __forceinline__ void QuadTransposeChunks(uint32_t* w, unsigned mask) {
  const unsigned q = threadIdx.x & 3;
  WPREP_UNROLL
  for (int b = 1; b <= 2; b <<= 1) {
    const bool hi = (q & b) != 0;
    WPREP_UNROLL
    for (int k = 0; k < 4; ++k) {
      if ((k & b) != 0) continue;
      WPREP_UNROLL
      for (int j = 0; j < 4; ++j) {
        const uint32_t send = hi ? w[4 * k + j] : w[4 * (k ^ b) + j];
        const uint32_t recv = __shfl_xor_sync(mask, send, b);
        if (hi) {
          w[4 * k + j] = recv;
        } else {
          w[4 * (k ^ b) + j] = recv;
        }
      }
    }
  }
}

// Lanes of quads whose four blocks are consecutive, 16-byte aligned and all present.
__device__ __forceinline__ unsigned CoalescibleQuads(const void* p, bool active, bool vec) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned long long mine = reinterpret_cast<unsigned long long>(p);
  const unsigned long long first = __shfl_sync(0xffffffffu, mine, lane & ~3u);
  const bool ok = active && vec && mine == first + 64 * (lane & 3);
  const unsigned ballot = __ballot_sync(0xffffffffu, ok);
  const unsigned quads = ballot & (ballot >> 1) & (ballot >> 2) & (ballot >> 3) & 0x11111111u;
  return quads * 0xFu;
}
#endif

WPREP_HD void StoreBlock64(uint8_t* dst, uint32_t* w, bool active, bool vec) {
#if defined(__CUDA_ARCH__)
  const unsigned mask = CoalescibleQuads(dst, active, vec);
  if ((mask >> (threadIdx.x & 31)) & 1) {
    QuadTransposeChunks(w, mask);
    uint8_t* first = dst - 64 * (threadIdx.x & 3);
    WPREP_UNROLL
    for (int i = 0; i < 4; ++i) Store4Words(first + 64 * i + 16 * (threadIdx.x & 3), w + 4 * i);
    return;
  }
#endif
  if (active) StoreRowWords<16>(dst, 64, w, vec);
}

// min(limit - start, kMax) clipped at 0: how many bytes of a run exist.
WPREP_HD int64_t ValidBytes(int64_t start, int64_t limit, int64_t max) {
  const int64_t v = limit - start;
  return v < 0 ? 0 : (v > max ? max : v);
}

}  // namespace wprep::tiles

#endif  // WPREP_KERNELS_SRC_TILE_COMMON_H_
