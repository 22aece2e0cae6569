// The ConvertStream data path. Receiving, converting and sending overlap: the RPC's
// thread frames input chunks into whole slices (StreamInputFramer), a converter thread
// converts each slice and cuts its output into chunk messages, and a sender thread writes
// those (StreamPipeline). Memory held is bounded by StreamPipeline::HostBytes.
#ifndef WPREP_SERVER_SRC_STREAM_PIPELINE_H_
#define WPREP_SERVER_SRC_STREAM_PIPELINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "wprep/v1/wprep.pb.h"

namespace wprep::server {

// Largest DataChunk a stream may carry.
inline constexpr uint64_t kMaxChunkBytes = 4ull << 20;
// Size of the output chunks the daemon sends.
inline constexpr uint64_t kOutputChunkBytes = 1ull << 20;

// A thread that takes items from a bounded queue and works on each; the first error
// stops it and is returned to whoever pushes next. Items are recycled (TakeBuffer; at
// most `depth` kept), so a long stream allocates its buffers once. Thread-safe.
template <typename T>
class WorkerQueue {
 public:
  using Work = std::function<absl::Status(T& item)>;

  // RESOURCE_EXHAUSTED when the thread cannot be created (a process thread limit).
  static absl::StatusOr<std::unique_ptr<WorkerQueue>> Start(size_t depth, Work work) {
    std::unique_ptr<WorkerQueue> q(new WorkerQueue(depth, std::move(work)));
    try {
      q->thread_ = std::thread([p = q.get()] { p->Run(); });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start a stream worker thread (", e.what(), "); retry later"));
    }
    return q;
  }
  ~WorkerQueue() { Stop(); }
  WorkerQueue(const WorkerQueue&) = delete;
  WorkerQueue& operator=(const WorkerQueue&) = delete;

  // A recycled item (its old contents kept, string capacity included) or a new one.
  T TakeBuffer() {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) return T();
    T b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  // Queues an item; waits while `depth` are queued. The worker's error, if any.
  absl::Status Push(T item) {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return queue_.size() < depth_ || !status_.ok();
    };
    mu_.Await(absl::Condition(&room));
    if (!status_.ok()) return status_;
    queue_.push_back(std::move(item));
    return absl::OkStatus();
  }
  // No more items: waits until every queued one is done; the first error, if any.
  absl::Status Finish() {
    Stop();
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // Drops what is queued, stops, and returns `why` (or the worker's own earlier error).
  absl::Status Abort(absl::Status why) {
    {
      absl::MutexLock lock(&mu_);
      if (status_.ok()) status_ = std::move(why);
      queue_.clear();
    }
    return Finish();
  }

 private:
  WorkerQueue(size_t depth, Work work) : depth_(depth), work_(std::move(work)) {}

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }
  void Run() {
    for (;;) {
      T item;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !queue_.empty() || closed_ || !status_.ok();
        };
        mu_.Await(absl::Condition(&ready));
        if (!status_.ok() || queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status s = work_(item);
      absl::MutexLock lock(&mu_);
      if (free_.size() < depth_) free_.push_back(std::move(item));
      if (!s.ok() && status_.ok()) status_ = s;
    }
  }

  const size_t depth_;
  const Work work_;
  absl::Mutex mu_;
  std::deque<T> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<T> free_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Where framed input slices go.
class SliceSink {
 public:
  virtual ~SliceSink() = default;
  // An empty buffer with room for `bytes` (recycled when possible).
  virtual std::string TakeBuffer(uint64_t bytes) = 0;
  virtual absl::Status Push(std::string slice) = 0;
};

// Checks a stream's input framing (after its header) and cuts the input into slices of
// `slice_bytes` (the last may be shorter): chunks in order without gaps, none above
// kMaxChunkBytes, no second header, no more than `expected` bytes, and all of them before
// the client half-closes. Not thread-safe.
class StreamInputFramer {
 public:
  StreamInputFramer(uint64_t expected, uint64_t slice_bytes, SliceSink* sink);

  // One request message after the header. Its chunk's data may be moved out.
  absl::Status Add(wprep::v1::ConvertStreamRequest& msg);
  // The client half-closed: pushes the last, shorter slice, or fails for a truncated
  // input.
  absl::Status Finish();
  uint64_t received() const { return received_; }

 private:
  const uint64_t expected_;
  const uint64_t slice_;
  SliceSink* const sink_;
  uint64_t received_ = 0;
  std::string pending_;
};

// The converter and sender threads of one stream.
class StreamPipeline final : public SliceSink {
 public:
  static constexpr size_t kSlicesQueued = 2;
  static constexpr size_t kChunksQueued = 8;
  // The most host memory one stream's buffers hold, besides the engine's own output
  // buffer of one slice: input slices queued, converting, being filled and recycled,
  // and output chunks queued, being sent and recycled.
  static constexpr uint64_t HostBytes(uint64_t slice_input_bytes) {
    return (2 * kSlicesQueued + 2) * slice_input_bytes + (2 * kChunksQueued + 1) * kOutputChunkBytes;
  }
  // What one stream holds at most, by need, the engine's output buffer of one slice
  // included: a tensor of `input_bytes` cut into slices of `slice_input_bytes`, each
  // converting into `slice_output_bytes`, fills only as many input buffers and output
  // chunks as it has slices and chunks, and a chunk no larger than a slice's output. So an
  // 8 KiB tensor reserves tens of KiB, not HostBytes(slice)'s 17 MiB of 1 MiB chunks.
  // UINT64_MAX when the sum would overflow (so the budget refuses it as too large).
  static uint64_t HostBytes(uint64_t input_bytes, uint64_t slice_input_bytes, uint64_t slice_output_bytes);
  // Converts one input slice; its output stays valid until the next call.
  using Convert = std::function<absl::StatusOr<absl::Span<const uint8_t>>(const std::string& in)>;
  // Writes one response message to the client; false when the client went away.
  using Write = std::function<bool(const wprep::v1::ConvertStreamResponse& msg)>;

  // RESOURCE_EXHAUSTED when its threads cannot be created.
  static absl::StatusOr<std::unique_ptr<StreamPipeline>> Start(Convert convert, Write write);

  std::string TakeBuffer(uint64_t bytes) override;
  absl::Status Push(std::string slice) override;
  // No more input: waits until everything is converted and sent; the output bytes sent.
  absl::StatusOr<uint64_t> Finish();
  // Stops both threads (the sender first, so a converter waiting for room wakes up).
  absl::Status Abort(absl::Status why);

 private:
  StreamPipeline() = default;

  uint64_t produced_ = 0;  // converter thread only
  uint64_t sent_ = 0;      // sender thread only; read after it stopped
  // sender_ before converter_: it outlives it.
  std::unique_ptr<WorkerQueue<wprep::v1::ConvertStreamResponse>> sender_;
  std::unique_ptr<WorkerQueue<std::string>> converter_;
};

}  // namespace wprep::server

#endif  // WPREP_SERVER_SRC_STREAM_PIPELINE_H_
