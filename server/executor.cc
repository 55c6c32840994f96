// Admission queue and per-backend worker; see executor.h.
#include "server/executor.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

}  // namespace

Executor::Executor(AttentionBackend* backend, const ExecutorOptions& options)
    : backend_(backend), options_(options) {
  worker_ = std::thread([this] { WorkerLoop(); });
}

Executor::~Executor() { Shutdown(); }

absl::Status Executor::Submit(WorkItem item) {
  absl::MutexLock lock(&mu_);
  if (!admitting_) return absl::UnavailableError(refusal_);
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_size) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", queue_.size(), " requests waiting, the limit is ",
                     options_.max_queue_size, " (--max_queue_size); retry later"));
  }
  queue_.push_back(Queued{std::move(item), absl::Now()});
  return absl::OkStatus();
}

void Executor::StopAdmitting() {
  absl::MutexLock lock(&mu_);
  if (admitting_) {
    admitting_ = false;
    refusal_ = "server is draining: not accepting new requests";
  }
}

bool Executor::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return queue_.empty() && !running_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void Executor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (admitting_) refusal_ = "server is shutting down: not accepting new requests";
    admitting_ = false;
    stopping_ = true;
  }
  // A done callback that shuts the executor down must not join itself.
  absl::MutexLock lock(&join_mu_);
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

int Executor::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

bool Executor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void Executor::WorkerLoop() {
  while (true) {
    Queued next;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to complete
      next = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      stopping = stopping_;
    }
    WorkTimings timings;
    const absl::Time picked = absl::Now();
    timings.queue_us = Micros(picked - next.admitted);
    absl::Status status =
        stopping ? absl::UnavailableError("server is shutting down: request dropped before compute")
                 : Run(next.item, &timings);
    timings.total_us = Micros(absl::Now() - next.item.received);
    next.item.done(status, timings);
    // Release the item (and whatever its callbacks hold) before reporting idle,
    // so WaitIdle returning means the front-end has been told.
    next = Queued{};
    absl::MutexLock lock(&mu_);
    running_ = false;
  }
}

absl::Status Executor::Run(WorkItem& item, WorkTimings* timings) {
  // Both checks come before any work: cancelled work is dropped, and work past
  // its deadline would produce a response nobody waits for.
  // The deadline first: gRPC also cancels a call whose deadline passes, and
  // DEADLINE_EXCEEDED says more than CANCELLED.
  const absl::Time now = absl::Now();
  if (now >= item.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(
        "deadline exceeded before compute started (queued for ", Micros(now - item.received),
        " us, deadline passed ", Micros(now - item.deadline), " us ago)"));
  }
  if (item.cancelled != nullptr && item.cancelled->load(std::memory_order_acquire)) {
    return absl::CancelledError("request cancelled by the client before compute started");
  }
  if (item.bind_outputs) {
    absl::Status bound = item.bind_outputs(&item.params);
    if (!bound.ok()) return bound;
  }
  // After binding: CanImplement checks the whole params, output pointers
  // included. UNIMPLEMENTED here names what this build lacks.
  absl::Status supported = backend_->CanImplement(item.params);
  if (!supported.ok()) return supported;
  BackendTimings backend_timings;
  const absl::Time start = absl::Now();
  absl::Status status = backend_->Forward(item.params, &backend_timings);
  if (options_.metrics != nullptr && !item.internal) options_.metrics->RecordExecution();
  timings->host_to_device_us = backend_timings.host_to_device_us;
  timings->device_to_host_us = backend_timings.device_to_host_us;
  // A backend that does not time itself (or times only part) still gets the
  // wall time of its Forward call reported as compute.
  timings->compute_us = backend_timings.compute_us > 0
                            ? backend_timings.compute_us
                            : Micros(absl::Now() - start) - backend_timings.host_to_device_us -
                                  backend_timings.device_to_host_us;
  if (timings->compute_us < 0) timings->compute_us = 0;
  return status;
}

}  // namespace attnserve
