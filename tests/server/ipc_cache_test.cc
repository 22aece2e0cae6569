// Host-only tests of the IPC mapping cache through FakeRuntime's handles: opening once,
// range checks, deferred release, eviction, expiry, registration and the owner check.
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "fake_runtime.h"
#include "gtest/gtest.h"
#include "device/ipc_cache.h"
#include "device/ipc_owner.h"

namespace wprep::testing {
namespace {

using server::IpcCache;

TEST(IpcCache, OpensAHandleOnceAndPointsAtTheRequestedOffset) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 4096);
  {
    absl::StatusOr<IpcCache::Lease> a = cache.Acquire(0, e.handle, 0, 4096);
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<IpcCache::Lease> b = cache.Acquire(0, e.handle, 1000, 96);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->ptr(), e.ptr);
    EXPECT_EQ(b->ptr(), e.ptr + 1000);
  }
  EXPECT_EQ(rt.counts(0).ipc_opens, 1);
  EXPECT_EQ(cache.size(), 1u);
  cache.CloseAll();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(rt.counts(0).ipc_closes, 1);
}

TEST(IpcCache, RangesBeyondTheAllocationAndBadHandlesAreInvalidArgument) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 4096);
  for (auto [offset, size] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 4097}, {4096, 1}, {5000, 0},
                                                                         {1, ~0ull}}) {
    absl::Status s = cache.Acquire(0, e.handle, offset, size).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << offset << "+" << size;
    EXPECT_NE(s.message().find("beyond the allocation"), std::string::npos) << s;
  }
  EXPECT_TRUE(cache.Acquire(0, e.handle, 4096, 0).ok());
  EXPECT_EQ(cache.Acquire(0, std::string(63, 'x'), 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status unknown = cache.Acquire(0, std::string(64, 'x'), 0, 1).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("could not be opened"), std::string::npos) << unknown;
  EXPECT_EQ(cache.size(), 1u) << "a failed open must leave no entry";
}

TEST(IpcCache, ReleaseWhileLeasedClosesWhenTheLastLeaseEnds) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 64);
  {
    absl::StatusOr<IpcCache::Lease> lease = cache.Acquire(0, e.handle, 0, 64);
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(cache.Release(0, e.handle), std::make_pair(0, 1));
    EXPECT_EQ(rt.counts(0).ipc_closes, 0);
  }
  EXPECT_EQ(rt.counts(0).ipc_closes, 1);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.Release(0, e.handle), std::make_pair(0, 0)) << "unknown handles count as neither";
}

TEST(IpcCache, FullCacheEvictsTheLeastRecentlyUsedAndRefusesWhenAllAreInUse) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 2, absl::Minutes(5), nullptr);
  FakeRuntime::Exported a = rt.ExportHandle(0, 64), b = rt.ExportHandle(0, 64), c = rt.ExportHandle(0, 64);
  ASSERT_TRUE(cache.Acquire(0, a.handle, 0, 64).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(cache.Acquire(0, b.handle, 0, 64).ok());
  ASSERT_TRUE(cache.Acquire(0, c.handle, 0, 64).ok());  // evicts a
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(rt.counts(0).ipc_closes, 1);
  ASSERT_TRUE(cache.Acquire(0, b.handle, 0, 64).ok());  // still open
  EXPECT_EQ(rt.counts(0).ipc_opens, 3);

  absl::StatusOr<IpcCache::Lease> hold_b = cache.Acquire(0, b.handle, 0, 64);
  absl::StatusOr<IpcCache::Lease> hold_c = cache.Acquire(0, c.handle, 0, 64);
  ASSERT_TRUE(hold_b.ok() && hold_c.ok());
  absl::Status s = cache.Acquire(0, a.handle, 0, 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--ipc-cache-entries"), std::string::npos) << s;
}

TEST(IpcCache, IdleMappingsExpire) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Milliseconds(1), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 64);
  ASSERT_TRUE(cache.Acquire(0, e.handle, 0, 64).ok());
  absl::SleepFor(absl::Milliseconds(5));
  cache.ExpireIdle();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(rt.counts(0).ipc_closes, 1);
}

TEST(IpcCache, MemoryFreedByItsOwnerCannotBeReopenedOnceReleased) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 64);
  ASSERT_TRUE(cache.Acquire(0, e.handle, 0, 64).ok());
  rt.FreeExported(e.handle);
  EXPECT_EQ(cache.Release(0, e.handle), std::make_pair(1, 0));
  EXPECT_EQ(cache.Acquire(0, e.handle, 0, 64).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(IpcCache, RegistrationOpensAndTouchesOnceThenReportsItWasOpen) {
  FakeRuntime rt(2);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(1, 8192);
  absl::StatusOr<IpcCache::Registration> r = cache.Register(1, e.handle);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->was_open);
  EXPECT_EQ(r->allocation_bytes, 8192u);
  r = cache.Register(1, e.handle);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->was_open);
  EXPECT_EQ(rt.counts(1).ipc_opens, 1);
  EXPECT_EQ(rt.counts(1).touches, 1);
  ASSERT_TRUE(cache.Acquire(1, e.handle, 0, 8192).ok());
  EXPECT_EQ(rt.counts(1).ipc_opens, 1);
}

TEST(IpcCache, TheOwnerMapRefusesAHandleSentWithAnotherGpu) {
  FakeRuntime rt(2);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  // FakeRuntime writes the exporting GPU into byte 32 of its handles; two processes'
  // worth of samples make the calibration find it.
  std::vector<std::vector<std::string>> samples(2);
  for (int g = 0; g < 2; ++g) {
    for (int i = 0; i < 4; ++i) samples[g].push_back(rt.ExportHandle(g, 64).handle);
  }
  server::IpcOwnerMap map = server::IpcOwnerMap::FromSamples({0, 1}, samples);
  ASSERT_TRUE(map.enabled()) << map.description();
  cache.SetOwnerMap(map);
  FakeRuntime::Exported on1 = rt.ExportHandle(1, 64);
  absl::Status s = cache.Acquire(0, on1.handle, 0, 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("daemon's GPU ordinal 1"), std::string::npos) << s;
  EXPECT_EQ(rt.counts(0).ipc_opens, 0);
  EXPECT_TRUE(cache.Acquire(1, on1.handle, 0, 64).ok());
}

TEST(IpcCache, ConcurrentFirstRequestsOfOneHandleOpenItOnce) {
  FakeRuntime rt(1);
  IpcCache cache(&rt, 4, absl::Minutes(5), nullptr);
  FakeRuntime::Exported e = rt.ExportHandle(0, 64);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&] {
      if (cache.Acquire(0, e.handle, 0, 64).ok()) ok++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 16);
  EXPECT_EQ(rt.counts(0).ipc_opens, 1);
}

}  // namespace
}  // namespace wprep::testing
