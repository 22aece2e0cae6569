#include "wprep/flags/flags.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace wprep::flags {
namespace {

// Help entries: flag and value in the first kNameWidth columns, help text beside them,
// wrapped at kWidth.
constexpr size_t kIndent = 2, kNameWidth = 25, kWidth = 92;

absl::Status BadValue(absl::string_view flag, absl::string_view value, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, " is not valid: expected ", want));
}

[[noreturn]] void Misuse(absl::string_view what, absl::string_view name) {
  std::fprintf(stderr, "wprep::flags: %s --%s\n", std::string(what).c_str(), std::string(name).c_str());
  std::abort();
}

// Words of `text` as lines no wider than `width`; "(default X)" stays on one line, so a
// reader (or a script) finds the default whole.
std::vector<std::string> Wrap(absl::string_view text, absl::string_view keep_whole, size_t width) {
  std::vector<std::string> words = absl::StrSplit(text, ' ', absl::SkipEmpty());
  if (!keep_whole.empty()) words.emplace_back(keep_whole);
  std::vector<std::string> lines;
  std::string line;
  for (const std::string& w : words) {
    if (!line.empty() && line.size() + 1 + w.size() > width) {
      lines.push_back(std::move(line));
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line += w;
  }
  if (!line.empty()) lines.push_back(std::move(line));
  return lines;
}

}  // namespace

absl::Status ParseBytes(absl::string_view flag, absl::string_view v, uint64_t* out) {
  absl::string_view digits = v;
  uint64_t mult = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': mult = 1ull << 10; break;
      case 'M': case 'm': mult = 1ull << 20; break;
      case 'G': case 'g': mult = 1ull << 30; break;
      case 'T': case 't': mult = 1ull << 40; break;
      default: break;
    }
    if (mult != 1) digits.remove_suffix(1);
  }
  uint64_t x = 0;
  if (!absl::SimpleAtoi(digits, &x) || x > (~0ull) / mult) {
    return BadValue(flag, v, "a byte count such as 1073741824, 512M or 80G");
  }
  *out = x * mult;
  return absl::OkStatus();
}

