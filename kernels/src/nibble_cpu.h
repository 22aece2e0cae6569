// The nibble transpose on the CPU: the move the Blackwell value layouts make from and to
// canonical storage, whose packed axis is not theirs.
//
// With X a byte matrix packed along its rows (nibble j of row i is X(i, j)), its nibble
// transpose Y has Y byte (n, k) = X(2k, n) | X(2k + 1, n) << 4: the storage of the
// transposed logical matrix, packed the other way, and applying it twice gives X back.
// A block is 32 X rows x 16 bytes (32 nibbles) <-> 32 Y rows x 16 bytes. Byte j of X rows
// 2k and 2k + 1 gives Y(2j, k) from their low nibbles and Y(2j + 1, k) from their high
// ones (masks and shifts), and a 16x16 byte transpose each of those "even" and "odd" sets
// puts n on the rows: in SSE2 registers, or both sets at once in the two lanes of AVX2
// registers where the CPU has AVX2 (the engine's tiles emulate a GPU block byte by byte).
#ifndef WPREP_KERNELS_SRC_NIBBLE_CPU_H_
#define WPREP_KERNELS_SRC_NIBBLE_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel.h"
#include "layout_math.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wprep::cpu_nibble {

inline constexpr int kBlockRows = 32;   // X rows (16 Y bytes) and Y rows (16 X bytes)
inline constexpr int kBlockBytes = 16;

// Rows a fixed step apart, indexed like a pointer array.
template <class Byte>
struct RowsAt {
  Byte* first;
  int64_t step;
  Byte* operator[](int i) const { return first + i * step; }
};

// The scalar definition of a block (and the path of CPUs without SSE2).
inline void BlockScalar(const uint8_t* const* src, uint8_t* const* dst) {
  for (int n = 0; n < kBlockRows; ++n) {
    for (int k = 0; k < kBlockBytes; ++k) {
      const int shift = 4 * (n & 1);
      const uint32_t lo = (src[2 * k][n >> 1] >> shift) & 15, hi = (src[2 * k + 1][n >> 1] >> shift) & 15;
      dst[n][k] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}

#if defined(__SSE2__)
// x[i] byte j -> x[j] byte i. Each round maps (row i, byte j) to (row 2(i mod 8) + j/8,
// byte 2(j mod 8) + i/8): its 8-bit index (i:j) rotated left by one, so four rounds swap
// the halves.
inline void Transpose16x16(__m128i x[16]) {
  for (int round = 0; round < 4; ++round) {
    __m128i y[16];
    for (int i = 0; i < 8; ++i) {
      y[2 * i] = _mm_unpacklo_epi8(x[i], x[i + 8]);
      y[2 * i + 1] = _mm_unpackhi_epi8(x[i], x[i + 8]);
    }
    for (int i = 0; i < 16; ++i) x[i] = y[i];
  }
}

// One block: src[i] points at 16 bytes of X row i (i < 32), dst[n] at 16 bytes of Y row n.
// Byte j of X rows 2k and 2k + 1 gives Y(2j, k) (the low nibbles) and Y(2j + 1, k) (the
// high ones): 16 such "even" rows over j and 16 "odd" ones, each set one 16x16 transpose.
template <class Src, class Dst>
inline void BlockSse2(Src src, Dst dst) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i even[16], odd[16];
  for (int k = 0; k < 16; ++k) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k]));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k + 1]));
    even[k] = _mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(b, low), 4));
    odd[k] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_andnot_si128(low, b));
  }
  Transpose16x16(even);
  Transpose16x16(odd);
  for (int j = 0; j < 16; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[2 * j]), even[j]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[2 * j + 1]), odd[j]);
  }
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WPREP_NIBBLE_AVX2 1
// BlockSse2 with the even rows in the low 128-bit lane and the odd rows in the high one:
// AVX2's byte unpacks work per lane, so one 16x16 transpose of 256-bit rows makes both,
// and per-lane shift counts make the even and odd bytes without a shuffle.
template <class Src, class Dst>
__attribute__((target("avx2"))) inline void BlockAvx2(Src src, Dst dst) {
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(static_cast<char>(0xF0));
  const __m256i shift_a = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i shift_b = _mm256_setr_epi32(4, 4, 4, 4, 0, 0, 0, 0);
  __m256i x[16];
  for (int k = 0; k < 16; ++k) {
    const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k])));
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[2 * k + 1])));
    x[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(a, shift_a), low),
                           _mm256_and_si256(_mm256_sllv_epi32(b, shift_b), high));
  }
  for (int round = 0; round < 4; ++round) {
    __m256i y[16];
    for (int i = 0; i < 8; ++i) {
      y[2 * i] = _mm256_unpacklo_epi8(x[i], x[i + 8]);
      y[2 * i + 1] = _mm256_unpackhi_epi8(x[i], x[i + 8]);
    }
    for (int i = 0; i < 16; ++i) x[i] = y[i];
  }
  for (int j = 0; j < 16; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[2 * j]), _mm256_castsi256_si128(x[j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[2 * j + 1]), _mm256_extracti128_si256(x[j], 1));
  }
}

