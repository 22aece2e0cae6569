// wprep::client_cuda's VmmExporter on a GPU, against a real wprepd on the same GPU: a pool
// the test builds with cuMemCreate (POSIX fd exportable, as vLLM's CuMemAllocator does)
// and maps as two physical chunks back to back; a tensor spanning both chunks converts
// byte for byte as the local engine converts it, repeatedly through one mapping, and the
// per-call time beside a legacy cudaMalloc IPC buffer is printed. Skipped where no GPU
// exists.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "daemon_harness.h"
#include "driver_entry.h"
#include "golden.h"
#include "shared_daemon.h"
#include "wprep/client/client.h"
#include "wprep/client/cuda_ipc.h"
#include "wprep/client/cuda_vmm.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

namespace v1 = wprep::v1;

using testing::DriverEntry;

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

// `chunks` physical allocations of `chunk_bytes` each (cuMemCreate, POSIX fd exportable),
// mapped back to back in one reserved range on device 0.
class CuMemPool {
 public:
  CuMemPool(int chunks, size_t chunk_bytes) : bytes_(static_cast<size_t>(chunks) * chunk_bytes) {
    Build(chunks, chunk_bytes);
  }
  ~CuMemPool() {
    if (base_ == 0) return;
    cudaDeviceSynchronize();
    if (ok_) unmap_(base_, bytes_);
    free_(base_, bytes_);
  }
  bool ok() const { return ok_; }
  uint8_t* at(size_t off) const { return reinterpret_cast<uint8_t*>(base_) + off; }

 private:
  void Build(int chunks, size_t chunk_bytes) {
    auto create = DriverEntry<CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                                     unsigned long long)>("cuMemCreate");
    auto reserve = DriverEntry<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
        "cuMemAddressReserve");
    auto map = DriverEntry<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)>(
        "cuMemMap");
    auto access = DriverEntry<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>("cuMemSetAccess");
    release_ = DriverEntry<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
    unmap_ = DriverEntry<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
    free_ = DriverEntry<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
    ASSERT_TRUE(create && reserve && map && access && release_ && unmap_ && free_);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the primary context
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    ASSERT_EQ(reserve(&base_, bytes_, 0, 0, 0), CUDA_SUCCESS);
    for (int i = 0; i < chunks; ++i) {
      CUmemGenericAllocationHandle h = 0;
      ASSERT_EQ(create(&h, chunk_bytes, &prop, 0), CUDA_SUCCESS);
      ASSERT_EQ(map(base_ + i * chunk_bytes, chunk_bytes, 0, h, 0), CUDA_SUCCESS);
      release_(h);  // the mapping keeps it
    }
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_EQ(access(base_, bytes_, &a, 1), CUDA_SUCCESS);
    ASSERT_EQ(cudaMemset(reinterpret_cast<void*>(base_), 0xEE, bytes_), cudaSuccess);
    ok_ = true;
  }

  size_t bytes_;
  CUdeviceptr base_ = 0;
  bool ok_ = false;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*unmap_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*free_)(CUdeviceptr, size_t) = nullptr;
};

class ClientVmmTest : public testing::SharedDaemonTest<ClientVmmTest> {
 protected:
  static void SetUpTestSuite() { StartSharedDaemon({}, absl::Seconds(300)); }
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    client_ = std::make_unique<client::Client>(daemon_->unix_target(), 1);
    absl::StatusOr<v1::ListDevicesResponse> d = client_->ListDevices();
    ASSERT_TRUE(d.ok()) << d.status();
    if (d->devices_size() == 0) GTEST_SKIP() << "the daemon uses no GPU";
    EXPECT_TRUE(d->devices(0).import_capabilities().legacy_ipc());
    if (!d->devices(0).import_capabilities().posix_fd()) GTEST_SKIP() << "the GPU cannot import POSIX fds";
  }
  std::unique_ptr<client::Client> client_;
};

TEST_F(ClientVmmTest, ATensorSpanningTwoChunksConvertsByteExactThroughOneMapping) {
  ConversionSpec spec;
  spec.layout = Layout::kHopperValue;
  spec.packing_axis = -2;
  const std::vector<int64_t> shape = {4, 512, 768};
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(11, 4 * 768 * 256);
  absl::StatusOr<Plan> plan = MakePlan(spec, shape);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<uint8_t> want(plan->output_bytes);
  ASSERT_TRUE(ConvertOnCpu(*plan, in.data(), in.size(), want.data(), want.size()).ok());

  const size_t chunk = 2 << 20;
  CuMemPool pool(4, chunk);
  ASSERT_TRUE(pool.ok());
  const size_t src_off = chunk - 4096, dst_off = 2 * chunk + 512;  // the source spans chunks 0 and 1
  ASSERT_EQ(cudaMemcpy(pool.at(src_off), in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  client::VmmExporter ex;
  absl::StatusOr<v1::CudaIpcBuffer> src = ex.Export(pool.at(src_off), in.size(), 0);
  absl::StatusOr<v1::CudaIpcBuffer> dst = ex.Export(pool.at(dst_off), want.size(), 0);
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(dst.ok()) << dst.status();
  ASSERT_EQ(src->vmm().chunks_size(), 2);
  EXPECT_EQ(src->offset(), chunk - 4096);

  v1::ConvertRequest r;
  *r.mutable_spec() = SpecToProto(spec);
  for (int64_t d : shape) r.add_logical_shape(d);
  *r.mutable_source_ipc() = *src;
  *r.mutable_destination_ipc() = *dst;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(cudaMemset(pool.at(dst_off), 0, want.size()), cudaSuccess);
    absl::StatusOr<v1::ConvertResponse> resp = client_->Convert(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    std::vector<uint8_t> got(want.size());
    ASSERT_EQ(cudaMemcpy(got.data(), pool.at(dst_off), got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, want) << "call " << i;
  }
  std::vector<uint8_t> before(512);
  ASSERT_EQ(cudaMemcpy(before.data(), pool.at(dst_off - 512), 512, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(before, std::vector<uint8_t>(512, 0xEE));

  // Per-call cost once mapped, beside a legacy IPC buffer of the same sizes (printed: the
  // acceptance figure; no timed assertion).
  void* legacy = nullptr;
  ASSERT_EQ(cudaMalloc(&legacy, 8 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(legacy, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  client::IpcExporter ipc;
  v1::ConvertRequest lr = r;
  *lr.mutable_source_ipc() = *ipc.Export(legacy, in.size());
  *lr.mutable_destination_ipc() = *ipc.Export(static_cast<uint8_t*>(legacy) + (4 << 20), want.size());
  auto time_calls = [&](const v1::ConvertRequest& req) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) EXPECT_TRUE(client_->Convert(req).ok());
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200;
  };
  time_calls(lr);
  time_calls(r);
  const double legacy_us = time_calls(lr), vmm_us = time_calls(r);
  std::printf("per call: legacy IPC %.1f us, VMM %.1f us (%.1f%%)\n", legacy_us, vmm_us,
              100.0 * (vmm_us - legacy_us) / legacy_us);
  cudaFree(legacy);
}

}  // namespace
}  // namespace wprep
