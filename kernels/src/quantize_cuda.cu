// quantize_mxfp4 on the GPU. One thread per group of 32: a group's loads are 64 (bf16) or
// 128 (fp32) contiguous bytes, read as 16-byte vectors when the row is aligned for it, and
// its 16 value bytes go out as one 16-byte store; the math is quantize_math.h, shared with
// the CPU engine, so the two cannot disagree.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "wprep/kernels/cuda_status.h"
#include "layout_math.h"
#include "wprep/kernels/quantize.h"
#include "quantize_math.h"

namespace wprep {
namespace {

template <QuantDtype D>
__device__ __forceinline__ float Load(const uint8_t* row, int64_t i) {
  if constexpr (D == QuantDtype::kFloat32) {
    return reinterpret_cast<const float*>(row)[i];
  } else {
    const uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
    return D == QuantDtype::kBfloat16 ? qmath::Bf16ToFloat(h) : qmath::Fp16ToFloat(h);
  }
}

template <QuantDtype D>
__global__ void QuantizeKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ values,
                               uint8_t* __restrict__ scales, int64_t rows, int64_t q, bool up,
                               int64_t vrow_bytes) {
  // vrow_bytes: ceil(q/2) for canonical values, Kpad for blackwell_value (the row's last
  // group also zeroes the padding). scales == nullptr: the scale layout is written apart.
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  const int64_t sq = (q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t vq = vrow_bytes;
  const int64_t total = rows * sq;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / sq, g = t - r * sq;
    const uint8_t* row = in + r * q * kEsize;
    const int64_t begin = g * qmath::kGroup;
    const int n = q - begin < qmath::kGroup ? static_cast<int>(q - begin) : qmath::kGroup;
    float x[qmath::kGroup];
    const uint8_t* src = row + begin * kEsize;
    if (n == qmath::kGroup && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      // Full aligned group: vector loads, then the same per-element conversion.
      uint4 raw[qmath::kGroup * kEsize / 16];
      WPREP_UNROLL
      for (int k = 0; k < qmath::kGroup * kEsize / 16; ++k) {
        raw[k] = reinterpret_cast<const uint4*>(src)[k];
      }
      const uint8_t* b = reinterpret_cast<const uint8_t*>(raw);
      WPREP_UNROLL
      for (int i = 0; i < qmath::kGroup; ++i) x[i] = Load<D>(b, i);
    } else {
      WPREP_UNROLL
      for (int i = 0; i < qmath::kGroup; ++i) x[i] = i < n ? Load<D>(src, i) : 0.0f;
    }
    float amax = 0.0f;
    WPREP_UNROLL
    for (int i = 0; i < qmath::kGroup; ++i) amax = qmath::AbsMaxNum(amax, x[i]);  // pads are 0
    const uint32_t e = qmath::ScaleBits(amax, up);
    if (scales != nullptr) scales[r * sq + g] = static_cast<uint8_t>(e >> 23);
    const float qs = qmath::ScaleMultiplier(e);
    uint8_t out[qmath::kGroup / 2];
    WPREP_UNROLL
    for (int j = 0; j < qmath::kGroup / 2; ++j) {
      const uint32_t lo = 2 * j < n ? qmath::EncodeE2m1(x[2 * j] * qs) : 0u;
      const uint32_t hi = 2 * j + 1 < n ? qmath::EncodeE2m1(x[2 * j + 1] * qs) : 0u;
      out[j] = static_cast<uint8_t>(lo | hi << 4);
    }
    uint8_t* dst = values + r * vq + begin / 2;
    const int nbytes = (n + 1) / 2;
    if (nbytes == qmath::kGroup / 2 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
    } else {
      for (int j = 0; j < nbytes; ++j) dst[j] = out[j];
    }
    if (g == sq - 1) {
      for (int64_t j = (q + 1) / 2; j < vrow_bytes; ++j) values[r * vq + j] = 0;
    }
  }
}

// blackwell_scale of the transposed scale view: each destination byte finds its group with
// BlackwellScaleSource and recomputes that group's scale from the input (32 elements).
template <QuantDtype D>
__global__ void BlackwellScaleKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ scales,
                                     int64_t mats, int64_t n, int64_t q, bool up,
                                     BlackwellScaleTiling t) {
  constexpr int kEsize = D == QuantDtype::kFloat32 ? 4 : 2;
  const int64_t per_mat = t.kpad * t.npad;
  const int64_t total = mats * per_mat;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / per_mat;
    int64_t k = 0, col = 0;
    BlackwellScaleSource(t, i - m * per_mat, &k, &col);
    uint8_t byte = 0;
    if (k < t.k && col < n) {
      const uint8_t* src = in + ((m * n + col) * q + k * qmath::kGroup) * kEsize;
      const int nel = q - k * qmath::kGroup < qmath::kGroup ? static_cast<int>(q - k * qmath::kGroup)
                                                            : qmath::kGroup;
      float amax = 0.0f;
      for (int j = 0; j < nel; ++j) amax = qmath::AbsMaxNum(amax, Load<D>(src, j));
      byte = static_cast<uint8_t>(qmath::ScaleBits(amax, up) >> 23);
    }
    scales[i] = byte;
  }
}

unsigned Blocks(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<unsigned>(b < (1 << 30) ? b : (1 << 30));
}

}  // namespace