inline bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// `src` and `dst` give the rows: pointer arrays, or RowsAt (a first row and a step), which
// spares a block the 64 pointers of the arrays.
template <class Src, class Dst>
inline void Block(Src src, Dst dst) {
#if defined(WPREP_NIBBLE_AVX2)
  if (HasAvx2()) {
    BlockAvx2(src, dst);
    return;
  }
#endif
#if defined(__SSE2__)
  BlockSse2(src, dst);
#else
  const uint8_t* xs[kBlockRows];
  uint8_t* ys[kBlockRows];
  for (int i = 0; i < kBlockRows; ++i) {
    xs[i] = src[i];
    ys[i] = dst[i];
  }
  BlockScalar(xs, ys);
#endif
}

// A block at an edge: X rows [0, x_rows) and bytes [0, x_bytes) of the given pointers are
// read, Y rows [0, y_rows) and bytes [0, y_bytes) written; the rest of X reads as zeros.
inline void EdgeBlock(const uint8_t* const* src, int x_rows, int x_bytes, uint8_t* const* dst, int y_rows,
                      int y_bytes) {
  alignas(16) uint8_t xs[kBlockRows][kBlockBytes] = {};
  alignas(16) uint8_t ys[kBlockRows][kBlockBytes];
  const uint8_t* xp[kBlockRows];
  uint8_t* yp[kBlockRows];
  for (int i = 0; i < kBlockRows; ++i) {
    if (i < x_rows && x_bytes > 0) std::memcpy(xs[i], src[i], static_cast<size_t>(x_bytes));
    xp[i] = xs[i];
    yp[i] = ys[i];
  }
  Block(xp, yp);
  for (int n = 0; n < y_rows; ++n) {
    if (y_bytes > 0) std::memcpy(dst[n], ys[n], static_cast<size_t>(y_bytes));
  }
}

// ---------------------------------------------------------------------------------------
// Blackwell value layouts from and to canonical storage ([K, N/2], packed along N). The
// storage (any tiling: shuffled tiles, blackwell_value rows) holds byte (n, k) =
// nib(2k, n) | nib(2k + 1, n) << 4: Y of the canonical X. A unit is a block of 64 n of one
// matrix, all of K, so the canonical rows are read 32 bytes at a time and each storage row
// is written front to back.

// 16-byte runs along K must stay in one tile (tile_k a multiple of 16, or one tile along K)
// and a block's first n must start a canonical byte (N even, as canonical storage needs).
inline bool ServesBlackwell(const Geometry& g) {
#if defined(__SSE2__)
  const BlackwellTiling* t = g.op == Op::kBlackwellSwizzle     ? &g.out_tiling
                             : g.op == Op::kBlackwellUnswizzle ? &g.in_tiling
                                                               : nullptr;
  return t != nullptr && (t->tile_k % kBlockBytes == 0 || t->ntk == 1) && g.n % 2 == 0;
#else
  (void)g;
  return false;
#endif
}

// 128 n: 64 bytes of each canonical row a unit, so threads rarely share a line.
inline constexpr int64_t kBlackwellUnitN = 4 * kBlockRows;

inline int64_t BlackwellUnitCount(const Geometry& g) {
  const BlackwellTiling& t = g.op == Op::kBlackwellSwizzle ? g.out_tiling : g.in_tiling;
  return g.num_matrices * CeilDiv(t.ntn * t.tile_n, kBlackwellUnitN);
}

// Storage rows n0 .. n0 + rows - 1 at byte k0 as one run (a first row and a step) when they
// share a tile (false: they do not).
template <class Byte>
bool StorageRun(const BlackwellTiling& t, const int64_t* strides, Byte* base, int64_t n0, int rows, int64_t k0,
                RowsAt<Byte>* run) {
  const int64_t in_tile = n0 - static_cast<int64_t>(t.div_n.Div(static_cast<uint32_t>(n0))) * t.tile_n;
  if (in_tile + rows > t.tile_n) return false;
  *run = {base + BlackwellOffset(t, strides, n0, k0), strides == nullptr ? t.tile_k : strides[2]};
  return true;
}

