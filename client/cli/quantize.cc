// `wprep quantize --local`: validates every flag and the input size before writing, then
// writes both outputs through temporary files, so a refused request leaves no files.
#include "quantize.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "convert_args.h"
#include "flags.h"
#include "local_convert.h"
#include "wprep/kernels/quantize.h"
#if defined(WPREP_CLI_REMOTE)
#include "wprep/client/client.h"
#include "wprep/v1/wprep.pb.h"
#endif

namespace wprep::cli {

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 2;
}

// The daemon at `target` quantizes `input` as one quantize batch item; its two inline
// outputs must be exactly the sizes the local planner gives (`values` and `scales` are
// sized so).
// The trtllm layouts' optional bias: its bytes in, its prepared bytes out (sized so).
struct BiasIo {
  bool bf16 = false;
  const std::vector<uint8_t>* in = nullptr;
  std::vector<uint8_t>* out = nullptr;
};

absl::Status QuantizeRemote(const std::string& target, const QuantizePlan& plan, const QuantLayoutSpec& layout,
                            const std::vector<uint8_t>& input, std::vector<uint8_t>* values,
                            std::vector<uint8_t>* scales, const BiasIo& bias) {
#if defined(WPREP_CLI_REMOTE)
  namespace v1 = wprep::v1;
  v1::ConvertBatchRequest req;
  v1::QuantizeItem* item = req.add_items()->mutable_quantize();
  item->set_dtype(plan.dtype == QuantDtype::kBfloat16  ? v1::QUANTIZE_DTYPE_BFLOAT16
                  : plan.dtype == QuantDtype::kFloat16 ? v1::QUANTIZE_DTYPE_FLOAT16
                                                       : v1::QUANTIZE_DTYPE_FLOAT32);
  for (int64_t d : plan.input_shape) item->add_shape(d);
  item->set_scale_rounding(plan.rounding == ScaleRounding::kDown ? v1::SCALE_ROUNDING_DOWN : v1::SCALE_ROUNDING_UP);
  switch (layout.layout) {
    case QuantLayout::kCanonical:
      item->set_layout(v1::QUANTIZE_LAYOUT_CANONICAL);
      break;
    case QuantLayout::kBlackwell:
      item->set_layout(v1::QUANTIZE_LAYOUT_BLACKWELL);
      break;
    case QuantLayout::kBlackwellShuffled:
      item->set_layout(v1::QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED);
      item->mutable_blackwell()->set_block_k(layout.block_k);
      item->mutable_blackwell()->set_block_n(layout.block_n);
      break;
    case QuantLayout::kHopper:
      item->set_layout(v1::QUANTIZE_LAYOUT_HOPPER);
      item->mutable_hopper()->set_mma_version(layout.mma_version);
      item->mutable_hopper_scale()->set_num_warps(layout.num_warps);
      item->mutable_hopper_scale()->set_align_k(layout.align_k);
      break;
    case QuantLayout::kTrtllmW13:
    case QuantLayout::kTrtllmW2:
      item->set_layout(layout.layout == QuantLayout::kTrtllmW13 ? v1::QUANTIZE_LAYOUT_TRTLLM_W13
                                                                : v1::QUANTIZE_LAYOUT_TRTLLM_W2);
      item->set_align(layout.align);
      if (bias.in != nullptr) {
        item->mutable_bias()->set_inline_bytes(bias.in->data(), bias.in->size());
        item->set_bias_dtype(bias.bf16 ? v1::QUANTIZE_DTYPE_BFLOAT16 : v1::QUANTIZE_DTYPE_FLOAT32);
      }
      break;
  }
  item->mutable_source()->set_inline_bytes(input.data(), input.size());
  client::Client client(target, 1);
  absl::StatusOr<v1::ConvertBatchResponse> resp = client.ConvertBatch(req);
  if (!resp.ok()) return resp.status();
  const int outputs = bias.in != nullptr ? 3 : 2;
  if (resp->items_size() != 1 || resp->items(0).outputs_size() != outputs) {
    return absl::DataLossError(absl::StrCat("the daemon answered a quantize item without its ", outputs, " outputs"));
  }
  for (int j = 0; j < outputs; ++j) {
    const std::string& got = resp->items(0).outputs(j).inline_bytes();
    std::vector<uint8_t>* out = j == 0 ? values : j == 1 ? scales : bias.out;
    if (got.size() != out->size()) {
      return absl::DataLossError(absl::StrCat("the daemon answered ", got.size(), " bytes of ",
                                              resp->items(0).outputs(j).name(), "; the plan has ", out->size()));
    }
    out->assign(got.begin(), got.end());
  }
  return absl::OkStatus();
#else
  (void)target, (void)plan, (void)layout, (void)input, (void)values, (void)scales, (void)bias;
  return absl::UnimplementedError("--target: this wprep was built without the RPC client; use --local");
#endif
}

