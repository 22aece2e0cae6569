#include "rpc/quantize_item.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "exec/gpu_queues.h"
#include "rpc/proto_translate.h"
#include "wprep/kernels/moe.h"
#include "wprep/kernels/plan.h"
#include "wprep/spec/status_macros.h"
#include "wprep/proto/spec_codec.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

absl::StatusOr<QuantDtype> DTypeFromProto(v1::QuantizeDType d, const std::string& field) {
  switch (d) {
    case v1::QUANTIZE_DTYPE_BFLOAT16:
      return QuantDtype::kBfloat16;
    case v1::QUANTIZE_DTYPE_FLOAT16:
      return QuantDtype::kFloat16;
    case v1::QUANTIZE_DTYPE_FLOAT32:
      return QuantDtype::kFloat32;
    default:
      return Bad(absl::StrCat(field, " must be QUANTIZE_DTYPE_BFLOAT16, QUANTIZE_DTYPE_FLOAT16 or "
                              "QUANTIZE_DTYPE_FLOAT32, got ", static_cast<int>(d)));
  }
}

absl::StatusOr<ScaleRounding> RoundingFromProto(v1::ScaleRounding r, const std::string& field) {
  switch (r) {
    case v1::SCALE_ROUNDING_UNSPECIFIED:
    case v1::SCALE_ROUNDING_UP:
      return ScaleRounding::kUp;
    case v1::SCALE_ROUNDING_DOWN:
      return ScaleRounding::kDown;
    default:
      return Bad(absl::StrCat(field, " must be SCALE_ROUNDING_UP or SCALE_ROUNDING_DOWN, got ", static_cast<int>(r)));
  }
}

const char* DTypeName(QuantDtype d) {
  switch (d) {
    case QuantDtype::kBfloat16:
      return "bfloat16";
    case QuantDtype::kFloat16:
      return "float16";
    case QuantDtype::kFloat32:
      return "float32";
  }
  return "?";
}

