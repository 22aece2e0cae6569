#include "reference.h"

#include <cstdio>
#include <cstdlib>

#include "layout_math.h"

namespace wprep::testing {
namespace {

// Index arithmetic over the plan's views.
struct Views {
  const Plan& plan;
  int rank;
  std::vector<int64_t> lead;
  int64_t num_matrices = 1;
  int64_t d0, d1;  // the last two logical dims

  explicit Views(const Plan& p) : plan(p) {
    const auto& s = p.logical_shape;
    rank = static_cast<int>(s.size());
    lead.assign(s.begin(), s.end() - 2);
    for (int64_t d : lead) num_matrices *= d;
    d0 = s[rank - 2];
    d1 = s[rank - 1];
  }
  // Byte offset of matrix e through the leading dims of `strides` (row-major order of e).
  int64_t LeadOffset(const std::vector<int64_t>& strides, int64_t e) const {
    int64_t off = 0;
    for (int i = rank - 3; i >= 0; --i) {
      off += (e % lead[i]) * strides[i];
      e /= lead[i];
    }
    return off;
  }
  // Offset of (e, i, j) in a view of the plan's logical rank whose last two dims are
  // indexed by (i, j).
  int64_t At(const std::vector<int64_t>& strides, int64_t e, int64_t i, int64_t j) const {
    return LeadOffset(strides, e) + i * strides[rank - 2] + j * strides[rank - 1];
  }
};

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "ReferenceConvert: %s\n", what);
  std::abort();
}

void HopperValue(const Views& v, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  const Plan& p = v.plan;
  const ConversionSpec& s = p.spec;
  const int mx = s.hopper.mx_axis, mma = s.hopper.mma_version;
  const HopperTiling t = MakeHopperTiling(mx, v.d0, v.d1);
  const int64_t matrix = t.out_rows * t.out_cols;
  const std::vector<int64_t>& st = p.input_strides;
  const bool packing2 = s.packing_axis == -2;
  if (s.direction == Direction::kSwizzle) {
    for (int64_t e = 0; e < v.num_matrices; ++e) {
      const uint8_t* m = in.data() + v.LeadOffset(st, e);
      const int64_t rs = st[v.rank - 2];
      auto nib = [&](int64_t i, int64_t j) {
        return packing2 ? Packing2Nibble(m, rs, i, j) : Packing1Nibble(m, rs, i, j);
      };
      for (int64_t orow = 0; orow < t.out_rows; ++orow) {
        for (int64_t wc = 0; wc < t.out_cols / 4; ++wc) {
          const uint32_t w = HopperStorageWord(nib, mx, mma, t, orow, wc);
          for (int b = 0; b < 4; ++b) {
            out[e * matrix + orow * t.out_cols + 4 * wc + b] = static_cast<uint8_t>(w >> (8 * b));
          }
        }
      }
    }
    return;
  }
  // Unswizzle: every logical value from the storage word that holds it.
  const int64_t rows = packing2 ? v.d1 : v.d0, row_bytes = packing2 ? v.d0 / 2 : v.d1 / 2;
  for (int64_t e = 0; e < v.num_matrices; ++e) {
    for (int64_t i = 0; i < v.d0; ++i) {
      for (int64_t j = 0; j < v.d1; ++j) {
        int64_t orow, ocol;
        uint32_t nibble;
        HopperValuePosition(mx, mma, i, j, &orow, &ocol, &nibble);
        uint32_t w = 0;
        for (int b = 0; b < 4; ++b) {
          const int64_t col = (ocol & ~int64_t{3}) + b;
          // mx_axis -2 storage is reported as its transpose: (col, orow).
          const int64_t off = mx == -1 ? v.At(st, e, orow, col) : v.At(st, e, col, orow);
          w |= uint32_t{in[off]} << (8 * b);
        }
        const uint32_t code = Nibble(HopperDeinterleaveWord(w) >> (8 * (ocol & 3)), nibble);
        const int64_t r = packing2 ? j : i, c = packing2 ? i : j;
        uint8_t& dst = out[e * rows * row_bytes + r * row_bytes + c / 2];
        dst = static_cast<uint8_t>((dst & ~(15u << (4 * (c & 1)))) | code << (4 * (c & 1)));
      }
    }
  }
}

