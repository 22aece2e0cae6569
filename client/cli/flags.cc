#include "flags.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace wprep::cli {
namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

absl::StatusOr<int64_t> ParseInt(absl::string_view flag, absl::string_view value) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v)) return Bad(absl::StrCat(flag, " must be an integer, got '", value, "'"));
  return v;
}

// "--name" -> "name", the FlagSet's spelling.
absl::string_view Bare(absl::string_view flag) {
  return absl::StartsWith(flag, "--") ? flag.substr(2) : flag;
}

// Declares the flags `only` names (every one when it is empty).
struct SpecFlagAdder {
  flags::FlagSet* set;
  std::initializer_list<absl::string_view> only;
  void String(absl::string_view name, absl::string_view value, const std::string& def, absl::string_view help) {
    if (only.size() != 0 && std::find(only.begin(), only.end(), name) == only.end()) return;
    set->String(name, value, def, help);
  }
};

}  // namespace

flags::FlagSet CommandFlags(absl::string_view command, absl::string_view header) {
  return flags::FlagSet(absl::StrCat("wprep ", command), std::string(header));
}

absl::StatusOr<Flags> Flags::Parse(const std::vector<std::string>& args, flags::FlagSet set) {
  if (absl::Status s = set.Parse(args); !s.ok()) return s;
  return Flags(std::move(set));
}

const std::string* Flags::Get(absl::string_view name) const {
  return Has(name) ? &set_.GetString(Bare(name)) : nullptr;
}

bool Flags::Has(absl::string_view name) const { return set_.Declared(Bare(name)) && set_.Has(Bare(name)); }

absl::StatusOr<int64_t> Flags::Int(absl::string_view name, int64_t fallback) const {
  if (!set_.Declared(Bare(name))) return fallback;
  const std::string& v = set_.GetString(Bare(name));
  if (!set_.Has(Bare(name)) && v.empty()) return fallback;
  return ParseInt(name, v);
}

const std::vector<std::string>& Flags::List(absl::string_view name) const { return set_.GetList(Bare(name)); }

absl::StatusOr<std::vector<int64_t>> Flags::IntList(absl::string_view name) const {
  const std::string* v = Get(name);
  if (v == nullptr) return std::vector<int64_t>();
  return ParseIntList(name, *v);
}

void AddSpecFlags(flags::FlagSet* set, std::initializer_list<absl::string_view> only) {
  const ConversionSpec d;
  SpecFlagAdder add{set, only};
  add.String("mx-axis", "-1|-2", absl::StrCat(d.hopper.mx_axis), "hopper_value and hopper_scale: the MX axis");
  add.String("mma-version", "2|3", absl::StrCat(d.hopper.mma_version), "hopper_value: the MMA tiles");
  add.String("num-warps", "N", absl::StrCat(d.hopper_scale.num_warps), "hopper_scale: a power of two");
  add.String("align-k", "N", absl::StrCat(d.hopper_scale.align_k),
             "hopper_scale: zero-pad the scale groups along the mx axis to a multiple of N first "
             "(vLLM's sm_90 call uses 4)");
  add.String("packing-axis", "-1|-2", absl::StrCat(d.packing_axis),
              "value layouts: how the canonical side (swizzle input, unswizzle output) packs: -1 "
              "[..., D0, D1/2], -2 checkpoint order [..., D1, D0/2]");
  add.String("block-k", "N", absl::StrCat(d.blackwell.block_k), "blackwell tiling (input tiling for retile)");
  add.String("block-n", "N", absl::StrCat(d.blackwell.block_n), "blackwell tiling (input tiling for retile)");
  add.String("to-block-k", "N", "", "retile output tiling (required for retile)");
  add.String("to-block-n", "N", "", "retile output tiling (required for retile)");
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(absl::string_view flag, absl::string_view value) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      return Bad(absl::StrCat(flag, " must be comma-separated integers, got '", value, "'"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<ConversionSpec> ParseSpecFlags(const Flags& flags, Layout layout, Direction direction) {
  ConversionSpec spec;
  spec.layout = layout;
  spec.direction = direction;
  int64_t mx = spec.hopper.mx_axis, mma = spec.hopper.mma_version, warps = spec.hopper_scale.num_warps;
  int64_t align_k = spec.hopper_scale.align_k;
  int64_t packing = spec.packing_axis, to_k = -1, to_n = -1;
  struct IntFlag {
    const char* name;
    int64_t* dst;
  };
  for (IntFlag f : {IntFlag{"--mx-axis", &mx}, IntFlag{"--mma-version", &mma},
                    IntFlag{"--num-warps", &warps}, IntFlag{"--align-k", &align_k},
                    IntFlag{"--packing-axis", &packing},
                    IntFlag{"--block-k", &spec.blackwell.block_k},
                    IntFlag{"--block-n", &spec.blackwell.block_n}, IntFlag{"--to-block-k", &to_k},
                    IntFlag{"--to-block-n", &to_n}}) {
    absl::StatusOr<int64_t> v = flags.Int(f.name, *f.dst);
    if (!v.ok()) return v.status();
    *f.dst = *v;
  }
  if (mx < -2 || mx > 2 || mma < 0 || mma > 100) {
    return Bad(absl::StrCat("--mx-axis must be -1 or -2 and --mma-version 2 or 3, got ", mx, " and ", mma));
  }
  spec.hopper.mx_axis = static_cast<int32_t>(mx);
  spec.hopper.mma_version = static_cast<int32_t>(mma);
  spec.hopper_scale.mx_axis = static_cast<int32_t>(mx);  // only the layout's own parameters are read
  if (warps < 1 || warps > 1024) return Bad(absl::StrCat("--num-warps must be a power of two, got ", warps));
  spec.hopper_scale.num_warps = static_cast<int32_t>(warps);
  if (align_k < 1 || align_k > 1024) return Bad(absl::StrCat("--align-k must be a power of two, got ", align_k));
  spec.hopper_scale.align_k = static_cast<int32_t>(align_k);
  if (packing != -1 && packing != -2) return Bad(absl::StrCat("--packing-axis must be -1 or -2, got ", packing));
  spec.packing_axis = static_cast<int32_t>(packing);
  if (direction == Direction::kRetile) {
    if (to_k < 0 || to_n < 0) return Bad("retile needs --to-block-k and --to-block-n");
    spec.blackwell_to = {to_k, to_n};
  } else if (to_k >= 0 || to_n >= 0) {
    return Bad("--to-block-k/--to-block-n apply to --direction retile only");
  }
  return spec;
}

}  // namespace wprep::cli