absl::StatusOr<QuantizeJob> JobFromProto(const v1::QuantizeItem& item, const std::string& prefix,
                                         const MoeLimits& limits) {
  QuantizeJob job;
  absl::StatusOr<QuantDtype> dtype = DTypeFromProto(item.dtype(), prefix + ".dtype");
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<ScaleRounding> rounding = RoundingFromProto(item.scale_rounding(), prefix + ".scale_rounding");
  if (!rounding.ok()) return rounding.status();
  switch (item.layout()) {
    case v1::QUANTIZE_LAYOUT_UNSPECIFIED:
    case v1::QUANTIZE_LAYOUT_CANONICAL:
      break;
    case v1::QUANTIZE_LAYOUT_BLACKWELL:
      job.layout.layout = QuantLayout::kBlackwell;
      break;
    case v1::QUANTIZE_LAYOUT_HOPPER:
      job.layout.layout = QuantLayout::kHopper;
      break;
    case v1::QUANTIZE_LAYOUT_TRTLLM_W13:
      job.layout.layout = QuantLayout::kTrtllmW13;
      break;
    case v1::QUANTIZE_LAYOUT_TRTLLM_W2:
      job.layout.layout = QuantLayout::kTrtllmW2;
      break;
    case v1::QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED:
      job.layout.layout = QuantLayout::kBlackwellShuffled;
      break;
    default:
      return Bad(absl::StrCat(prefix, ".layout must be QUANTIZE_LAYOUT_CANONICAL, QUANTIZE_LAYOUT_BLACKWELL, ",
                              "QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED, QUANTIZE_LAYOUT_HOPPER, ",
                              "QUANTIZE_LAYOUT_TRTLLM_W13 or QUANTIZE_LAYOUT_TRTLLM_W2, got ",
                              static_cast<int>(item.layout())));
  }
  const bool trtllm = job.layout.layout == QuantLayout::kTrtllmW13 || job.layout.layout == QuantLayout::kTrtllmW2;
  const std::pair<const char*, bool> trtllm_only[] = {{".align", item.has_align()},
                                                      {".bias", item.has_bias()},
                                                      {".bias_dtype", item.bias_dtype() != v1::QUANTIZE_DTYPE_UNSPECIFIED},
                                                      {".bias_out", item.has_bias_out()}};
  for (const auto& [field, set] : trtllm_only) {
    if (set && !trtllm) {
      return Bad(absl::StrCat(prefix, field, " is for layouts QUANTIZE_LAYOUT_TRTLLM_W13 and _W2 only; leave it unset"));
    }
  }
  if (item.has_align()) job.layout.align = item.align();
  if (job.layout.layout != QuantLayout::kHopper && (item.has_hopper() || item.has_hopper_scale())) {
    return Bad(absl::StrCat(prefix, item.has_hopper() ? ".hopper" : ".hopper_scale",
                            " is for layout QUANTIZE_LAYOUT_HOPPER only; leave it unset"));
  }
  if (job.layout.layout != QuantLayout::kBlackwellShuffled && item.has_blackwell()) {
    return Bad(absl::StrCat(prefix, ".blackwell is for layout QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED only; leave it unset"));
  }
  if (item.blackwell().has_block_k() || item.blackwell().has_block_n()) {
    const std::pair<const char*, int64_t> blocks[] = {{".blackwell.block_k", item.blackwell().block_k()},
                                                      {".blackwell.block_n", item.blackwell().block_n()}};
    for (const auto& [field, v] : blocks) {
      if (v < 1 || v > 4096) return Bad(absl::StrCat(prefix, field, " must be in [1, 4096], got ", v));
    }
    if (item.blackwell().has_block_k()) job.layout.block_k = static_cast<int>(item.blackwell().block_k());
    if (item.blackwell().has_block_n()) job.layout.block_n = static_cast<int>(item.blackwell().block_n());
  }
  if (job.layout.layout == QuantLayout::kHopper) {
    const std::pair<const char*, bool> axes[] = {
        {".hopper.mx_axis", item.hopper().has_mx_axis() && item.hopper().mx_axis() != -2},
        {".hopper_scale.mx_axis", item.hopper_scale().has_mx_axis() && item.hopper_scale().mx_axis() != -2}};
    for (const auto& [field, bad] : axes) {
      if (bad) {
        return Bad(absl::StrCat(prefix, field, " must be -2 (or unset): a weight quantized along K has its scale ",
                                "groups on the matmul's reduction axis, logical axis -2"));
      }
    }
    if (item.hopper().has_mma_version()) job.layout.mma_version = item.hopper().mma_version();
    if (item.hopper_scale().has_num_warps()) job.layout.num_warps = item.hopper_scale().num_warps();
    if (item.hopper_scale().has_align_k()) job.layout.align_k = item.hopper_scale().align_k();
  }
  absl::StatusOr<QuantizePlan> plan = MakeQuantizePlan(*dtype, ShapeFromProto(item.shape()), *rounding);
  if (!plan.ok()) return Bad(absl::StrCat(prefix, ".shape: ", plan.status().message()));
  job.plan = *std::move(plan);
  absl::StatusOr<QuantOutputSizes> out_sizes = PlanQuantizeLayout(job.plan, job.layout);
  if (!out_sizes.ok()) {
    return Bad(absl::StrCat(prefix, ".layout ", v1::QuantizeLayout_Name(item.layout()), ": ",
                            out_sizes.status().message()));
  }
  job.values_bytes = static_cast<uint64_t>(out_sizes->values_bytes);
  job.scales_bytes = static_cast<uint64_t>(out_sizes->scales_bytes);
  job.values_shape = out_sizes->values_shape;
  job.scales_shape = out_sizes->scales_shape;
  job.values_strides = out_sizes->values_strides;
  job.scales_strides = out_sizes->scales_strides;
  if (trtllm) {
    job.moe_plan = out_sizes->moe_plan;
    if (item.has_bias()) {
      if (item.bias_dtype() != v1::QUANTIZE_DTYPE_FLOAT32 && item.bias_dtype() != v1::QUANTIZE_DTYPE_BFLOAT16) {
        return Bad(absl::StrCat(prefix, ".bias_dtype must be QUANTIZE_DTYPE_FLOAT32 or QUANTIZE_DTYPE_BFLOAT16, got ",
                                static_cast<int>(item.bias_dtype())));
      }
      job.bias = true;
      job.bias_bf16 = item.bias_dtype() == v1::QUANTIZE_DTYPE_BFLOAT16;
      job.bias_in_bytes = static_cast<uint64_t>(job.plan.rows) * (job.bias_bf16 ? 2 : 4);
      job.bias_out_bytes = static_cast<uint64_t>(out_sizes->bias_bytes);
      job.bias_shape = out_sizes->bias_shape;
    } else if (item.bias_dtype() != v1::QUANTIZE_DTYPE_UNSPECIFIED || item.has_bias_out()) {
      return Bad(absl::StrCat(prefix, item.has_bias_out() ? ".bias_out" : ".bias_dtype", " is set without .bias"));
    }
  }
  const uint64_t input_bytes = static_cast<uint64_t>(job.plan.input_bytes);
  const std::pair<const char*, uint64_t> sizes[] = {
      {"source", input_bytes}, {"values", job.values_bytes}, {"scales", job.scales_bytes}};
  for (const auto& [what, bytes] : sizes) {
    if (bytes > limits.max_tensor_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(prefix, ".", what, " has ", bytes,
                                                       " bytes, more than --max-tensor-bytes=", limits.max_tensor_bytes));
    }
  }
  const v1::TensorSource& src = item.source();
  if (src.kind_case() == v1::TensorSource::KIND_NOT_SET) {
    return Bad(absl::StrCat(prefix, ".source is not set: give inline_bytes or ipc"));
  }
  if (src.inline_strides_size() != 0) {
    return Bad(absl::StrCat(prefix, ".source.inline_strides must be empty: the tensor is dense, row-major"));
  }
  job.ipc = src.has_ipc();
  if (!job.ipc) {
    if (src.inline_bytes().size() != input_bytes) {
      return Bad(absl::StrCat(prefix, ".source.inline_bytes has ", src.inline_bytes().size(), " bytes; ",
                              DTypeName(job.plan.dtype), " [", absl::StrJoin(job.plan.input_shape, ","), "] needs ",
                              input_bytes));
    }
    if (item.values().has_ipc() || item.scales().has_ipc() || item.bias_out().has_ipc()) {
      return Bad(absl::StrCat(prefix, item.values().has_ipc() ? ".values" : item.scales().has_ipc() ? ".scales" : ".bias_out",
                              ".ipc: an item with an inline source returns its outputs inline"));
    }
    job.input = src.inline_bytes();
    if (job.bias) {
      if (item.bias().has_ipc() || item.bias().inline_strides_size() != 0 ||
          item.bias().inline_bytes().size() != job.bias_in_bytes) {
        return Bad(absl::StrCat(prefix, ".bias: an item with an inline source takes an inline, dense bias of ",
                                job.bias_in_bytes, " bytes ([E, R] ", job.bias_bf16 ? "bfloat16" : "float32", "), got ",
                                item.bias().has_ipc() ? "IPC" : absl::StrCat(item.bias().inline_bytes().size(), " bytes")));
      }
      job.bias_input = item.bias().inline_bytes();
    }
    return job;
  }
  absl::StatusOr<IpcRegion> in = DenseRegionFromProto(src.ipc(), input_bytes, prefix + ".source.ipc");
  if (!in.ok()) return in.status();
  // The kernels read whole elements: a source that splits one would fault the GPU.
  const int esize = QuantDtypeBytes(job.plan.dtype);
  if (in->offset % static_cast<uint64_t>(esize) != 0) {
    return Bad(absl::StrCat(prefix, ".source.ipc.offset is ", in->offset, ", not a multiple of the ",
                            DTypeName(job.plan.dtype), " element size ", esize,
                            ": give the tensor's own offset in its allocation"));
  }
  job.input_ipc = *std::move(in);
  const std::pair<const char*, const v1::TensorDestination*> outs[] = {{"values", &item.values()},
                                                                       {"scales", &item.scales()}};
  IpcRegion* regions[] = {&job.values_ipc, &job.scales_ipc};
  const uint64_t out_bytes[] = {job.values_bytes, job.scales_bytes};
  for (int j = 0; j < 2; ++j) {
    const std::string field = absl::StrCat(prefix, ".", outs[j].first);
    if (!outs[j].second->has_ipc()) {
      return Bad(absl::StrCat(field, ".ipc is not set: an item with an IPC source writes both outputs to IPC "
                              "memory on its GPU"));
    }
    absl::StatusOr<IpcRegion> r = DenseRegionFromProto(outs[j].second->ipc(), out_bytes[j], field + ".ipc");
    if (!r.ok()) return r.status();
    if (r->gpu != job.input_ipc.gpu) {
      return Bad(absl::StrCat(field, ".ipc.device_uuid: the source and both outputs must be on one GPU"));
    }
    *regions[j] = *std::move(r);
  }
  // The kernel reads the source while it writes: no output may overlap it, or the other.
  for (int j = 0; j < 2; ++j) {
    if (IpcRegionsOverlap(*regions[j], out_bytes[j], job.input_ipc, input_bytes)) {
      return Bad(absl::StrCat(prefix, ".", outs[j].first, ".ipc overlaps source.ipc: give another buffer"));
    }
  }
  if (IpcRegionsOverlap(job.values_ipc, job.values_bytes, job.scales_ipc, job.scales_bytes)) {
    return Bad(absl::StrCat(prefix, ".scales.ipc overlaps values.ipc: give another buffer"));
  }
  if (job.bias) {
    if (!item.bias().has_ipc() || !item.bias_out().has_ipc()) {
      return Bad(absl::StrCat(prefix, !item.bias().has_ipc() ? ".bias.ipc" : ".bias_out.ipc",
                              " is not set: an item with an IPC source takes its bias and writes it as IPC memory"));
    }
    absl::StatusOr<IpcRegion> bin = DenseRegionFromProto(item.bias().ipc(), job.bias_in_bytes, prefix + ".bias.ipc");
    if (!bin.ok()) return bin.status();
    absl::StatusOr<IpcRegion> bout = DenseRegionFromProto(item.bias_out().ipc(), job.bias_out_bytes, prefix + ".bias_out.ipc");
    if (!bout.ok()) return bout.status();
    if (bin->gpu != job.input_ipc.gpu || bout->gpu != job.input_ipc.gpu) {
      return Bad(absl::StrCat(prefix, bin->gpu != job.input_ipc.gpu ? ".bias" : ".bias_out",
                              ".ipc.device_uuid: the source, the bias and the outputs must be on one GPU"));
    }
    job.bias_ipc = *std::move(bin);
    job.bias_out_ipc = *std::move(bout);
    const std::pair<const IpcRegion*, uint64_t> others[] = {{&job.input_ipc, input_bytes},
                                                            {&job.values_ipc, job.values_bytes},
                                                            {&job.scales_ipc, job.scales_bytes},
                                                            {&job.bias_ipc, job.bias_in_bytes}};
    for (const auto& [region, bytes] : others) {
      if (IpcRegionsOverlap(job.bias_out_ipc, job.bias_out_bytes, *region, bytes)) {
        return Bad(absl::StrCat(prefix, ".bias_out.ipc overlaps another operand of the item: give another buffer"));
      }
    }
    for (const auto& [region, bytes] : {std::pair{&job.values_ipc, job.values_bytes}, std::pair{&job.scales_ipc, job.scales_bytes}}) {
      if (IpcRegionsOverlap(*region, bytes, job.bias_ipc, job.bias_in_bytes)) {
        return Bad(absl::StrCat(prefix, ".bias.ipc overlaps an output of the item: give another buffer"));
      }
    }
  }
  return job;
}

