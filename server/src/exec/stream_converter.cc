#include "exec/stream_converter.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "device/device_run.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/spec/checked_math.h"
#include "wprep/spec/status_macros.h"

namespace wprep::server {
namespace {

// True when a slice of one matrix is laid out like a matrix of a slice of two (and so of
// the whole tensor): the same strides of the last two dims on both sides.
bool OneMatrixSlicesAgree(const ConversionSpec& spec, const Plan& one) {
  const std::vector<int64_t>& s = one.logical_shape;
  absl::StatusOr<Plan> two = MakePlan(spec, std::vector<int64_t>{2, s[s.size() - 2], s[s.size() - 1]});
  if (!two.ok()) return false;
  auto inner = [](const std::vector<int64_t>& strides) {
    return strides.size() < 2 ? strides : std::vector<int64_t>(strides.end() - 2, strides.end());
  };
  return inner(one.output_strides) == inner(two->output_strides) &&
         inner(one.input_strides) == inner(two->input_strides);
}

// The most matrices per slice, at most `per` and at least 2, that leaves no last slice of
// exactly one matrix out of `e`; `e` (one slice) when there is none.
uint64_t SlicesOfTwoOrMore(uint64_t e, uint64_t per) {
  for (uint64_t p = std::min(std::max<uint64_t>(per, 2), e); p >= 2; --p) {
    if (e % p != 1) return p;
  }
  return e;
}

}  // namespace

StreamConverter::StreamConverter(const Plan& plan, uint64_t target_slice_bytes, std::string engine,
                                 DeviceMetrics* metrics)
    : plan_(plan), engine_(std::move(engine)), engine_metrics_(metrics) {
  const auto& s = plan.logical_shape;
  // Checked, though MakePlan bounds the matrices of a valid plan: a wrapped count here
  // would slice a tensor by the wrong matrix size. Any doubt converts it whole.
  const std::optional<uint64_t> e =
      s.size() < 2 ? std::nullopt : CheckedProduct(absl::MakeConstSpan(s.data(), s.size() - 2));
  absl::StatusOr<Plan> one = absl::InvalidArgumentError("no matrices");
  if (e && *e > 0) one = MakePlan(plan.spec, std::vector<int64_t>{1, s[s.size() - 2], s[s.size() - 1]});
  if (one.ok() && one->input_bytes > 0 && CheckedMul(one->input_bytes, *e) == plan.input_bytes &&
      CheckedMul(one->output_bytes, *e) == plan.output_bytes) {
    matrix_in_ = one->input_bytes;
    matrix_out_ = one->output_bytes;
    // Sized by the larger side: a padded layout's output can be many times its input.
    uint64_t per = std::min<uint64_t>(std::max<uint64_t>(1, target_slice_bytes / std::max(matrix_in_, matrix_out_)), *e);
    if (*e >= 2 && !OneMatrixSlicesAgree(plan.spec, *one)) {
      // The planner follows torch: a leading dim of 1 does not count towards a view's
      // density, so a slice of one matrix may be laid out (transposed or not) unlike the
      // same matrix in the whole tensor (hopper_scale unswizzle, mx_axis -2, padded rows;
      // found by wprep_fuzz_stream). Every slice then holds at least two matrices, the
      // last one too; when no slice size allows that, the tensor goes whole.
      per = SlicesOfTwoOrMore(*e, per);
      min_matrices_ = 2;
    }
    if (per == *e && min_matrices_ > 1) {
      whole_ = true;
      matrix_in_ = plan.input_bytes;
      matrix_out_ = plan.output_bytes;
      min_matrices_ = 1;
      slice_in_ = plan.input_bytes;
      return;
    }
    slice_in_ = per * matrix_in_;
    slice_plans_.emplace(1, *std::move(one));
  } else {
    whole_ = true;
    matrix_in_ = plan.input_bytes;
    matrix_out_ = plan.output_bytes;
    slice_in_ = plan.input_bytes;
  }
}

uint64_t StreamConverter::MatrixBytes() const { return std::max(matrix_in_, matrix_out_) * min_matrices_; }

uint64_t StreamConverter::SliceOutputBytes(uint64_t input_bytes) const {
  if (whole_ || matrix_in_ == 0) return plan_.output_bytes;
  return input_bytes / matrix_in_ * matrix_out_;
}

absl::StatusOr<const Plan*> StreamConverter::SlicePlan(uint64_t in_bytes) {
  if (whole_ || matrix_in_ == 0) {
    if (in_bytes != plan_.input_bytes) {
      return absl::InternalError("stream slice does not match the whole-tensor plan");
    }
    return &plan_;
  }
  if (in_bytes == 0 || in_bytes % matrix_in_ != 0 || in_bytes > slice_in_) {
    return absl::InternalError(
        absl::StrCat("stream slice of ", in_bytes, " bytes is not a whole number of matrices"));
  }
  const int64_t b = static_cast<int64_t>(in_bytes / matrix_in_);
  auto it = slice_plans_.find(b);
  if (it == slice_plans_.end()) {
    const auto& s = plan_.logical_shape;
    WPREP_ASSIGN_OR_RETURN(Plan p, MakePlan(plan_.spec, std::vector<int64_t>{b, s[s.size() - 2], s[s.size() - 1]}));
    it = slice_plans_.emplace(b, std::move(p)).first;
  }
  return &it->second;
}

absl::StatusOr<absl::Span<const uint8_t>> StreamConverter::ConvertSlice(absl::Span<const uint8_t> in) {
  WPREP_ASSIGN_OR_RETURN(const Plan* p, SlicePlan(in.size()));
  std::optional<double> seconds;
  WPREP_ASSIGN_OR_RETURN(absl::Span<const uint8_t> out, Run(*p, in, &seconds));
  if (seconds) kernel_seconds_ = kernel_seconds_.value_or(0) + *seconds;
  return out;
}

namespace {

class CpuStreamConverter final : public StreamConverter {
 public:
  CpuStreamConverter(const Plan& plan, uint64_t target, int threads, DeviceMetrics* metrics)
      : StreamConverter(plan, target, "cpu", metrics), threads_(threads), in_flight_(metrics) {}

