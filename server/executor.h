// The protocol-independent core: an admission queue with a bound, and one
// worker thread per backend that runs launches one at a time (backends are
// serialised per instance) and reports each request through a completion
// callback. With batching on, the worker packs queued requests that can share
// a launch (ragged_batch.h) into one varlen call.
// Front-ends (the native v1 API now, KServe v2 later) submit work here and
// never block: they are called back when the work is done.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/params.h"
#include "server/metrics.h"

namespace attnserve {

// Where one request's time went, in microseconds (ServerTiming on the wire).
struct WorkTimings {
  int64_t queue_us = 0;  // admission until the worker picked it up
  int64_t host_to_device_us = 0;
  int64_t compute_us = 0;
  int64_t device_to_host_us = 0;
  int64_t total_us = 0;  // `received` until completion
  int batch_size = 1;    // requests that shared this request's backend launch
};

// One attention call. Before compute the worker checks cancellation and the
// deadline, binds outputs and asks the backend's CanImplement (UNIMPLEMENTED
// for a valid combination this build lacks). Input pointers in `params` must stay valid until
// `done` has been called; output pointers are set by `bind_outputs`.
struct WorkItem {
  AttnParams params{};
  // Runs on the worker just before compute and sets params->o (and ->lse when
  // wanted). Allocating here, not in the front-end, keeps large allocations
  // off gRPC's callback threads and away from requests that never run.
  std::function<absl::Status(AttnParams* params)> bind_outputs;
  // When the front-end received the request (the start of total_us).
  absl::Time received = absl::Now();
  // Past this when the worker picks the item up: DEADLINE_EXCEEDED, not run.
  absl::Time deadline = absl::InfiniteFuture();
  // Set by the front-end when the client cancels; checked before compute, and
  // a cancelled item is dropped with CANCELLED. May be null.
  std::shared_ptr<const std::atomic<bool>> cancelled;
  // Called exactly once for an admitted item, on the worker thread (or on the
  // thread that calls Shutdown), never under the executor's lock.
  std::function<void(const absl::Status& status, const WorkTimings& timings)> done;
  // The server's own work (the start-up warm-up): left out of the metrics.
  bool internal = false;
};

struct ExecutorOptions {
  // Items admitted but not yet started; Submit beyond it is RESOURCE_EXHAUSTED.
  int max_queue_size = 256;
  // Counts backend launches (nv_inference_exec_count) when set; must outlive
  // the executor.
  ServerMetrics* metrics = nullptr;
  // Dynamic ragged batching. Off here (unit tests drive single launches); the
  // server turns it on by default (ServerOptions).
  bool batching = false;
  // How long a batch that already has company may wait, counted from its
  // first request's admission, for more compatible requests. Worked example:
  // at concurrency 1 the queue is empty when the worker takes a request, so it
  // runs at once with no added delay; at concurrency 64 the worker finds other
  // callers' requests queued, packs them, and waits at most this long for
  // stragglers while the batch is under the token budget.
  absl::Duration batch_max_delay = absl::Microseconds(500);
  // Most Tq + Tk rows in one packed launch; a larger request runs alone.
  int64_t batch_max_tokens = 65536;
};

class Executor {
 public:
  // `backend` must outlive the executor. Starts the worker thread.
  Executor(AttentionBackend* backend, const ExecutorOptions& options);
  // Shutdown(), then joins the worker.
  ~Executor();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Admits `item` (OK: `done` will be called) or refuses it without calling
  // `done`: RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE once
  // StopAdmitting or Shutdown has been called.
  absl::Status Submit(WorkItem item);

  // Refuses new items with UNAVAILABLE "server is draining"; admitted items
  // still run.
  void StopAdmitting();

  // Waits until nothing is queued or running, or `timeout` passes. True when idle.
  bool WaitIdle(absl::Duration timeout);

  // Stops admitting, completes every queued item with UNAVAILABLE without
  // running it, lets a running one finish and stops the worker. Idempotent.
  void Shutdown();

  // Items queued and running now (for tests and logs).
  int queued() const;
  bool running() const;

 private:
  struct Queued {
    WorkItem item;
    absl::Time admitted;
  };

  void WorkerLoop();
  // Moves queued items that can share `batch`'s launch into it, waiting up to
  // batch_max_delay for more when the batch already has company.
  void CollectBatch(std::vector<Queued>* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The checks before compute (deadline, cancellation) and output binding.
  absl::Status Prepare(WorkItem& item);
  // CanImplement and Forward of one launch; fills the device timings.
  absl::Status Launch(const AttnParams& params, bool internal, WorkTimings* timings);
  // Runs one item on the backend and fills timings; returns its status.
  absl::Status Run(WorkItem& item, WorkTimings* timings);
  // Runs `batch` (two or more items) as one packed launch, falling back to
  // one launch each if the packed one fails (so an out-of-memory or a bad
  // request fails only itself); completes every item.
  void RunBatch(std::vector<Queued>& batch, absl::Time picked);
  // One packed launch for batch[group...] (two or more that share a launch);
  // fills their timings. False, touching no output, if the launch failed.
  bool RunPacked(std::vector<Queued>& batch, const std::vector<size_t>& group,
                 std::vector<WorkTimings>* timings);

  AttentionBackend* const backend_;
  const ExecutorOptions options_;

  mutable absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // wakes a batch waiting for company
  bool admitting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  std::string refusal_ ABSL_GUARDED_BY(mu_);

  absl::Mutex join_mu_;
  std::thread worker_;  // joined once, under join_mu_
};

}  // namespace attnserve