// `wprep quantize`'s flags: the parser and --help.
flags::FlagSet QuantizeFlags() {
  flags::FlagSet fs = CommandFlags(
      "quantize",
      "usage: wprep quantize (--local | --target ADDR) --dtype T --shape D0,...,Q --input FILE\n"
      "         --values-output FILE --scales-output FILE [flags]\n"
      "Quantizes little-endian row-major weights [..., Q] to canonical MXFP4 values\n"
      "[..., ceil(Q/2)] and e8m0 scales [..., ceil(Q/32)] (groups of 32 along the last axis;\n"
      "docs/LAYOUTS.md, \"Quantization to MXFP4\").\n");
  fs.Switch("local", "quantize in this process");
  fs.String("target", "ADDR", "",
            "the daemon quantizes (a quantize batch item, on its CPU engine): unix:///path.sock or "
            "HOST:PORT");
  fs.String("device", "cpu|cuda:N", "cpu", "with --local: where it runs");
  fs.String("dtype", "T", "", "the input's type: bfloat16, float16 or float32");
  fs.String("shape", "D0,...,Q", "", "the input's shape");
  fs.String("scale-rounding", "up|down", "up", "how a group's scale rounds");
  fs.String("layout", "L", "",
            "a weight stored [..., N, K], quantized along K: write the layout of the matmul's "
            "logical [..., K, N] directly (fused, K even): blackwell_value or "
            "blackwell_shuffled_value (scales blackwell_scale) or hopper_value (mx_axis -2; scales "
            "hopper_scale, mx_axis -2); or trtllm_w13 / trtllm_w2 (see --align)");
  AddSpecFlags(&fs, {"mma-version", "num-warps", "align-k", "block-k", "block-n"});
  fs.String("align", "N", "256",
            "trtllm_w13 / trtllm_w2: expert weights [E, R, K] to the trtllm-gen MXFP4 prepare_w13 / "
            "prepare_w2 bytes, H and I padded to a multiple of N (a multiple of 128)");
  fs.String("bias-input", "FILE", "", "trtllm layouts: the experts' bias [E, R] to prepare beside them");
  fs.String("bias-dtype", "float32|bfloat16", "float32", "the bias's type");
  fs.String("bias-output", "FILE", "", "where the prepared bias [E, rows] float32 goes");
  fs.String("input", "FILE", "", "the weights");
  fs.String("values-output", "FILE", "", "where the MXFP4 values go");
  fs.String("scales-output", "FILE", "", "where the e8m0 scales go");
  return fs;
}

