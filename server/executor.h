// The protocol-independent core for one backend (one device): an admission
// queue with a bound and two threads. The launcher takes queued calls (dense
// attention calls and K/V append-and-attend calls, each planned once by the
// backend), packs those that can share a launch (ragged_batch.h and
// paged_batch.h, with batching on) and starts launches on the backend
// (StartForward or StartPagedForward), keeping up to max_launches_in_flight()
// of them open so a device backend overlaps one launch's copies with
// another's compute. The completer finishes launches in the order they
// started and reports each call through its callback; with a backend that runs
// one launch at a time and nothing else waiting, the launcher finishes its
// launch and answers itself (no hand-off). Front-ends and the K/V
// pool submit work here and are called back when the work is done; a small
// call that finds the executor idle may run on the submitting thread instead
// (ExecutorOptions::inline_max_cost), which then blocks for that call only.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/make_params.h"
#include "backend/params.h"
#include "server/fair_queue.h"
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
  int device = 0;        // ExecutorOptions::device of the executor that ran it
};

// An append-and-attend call on server-side K/V (server/kv). Just before the
// launch, in arrival order, the launcher calls `reserve`: it reserves the
// call's pages (all or nothing), binds its outputs and returns the launch's
// params (host memory but the pages), built once. The backend then checks and
// plans them once (CanImplementPaged), and the launch (StartPagedForward) runs
// that plan; calls of one cache and layer may share it. The item's `done`
// commits (OK) or rolls back (any error, including a refusal before `reserve`
// ran).
struct PagedWork {
  const void* cache = nullptr;  // with layer: which calls may share a launch
  int32_t layer = 0;
  // The call's query and new K/V rows, varlen (cu_seqlens in host memory that
  // lives as long as the item): its tokens and cost while it is queued.
  AttnShape rows;
  std::function<absl::StatusOr<PagedAttnParams>()> reserve;
};

// What the executor needs of every call, whatever its kind.
struct WorkMetadata {
  // When the front-end received the request (the start of total_us).
  absl::Time received = absl::Now();
  // Past this when the worker picks the item up: DEADLINE_EXCEEDED, not run.
  absl::Time deadline = absl::InfiniteFuture();
  // Set by the front-end when the client cancels; checked before compute, and
  // a cancelled item is dropped with CANCELLED. May be null.
  std::shared_ptr<const std::atomic<bool>> cancelled;
  // Called exactly once for an admitted item, never under the executor's
  // lock: on one of the executor's threads or, for a call run inline
  // (ExecutorOptions::inline_max_cost), possibly on the submitting thread
  // before Submit returns OK. So a submitter must not hold a lock `done` takes.
  std::function<void(const absl::Status& status, const WorkTimings& timings)> done;
  // The server's own work (the start-up warm-up): left out of the metrics.
  bool internal = false;
  // Accepted by the front-end before a drain began (a K/V call that waited
  // for an earlier call on its sequence): StopAdmitting does not refuse it.
  bool follows_admitted = false;
  // Who the call acts for (server/tenant.h): the device is shared fairly
  // between tenants (fair_queue.h). Empty: the server's own work.
  std::string tenant;
  // Never run on the submitting thread (ExecutorOptions::inline_max_cost): one
  // of several launches of a step on several devices, which must not wait for
  // each other by running one after another on the thread that submits them.
  bool no_inline = false;
};

// One call: a dense attention call (params and bind_outputs) or, when `paged`
// is set, a K/V append-and-attend call. Before compute the worker checks
// cancellation and the deadline, makes the call ready (binds a dense call's
// outputs, reserves a paged call's pages) and has the backend check and plan
// it once (CanImplement or CanImplementPaged: UNIMPLEMENTED for a valid
// combination this build lacks). Input pointers must stay valid until `done`
// has been called.
struct WorkItem : WorkMetadata {
  // A dense call: inputs set, outputs set by `bind_outputs`.
  AttnParams params{};
  // Runs on the worker just before compute and sets params->o (and ->lse when
  // wanted). Allocating here, not in the front-end, keeps large allocations
  // off gRPC's callback threads and away from requests that never run.
  std::function<absl::Status(AttnParams* params)> bind_outputs;
  // A K/V append-and-attend call instead: `params` and `bind_outputs` unused.
  std::optional<PagedWork> paged;
};

// The executor's own form of each kind of call, with the plan it launches.
struct DenseJob {
  AttnParams params{};
  std::function<absl::Status(AttnParams* params)> bind_outputs;
  Plan plan;  // CanImplement's, once outputs are bound
};
struct PagedJob {
  PagedWork work;
  PagedAttnParams params{};  // work.reserve's
  Plan plan;                 // CanImplementPaged's
};
using WorkJob = std::variant<DenseJob, PagedJob>;

