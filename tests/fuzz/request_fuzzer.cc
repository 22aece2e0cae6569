// libFuzzer target: the daemon's request edge over arbitrary protobuf bytes. The first
// byte picks the message (ConvertRequest, PlanRequest or StreamRequestHeader), the rest is
// its wire form, parsed as gRPC would. Each parsed message goes through what its handler
// runs before any work: SpecFromProto, then ConvertJobFromProto / PlanFromProto /
// StreamStartFromProto (which call MakePlan), then CheckTensorBytes. Then:
// - every refusal is INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never another code;
// - the spec survives SpecToProto -> SpecFromProto unchanged;
// - every accepted plan passes CheckPlan (fuzz_support.h), an inline source holds exactly
//   the plan's input bytes (a strided one: a view inside them), and an inline output fits
//   --max-message-bytes;
// - accepted plans of at most 256 KiB run on the CPU engine with buffers of exactly the
//   size the request declared (the inline bytes, the IPC region's size, the Plan's
//   input_buffer_bytes), under AddressSanitizer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

#include "fuzz_support.h"
#include "proto_mutator.h"
#include "rpc/proto_translate.h"
#include "wprep/proto/spec_codec.h"

namespace {

namespace v1 = wprep::v1;
using wprep::fuzz::CheckPlan;
using wprep::fuzz::RunOnCpu;

// The daemon's defaults (options.h).
constexpr int64_t kMaxMessageBytes = 64ll << 20;
constexpr uint64_t kMaxTensorBytes = 64ull << 30;

void CheckRefusal(const absl::Status& s, const char* stage) {
  WPREP_FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kResourceExhausted,
                   "%s refused with %s", stage, s.ToString().c_str());
  WPREP_FUZZ_CHECK(!s.message().empty(), "%s refused without a message", stage);
}

absl::Span<const int64_t> Shape(const google::protobuf::RepeatedField<int64_t>& f) {
  return absl::MakeConstSpan(f.data(), static_cast<size_t>(f.size()));
}

bool SameSpec(const wprep::ConversionSpec& a, const wprep::ConversionSpec& b) {
  return a.layout == b.layout && a.direction == b.direction && a.hopper.mx_axis == b.hopper.mx_axis &&
         a.hopper.mma_version == b.hopper.mma_version && a.blackwell.block_k == b.blackwell.block_k &&
         a.blackwell.block_n == b.blackwell.block_n && a.blackwell_to.block_k == b.blackwell_to.block_k &&
         a.blackwell_to.block_n == b.blackwell_to.block_n;
}

// SpecFromProto, with its refusal and round-trip checks; false when refused.
bool Spec(const v1::ConversionSpec& p, const char* field, wprep::ConversionSpec* out) {
  absl::StatusOr<wprep::ConversionSpec> s = wprep::SpecFromProto(p, field);
  if (!s.ok()) {
    WPREP_FUZZ_CHECK(s.status().code() == absl::StatusCode::kInvalidArgument, "%s", s.status().ToString().c_str());
    return false;
  }
  absl::StatusOr<wprep::ConversionSpec> again = wprep::SpecFromProto(wprep::SpecToProto(*s), field);
  WPREP_FUZZ_CHECK(again.ok() && SameSpec(*s, *again), "spec changed through SpecToProto: %s",
                   wprep::Describe(*s).c_str());
  *out = *s;
  return true;
}

// CheckTensorBytes agrees with the plan's sizes; false when it refused.
bool TensorBytes(const wprep::Plan& plan) {
  const absl::Status s = wprep::server::CheckTensorBytes(plan, kMaxTensorBytes);
  const bool fits = plan.input_bytes <= kMaxTensorBytes && plan.output_bytes <= kMaxTensorBytes;
  WPREP_FUZZ_CHECK(s.ok() == fits, "CheckTensorBytes: %s for %llu in, %llu out", s.ToString().c_str(),
                   static_cast<unsigned long long>(plan.input_bytes),
                   static_cast<unsigned long long>(plan.output_bytes));
  if (!s.ok()) CheckRefusal(s, "CheckTensorBytes");
  return s.ok();
}