absl::Status QuantizeOnCuda(const QuantizePlan& plan, const void* in, void* values, void* scales,
                            CudaStream stream) {
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t groups = plan.rows * sq;  // <= scales_bytes, checked by the plan
  if (groups == 0) return absl::OkStatus();
  auto ptr_device = [](const void* p) -> int {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
      (void)cudaGetLastError();  // clear the sticky-free error of a host pointer
      return -1;
    }
    return a.device;
  };
  const int dev = ptr_device(in);
  if (dev < 0 || ptr_device(values) != dev || ptr_device(scales) != dev) {
    return absl::InvalidArgumentError(
        "quantize: input, values and scales must be device memory of one GPU");
  }
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev));
  constexpr int kThreads = 256;
  const int64_t blocks64 = (groups + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < (1 << 30) ? blocks64 : (1 << 30));
  const bool up = plan.rounding == ScaleRounding::kUp;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  switch (plan.dtype) {
    case QuantDtype::kBfloat16:
      QuantizeKernel<QuantDtype::kBfloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
      break;
    case QuantDtype::kFloat16:
      QuantizeKernel<QuantDtype::kFloat16><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
      break;
    case QuantDtype::kFloat32:
      QuantizeKernel<QuantDtype::kFloat32><<<blocks, kThreads, 0, stream>>>(src, v, s, plan.rows, plan.q, up, (plan.q + 1) / 2);
      break;
  }
  absl::Status launched = WPREP_CUDA_STATUS(cudaGetLastError());
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return launched;
}

absl::Status QuantizeBlackwellOnCuda(const QuantizePlan& plan, const void* in, void* values,
                                     void* scales, CudaStream stream) {
  auto sizes = PlanQuantizeBlackwell(plan);
  if (!sizes.ok()) return sizes.status();
  const int64_t n = plan.input_shape[plan.input_shape.size() - 2];
  if (n == 0 || plan.rows == 0) return absl::OkStatus();
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  cudaPointerAttributes a{};
  WPREP_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&a, in));
  if (a.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("quantize: input must be device memory");
  }
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(a.device));
  constexpr int kThreads = 256;
  const int64_t sq = (plan.q + qmath::kGroup - 1) / qmath::kGroup;
  const int64_t kpad = RoundUp(plan.q / 2, 128);
  const BlackwellScaleTiling t = MakeBlackwellScaleTiling(sq, n);
  const bool up = plan.rounding == ScaleRounding::kUp;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* v = static_cast<uint8_t*>(values);
  auto* s = static_cast<uint8_t*>(scales);
  const unsigned vb = Blocks(plan.rows * sq, kThreads), sb = Blocks(sizes->scales_bytes, kThreads);
  const int64_t mats = plan.rows / n;
  switch (plan.dtype) {
#define WPREP_Q_LAUNCH(D)                                                                    \
  QuantizeKernel<D><<<vb, kThreads, 0, stream>>>(src, v, nullptr, plan.rows, plan.q, up, kpad); \
  BlackwellScaleKernel<D><<<sb, kThreads, 0, stream>>>(src, s, mats, n, plan.q, up, t);
    case QuantDtype::kBfloat16: WPREP_Q_LAUNCH(QuantDtype::kBfloat16) break;
    case QuantDtype::kFloat16: WPREP_Q_LAUNCH(QuantDtype::kFloat16) break;
    case QuantDtype::kFloat32: WPREP_Q_LAUNCH(QuantDtype::kFloat32) break;
#undef WPREP_Q_LAUNCH
  }
  absl::Status launched = WPREP_CUDA_STATUS(cudaGetLastError());
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return launched;
}

absl::Status QuantizeHostBuffersOnCuda(const QuantizePlan& plan, const uint8_t* in,
                                       size_t in_size, uint8_t* values, size_t values_size,
                                       uint8_t* scales, size_t scales_size, int device) {
  if (static_cast<int64_t>(in_size) != plan.input_bytes ||
      static_cast<int64_t>(values_size) != plan.values_bytes ||
      static_cast<int64_t>(scales_size) != plan.scales_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize: buffer sizes ", in_size, "/", values_size, "/", scales_size,
        " do not match the plan's ", plan.input_bytes, "/", plan.values_bytes, "/",
        plan.scales_bytes));
  }
  if (plan.scales_bytes == 0) return absl::OkStatus();
  int previous = 0;
  WPREP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  WPREP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void *d_in = nullptr, *d_v = nullptr, *d_s = nullptr;
  absl::Status st = WPREP_CUDA_STATUS(cudaMalloc(&d_in, in_size > 0 ? in_size : 1));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_v, values_size > 0 ? values_size : 1)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMalloc(&d_s, scales_size)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(d_in, in, in_size, cudaMemcpyHostToDevice)));
  if (st.ok()) st.Update(QuantizeOnCuda(plan, d_in, d_v, d_s, nullptr));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(values, d_v, values_size, cudaMemcpyDeviceToHost)));
  if (st.ok()) st.Update(WPREP_CUDA_STATUS(cudaMemcpy(scales, d_s, scales_size, cudaMemcpyDeviceToHost)));
  (void)cudaFree(d_in);
  (void)cudaFree(d_v);
  (void)cudaFree(d_s);
  (void)cudaSetDevice(previous);  // best effort: the status that matters is st
  return st;
}

}  // namespace wprep
