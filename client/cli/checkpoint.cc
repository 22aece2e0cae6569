#include "checkpoint.h"

#include <algorithm>
#include <map>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wprep::cli {
namespace {

std::string ShapeString(absl::Span<const int64_t> v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

}  // namespace

absl::StatusOr<std::vector<Mxfp4Tensor>> FindMxfp4Tensors(absl::Span<const SafetensorsTensor* const> tensors,
                                                          const ConversionSpec& values,
                                                          const ConversionSpec& scales) {
  constexpr absl::string_view kBlocks = "_blocks", kScales = "_scales";
  std::map<absl::string_view, const SafetensorsTensor*> by_name;
  for (const SafetensorsTensor* t : tensors) by_name[t->name] = t;
  std::vector<Mxfp4Tensor> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& t = *tensors[i];
    const bool blocks = absl::EndsWith(t.name, kBlocks), is_scales = absl::EndsWith(t.name, kScales);
    if (!blocks && !is_scales) continue;
    const std::string stem = t.name.substr(0, t.name.size() - (blocks ? kBlocks : kScales).size());
    const std::string partner = absl::StrCat(stem, blocks ? kScales : kBlocks);
    auto it = by_name.find(partner);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape mismatch: '", t.name, "' has no '", partner, "' to pair with"));
    }
    if (t.dtype != Dtype::kU8 && !(is_scales && t.dtype == Dtype::kF8E8M0)) {
      return absl::InvalidArgumentError(absl::StrCat("unsupported dtype: '", t.name, "' is ", DtypeName(t.dtype),
                                                     "; MXFP4 ", blocks ? "blocks must be U8" : "scales must be U8 (or F8_E8M0)"));
    }
    const SafetensorsTensor& b = blocks ? t : *it->second;
    const SafetensorsTensor& s = blocks ? *it->second : t;
    const bool pairs = b.shape.size() >= 3 && b.shape.back() == 16 && s.shape.size() + 1 == b.shape.size() &&
                       std::equal(s.shape.begin(), s.shape.end(), b.shape.begin());
    if (!pairs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape mismatch: '", b.name, "' ", ShapeString(b.shape), " and '", s.name, "' ", ShapeString(s.shape),
          " do not pair up: blocks are [..., N, K/32, 16] and scales [..., N, K/32]"));
    }
    absl::StatusOr<client::TensorConversion> c =
        blocks ? client::CheckpointValues(values, t.shape) : client::CheckpointScales(scales, t.shape);
    if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(t.name, ": ", c.status().message()));
    Mxfp4Tensor m;
    m.index = i;
    m.values = blocks;
    m.conversion = *std::move(c);
    m.experts = 1;
    for (size_t d = 0; d + 2 < m.conversion.logical_shape.size(); ++d) m.experts *= m.conversion.logical_shape[d];
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace wprep::cli