// The identity of an output: what produced it, in the LayoutIdentity form of convert items.
v1::LayoutIdentity IdentityOf(const QuantizeJob& job, bool values) {
  const std::string quantize =
      absl::StrCat(DTypeName(job.plan.dtype), " -> quantize_mxfp4(scale_rounding=",
                   job.plan.rounding == ScaleRounding::kUp ? "up" : "down", ")");
  v1::LayoutIdentity id;
  if (job.moe_plan.has_value()) {
    id.set_layout(job.moe_plan->identity);
    id.set_conversion(absl::StrCat(quantize, " -> ", job.moe_plan->identity));
    id.set_contract_version(kMoeContractVersion);
    return id;
  }
  if (job.layout.layout != QuantLayout::kCanonical) {
    id = IdentityToProto(QuantLayoutConversion(job.layout, values));
    id.set_conversion(absl::StrCat(quantize, " -> ", id.conversion()));
    return id;
  }
  id.set_layout(values ? "canonical(packing_axis=-1)" : "scales");
  id.set_conversion(absl::StrCat(quantize, " -> ", id.layout()));
  id.set_contract_version(kLayoutContractVersion);
  return id;
}

void AddOutput(const QuantizeJob& job, bool values, v1::BatchItemResult* item) {
  v1::TensorResult* t = item->add_outputs();
  t->set_name(values ? "values" : "scales");
  const std::vector<int64_t>& shape = values ? job.values_shape : job.scales_shape;
  for (int64_t d : shape) t->add_shape(d);
  for (int64_t s : values ? job.values_strides : job.scales_strides) t->add_strides(s);
  t->set_bytes(values ? job.values_bytes : job.scales_bytes);
  *t->mutable_identity() = IdentityOf(job, values);
  if (job.moe_plan.has_value()) {
    t->set_dtype(v1::MOE_DTYPE_UINT8);
    *t->mutable_moe_identity() = MoeIdentityOf(*job.moe_plan);
  }
}

