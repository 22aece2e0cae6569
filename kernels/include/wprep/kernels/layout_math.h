// The layout mappings of LAYOUTS.md, written once. Every function here is
// __host__ __device__: the planner, the CPU engine, the CUDA kernels and the tests all
// call these, so there is one definition of each mapping to get right.
//
// Conventions: "canonical" is MXFP4 storage [..., D0, D1/2] (two FP4 codes per byte,
// even column in the low nibble). Hopper's Q matrix, placement and bit interleave follow
// LAYOUTS.md steps 1-4; Blackwell storage is [E, ntk, ntn, tile_n, tile_k] bytes.
#ifndef WPREP_KERNELS_LAYOUT_MATH_H_
#define WPREP_KERNELS_LAYOUT_MATH_H_

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

// CUDA threads per tile (kernels/src/tiles.h).
inline constexpr int kTileThreads = 256;

WPREP_HD constexpr int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
WPREP_HD constexpr int64_t CeilDiv(int64_t x, int64_t a) { return (x + a - 1) / a; }

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

// Step 4: four consecutive bytes b0..b3 of an O row become the interleaved word
// W = f(b0) | f(b1) >> 3 | f(b2) >> 6 | g(b3) (LAYOUTS.md), a fixed permutation of their
// bits. The low nibbles of b0..b3 all end in the low half of W and the high nibbles in the
// high half. Gathered in the order G = (lo b2, lo b1, lo b3, lo b0, hi b2, hi b1, hi b3,
// hi b0) (nibbles from bit 0 up), every field of W moves by one of seven shifts: 13
// instructions, where moving the fields from b0..b3 in place takes about 21. The
// word-level forms below build G with nibble pairs and byte permutes, often merged with
// the placement (step 3). Checked bit for bit against the formula in
// tests/kernels/cpu_engine_test.cc (host) and by the GPU golden tests (device).

// W from the gathered word G above.
WPREP_HD uint32_t HopperInterleaveGathered(uint32_t g) {
  return (g & 0x80078007u) | ((g >> 6) & 0x01C001C0u) | ((g >> 1) & 0x00380038u) |
         ((g << 5) & 0x30003000u) | ((g << 6) & 0x02000200u) | ((g << 1) & 0x0C000C00u) |
         ((g << 3) & 0x40004000u);
}

// Its inverse: W -> G.
WPREP_HD uint32_t HopperDeinterleaveGathered(uint32_t w) {
  return (w & 0x80078007u) | ((w << 6) & 0x70007000u) | ((w << 1) & 0x00700070u) |
         ((w >> 5) & 0x01800180u) | ((w >> 6) & 0x00080008u) | ((w >> 1) & 0x06000600u) |
         ((w >> 3) & 0x08000800u);
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
  // No byte permute on the host: swap the off-diagonal bytes of each 2x2 block of bytes,
  // then the off-diagonal 16-bit halves of each 2x2 block of halves (delta swaps).
  auto swap = [](uint32_t& lo, uint32_t& hi, int shift, uint32_t mask) {
    const uint32_t t = ((lo >> shift) ^ hi) & mask;
    hi ^= t;
    lo ^= t << shift;
  };
  swap(w[0], w[1], 8, 0x00FF00FFu);
  swap(w[2], w[3], 8, 0x00FF00FFu);
  swap(w[0], w[2], 16, 0x0000FFFFu);
  swap(w[1], w[3], 16, 0x0000FFFFu);
#endif
}

// PairNibbles on every byte of two words: byte i of *e is the low nibble of byte i of x
// | the low nibble of byte i of y << 4, *o the same of the high nibbles. An involution:
// PairNibbleWords(*e, *o) gives back x and y.
WPREP_HD void PairNibbleWords(uint32_t x, uint32_t y, uint32_t* e, uint32_t* o) {
  *e = (x & 0x0F0F0F0Fu) | ((y << 4) & 0xF0F0F0F0u);
  *o = ((x >> 4) & 0x0F0F0F0Fu) | (y & 0xF0F0F0F0u);
}

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