void Convert(const v1::ConvertRequest& req) {
  wprep::ConversionSpec spec;
  if (!Spec(req.spec(), "spec", &spec)) return;
  absl::StatusOr<wprep::server::ConvertJob> job = wprep::server::ConvertJobFromProto(req, spec, kMaxMessageBytes);
  if (!job.ok()) return CheckRefusal(job.status(), "ConvertJobFromProto");
  const wprep::Plan& plan = job->plan;
  CheckPlan(plan, Shape(req.logical_shape()));
  if (!TensorBytes(plan)) return;
  if (job->destination_ipc) {
    WPREP_FUZZ_CHECK(job->destination_ipc->size >= plan.output_bytes, "destination smaller than the output");
  } else {
    WPREP_FUZZ_CHECK(plan.output_bytes <= static_cast<uint64_t>(kMaxMessageBytes), "inline output above the limit");
  }
  if (job->source_ipc) {
    // The GPU reads [offset, offset + size) of the client's allocation: the view must
    // lie in those `size` bytes.
    const uint64_t size = job->source_ipc->size;
    if (size <= wprep::fuzz::kRunBytes) RunOnCpu(plan, wprep::fuzz::Pattern(size, size).data(), size);
    return;
  }
  if (req.source_strides_size() == 0) {
    WPREP_FUZZ_CHECK(job->source_bytes.size() == plan.input_bytes, "inline source of %zu bytes, plan needs %llu",
                     job->source_bytes.size(), static_cast<unsigned long long>(plan.input_bytes));
  } else {
    WPREP_FUZZ_CHECK(plan.input_bytes <= job->source_bytes.size(), "a strided view outside its %zu inline bytes",
                     job->source_bytes.size());
  }
  RunOnCpu(plan, reinterpret_cast<const uint8_t*>(job->source_bytes.data()), job->source_bytes.size());
}

void PlanOnly(const v1::PlanRequest& req) {
  wprep::ConversionSpec spec;
  if (!Spec(req.spec(), "spec", &spec)) return;
  absl::StatusOr<wprep::Plan> plan = wprep::server::PlanFromProto(req, spec);
  if (!plan.ok()) return CheckRefusal(plan.status(), "PlanFromProto");
  CheckPlan(*plan, Shape(req.logical_shape()));
  if (!TensorBytes(*plan)) return;
  const uint64_t buffer = req.has_input_buffer_bytes() ? req.input_buffer_bytes() : plan->input_bytes;
  if (req.has_input_buffer_bytes()) {
    WPREP_FUZZ_CHECK(plan->input_bytes <= buffer, "view outside input_buffer_bytes");
    if (plan->input_dense) WPREP_FUZZ_CHECK(plan->input_bytes == buffer, "dense view of another size");
  }
  if (buffer <= wprep::fuzz::kRunBytes) RunOnCpu(*plan, wprep::fuzz::Pattern(buffer, 7).data(), buffer);
}

void StreamHeader(const v1::StreamRequestHeader& header) {
  wprep::ConversionSpec spec;
  if (!Spec(header.spec(), "header.spec", &spec)) return;
  absl::StatusOr<wprep::server::StreamStart> start = wprep::server::StreamStartFromProto(header, spec);
  if (!start.ok()) return CheckRefusal(start.status(), "StreamStartFromProto");
  CheckPlan(start->plan, Shape(header.logical_shape()));
  WPREP_FUZZ_CHECK(start->plan.input_dense, "a stream's input is dense");
  if (!TensorBytes(start->plan)) return;
  if (start->plan.input_bytes <= wprep::fuzz::kRunBytes) {
    RunOnCpu(start->plan, wprep::fuzz::Pattern(start->plan.input_bytes, 9).data(), start->plan.input_bytes);
  }
}

}  // namespace

int wprep::fuzz::FuzzRequest(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t kind = data[0] % 3;
  const int n = static_cast<int>(std::min<size_t>(size - 1, 1 << 30));
  if (kind == 0) {
    v1::ConvertRequest req;
    if (req.ParseFromArray(data + 1, n)) Convert(req);
  } else if (kind == 1) {
    v1::PlanRequest req;
    if (req.ParseFromArray(data + 1, n)) PlanOnly(req);
  } else {
    v1::StreamRequestHeader req;
    if (req.ParseFromArray(data + 1, n)) StreamHeader(req);
  }
  return 0;
}

#ifndef WPREP_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return wprep::fuzz::FuzzRequest(data, size); }

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Structure-aware: three times in four the input is parsed as its message, edited field
// by field (proto_mutator.h) and written back; otherwise libFuzzer's byte mutations.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::minstd_rand rng(seed);
  if (rng() % 4 == 0 || max_size < 2) return LLVMFuzzerMutate(data, size, max_size);
  uint8_t kind = size > 0 ? data[0] % 3 : static_cast<uint8_t>(rng() % 3);
  if (rng() % 16 == 0) kind = static_cast<uint8_t>(rng() % 3);  // the same fields as another message
  v1::ConvertRequest convert;
  v1::PlanRequest plan;
  v1::StreamRequestHeader header;
  google::protobuf::Message* m = kind == 0 ? static_cast<google::protobuf::Message*>(&convert)
                                 : kind == 1 ? static_cast<google::protobuf::Message*>(&plan)
                                             : static_cast<google::protobuf::Message*>(&header);
  if (size > 1 && !m->ParseFromArray(data + 1, static_cast<int>(std::min<size_t>(size - 1, 1 << 30)))) m->Clear();
  wprep::fuzz::MutateMessage(m, rng);
  const std::string wire = m->SerializeAsString();
  if (wire.size() + 1 > max_size) return LLVMFuzzerMutate(data, size, max_size);
  data[0] = kind;
  std::memcpy(data + 1, wire.data(), wire.size());
  return wire.size() + 1;
}
#endif
