// The layout mappings of LAYOUTS.md, written once. Every function here is
// __host__ __device__: the planner, the CPU engine, the CUDA kernels and the tests all
// call these, so there is one definition of each mapping to get right.
//
// Conventions: "canonical" is MXFP4 storage [..., D0, D1/2] (two FP4 codes per byte,
// even column in the low nibble). Hopper's Q matrix, placement and bit interleave follow
// LAYOUTS.md steps 1-4; Blackwell storage is [E, ntk, ntn, tile_n, tile_k] bytes.
#ifndef WPREP_KERNELS_SRC_LAYOUT_MATH_H_
#define WPREP_KERNELS_SRC_LAYOUT_MATH_H_

#include <cstdint>

#if defined(__CUDACC__)
#define WPREP_HD __host__ __device__ __forceinline__
#else
#define WPREP_HD inline
#endif

// Full unrolling of constant-trip loops in device code (register arrays must be indexed
// with constants); host compilers decide for themselves.
#if defined(__CUDA_ARCH__)
#define WPREP_UNROLL _Pragma("unroll")
#else
#define WPREP_UNROLL
#endif

namespace wprep {

// Most dims a tensor may have (leading dims included).
inline constexpr int kMaxRank = 8;

// CUDA threads per tile (tiles.h).
inline constexpr int kTileThreads = 256;

WPREP_HD constexpr int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
WPREP_HD constexpr int64_t CeilDiv(int64_t x, int64_t a) { return (x + a - 1) / a; }

// Greatest common divisor, >= 0, as std::gcd (Gcd(0, b) = |b|): the one the planner's
// alignments, the tilings and the engines' access choice all use. Host and device.
WPREP_HD constexpr int64_t Gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a < 0 ? -a : a;
}

// ---------------------------------------------------------------------------------------
// Nibbles.

// FP4 code `nibble` (0 or 1) of byte b.
WPREP_HD constexpr uint32_t Nibble(uint32_t b, uint32_t nibble) {
  return (b >> (4 * nibble)) & 15u;
}

// The 2x2 nibble transpose shared by Hopper mx_axis -2 and Blackwell: from bytes `a`
// (codes of one row pair's first row) and `b` (second row), the byte holding nibble
// `which` of each: low nibble from a, high nibble from b.
WPREP_HD constexpr uint8_t PairNibbles(uint32_t a, uint32_t b, uint32_t which) {
  return static_cast<uint8_t>(Nibble(a, which) | Nibble(b, which) << 4);
}

// Logical value (i, j) of one matrix from the bytes that hold it, for the two orders a
// value layout's canonical side may take (LAYOUTS.md, "packing axis"): packing -1 rows
// are i, pairs along j; packing -2 (checkpoint order) rows are j, pairs along i.
// `row_stride` is the byte distance between rows. These define what every conversion's
// canonical side means; the per-byte definitions below take them as `nib(i, j)`.
WPREP_HD uint32_t Packing1Nibble(const uint8_t* m, int64_t row_stride, int64_t i, int64_t j) {
  return Nibble(m[i * row_stride + j / 2], static_cast<uint32_t>(j & 1));
}
WPREP_HD uint32_t Packing2Nibble(const uint8_t* m, int64_t row_stride, int64_t i, int64_t j) {
  return Nibble(m[j * row_stride + i / 2], static_cast<uint32_t>(i & 1));
}

// ---------------------------------------------------------------------------------------
// Hopper value layout.

// Padding granularity of the Q matrix (LAYOUTS.md step 2).
inline constexpr int64_t kHopperRowAlign = 256;
inline constexpr int64_t kHopperColAlign = 64;

// The storage geometry of one matrix (LAYOUTS.md steps 1, 2 and 5): Q's extent before
// and after padding, and the storage matrix O in memory (out_rows x out_cols bytes,
// row-major, whatever shape is reported).
struct HopperTiling {
  int64_t q_rows = 0, q_cols = 0;      // Q: rows along the non-mx axis, bytes along mx
  int64_t rows_pad = 0, cols_pad = 0;  // R, C
  int64_t out_rows = 0, out_cols = 0;  // R/4, 4C
};

// Logical matrix [d0, d1] (FP4 values) with the mx axis `mx_axis` (-1 or -2).
WPREP_HD HopperTiling MakeHopperTiling(int mx_axis, int64_t d0, int64_t d1) {
  HopperTiling t;
  t.q_rows = mx_axis == -1 ? d0 : d1;
  t.q_cols = mx_axis == -1 ? d1 / 2 : d0 / 2;
  t.rows_pad = RoundUp(t.q_rows, kHopperRowAlign);
  t.cols_pad = RoundUp(t.q_cols, kHopperColAlign);
  t.out_rows = t.rows_pad / 4;
  t.out_cols = 4 * t.cols_pad;
  return t;
}

