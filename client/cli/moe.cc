#include "moe.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "convert_args.h"
#include "flags.h"
#include "local_convert.h"
#include "moe_cuda.h"
#if defined(WPREP_CLI_REMOTE)
#include "wprep/client/client.h"
#include "wprep/proto/spec_codec.h"
#include "wprep/v1/wprep.pb.h"
#endif

namespace wprep::cli {

namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

// NAME:DTYPE:D0,D1,...=PATH
absl::StatusOr<MoeInputArg> ParseInput(const std::string& text) {
  const size_t eq = text.find('=');
  const std::string spec = text.substr(0, eq);
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (eq == std::string::npos || eq + 1 == text.size() || parts.size() != 3 || parts[0].empty()) {
    return Bad(absl::StrCat("--input must be NAME:DTYPE:D0,D1,...=PATH, got '", text, "'"));
  }
  MoeInputArg in;
  in.desc.name = parts[0];
  absl::StatusOr<MoeDType> dtype = ParseMoeDType(parts[1]);
  if (!dtype.ok()) {
    return Bad(absl::StrCat("--input ", parts[0], ": dtype must be uint8, float32 or bfloat16, got '", parts[1],
                            "'"));
  }
  in.desc.dtype = *dtype;
  if (!parts[2].empty()) {  // an empty dim list is a scalar
    for (absl::string_view d : absl::StrSplit(parts[2], ',')) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(d, &v) || v < 0) {
        return Bad(absl::StrCat("--input ", parts[0], ": dims must be non-negative decimal integers, got '", parts[2],
                                "'"));
      }
      in.desc.shape.push_back(v);
    }
  }
  in.path = text.substr(eq + 1);
  return in;
}

// The size of a file, or InvalidArgument naming the operand when it cannot be read.
absl::StatusOr<uint64_t> FileSize(const std::string& path, const std::string& what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return Bad(absl::StrCat(what, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return Bad(absl::StrCat(what, ": '", path, "' is not a regular file"));
  return static_cast<uint64_t>(st.st_size);
}

// The temporary files of the outputs, removed unless committed.
class PendingOutputs {
 public:
  ~PendingOutputs() {
    for (const auto& [tmp, path] : files_) std::remove(tmp.c_str());
  }
  absl::Status Write(const std::string& path, const uint8_t* data, size_t size) {
    const std::string tmp = path + ".wprep-tmp";
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) {
      return absl::PermissionDeniedError(absl::StrCat("cannot create output file '", tmp, "': ", std::strerror(errno)));
    }
    files_.emplace_back(tmp, path);
    if (size > 0) f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!f.flush()) return absl::ResourceExhaustedError(absl::StrCat("short write to '", tmp, "'"));
    return absl::OkStatus();
  }
  // Renames every file into place: all of them were written completely first.
  absl::Status Commit() {
    for (size_t i = 0; i < files_.size(); ++i) {
      if (std::rename(files_[i].first.c_str(), files_[i].second.c_str()) != 0) {
        return absl::PermissionDeniedError(
            absl::StrCat("cannot rename into '", files_[i].second, "': ", std::strerror(errno)));
      }
      files_[i].first.clear();
    }
    files_.clear();
    return absl::OkStatus();
  }

 private:
  std::vector<std::pair<std::string, std::string>> files_;  // tmp, final
};

// The --output of each plan output, or -1 where none names it; checks every --output names
// one of the op's outputs, once.
absl::StatusOr<std::vector<int>> MatchOutputs(const MoeArgs& args, const std::vector<MoeTensorDesc>& outputs) {
  std::vector<int> of(outputs.size(), -1);
  std::vector<std::string> names;
  names.reserve(outputs.size());
  for (const MoeTensorDesc& d : outputs) names.push_back(d.name);
  for (size_t k = 0; k < args.outputs.size(); ++k) {
    size_t j = 0;
    while (j < outputs.size() && outputs[j].name != args.outputs[k].name) ++j;
    if (j == outputs.size()) {
      return Bad(absl::StrCat("--output ", args.outputs[k].name, ": ", args.op_name, " with these inputs writes ",
                              absl::StrJoin(names, ", "), "; no output is named '", args.outputs[k].name, "'"));
    }
    if (of[j] >= 0) return Bad(absl::StrCat("--output ", args.outputs[k].name, " is given twice"));
    of[j] = static_cast<int>(k);
  }
  return of;
}

