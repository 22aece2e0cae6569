#include "inspect.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "flags.h"
#include "wprep/kernels/plan.h"
#if defined(WPREP_CLI_REMOTE)
#include "wprep/client/client.h"
#endif

namespace wprep::cli {

namespace {

constexpr char kDefaultTarget[] = "unix:///tmp/wprepd.sock";

// `wprep plan`'s flags: the parser and --help.
flags::FlagSet PlanFlags() {
  flags::FlagSet fs = CommandFlags(
      "plan",
      "usage: wprep plan --layout L --direction swizzle|unswizzle|retile --shape D0,D1,... [flags]\n"
      "Prints what the conversion reads and writes (shapes, byte strides, byte counts) and the\n"
      "layout it produces, without converting anything. Flags as for wprep convert.\n");
  fs.String("layout", "L", "",
            "hopper_value, blackwell_shuffled_value, blackwell_value, hopper_scale or blackwell_scale");
  fs.String("direction", "D", "", "swizzle, unswizzle or retile");
  fs.String("shape", "D0,D1,...", "", "logical shape (FP4 values; for scales, the scale tensor)");
  AddSpecFlags(&fs);
  fs.String("input-strides", "S0,S1,...", "", "byte strides of the input's view (default dense)");
  fs.String("input-bytes", "N", "", "bytes of the input's buffer, checked against the view");
  fs.String("target", "ADDR", "", "ask a running wprepd (unix:///path.sock or HOST:PORT); "
                                  "default: plan here");
  fs.Footer("On bad input exits 2 with one line beginning with the status code.\n");
  return fs;
}

// `wprep devices`' flags: the parser and --help.
flags::FlagSet DevicesFlags() {
  flags::FlagSet fs = CommandFlags(
      "devices",
      "usage: wprep devices [flags]\n"
      "Prints the engines a running wprepd converts with: one line for the CPU engine, one\n"
      "per GPU (UUID, name, compute capability, memory, warm, streams, load).\n");
  fs.String("target", "ADDR", kDefaultTarget, "the daemon: unix:///path.sock or HOST:PORT");
  fs.String("timeout", "DURATION", "5s", "deadline of the call");
  fs.Footer("On error exits 2 with one line beginning with the status code (UNAVAILABLE: ...).\n");
  return fs;
}

std::string List(const auto& v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

// The lines `wprep plan` prints, from the daemon's answer or the local planner alike.
void PrintPlan(const auto& input_shape, const auto& input_strides, uint64_t input_bytes, const auto& output_shape,
               const auto& output_strides, uint64_t output_bytes, const std::string& description,
               const std::string& layout, const std::string& conversion, uint32_t contract_version) {
  std::printf("input_shape %s input_strides %s input_bytes %llu\n", List(input_shape).c_str(),
              List(input_strides).c_str(), static_cast<unsigned long long>(input_bytes));
  std::printf("output_shape %s output_strides %s output_bytes %llu\n", List(output_shape).c_str(),
              List(output_strides).c_str(), static_cast<unsigned long long>(output_bytes));
  std::printf("description %s\nlayout %s\nconversion %s\ncontract_version %u\n", description.c_str(),
              layout.c_str(), conversion.c_str(), contract_version);
}

}  // namespace

std::string UuidString(const std::string& b) {
  if (b.size() != 16) return absl::StrCat("(", b.size(), "-byte uuid)");
  std::string s = "GPU-";
  for (size_t i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    absl::StrAppendFormat(&s, "%02x", static_cast<unsigned char>(b[i]));
  }
  return s;
}

int FailLine(const absl::Status& s) {
  const std::string msg = absl::StrReplaceAll(s.message(), {{"\r", " "}, {"\n", " "}});
  std::fprintf(stderr, "%s: %s\n", absl::StatusCodeToString(s.code()).c_str(), msg.c_str());
  return 2;
}

int PlanCommand(const std::vector<std::string>& args) {
  if (flags::WantsHelp(args)) {
    std::fputs(PlanFlags().Usage().c_str(), stdout);
    return 0;
  }
  absl::StatusOr<Flags> flags = Flags::Parse(args, PlanFlags());
  if (!flags.ok()) return FailLine(flags.status());
  const std::string* layout = flags->Get("--layout");
  const std::string* direction = flags->Get("--direction");
  if (layout == nullptr || direction == nullptr || !flags->Has("--shape")) {
    return FailLine(absl::InvalidArgumentError("--layout, --direction and --shape are required"));
  }
  absl::StatusOr<Layout> l = ParseLayout(*layout);
  if (!l.ok()) return FailLine(l.status());
  absl::StatusOr<Direction> d = ParseDirection(*direction);
  if (!d.ok()) return FailLine(d.status());
  absl::StatusOr<ConversionSpec> spec = ParseSpecFlags(*flags, *l, *d);
  if (!spec.ok()) return FailLine(spec.status());
  absl::StatusOr<std::vector<int64_t>> shape = flags->IntList("--shape");
  if (!shape.ok()) return FailLine(shape.status());
  absl::StatusOr<std::vector<int64_t>> strides = flags->IntList("--input-strides");
  if (!strides.ok()) return FailLine(strides.status());
  absl::StatusOr<int64_t> buffer = flags->Int("--input-bytes", -1);
  if (!buffer.ok()) return FailLine(buffer.status());
  if (flags->Has("--input-bytes") && *buffer < 0) {
    return FailLine(absl::InvalidArgumentError(absl::StrCat("--input-bytes must be >= 0, got ", *buffer)));
  }

  if (const std::string* target = flags->Get("--target")) {
#if defined(WPREP_CLI_REMOTE)
    wprep::v1::PlanRequest req;
    *req.mutable_spec() = SpecToProto(*spec);
    for (int64_t v : *shape) req.add_logical_shape(v);
    for (int64_t v : *strides) req.add_input_strides(v);
    if (*buffer >= 0) req.set_input_buffer_bytes(static_cast<uint64_t>(*buffer));
    client::Client c(*target, 1);
    client::CallOptions o;
    o.timeout = std::chrono::seconds(30);
    absl::StatusOr<wprep::v1::PlanResponse> p = c.Plan(req, o);
    if (!p.ok()) return FailLine(p.status());
    PrintPlan(p->input_shape(), p->input_strides(), p->input_bytes(), p->output_shape(), p->output_strides(),
              p->output_bytes(), p->description(), p->identity().layout(), p->identity().conversion(),
              p->identity().contract_version());
    return 0;
#else
    (void)target;
    return FailLine(absl::UnimplementedError("this wprep build has no gRPC client; plan without --target"));
#endif
  }
  InputBinding binding;
  binding.strides = *strides;
  if (*buffer >= 0) binding.buffer_bytes = static_cast<uint64_t>(*buffer);
  absl::StatusOr<Plan> p = MakePlan(*spec, *shape, binding);
  if (!p.ok()) return FailLine(p.status());
  PrintPlan(p->input_shape, p->input_strides, p->input_bytes, p->output_shape, p->output_strides, p->output_bytes,
            Describe(*spec), LayoutIdentity(*spec), ConversionIdentity(*spec),
            static_cast<uint32_t>(kLayoutContractVersion));
  return 0;
}

int DevicesCommand(const std::vector<std::string>& args) {
  if (flags::WantsHelp(args)) {
    std::fputs(DevicesFlags().Usage().c_str(), stdout);
    return 0;
  }
  absl::StatusOr<Flags> flags = Flags::Parse(args, DevicesFlags());
  if (!flags.ok()) return FailLine(flags.status());
  absl::Duration timeout = absl::Seconds(5);
  if (const std::string* t = flags->Get("--timeout")) {
    if (!absl::ParseDuration(*t, &timeout) || timeout <= absl::ZeroDuration()) {
      return FailLine(absl::InvalidArgumentError(
          absl::StrCat("--timeout must be a positive duration such as 2s or 500ms, got '", *t, "'")));
    }
  }
#if defined(WPREP_CLI_REMOTE)
  const std::string* target = flags->Get("--target");
  client::Client c(target != nullptr ? *target : kDefaultTarget, 1);
  client::CallOptions o;
  o.timeout = absl::ToChronoMilliseconds(timeout);
  absl::StatusOr<wprep::v1::ListDevicesResponse> r = c.ListDevices(o);
  if (!r.ok()) return FailLine(r.status());
  std::printf("cpu engine %s threads %d\n", r->cpu_engine() ? "serving" : "idle (GPUs serve)", r->cpu_threads());
  for (const wprep::v1::DeviceInfo& d : r->devices()) {
    std::printf("gpu %d %s %s sm_%d%d memory %.1f GiB warm %s streams %d in_flight %d allocated %llu\n", d.ordinal(),
                UuidString(d.uuid()).c_str(), d.name().c_str(), d.compute_capability_major(),
                d.compute_capability_minor(), static_cast<double>(d.total_memory_bytes()) / (1ull << 30),
                d.warm() ? "true" : "false", d.streams(), d.in_flight(),
                static_cast<unsigned long long>(d.allocated_bytes()));
  }
  if (r->devices_size() == 0) std::printf("gpus none\n");
  return 0;
#else
  (void)kDefaultTarget;
  return FailLine(absl::UnimplementedError("this wprep build has no gRPC client (built without gRPC)"));
#endif
}

}  // namespace wprep::cli
