#include "device/completions.h"

#include <utility>

#include "net/log.h"

namespace wprep::server {

Completions::Completions(DeviceRuntime* runtime, size_t max_pending)
    : runtime_(runtime), max_pending_(max_pending == 0 ? 1 : max_pending), thread_([this] { Run(); }) {}

Completions::~Completions() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Completions::Add(Work work) {
  absl::MutexLock lock(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ < max_pending_; };
  mu_.Await(absl::Condition(&room));
  ++pending_;
  queue_.push_back(std::move(work));
}

size_t Completions::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

void Completions::Run() {
  for (;;) {
    Work work;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and everything added is done
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    const absl::Status s = runtime_->SynchronizeEvent(work.gpu, work.event);
    if (!s.ok()) LogLine(LogLevel::kError, "completion_wait_failed", LogQuote(s.message()));
    std::move(work.done)(s);
    work.done = nullptr;  // what it held goes before the work counts as finished
    absl::MutexLock lock(&mu_);
    --pending_;
  }
}

}  // namespace wprep::server