absl::StatusOr<MoeResult> RunLocal(const MoeArgs& args) {
  absl::StatusOr<int> device = ParseDevice(args.device);
  if (!device.ok()) return device.status();
  std::vector<MoeTensorDesc> descs;
  for (const MoeInputArg& in : args.inputs) descs.push_back(in.desc);
  absl::StatusOr<MoePlan> plan = PlanMoe(args.op, args.params, std::move(descs));
  if (!plan.ok()) return plan.status();
  absl::StatusOr<std::vector<int>> out_of = MatchOutputs(args, plan->outputs);
  if (!out_of.ok()) return out_of.status();
  // Every input file, in the plan's order, its size checked before any is read.
  std::vector<const MoeInputArg*> in_of;
  for (size_t i = 0; i < plan->inputs.size(); ++i) {
    const MoeInputArg* arg = nullptr;
    for (const MoeInputArg& a : args.inputs) {
      if (a.desc.name == plan->inputs[i].name) arg = &a;
    }
    if (arg == nullptr) return absl::InternalError(absl::StrCat("the plan's input ", plan->inputs[i].name, " was not given"));
    absl::StatusOr<uint64_t> size = FileSize(arg->path, absl::StrCat("--input ", arg->desc.name));
    if (!size.ok()) return size.status();
    if (*size != plan->input_bytes[i]) {
      return Bad(absl::StrCat("--input ", arg->desc.name, ": '", arg->path, "' has ", *size, " bytes; ",
                              std::string(MoeDTypeName(arg->desc.dtype)), " [", absl::StrJoin(arg->desc.shape, ","), "] needs ",
                              plan->input_bytes[i]));
    }
    in_of.push_back(arg);
  }
  std::vector<std::vector<uint8_t>> inputs;
  for (const MoeInputArg* a : in_of) {
    absl::StatusOr<std::vector<uint8_t>> bytes = ReadWholeFile(a->path);
    if (!bytes.ok()) return bytes.status();
    inputs.push_back(*std::move(bytes));
  }
  std::vector<std::vector<uint8_t>> outputs;
  for (uint64_t n : plan->output_bytes) outputs.emplace_back(n);
  std::vector<absl::Span<const uint8_t>> in_spans;
  in_spans.reserve(inputs.size());
  for (const auto& v : inputs) in_spans.emplace_back(v.data(), v.size());
  std::vector<absl::Span<uint8_t>> out_spans;
  out_spans.reserve(outputs.size());
  for (auto& v : outputs) out_spans.emplace_back(v.data(), v.size());
  absl::Status s = *device < 0 ? RunMoeCpu(*plan, in_spans, out_spans, args.threads)
                               : RunMoeHostBuffersOnCuda(*plan, in_spans, out_spans, *device);
  if (!s.ok()) return s;
  PendingOutputs pending;
  MoeResult result;
  result.identity = plan->identity;
  for (size_t j = 0; j < outputs.size(); ++j) {
    if ((*out_of)[j] < 0) continue;
    const MoeOutputArg& o = args.outputs[static_cast<size_t>((*out_of)[j])];
    if (s = pending.Write(o.path, outputs[j].data(), outputs[j].size()); !s.ok()) return s;
    result.outputs.push_back(MoeOutputResult{plan->outputs[j].name, plan->outputs[j].dtype, plan->outputs[j].shape,
                                             plan->output_strides[j], plan->output_bytes[j]});
  }
  if (s = pending.Commit(); !s.ok()) return s;
  return result;
}

#if defined(WPREP_CLI_REMOTE)
// The params the user gave, typed (only those: the daemon fills the defaults).
void ParamsToProto(const MoeParams& p, v1::MoeParams* out) {
  if (p.given & kMoeParamFormat) out->set_format(std::string(MoeFormatName(p.format)));
  if (p.given & kMoeParamGated) out->set_gated(p.gated);
  if (p.given & kMoeParamAlign) out->set_align(p.align);
  if (p.given & kMoeParamAlignH) out->set_align_h(p.align_h);
  if (p.given & kMoeParamAlignI) out->set_align_i(p.align_i);
  if (p.given & kMoeParamBlockK) out->set_block_k(p.block_k);
  if (p.given & kMoeParamAxis) out->set_axis(p.axis);
  if (p.given & kMoeParamEpilogueTileM) out->set_epilogue_tile_m(p.epilogue_tile_m);
  if (p.given & kMoeParamNumEltsPerSf) out->set_num_elts_per_sf(p.num_elts_per_sf);
}

