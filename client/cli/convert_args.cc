#include "convert_args.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "flags.h"

namespace wprep::cli {

const char kConvertUsage[] =
    "usage: wprep convert (--local | --target unix:///path.sock|HOST:PORT)\n"
    "         --layout hopper_value|blackwell_shuffled_value|blackwell_value|hopper_scale|blackwell_scale\n"
    "         --direction swizzle|unswizzle|retile\n"
    "         --shape D0,D1,...            logical shape (FP4 values; for scales, the scale tensor)\n"
    "         [--mx-axis -1|-2]            hopper_value and hopper_scale (default -2)\n"
    "         [--mma-version 2|3]          hopper_value (default 3)\n"
    "         [--num-warps N]              hopper_scale: a power of two (default 8)\n"
    "         [--align-k N]                hopper_scale: zero-pad the scale groups along the mx\n"
    "                                      axis to a multiple of N first (default 2; vLLM's\n"
    "                                      sm_90 call uses 4)\n"
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

}  // namespace

absl::StatusOr<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  int n = 0;
  if (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &n) && n >= 0) return n;
  return Bad(absl::StrCat("--device must be cpu or cuda:N, got '", device, "'"));
}

absl::StatusOr<ConvertArgs> ParseConvertArgs(const std::vector<std::string>& args) {
  FlagSpec fs;
  fs.command = "convert";
  fs.switches = {"--local"};
  fs.with_value = {"--layout", "--direction", "--shape", "--input-strides", "--device",
                   "--threads", "--input",     "--output", "--target"};
  fs.with_value.insert(fs.with_value.end(), kSpecFlags.begin(), kSpecFlags.end());
  absl::StatusOr<Flags> flags = Flags::Parse(args, fs);
  if (!flags.ok()) return flags.status();
  ConvertArgs out;
  out.local = flags->Has("--local");
  if (const auto* t = flags->Get("--target")) out.target = *t;
  if (out.local == !out.target.empty()) {
    return Bad("give exactly one of --local and --target ADDRESS");
  }
  const std::string* layout = flags->Get("--layout");
  const std::string* direction = flags->Get("--direction");
  if (!layout || !direction || !flags->Has("--shape") || !flags->Has("--input") || !flags->Has("--output")) {
    return Bad("--layout, --direction, --shape, --input and --output are required");
  }
  auto l = ParseLayout(*layout);
  if (!l.ok()) return l.status();
  auto d = ParseDirection(*direction);
  if (!d.ok()) return d.status();
  auto shape = flags->IntList("--shape");
  if (!shape.ok()) return shape.status();
  out.shape = *std::move(shape);
  auto spec = ParseSpecFlags(*flags, *l, *d);
  if (!spec.ok()) return spec.status();
  out.spec = *spec;
  auto strides = flags->IntList("--input-strides");
  if (!strides.ok()) return strides.status();
  out.input_strides = *std::move(strides);
  auto threads = flags->Int("--threads", 0);
  if (!threads.ok()) return threads.status();
  if (*threads < 0 || *threads > 4096) return Bad(absl::StrCat("--threads must be in [0, 4096], got ", *threads));
  out.threads = static_cast<int>(*threads);
  if (const auto* dev = flags->Get("--device")) out.device = *dev;
  if (auto dev = ParseDevice(out.device); !dev.ok()) return dev.status();
  out.input = *flags->Get("--input");
  out.output = *flags->Get("--output");
  return out;
}

}  // namespace wprep::cli
