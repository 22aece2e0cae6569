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
// experts x rows_p / 128): each source row is read once, front to back, its 4-byte column
// groups written to their places in the tile's cols_p / 4 blocks of 512 bytes (row m of
// the tile at 16 * (m % 32) + 4 * (m / 32) in each), padding zeroed. The bytes are
// InterleaveSrcWord's (moe_math.h), which the GPU kernel follows.
void Interleave16Tiles(const InterleavePass& p, const uint8_t* in, uint8_t* out, int64_t begin, int64_t end) {
  const int64_t mtiles = p.rows_p / 128, groups = p.cols_p / 4, whole = p.cols_in / 4;
  const int tail = static_cast<int>(p.cols_in - 4 * whole);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t e = t / mtiles, mt = t - e * mtiles;
    uint8_t* tile = out + e * p.rows_p * p.cols_p + mt * groups * 512;
    for (int j = 0; j < 128; ++j) {
      uint8_t* dst = tile + 16 * (j % 32) + 4 * (j / 32);
      const int64_t r = moe::SrcRow(p.map, 128 * mt + j);
      int64_t g = 0;
      if (r >= 0) {
        const uint8_t* src = in + (e * p.rows_in + r) * p.cols_in;
        for (; g < whole && g < groups; ++g) std::memcpy(dst + 512 * g, src + 4 * g, 4);
        if (tail > 0 && g < groups) {
          uint8_t word[4] = {0, 0, 0, 0};
          std::memcpy(word, src + 4 * g, static_cast<size_t>(tail));
          std::memcpy(dst + 512 * g, word, 4);
          ++g;
        }
      }
      for (; g < groups; ++g) std::memset(dst + 512 * g, 0, 4);
    }
  }
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