absl::StatusOr<MoeResult> RunRemote(const MoeArgs& args) {
  if (args.device != "cpu") {
    return Bad("--device is for --local; with --target the daemon picks the engine");
  }
  v1::ConvertBatchRequest req;
  v1::MoeItem* item = req.add_items()->mutable_moe();
  item->set_op(args.op_name);
  ParamsToProto(args.params, item->mutable_params());
  // Every file's existence first, then the bytes (the daemon checks sizes against shapes).
  for (const MoeInputArg& in : args.inputs) {
    absl::StatusOr<uint64_t> size = FileSize(in.path, absl::StrCat("--input ", in.desc.name));
    if (!size.ok()) return size.status();
  }
  for (const MoeInputArg& in : args.inputs) {
    v1::MoeInput* m = item->add_inputs();
    m->set_name(in.desc.name);
    m->set_dtype(MoeDTypeToProto(in.desc.dtype));
    for (int64_t d : in.desc.shape) m->add_shape(d);
    absl::StatusOr<std::vector<uint8_t>> bytes = ReadWholeFile(in.path);
    if (!bytes.ok()) return bytes.status();
    m->mutable_source()->set_inline_bytes(bytes->data(), bytes->size());
  }
  for (const MoeOutputArg& o : args.outputs) item->add_outputs()->set_name(o.name);
  client::Client client(args.target, 1);
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  if (!resp.ok()) return resp.status();
  if (resp->items_size() != 1) {
    return absl::DataLossError(absl::StrCat("the daemon answered ", resp->items_size(), " items for one"));
  }
  PendingOutputs pending;
  MoeResult result;
  for (const v1::TensorResult& t : resp->items(0).outputs()) {
    const MoeOutputArg* o = nullptr;
    for (const MoeOutputArg& a : args.outputs) {
      if (a.name == t.name()) o = &a;
    }
    if (o == nullptr) continue;
    if (t.inline_bytes().size() != t.bytes()) {
      return absl::DataLossError(absl::StrCat("the daemon announced ", t.bytes(), " bytes of ", t.name(), " but sent ",
                                              t.inline_bytes().size()));
    }
    absl::StatusOr<MoeDType> dtype = MoeDTypeFromProto(t.dtype());
    if (!dtype.ok()) return absl::DataLossError(absl::StrCat("the daemon answered an output dtype that ", dtype.status().message()));
    if (absl::Status s = pending.Write(o->path, reinterpret_cast<const uint8_t*>(t.inline_bytes().data()),
                                       t.inline_bytes().size());
        !s.ok()) {
      return s;
    }
    result.outputs.push_back(MoeOutputResult{t.name(), *dtype, {t.shape().begin(), t.shape().end()},
                                             {t.strides().begin(), t.strides().end()}, t.bytes()});
    result.identity = t.moe_identity().description();
  }
  if (result.outputs.size() != args.outputs.size()) {
    return absl::DataLossError("the daemon's answer lacks an output that was asked for");
  }
  if (absl::Status s = pending.Commit(); !s.ok()) return s;
  return result;
}
#endif

}  // namespace

namespace {

// `wprep moe`'s flags: the parser and --help.
flags::FlagSet MoeFlags() {
  flags::FlagSet fs = CommandFlags(
      "moe",
      "usage: wprep moe (--local | --target ADDR) --op OP [--param KEY=VALUE]...\n"
      "         --input NAME:DTYPE:D0,D1,...=PATH ...  --output NAME=PATH ... [flags]\n"
      "trtllm-gen MoE weight preparation (FlashInfer's Blackwell fused MoE), as the contract\n"
      "TRTLLM_GEN.md and its reference trtllm_ref.run_op define it.\n");
  fs.Switch("local", "prepare in this process");
  fs.String("target", "ADDR", "", "prepare on a running wprepd: unix:///path.sock or HOST:PORT");
  fs.String("device", "cpu|cuda:N", "cpu", "with --local: where it runs");
  fs.String("threads", "N", "0", "CPU engine threads (--local --device cpu), 0 = all");
  fs.String("op", "OP", "",
            "swap_pairs, gated_act_reorder, row_shuffle, swap_halves, block_layout, bias_shuffle, "
            "scale_row_shuffle, block_scale_interleave, shuffle_sf_a, prepare_w13 or prepare_w2");
  fs.String("param", "KEY=VALUE", "",
            "repeatable; KEY: format (mxfp4|nvfp4|mxfp8|fp8|fp8_block|bf16), gated (true|false), "
            "align_h, align_i, block_k, axis, epilogue_tile_m, num_elts_per_sf, align (decimal)")
      .Repeatable();
  fs.String("input", "NAME:DTYPE:D0,D1,...=PATH", "",
            "repeatable; NAME: x (input) of a single step, or values, scales, bias of prepare_*; "
            "DTYPE: uint8, float32 or bfloat16; PATH: raw bytes in memory order (row-major, dense)")
      .Repeatable();
  fs.String("output", "NAME=PATH", "",
            "repeatable; NAME: y (output) of a single step, or values, scales, bias of prepare_*")
      .Repeatable();
  fs.Footer(
      "Outputs not named with --output are not written. On success prints one line per output\n"
      "and the identity. On bad input exits 2 with one line beginning with the status code\n"
      "(e.g. INVALID_ARGUMENT:) and writes no output file.\n");
  return fs;
}

}  // namespace

