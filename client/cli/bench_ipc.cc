#include "bench_ipc.h"

#include "absl/strings/str_cat.h"
#include "wprep/config.h"

#if WPREP_HAVE_CUDA
#include <cuda_runtime.h>

#include "wprep/client/cuda_ipc.h"
#include "wprep/proto/spec_codec.h"
#endif

namespace wprep::cli {

#if WPREP_HAVE_CUDA
namespace {

class CudaIpcBench final : public IpcBench {
 public:
  ~CudaIpcBench() override {
    for (void* p : buffers_) cudaFree(p);
    cudaGetLastError();
  }

  absl::Status Prepare(const std::vector<BenchItem>& items) {
    for (const BenchItem& item : items) {
      void* in = nullptr;
      void* out = nullptr;
      // The tensors sit inside larger allocations, as a loader's pool holds them.
      if (cudaError_t e = cudaMalloc(&in, item.input.size() + 4096); e != cudaSuccess) return Cuda(e, "cudaMalloc");
      buffers_.push_back(in);
      if (cudaError_t e = cudaMalloc(&out, item.output_bytes + 4096); e != cudaSuccess) return Cuda(e, "cudaMalloc");
      buffers_.push_back(out);
      uint8_t* src = static_cast<uint8_t*>(in) + 256;
      uint8_t* dst = static_cast<uint8_t*>(out) + 256;
      if (cudaError_t e = cudaMemcpy(src, item.input.data(), item.input.size(), cudaMemcpyHostToDevice);
          e != cudaSuccess) {
        return Cuda(e, "cudaMemcpy");
      }
      wprep::v1::ConvertRequest r;
      *r.mutable_spec() = SpecToProto(item.spec);
      for (int64_t d : item.logical_shape) r.add_logical_shape(d);
      absl::StatusOr<wprep::v1::CudaIpcBuffer> s = exporter_.Export(src, item.input.size(), item.input_strides);
      if (!s.ok()) return s.status();
      absl::StatusOr<wprep::v1::CudaIpcBuffer> d = exporter_.Export(dst, item.output_bytes);
      if (!d.ok()) return d.status();
      *r.mutable_source_ipc() = *std::move(s);
      *r.mutable_destination_ipc() = *std::move(d);
      requests_.push_back(std::move(r));
    }
    return absl::OkStatus();
  }

  absl::Status Convert(client::Client& client, size_t i) override {
    return client.Convert(requests_[i % requests_.size()]).status();
  }

  void Release(client::Client& client) override {
    wprep::v1::ReleaseIpcHandlesRequest release;
    for (wprep::v1::IpcHandleRef& ref : exporter_.ForgetAll()) *release.add_handles() = std::move(ref);
    (void)client.ReleaseIpcHandles(release);
  }

 private:
  static absl::Status Cuda(cudaError_t e, const char* call) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(call, " failed: ", cudaGetErrorString(e)));
  }

  client::IpcExporter exporter_;
  std::vector<void*> buffers_;
  std::vector<wprep::v1::ConvertRequest> requests_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<IpcBench>> IpcBench::Make(const std::vector<BenchItem>& items) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("the ipc mode needs a GPU in this process, and none is visible");
  }
  auto b = std::make_unique<CudaIpcBench>();
  if (absl::Status s = b->Prepare(items); !s.ok()) return s;
  return b;
}
#else
absl::StatusOr<std::unique_ptr<IpcBench>> IpcBench::Make(const std::vector<BenchItem>&) {
  return absl::UnimplementedError("the ipc mode needs a wprep built with CUDA");
}
#endif

}  // namespace wprep::cli
