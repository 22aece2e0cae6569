#include "rpc/moe_item.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "exec/gpu_queues.h"
#include "rpc/proto_translate.h"
#include "wprep/proto/spec_codec.h"

namespace wprep::server {

namespace v1 = wprep::v1;

namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

// The typed wire params -> the engine's, marking each one given (the engine checks which
// an op takes, and their ranges). Errors name `field`.
absl::StatusOr<MoeParams> ParamsFromProto(const v1::MoeParams& p, const std::string& field) {
  MoeParams out;
  if (p.has_format()) {
    absl::StatusOr<MoeFormat> f = ParseMoeFormat(p.format());
    if (!f.ok()) return Bad(absl::StrCat(field, ".format: ", f.status().message()));
    out.format = *f;
    out.given |= kMoeParamFormat;
  }
  auto set = [&](bool has, int64_t value, int64_t* dst, uint32_t bit) {
    if (!has) return;
    *dst = value;
    out.given |= bit;
  };
  if (p.has_gated()) {
    out.gated = p.gated();
    out.given |= kMoeParamGated;
  }
  set(p.has_align(), p.align(), &out.align, kMoeParamAlign);
  set(p.has_align_h(), p.align_h(), &out.align_h, kMoeParamAlignH);
  set(p.has_align_i(), p.align_i(), &out.align_i, kMoeParamAlignI);
  set(p.has_block_k(), p.block_k(), &out.block_k, kMoeParamBlockK);
  set(p.has_axis(), p.axis(), &out.axis, kMoeParamAxis);
  set(p.has_epilogue_tile_m(), p.epilogue_tile_m(), &out.epilogue_tile_m, kMoeParamEpilogueTileM);
  set(p.has_num_elts_per_sf(), p.num_elts_per_sf(), &out.num_elts_per_sf, kMoeParamNumEltsPerSf);
  return out;
}

// The params that shape an op's bytes, as it used them (defaults filled in).
void IdentityParams(const MoePlan& plan, v1::MoeParams* out) {
  const MoeParams& p = plan.params;
  switch (plan.op) {
    case MoeOp::kSwapPairs:
    case MoeOp::kSwapHalves:
      out->set_axis(p.axis);
      return;
    case MoeOp::kRowShuffle:
    case MoeOp::kBiasShuffle:
      out->set_epilogue_tile_m(p.epilogue_tile_m);
      return;
    case MoeOp::kScaleRowShuffle:
    case MoeOp::kShuffleSfA:
      out->set_epilogue_tile_m(p.epilogue_tile_m);
      out->set_num_elts_per_sf(p.num_elts_per_sf);
      return;
    case MoeOp::kBlockLayout:
      out->set_block_k(p.block_k);
      return;
    case MoeOp::kGatedActReorder:
    case MoeOp::kBlockScaleInterleave:
      return;
    case MoeOp::kPrepareW13:
    case MoeOp::kPrepareW2:
      break;
  }
  out->set_format(std::string(MoeFormatName(p.format)));
  if (p.format == MoeFormat::kMxfp4) {
    out->set_align(p.align);
    return;
  }
  if (plan.op == MoeOp::kPrepareW13) out->set_gated(p.gated);
  if (p.format == MoeFormat::kNvfp4) out->set_align_h(p.align_h);
  if (p.format == MoeFormat::kNvfp4 || p.format == MoeFormat::kFp8 || p.format == MoeFormat::kBf16) {
    out->set_align_i(p.align_i);
  }
}

// The engine names the operand first ("scales: ..."); on the wire it is a field of the
// item: "items[3].moe.scales: ...".
absl::Status NameInItem(const absl::Status& s, const std::string& item) {
  const absl::string_view m = s.message();
  for (absl::string_view name : {"x", "y", "values", "scales", "bias"}) {
    if (m.size() > name.size() && m.substr(0, name.size()) == name &&
        (m[name.size()] == ':' || m[name.size()] == ' ' || m[name.size()] == '.')) {
      return absl::Status(s.code(), absl::StrCat(item, ".", m));
    }
  }
  return absl::Status(s.code(), absl::StrCat(item, ": ", m));
}

absl::StatusOr<MoeJob> JobFromProto(const v1::MoeItem& item, const std::string& prefix, const MoeLimits& limits) {
  if (item.op().empty()) return Bad(absl::StrCat(prefix, ".op is empty: give a trtllm-gen op, e.g. prepare_w13"));
  absl::StatusOr<MoeOp> op = ParseMoeOp(item.op());
  if (!op.ok()) return Bad(absl::StrCat(prefix, ".op: ", op.status().message()));
  absl::StatusOr<MoeParams> params = ParamsFromProto(item.params(), prefix + ".params");
  if (!params.ok()) return params.status();
  if (item.inputs_size() == 0 || item.inputs_size() > 3) {
    return Bad(absl::StrCat(prefix, ".inputs has ", item.inputs_size(),
                            " entries: give one (x) or up to three (values, scales, bias)"));
  }
  if (item.outputs_size() > 3) {
    return Bad(absl::StrCat(prefix, ".outputs has ", item.outputs_size(), " entries, at most three"));
  }
  std::vector<MoeTensorDesc> descs;
  for (int k = 0; k < item.inputs_size(); ++k) {
    const v1::MoeInput& in = item.inputs(k);
    const std::string field = absl::StrCat(prefix, ".inputs[", k, "]");
    if (in.name().empty()) return Bad(absl::StrCat(field, ".name is empty: give x, values, scales or bias"));
    for (int j = 0; j < k; ++j) {
      if (item.inputs(j).name() == in.name()) {
        return Bad(absl::StrCat(field, ".name: '", in.name(), "' is also inputs[", j, "]"));
      }
    }
    MoeTensorDesc d;
    d.name = in.name();
    absl::StatusOr<MoeDType> dtype = MoeDTypeFromProto(in.dtype());
    if (!dtype.ok()) return Bad(absl::StrCat(field, ".dtype ", dtype.status().message()));
    d.dtype = *dtype;
    for (int64_t x : in.shape()) {
      if (x < 0) return Bad(absl::StrCat(prefix, ".", in.name(), ".shape has a negative dim ", x));
      d.shape.push_back(x);
    }
    if (in.source().kind_case() == v1::TensorSource::KIND_NOT_SET) {
      return Bad(absl::StrCat(prefix, ".", in.name(), ".source is not set: give inline_bytes or ipc"));
    }
    if (in.source().inline_strides_size() != 0) {
      return Bad(absl::StrCat(prefix, ".", in.name(),
                              ".source.inline_strides must be empty: MoE operands are dense, row-major"));
    }
    descs.push_back(std::move(d));
  }
  absl::StatusOr<MoePlan> plan = PlanMoe(*op, *params, std::move(descs));
  if (!plan.ok()) return NameInItem(plan.status(), prefix);
  MoeJob job;
  job.plan = *std::move(plan);
  // The requested destinations: each names one of the op's outputs, once.
  std::vector<std::string> out_names;
  for (const MoeTensorDesc& d : job.plan.outputs) out_names.push_back(d.name);
  for (int k = 0; k < item.outputs_size(); ++k) {
    const v1::MoeOutput& o = item.outputs(k);
    const std::string field = absl::StrCat(prefix, ".outputs[", k, "]");
    bool known = false;
    for (const std::string& n : out_names) known = known || n == o.name();
    if (!known) {
      return Bad(absl::StrCat(field, ".name: ", item.op(), " with these inputs writes ", absl::StrJoin(out_names, ", "),
                              "; no output is named '", o.name(), "'"));
    }
    for (int j = 0; j < k; ++j) {
      if (item.outputs(j).name() == o.name()) {
        return Bad(absl::StrCat(field, ".name: '", o.name(), "' is also outputs[", j, "]"));
      }
    }
  }
  const bool ipc = item.inputs(0).source().has_ipc();
  // The inline bytes, in the plan's order, each exactly its dense size.
  for (size_t i = 0; i < job.plan.inputs.size(); ++i) {
    const MoeTensorDesc& d = job.plan.inputs[i];
    const v1::MoeInput* in = nullptr;
    for (const v1::MoeInput& x : item.inputs()) {
      if (x.name() == d.name) in = &x;
    }
    if (in == nullptr) return absl::InternalError(absl::StrCat(prefix, ": the plan's input ", d.name, " is not given"));
    if (in->source().has_ipc() != ipc) {
      return Bad(absl::StrCat(prefix, ".", d.name, ".source: an item's inputs are all inline bytes or all CUDA IPC; ",
                              item.inputs(0).name(), " is ", ipc ? "IPC" : "inline"));
    }
    if (ipc) {
      absl::StatusOr<IpcRegion> r =
          DenseRegionFromProto(in->source().ipc(), job.plan.input_bytes[i], absl::StrCat(prefix, ".", d.name, ".source.ipc"));
      if (!r.ok()) return r.status();
      if (!job.input_ipc.empty() && r->gpu != job.input_ipc[0].gpu) {
        return Bad(absl::StrCat(prefix, ".", d.name, ".source.ipc.device_uuid: every operand of an item must be on one "
                                "GPU, and ", job.plan.inputs[0].name, " is on another"));
      }
      job.input_ipc.push_back(*std::move(r));
      job.input_bytes += job.plan.input_bytes[i];
      continue;
    }
    const std::string& bytes = in->source().inline_bytes();
    if (bytes.size() != job.plan.input_bytes[i]) {
      return Bad(absl::StrCat(prefix, ".", d.name, ".source.inline_bytes has ", bytes.size(), " bytes; ",
                              std::string(MoeDTypeName(d.dtype)), " [", absl::StrJoin(d.shape, ","), "] needs ",
                              job.plan.input_bytes[i]));
    }
    if (job.plan.input_bytes[i] > limits.max_tensor_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(prefix, ".", d.name, " has ", job.plan.input_bytes[i],
                                                       " bytes, more than --max-tensor-bytes=",
                                                       limits.max_tensor_bytes));
    }
    job.inputs.emplace_back(bytes);
    job.input_bytes += bytes.size();
  }
  for (size_t j = 0; j < job.plan.outputs.size(); ++j) {
    if (job.plan.output_bytes[j] > limits.max_tensor_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(prefix, ".", job.plan.outputs[j].name, " has ",
                                                       job.plan.output_bytes[j],
                                                       " bytes, more than --max-tensor-bytes=", limits.max_tensor_bytes));
    }
    job.output_bytes += job.plan.output_bytes[j];
    // The destination: IPC memory on the inputs' GPU for an IPC item, inline otherwise.
    const v1::MoeOutput* o = nullptr;
    for (const v1::MoeOutput& x : item.outputs()) {
      if (x.name() == job.plan.outputs[j].name) o = &x;
    }
    const std::string field = absl::StrCat(prefix, ".", job.plan.outputs[j].name, ".destination");
    const bool has_ipc = o != nullptr && o->destination().has_ipc();
    if (has_ipc != ipc) {
      return Bad(ipc ? absl::StrCat(field, ".ipc is not set: an item with IPC inputs writes every output to IPC "
                                           "memory on their GPU; list ", job.plan.outputs[j].name, " in outputs")
                     : absl::StrCat(field, ".ipc: an item with inline inputs returns its outputs inline"));
    }
    if (!ipc) continue;
    absl::StatusOr<IpcRegion> r = DenseRegionFromProto(o->destination().ipc(), job.plan.output_bytes[j], field + ".ipc");
    if (!r.ok()) return r.status();
    if (r->gpu != job.input_ipc[0].gpu) {
      return Bad(absl::StrCat(field, ".ipc.device_uuid: every operand of an item must be on one GPU, and ",
                              job.plan.inputs[0].name, " is on another"));
    }
    // The engine gathers: an output over an input (or another output) would read moved bytes.
    for (size_t i = 0; i < job.input_ipc.size(); ++i) {
      if (IpcRegionsOverlap(*r, job.plan.output_bytes[j], job.input_ipc[i], job.plan.input_bytes[i])) {
        return Bad(absl::StrCat(field, ".ipc overlaps ", job.plan.inputs[i].name,
                                ".source.ipc: outputs are written apart from the inputs; give another buffer"));
      }
    }
    for (size_t k = 0; k < job.output_ipc.size(); ++k) {
      if (IpcRegionsOverlap(*r, job.plan.output_bytes[j], job.output_ipc[k], job.plan.output_bytes[k])) {
        return Bad(absl::StrCat(field, ".ipc overlaps ", job.plan.outputs[k].name, ".destination.ipc"));
      }
    }
    job.output_ipc.push_back(*std::move(r));
  }
  return job;
}

}  // namespace