std::string FormatBytes(uint64_t v) {
  static constexpr struct {
    int shift;
    char suffix;
  } kUnits[] = {{40, 'T'}, {30, 'G'}, {20, 'M'}, {10, 'K'}};
  for (const auto& u : kUnits) {
    const uint64_t unit = 1ull << u.shift;
    if (v != 0 && v % unit == 0) return absl::StrCat(v / unit, std::string(1, u.suffix));
  }
  return absl::StrCat(v);
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

FlagSet::FlagSet(std::string program, std::string header)
    : program_(std::move(program)), header_(std::move(header)) {}

FlagSet::Flag& FlagSet::Declare(absl::string_view name, Kind kind, absl::string_view value,
                                absl::string_view help) {
  if (name.empty() || absl::StartsWith(name, "-") || name == "help" || index_.count(name) != 0) {
    Misuse("bad or duplicate declaration of", name);
  }
  index_.emplace(std::string(name), flags_.size());
  Flag& f = flags_.emplace_back();
  f.name = std::string(name);
  f.kind = kind;
  f.value_name = std::string(value);
  f.help = std::string(help);
  return f;
}

FlagSet& FlagSet::Switch(absl::string_view name, absl::string_view help) {
  Declare(name, Kind::kSwitch, "", help);
  return *this;
}

FlagSet& FlagSet::Bool(absl::string_view name, bool def, absl::string_view help) {
  Flag& f = Declare(name, Kind::kBool, "", help);
  f.on = def;
  f.default_text = def ? "true" : "false";
  return *this;
}

FlagSet& FlagSet::String(absl::string_view name, absl::string_view value, absl::string_view def,
                         absl::string_view help) {
  Flag& f = Declare(name, Kind::kString, value, help);
  f.text = std::string(def);
  f.default_text = std::string(def);
  return *this;
}

FlagSet& FlagSet::Int(absl::string_view name, absl::string_view value, int64_t def,
                      absl::string_view help, int64_t lo, int64_t hi) {
  Flag& f = Declare(name, Kind::kInt, value, help);
  f.number = def;
  f.lo = lo;
  f.hi = hi;
  f.default_text = absl::StrCat(def);
  return *this;
}

FlagSet& FlagSet::Bytes(absl::string_view name, absl::string_view value, uint64_t def,
                        absl::string_view help, uint64_t lo, uint64_t hi) {
  Flag& f = Declare(name, Kind::kBytes, value, help);
  f.bytes = def;
  f.ulo = lo;
  f.uhi = hi;
  f.default_text = FormatBytes(def);
  return *this;
}

FlagSet& FlagSet::Duration(absl::string_view name, absl::string_view value, absl::Duration def,
                           absl::string_view help) {
  Flag& f = Declare(name, Kind::kDuration, value, help);
  f.duration = def;
  f.default_text = absl::FormatDuration(def);
  return *this;
}

FlagSet& FlagSet::List(absl::string_view name, absl::string_view value, std::vector<std::string> def,
                       absl::string_view help) {
  Flag& f = Declare(name, Kind::kList, value, help);
  f.default_text = absl::StrJoin(def, ",");
  f.list = std::move(def);
  return *this;
}

FlagSet& FlagSet::Repeatable() {
  if (flags_.empty() || flags_.back().kind == Kind::kSwitch || flags_.back().kind == Kind::kBool) Misuse("Repeatable() needs a valued flag", "");
  Flag& f = flags_.back();
  f.repeatable = true;
  if (f.kind == Kind::kString && !f.text.empty()) f.list = {f.text};
  return *this;
}

FlagSet& FlagSet::HideDefault() {
  if (flags_.empty()) Misuse("HideDefault() before any flag", "");
  flags_.back().default_text.clear();
  return *this;
}

FlagSet& FlagSet::Positional(size_t min, size_t max) {
  min_positional_ = min;
  max_positional_ = max;
  return *this;
}

FlagSet& FlagSet::AllowRest() {
  allow_rest_ = true;
  return *this;
}

FlagSet& FlagSet::LastWins() {
  last_wins_ = true;
  return *this;
}

FlagSet& FlagSet::Footer(absl::string_view text) {
  footer_ = std::string(text);
  return *this;
}

absl::Status FlagSet::Set(Flag& f, const std::string& value) {
  const bool first = !f.given;
  f.given = true;
  switch (f.kind) {
    case Kind::kSwitch:
      f.on = true;
      return absl::OkStatus();
    case Kind::kBool:
      if (value == "true" || value == "1") {
        f.on = true;
      } else if (value == "false" || value == "0") {
        f.on = false;
      } else {
        return BadValue(f.name, value, "true or false");
      }
      return absl::OkStatus();
    case Kind::kString:
      f.text = value;
      if (f.repeatable) {
        if (first) f.list.clear();
        f.list.push_back(value);
      }
      return absl::OkStatus();
    case Kind::kList:
      if (first) f.list.clear();
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) f.list.emplace_back(item);
      return absl::OkStatus();
    case Kind::kInt: {
      int64_t x = 0;
      if (!absl::SimpleAtoi(value, &x) || x < f.lo || x > f.hi) {
        if (f.lo == std::numeric_limits<int64_t>::min() && f.hi == std::numeric_limits<int64_t>::max()) {
          return BadValue(f.name, value, "an integer");
        }
        return BadValue(f.name, value, absl::StrCat("an integer in [", f.lo, ", ", f.hi, "]"));
      }
      f.number = x;
      return absl::OkStatus();
    }
    case Kind::kBytes: {
      uint64_t x = 0;
      if (absl::Status s = ParseBytes(f.name, value, &x); !s.ok()) return s;
      if (x < f.ulo || x > f.uhi) {
        return BadValue(f.name, value,
                        absl::StrCat("a size between ", FormatBytes(f.ulo), " and ", FormatBytes(f.uhi)));
      }
      f.bytes = x;
      return absl::OkStatus();
    }
    case Kind::kDuration: {
      absl::Duration d;
      if (!absl::ParseDuration(value, &d) || d < absl::ZeroDuration()) {
        return BadValue(f.name, value, "a non-negative duration such as 30s or 500ms");
      }
      f.duration = d;
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unknown flag kind");
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    help_ = true;
    return absl::OkStatus();
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--" && allow_rest_) {
      rest_.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      break;
    }
    if (!absl::StartsWith(a, "--")) {
      if (positional_.size() >= max_positional_) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected argument '", a, "' (see ", program_, " --help)"));
      }
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    auto it = index_.find(name);
    if (it == index_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see ", program_, " --help)"));
    }
    Flag& f = flags_[it->second];
    if (f.kind == Kind::kSwitch) {
      if (eq != std::string::npos) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
    } else if (f.kind == Kind::kBool) {
      if (eq == std::string::npos) value = "true";
    } else if (eq == std::string::npos) {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      value = args[++i];
    }
    if (f.given && !f.repeatable && !last_wins_) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " given twice"));
    }
    if (absl::Status s = Set(f, value); !s.ok()) return s;
  }
  if (positional_.size() < min_positional_) {
    return absl::InvalidArgumentError(absl::StrCat(program_, " needs ", min_positional_, " argument",
                                                   min_positional_ == 1 ? "" : "s", " (see ", program_,
                                                   " --help)"));
  }
  return absl::OkStatus();
}

