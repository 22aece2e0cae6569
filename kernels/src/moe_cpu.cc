// RunMoeCpu: each output tensor in one pass over its rows (or 128x4 groups), with the
// index math of moe_math.h. Rows move with memcpy: a row's bytes are contiguous runs.
#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu_parallel.h"
#include "moe_geometry.h"
#include "simd_cpu.h"
#include "wprep/kernels/moe.h"

namespace wprep {
namespace {

using moe::InterleavePass;
using moe::OutputPass;
using moe::RowsPass;
using cpu::Parallel;

void RowsRange(const RowsPass& p, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  for (int64_t g = begin; g < end; ++g) {
    const int64_t e = g / p.rows_out, n = g - e * p.rows_out;
    const int64_t src = moe::RowsSrcRowOffset(p, e, n);
    const uint8_t* row = src < 0 ? nullptr : in + src;
    if (p.elem == moe::kElemCopy) {
      // Contiguous runs: the whole row, or each BlockMajorK chunk of it.
      const int64_t run = p.block_bytes ? p.block_bytes : p.out_row_bytes;
      for (int64_t x = 0; x < p.out_row_bytes; x += run) {
        uint8_t* dst = out + moe::RowsOutOffset(p, e, n, x);
        const int64_t have =
            row == nullptr ? 0 : std::clamp<int64_t>(p.in_row_bytes - x, 0, run);
        if (have > 0) std::memcpy(dst, row + x, have);
        if (have < run) std::memset(dst + have, 0, run - have);
      }
      continue;
    }
    for (int64_t x = 0; x < p.out_row_bytes; x += 4) {
      const int64_t s = row == nullptr ? -1 : moe::RowsSrcByte(p, x);
      uint32_t word = 0;
      if (s >= 0 && p.elem == moe::kElemWidenBf16) {
        uint16_t h;
        std::memcpy(&h, row + s, 2);
        word = static_cast<uint32_t>(h) << 16;
      } else if (s >= 0) {
        std::memcpy(&word, row + s, 4);
        word = moe::ClampBlockScale(word);
      }
      std::memcpy(out + moe::RowsOutOffset(p, e, n, x), &word, 4);
    }
  }
}

// uint8 scales, a tile of 128 output rows of one expert at a time ([begin, end) of
// experts x rows_p / 128). Row m of the tile sits at 16 * (m % 32) + 4 * (m / 32) in each of
// its cols_p / 4 blocks of 512 bytes, so the 16 bytes at 16b of block g are the words g of
// rows b, 32 + b, 64 + b and 96 + b: with SSE2, 16 source bytes of each of those four rows
// and a 4x4 transpose of their words make 16 output bytes of 4 blocks (a strip), and the
// tile is written front to back. The last strip with source bytes reads the row's last 16
// bytes, shifted down (zeros past the row); blocks past the rows' bytes are zeros. The next
// tile's rows are prefetched, and long rows 256 bytes ahead. Without SSE2 (or for rows
// shorter than 16 bytes) each source row's 4-byte groups go to their places one by one.
// The bytes are InterleaveSrcWord's (moe_math.h), which the GPU kernel follows.
void Interleave16Tiles(const InterleavePass& p, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const int64_t mtiles = p.rows_p / 128, groups = p.cols_p / 4, whole = p.cols_in / 4;
  const int tail = static_cast<int>(p.cols_in - 4 * whole);
  const int64_t data_groups = std::min(groups, whole + (tail > 0 ? 1 : 0));  // groups with source bytes
  auto src_of = [&](int64_t t, int j) -> const uint8_t* {
    const int64_t e = t / mtiles, r = moe::SrcRow(p.map, 128 * (t - e * mtiles) + j);
    return r >= 0 ? in + (e * p.rows_in + r) * p.cols_in : nullptr;
  };
#if defined(__SSE2__)
  const bool simd = p.cols_in >= 16;
  const bool stream = simd && (reinterpret_cast<uintptr_t>(out) & 15) == 0 &&
                      static_cast<uint64_t>(p.experts * p.rows_p * p.cols_p) >= cpu::kStreamingBytes;
  const int64_t g_full = simd ? 4 * (std::min(whole, groups) / 4) : 0;  // strips of 4 whole groups
  // The strip after them, where it holds source bytes: its 16 bytes start at 4 * g_full, or
  // are the row's last n bytes moved down (zeros above).
  const int64_t n_last = std::min<int64_t>(p.cols_in - 4 * g_full, 16);
  const bool last_strip = simd && data_groups > g_full;
  auto load_last = [&](const uint8_t* row) -> __m128i {
    if (n_last == 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4 * g_full));
    uint64_t lo, hi;
    std::memcpy(&lo, row + p.cols_in - 16, 8);
    std::memcpy(&hi, row + p.cols_in - 8, 8);
    const int shift = static_cast<int>(8 * (16 - n_last));  // bits, 8 .. 120
    if (shift >= 64) {
      lo = hi >> (shift - 64);
      hi = 0;
    } else {
      lo = (lo >> shift) | (hi << (64 - shift));
      hi >>= shift;
    }
    return _mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo));
  };
  auto put = [&](uint8_t* dst, __m128i v) {
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v);
    }
  };