// Blackwell shuffled and blackwell_value: K-packed storage; checkpoint order is one more
// K-packed arrangement (rows of K/2 bytes).
void BlackwellValue(const Views& v, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  const Plan& p = v.plan;
  const ConversionSpec& s = p.spec;
  const int64_t kp = v.d0 / 2, n_values = v.d1;
  const bool shuffled = s.layout == Layout::kBlackwellShuffledValue;
  const bool packing2 = s.packing_axis == -2;
  auto tiling = [&](const BlackwellParams& b) {
    return shuffled ? MakeBlackwellTiling(b.block_k, b.block_n, kp, n_values)
                    : MakeRowTiling(RoundUp(kp, kBlackwellValueKAlign), n_values);
  };
  auto matrix_bytes = [](const BlackwellTiling& t) { return t.kpad * t.ntn * t.tile_n; };
  const std::vector<int64_t>& st = p.input_strides;
  // Byte (n, k) of matrix e of the storage input (shuffled or blackwell_value view).
  auto storage_in = [&](const BlackwellTiling& t, int64_t e, int64_t n, int64_t k) -> uint8_t {
    if (shuffled) {
      const int64_t kt = k / t.tile_k, nt = n / t.tile_n;
      return in[e * st[0] + kt * st[1] + nt * st[2] + (n - nt * t.tile_n) * st[3] +
                (k - kt * t.tile_k) * st[4]];
    }
    return in[v.At(st, e, k, n)];  // reported [..., Kpad, N]
  };
  switch (s.direction) {
    case Direction::kSwizzle: {
      const BlackwellTiling t = tiling(s.blackwell);
      for (int64_t e = 0; e < v.num_matrices; ++e) {
        const uint8_t* m = in.data() + v.LeadOffset(st, e);
        const int64_t rs = st[v.rank - 2];
        auto nib = [&](int64_t i, int64_t j) {
          return packing2 ? Packing2Nibble(m, rs, i, j) : Packing1Nibble(m, rs, i, j);
        };
        for (int64_t n = 0; n < t.ntn * t.tile_n; ++n) {
          for (int64_t k = 0; k < t.kpad; ++k) {
            out[e * matrix_bytes(t) + BlackwellOffset(t, nullptr, n, k)] =
                static_cast<uint8_t>(BlackwellStorageByte(nib, kp, n_values, n, k));
          }
        }
      }
      return;
    }
    case Direction::kUnswizzle: {
      const BlackwellTiling t = tiling(s.blackwell);
      for (int64_t e = 0; e < v.num_matrices; ++e) {
        for (int64_t i = 0; i < v.d0; ++i) {
          for (int64_t j = 0; j < v.d1; ++j) {
            const uint32_t code = Nibble(storage_in(t, e, j, i / 2), static_cast<uint32_t>(i & 1));
            const int64_t r = packing2 ? j : i, c = packing2 ? i : j;
            const int64_t rows = packing2 ? v.d1 : v.d0, row_bytes = packing2 ? v.d0 / 2 : v.d1 / 2;
            uint8_t& dst = out[e * rows * row_bytes + r * row_bytes + c / 2];
            dst = static_cast<uint8_t>((dst & ~(15u << (4 * (c & 1)))) | code << (4 * (c & 1)));
          }
        }
      }
      return;
    }
    case Direction::kRetile: {
      const BlackwellTiling from = tiling(s.blackwell), to = tiling(s.blackwell_to);
      for (int64_t e = 0; e < v.num_matrices; ++e) {
        for (int64_t n = 0; n < to.ntn * to.tile_n; ++n) {
          for (int64_t k = 0; k < to.kpad; ++k) {
            out[e * matrix_bytes(to) + BlackwellOffset(to, nullptr, n, k)] =
                n < n_values && k < kp ? storage_in(from, e, n, k) : 0;
          }
        }
      }
      return;
    }
  }
}