void AddBiasOutput(const QuantizeJob& job, v1::BatchItemResult* item) {
  v1::TensorResult* t = item->add_outputs();
  t->set_name("bias");
  for (int64_t d : job.bias_shape) t->add_shape(d);
  for (int64_t s : DenseStrides(job.bias_shape)) t->add_strides(s);
  t->set_bytes(job.bias_out_bytes);
  t->set_dtype(v1::MOE_DTYPE_FLOAT32);
  *t->mutable_identity() = IdentityOf(job, true);
  *t->mutable_moe_identity() = MoeIdentityOf(*job.moe_plan);
}

// An IPC job's GPU and mapped regions (leases held until its GPU's work is done).
struct Mapped {
  Gpu* gpu = nullptr;
  IpcCache::Lease in, values, scales, bias, bias_out;
};

absl::StatusOr<Mapped> MapJob(const QuantizeJob& job, const std::string& prefix, const MoeEngines& engines) {
  Mapped m;
  absl::StatusOr<Gpu*> gpu = engines.devices->FindByUuid(job.input_ipc.gpu);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(),
                        absl::StrCat(prefix, ".source.ipc.device_uuid: ", gpu.status().message()));
  }
  m.gpu = *gpu;
  const std::pair<const IpcRegion*, IpcCache::Lease*> regions[] = {{&job.input_ipc, &m.in},
                                                                    {&job.values_ipc, &m.values},
                                                                    {&job.scales_ipc, &m.scales},
                                                                    {&job.bias_ipc, &m.bias},
                                                                    {&job.bias_out_ipc, &m.bias_out}};
  const char* names[] = {"source", "values", "scales", "bias", "bias_out"};
  for (int i = 0; i < (job.bias ? 5 : 3); ++i) {
    const IpcRegion& r = *regions[i].first;
    absl::StatusOr<IpcCache::Lease> l = engines.ipc->Acquire(m.gpu->ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) {
      return absl::Status(l.status().code(), absl::StrCat(prefix, ".", names[i], ".ipc: ", l.status().message()));
    }
    *regions[i].second = *std::move(l);
  }
  return m;
}


