// ThreadSanitizer annotations for the system's abseil synchronization (WPREP_TSAN only).
//
// The daemon, gRPC and abseil all lock absl::Mutex, whose code lives in the Debian
// library libabsl_synchronization.so, built without ThreadSanitizer: TSan sees none of
// its lock operations, so every member guarded by a mutex would look like a race. This
// library is linked ahead of every binary of the TSan build (link_libraries in the root
// CMakeLists.txt), so its definitions of the public lock operations interpose the
// library's for every caller (our code, gRPC's, abseil's own). Each one tells TSan what
// it does, with the annotations abseil itself makes when built with TSan
// (absl/base/internal/tsan_mutex_interface.h), and calls the real one (dlsym RTLD_NEXT).
//
// Between an operation's pre and post annotations TSan ignores memory accesses: that
// covers the conditions abseil evaluates inside Unlock and Await on behalf of waiting
// threads, as abseil's own annotated build does. Destruction is not annotated: gRPC
// destroys mutexes in threads other than those that used them, ordered by reference
// counts TSan cannot see, and TSan forgets a mutex when its memory is freed anyway.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

static_assert(ABSL_OPTION_USE_INLINE_NAMESPACE == 1, "the mangled names below assume absl::<inline namespace>");

#define WPREP_STR(x) WPREP_STR_INNER(x)
#define WPREP_STR_INNER(x) #x