absl::StatusOr<IpcRegion> DenseRegionFromProto(const v1::CudaIpcBuffer& b, uint64_t bytes, const std::string& field) {
  if (b.handle().size() != kIpcHandleBytes) {
    return Bad(absl::StrCat(field, ".handle must be the ", kIpcHandleBytes, " bytes of a cudaIpcMemHandle_t, got ",
                            b.handle().size(), " bytes"));
  }
  if (b.strides_size() != 0) return Bad(absl::StrCat(field, ".strides must be empty: the operand is dense"));
  if (b.size() < bytes) {
    return Bad(absl::StrCat(field, ".size is ", b.size(), " bytes; the operand needs ", bytes));
  }
  absl::StatusOr<Uuid> gpu = UuidFromWire(b.device_uuid(), field + ".device_uuid");
  if (!gpu.ok()) return gpu.status();
  return IpcRegion{b.handle(), b.offset(), b.size(), *gpu};
}

// The identity every output of `plan` reports.
v1::MoeIdentity MoeIdentityOf(const MoePlan& plan) {
  v1::MoeIdentity identity;
  identity.set_format(plan.op == MoeOp::kPrepareW13 || plan.op == MoeOp::kPrepareW2
                          ? std::string(MoeFormatName(plan.params.format))
                          : "");
  identity.set_op(std::string(MoeOpName(plan.op)));
  IdentityParams(plan, identity.mutable_params());
  identity.set_contract_version(kMoeContractVersion);
  identity.set_description(plan.identity);
  return identity;
}

