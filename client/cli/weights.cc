#include "weights.h"

#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "flags.h"
#include "inspect.h"
#include "progress.h"
#include "wprep/client/client.h"
#include "wprep/client/weights.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/spec/status_macros.h"
#include "wprep/v1/wprep.grpc.pb.h"

namespace wprep::cli {
namespace {

namespace v1 = wprep::v1;

// `wprep weights`' flags: the parser and --help.
flags::FlagSet WeightsFlags() {
  flags::FlagSet fs = CommandFlags(
      "weights",
      "usage: wprep weights load NAME PATH [--rules RULES] [--gpu GPU [--vmm]] [--progress MODE]\n"
      "       wprep weights list [--tensors]\n"
      "       wprep weights show NAME\n"
      "       wprep weights drop NAME [--force]\n"
      "Resident weight sets of a running wprepd. `load` has the daemon read PATH (relative\n"
      "to its --weights-root: a .safetensors file, or a directory with\n"
      "model.safetensors.index.json or model.safetensors), convert the tensors RULES name,\n"
      "copy the rest, and keep the set as NAME: on GPU GPU, or in host memory without --gpu.\n");
  fs.String("target", "ADDR", "unix:///tmp/wprepd.sock", "the daemon, for every form: unix:///path.sock or HOST:PORT");
  fs.String("rules", "RULES",  "",
            "load: PATTERN=LAYOUT[:param=value...] separated by ';', first match wins; LAYOUT is a "
            "layout name (hopper_value, hopper_scale, ...) swizzled from the tensor's bytes, or "
            "'verbatim'. Params: mx_axis, mma_version, num_warps, align_k, packing_axis, block_k, "
            "block_n. A rule may add slice=AXIS/START/LENGTH: keep only that slice of each matched tensor "
            "(a tensor- or expert-parallel rank's shard), cut from the stored tensor before its conversion. "
            "A layout rule may add checkpoint: read the tensor as an MXFP4 checkpoint stores it (gpt-oss's "
            "*_blocks [..., N, K/32, 16] and *_scales [..., N, K/32]), as convert-safetensors does. "
            "Example: '*_blocks=hopper_value:checkpoint;*_scales=hopper_scale:checkpoint;"
            "*.q_proj.weight=verbatim:slice=0/0/2048'");
  fs.String("gpu", "GPU", "",
            "load: keep the set on this GPU of the daemon's: its UUID (GPU-xxxxxxxx-..., as nvidia-smi -L "
            "prints it) or its index in the daemon's list (wprep devices)");
  fs.Switch("vmm", "load: with --gpu, keep the set in CUDA virtual memory (cuMemCreate); engines attach "
            "over the daemon's Unix socket, mapping it from a file descriptor instead of a legacy IPC handle");
  fs.String("progress", "MODE", "auto", "load: auto (a bar on a terminal), bar, lines or none");
  fs.Switch("tensors", "list: every set's tensors too");
  fs.Switch("force", "drop: even while engines are attached (their attachments end)");
  fs.Positional(1, 3);
  fs.Footer("Exit status 0, or 2 with the daemon's error on stderr.\n");
  return fs;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", absl::StatusCodeToString(s.code()).c_str(), std::string(s.message()).c_str());
  return 2;
}

std::string Shape(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

// --gpu into the request: an index into the daemon's ListDevices, or a UUID.
absl::Status SetGpu(const std::string& gpu, v1::LoadWeightsRequest* req) {
  int index = -1;
  if (absl::SimpleAtoi(gpu, &index)) {
    req->set_device_index(index);
    return absl::OkStatus();
  }
  std::string hex = absl::StrReplaceAll(absl::StripPrefix(gpu, "GPU-"), {{"-", ""}});
  const bool hex_digits =
      hex.size() == 32 && hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
  if (!hex_digits) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu '", gpu, "': want a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) or an index"));
  }
  req->set_device_uuid(absl::HexStringToBytes(hex));
  return absl::OkStatus();
}

void PrintManifest(const v1::WeightManifest& m, uint32_t attachments, bool tensors) {
  std::printf("%s  %s  %s  %d tensors  on %s%s  attachments %u  sha256 %s\n", m.name().c_str(), m.path().c_str(),
              Progress::Bytes(m.total_bytes()).c_str(), m.tensors_size(),
              m.device_uuid().empty() ? "host" : UuidString(m.device_uuid()).c_str(), m.vmm() ? " (vmm)" : "",
              attachments,
              Hex(m.source_checksum()).c_str());
  if (!tensors) return;
  for (const v1::WeightTensor& t : m.tensors()) {
    std::printf("  %-48s %-5s %-20s strides %-20s %10llu bytes @ %llu  %s\n", t.name().c_str(), t.dtype().c_str(),
                Shape(t.shape()).c_str(), Shape(t.strides()).c_str(), static_cast<unsigned long long>(t.bytes()),
                static_cast<unsigned long long>(t.offset()),
                t.has_identity() ? t.identity().layout().c_str() : "verbatim");
  }
}

absl::Status Load(client::WeightSets& sets, const Flags& flags) {
  v1::LoadWeightsRequest req;
  req.set_name(flags.positional()[1]);
  req.set_path(flags.positional()[2]);
  if (const std::string* gpu = flags.Get("--gpu")) WPREP_RETURN_IF_ERROR(SetGpu(*gpu, &req));
  req.set_vmm(flags.Has("--vmm"));
  if (const std::string* rules = flags.Get("--rules")) {
    WPREP_ASSIGN_OR_RETURN(std::vector<v1::WeightRule> parsed, ParseWeightRules(*rules));
    for (auto& r : parsed) *req.add_rules() = std::move(r);
  }
  const std::string* mode_flag = flags.Get("--progress");
  WPREP_ASSIGN_OR_RETURN(ProgressMode mode, ParseProgressMode(mode_flag ? *mode_flag : "auto", stderr));
  std::unique_ptr<Progress> progress;
  uint64_t shown_bytes = 0, shown_items = 0;
  absl::StatusOr<v1::LoadWeightsResponse> last = sets.Load(req, [&](const v1::LoadWeightsResponse& msg) {
    if (progress == nullptr) {
      progress = std::make_unique<Progress>(mode, msg.bytes_total(), static_cast<int>(msg.tensors_total()));
    }
    progress->AddBytes(msg.bytes_done() - shown_bytes);
    shown_bytes = msg.bytes_done();
    for (; shown_items < msg.tensors_done() && !msg.has_manifest(); ++shown_items) progress->ItemDone("tensor");
  });
  if (progress != nullptr) progress->Finish();
  if (!last.ok()) return last.status();
  PrintManifest(last->manifest(), 0, false);
  std::printf("loaded in %.3f s\n", last->load_seconds());
  return absl::OkStatus();
}

absl::Status List(client::WeightSets& sets, const std::string* name, bool tensors) {
  WPREP_ASSIGN_OR_RETURN(v1::ListWeightsResponse resp, sets.List(tensors));
  bool found = false;
  for (const v1::WeightSetInfo& s : resp.sets()) {
    if (name != nullptr && s.manifest().name() != *name) continue;
    found = true;
    PrintManifest(s.manifest(), s.attachments(), tensors);
  }
  if (name != nullptr && !found) return absl::NotFoundError(absl::StrCat("no weight set '", *name, "'"));
  if (name == nullptr) {
    std::printf("resident %s of budget %s\n", Progress::Bytes(resp.resident_bytes()).c_str(),
                resp.budget_bytes() == 0 ? "unlimited" : Progress::Bytes(resp.budget_bytes()).c_str());
  }
  return absl::OkStatus();
}

absl::Status Drop(client::WeightSets& sets, const std::string& name, bool force) {
  WPREP_ASSIGN_OR_RETURN(uint64_t freed, sets.Drop(name, force));
  std::printf("dropped %s (%s)\n", name.c_str(), Progress::Bytes(freed).c_str());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<v1::WeightRule>> ParseWeightRules(const std::string& text) {
  std::vector<v1::WeightRule> rules;
  for (absl::string_view part : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    const std::string where = absl::StrCat("--rules '", part, "'");
    const size_t eq = part.rfind('=', part.find(':'));
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": want PATTERN=LAYOUT[:param=value...]"));
    }
    v1::WeightRule rule;
    rule.set_pattern(std::string(part.substr(0, eq)));
    std::vector<std::string> fields = absl::StrSplit(part.substr(eq + 1), ':');
    // slice=AXIS/START/LENGTH, in any place after the action.
    for (size_t i = 1; i < fields.size(); ++i) {
      if (!absl::StartsWith(fields[i], "slice=")) continue;
      std::vector<std::string> v = absl::StrSplit(fields[i].substr(6), '/');
      int axis = 0;
      int64_t start = 0, length = 0;
      if (v.size() != 3 || !absl::SimpleAtoi(v[0], &axis) || !absl::SimpleAtoi(v[1], &start) ||
          !absl::SimpleAtoi(v[2], &length)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": '", fields[i], "': want slice=AXIS/START/LENGTH"));
      }
      rule.mutable_slice()->set_axis(axis);
      rule.mutable_slice()->set_start(start);
      rule.mutable_slice()->set_length(length);
      fields.erase(fields.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
    // checkpoint: the conversion reads an MXFP4 checkpoint's *_blocks / *_scales as stored.
    for (size_t i = 1; i < fields.size(); ++i) {
      if (fields[i] != "checkpoint") continue;
      rule.set_checkpoint(true);
      fields.erase(fields.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
    if (fields[0] == "verbatim" && fields.size() == 1) {
      if (rule.checkpoint()) return absl::InvalidArgumentError(absl::StrCat(where, ": checkpoint is for a layout"));
      rule.set_verbatim(true);
      rules.push_back(std::move(rule));
      continue;
    }
    absl::StatusOr<Layout> layout = ParseLayout(fields[0]);
    if (!layout.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", layout.status().message()));
    std::vector<std::string> args;
    for (size_t i = 1; i < fields.size(); ++i) {
      std::vector<std::string> kv = absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
      if (kv.size() != 2) return absl::InvalidArgumentError(absl::StrCat(where, ": '", fields[i], "' is not param=value"));
      args.push_back(absl::StrCat("--", absl::StrReplaceAll(kv[0], {{"_", "-"}}), "=", kv[1]));
    }
    flags::FlagSet params = CommandFlags("weights", "");
    AddSpecFlags(&params);
    absl::StatusOr<Flags> parsed = Flags::Parse(args, std::move(params));
    if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", parsed.status().message()));
    absl::StatusOr<ConversionSpec> conv = ParseSpecFlags(*parsed, *layout, Direction::kSwizzle);
    if (!conv.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", conv.status().message()));
    *rule.mutable_convert() = SpecToProto(*conv);
    rules.push_back(std::move(rule));
  }
  return rules;
}

int WeightsCommand(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(WeightsFlags().Usage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<Flags> flags = Flags::Parse(args, WeightsFlags());
  if (!flags.ok()) return Fail(flags.status());
  const std::vector<std::string>& pos = flags->positional();
  const std::string& verb = pos[0];
  const size_t want = verb == "load" ? 3 : verb == "list" ? 1 : 2;
  if ((verb != "load" && verb != "list" && verb != "show" && verb != "drop") || pos.size() != want) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("usage: see wprep weights --help")));
  }
  if (verb != "load" && flags->Has("--rules")) return Fail(absl::InvalidArgumentError("--rules is for load"));
  if (verb != "drop" && flags->Has("--force")) return Fail(absl::InvalidArgumentError("--force is for drop"));
  if (verb != "load" && flags->Has("--gpu")) return Fail(absl::InvalidArgumentError("--gpu is for load"));
  if (flags->Has("--vmm") && !flags->Has("--gpu")) {
    return Fail(absl::InvalidArgumentError("--vmm is for load --gpu: a set in host memory is a shared-memory file"));
  }
  const std::string* target_flag = flags->Get("--target");
  const std::string target = target_flag ? *target_flag : "unix:///tmp/wprepd.sock";
  client::WeightSets sets(target);
  absl::Status s;
  if (verb == "load") s = Load(sets, *flags);
  if (verb == "list") s = List(sets, nullptr, flags->Has("--tensors"));
  if (verb == "show") s = List(sets, &pos[1], true);
  if (verb == "drop") s = Drop(sets, pos[1], flags->Has("--force"));
  return s.ok() ? 0 : Fail(s);
}

}  // namespace wprep::cli