// Tq + Tk rows of an item (a K/V call's query and new rows): what counts
// against batch_max_tokens.
int64_t WorkItemTokens(const WorkItem& item);

struct ExecutorOptions {
  // Items admitted but not yet started; Submit beyond it is RESOURCE_EXHAUSTED,
  // except for a tenant below its fair share of it (FairQueue::HasRoom).
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
  // Every call batch-invariant (AttnParams::batch_invariant; --batch_invariant),
  // whatever its options say.
  bool batch_invariant = false;
  // Reported in WorkTimings::device (the backend's device index).
  int device = 0;
  // FairQueue's quantum: the cost (RequestCost) a tenant may run per turn.
  int64_t fair_quantum = int64_t{1} << 20;
  // A backend call (StartForward, or a launch's Finish) running longer than
  // this means the device stopped answering: the executor turns unhealthy
  // (Healthy()), fails its queued requests and refuses new ones with
  // UNAVAILABLE, fails the stuck launch's requests when the launch can be
  // abandoned (PendingLaunch::Abandon), and is healthy again as soon as the
  // call returns. Infinite: never checked (no watchdog thread).
  absl::Duration launch_timeout = absl::InfiniteDuration();
  // Called (on an executor thread, no lock held) when Healthy() changes.
  std::function<void()> on_health_change;
  // Runs a call on the thread that submits it, saving the wake-up of the
  // launcher (and, without a pipeline, of the completer), when the executor
  // is idle: nothing queued, launching, in flight or completing, and the
  // submitting thread is not already running a call inline. Everything else
  // is as on the launcher: the same admission (queue bound, drain, health),
  // the deadline and cancellation checks, the watchdog, WaitIdle waiting for
  // it; items submitted meanwhile queue and start once it is launched. Only
  // small calls, so the submitting thread (a gRPC callback thread) is held
  // briefly: RequestCost of at most this, counted on what the submitting
  // thread runs. Without a pipeline that is the whole call, a K/V call's
  // context included, checked again once its pages are known (over it, the
  // ready call goes to the launcher); with one, only the launch's start (its
  // own rows), the completer finishing it. 0: never.
  int64_t inline_max_cost = 0;
};