 private:
  absl::StatusOr<absl::Span<const uint8_t>> Run(const Plan& slice, absl::Span<const uint8_t> in,
                                                std::optional<double>* seconds) override {
    out_.resize(slice.output_bytes);
    const absl::Time start = absl::Now();
    WPREP_RETURN_IF_ERROR(ConvertOnCpu(slice, in.data(), in.size(), out_.data(), out_.size(),
                                       CpuOptions{threads_}));
    *seconds = absl::ToDoubleSeconds(absl::Now() - start);
    return absl::Span<const uint8_t>(out_);
  }

  const int threads_;
  const InFlight in_flight_;
  std::vector<uint8_t> out_;
};

class GpuStreamConverter final : public StreamConverter {
 public:
  GpuStreamConverter(const Plan& plan, uint64_t target, Gpu& gpu)
      : StreamConverter(plan, target, gpu.engine_name(), gpu.metrics()) {}

  absl::Status Begin(Gpu& gpu, PinnedHostPool& pinned, absl::Time deadline, absl::Time memory_deadline) {
    const uint64_t in = slice_input_bytes();
    WPREP_ASSIGN_OR_RETURN(run_, DeviceRun::Begin(gpu, pinned, {in, SliceOutputBytes(in)}, deadline,
                                                  memory_deadline));
    return absl::OkStatus();
  }
  uint64_t peak_extra_device_bytes() const override { return run_->peak_extra_device_bytes(); }

 private:
  absl::StatusOr<absl::Span<const uint8_t>> Run(const Plan& slice, absl::Span<const uint8_t> in,
                                                std::optional<double>* seconds) override {
    WPREP_ASSIGN_OR_RETURN(DeviceRun::Result r, run_->Convert(slice, RunInput::Host(in.data()), nullptr));
    *seconds = r.kernel_seconds;
    return r.host_output;
  }

  std::unique_ptr<DeviceRun> run_;
};

absl::Status CheckMatrixBytes(const StreamConverter& conv, uint64_t max_matrix_bytes) {
  if (conv.MatrixBytes() <= max_matrix_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "one matrix of this tensor has ", conv.MatrixBytes(), " bytes (input or output), more than the ",
      max_matrix_bytes, " a ConvertStream holds at a time (--max-stream-matrix-bytes); convert it through CUDA "
      "IPC buffers instead"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<StreamConverter>> NewCpuStreamConverter(const Plan& plan, const StreamSlicing& slicing,
                                                                       int threads, DeviceMetrics* metrics) {
  auto conv = std::make_unique<CpuStreamConverter>(plan, slicing.target_slice_bytes, threads, metrics);
  WPREP_RETURN_IF_ERROR(CheckMatrixBytes(*conv, slicing.max_matrix_bytes));
  return std::unique_ptr<StreamConverter>(std::move(conv));
}

absl::StatusOr<std::unique_ptr<StreamConverter>> NewGpuStreamConverter(
    const Plan& plan, const StreamSlicing& slicing, Gpu& gpu, PinnedHostPool& pinned,
    absl::Time deadline, absl::Time memory_deadline) {
  auto conv = std::make_unique<GpuStreamConverter>(plan, slicing.target_slice_bytes, gpu);
  WPREP_RETURN_IF_ERROR(CheckMatrixBytes(*conv, slicing.max_matrix_bytes));
  WPREP_RETURN_IF_ERROR(conv->Begin(gpu, pinned, deadline, memory_deadline));
  return std::unique_ptr<StreamConverter>(std::move(conv));
}

}  // namespace wprep::server