// Queues an IPC job on its GPU's stream of the batch.
absl::Status Queue(const QuantizeJob& job, const Mapped& m, size_t index, GpuQueues& queues) {
  absl::StatusOr<Stream> stream = queues.StreamOf(*m.gpu);
  if (!stream.ok()) return stream.status();
  QuantBias bias;
  if (job.bias) bias = {m.bias.ptr(), job.bias_bf16, m.bias_out.ptr()};
  WPREP_RETURN_IF_ERROR(m.gpu->runtime().Quantize(m.gpu->ordinal(), job.plan, job.layout, m.in.ptr(),
                                                  m.values.ptr(), m.scales.ptr(), bias, *stream));
  queues.Queued(*m.gpu, index);
  return absl::OkStatus();
}

absl::Status RunInline(const QuantizeJob& job, v1::BatchItemResult* item) {
  std::string* values = item->mutable_outputs(0)->mutable_inline_bytes();
  std::string* scales = item->mutable_outputs(1)->mutable_inline_bytes();
  values->resize(job.values_bytes);
  scales->resize(job.scales_bytes);
  const auto* in = reinterpret_cast<const uint8_t*>(job.input.data());
  auto* v = reinterpret_cast<uint8_t*>(values->data());
  auto* s = reinterpret_cast<uint8_t*>(scales->data());
  const absl::Time start = absl::Now();
  QuantBias bias;
  if (job.bias) {
    std::string* out = item->mutable_outputs(2)->mutable_inline_bytes();
    out->resize(job.bias_out_bytes);
    bias = {job.bias_input.data(), job.bias_bf16, out->data()};
  }
  absl::Status st = QuantizeLayoutOnCpu(job.plan, job.layout, in, job.input.size(), v, values->size(), s,
                                        scales->size(), bias);
  item->set_engine("cpu");
  item->set_kernel_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return st;
}

}  // namespace