absl::StatusOr<MoeArgs> ParseMoeArgs(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, MoeFlags());
  if (!flags.ok()) return flags.status();
  MoeArgs out;
  out.local = flags->Has("--local");
  if (const std::string* t = flags->Get("--target")) out.target = *t;
  if (const std::string* d = flags->Get("--device")) out.device = *d;
  if (const std::string* t = flags->Get("--threads")) {
    if (!absl::SimpleAtoi(*t, &out.threads) || out.threads < 0) {
      return Bad(absl::StrCat("--threads must be a non-negative integer, got '", *t, "'"));
    }
  }
  const bool have_op = flags->Has("--op");
  if (have_op) {
    const std::string& value = *flags->Get("--op");
    absl::StatusOr<MoeOp> op = ParseMoeOp(value);
    if (!op.ok()) return Bad(absl::StrCat("--op: ", op.status().message()));
    out.op = *op;
    out.op_name = value;
  }
  std::set<std::string> param_keys, input_names, output_names;
  for (const std::string& value : flags->List("--param")) {
    const size_t eq = value.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Bad(absl::StrCat("--param must be KEY=VALUE, got '", value, "'"));
    }
    const std::string key = value.substr(0, eq), v = value.substr(eq + 1);
    if (!param_keys.insert(key).second) return Bad(absl::StrCat("--param ", key, " is given twice"));
    if (absl::Status s = SetMoeParam(out.params, key, v); !s.ok()) {
      return Bad(absl::StrCat("--param ", key, "=", v, ": ", s.message()));
    }
    out.raw_params.emplace_back(key, v);
  }
  for (const std::string& value : flags->List("--input")) {
    absl::StatusOr<MoeInputArg> in = ParseInput(value);
    if (!in.ok()) return in.status();
    if (!input_names.insert(in->desc.name).second) return Bad(absl::StrCat("--input ", in->desc.name, " is given twice"));
    out.inputs.push_back(*std::move(in));
  }
  for (const std::string& value : flags->List("--output")) {
    const size_t eq = value.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == value.size()) {
      return Bad(absl::StrCat("--output must be NAME=PATH, got '", value, "'"));
    }
    MoeOutputArg o{value.substr(0, eq), value.substr(eq + 1)};
    if (!output_names.insert(o.name).second) return Bad(absl::StrCat("--output ", o.name, " is given twice"));
    out.outputs.push_back(std::move(o));
  }
  if (out.local == !out.target.empty()) return Bad("give exactly one of --local and --target ADDRESS");
  if (!have_op) return Bad("--op is required; see wprep moe --help");
  if (out.inputs.empty()) return Bad("give at least one --input NAME:DTYPE:D0,D1,...=PATH");
  if (out.outputs.empty()) return Bad("give at least one --output NAME=PATH");
  if (absl::StatusOr<int> dev = ParseDevice(out.device); !dev.ok()) return dev.status();
  return out;
}

std::string MoeUsage() { return MoeFlags().Usage(); }

absl::StatusOr<MoeResult> RunMoe(const MoeArgs& args) {
  if (args.local) return RunLocal(args);
#if defined(WPREP_CLI_REMOTE)
  return RunRemote(args);
#else
  return absl::UnimplementedError("this wprep build has no remote mode (built without gRPC); use --local");
#endif
}

int MoeCommand(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(MoeUsage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<MoeArgs> parsed = ParseMoeArgs(args);
  absl::StatusOr<MoeResult> result = parsed.ok() ? RunMoe(*parsed) : absl::StatusOr<MoeResult>(parsed.status());
  if (!result.ok()) {
    // One line, whatever the message holds.
    std::string msg(result.status().message());
    for (char& c : msg) {
      if (c == '\n') c = ' ';
    }
    std::fprintf(stderr, "%s: %s\n", absl::StatusCodeToString(result.status().code()).c_str(), msg.c_str());
    return 2;
  }
  for (const MoeOutputResult& o : result->outputs) {
    std::printf("%s %s shape [%s] strides [%s] bytes %llu\n", o.name.c_str(), std::string(MoeDTypeName(o.dtype)).c_str(),
                absl::StrJoin(o.shape, ", ").c_str(), absl::StrJoin(o.strides, ", ").c_str(),
                static_cast<unsigned long long>(o.bytes));
  }
  std::printf("identity %s\n", result->identity.c_str());
  return 0;
}

}  // namespace wprep::cli