void HopperScale(const Views& v, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  const Plan& p = v.plan;
  const HopperScaleParams& hs = p.spec.hopper_scale;
  const HopperScaleTiling t = MakeHopperScaleTiling(hs.mx_axis, hs.num_warps, hs.align_k, v.d0, v.d1);
  const int64_t matrix = t.out_rows * t.out_cols;
  const bool swizzle = p.spec.direction == Direction::kSwizzle;
  const std::vector<int64_t>& st = p.input_strides;
  for (int64_t e = 0; e < v.num_matrices; ++e) {
    for (int64_t orow = 0; orow < t.out_rows; ++orow) {
      for (int64_t ocol = 0; ocol < t.out_cols; ++ocol) {
        int64_t r, col;
        HopperScaleSource(t, orow, ocol, &r, &col);
        const bool inside = r < t.rows && col < t.cols;
        // x[m, k] of S[r, col].
        const int64_t m = hs.mx_axis == -1 ? r : col, k = hs.mx_axis == -1 ? col : r;
        if (swizzle) {
          out[e * matrix + orow * t.out_cols + ocol] = inside ? in[v.At(st, e, m, k)] : 0;
        } else if (inside) {
          const int64_t src = hs.mx_axis == -1 ? v.At(st, e, orow, ocol) : v.At(st, e, ocol, orow);
          out[v.At(p.output_strides, e, m, k)] = in[src];
        }
      }
    }
  }
}

void BlackwellScale(const Views& v, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  const Plan& p = v.plan;
  const BlackwellScaleTiling t = MakeBlackwellScaleTiling(v.d0, v.d1);
  const int64_t matrix = t.kpad * t.npad, n_blocks = t.npad / 128;
  const bool swizzle = p.spec.direction == Direction::kSwizzle;
  const std::vector<int64_t>& st = p.input_strides;
  for (int64_t e = 0; e < v.num_matrices; ++e) {
    for (int64_t i = 0; i < matrix; ++i) {
      int64_t k, n;
      BlackwellScaleSource(t, i, &k, &n);
      const bool inside = k < t.k && n < t.n;
      if (swizzle) {
        out[e * matrix + i] = inside ? in[v.At(st, e, k, n)] : 0;
      } else if (inside) {
        // Storage [1, E*Np/128, Kp/4, 2, 256].
        const int64_t block = i >> 9, n0 = block / (t.kpad / 4), k0 = block % (t.kpad / 4);
        const int64_t src = (e * n_blocks + n0) * st[1] + k0 * st[2] + ((i >> 8) & 1) * st[3] +
                            (i & 255) * st[4];
        out[v.At(p.output_strides, e, k, n)] = in[src];
      }
    }
  }
}

}  // namespace

std::vector<uint8_t> ReferenceConvert(const Plan& plan, const std::vector<uint8_t>& input) {
  std::vector<uint8_t> out(plan.output_bytes, 0);
  if (plan.output_bytes == 0) return out;
  if (input.size() < plan.input_bytes) Fail("input shorter than the plan's view");
  const Views v(plan);
  switch (plan.spec.layout) {
    case Layout::kHopperValue:
      HopperValue(v, input, out);
      break;
    case Layout::kBlackwellShuffledValue:
    case Layout::kBlackwellValue:
      BlackwellValue(v, input, out);
      break;
    case Layout::kHopperScale:
      HopperScale(v, input, out);
      break;
    case Layout::kBlackwellScale:
      BlackwellScale(v, input, out);
      break;
  }
  return out;
}

}  // namespace wprep::testing