// --layout and the flags of its family (each refused for another layout): the layout a
// quantization writes, with its parameters.
absl::StatusOr<QuantLayoutSpec> ParseLayoutFlags(const Flags& flags) {
  QuantLayoutSpec layout;
  if (const std::string* l = flags.Get("--layout"); l != nullptr) {
    if (*l == "blackwell_value") {
      layout.layout = QuantLayout::kBlackwell;
    } else if (*l == "hopper_value") {
      layout.layout = QuantLayout::kHopper;
    } else if (*l == "trtllm_w13" || *l == "trtllm_w2") {
      layout.layout = *l == "trtllm_w13" ? QuantLayout::kTrtllmW13 : QuantLayout::kTrtllmW2;
    } else if (*l == "blackwell_shuffled_value") {
      layout.layout = QuantLayout::kBlackwellShuffled;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--layout: '", *l,
                                                     "' is not a layout a quantization writes (blackwell_value, "
                                                     "blackwell_shuffled_value, hopper_value, trtllm_w13, trtllm_w2)"));
    }
  }
  const bool hopper = layout.layout == QuantLayout::kHopper;
  const bool shuffled = layout.layout == QuantLayout::kBlackwellShuffled;
  const bool trtllm = layout.layout == QuantLayout::kTrtllmW13 || layout.layout == QuantLayout::kTrtllmW2;
  struct Family {
    const char* flag;
    bool allowed;
    const char* layouts;
  };
  for (const Family& f : {Family{"--mma-version", hopper, "hopper_value"}, Family{"--num-warps", hopper, "hopper_value"},
                          Family{"--align-k", hopper, "hopper_value"},
                          Family{"--block-k", shuffled, "blackwell_shuffled_value"},
                          Family{"--block-n", shuffled, "blackwell_shuffled_value"},
                          Family{"--align", trtllm, "trtllm_w13 or trtllm_w2"},
                          Family{"--bias-input", trtllm, "trtllm_w13 or trtllm_w2"},
                          Family{"--bias-dtype", trtllm, "trtllm_w13 or trtllm_w2"},
                          Family{"--bias-output", trtllm, "trtllm_w13 or trtllm_w2"}}) {
    if (!f.allowed && flags.Has(f.flag)) {
      return absl::InvalidArgumentError(absl::StrCat(f.flag, " is for --layout ", f.layouts));
    }
  }
  if (flags.Has("--bias-input") != flags.Has("--bias-output")) {
    return absl::InvalidArgumentError("--bias-input and --bias-output go together");
  }
  const std::pair<const char*, int*> params[] = {{"--mma-version", &layout.mma_version},
                                                 {"--num-warps", &layout.num_warps},
                                                 {"--align-k", &layout.align_k},
                                                 {"--block-k", &layout.block_k},
                                                 {"--block-n", &layout.block_n}};
  for (const auto& [flag, dst] : params) {
    absl::StatusOr<int64_t> v = flags.Int(flag, *dst);
    if (!v.ok()) return v.status();
    if (*v < 0 || *v > 1 << 20) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", *v, " is out of range"));
    *dst = static_cast<int>(*v);
  }
  absl::StatusOr<int64_t> align = flags.Int("--align", layout.align);
  if (!align.ok()) return align.status();
  layout.align = *align;
  return layout;
}

