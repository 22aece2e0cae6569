#include "exec/ready_words.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "net/log.h"

namespace wprep::server {

ReadyWords::ReadyWords(absl::Duration timeout, absl::Duration period)
    : timeout_(timeout), period_(period), thread_([this] { Run(); }) {}

ReadyWords::~ReadyWords() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void ReadyWords::Watch(uint32_t* word, uint32_t value, std::shared_ptr<const void> keep, uint64_t owner,
                       uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  entries_.push_back({word, value, std::move(keep), owner, request_id, absl::Now() + timeout_});
}

void ReadyWords::ReleaseOwner(uint64_t owner) {
  if (owner == 0) return;
  absl::MutexLock lock(&mu_);
  Sweep([owner](const Entry& e) { return e.owner == owner; }, Why::kClientGone);
}

void ReadyWords::CountIn(prometheus::Counter* timeout, prometheus::Counter* client_gone) {
  absl::MutexLock lock(&mu_);
  timeout_counter_ = timeout;
  gone_counter_ = client_gone;
}

size_t ReadyWords::watched() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

uint64_t ReadyWords::released_after_timeout() const {
  absl::MutexLock lock(&mu_);
  return after_timeout_;
}

uint64_t ReadyWords::released_for_gone_clients() const {
  absl::MutexLock lock(&mu_);
  return for_gone_clients_;
}

bool ReadyWords::Release(const Entry& e, Why why) {
  // A client's stream may write the word at the same moment: it writes this value or a later
  // one, and a wait passes on either, so the race loses nothing.
  if (Reached(__atomic_load_n(e.word, __ATOMIC_ACQUIRE), e.value)) return false;
  __atomic_store_n(e.word, e.value, __ATOMIC_SEQ_CST);
  LogLine(LogLevel::kWarning, "ready_word_released",
          absl::StrCat("id=", e.request_id, " value=", e.value,
                       " why=", why == Why::kTimeout ? "timeout" : "client_gone",
                       why == Why::kTimeout ? " note=\"the client did not write its ready word in time; the batch "
                                              "read its sources as they were\""
                                            : ""));
  return true;
}

template <class Due>
void ReadyWords::Sweep(Due due, Why why) {
  auto keep = std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    if (Reached(__atomic_load_n(e.word, __ATOMIC_ACQUIRE), e.value)) return true;
    if (!due(e)) return false;
    if (Release(e, why)) {
      ++(why == Why::kTimeout ? after_timeout_ : for_gone_clients_);
      if (prometheus::Counter* c = why == Why::kTimeout ? timeout_counter_ : gone_counter_; c != nullptr) c->Increment();
    }
    return true;
  });
  entries_.erase(keep, entries_.end());
}

void ReadyWords::Run() {
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping), period_)) {
    const absl::Time now = absl::Now();
    Sweep([now](const Entry& e) { return e.deadline <= now; }, Why::kTimeout);
  }
}

}  // namespace wprep::server