// Pointers to storage rows n0 .. n0 + rows - 1 at byte k0 (in one tile along K): the run's
// rows when they share a tile, else row by row; pointers past `rows` repeat the last row.
template <class Byte>
void StorageRows(const BlackwellTiling& t, const int64_t* strides, Byte* base, int64_t n0, int rows, int64_t k0,
                 Byte** p) {
  RowsAt<Byte> run;
  if (StorageRun(t, strides, base, n0, rows, k0, &run)) {
    for (int i = 0; i < kBlockRows; ++i) p[i] = run[std::min(i, rows - 1)];
    return;
  }
  for (int i = 0; i < kBlockRows; ++i) p[i] = base + BlackwellOffset(t, strides, n0 + std::min(i, rows - 1), k0);
}

inline void Prefetch(const void* p) {
#if defined(__SSE2__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// Units [begin, end) of a Blackwell swizzle or unswizzle that ServesBlackwell. A unit is
// 128 n of one matrix, all of K, taken 16 bytes along K at a time: its 64-byte lines of
// the canonical side's 32 rows, and 16 bytes of 128 storage rows. Neither side's lines
// come in order (rows are K or N bytes apart), so the input of the step kPrefetchSteps on
// is fetched ahead.
inline constexpr int kPrefetchSteps = 4;

#if defined(__SSE2__)
// Four whole blocks along K (32 canonical rows x 16 bytes at k0, k0 + 16, k0 + 32, k0 + 48)
// staged, then the 32 storage rows' 64 bytes, 2 KiB in a row where a tile is 64 bytes along
// K (blackwell_shuffled_value's default), written with streaming stores: an output not read
// back costs no read for ownership. Rows further apart (blackwell_value's whole-K rows)
// measured slower streamed and keep ordinary stores.
inline void StreamBlocks4(RowsAt<const uint8_t> src, int64_t src_step16, RowsAt<uint8_t> dst) {
  alignas(64) uint8_t staged[kBlockRows * 64];
  for (int q = 0; q < 4; ++q) {
    Block(RowsAt<const uint8_t>{src.first + q * src_step16, src.step}, RowsAt<uint8_t>{staged + 16 * q, 64});
  }
  for (int i = 0; i < kBlockRows; ++i) {
    for (int q = 0; q < 4; ++q) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst[i] + 16 * q),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(staged + 64 * i + 16 * q)));
    }
  }
}
#endif