#else
  const int64_t g_full = 0;
  const bool last_strip = false;
#endif
  const int64_t g_simd = last_strip ? std::min(g_full + 4, groups) : g_full;  // groups [0, g_simd) in strips
  const uint8_t* src[128];   // the tile's source rows; nullptr: a zero row
  const uint8_t* next[128];  // the next tile's, found while this one is written
  if (begin < end) {
    for (int j = 0; j < 128; ++j) src[j] = src_of(begin, j);
  }
  for (int64_t t = begin; t < end; ++t) {
    const int64_t e = t / mtiles;
    uint8_t* tile = out + e * p.rows_p * p.cols_p + (t - e * mtiles) * groups * 512;
    if (t + 1 < end) {
      for (int j = 0; j < 128; ++j) next[j] = src_of(t + 1, j);
    }
#if defined(__SSE2__)
    if (simd && t + 1 < end) {  // the next tile's rows, their first 256 bytes
      for (int j = 0; j < 128; ++j) {
        const char* row = reinterpret_cast<const char*>(next[j]);
        if (row == nullptr) continue;
        for (int64_t x = 0; x < std::min<int64_t>(p.cols_in, 256); x += 64) _mm_prefetch(row + x, _MM_HINT_T0);
      }
    }
    for (int64_t g = 0; g < g_simd; g += 4) {
      uint8_t* blocks = tile + 512 * g;
      const bool last = g == g_full;
      if (!last && g % 16 == 0 && 4 * g + 256 < p.cols_in) {  // a line of each row, 256 bytes ahead
        for (int j = 0; j < 128; ++j) {
          if (src[j] != nullptr) _mm_prefetch(reinterpret_cast<const char*>(src[j] + 4 * g + 256), _MM_HINT_T0);
        }
      }
      const int64_t count = std::min<int64_t>(4, groups - g);
      for (int b = 0; b < 32; ++b) {
        __m128i w[4];
        for (int a = 0; a < 4; ++a) {
          const uint8_t* row = src[32 * a + b];
          w[a] = row == nullptr ? _mm_setzero_si128()
                 : last         ? load_last(row)
                                : _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4 * g));
        }
        cpu::Transpose4(w[0], w[1], w[2], w[3]);  // w[i]: group g + i of rows b, 32 + b, 64 + b, 96 + b
        for (int64_t i = 0; i < count; ++i) put(blocks + 512 * i + 16 * b, w[i]);
      }
    }
#endif
    // Groups with source bytes no strip wrote (no SIMD here): group by group, zero rows as zeros.
    for (int j = 0; j < 128 && g_simd < data_groups; ++j) {
      uint8_t* dst = tile + 16 * (j % 32) + 4 * (j / 32);
      for (int64_t g = g_simd; g < data_groups; ++g) {
        uint8_t word[4] = {0, 0, 0, 0};
        if (src[j] != nullptr) std::memcpy(word, src[j] + 4 * g, g < whole ? 4 : static_cast<size_t>(tail));
        std::memcpy(dst + 512 * g, word, 4);
      }
    }
    // Blocks past the source bytes: zeros.
    const int64_t g_zero = std::max(g_simd, data_groups);
    if (g_zero < groups) std::memset(tile + 512 * g_zero, 0, static_cast<size_t>(512 * (groups - g_zero)));
    if (t + 1 < end) std::copy(next, next + 128, src);
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // the streamed stores are visible before the pass returns
#endif
}