// One 64-byte block of a Hopper O row: O[orow, 128*cr + 64*s0 + 0..63], orow = 4*r0 + t0.
// Its bytes come from two 32-byte pieces of Q: q0 = Q[16*r0 + 2*t0 + s0, 32*cr + 0..31]
// and q1 = the row 8 below (w0 = 1), each as 8 little-endian words. Pack places and
// interleaves (steps 3-4) into out[16]; Unpack is its inverse.
template <int kMma>
WPREP_HD void HopperPackBlock(const uint32_t* q0, const uint32_t* q1, uint32_t* out) {
  if constexpr (kMma == 2) {
    // ocol = 16*t1 + 8*w1 + 4*w0 + d  <-  c = 16*w1 + 4*t1 + d: whole Q words.
    WPREP_UNROLL
    for (int t1 = 0; t1 < 4; ++t1) {
      WPREP_UNROLL
      for (int w1 = 0; w1 < 2; ++w1) {
        HopperInterleaveWordPair(q0[4 * w1 + t1], q1[4 * w1 + t1], &out[4 * t1 + 2 * w1],
                                 &out[4 * t1 + 2 * w1 + 1]);
      }
    }
  } else {
    // ocol = 16*t1 + 4*k + 2*w1 + w0  <-  c = 8*k + 4*w1 + t1: out[4*t1 + k] has bytes
    // b0..b3 = byte t1 of q0[2k], q1[2k], q0[2k + 1], q1[2k + 1]. Its gathered word G
    // is byte t1 of each of w[0..3] below.
    WPREP_UNROLL
    for (int k = 0; k < 4; ++k) {
      uint32_t w[4];
      PairNibbleWords(q0[2 * k + 1], q1[2 * k], &w[0], &w[2]);
      PairNibbleWords(q1[2 * k + 1], q0[2 * k], &w[1], &w[3]);
      Transpose4x4Bytes(w);
      WPREP_UNROLL
      for (int t1 = 0; t1 < 4; ++t1) out[4 * t1 + k] = HopperInterleaveGathered(w[t1]);
    }
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
// are depends on mma_version (HopperMxAcrossPackingTile in kernels/src/fast_tiles.h).
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
  WPREP_HD explicit FastDivisor(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  // x / divisor, for 0 <= x < 2^31.
  WPREP_HD uint32_t Div(uint32_t x) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(x, multiplier);
#else
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

WPREP_HD constexpr int64_t Gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

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

// ---------------------------------------------------------------------------------------
// The geometry of one planned conversion, as the engines consume it. Built by MakePlan;
// plain data so it can be passed to a kernel by value.

enum class Op : int32_t {
  kHopperSwizzle = 0,
  kHopperUnswizzle = 1,
  kBlackwellSwizzle = 2,
  kBlackwellUnswizzle = 3,
  kBlackwellRetile = 4,
};

struct Geometry {
  Op op = Op::kHopperSwizzle;
  int32_t mx_axis = -1;
  int32_t mma_version = 3;

  int64_t num_matrices = 0;  // E: product of leading dims
  // Leading dims of the input view and their byte strides (Blackwell storage inputs
  // have one leading dim, E).
  int32_t lead_rank = 0;
  int64_t lead_shape[kMaxRank] = {};
  int64_t in_lead_stride[kMaxRank] = {};

  // Canonical side: rows and bytes per row of one matrix.
  int64_t d0 = 0;
  int64_t d1b = 0;

  // Hopper value storage of one matrix.
  HopperTiling hopper;

  // Blackwell: K/2 bytes and N values; input and output tilings (those not used are 0).
  int64_t kp = 0, n = 0;
  BlackwellTiling in_tiling, out_tiling;

  // Inner byte strides of the input view. Canonical and Hopper storage: [row stride];
  // Blackwell storage: [kt, nt, n'] strides. The innermost dim is always contiguous.
  int64_t in_stride[3] = {};

  // Output is contiguous: bytes of one output matrix.
  int64_t out_matrix_bytes = 0;

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

}  // namespace wprep

#endif  // WPREP_KERNELS_LAYOUT_MATH_H_
