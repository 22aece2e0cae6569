// Wait words (a batch's wait fence as a word of shared host memory, client_fence.h) the
// daemon's streams wait on, and
// the daemon's CPU writing them when their client cannot: a stream waiting for a word that
// never reaches its value would hold back every later work queued on it, other clients'
// included. A word is watched from the moment a wait for it is queued until it reaches its
// value (the client's stream wrote it, read from the CPU), and written by the daemon
//   - once `timeout` has passed without it (a client that never writes its word), or
//   - at once when its owner (a ConvertBatches stream) ends cancelled: the client's process
//     is gone, and with it the stream that would have written the word.
// Each such write is logged (event=ready_word_released) and counted; the batch's outputs are
// then whatever the sources held, which no client reads any more, or one whose client was
// too slow, which the log names. Words of GPU memory are not watched. Thread-safe.
#ifndef WPREP_SERVER_SRC_READY_WORDS_H_
#define WPREP_SERVER_SRC_READY_WORDS_H_

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"

namespace wprep::server {

class ReadyWords {
 public:
  // Checks the words every `period`.
  explicit ReadyWords(absl::Duration timeout, absl::Duration period = absl::Milliseconds(20));
  ~ReadyWords();
  ReadyWords(const ReadyWords&) = delete;
  ReadyWords& operator=(const ReadyWords&) = delete;

  // Watches `word` (its host address; `keep` holds the mapping) until it reaches `value`.
  // `owner`: the ConvertBatches stream that sent it (0: none); `request_id` names the
  // batch in the log.
  void Watch(uint32_t* word, uint32_t value, std::shared_ptr<const void> keep, uint64_t owner, uint64_t request_id);
  // The owner's client is gone: writes its words that have not reached their values now.
  void ReleaseOwner(uint64_t owner);
  // Counts the daemon's writes in these too (wprep_ready_words_released_total).
  void CountIn(prometheus::Counter* timeout, prometheus::Counter* client_gone);

  // Words watched now; words the daemon wrote so far, after the timeout / for a gone client.
  size_t watched() const;
  uint64_t released_after_timeout() const;
  uint64_t released_for_gone_clients() const;

  // cuStreamWaitValue32's "greater or equal", wrapping: (int32)(word - value) >= 0.
  static bool Reached(uint32_t word, uint32_t value) { return static_cast<int32_t>(word - value) >= 0; }

 private:
  struct Entry {
    uint32_t* word;
    uint32_t value;
    std::shared_ptr<const void> keep;
    uint64_t owner;
    uint64_t request_id;
    absl::Time deadline;
  };
  enum class Why { kTimeout, kClientGone };
  void Run();
  // Writes what has not reached its value; false when it had (nothing written).
  static bool Release(const Entry& e, Why why);
  // Drops reached entries and releases those `due` says must go now.
  template <class Due>
  void Sweep(Due due, Why why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration timeout_;
  const absl::Duration period_;
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t after_timeout_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t for_gone_clients_ ABSL_GUARDED_BY(mu_) = 0;
  prometheus::Counter* timeout_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  prometheus::Counter* gone_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_READY_WORDS_H_