bool HasQuantizeItems(const v1::ConvertBatchRequest& req) {
  for (const v1::BatchItem& item : req.items()) {
    if (item.has_quantize()) return true;
  }
  return false;
}

absl::StatusOr<std::vector<QuantizeJob>> QuantizeJobsFromProto(const v1::ConvertBatchRequest& req,
                                                               const MoeLimits& limits) {
  if (absl::Status s = CheckBatchSize(req, limits); !s.ok()) return s;
  std::vector<QuantizeJob> jobs;
  jobs.reserve(static_cast<size_t>(req.items_size()));
  uint64_t inline_out = 0;
  for (int i = 0; i < req.items_size(); ++i) {
    const std::string prefix = absl::StrCat("items[", i, "]");
    if (!req.items(i).has_quantize()) {
      return Bad(absl::StrCat(prefix, ": a batch holds items of one kind (convert, moe or quantize); send the ",
                              req.items(i).has_moe() ? "moe" : req.items(i).has_convert() ? "convert" : "unset",
                              " item in another batch"));
    }
    absl::StatusOr<QuantizeJob> job = JobFromProto(req.items(i).quantize(), prefix + ".quantize", limits);
    if (!job.ok()) return job.status();
    if (!job->ipc) inline_out += job->values_bytes + job->scales_bytes + job->bias_out_bytes;
    jobs.push_back(*std::move(job));
  }
  if (inline_out > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the batch's inline outputs total ", inline_out,
                                                     " bytes, more than --max-message-bytes=",
                                                     limits.max_message_bytes, "; split it or use IPC outputs"));
  }
  return jobs;
}

absl::Status RunQuantizeJobs(const std::vector<QuantizeJob>& jobs, const MoeEngines& engines, absl::Time deadline,
                             v1::ConvertBatchResponse* resp) {
  // Every IPC job's GPU and memory first: a bad one fails the batch before any work.
  std::vector<Mapped> mapped(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!jobs[i].ipc) continue;
    absl::StatusOr<Mapped> m = MapJob(jobs[i], absl::StrCat("items[", i, "].quantize"), engines);
    if (!m.ok()) return m.status();
    mapped[i] = *std::move(m);
  }
  // IPC jobs: one stream per GPU, every job queued on it, one wait per GPU.
  GpuQueues queues(deadline);
  absl::Status failed;
  for (size_t i = 0; i < jobs.size() && failed.ok(); ++i) {
    v1::BatchItemResult* item = resp->add_items();
    AddOutput(jobs[i], true, item);
    AddOutput(jobs[i], false, item);
    if (jobs[i].bias) AddBiasOutput(jobs[i], item);
    failed = jobs[i].ipc ? Queue(jobs[i], mapped[i], i, queues) : RunInline(jobs[i], item);
    if (!failed.ok()) failed = absl::Status(failed.code(), absl::StrCat("items[", i, "].quantize: ", failed.message()));
  }
  // Every queued stream is waited for, also after a failure. The GPU's items ran together:
  // each reports the batch's time on that GPU.
  absl::Status waited = queues.WaitAll([&](Gpu& gpu, const std::vector<size_t>& items, double seconds) {
    for (size_t i : items) {
      resp->mutable_items(static_cast<int>(i))->set_engine(gpu.engine_name());
      resp->mutable_items(static_cast<int>(i))->set_kernel_seconds(seconds);
    }
  });
  return failed.ok() ? waited : failed;
}

}  // namespace wprep::server