bool HasMoeItems(const v1::ConvertBatchRequest& req) {
  for (const v1::BatchItem& item : req.items()) {
    if (item.has_moe()) return true;
  }
  return false;
}

bool IpcRegionsOverlap(const IpcRegion& a, uint64_t a_bytes, const IpcRegion& b, uint64_t b_bytes) {
  return a.handle == b.handle && a.offset < b.offset + b_bytes && b.offset < a.offset + a_bytes;
}

absl::Status CheckBatchSize(const v1::ConvertBatchRequest& req, const MoeLimits& limits) {
  if (static_cast<uint64_t>(req.items_size()) > limits.max_items) {
    return absl::ResourceExhaustedError(absl::StrCat("the batch has ", req.items_size(),
                                                     " items, more than --max-batch-items=", limits.max_items,
                                                     "; split it into several batches"));
  }
  if (const uint64_t n = req.ByteSizeLong(); n > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("ConvertBatch request of ", n,
                                                     " bytes exceeds --max-message-bytes=", limits.max_message_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MoeJob>> MoeJobsFromProto(const v1::ConvertBatchRequest& req, const MoeLimits& limits) {
  if (absl::Status s = CheckBatchSize(req, limits); !s.ok()) return s;
  std::vector<MoeJob> jobs;
  uint64_t inline_out = 0;
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::BatchItem& item = req.items(i);
    const std::string prefix = absl::StrCat("items[", i, "].moe");
    if (!item.has_moe()) {
      return Bad(absl::StrCat("items[", i, "]: a batch holds items of one kind (convert, moe or quantize); send the ",
                              item.has_convert() ? "convert" : item.has_quantize() ? "quantize" : "unset",
                              " item in another batch"));
    }
    absl::StatusOr<MoeJob> job = JobFromProto(item.moe(), prefix, limits);
    if (!job.ok()) return job.status();
    if (!job->ipc()) inline_out += job->output_bytes;
    if (inline_out > limits.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("the inline outputs reach ", inline_out, " bytes at items[", i,
                                                       "], more than --max-message-bytes=", limits.max_message_bytes,
                                                       " allows in one answer; split the batch"));
    }
    jobs.push_back(*std::move(job));
  }
  return jobs;
}

namespace {

// An IPC job's GPU and mapped regions (leases held until the work is done).
struct MappedJob {
  Gpu* gpu = nullptr;
  std::vector<IpcCache::Lease> inputs, outputs;
};

absl::StatusOr<MappedJob> MapJob(const MoeJob& job, size_t index, const MoeEngines& engines) {
  const std::string prefix = absl::StrCat("items[", index, "].moe.");
  MappedJob m;
  absl::StatusOr<Gpu*> gpu = engines.devices->FindByUuid(job.input_ipc[0].gpu);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(), absl::StrCat(prefix, job.plan.inputs[0].name,
                                                          ".source.ipc.device_uuid: ", gpu.status().message()));
  }
  m.gpu = *gpu;
  auto map = [&](const IpcRegion& r, const std::string& field) -> absl::StatusOr<IpcCache::Lease> {
    absl::StatusOr<IpcCache::Lease> l = engines.ipc->Acquire(m.gpu->ordinal(), r.handle, r.offset, r.size);
    if (!l.ok()) return absl::Status(l.status().code(), absl::StrCat(prefix, field, ": ", l.status().message()));
    return l;
  };
  for (size_t i = 0; i < job.input_ipc.size(); ++i) {
    absl::StatusOr<IpcCache::Lease> l = map(job.input_ipc[i], job.plan.inputs[i].name + ".source.ipc");
    if (!l.ok()) return l.status();
    m.inputs.push_back(*std::move(l));
  }
  for (size_t j = 0; j < job.output_ipc.size(); ++j) {
    absl::StatusOr<IpcCache::Lease> l = map(job.output_ipc[j], job.plan.outputs[j].name + ".destination.ipc");
    if (!l.ok()) return l.status();
    m.outputs.push_back(*std::move(l));
  }
  return m;
}