const FlagSet::Flag& FlagSet::Find(absl::string_view name, Kind kind) const {
  auto it = index_.find(name);
  if (it == index_.end()) Misuse("asked for undeclared flag", name);
  const Flag& f = flags_[it->second];
  if (f.kind != kind && !(kind == Kind::kList && f.kind == Kind::kString && f.repeatable)) {
    Misuse("asked for the wrong kind of", name);
  }
  return f;
}

bool FlagSet::Has(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) Misuse("asked for undeclared flag", name);
  return flags_[it->second].given;
}

bool FlagSet::GetSwitch(absl::string_view name) const { return Find(name, Kind::kSwitch).on; }
bool FlagSet::GetBool(absl::string_view name) const { return Find(name, Kind::kBool).on; }
const std::string& FlagSet::GetString(absl::string_view name) const { return Find(name, Kind::kString).text; }
int64_t FlagSet::GetInt(absl::string_view name) const { return Find(name, Kind::kInt).number; }
uint64_t FlagSet::GetBytes(absl::string_view name) const { return Find(name, Kind::kBytes).bytes; }
absl::Duration FlagSet::GetDuration(absl::string_view name) const {
  return Find(name, Kind::kDuration).duration;
}
const std::vector<std::string>& FlagSet::GetList(absl::string_view name) const {
  return Find(name, Kind::kList).list;
}

std::string FlagSet::Usage() const {
  std::string out = header_;
  if (!out.empty() && out.back() != '\n') out += '\n';
  if (!flags_.empty()) {
    out += "\nFlags (--name=value or --name value):\n";
  }
  const std::string pad(kNameWidth + kIndent, ' ');
  for (const Flag& f : flags_) {
    std::string head = absl::StrCat(std::string(kIndent, ' '), "--", f.name);
    if (f.kind == Kind::kBool) absl::StrAppend(&head, "[=true|false]");
    if (!f.value_name.empty()) absl::StrAppend(&head, " ", f.value_name);
    const std::string def = f.default_text.empty() ? "" : absl::StrCat("(default ", f.default_text, ")");
    std::vector<std::string> lines = Wrap(f.help, def, kWidth - pad.size());
    if (lines.empty()) {
      absl::StrAppend(&out, head, "\n");
      continue;
    }
    size_t first = 0;
    if (head.size() < pad.size()) {
      absl::StrAppend(&out, head, std::string(pad.size() - head.size(), ' '), lines[0], "\n");
      first = 1;
    } else {
      absl::StrAppend(&out, head, "\n");
    }
    for (size_t i = first; i < lines.size(); ++i) absl::StrAppend(&out, pad, lines[i], "\n");
  }
  if (!footer_.empty()) {
    absl::StrAppend(&out, "\n", footer_);
    if (out.back() != '\n') out += '\n';
  }
  return out;
}

}  // namespace wprep::flags
