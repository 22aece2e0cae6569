#include "exec/gpu_queues.h"

#include <utility>

#include "absl/time/clock.h"

namespace wprep::server {

GpuQueues::Queue* GpuQueues::Find(Gpu& gpu) {
  for (Queue& q : queues_) {
    if (q.gpu == &gpu) return &q;
  }
  return nullptr;
}

absl::StatusOr<Stream> GpuQueues::StreamOf(Gpu& gpu) {
  if (Queue* q = Find(gpu); q != nullptr) return q->stream.stream();
  absl::StatusOr<Gpu::StreamLease> lease = gpu.AcquireStream(deadline_);
  if (!lease.ok()) return lease.status();
  queues_.push_back(Queue{&gpu, *std::move(lease), {}});
  return queues_.back().stream.stream();
}

void GpuQueues::Queued(Gpu& gpu, size_t index) {
  if (Queue* q = Find(gpu); q != nullptr) q->items.push_back(index);
}

absl::Status GpuQueues::WaitAll(absl::FunctionRef<void(Gpu&, const std::vector<size_t>&, double)> done) {
  absl::Status first;
  for (Queue& q : queues_) {
    absl::Status st = q.gpu->runtime().Synchronize(q.gpu->ordinal(), q.stream.stream());
    if (first.ok()) first = st;
    done(*q.gpu, q.items, absl::ToDoubleSeconds(absl::Now() - start_));
  }
  queues_.clear();  // the leases give the streams back
  return first;
}

}  // namespace wprep::server