// Queues an IPC job on its GPU's stream of the batch.
absl::Status QueueOnGpu(const MoeJob& job, const MappedJob& m, size_t index, GpuQueues& queues) {
  std::vector<const void*> ins;
  std::vector<void*> outs;
  ins.reserve(m.inputs.size());
  outs.reserve(m.outputs.size());
  for (const IpcCache::Lease& l : m.inputs) ins.push_back(l.ptr());
  for (const IpcCache::Lease& l : m.outputs) outs.push_back(l.ptr());
  absl::StatusOr<Stream> stream = queues.StreamOf(*m.gpu);
  if (!stream.ok()) return stream.status();
  if (absl::Status s = m.gpu->runtime().ConvertMoe(m.gpu->ordinal(), job.plan, ins, outs, *stream); !s.ok()) return s;
  queues.Queued(*m.gpu, index);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunMoeJobs(const std::vector<MoeJob>& jobs, const MoeEngines& engines, absl::Time deadline,
                        v1::ConvertBatchResponse* resp) {
  // Every IPC job's GPU and memory first: a bad one fails the batch before any work.
  std::vector<MappedJob> mapped(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!jobs[i].ipc()) continue;
    absl::StatusOr<MappedJob> m = MapJob(jobs[i], i, engines);
    if (!m.ok()) return m.status();
    mapped[i] = *std::move(m);
  }
  // IPC jobs: one stream per GPU, every job queued on it in order, one wait per GPU.
  GpuQueues queues(deadline);
  absl::Status failed;
  for (size_t i = 0; i < jobs.size() && failed.ok(); ++i) {
    const MoePlan& plan = jobs[i].plan;
    v1::BatchItemResult* item = resp->add_items();
    const v1::MoeIdentity identity = MoeIdentityOf(plan);
    std::vector<absl::Span<uint8_t>> outs;
    outs.reserve(plan.outputs.size());
    for (size_t j = 0; j < plan.outputs.size(); ++j) {
      v1::TensorResult* t = item->add_outputs();
      t->set_name(plan.outputs[j].name);
      t->set_dtype(MoeDTypeToProto(plan.outputs[j].dtype));
      for (int64_t d : plan.outputs[j].shape) t->add_shape(d);
      for (int64_t s : plan.output_strides[j]) t->add_strides(s);
      t->set_bytes(plan.output_bytes[j]);
      *t->mutable_moe_identity() = identity;
      if (jobs[i].ipc()) continue;
      std::string* bytes = t->mutable_inline_bytes();
      bytes->resize(plan.output_bytes[j]);
      outs.emplace_back(reinterpret_cast<uint8_t*>(bytes->data()), bytes->size());
    }
    absl::Status s;
    if (jobs[i].ipc()) {
      s = QueueOnGpu(jobs[i], mapped[i], i, queues);
    } else {
      std::vector<absl::Span<const uint8_t>> ins;
      ins.reserve(jobs[i].inputs.size());
      for (absl::string_view b : jobs[i].inputs) ins.emplace_back(reinterpret_cast<const uint8_t*>(b.data()), b.size());
      const absl::Time start = absl::Now();
      s = RunMoeCpu(plan, ins, outs, engines.cpu_threads);
      item->set_engine("cpu");
      item->set_kernel_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    }
    if (!s.ok()) failed = absl::Status(s.code(), absl::StrCat("items[", i, "].moe: ", s.message()));
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