inline void BlackwellUnits(const Geometry& g, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const bool swizzle = g.op == Op::kBlackwellSwizzle;
  const BlackwellTiling& t = swizzle ? g.out_tiling : g.in_tiling;
  const int64_t n_all = t.ntn * t.tile_n;  // storage rows, padding included
  const int64_t per_matrix = CeilDiv(n_all, kBlackwellUnitN);
  const int64_t crow = swizzle ? g.in_stride[0] : g.d1b;  // canonical row stride
  const int64_t step = t.ntk == 1 ? t.kpad : t.tile_k;     // bytes along K inside one tile
#if defined(__SSE2__)
  // Swizzles of outputs this large go out with streaming stores where 32 storage rows of
  // 64 bytes are one run: tiles 64 bytes along K, of whole blocks of rows (so no block
  // straddles two), at 16-byte aligned offsets of an aligned output; the units of whole
  // blocks inside N, the others (N's edge) by the blocks below.
  const bool stream = swizzle && static_cast<uint64_t>(g.num_matrices * g.out_matrix_bytes) >= cpu::kStreamingBytes &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0 && t.tile_k == 64 && step == 64 &&
                      t.tile_n % kBlockRows == 0;
  bool streamed = false;
#endif
  for (int64_t u = begin; u < end; ++u) {
    const int64_t e = u / per_matrix, first_n = (u - e * per_matrix) * kBlackwellUnitN;
    const int64_t last_n = std::min(n_all, first_n + kBlackwellUnitN);
#if defined(__SSE2__)
    const bool stream_unit = stream && last_n - first_n == kBlackwellUnitN && last_n <= g.n;
#endif
    const uint8_t* src_m = in + g.InputMatrixOffset(e);
    uint8_t* dst_m = out + e * g.out_matrix_bytes;
    auto canonical = [&](auto* base, int64_t k0, int64_t n0, auto** rows) {
      for (int i = 0; i < kBlockRows; ++i) rows[i] = base + std::min<int64_t>(2 * k0 + i, 2 * g.kp - 1) * crow + n0 / 2;
    };
    for (int64_t k0 = 0; k0 < t.kpad;) {
#if defined(__SSE2__)
      if (stream_unit && k0 % 64 == 0 && k0 + 64 <= g.kp) {
        for (int q = 0; q < 4; ++q) {
          const int64_t ahead = 2 * (k0 + 16 * q + kPrefetchSteps * kBlockBytes);
          for (int64_t r = ahead; r < std::min(ahead + kBlockRows, 2 * g.kp); ++r) Prefetch(src_m + r * crow + first_n / 2);
        }
        for (int64_t n0 = first_n; n0 < last_n; n0 += kBlockRows) {
          StreamBlocks4(RowsAt<const uint8_t>{src_m + 2 * k0 * crow + n0 / 2, crow}, 32 * crow,
                        RowsAt<uint8_t>{dst_m + BlackwellOffset(t, nullptr, n0, k0), 64});  // rows of one tile
        }
        streamed = true;
        k0 += 64;
        continue;
      }
#endif
      // Inside one tile along K: a block is at most the rest of the tile.
      const int k_bytes = static_cast<int>(std::min<int64_t>({kBlockBytes, t.kpad - k0, step - k0 % step}));
      const int k_valid = static_cast<int>(std::clamp<int64_t>(g.kp - k0, 0, k_bytes));
      if (!swizzle && k_valid == 0) break;
      if (swizzle) {
        const int64_t ahead = 2 * (k0 + kPrefetchSteps * kBlockBytes);
        for (int64_t r = ahead; r < std::min(ahead + kBlockRows, 2 * g.kp); ++r) Prefetch(src_m + r * crow + first_n / 2);
      }
      for (int64_t n0 = first_n; n0 < last_n; n0 += kBlockRows) {
        const int n_rows = static_cast<int>(std::min<int64_t>(kBlockRows, n_all - n0));  // storage rows here
        const int n_valid = static_cast<int>(std::clamp<int64_t>(g.n - n0, 0, n_rows));   // of them inside N
        if (!swizzle && n_valid == 0) break;
        const uint8_t* xs[kBlockRows];
        uint8_t* ys[kBlockRows];
        const bool full = n_valid == kBlockRows && k_valid == kBlockBytes;
        if (full) {  // whole blocks whose storage rows share a tile: both sides as runs
          RowsAt<const uint8_t> x_run;
          RowsAt<uint8_t> y_run;
          if (swizzle && StorageRun(t, static_cast<const int64_t*>(nullptr), dst_m, n0, kBlockRows, k0, &y_run)) {
            Block(RowsAt<const uint8_t>{src_m + 2 * k0 * crow + n0 / 2, crow}, y_run);
            continue;
          }
          if (!swizzle && StorageRun(t, g.in_stride, src_m, n0, kBlockRows, k0, &x_run)) {
            if (k0 % 64 == 0) {
              for (int i = 0; i < kBlockRows; ++i) Prefetch(x_run[i] + kPrefetchSteps * kBlockBytes);
            }
            Block(x_run, RowsAt<uint8_t>{dst_m + 2 * k0 * crow + n0 / 2, crow});
            continue;
          }
        }
        if (swizzle) {  // X canonical rows 2k0 .., bytes n0/2 ..; Y storage rows n0 .., bytes k0 ..
          canonical(src_m, k0, n0, xs);
          StorageRows(t, static_cast<const int64_t*>(nullptr), dst_m, n0, n_rows, k0, ys);
          full ? Block(xs, ys) : EdgeBlock(xs, 2 * k_valid, n_valid / 2, ys, n_rows, k_bytes);
        } else {  // X storage rows; Y canonical
          StorageRows(t, g.in_stride, src_m, n0, n_valid, k0, xs);
          if (k0 % 64 == 0) {
            for (int i = 0; i < n_valid; ++i) Prefetch(xs[i] + kPrefetchSteps * kBlockBytes);
          }
          canonical(dst_m, k0, n0, ys);
          full ? Block(xs, ys) : EdgeBlock(xs, n_valid, k_valid, ys, 2 * k_valid, n_valid / 2);
        }
      }
      k0 += k_bytes;
    }
  }
#if defined(__SSE2__)
  if (streamed) _mm_sfence();  // the streamed lines land before the caller's threads join
#endif
}

}  // namespace wprep::cpu_nibble

#endif  // WPREP_KERNELS_SRC_NIBBLE_CPU_H_
