// Converts a streamed tensor slice by slice (groups of whole leading-dim matrices), so
// memory stays at one slice whatever the tensor's size: on the CPU engine, or on a GPU
// through one DeviceRun for the whole stream.
#ifndef WPREP_SERVER_SRC_STREAM_CONVERTER_H_
#define WPREP_SERVER_SRC_STREAM_CONVERTER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "device/device_manager.h"
#include "net/metrics.h"
#include "wprep/kernels/plan.h"

namespace wprep::server {

// Not thread-safe: one per stream, used by one thread at a time.
class StreamConverter {
 public:
  virtual ~StreamConverter() = default;

  const Plan& plan() const { return plan_; }
  const std::string& engine() const { return engine_; }
  DeviceMetrics* engine_metrics() const { return engine_metrics_; }
  // Input bytes of a full slice; the last slice may be shorter. 0 when the input is empty.
  uint64_t slice_input_bytes() const { return slice_in_; }
  // The output bytes of a slice of `input_bytes`.
  uint64_t SliceOutputBytes(uint64_t input_bytes) const;
  // The larger of one matrix's input and output (the whole tensor's when the stream is
  // one slice): the least a slice holds.
  uint64_t MatrixBytes() const;

  // Converts `in` (a full slice, or the last, shorter one). The output stays valid until
  // the next call.
  absl::StatusOr<absl::Span<const uint8_t>> ConvertSlice(absl::Span<const uint8_t> in);

  // The plan of a slice of `in_bytes` (a full slice, or the last, shorter one): what
  // ConvertSlice runs. Public so that the stream fuzzer checks every slice size of a
  // tensor too large to convert there.
  absl::StatusOr<const Plan*> SlicePlan(uint64_t in_bytes);

  // Totals over the slices so far.
  std::optional<double> kernel_seconds() const { return kernel_seconds_; }
  virtual uint64_t peak_extra_device_bytes() const { return 0; }

 protected:
  // Slicing by whole matrices of about `target_slice_bytes` (input or output, whichever
  // is larger); one slice when
  // the layout's per-matrix sizes do not add up (never expected, but never wrong).
  StreamConverter(const Plan& plan, uint64_t target_slice_bytes, std::string engine,
                  DeviceMetrics* metrics);

  // The engine's conversion of one slice, planned by `slice`.
  virtual absl::StatusOr<absl::Span<const uint8_t>> Run(const Plan& slice, absl::Span<const uint8_t> in,
                                                        std::optional<double>* seconds) = 0;

 private:
  const Plan plan_;
  const std::string engine_;
  DeviceMetrics* const engine_metrics_;
  bool whole_ = false;
  uint64_t matrix_in_ = 0;   // input bytes of one matrix
  uint64_t matrix_out_ = 0;  // output bytes of one matrix
  uint64_t slice_in_ = 0;
  uint64_t min_matrices_ = 1;  // the fewest matrices a slice holds (2 where one would differ)
  std::map<int64_t, Plan> slice_plans_;  // by matrices per slice (a stream needs two)
  std::optional<double> kernel_seconds_;
};

// How a stream slices: about `target_slice_bytes` per slice, and RESOURCE_EXHAUSTED
// before anything is allocated when one matrix needs more than `max_matrix_bytes`.
struct StreamSlicing {
  uint64_t target_slice_bytes = 4ull << 20;
  uint64_t max_matrix_bytes = 128ull << 20;
};

// A stream on the CPU engine with `threads` threads per slice.
absl::StatusOr<std::unique_ptr<StreamConverter>> NewCpuStreamConverter(const Plan& plan, const StreamSlicing& slicing,
                                                                       int threads, DeviceMetrics* metrics);

// A stream on `gpu`: leases a stream and the slice's device memory until destroyed.
absl::StatusOr<std::unique_ptr<StreamConverter>> NewGpuStreamConverter(
    const Plan& plan, const StreamSlicing& slicing, Gpu& gpu, PinnedHostPool& pinned,
    absl::Time deadline, absl::Time memory_deadline);

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_STREAM_CONVERTER_H_