namespace {

// The library's definition of absl::<ns>::`rest` (its mangled name after the namespaces).
// A const member function's name starts _ZNK: pass `konst`.
template <typename Fn>
Fn Real(const char* rest, bool konst = false) {
  const char* ns = WPREP_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string mangled = std::string(konst ? "_ZNK4absl" : "_ZN4absl") + std::to_string(std::strlen(ns)) + ns + rest;
  void* p = dlsym(RTLD_NEXT, mangled.c_str());
  if (p == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: %s not found: %s\n", mangled.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

// The real function, resolved once.
#define WPREP_REAL(type, rest) static const auto real = Real<type>(rest)
#define WPREP_REAL_CONST(type, rest) static const auto real = Real<type>(rest, true)

// The library's operations call each other (WaitWithTimeout calls WaitWithDeadline, for
// one), through the same interposed symbols: only the outermost call of a thread is
// annotated.
thread_local int depth = 0;
struct Outermost {
  Outermost() : outer(depth++ == 0) {}
  ~Outermost() { --depth; }
  const bool outer;
};

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Time;

constexpr unsigned kRead = __tsan_mutex_read_lock;
constexpr unsigned kTry = __tsan_mutex_try_lock;
constexpr unsigned kTryFailed = __tsan_mutex_try_lock_failed;

// The caller holds `mu` on entry and on exit, and the wait in between releases it: a
// release now, an acquire after. Accesses inside `wait` (conditions it evaluates) are
// ignored, as they are inside any annotated unlock.
template <typename Wait>
auto ReleaseWaitAcquire(const void* mu, unsigned flags, Wait wait) {
  void* m = const_cast<void*>(mu);
  __tsan_mutex_pre_unlock(m, flags);
  auto r = wait();
  __tsan_mutex_post_unlock(m, flags);
  __tsan_mutex_pre_lock(m, flags);
  __tsan_mutex_post_lock(m, flags, 0);
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  WPREP_REAL(void (*)(Mutex*), "5Mutex4LockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::ReaderLock() {
  WPREP_REAL(void (*)(Mutex*), "5Mutex10ReaderLockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_lock(this, kRead);
  real(this);
  __tsan_mutex_post_lock(this, kRead, 0);
}

bool Mutex::TryLock() {
  WPREP_REAL(bool (*)(Mutex*), "5Mutex7TryLockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_lock(this, kTry);
  const bool ok = real(this);
  __tsan_mutex_post_lock(this, kTry | (ok ? 0 : kTryFailed), 0);
  return ok;
}

bool Mutex::ReaderTryLock() {
  WPREP_REAL(bool (*)(Mutex*), "5Mutex13ReaderTryLockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_lock(this, kRead | kTry);
  const bool ok = real(this);
  __tsan_mutex_post_lock(this, kRead | kTry | (ok ? 0 : kTryFailed), 0);
  return ok;
}

void Mutex::Unlock() {
  WPREP_REAL(void (*)(Mutex*), "5Mutex6UnlockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderUnlock() {
  WPREP_REAL(void (*)(Mutex*), "5Mutex12ReaderUnlockEv");
  Outermost o;
  if (!o.outer) return real(this);
  __tsan_mutex_pre_unlock(this, kRead);
  real(this);
  __tsan_mutex_post_unlock(this, kRead);
}

void Mutex::LockWhen(const Condition& cond) {
  WPREP_REAL(void (*)(Mutex*, const Condition&), "5Mutex8LockWhenERKNS0_9ConditionE");
  Outermost o;
  if (!o.outer) return real(this, cond);
  __tsan_mutex_pre_lock(this, 0);
  real(this, cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Duration),
             "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Outermost o;
  if (!o.outer) return real(this, cond, timeout);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = real(this, cond, timeout);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Time),
             "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Outermost o;
  if (!o.outer) return real(this, cond, deadline);
  __tsan_mutex_pre_lock(this, 0);
  const bool r = real(this, cond, deadline);
  __tsan_mutex_post_lock(this, 0, 0);
  return r;
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  WPREP_REAL(void (*)(Mutex*, const Condition&), "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Outermost o;
  if (!o.outer) return real(this, cond);
  __tsan_mutex_pre_lock(this, kRead);
  real(this, cond);
  __tsan_mutex_post_lock(this, kRead, 0);
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Duration),
             "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Outermost o;
  if (!o.outer) return real(this, cond, timeout);
  __tsan_mutex_pre_lock(this, kRead);
  const bool r = real(this, cond, timeout);
  __tsan_mutex_post_lock(this, kRead, 0);
  return r;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Time),
             "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Outermost o;
  if (!o.outer) return real(this, cond, deadline);
  __tsan_mutex_pre_lock(this, kRead);
  const bool r = real(this, cond, deadline);
  __tsan_mutex_post_lock(this, kRead, 0);
  return r;
}

void Mutex::Await(const Condition& cond) {
  WPREP_REAL(void (*)(Mutex*, const Condition&), "5Mutex5AwaitERKNS0_9ConditionE");
  Outermost o;
  if (!o.outer) return real(this, cond);
  ReleaseWaitAcquire(this, 0, [&] {
    real(this, cond);
    return 0;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Duration),
             "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Outermost o;
  if (!o.outer) return real(this, cond, timeout);
  return ReleaseWaitAcquire(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  WPREP_REAL(bool (*)(Mutex*, const Condition&, Time),
             "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Outermost o;
  if (!o.outer) return real(this, cond, deadline);
  return ReleaseWaitAcquire(this, 0, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  WPREP_REAL(void (*)(CondVar*, Mutex*), "7CondVar4WaitEPNS0_5MutexE");
  Outermost o;
  if (!o.outer) return real(this, mu);
  ReleaseWaitAcquire(mu, 0, [&] {
    real(this, mu);
    return 0;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  WPREP_REAL(bool (*)(CondVar*, Mutex*, Duration),
             "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Outermost o;
  if (!o.outer) return real(this, mu, timeout);
  return ReleaseWaitAcquire(mu, 0, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  WPREP_REAL(bool (*)(CondVar*, Mutex*, Time),
             "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Outermost o;
  if (!o.outer) return real(this, mu, deadline);
  return ReleaseWaitAcquire(mu, 0, [&] { return real(this, mu, deadline); });
}

// absl::Notification: Notify stores its flag (a release) inside the library, where TSan
// does not see it, and HasBeenNotified, inline in the caller, loads it (an acquire TSan
// does see, with nothing to pair it with). So Notify releases on the flag's address,
// which is what the inline acquire reads, and each wait acquires on it once notified
// (a wait that finds the flag set returns without touching the mutex).
namespace {
// The flag follows the mutex (absl/synchronization/notification.h: mutex_, notified_yet_).
static_assert(sizeof(Notification) == 2 * sizeof(Mutex), "absl::Notification is no longer {Mutex, std::atomic<bool>}");
void* Flag(const Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(Mutex));
}
}  // namespace

void Notification::Notify() {
  WPREP_REAL(void (*)(Notification*), "12Notification6NotifyEv");
  __tsan_release(Flag(this));
  real(this);
}

void Notification::WaitForNotification() const {
  WPREP_REAL_CONST(void (*)(const Notification*), "12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(Flag(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  WPREP_REAL_CONST(bool (*)(const Notification*, Duration), "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(Flag(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  WPREP_REAL_CONST(bool (*)(const Notification*, Time), "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(Flag(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