// Step 3: byte Q[r, c] goes to O[*orow, *ocol]. T is any signed integer type; the map
// commutes with translation by multiples of 16 rows and 32 columns.
template <class T>
WPREP_HD void HopperPlace(T r, T c, int mma_version, T* orow, T* ocol) {
  const T r0 = r >> 4, w0 = (r >> 3) & 1, t0 = (r >> 1) & 3, s0 = r & 1;
  const T cr = c >> 5;
  *orow = 4 * r0 + t0;
  if (mma_version == 2) {
    const T w1 = (c >> 4) & 1, t1 = (c >> 2) & 3, d = c & 3;
    *ocol = 128 * cr + 64 * s0 + 16 * t1 + 8 * w1 + 4 * w0 + d;
  } else {
    const T k = (c >> 3) & 3, w1 = (c >> 2) & 1, t1 = c & 3;
    *ocol = 128 * cr + 64 * s0 + 16 * t1 + 4 * k + 2 * w1 + w0;
  }
}

// Inverse of HopperPlace: which Q[*r, *c] lands at O[orow, ocol].
template <class T>
WPREP_HD void HopperSource(T orow, T ocol, int mma_version, T* r, T* c) {
  const T r0 = orow >> 2, t0 = orow & 3;
  const T cr = ocol >> 7, s0 = (ocol >> 6) & 1, t1 = (ocol >> 4) & 3;
  T w0, w1;
  if (mma_version == 2) {
    w1 = (ocol >> 3) & 1;
    w0 = (ocol >> 2) & 1;
    *c = 32 * cr + 16 * w1 + 4 * t1 + (ocol & 3);
  } else {
    const T k = (ocol >> 2) & 3;
    w1 = (ocol >> 1) & 1;
    w0 = ocol & 1;
    *c = 32 * cr + 8 * k + 4 * w1 + t1;
  }
  *r = 16 * r0 + 8 * w0 + 2 * t0 + s0;
}

// Step 4 as LAYOUTS.md writes it: the storage word of four consecutive O bytes
// o = b0 | b1 << 8 | b2 << 16 | b3 << 24. The definition the word-level forms below are
// tested against.
WPREP_HD constexpr uint32_t HopperInterleaveWord(uint32_t o) {
  auto s = [](uint32_t n) { return ((n & 8) << 12) | ((n & 7) << 6); };
  auto s4 = [](uint32_t n) { return ((n & 8) << 11) | ((n & 6) << 9) | ((n & 1) << 13); };
  auto f = [&](uint32_t b) { return s(b & 15) | s(b >> 4) << 16; };
  auto g = [&](uint32_t b) { return s4(b & 15) | s4(b >> 4) << 16; };
  return f(o & 255) | f((o >> 8) & 255) >> 3 | f((o >> 16) & 255) >> 6 | g(o >> 24);
}

// Its inverse, read off the formula: in each 16-bit half of W, bits 0-2 are bits 0-2 of
// b2's code, 3-5 of b1's, 6-8 of b0's; bit 9 is b2's bit 3, 10-11 b3's bits 1-2, 12 b1's
// bit 3, 13 b3's bit 0, 14 b3's bit 3 and 15 b0's bit 3 (low half: low nibbles).
WPREP_HD constexpr uint32_t HopperDeinterleaveWord(uint32_t w) {
  auto codes = [](uint32_t h) {  // the four codes of one half, b0's in bits 0-3
    const uint32_t n0 = ((h >> 6) & 7) | ((h >> 12) & 8);
    const uint32_t n1 = ((h >> 3) & 7) | ((h >> 9) & 8);
    const uint32_t n2 = (h & 7) | ((h >> 6) & 8);
    const uint32_t n3 = ((h >> 13) & 1) | ((h >> 9) & 6) | ((h >> 11) & 8);
    return n0 | n1 << 8 | n2 << 16 | n3 << 24;
  };
  return codes(w & 0xFFFF) | codes(w >> 16) << 4;
}

// Step 1: byte Q[r, c] of one matrix whose logical values are nib(i, j); 0 in the padding.
template <class Nib>
WPREP_HD uint32_t HopperQByte(const Nib& nib, int mx_axis, const HopperTiling& t, int64_t r,
                              int64_t c) {
  if (r >= t.q_rows || c >= t.q_cols) return 0;
  return mx_axis == -1 ? nib(r, 2 * c) | nib(r, 2 * c + 1) << 4
                       : nib(2 * c, r) | nib(2 * c + 1, r) << 4;
}

// Steps 1-4 byte by byte: the storage word at O row `orow`, bytes 4*wc .. 4*wc + 3, of
// one matrix whose logical values are nib(i, j).
template <class Nib>
WPREP_HD uint32_t HopperStorageWord(const Nib& nib, int mx_axis, int mma_version,
                                    const HopperTiling& t, int64_t orow, int64_t wc) {
  uint32_t o = 0;
  for (int i = 0; i < 4; ++i) {
    int64_t r = 0, c = 0;
    HopperSource<int64_t>(orow, 4 * wc + i, mma_version, &r, &c);
    o |= HopperQByte(nib, mx_axis, t, r, c) << (8 * i);
  }
  return HopperInterleaveWord(o);
}

