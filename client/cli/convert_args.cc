#include "convert_args.h"

#include <map>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace wprep::cli {

const char kConvertUsage[] =
    "usage: wprep convert (--local | --target unix:///path.sock|HOST:PORT)\n"
    "         --layout hopper_value|blackwell_shuffled_value|blackwell_value|hopper_scale|blackwell_scale\n"
    "         --direction swizzle|unswizzle|retile\n"
    "         --shape D0,D1,...            logical shape (FP4 values; for scales, the scale tensor)\n"
    "         [--mx-axis -1|-2]            hopper_value and hopper_scale (default -2)\n"
    "         [--mma-version 2|3]          hopper_value (default 3)\n"
    "         [--num-warps N]              hopper_scale: a power of two (default 8)\n"
    "         [--packing-axis -1|-2]       value layouts: how the canonical side (swizzle input,\n"
    "                                      unswizzle output) packs: -1 [..., D0, D1/2] (default),\n"
    "                                      -2 checkpoint order [..., D1, D0/2]\n"
    "         [--input-strides S0,S1,...]  byte strides of the input file's view (default dense)\n"
    "         [--block-k N] [--block-n N]  blackwell tiling (default 128, 256; input tiling for retile)\n"
    "         [--to-block-k N] [--to-block-n N]  retile output tiling (required for retile)\n"
    "         [--device cpu|cuda:N]        where a local conversion runs (default cpu)\n"
    "         [--threads N]                CPU engine threads (default: all)\n"
    "         --input FILE --output FILE   storage bytes in memory order\n"
    "On success prints the output shape and strides. On bad input exits 2 with one line\n"
    "beginning with the status code (e.g. INVALID_ARGUMENT:) and writes no output file.\n";

namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

absl::StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& value) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v)) {
    return Bad(absl::StrCat(flag, " must be an integer, got '", value, "'"));
  }
  return v;
}

}  // namespace

absl::StatusOr<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  int n = 0;
  if (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &n) && n >= 0) return n;
  return Bad(absl::StrCat("--device must be cpu or cuda:N, got '", device, "'"));
}

absl::StatusOr<ConvertArgs> ParseConvertArgs(const std::vector<std::string>& args) {
  // Collect --flag value / --flag=value pairs; --local takes no value.
  std::map<std::string, std::string> flags;
  ConvertArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0) return Bad(absl::StrCat("unexpected argument '", a, "'"));
    if (a == "--local") {
      out.local = true;
      continue;
    }
    std::string value;
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a.resize(eq);
    } else {
      if (i + 1 >= args.size()) return Bad(absl::StrCat(a, " needs a value"));
      value = args[++i];
    }
    static const char* kKnown[] = {"--layout",     "--direction",    "--shape",        "--mx-axis",
                                   "--mma-version", "--num-warps",   "--packing-axis", "--input-strides",
                                   "--block-k",    "--block-n",      "--to-block-k",   "--to-block-n",
                                   "--device",     "--threads",      "--input",        "--output",
                                   "--target"};
    bool known = false;
    for (const char* k : kKnown) known = known || a == k;
    if (!known) return Bad(absl::StrCat("unknown flag ", a, "; see wprep convert --help"));
    if (flags.count(a)) return Bad(absl::StrCat(a, " given twice"));
    flags[a] = value;
  }
  auto get = [&](const char* name) -> const std::string* {
    auto it = flags.find(name);
    return it == flags.end() ? nullptr : &it->second;
  };

  if (const auto* t = get("--target")) out.target = *t;
  if (out.local == !out.target.empty()) {
    return Bad("give exactly one of --local and --target ADDRESS");
  }
  const std::string* layout = get("--layout");
  const std::string* direction = get("--direction");
  const std::string* shape = get("--shape");
  if (!layout || !direction || !shape || !get("--input") || !get("--output")) {
    return Bad("--layout, --direction, --shape, --input and --output are required");
  }
  auto l = ParseLayout(*layout);
  if (!l.ok()) return l.status();
  auto d = ParseDirection(*direction);
  if (!d.ok()) return d.status();
  out.spec.layout = *l;
  out.spec.direction = *d;
  for (absl::string_view dim : absl::StrSplit(*shape, ',')) {
    auto v = ParseInt("--shape", std::string(dim));
    if (!v.ok()) return Bad(absl::StrCat("--shape must be comma-separated integers, got '", *shape, "'"));
    out.shape.push_back(*v);
  }

  struct IntFlag {
    const char* name;
    int64_t* dst;
  };
  int64_t mx = out.spec.hopper.mx_axis, mma = out.spec.hopper.mma_version, threads = 0;
  int64_t to_k = -1, to_n = -1, warps = out.spec.hopper_scale.num_warps, packing = out.spec.packing_axis;
  for (IntFlag f : {IntFlag{"--mx-axis", &mx}, IntFlag{"--mma-version", &mma},
                    IntFlag{"--num-warps", &warps}, IntFlag{"--packing-axis", &packing},
                    IntFlag{"--block-k", &out.spec.blackwell.block_k},
                    IntFlag{"--block-n", &out.spec.blackwell.block_n},
                    IntFlag{"--to-block-k", &to_k}, IntFlag{"--to-block-n", &to_n},
                    IntFlag{"--threads", &threads}}) {
    if (const auto* v = get(f.name)) {
      auto n = ParseInt(f.name, *v);
      if (!n.ok()) return n.status();
      *f.dst = *n;
    }
  }
  if (mx < -2 || mx > 2 || mma < 0 || mma > 100) {
    return Bad(absl::StrCat("--mx-axis must be -1 or -2 and --mma-version 2 or 3, got ", mx, " and ", mma));
  }
  out.spec.hopper.mx_axis = static_cast<int32_t>(mx);
  out.spec.hopper.mma_version = static_cast<int32_t>(mma);
  out.spec.hopper_scale.mx_axis = static_cast<int32_t>(mx);  // only the layout's own parameters are read
  if (warps < 1 || warps > 1024) return Bad(absl::StrCat("--num-warps must be a power of two, got ", warps));
  out.spec.hopper_scale.num_warps = static_cast<int32_t>(warps);
  if (packing != -1 && packing != -2) return Bad(absl::StrCat("--packing-axis must be -1 or -2, got ", packing));
  out.spec.packing_axis = static_cast<int32_t>(packing);
  if (const auto* st = get("--input-strides")) {
    for (absl::string_view v : absl::StrSplit(*st, ',')) {
      auto n = ParseInt("--input-strides", std::string(v));
      if (!n.ok()) return Bad(absl::StrCat("--input-strides must be comma-separated integers, got '", *st, "'"));
      out.input_strides.push_back(*n);
    }
  }
  if (out.spec.direction == Direction::kRetile) {
    if (to_k < 0 || to_n < 0) return Bad("retile needs --to-block-k and --to-block-n");
    out.spec.blackwell_to = {to_k, to_n};
  } else if (to_k >= 0 || to_n >= 0) {
    return Bad("--to-block-k/--to-block-n apply to --direction retile only");
  }
  if (threads < 0 || threads > 4096) return Bad(absl::StrCat("--threads must be in [0, 4096], got ", threads));
  out.threads = static_cast<int>(threads);
  if (const auto* dev = get("--device")) out.device = *dev;
  if (auto dev = ParseDevice(out.device); !dev.ok()) return dev.status();
  out.input = *get("--input");
  out.output = *get("--output");
  return out;
}

}  // namespace wprep::cli