// Groups of 4 output elements (4 columns of one row, moe_math.h SfSource).
void InterleaveRange(const InterleavePass& p, const uint8_t* in, uint8_t* out, int64_t begin,
                     int64_t end) {
  const int64_t groups_per_expert = p.rows_p * p.cols_p / 4;
  const int es = p.elem_bytes;
  for (int64_t g = begin; g < end; ++g) {
    const int64_t e = g / groups_per_expert, o = 4 * (g - e * groups_per_expert);
    uint8_t* dst = out + (e * p.rows_p * p.cols_p + o) * es;
    int64_t src = 0;
    int valid = 0;
    moe::InterleaveSrcGroup(p, e, o, &src, &valid);
    if (valid > 0) std::memcpy(dst, in + src * es, valid * es);
    if (valid < 4) std::memset(dst + valid * es, 0, (4 - valid) * es);
  }
}


bool Overlap(const uint8_t* a, size_t an, const uint8_t* b, size_t bn) {
  return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

}  // namespace

namespace moe {

void RunRowsOnCpu(const RowsPass& p, const uint8_t* in, uint8_t* out) {
  RowsRange(p, in, out, 0, p.experts * p.rows_out);
}

void RunInterleave16OnCpu(const InterleavePass& p, const uint8_t* in, uint8_t* out, int threads) {
  Parallel(p.experts * (p.rows_p / 128), static_cast<uint64_t>(p.experts * p.rows_p * p.cols_p), threads,
           [&](int64_t b, int64_t e) { Interleave16Tiles(p, in, out, b, e); });
}

}  // namespace moe

absl::Status RunMoeCpu(const MoePlan& plan, absl::Span<const absl::Span<const uint8_t>> inputs,
                       absl::Span<const absl::Span<uint8_t>> outputs, int threads) {
  if (inputs.size() != plan.inputs.size() || outputs.size() != plan.outputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan takes ", plan.inputs.size(), " inputs and ", plan.outputs.size(),
                     " outputs; got ", inputs.size(), " and ", outputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].size() != plan.input_bytes[i]) {
      return absl::InvalidArgumentError(absl::StrCat(plan.inputs[i].name, ": buffer holds ",
                                                     inputs[i].size(), " bytes; the plan needs ",
                                                     plan.input_bytes[i]));
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].size() != plan.output_bytes[i]) {
      return absl::InvalidArgumentError(absl::StrCat(plan.outputs[i].name, ": buffer holds ",
                                                     outputs[i].size(), " bytes; the plan needs ",
                                                     plan.output_bytes[i]));
    }
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (Overlap(outputs[i].data(), outputs[i].size(), inputs[j].data(), inputs[j].size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            plan.outputs[i].name, ": output buffer overlaps input ", plan.inputs[j].name));
      }
    }
  }
  auto geo = moe::GeometryOf(plan);
  if (!geo.ok()) return geo.status();
  for (int i = 0; i < geo->num_outputs; ++i) {
    const OutputPass& pass = geo->outputs[i];
    const uint8_t* in = inputs[pass.input].data();
    uint8_t* out = outputs[i].data();
    if (plan.output_bytes[i] == 0) continue;
    if (pass.interleave) {
      const InterleavePass p = pass.il;
      if (p.elem_bytes == 1) {
        moe::RunInterleave16OnCpu(p, in, out, threads);
      } else {
        Parallel(p.experts * p.rows_p * p.cols_p / 4, plan.output_bytes[i], threads,
                 [&](int64_t b, int64_t e) { InterleaveRange(p, in, out, b, e); });
      }
    } else {
      const RowsPass p = pass.rows;
      Parallel(p.experts * p.rows_out, plan.output_bytes[i], threads,
               [&](int64_t b, int64_t e) { RowsRange(p, in, out, b, e); });
    }
  }
  return absl::OkStatus();
}

}  // namespace wprep