// The other way: logical value (i, j) of a matrix is nibble *nibble of O byte
// (*orow, *ocol) before the interleave (unswizzle reads it back through
// HopperDeinterleaveWord of the word holding that byte).
WPREP_HD void HopperValuePosition(int mx_axis, int mma_version, int64_t i, int64_t j,
                                  int64_t* orow, int64_t* ocol, uint32_t* nibble) {
  const int64_t r = mx_axis == -1 ? i : j, c = mx_axis == -1 ? j / 2 : i / 2;
  *nibble = static_cast<uint32_t>(mx_axis == -1 ? j & 1 : i & 1);
  HopperPlace<int64_t>(r, c, mma_version, orow, ocol);
}

// Step 4: four consecutive bytes b0..b3 of an O row become the interleaved word
// W = f(b0) | f(b1) >> 3 | f(b2) >> 6 | g(b3) (LAYOUTS.md), a fixed permutation of their
// bits. The low nibbles of b0..b3 all end in the low half of W and the high nibbles in the
// high half. Gathered in the order G = (lo b2, lo b1, lo b3, lo b0, hi b2, hi b1, hi b3,
// hi b0) (nibbles from bit 0 up), every field of W moves by one of seven shifts: 13
// instructions, where moving the fields from b0..b3 in place takes about 21. The
// word-level forms below build G with nibble pairs and byte permutes, often merged with
// the placement (step 3). Checked bit for bit against the formula in
// tests/kernels/cpu_engine_test.cc (host) and by the GPU golden tests (device).

// W from the gathered word G above. `Word` is uint32_t, or on the CPU a vector of them
// (GCC's vector extensions), each lane a word of its own; the ...At forms work in place.
// In place, and by reference: a 32-byte vector passed by value would take AVX's ABI.
template <class Word>
WPREP_HD void HopperInterleaveGatheredAt(Word* w) {
  const Word g = *w;
  *w = (g & 0x80078007u) | ((g >> 6) & 0x01C001C0u) | ((g >> 1) & 0x00380038u) | ((g << 5) & 0x30003000u) |
       ((g << 6) & 0x02000200u) | ((g << 1) & 0x0C000C00u) | ((g << 3) & 0x40004000u);
}
WPREP_HD uint32_t HopperInterleaveGathered(uint32_t g) {
  HopperInterleaveGatheredAt(&g);
  return g;
}

// Its inverse: W -> G.
template <class Word>
WPREP_HD void HopperDeinterleaveGatheredAt(Word* g) {
  const Word w = *g;
  *g = (w & 0x80078007u) | ((w << 6) & 0x70007000u) | ((w << 1) & 0x00700070u) | ((w >> 5) & 0x01800180u) |
       ((w >> 6) & 0x00080008u) | ((w >> 1) & 0x06000600u) | ((w >> 3) & 0x08000800u);
}
WPREP_HD uint32_t HopperDeinterleaveGathered(uint32_t w) {
  HopperDeinterleaveGatheredAt(&w);
  return w;
}

// ---------------------------------------------------------------------------------------
// Word-level forms of the mappings above, used by the fast tiles. Each is checked
// against the per-byte definitions in tests/kernels/cpu_engine_test.cc.

// CUDA's __byte_perm: result byte i is byte sel[i] (0-7) of the 8 bytes {b:a}.
WPREP_HD uint32_t BytePerm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    r |= static_cast<uint32_t>((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  }
  return r;
#endif
}

// Transpose4x4Bytes without a byte permute (the host's form): swap the off-diagonal bytes
// of each 2x2 block of bytes, then the off-diagonal 16-bit halves of each 2x2 block of
// halves (delta swaps). `Word` as for HopperInterleaveGatheredAt.
template <class Word>
WPREP_HD void Transpose4x4BytesBySwaps(Word* w) {
  auto swap = [](Word& lo, Word& hi, int shift, uint32_t mask) {
    const Word t = ((lo >> shift) ^ hi) & mask;
    hi ^= t;
    lo ^= t << shift;
  };
  swap(w[0], w[1], 8, 0x00FF00FFu);
  swap(w[2], w[3], 8, 0x00FF00FFu);
  swap(w[0], w[2], 16, 0x0000FFFFu);
  swap(w[1], w[3], 16, 0x0000FFFFu);
}

// Transposes the 4x4 byte matrix whose rows are w[0..3]: afterwards byte j of w[i] is
// what byte i of w[j] was.
WPREP_HD void Transpose4x4Bytes(uint32_t* w) {
#if defined(__CUDA_ARCH__)
  const uint32_t t0 = BytePerm(w[0], w[1], 0x5140), t1 = BytePerm(w[0], w[1], 0x7362);
  const uint32_t t2 = BytePerm(w[2], w[3], 0x5140), t3 = BytePerm(w[2], w[3], 0x7362);
  w[0] = BytePerm(t0, t2, 0x5410);
  w[1] = BytePerm(t0, t2, 0x7632);
  w[2] = BytePerm(t1, t3, 0x5410);
  w[3] = BytePerm(t1, t3, 0x7632);
#else
  Transpose4x4BytesBySwaps(w);
#endif
}