absl::Status Run(const std::vector<std::string>& args) {
  auto flags = Flags::Parse(args, QuantizeFlags());
  if (!flags.ok()) return flags.status();
  const bool remote = flags->Has("--target");
  if (remote == flags->Has("--local")) {
    return absl::InvalidArgumentError("quantize: give one of --local and --target (see wprep quantize --help)");
  }
  if (remote && flags->Has("--device")) {
    return absl::InvalidArgumentError("--device is for --local; with --target the daemon picks the engine");
  }
  absl::StatusOr<QuantLayoutSpec> parsed_layout = ParseLayoutFlags(*flags);
  if (!parsed_layout.ok()) return parsed_layout.status();
  const QuantLayoutSpec layout = *parsed_layout;
  const bool trtllm = layout.layout == QuantLayout::kTrtllmW13 || layout.layout == QuantLayout::kTrtllmW2;
  BiasIo bias;
  if (const std::string* d = flags->Get("--bias-dtype"); d != nullptr) {
    if (*d != "float32" && *d != "bfloat16") {
      return absl::InvalidArgumentError(absl::StrCat("--bias-dtype: '", *d, "' is not float32 or bfloat16"));
    }
    bias.bf16 = *d == "bfloat16";
  }
  int device = -1;
  if (const std::string* d = flags->Get("--device"); d != nullptr) {
    absl::StatusOr<int> parsed = ParseDevice(*d);
    if (!parsed.ok()) return parsed.status();
    device = *parsed;
  }
  for (const char* required : {"--dtype", "--shape", "--input", "--values-output",
                               "--scales-output"}) {
    if (!flags->Has(required)) {
      return absl::InvalidArgumentError(
          absl::StrCat(required, " is required (see wprep quantize --help)"));
    }
  }
  auto dtype = ParseQuantDtype(*flags->Get("--dtype"));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--", dtype.status().message()));
  ScaleRounding rounding = ScaleRounding::kUp;
  if (const std::string* r = flags->Get("--scale-rounding"); r != nullptr) {
    auto parsed = ParseScaleRounding(*r);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", parsed.status().message()));
    }
    rounding = *parsed;
  }
  auto shape = flags->IntList("--shape");
  if (!shape.ok()) return shape.status();
  auto plan = MakeQuantizePlan(*dtype, *shape, rounding);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", plan.status().message()));
  }
  auto input = ReadWholeFile(*flags->Get("--input"));
  if (!input.ok()) return input.status();
  if (static_cast<int64_t>(input->size()) != plan->input_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--input: '", *flags->Get("--input"), "' has ", input->size(), " bytes; ",
        *flags->Get("--dtype"), " [", absl::StrJoin(*shape, ","), "] needs ", plan->input_bytes));
  }
  auto sizes = PlanQuantizeLayout(*plan, layout);
  if (!sizes.ok()) return absl::InvalidArgumentError(absl::StrCat("--", sizes.status().message()));
  const int64_t values_bytes = sizes->values_bytes, scales_bytes = sizes->scales_bytes;
  std::vector<uint8_t> values(static_cast<size_t>(values_bytes));
  std::vector<uint8_t> scales(static_cast<size_t>(scales_bytes));
  std::vector<uint8_t> bias_out;
  absl::StatusOr<std::vector<uint8_t>> bias_in;
  if (const std::string* b = flags->Get("--bias-input"); b != nullptr) {
    bias_in = ReadWholeFile(*b);
    if (!bias_in.ok()) return bias_in.status();
    const uint64_t want = static_cast<uint64_t>(plan->rows) * (bias.bf16 ? 2 : 4);
    if (bias_in->size() != want) {
      return absl::InvalidArgumentError(absl::StrCat("--bias-input: '", *b, "' has ", bias_in->size(), " bytes; ",
                                                     bias.bf16 ? "bfloat16" : "float32", " [E, R] needs ", want));
    }
    bias_out.resize(static_cast<size_t>(sizes->bias_bytes));
    bias.in = &*bias_in;
    bias.out = &bias_out;
  }
  absl::Status done;
  QuantBias qb;  // host buffers, for the local engines
  if (bias.in != nullptr) qb = {bias.in->data(), bias.bf16, bias.out->data()};
  if (remote) {
    done = QuantizeRemote(*flags->Get("--target"), *plan, layout, *input, &values, &scales, bias);
  } else if (device >= 0) {
    done = QuantizeHostBuffersOnCuda(*plan, input->data(), input->size(), values.data(), values.size(),
                                     scales.data(), scales.size(), device, layout, qb);
  } else {
    done = QuantizeLayoutOnCpu(*plan, layout, input->data(), input->size(), values.data(), values.size(),
                               scales.data(), scales.size(), qb);
  }
  if (!done.ok()) return done;
  if (absl::Status s = WriteFileAtomically(*flags->Get("--values-output"), values.data(),
                                           values.size());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = WriteFileAtomically(*flags->Get("--scales-output"), scales.data(),
                                           scales.size());
      !s.ok()) {
    // Both outputs or neither: a values file without its scales is useless and misleading.
    std::remove(flags->Get("--values-output")->c_str());
    return s;
  }
  if (bias.in != nullptr) {
    if (absl::Status s = WriteFileAtomically(*flags->Get("--bias-output"), bias_out.data(), bias_out.size()); !s.ok()) {
      std::remove(flags->Get("--values-output")->c_str());
      std::remove(flags->Get("--scales-output")->c_str());
      return s;
    }
  }
  if (trtllm) {
    std::printf("values_shape [%s] scales_shape [%s] (%s)\n", absl::StrJoin(sizes->values_shape, ", ").c_str(),
                absl::StrJoin(sizes->scales_shape, ", ").c_str(), sizes->moe_plan->identity.c_str());
  } else if (layout.layout != QuantLayout::kCanonical) {
    std::printf("values_bytes %lld (%s) scales_bytes %lld (%s)\n", static_cast<long long>(values_bytes),
                std::string(LayoutName(QuantLayoutConversion(layout, true).layout)).c_str(),
                static_cast<long long>(scales_bytes),
                std::string(LayoutName(QuantLayoutConversion(layout, false).layout)).c_str());
  } else {
    std::printf("values_shape [%s] scales_shape [%s]\n",
                absl::StrJoin(plan->values_shape, ", ").c_str(),
                absl::StrJoin(plan->scales_shape, ", ").c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int QuantizeCommand(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(QuantizeFlags().Usage().c_str(), stdout);
      return 0;
    }
  }
  absl::Status s = Run(args);
  return s.ok() ? 0 : Fail(s);
}

}  // namespace wprep::cli
