#include "flags.h"

#include <algorithm>

#include "absl/status/status.h"
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

bool Contains(const std::vector<std::string>& v, absl::string_view s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

const std::vector<std::string> kSpecFlags = {"--mx-axis",  "--mma-version", "--num-warps",
                                             "--align-k", "--packing-axis", "--block-k",
                                             "--block-n", "--to-block-k", "--to-block-n"};

absl::StatusOr<Flags> Flags::Parse(const std::vector<std::string>& args, const FlagSpec& spec) {
  Flags out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) {
      if (out.positional_.size() >= spec.max_positional) {
        return Bad(absl::StrCat("unexpected argument '", a, "'; see wprep ", spec.command, " --help"));
      }
      out.positional_.push_back(a);
      continue;
    }
    std::string value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a.resize(eq);
    }
    if (Contains(spec.switches, a)) {
      if (eq != std::string::npos) return Bad(absl::StrCat(a, " takes no value"));
    } else if (Contains(spec.with_value, a)) {
      if (eq == std::string::npos) {
        if (i + 1 >= args.size()) return Bad(absl::StrCat(a, " needs a value"));
        value = args[++i];
      }
    } else {
      return Bad(absl::StrCat("unknown flag ", a, "; see wprep ", spec.command, " --help"));
    }
    if (out.values_.count(a)) return Bad(absl::StrCat(a, " given twice"));
    out.values_[a] = value;
  }
  if (out.positional_.size() < spec.min_positional) {
    return Bad(absl::StrCat("wprep ", spec.command, " needs ", spec.min_positional,
                            " arguments; see wprep ", spec.command, " --help"));
  }
  return out;
}

const std::string* Flags::Get(absl::string_view name) const {
  auto it = values_.find(name);
  return it == values_.end() ? nullptr : &it->second;
}

bool Flags::Has(absl::string_view name) const { return values_.find(name) != values_.end(); }

absl::StatusOr<int64_t> Flags::Int(absl::string_view name, int64_t fallback) const {
  const std::string* v = Get(name);
  if (v == nullptr) return fallback;
  return ParseInt(name, *v);
}

absl::StatusOr<std::vector<int64_t>> Flags::IntList(absl::string_view name) const {
  const std::string* v = Get(name);
  if (v == nullptr) return std::vector<int64_t>();
  return ParseIntList(name, *v);
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