class Executor {
 public:
  // `backend` must outlive the executor. Starts the threads.
  Executor(AttentionBackend* backend, const ExecutorOptions& options);
  // Shutdown(), then joins the threads.
  ~Executor();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Admits `item` (OK: `done` will be called, or has been for a call run
  // inline) or refuses it without calling `done`: RESOURCE_EXHAUSTED when the
  // queue is full, UNAVAILABLE once StopAdmitting or Shutdown has been called.
  absl::Status Submit(WorkItem item);
  // The same, moving from `*item` only when it is admitted: a refused item
  // is intact, for the multi-device dispatcher to offer to another executor.
  absl::Status Offer(WorkItem* item);

  // Refuses new items with UNAVAILABLE "server is draining"; admitted items
  // still run.
  void StopAdmitting();

  // Waits until nothing is queued or running, or `timeout` passes. True when idle.
  bool WaitIdle(absl::Duration timeout);

  // Stops admitting, completes every queued item with UNAVAILABLE without
  // running it, lets started launches finish and stops the threads. Idempotent.
  // From a done callback it only begins the shutdown (no thread is joined);
  // a callback must not destroy the executor.
  void Shutdown();

  // False once StopAdmitting or Shutdown has been called, with the reason.
  absl::Status Admitting() const;

  // UNAVAILABLE naming the stuck call while the device has stopped answering
  // (ExecutorOptions::launch_timeout); OK otherwise.
  absl::Status Healthy() const;

  // Items queued, and whether anything is being launched or in flight (for
  // tests, logs and metrics).
  int queued() const;
  // Items queued per tenant (tenants with none left out).
  std::map<std::string, int64_t> queued_by_tenant() const;
  bool running() const;
  // What the multi-device dispatcher (executor_pool.h) reads, without a lock.
  // Tq + Tk rows of the requests admitted and not yet completed.
  int64_t outstanding_tokens() const { return outstanding_tokens_.load(std::memory_order_relaxed); }
  // The same requests' estimated device time (RequestCost: queued and in
  // launch together).
  int64_t outstanding_work() const { return outstanding_work_.load(std::memory_order_relaxed); }
  // Tq + Tk rows queued and not yet picked by the launcher: the batch that is
  // forming for the next launch.
  int64_t queued_tokens() const { return queued_tokens_.load(std::memory_order_relaxed); }

 private:
  struct Queued {
    // Takes the item apart: its metadata, and its call as a job of its kind.
    explicit Queued(WorkItem item);

    WorkMetadata meta;
    // Planned once, when the launcher makes it ready: the launch runs the
    // plan without checking again.
    WorkJob job;
    int64_t tokens = 0;  // Tq + Tk rows: the batch budget and outstanding_tokens
    int64_t cost = 0;    // RequestCost: the fair queue's charge and outstanding_work
    absl::Time admitted;
    WorkTimings timings;
    // Set for the members of a packed launch that failed, and for a call
    // made ready inline that turned out too large to run there: they come
    // back to the front of the queue, ready and planned, to run one by one.
    bool rerun_alone = false;
  };
  // A launch the backend has started and the completer has yet to finish, or
  // (launch null) an item that failed before launch: it goes through the
  // completer too, so items complete in the order they were picked.
  struct InFlight {
    std::vector<Queued> members;
    std::unique_ptr<PendingLaunch> launch;
    absl::Time started;
    absl::Status failed;
  };

  void LauncherLoop();
  void CompleterLoop();
  // Finishes one launch (or reports an item that failed before launch) and
  // completes its members; clears completing_, which the caller set.
  void FinishLaunch(InFlight done);
  // Watches the backend calls in progress (launch_timeout); see ExecutorOptions.
  void WatchdogLoop();
  // A backend call begins or ends on the launcher (slot 0) or the completer
  // (slot 1). Ending one may end a stall: then on_health_change runs.
  void CallBegins(int slot, PendingLaunch* launch = nullptr,
                  std::vector<Queued>* members = nullptr);
  void CallEnds(int slot);
  // Whether a call in progress has run past launch_timeout at `now`.
  bool CallOverdue(absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Moves queued items that can share `batch`'s launch into it, waiting up to
  // batch_max_delay for more when the batch already has company.
  void CollectBatch(std::vector<Queued>* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the items picked together ready (deadline and cancellation checked,
  // outputs bound or pages reserved, planned), splits them into groups that
  // can share a launch and starts each group; completes the ones that fail.
  void Dispatch(std::vector<Queued> picked);
  // Starts one launch for `group` (one item, or several that share a launch)
  // once fewer than max_launches_in_flight are open. A packed launch that
  // fails to start is retried one member at a time, so an out-of-memory or a
  // bad request fails only itself.
  void StartLaunch(std::vector<Queued> group);
  // Whether an admitted item may run on the submitting thread now
  // (ExecutorOptions::inline_max_cost); the caller then claims the launcher.
  bool MayRunHere(const Queued& q) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Does for one claimed item what the launcher would, on this thread.
  void RunHere(Queued q);
  // Hands an item that failed before launch to the completer.
  void Fail(Queued q, absl::Status status);
  // Fills the item's final timings, calls its `done` and releases its tokens.
  void Complete(Queued& q, const absl::Status& status);
  // Takes the queue's next item (DRR), keeping queued_tokens_ in step.
  Queued PopQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  AttentionBackend* const backend_;
  const ExecutorOptions options_;
  const int max_in_flight_;

  mutable absl::Mutex mu_;
  // Admitted, not yet picked: per-tenant FIFOs under one fairness rule.
  FairQueue<Queued> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  // Launches started and not yet finished (those in in_flight_ plus the one
  // the completer is finishing): the bound of max_launches_in_flight.
  int open_launches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // wakes a batch waiting for company
  bool admitting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The launcher holds picked items, or a submitting thread runs one inline
  // (the launcher waits until it is clear).
  bool launching_ ABSL_GUARDED_BY(mu_) = false;
  bool completing_ ABSL_GUARDED_BY(mu_) = false;     // the completer holds popped items
  bool launcher_done_ ABSL_GUARDED_BY(mu_) = false;  // it has exited: nothing more starts
  std::string refusal_ ABSL_GUARDED_BY(mu_);
  // Backend calls in progress: when each began (InfiniteFuture: none), and
  // the completer's launch and members (for the watchdog to abandon).
  absl::Time call_since_[2] ABSL_GUARDED_BY(mu_) = {absl::InfiniteFuture(), absl::InfiniteFuture()};
  int64_t call_changes_ ABSL_GUARDED_BY(mu_) = 0;
  PendingLaunch* finishing_launch_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<Queued>* finishing_members_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Non-empty while the device has stopped answering: why (Healthy()).
  std::string stalled_ ABSL_GUARDED_BY(mu_);
  bool watchdog_failing_ ABSL_GUARDED_BY(mu_) = false;  // it holds items to complete
  std::atomic<int64_t> outstanding_tokens_{0};
  std::atomic<int64_t> outstanding_work_{0};
  // Mirrors the tokens of queue_'s items (changed under mu_, read without).
  std::atomic<int64_t> queued_tokens_{0};

  absl::Mutex join_mu_;
  std::thread launcher_;  // both joined once, under join_mu_
  std::thread completer_;
  std::thread watchdog_;  // only with a finite launch_timeout
  // Set once in the constructor: Shutdown compares them without a lock.
  std::thread::id launcher_id_;
  std::thread::id completer_id_;
  std::thread::id watchdog_id_;
};

}  // namespace attnserve