// PairNibbles on every byte of two words: byte i of *e is the low nibble of byte i of x
// | the low nibble of byte i of y << 4, *o the same of the high nibbles. An involution:
// PairNibbleWords(*e, *o) gives back x and y.
template <class Word>
WPREP_HD void PairNibbleWordsOf(const Word& x, const Word& y, Word* e, Word* o) {
  *e = (x & 0x0F0F0F0Fu) | ((y << 4) & 0xF0F0F0F0u);
  *o = ((x >> 4) & 0x0F0F0F0Fu) | (y & 0xF0F0F0F0u);
}
WPREP_HD void PairNibbleWords(uint32_t x, uint32_t y, uint32_t* e, uint32_t* o) { PairNibbleWordsOf(x, y, e, o); }

// The interleaved words of two O words a and b at once, through the gathered form.
WPREP_HD void HopperInterleaveWordPair(uint32_t a, uint32_t b, uint32_t* wa, uint32_t* wb) {
  uint32_t e, o;  // bytes 0-1: G of a, bytes 2-3: G of b; e the low half, o the high
  PairNibbleWords(BytePerm(a, b, 0x7632), BytePerm(a, b, 0x4501), &e, &o);
  *wa = HopperInterleaveGathered(BytePerm(e, o, 0x5410));
  *wb = HopperInterleaveGathered(BytePerm(e, o, 0x7632));
}

// Its inverse.
WPREP_HD void HopperDeinterleaveWordPair(uint32_t wa, uint32_t wb, uint32_t* a, uint32_t* b) {
  const uint32_t ga = HopperDeinterleaveGathered(wa), gb = HopperDeinterleaveGathered(wb);
  uint32_t x, y;  // x: bytes b2, b3 of a then of b; y: bytes b1, b0 of a then of b
  PairNibbleWords(BytePerm(ga, gb, 0x5410), BytePerm(ga, gb, 0x7632), &x, &y);
  *a = BytePerm(x, y, 0x1045);
  *b = BytePerm(x, y, 0x3267);
}

// The PairNibbles transpose on an 8x4-byte micro-tile. in[r] holds 4 bytes (columns
// j..j+3) of row r; out[m] holds 4 bytes of "row" m, where
//   byte t of out[2p + h] = PairNibbles(byte p of in[2t], byte p of in[2t + 1], h).
// With canonical rows 2k..2k+7 in, out is Blackwell storage rows n = 2j..2j+7 at bytes
// k..k+3 (and Hopper mx_axis -2's Q rows at columns k..k+3). It is an involution.
WPREP_HD void PairTranspose8x4(const uint32_t* in, uint32_t* out) {
  uint32_t e[4], o[4];
  WPREP_UNROLL
  for (int t = 0; t < 4; ++t) PairNibbleWords(in[2 * t], in[2 * t + 1], &e[t], &o[t]);
  Transpose4x4Bytes(e);
  Transpose4x4Bytes(o);
  WPREP_UNROLL
  for (int p = 0; p < 4; ++p) {
    out[2 * p] = e[p];
    out[2 * p + 1] = o[p];
  }
}

// Quarter k (0-3) of HopperPackBlock, from four words of q0 and four of q1: mma 2 makes
// out[4k .. 4k+3] (o[0..3], 16 contiguous bytes), mma 3 makes out[4*t1 + k] (o[t1]). Four
// threads can pack a block between them.
template <int kMma>
WPREP_HD void HopperPackQuarter(const uint32_t* q0, const uint32_t* q1, int k, uint32_t* o) {
  if constexpr (kMma == 2) {
    // ocol = 16*t1 + 8*w1 + 4*w0 + d  <-  c = 16*w1 + 4*t1 + d: whole Q words; t1 = k.
    HopperInterleaveWordPair(q0[k], q1[k], &o[0], &o[1]);
    HopperInterleaveWordPair(q0[4 + k], q1[4 + k], &o[2], &o[3]);
  } else {
    // ocol = 16*t1 + 4*k + 2*w1 + w0  <-  c = 8*k + 4*w1 + t1: out[4*t1 + k] has bytes
    // b0..b3 = byte t1 of q0[2k], q1[2k], q0[2k + 1], q1[2k + 1]. Its gathered word G
    // is byte t1 of each of w[0..3] below.
    uint32_t w[4];
    PairNibbleWords(q0[2 * k + 1], q1[2 * k], &w[0], &w[2]);
    PairNibbleWords(q1[2 * k + 1], q0[2 * k], &w[1], &w[3]);
    Transpose4x4Bytes(w);
    WPREP_UNROLL
    for (int t1 = 0; t1 < 4; ++t1) o[t1] = HopperInterleaveGathered(w[t1]);
  }
}

