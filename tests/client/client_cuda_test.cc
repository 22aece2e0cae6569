// wprep::client_cuda (IpcExporter) on a GPU, against a real wprepd on the same GPU:
// tensors that sit in the middle of larger allocations convert byte for byte through
// the daemon, IPC -> IPC, as the local engine (wprep::ConvertOnCpu, checked against the
// reference vectors elsewhere) converts the same bytes. Skipped where no GPU exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon_harness.h"
#include "golden.h"
#include "shared_daemon.h"
#include "wprep/client/batch.h"
#include "wprep/client/client.h"
#include "wprep/client/cuda_ipc.h"
#include "wprep/kernels/cpu_engine.h"
#include "wprep/kernels/plan.h"

namespace wprep {
namespace {

namespace v1 = wprep::v1;

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

std::vector<uint8_t> Expected(const client::TensorConversion& c, const std::vector<uint8_t>& in) {
  absl::StatusOr<Plan> plan = MakePlan(c.spec, c.logical_shape, InputBinding{c.input_strides, in.size()});
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<uint8_t> out(plan->output_bytes);
  EXPECT_TRUE(ConvertOnCpu(*plan, in.data(), in.size(), out.data(), out.size()).ok());
  return out;
}

// One cudaMalloc'd pool, filled with a canary, freed at the end.
struct Pool {
  explicit Pool(size_t bytes) : size(bytes) {
    EXPECT_EQ(cudaMalloc(&base, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(base, 0xEE, bytes), cudaSuccess);
  }
  ~Pool() { cudaFree(base); }
  uint8_t* at(size_t off) const { return static_cast<uint8_t*>(base) + off; }
  void Put(size_t off, const std::vector<uint8_t>& b) const {
    ASSERT_EQ(cudaMemcpy(at(off), b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Get(size_t off, size_t n) const {
    std::vector<uint8_t> b(n);
    EXPECT_EQ(cudaMemcpy(b.data(), at(off), n, cudaMemcpyDeviceToHost), cudaSuccess);
    return b;
  }
  void* base = nullptr;
  size_t size = 0;
};

class ClientCudaTest : public testing::SharedDaemonTest<ClientCudaTest> {
 protected:
  // The daemon starts before this process touches CUDA (it is forked from here).
  static void SetUpTestSuite() { StartSharedDaemon({}, absl::Seconds(300)); }
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    client_ = std::make_unique<client::Client>(daemon_->unix_target(), 1);
    absl::StatusOr<v1::ListDevicesResponse> d = client_->ListDevices();
    ASSERT_TRUE(d.ok()) << d.status();
    if (d->devices_size() == 0) GTEST_SKIP() << "the daemon uses no GPU";
  }
  std::unique_ptr<client::Client> client_;
};

TEST_F(ClientCudaTest, APointerIntoTheMiddleOfAnAllocationConvertsByteExact) {
  client::TensorConversion c;
  c.spec.layout = Layout::kHopperValue;
  c.spec.packing_axis = -2;
  c.logical_shape = {4, 512, 768};
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(11, 4 * 768 * 256);
  const std::vector<uint8_t> want = Expected(c, in);
  Pool pool(64 << 20);
  const size_t src_off = (1 << 20) + 4096 + 256, dst_off = (40 << 20) + 512;
  pool.Put(src_off, in);

  client::IpcExporter ex;
  absl::StatusOr<v1::CudaIpcBuffer> src = ex.Export(pool.at(src_off), in.size());
  absl::StatusOr<v1::CudaIpcBuffer> dst = ex.Export(pool.at(dst_off), want.size());
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(dst.ok()) << dst.status();
  EXPECT_EQ(ex.cached(), 1u);  // one allocation, exported once
  EXPECT_EQ(src->handle(), dst->handle());
  EXPECT_EQ(src->handle().size(), 64u);
  EXPECT_EQ(src->device_uuid().size(), 16u);
  EXPECT_EQ(src->offset(), src_off);
  EXPECT_EQ(dst->offset(), dst_off);

  v1::ConvertRequest r;
  *r.mutable_spec() = SpecToProto(c.spec);
  for (int64_t d : c.logical_shape) r.add_logical_shape(d);
  *r.mutable_source_ipc() = *src;
  *r.mutable_destination_ipc() = *dst;
  absl::StatusOr<v1::ConvertResponse> resp = client_->Convert(r);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->peak_extra_device_bytes(), 0u);
  EXPECT_EQ(pool.Get(dst_off, want.size()), want);
  // Nothing outside the destination was written.
  const std::vector<uint8_t> before = pool.Get(dst_off - 512, 512), after = pool.Get(dst_off + want.size(), 4096);
  EXPECT_EQ(before, std::vector<uint8_t>(512, 0xEE));
  EXPECT_EQ(after, std::vector<uint8_t>(4096, 0xEE));
  EXPECT_TRUE(ex.Release(*client_, pool.at(src_off)).ok());
  EXPECT_EQ(ex.cached(), 0u);
}

// A gpt-oss projection from its checkpoint bytes in device memory: values and the
// strided scale view in one ConvertBatch, IPC -> IPC, sources and destinations in two
// allocations.
TEST_F(ClientCudaTest, ACheckpointPairConvertsInOneBatch) {
  const int64_t e = 4, n = 384, g = 6;  // K = 192
  ConversionSpec hv, hs;
  hv.layout = Layout::kHopperValue;
  hs.layout = Layout::kHopperScale;
  const client::TensorConversion values = *client::CheckpointValues(hv, {e, n, g, 16});
  const client::TensorConversion scales = *client::CheckpointScales(hs, {e, n, g});
  const std::vector<uint8_t> vin = testing::SplitMix64Bytes(5, static_cast<uint64_t>(e * n * g * 16));
  const std::vector<uint8_t> sin = testing::SplitMix64Bytes(6, static_cast<uint64_t>(e * n * g));
  const std::vector<uint8_t> vwant = Expected(values, vin), swant = Expected(scales, sin);
  Pool sources(8 << 20), outputs(8 << 20);
  sources.Put(4096, vin);
  sources.Put(3 << 20, sin);
  client::IpcExporter ex;
  client::BatchBuilder b;
  auto exp = [&](void* p, uint64_t size) {
    absl::StatusOr<v1::CudaIpcBuffer> r = ex.Export(p, size);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  };
  const v1::CudaIpcBuffer vout = exp(outputs.at(256), vwant.size());
  const v1::CudaIpcBuffer sout = exp(outputs.at(5 << 20), swant.size());
  b.AddIpc(values, exp(sources.at(4096), vin.size()), &vout);
  b.AddIpc(scales, exp(sources.at(3 << 20), sin.size()), &sout);
  EXPECT_EQ(ex.cached(), 2u);
  EXPECT_EQ(b.request().items(1).convert().source().ipc().strides_size(), 3);
  absl::StatusOr<v1::ConvertBatchResponse> r = client_->ConvertBatch(b.Take());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(outputs.Get(256, vwant.size()), vwant);
  EXPECT_EQ(outputs.Get(5 << 20, swant.size()), swant);
  v1::ReleaseIpcHandlesRequest release;
  for (v1::IpcHandleRef& ref : ex.ForgetAll()) *release.add_handles() = std::move(ref);
  EXPECT_EQ(release.handles_size(), 2);
  EXPECT_TRUE(client_->ReleaseIpcHandles(release).ok());
}

// The loaders' value conversion (Hopper, mma 3, from checkpoint order) of 32 MiB in and out.
client::TensorConversion CheckpointHopperValues32MiB() {
  client::TensorConversion c;
  c.spec.layout = Layout::kHopperValue;
  c.spec.hopper = {-2, 3};
  c.spec.packing_axis = -2;
  c.logical_shape = {4, 4096, 4096};
  return c;
}

// A batch with a CompletionEvent is answered once its work is queued: a copy queued on the
// client's stream after StreamWait reads the finished outputs (the batch's 8 x 32 MiB keep
// the GPU busy well past the answer), and Synchronize waits for them on the host. The
// answer's kernel times are 0.
TEST_F(ClientCudaTest, ACompletionEventOrdersTheClientsStreamAfterTheBatch) {
  const client::TensorConversion c = CheckpointHopperValues32MiB();
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(9, 32ull << 20);
  const std::vector<uint8_t> want = Expected(c, in);
  constexpr int kItems = 8;
  Pool sources(kItems * (32ull << 20)), outputs(kItems * (32ull << 20)), copies(kItems * (32ull << 20));
  for (int i = 0; i < kItems; ++i) sources.Put(i * (32ull << 20), in);
  client::IpcExporter ex;
  absl::StatusOr<client::CompletionEvent> ev = client::CompletionEvent::Create(0);
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ(ev->ref().handle().size(), 64u);
  EXPECT_EQ(ev->ref().device_uuid().size(), 16u);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int rep = 0; rep < 3; ++rep) {
    ASSERT_EQ(cudaMemset(outputs.base, 0, outputs.size), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    client::BatchBuilder b;
    for (int i = 0; i < kItems; ++i) {
      absl::StatusOr<v1::CudaIpcBuffer> src = ex.Export(sources.at(i * (32ull << 20)), in.size());
      absl::StatusOr<v1::CudaIpcBuffer> dst = ex.Export(outputs.at(i * (32ull << 20)), want.size());
      ASSERT_TRUE(src.ok() && dst.ok());
      b.AddIpc(c, *src, &*dst);
    }
    v1::ConvertBatchRequest req = b.Take();
    ev->AttachTo(&req);
    absl::StatusOr<v1::ConvertBatchResponse> r = client_->ConvertBatch(req);
    ASSERT_TRUE(r.ok()) << r.status();
    for (const v1::BatchItemResult& it : r->items()) EXPECT_EQ(it.kernel_seconds(), 0);
    ASSERT_TRUE(ev->StreamWait(stream).ok());
    ASSERT_EQ(cudaMemcpyAsync(copies.base, outputs.base, outputs.size, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(copies.Get(0, want.size()), want) << "rep " << rep << ": the stream read before the batch was done";
    EXPECT_EQ(copies.Get((kItems - 1) * (32ull << 20), want.size()), want) << "rep " << rep;
    EXPECT_TRUE(ev->Synchronize().ok());
  }
  cudaStreamDestroy(stream);
  v1::ReleaseIpcHandlesRequest release;
  for (v1::IpcHandleRef& ref : ex.ForgetAll()) *release.add_handles() = std::move(ref);
  EXPECT_TRUE(client_->ReleaseIpcHandles(release).ok());
}

// With RecordReady the batch's work waits on the GPU for the client's stream: while a host
// function holds the stream (the sources' producer, still busy when the request is sent)
// the daemon answers, writes nothing, and the sources' real bytes, copied in after the
// hold, are what it converts.
TEST_F(ClientCudaTest, AReadyEventOrdersTheBatchAfterTheClientsStream) {
  const client::TensorConversion c = CheckpointHopperValues32MiB();
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(11, 32ull << 20);
  const std::vector<uint8_t> want = Expected(c, in);
  Pool source(in.size()), output(want.size()), copy(want.size());
  void* staged = nullptr;  // pinned, so the copy into the source is asynchronous
  ASSERT_EQ(cudaMallocHost(&staged, in.size()), cudaSuccess);
  std::memcpy(staged, in.data(), in.size());
  client::IpcExporter ex;
  absl::StatusOr<client::CompletionEvent> ev = client::CompletionEvent::Create(0);
  ASSERT_TRUE(ev.ok()) << ev.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int rep = 0; rep < 2; ++rep) {
    ASSERT_EQ(cudaMemset(source.base, 0, source.size), cudaSuccess);
    ASSERT_EQ(cudaMemset(output.base, 0, output.size), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::atomic<bool> go{false};
    ASSERT_EQ(cudaLaunchHostFunc(
                  stream,
                  [](void* p) {
                    while (!static_cast<std::atomic<bool>*>(p)->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                  },
                  &go),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(source.base, staged, in.size(), cudaMemcpyHostToDevice, stream), cudaSuccess);
    client::BatchBuilder b;
    absl::StatusOr<v1::CudaIpcBuffer> src = ex.Export(source.base, in.size());
    absl::StatusOr<v1::CudaIpcBuffer> dst = ex.Export(output.base, want.size());
    ASSERT_TRUE(src.ok() && dst.ok());
    b.AddIpc(c, *src, &*dst);
    v1::ConvertBatchRequest req = b.Take();
    ASSERT_TRUE(ev->RecordReady(stream, &req).ok());
    ev->AttachTo(&req);
    absl::StatusOr<v1::ConvertBatchResponse> r = client_->ConvertBatch(req);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_EQ(output.Get(0, 4096), std::vector<uint8_t>(4096, 0)) << "rep " << rep << ": written before the stream was ready";
    go = true;
    ASSERT_TRUE(ev->StreamWait(stream).ok());
    ASSERT_EQ(cudaMemcpyAsync(copy.base, output.base, output.size, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(copy.Get(0, want.size()), want) << "rep " << rep << ": converted before the sources were written";
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(staged);
  v1::ReleaseIpcHandlesRequest release;
  for (v1::IpcHandleRef& ref : ex.ForgetAll()) *release.add_handles() = std::move(ref);
  EXPECT_TRUE(client_->ReleaseIpcHandles(release).ok());
}

TEST_F(ClientCudaTest, RefusesWhatHasNoHandle) {
  client::IpcExporter ex;
  std::vector<uint8_t> host(4096);
  absl::StatusOr<v1::CudaIpcBuffer> r = ex.Export(host.data(), host.size());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 4096), cudaSuccess);
  r = ex.Export(managed, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  cudaFree(managed);
  Pool pool(1 << 20);
  r = ex.Export(pool.at(1000), pool.size);  // runs past the allocation's end
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(ex.Export(pool.at(1000), pool.size - 1000).ok());
}

// Memory released and allocated again is exported afresh once the old entry is gone.
TEST_F(ClientCudaTest, ReleasedMemoryIsExportedAfresh) {
  client::TensorConversion c;
  c.spec.layout = Layout::kBlackwellValue;
  c.logical_shape = {256, 512};
  const std::vector<uint8_t> in = testing::SplitMix64Bytes(9, 256 * 256);
  const std::vector<uint8_t> want = Expected(c, in);
  client::IpcExporter ex;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    Pool src(1 << 20), dst(1 << 20);
    src.Put(512, in);
    v1::ConvertRequest r;
    *r.mutable_spec() = SpecToProto(c.spec);
    for (int64_t d : c.logical_shape) r.add_logical_shape(d);
    *r.mutable_source_ipc() = *ex.Export(src.at(512), in.size());
    *r.mutable_destination_ipc() = *ex.Export(dst.at(1024), want.size());
    absl::StatusOr<v1::ConvertResponse> resp = client_->Convert(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(dst.Get(1024, want.size()), want);
    EXPECT_TRUE(ex.Release(*client_, src.base).ok());
    EXPECT_TRUE(ex.Release(*client_, dst.at(100)).ok());  // any pointer into it
    EXPECT_EQ(ex.cached(), 0u);
  }
}

}  // namespace
}  // namespace wprep
