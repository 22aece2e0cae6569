#include "convert_args.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "flags.h"

namespace wprep::cli {

namespace {

// `wprep convert`'s flags: the parser and --help.
flags::FlagSet ConvertFlags() {
  flags::FlagSet fs = CommandFlags(
      "convert",
      "usage: wprep convert (--local | --target ADDR) --layout L --direction D --shape D0,D1,...\n"
      "         --input FILE --output FILE [flags]\n"
      "Converts one tensor file between MXFP4 layouts: storage bytes in memory order in, the\n"
      "converted storage bytes out.\n");
  fs.Switch("local", "convert in this process");
  fs.String("target", "ADDR", "", "convert on a running wprepd: unix:///path.sock or HOST:PORT");
  fs.String("layout", "L", "",
            "hopper_value, blackwell_shuffled_value, blackwell_value, hopper_scale or blackwell_scale");
  fs.String("direction", "D", "", "swizzle, unswizzle or retile");
  fs.String("shape", "D0,D1,...", "", "logical shape (FP4 values; for scales, the scale tensor)");
  AddSpecFlags(&fs);
  fs.String("input-strides", "S0,S1,...", "", "byte strides of the input file's view (default dense)");
  fs.String("device", "cpu|cuda:N", "cpu", "where a local conversion runs");
  fs.String("threads", "N", "0", "CPU engine threads, 0 = all");
  fs.String("input", "FILE", "", "the input's storage bytes");
  fs.String("output", "FILE", "", "where the output's storage bytes go");
  fs.Footer(
      "On success prints the output shape and strides. On bad input exits 2 with one line\n"
      "beginning with the status code (e.g. INVALID_ARGUMENT:) and writes no output file.\n");
  return fs;
}

}  // namespace

std::string ConvertUsage() { return ConvertFlags().Usage(); }

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
  absl::StatusOr<Flags> flags = Flags::Parse(args, ConvertFlags());
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
