// Admission queue and per-backend worker; see executor.h.
#include "server/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ragged_batch.h"

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
  ++submitted_;
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
    std::vector<Queued> batch;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to complete
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
      running_ = true;
      stopping = stopping_;
      if (!stopping && options_.batching && !batch.front().item.internal) CollectBatch(&batch);
    }
    const absl::Time picked = absl::Now();
    if (batch.size() > 1) {
      RunBatch(batch, picked);
    } else {
      Queued& next = batch.front();
      WorkTimings timings;
      timings.queue_us = Micros(picked - next.admitted);
      absl::Status status =
          stopping
              ? absl::UnavailableError("server is shutting down: request dropped before compute")
              : Run(next.item, &timings);
      timings.total_us = Micros(absl::Now() - next.item.received);
      next.item.done(status, timings);
    }
    // Release the items (and whatever their callbacks hold) before reporting
    // idle, so WaitIdle returning means the front-end has been told.
    batch.clear();
    absl::MutexLock lock(&mu_);
    running_ = false;
  }
}

void Executor::CollectBatch(std::vector<Queued>* batch) {
  // A copy: pushing onto `batch` may move its elements.
  const AttnParams head = batch->front().item.params;
  int64_t tokens = BatchTokens(head);
  if (tokens >= options_.batch_max_tokens) return;
  const absl::Time wait_until = batch->front().admitted + options_.batch_max_delay;
  while (true) {
    for (auto it = queue_.begin(); it != queue_.end();) {
      const int64_t t = BatchTokens(it->item.params);
      if (!it->item.internal && CanShareLaunch(head, it->item.params) &&
          tokens + t <= options_.batch_max_tokens) {
        tokens += t;
        batch->push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    // Alone means no sign of concurrency: waiting would only add latency.
    if (batch->size() < 2 || stopping_ || absl::Now() >= wait_until) return;
    const int64_t seen = submitted_;
    auto arrived = [this, seen]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return submitted_ != seen || stopping_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&arrived), wait_until)) return;
  }
}

absl::Status Executor::Prepare(WorkItem& item) {
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
  if (item.bind_outputs) return item.bind_outputs(&item.params);
  return absl::OkStatus();
}

absl::Status Executor::Launch(const AttnParams& params, bool internal, WorkTimings* timings) {
  // After binding: CanImplement checks the whole params, output pointers
  // included. UNIMPLEMENTED here names what this build lacks.
  absl::Status supported = backend_->CanImplement(params);
  if (!supported.ok()) return supported;
  BackendTimings backend_timings;
  const absl::Time start = absl::Now();
  absl::Status status = backend_->Forward(params, &backend_timings);
  if (options_.metrics != nullptr && !internal) options_.metrics->RecordExecution();
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

absl::Status Executor::Run(WorkItem& item, WorkTimings* timings) {
  absl::Status prepared = Prepare(item);
  if (!prepared.ok()) return prepared;
  return Launch(item.params, item.internal, timings);
}

bool Executor::RunPacked(std::vector<Queued>& batch, const std::vector<size_t>& group,
                         std::vector<WorkTimings>* timings) {
  std::vector<const AttnParams*> members;
  for (size_t i : group) members.push_back(&batch[i].item.params);
  // Gathering the inputs and scattering the outputs are host copies that a
  // device pipeline does while staging, so they count as host_to_device and
  // device_to_host.
  const absl::Time gather_start = absl::Now();
  PackedBatch packed(members);
  const int64_t gather_us = Micros(absl::Now() - gather_start);
  WorkTimings launch;
  if (!Launch(packed.params(), /*internal=*/false, &launch).ok()) return false;
  const absl::Time scatter_start = absl::Now();
  packed.Scatter();
  const int64_t scatter_us = Micros(absl::Now() - scatter_start);
  for (size_t i : group) {
    WorkTimings& t = (*timings)[i];
    t.host_to_device_us = launch.host_to_device_us + gather_us;
    t.compute_us = launch.compute_us;
    t.device_to_host_us = launch.device_to_host_us + scatter_us;
    t.batch_size = static_cast<int>(group.size());
  }
  return true;
}

void Executor::RunBatch(std::vector<Queued>& batch, absl::Time picked) {
  std::vector<absl::Status> status(batch.size());
  std::vector<WorkTimings> timings(batch.size());
  std::vector<size_t> ready;
  for (size_t i = 0; i < batch.size(); ++i) {
    timings[i].queue_us = Micros(picked - batch[i].admitted);
    status[i] = Prepare(batch[i].item);
    if (status[i].ok()) ready.push_back(i);
  }
  // Collection compared params before outputs were bound; LSE is known only
  // now, so the ready items are split into groups that can share a launch.
  std::vector<std::vector<size_t>> groups;
  for (size_t i : ready) {
    auto fits = [&](const std::vector<size_t>& g) {
      return CanShareLaunch(batch[g.front()].item.params, batch[i].item.params);
    };
    auto g = std::find_if(groups.begin(), groups.end(), fits);
    if (g == groups.end()) {
      groups.push_back({i});
    } else {
      g->push_back(i);
    }
  }
  for (const std::vector<size_t>& group : groups) {
    if (group.size() > 1 && RunPacked(batch, group, &timings)) continue;
    for (size_t i : group) {
      status[i] = Launch(batch[i].item.params, batch[i].item.internal, &timings[i]);
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    timings[i].total_us = Micros(absl::Now() - batch[i].item.received);
    batch[i].item.done(status[i], timings[i]);
  }
}

}  // namespace attnserve