// One 64-byte block of a Hopper O row: O[orow, 128*cr + 64*s0 + 0..63], orow = 4*r0 + t0.
// Its bytes come from two 32-byte pieces of Q: q0 = Q[16*r0 + 2*t0 + s0, 32*cr + 0..31]
// and q1 = the row 8 below (w0 = 1), each as 8 little-endian words. Pack places and
// interleaves (steps 3-4) into out[16]; Unpack is its inverse.
template <int kMma>
WPREP_HD void HopperPackBlock(const uint32_t* q0, const uint32_t* q1, uint32_t* out) {
  WPREP_UNROLL
  for (int k = 0; k < 4; ++k) {
    uint32_t o[4];
    HopperPackQuarter<kMma>(q0, q1, k, o);
    WPREP_UNROLL
    for (int i = 0; i < 4; ++i) out[kMma == 2 ? 4 * k + i : 4 * i + k] = o[i];
  }
}

template <int kMma>
WPREP_HD void HopperUnpackBlock(const uint32_t* in, uint32_t* q0, uint32_t* q1) {
  if constexpr (kMma == 2) {
    WPREP_UNROLL
    for (int t1 = 0; t1 < 4; ++t1) {
      WPREP_UNROLL
      for (int w1 = 0; w1 < 2; ++w1) {
        HopperDeinterleaveWordPair(in[4 * t1 + 2 * w1], in[4 * t1 + 2 * w1 + 1], &q0[4 * w1 + t1],
                                   &q1[4 * w1 + t1]);
      }
    }
  } else {
    WPREP_UNROLL
    for (int k = 0; k < 4; ++k) {
      uint32_t w[4];
      WPREP_UNROLL
      for (int t1 = 0; t1 < 4; ++t1) w[t1] = HopperDeinterleaveGathered(in[4 * t1 + k]);
      Transpose4x4Bytes(w);
      PairNibbleWords(w[0], w[2], &q0[2 * k + 1], &q1[2 * k]);
      PairNibbleWords(w[1], w[3], &q1[2 * k + 1], &q0[2 * k]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Hopper mx_axis -2 straight from canonical words. For mx_axis -2 the two nibbles of a Q
// byte come from two canonical rows, and they end in the two halves of W, so the O
// words are built from canonical nibbles without forming Q.

// Eight O words from eight canonical words. O word (t0, s0) -> out[2*t0 + s0] takes
// nibble s0 of byte t0 of every input word: of x[0..3] for (lo b2, lo b3, hi b2, hi b3)
// and of y[0..3] for (lo b1, lo b0, hi b1, hi b0). Which canonical rows and columns those
// are depends on mma_version (HopperMxAcrossPackingTile in fast_tiles.h).
WPREP_HD void HopperInterleaveCanonical(const uint32_t* x, const uint32_t* y, uint32_t* out) {
  uint32_t e[4], o[4];
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) PairNibbleWords(x[i], y[i], &e[i], &o[i]);
  // Byte t0 of e[i] is byte i of gathered word (t0, 0); the transpose collects them.
  Transpose4x4Bytes(e);
  Transpose4x4Bytes(o);
  WPREP_UNROLL
  for (int t0 = 0; t0 < 4; ++t0) {
    out[2 * t0] = HopperInterleaveGathered(e[t0]);
    out[2 * t0 + 1] = HopperInterleaveGathered(o[t0]);
  }
}

// Its inverse: the eight O words in[2*t0 + s0] -> x[0..3], y[0..3].
WPREP_HD void HopperDeinterleaveCanonical(const uint32_t* in, uint32_t* x, uint32_t* y) {
  uint32_t e[4], o[4];
  WPREP_UNROLL
  for (int t0 = 0; t0 < 4; ++t0) {
    e[t0] = HopperDeinterleaveGathered(in[2 * t0]);
    o[t0] = HopperDeinterleaveGathered(in[2 * t0 + 1]);
  }
  Transpose4x4Bytes(e);
  Transpose4x4Bytes(o);
  WPREP_UNROLL
  for (int i = 0; i < 4; ++i) PairNibbleWords(e[i], o[i], &x[i], &y[i]);
}

// ---------------------------------------------------------------------------------------
// Blackwell shuffled value layout.

// Division of 32-bit dividends below 2^31 by a fixed divisor with a multiply and a shift
// (the round-up method of Granlund and Montgomery, as in CUTLASS's FastDivmod).
struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  FastDivisor() = default;
  // d is at least 1: a zero (a caller's extent that did not fit 32 bits) divides by 1, and
  // MakePlan refuses every such extent before a kernel can see the result.
  WPREP_HD explicit FastDivisor(uint32_t d) : divisor(d > 0 ? d : 1) {
    d = divisor;
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  // x / divisor, for 0 <= x < 2^31.
  WPREP_HD uint32_t Div(uint32_t x) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(x, multiplier);
#else
    // A 64-bit product: cppcheck 2.10 reads uint64_t{x} as 32-bit.
    // cppcheck-suppress shiftTooManyBits
    const uint32_t hi = static_cast<uint32_t>((uint64_t{x} * multiplier) >> 32);
#endif
    return (hi + x) >> shift;
  }
};

// The storage geometry of one matrix for one (block_k, block_n).
struct BlackwellTiling {
  int64_t tile_k = 0;  // bytes along K (block_k / 2)
  int64_t tile_n = 0;  // values along N (block_n)
  int64_t ntk = 0;     // tiles along K
  int64_t ntn = 0;     // tiles along N
  int64_t kpad = 0;    // padded K bytes = ntk * tile_k
  FastDivisor div_k, div_n;  // by tile_k and tile_n
};


// kp = K/2 bytes, n = N values.
WPREP_HD BlackwellTiling MakeBlackwellTiling(int64_t block_k, int64_t block_n, int64_t kp,
                                             int64_t n) {
  BlackwellTiling t;
  t.tile_k = block_k / 2;
  t.tile_n = block_n;
  const int64_t align_k = 128 / Gcd(128, t.tile_k) * t.tile_k;
  t.kpad = RoundUp(kp, align_k);
  t.ntk = t.kpad / t.tile_k;
  t.ntn = CeilDiv(n, t.tile_n);
  t.div_k = FastDivisor(static_cast<uint32_t>(t.tile_k));
  t.div_n = FastDivisor(static_cast<uint32_t>(t.tile_n));
  return t;
}

// Byte offset of (n, k) (value column n, byte k along K) in one Blackwell storage matrix:
// dense when strides == nullptr, else through a view's (kt, nt, n') byte strides (tile_k
// contiguous). 32-bit division: MakePlan bounds every in-matrix extent by 2^31.
WPREP_HD int64_t BlackwellOffset(const BlackwellTiling& t, const int64_t* strides, int64_t n,
                                 int64_t k) {
  const uint32_t kt = t.div_k.Div(static_cast<uint32_t>(k));
  const uint32_t nt = t.div_n.Div(static_cast<uint32_t>(n));
  const int64_t kk = k - int64_t{kt} * t.tile_k, nn = n - int64_t{nt} * t.tile_n;
  if (strides == nullptr) return ((int64_t{kt} * t.ntn + nt) * t.tile_n + nn) * t.tile_k + kk;
  return kt * strides[0] + nt * strides[1] + nn * strides[2] + kk;
}

// Storage byte (n, k) of every K-packed Blackwell arrangement (shuffled tiles, the
// blackwell_value rows, checkpoint order): values (2k, n) and (2k + 1, n) of a matrix
// whose logical values are nib(i, j), with kp = K/2 bytes and n_values = N; 0 in the
// padding. Where the byte lives is BlackwellOffset's business.
template <class Nib>
WPREP_HD uint32_t BlackwellStorageByte(const Nib& nib, int64_t kp, int64_t n_values, int64_t n,
                                       int64_t k) {
  if (n >= n_values || k >= kp) return 0;
  return nib(2 * k, n) | nib(2 * k + 1, n) << 4;
}

// Blackwell value layout: rows of K bytes padded to a multiple of 128 (the TMA alignment).
inline constexpr int64_t kBlackwellValueKAlign = 128;

// A matrix of n rows of kpad K bytes, no tiles: the blackwell_value layout (kpad =
// rup(K/2, 128), zero padding) and checkpoint order (kpad = K/2) are the tilings with a
// single tile of n x kpad. They hold the same bytes as a shuffled tiling, arranged
// differently, so the Blackwell tiles move them like any other tiling.
WPREP_HD BlackwellTiling MakeRowTiling(int64_t kpad, int64_t n) {
  BlackwellTiling t;
  t.tile_k = kpad;
  t.tile_n = n;
  t.ntk = kpad > 0 ? 1 : 0;
  t.ntn = n > 0 ? 1 : 0;
  t.kpad = kpad;
  // Empty extents never reach a kernel; the divisors must still be defined.
  t.div_k = FastDivisor(static_cast<uint32_t>(kpad > 0 ? kpad : 1));
  t.div_n = FastDivisor(static_cast<uint32_t>(n > 0 ? n : 1));
  return t;
}

// True when no 16-byte run along K of this tiling crosses from one tile into the next:
// tile_k is a multiple of 16, or there is a single tile along K (rows clip at kpad).
WPREP_HD bool ChunksStayInTiles(const BlackwellTiling& t) {
  return t.tile_k % 16 == 0 || t.ntk <= 1;
}

// ---------------------------------------------------------------------------------------
// MX scale layouts (LAYOUTS.md, "MX scale layouts"): bytes move, nothing else.

// Hopper scale storage of one matrix of the scale tensor [M, K]: S is the tensor
// oriented so its columns walk the mx axis (S = x for mx_axis -1, x transposed for -2),
// padded to R = rup(rows, 32 * num_warps), C = rup(cols, align_k) (align_k 2 is the
// layout's own; a larger one appends zero groups first); O is R/32 x 32C bytes.
struct HopperScaleTiling {
  int64_t rows = 0, cols = 0;          // S before padding
  int64_t rows_pad = 0, cols_pad = 0;  // R, C
  int64_t out_rows = 0, out_cols = 0;  // R/32, 32C
  int32_t num_warps = 1;
};

WPREP_HD HopperScaleTiling MakeHopperScaleTiling(int mx_axis, int num_warps, int align_k,
                                                 int64_t m, int64_t k) {
  HopperScaleTiling t;
  t.num_warps = num_warps;
  t.rows = mx_axis == -1 ? m : k;
  t.cols = mx_axis == -1 ? k : m;
  t.rows_pad = RoundUp(t.rows, 32 * int64_t{num_warps});
  t.cols_pad = RoundUp(t.cols, int64_t{align_k});
  t.out_rows = t.rows_pad / 32;
  t.out_cols = 32 * t.cols_pad;
  return t;
}

// Which S[*r, *col] is O byte (orow, ocol): with r = 32*nw*m0 + 16*nw*a + 16*w + 8*b + c
// and col = 2*k0 + d, O[m0*nw + w, 64*k0 + 32*a + 4*c + 2*d + b] = S[r, col].
WPREP_HD void HopperScaleSource(const HopperScaleTiling& t, int64_t orow, int64_t ocol,
                                int64_t* r, int64_t* col) {
  const int64_t nw = t.num_warps;  // a power of two: w = orow mod nw, nw*m0 = orow - w
  const int64_t w = orow & (nw - 1);
  const int64_t k0 = ocol >> 6, a = (ocol >> 5) & 1, c = (ocol >> 2) & 7, d = (ocol >> 1) & 1,
                b = ocol & 1;
  *r = 32 * (orow - w) + 16 * nw * a + 16 * w + 8 * b + c;
  *col = 2 * k0 + d;
}

// Forward form of HopperScaleSource: the O offset (orow * out_cols + ocol) of S[r, col].
// num_warps is a power of two (the plans check): masks and shifts, no division.
WPREP_HD int64_t HopperScaleOffset(const HopperScaleTiling& t, int64_t r, int64_t col) {
  const int64_t nw = t.num_warps;
  const int64_t rem = r & (32 * nw - 1), m0nw = (r - rem) >> 5;  // m0 * nw, m0 = r / (32 * nw)
  const int64_t a = rem >= 16 * nw ? 1 : 0, rem2 = rem - a * 16 * nw;
  const int64_t w = rem2 >> 4, b = (rem2 >> 3) & 1, c = rem2 & 7;
  return (m0nw + w) * t.out_cols + 64 * (col >> 1) + 32 * a + 4 * c + 2 * (col & 1) + b;
}

// First S row of the 16-row run (a, b = 0, c = 0..7 and b = 1) that O row `orow` takes
// for half a (0 or 1): the runs a tile moves as 16 contiguous column bytes.
WPREP_HD int64_t HopperScaleRunRow(const HopperScaleTiling& t, int64_t orow, int a) {
  // num_warps is a power of two (the plan checks), so w = orow mod nw and nw*m0 = orow - w:
  // no division in the kernels' per-tile index math.
  const int64_t nw = t.num_warps;
  const int64_t w = orow & (nw - 1);
  return 32 * (orow - w) + 16 * nw * a + 16 * w;
}

// Blackwell scale storage of one matrix of the scale tensor [K, N]: Kp = rup(K, 8),
// Np = rup(N, 128); Np*Kp bytes in blocks of 512, block (n0, k0) at
// (n0 * Kp/4 + k0) * 512 (the storage [1, E*Np/128, Kp/4, 2, 256] for all matrices).
struct BlackwellScaleTiling {
  int64_t k = 0, n = 0;        // the tensor
  int64_t kpad = 0, npad = 0;  // Kp, Np
};

inline constexpr int64_t kBlackwellScaleBlock = 512;  // bytes of one (n0, k0) block

WPREP_HD BlackwellScaleTiling MakeBlackwellScaleTiling(int64_t k, int64_t n) {
  BlackwellScaleTiling t;
  t.k = k;
  t.n = n;
  t.kpad = RoundUp(k, 8);
  t.npad = RoundUp(n, 128);
  return t;
}

// Which x[*k, *n] is storage byte i of one matrix: with i = ((n0*Kp/4 + k0)*32 + b)*16
// + 4*a + c, it is x[4*k0 + c, 128*n0 + 32*a + b] (0 where that lies outside K x N).
WPREP_HD void BlackwellScaleSource(const BlackwellScaleTiling& t, int64_t i, int64_t* k,
                                   int64_t* n) {
  const int64_t c = i & 3, a = (i >> 2) & 3, b = (i >> 4) & 31, block = i >> 9;
  const int64_t k_blocks = t.kpad / 4;
  const int64_t n0 = block / k_blocks, k0 = block - n0 * k_blocks;
  *k = 4 * k0 + c;
  *n = 128 * n0 + 32 * a + b;
}

// Its inverse: the storage byte of x[k, n] (k < Kp, n < Np).
WPREP_HD int64_t BlackwellScaleOffset(const BlackwellScaleTiling& t, int64_t k, int64_t n) {
  return (((n >> 7) * (t.kpad / 4) + (k >> 2)) * 32 + (n & 31)) * 16 + 4 * ((n >> 5) & 3) + (k & 3);
}

// ---------------------------------------------------------------------------------------
// The geometry of one planned conversion, as the engines consume it. Built by MakePlan;
// plain data so it can be passed to a kernel by value.

enum class Op : int32_t {
  kHopperSwizzle = 0,
  kHopperUnswizzle = 1,
  // Between canonical storage (pairs along N) and a K-packed Blackwell arrangement:
  // nibbles move between bytes.
  kBlackwellSwizzle = 2,
  kBlackwellUnswizzle = 3,
  // Between two K-packed arrangements (in_tiling -> out_tiling): whole bytes move. Serves
  // retile, and every Blackwell value layout from or to checkpoint order (packing -2).
  kBlackwellRetile = 4,
  kHopperScaleSwizzle = 5,
  kHopperScaleUnswizzle = 6,
  kBlackwellScaleSwizzle = 7,
  kBlackwellScaleUnswizzle = 8,
};

// How the plain side of a scale conversion (the tensor's input view for swizzle, its
// output for unswizzle) is laid out in one matrix, which picks the tile's access path.
enum class ScaleAccess : int32_t {
  kRows = 0,     // x (Blackwell) or S (Hopper) rows are contiguous: stride 1 along columns
  kColumns = 1,  // columns are contiguous: stride 1 along rows (a transposed view)
  kBytes = 2,    // neither: byte by byte
};

struct Geometry {
  Op op = Op::kHopperSwizzle;
  // Hopper values: the canonical side (input of a swizzle, output of an unswizzle) is
  // packed along the mx axis, so Q is that matrix as it is (mx_axis -1 from packing -1,
  // mx_axis -2 from packing -2); otherwise each Q byte pairs nibbles of two of its rows.
  bool hopper_q_is_canonical = true;
  int32_t mma_version = 3;

  int64_t num_matrices = 0;  // E: product of leading dims
  // Leading dims of the input view and their byte strides (Blackwell storage inputs
  // have one leading dim, E).
  int32_t lead_rank = 0;
  int64_t lead_shape[kMaxRank] = {};
  int64_t in_lead_stride[kMaxRank] = {};

  // Canonical side as stored: rows and bytes per row of one matrix (for packing -2 the
  // rows are D1 and the bytes D0/2).
  int64_t d0 = 0;
  int64_t d1b = 0;

  // Hopper value storage of one matrix.
  HopperTiling hopper;

  // Blackwell: K/2 bytes and N values; input and output tilings (those not used are 0).
  int64_t kp = 0, n = 0;
  BlackwellTiling in_tiling, out_tiling;

  // Scales: the storage of one matrix, and the plain side's byte strides [row, column] of
  // S (Hopper) or x (Blackwell) in one matrix, with how they can be accessed.
  HopperScaleTiling hopper_scale;
  BlackwellScaleTiling blackwell_scale;
  int64_t scale_stride[2] = {};
  ScaleAccess scale_access = ScaleAccess::kRows;

  // Inner byte strides of the input view. Canonical and Hopper storage: [row stride];
  // Blackwell arrangements: [kt, nt, n'] strides (rows of a single-tile arrangement are
  // n'); Blackwell scale storage: [n0 block, k0 block, half] strides. The innermost dim
  // is always contiguous.
  int64_t in_stride[3] = {};

  // Output is contiguous: bytes of one output matrix.
  int64_t out_matrix_bytes = 0;

  // What every access start inside one input / output matrix is a multiple of (a divisor
  // of 64), pointer and leading strides aside: the engines pick 16-, 4- or 1-byte
  // accesses from it (tile_common.h's ChooseAccess).
  int64_t in_align = 64;
  int64_t out_align = 64;

  // lead_shape[i] as a FastDivisor (set by MakePlan for i >= 1; dim 0 is never divided).
  FastDivisor lead_div[kMaxRank];

  // Byte offset of matrix e of the input view. MakePlan keeps E below 2^31, so the
  // leading-dim split is 32-bit, and it divides only by the inner leading dims: a kernel
  // computes this once per tile, and a hardware division costs ~20 instructions.
  WPREP_HD int64_t InputMatrixOffset(int64_t e) const {
    uint32_t rest = static_cast<uint32_t>(e);
    int64_t off = 0;
    for (int i = lead_rank - 1; i > 0; --i) {
      const uint32_t q = lead_div[i].Div(rest);
      off += (rest - q * lead_div[i].divisor) * in_lead_stride[i];
      rest = q;
    }
    return lead_rank > 0 ? off + rest * in_lead_stride[0] : off;
  }
};

// Whether the input's matrices lie back to back, `matrix_bytes` apart, as the leading dims
// of a dense tensor lay them out (the passes that address matrix e at e * matrix_bytes).
inline bool InputMatricesBackToBack(const Geometry& g, int64_t matrix_bytes) {
  int64_t stride = matrix_bytes;
  for (int i = g.lead_rank - 1; i >= 0; --i) {
    if (g.lead_shape[i] > 1 && g.in_lead_stride[i] != stride) return false;
    stride *= g.lead_shape[i];
  }
  return true;
}

}  // namespace wprep

#endif  // WPREP_KERNELS_SRC_LAYOUT_MATH_H_
