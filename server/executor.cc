// Admission queue, launcher and completer threads; see executor.h.
#include "server/executor.h"

#include <algorithm>
#include <exception>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "backend/paged_batch.h"
#include "backend/ragged_batch.h"
#include "common/status_macros.h"
#include "server/in_flight.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// Both checks come before any work: cancelled work is dropped, and work past
// its deadline would produce a response nobody waits for. The deadline first:
// gRPC also cancels a call whose deadline passes, and DEADLINE_EXCEEDED says
// more than CANCELLED.
absl::Status CheckStillWanted(const WorkMetadata& call) {
  const absl::Time now = absl::Now();
  if (now >= call.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(
        "deadline exceeded before compute started (queued for ", Micros(now - call.received),
        " us, deadline passed ", Micros(now - call.deadline), " us ago)"));
  }
  if (call.cancelled != nullptr && call.cancelled->load(std::memory_order_acquire)) {
    return absl::CancelledError("request cancelled by the client before compute started");
  }
  return absl::OkStatus();
}

// --- The two kinds of call: everything the executor does differently for them. ---

// Tq + Tk rows: the batch token budget and the dispatcher's load.
int64_t Tokens(const DenseJob& j) { return BatchTokens(j.params); }
int64_t Tokens(const PagedJob& j) {
  const AttnShape& rows = j.work.rows;
  return int64_t{rows.cu_seqlens_q[rows.batch]} + rows.cu_seqlens_k[rows.batch];
}

// What the fair queue charges the call's tenant.
int64_t Cost(const DenseJob& j) { return RequestCost(j.params); }
int64_t Cost(const PagedJob& j) { return RequestCost(j.work.rows); }

// Whether two queued calls may be collected into one launch before they are
// ready: dense calls by their params, K/V calls by cache and layer.
bool MayShare(const DenseJob& a, const DenseJob& b) { return CanShareLaunch(a.params, b.params); }
bool MayShare(const PagedJob& a, const PagedJob& b) {
  return a.work.cache == b.work.cache && a.work.layer == b.work.layer;
}

// Just before the launch: binds a dense call's outputs, or reserves a K/V
// call's pages (now, in arrival order, so the pool takes pages only for calls
// about to run); then the backend checks the whole params, outputs included,
// and plans the launch, once. UNIMPLEMENTED here names what this build lacks.
// batch_invariant: ExecutorOptions::batch_invariant, set on every call here.
absl::Status MakeReady(AttentionBackend& backend, DenseJob& j, bool batch_invariant) {
  if (j.bind_outputs) RETURN_IF_ERROR(j.bind_outputs(&j.params));
  j.params.batch_invariant |= batch_invariant;
  ASSIGN_OR_RETURN(j.plan, backend.CanImplement(j.params));
  return absl::OkStatus();
}
absl::Status MakeReady(AttentionBackend& backend, PagedJob& j, bool batch_invariant) {
  ASSIGN_OR_RETURN(j.params, j.work.reserve());
  j.params.attn.batch_invariant |= batch_invariant;
  ASSIGN_OR_RETURN(j.plan, backend.CanImplementPaged(j.params));
  return absl::OkStatus();
}

// MakeReady that never throws: on the launcher thread nothing above it
// catches (the process would terminate), and a call run inline would leave
// the launcher claimed and the executor wedged. A throw from the backend's
// planning, the output binding or a K/V call's reservation fails that call.
template <typename Job>
absl::Status MakeReadyCaught(AttentionBackend& backend, Job& j, bool batch_invariant) {
  try {
    return MakeReady(backend, j, batch_invariant);
  } catch (...) {
    return StatusOfException(std::current_exception(), "planning the call");
  }
}

// Whether two ready calls can share a launch (LSE is known only once outputs
// are bound, a K/V call's pages once reserved). Batch-invariant calls share
// only with calls planned alike (SamePlanned): the packed launch is planned
// for the packed sizes, which then gives each member the plan it has alone.
bool CanShare(const DenseJob& a, const DenseJob& b) {
  return CanShareLaunch(a.params, b.params) &&
         (!a.params.batch_invariant || SamePlanned(a.plan, b.plan));
}
bool CanShare(const PagedJob& a, const PagedJob& b) {
  return CanSharePagedLaunch(a.params, b.params) &&
         (!a.params.attn.batch_invariant || SamePlanned(a.plan, b.plan));
}

// One launch over ready calls of one kind, with the first one's plan.
absl::StatusOr<std::unique_ptr<PendingLaunch>> Start(AttentionBackend& backend,
                                                     const std::vector<const DenseJob*>& jobs) {
  std::vector<const AttnParams*> members;
  for (const DenseJob* j : jobs) members.push_back(&j->params);
  return backend.StartForward(jobs.front()->plan, PackedBatch(std::move(members)));
}
absl::StatusOr<std::unique_ptr<PendingLaunch>> Start(AttentionBackend& backend,
                                                     const std::vector<const PagedJob*>& jobs) {
  std::vector<const PagedAttnParams*> members;
  for (const PagedJob* j : jobs) members.push_back(&j->params);
  return backend.StartPagedForward(jobs.front()->plan, PagedBatch(std::move(members)));
}

// `pair(a, b)` for two calls of one kind; calls of different kinds share nothing.
template <typename Pair>
bool OfOneKindAnd(const WorkJob& a, const WorkJob& b, Pair pair) {
  return std::visit(
      [&pair](const auto& x, const auto& y) {
        if constexpr (std::is_same_v<decltype(x), decltype(y)>) {
          return pair(x, y);
        } else {
          return false;
        }
      },
      a, b);
}

// The one place that tells the kinds apart: an item's call as its job.
WorkJob JobOf(WorkItem& item) {
  if (item.paged.has_value()) return PagedJob{*std::move(item.paged), {}, Plan()};
  return DenseJob{item.params, std::move(item.bind_outputs), Plan()};
}

// What the thread that launches a ready call runs of it (inline_max_cost):
// without a pipeline the whole call, a K/V call's context included; with one
// only the launch's start, which stages the call's own rows.
int64_t WorkOnLaunchingThread(const DenseJob& j, bool) { return RequestCost(j.params); }
int64_t WorkOnLaunchingThread(const PagedJob& j, bool finishes_here) {
  return finishes_here ? RequestCost(j.params) : RequestCost(j.work.rows);
}

// The executor whose call this thread runs inline, if any: a call submitted
// from its `done` (or from any executor's) queues instead of nesting.
thread_local const void* t_running_inline = nullptr;

absl::Status DroppedAtShutdown() {
  return absl::UnavailableError("server is shutting down: request dropped before compute");
}

}  // namespace

int64_t WorkItemTokens(const WorkItem& item) {
  if (!item.paged.has_value()) return BatchTokens(item.params);
  const AttnShape& rows = item.paged->rows;
  return int64_t{rows.cu_seqlens_q[rows.batch]} + rows.cu_seqlens_k[rows.batch];
}

Executor::Queued::Queued(WorkItem item)
    : meta(std::move(static_cast<WorkMetadata&>(item))),
      job(JobOf(item)),
      tokens(std::visit([](const auto& j) { return Tokens(j); }, job)),
      cost(std::visit([](const auto& j) { return Cost(j); }, job)) {}

Executor::Executor(AttentionBackend* backend, const ExecutorOptions& options)
    : backend_(backend),
      options_(options),
      max_in_flight_(std::max(1, backend->max_launches_in_flight())),
      queue_(options.fair_quantum) {
  launcher_ = std::thread([this] { LauncherLoop(); });
  completer_ = std::thread([this] { CompleterLoop(); });
  launcher_id_ = launcher_.get_id();
  completer_id_ = completer_.get_id();
  if (options_.launch_timeout != absl::InfiniteDuration()) {
    watchdog_ = std::thread([this] { WatchdogLoop(); });
    watchdog_id_ = watchdog_.get_id();
  }
}

Executor::~Executor() { Shutdown(); }

absl::Status Executor::Submit(WorkItem item) { return Offer(&item); }

absl::Status Executor::Offer(WorkItem* item) {
  absl::ReleasableMutexLock lock(&mu_);
  if (!admitting_ && (stopping_ || !item->follows_admitted)) {
    return absl::UnavailableError(refusal_);
  }
  if (!stalled_.empty()) return absl::UnavailableError(stalled_);
  if (!queue_.HasRoom(item->tenant, options_.max_queue_size)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", queue_.size(), " requests waiting, the limit is ",
                     options_.max_queue_size, " (--max_queue_size), and tenant \"", item->tenant,
                     "\" holds its fair share of it; retry later"));
  }
  Queued q(std::move(*item));
  outstanding_tokens_.fetch_add(q.tokens, std::memory_order_relaxed);
  outstanding_work_.fetch_add(q.cost, std::memory_order_relaxed);
  q.admitted = absl::Now();
  if (MayRunHere(q)) {
    // Claimed as the launcher claims what it picks: the launcher waits, and
    // WaitIdle counts it, until RunHere clears launching_.
    launching_ = true;
    lock.Release();
    RunHere(std::move(q));
    return absl::OkStatus();
  }
  queued_tokens_.fetch_add(q.tokens, std::memory_order_relaxed);
  const std::string tenant = q.meta.tenant;
  const int64_t cost = q.cost;
  queue_.Push(tenant, cost, std::move(q));
  ++submitted_;
  return absl::OkStatus();
}

bool Executor::MayRunHere(const Queued& q) const {
  return options_.inline_max_cost > 0 && !q.meta.no_inline && t_running_inline == nullptr &&
         q.cost <= options_.inline_max_cost && queue_.empty() && !launching_ &&
         in_flight_.empty() && !completing_ && open_launches_ == 0 && !watchdog_failing_ &&
         !stopping_ && stalled_.empty();
}

void Executor::RunHere(Queued q) {
  t_running_inline = this;
  q.timings.queue_us = Micros(absl::Now() - q.admitted);
  absl::Status ready = CheckStillWanted(q.meta);
  if (ready.ok()) {
    ready = std::visit(
        [this](auto& job) { return MakeReadyCaught(*backend_, job, options_.batch_invariant); },
        q.job);
  }
  const bool finishes_here = max_in_flight_ == 1;
  if (!ready.ok()) {
    Fail(std::move(q), ready);
  } else if (std::visit([&](const auto& j) { return WorkOnLaunchingThread(j, finishes_here); },
                        q.job) > options_.inline_max_cost) {
    // Too long to hold this thread (a K/V call over a long context): the
    // launcher runs it, ready, ahead of anything queued since.
    absl::MutexLock lock(&mu_);
    q.rerun_alone = true;
    queued_tokens_.fetch_add(q.tokens, std::memory_order_relaxed);
    queue_.PushFront(std::move(q));
    ++submitted_;
  } else {
    std::vector<Queued> alone;
    alone.push_back(std::move(q));
    StartLaunch(std::move(alone));
  }
  t_running_inline = nullptr;
  absl::MutexLock lock(&mu_);
  launching_ = false;
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
  // Every open launch is in in_flight_ or held by the completer.
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return queue_.empty() && !launching_ && in_flight_.empty() && !completing_ &&
           !watchdog_failing_;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void Executor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (admitting_) refusal_ = "server is shutting down: not accepting new requests";
    admitting_ = false;
    stopping_ = true;
  }
  // A done callback (on the launcher or the completer) may shut the executor
  // down: it must not join either thread, since the other may be waiting for
  // it. The flags are set; the owner's Shutdown or destructor joins.
  const std::thread::id self = std::this_thread::get_id();
  if (self == launcher_id_ || self == completer_id_ || self == watchdog_id_ ||
      t_running_inline == this) {
    return;
  }
  absl::MutexLock lock(&join_mu_);
  for (std::thread* t : {&launcher_, &completer_, &watchdog_}) {
    if (t->joinable()) t->join();
  }
}

absl::Status Executor::Admitting() const {
  absl::MutexLock lock(&mu_);
  return admitting_ ? absl::OkStatus() : absl::UnavailableError(refusal_);
}

absl::Status Executor::Healthy() const {
  absl::MutexLock lock(&mu_);
  return stalled_.empty() ? absl::OkStatus() : absl::UnavailableError(stalled_);
}

int Executor::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

std::map<std::string, int64_t> Executor::queued_by_tenant() const {
  absl::MutexLock lock(&mu_);
  return queue_.Depths();
}

bool Executor::running() const {
  absl::MutexLock lock(&mu_);
  return launching_ || completing_ || !in_flight_.empty();
}

void Executor::Complete(Queued& q, const absl::Status& status) {
  q.timings.total_us = Micros(absl::Now() - q.meta.received);
  q.timings.device = options_.device;
  q.meta.done(status, q.timings);
  outstanding_tokens_.fetch_sub(q.tokens, std::memory_order_relaxed);
  outstanding_work_.fetch_sub(q.cost, std::memory_order_relaxed);
}

Executor::Queued Executor::PopQueued() {
  Queued q = queue_.Pop();
  queued_tokens_.fetch_sub(q.tokens, std::memory_order_relaxed);
  return q;
}

void Executor::LauncherLoop() {
  while (true) {
    std::vector<Queued> picked;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      // A call running inline holds launching_: it goes first.
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !launching_ && (!queue_.empty() || stopping_);
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) {  // stopping, and nothing left to complete
        launcher_done_ = true;
        return;
      }
      picked.push_back(PopQueued());
      launching_ = true;
      stopping = stopping_;
      const Queued& head = picked.front();
      if (!stopping && options_.batching && !head.meta.internal && !head.rerun_alone) {
        CollectBatch(&picked);
        stopping = stopping_;  // collection may have waited while Shutdown began
      }
    }
    if (stopping) {
      for (Queued& q : picked) Fail(std::move(q), DroppedAtShutdown());
    } else {
      Dispatch(std::move(picked));
    }
    // `picked` is released by now, so WaitIdle returning means the front-end
    // has been told about everything that did not start.
    absl::MutexLock lock(&mu_);
    launching_ = false;
  }
}

void Executor::CollectBatch(std::vector<Queued>* batch) {
  // Joiners go to `joined` first: `head` points into `batch`.
  const Queued& head = batch->front();
  int64_t tokens = head.tokens;
  if (tokens >= options_.batch_max_tokens) return;
  const absl::Time wait_until = head.admitted + options_.batch_max_delay;
  std::vector<Queued> joined;
  while (true) {
    // Any tenant's compatible items may ride along (charged to their own
    // tenant by the queue); the head was picked fairly.
    queue_.TakeIf(
        [&](const Queued& q) {
          if (q.meta.internal || q.rerun_alone || tokens + q.tokens > options_.batch_max_tokens ||
              !OfOneKindAnd(head.job, q.job,
                            [](const auto& a, const auto& b) { return MayShare(a, b); })) {
            return false;
          }
          tokens += q.tokens;
          queued_tokens_.fetch_sub(q.tokens, std::memory_order_relaxed);
          return true;
        },
        &joined);
    // Alone means no sign of concurrency: waiting would only add latency.
    if (joined.empty() || stopping_ || absl::Now() >= wait_until) break;
    const int64_t seen = submitted_;
    auto arrived = [this, seen]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return submitted_ != seen || stopping_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&arrived), wait_until)) break;
  }
  for (Queued& q : joined) batch->push_back(std::move(q));
}

void Executor::Dispatch(std::vector<Queued> picked) {
  const absl::Time now = absl::Now();
  std::vector<std::vector<Queued>> groups;
  for (Queued& q : picked) {
    // A rerun was made ready and timed the first time it was picked.
    if (!q.rerun_alone) {
      q.timings.queue_us = Micros(now - q.admitted);
      absl::Status ready = CheckStillWanted(q.meta);
      if (ready.ok()) {
        ready = std::visit(
            [this](auto& job) { return MakeReadyCaught(*backend_, job, options_.batch_invariant); },
            q.job);
      }
      if (!ready.ok()) {
        Fail(std::move(q), ready);
        continue;
      }
    }
    // Collection compared the calls before they were ready, so the ready ones
    // are split into groups that can share a launch.
    auto fits = [&](const std::vector<Queued>& g) {
      return !q.rerun_alone && !g.front().rerun_alone &&
             OfOneKindAnd(g.front().job, q.job,
                          [](const auto& a, const auto& b) { return CanShare(a, b); });
    };
    auto g = std::find_if(groups.begin(), groups.end(), fits);
    if (g == groups.end()) {
      groups.emplace_back();
      g = groups.end() - 1;
    }
    g->push_back(std::move(q));
  }
  for (std::vector<Queued>& group : groups) StartLaunch(std::move(group));
}

void Executor::StartLaunch(std::vector<Queued> group) {
  bool stopping;
  std::string stalled;
  {
    absl::MutexLock lock(&mu_);
    // Shutdown also ends the wait: a done callback that shuts the executor
    // down runs on the completer, which then cannot make room.
    // So does a stall: the device is not answering, nothing more goes to it.
    auto has_room = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return open_launches_ < max_in_flight_ || stopping_ || !stalled_.empty();
    };
    mu_.Await(absl::Condition(&has_room));
    stopping = stopping_;
    stalled = stalled_;
  }
  if (stopping || !stalled.empty()) {
    const absl::Status why = stopping ? DroppedAtShutdown() : absl::UnavailableError(stalled);
    for (Queued& q : group) Fail(std::move(q), why);
    return;
  }
  const bool internal = group.front().meta.internal;
  const absl::Time started = absl::Now();
  CallBegins(0);
  absl::StatusOr<std::unique_ptr<PendingLaunch>> launch;
  // A throwing backend fails the launch like an error status (as in
  // MakeReadyCaught: no thread of the executor may be left by a throw).
  try {
    launch = std::visit(
        [&](const auto& first) {
          using Job = std::decay_t<decltype(first)>;
          std::vector<const Job*> jobs;
          for (const Queued& q : group) jobs.push_back(&std::get<Job>(q.job));
          return Start(*backend_, jobs);
        },
        group.front().job);
  } catch (...) {
    launch = StatusOfException(std::current_exception(), "launch");
  }
  CallEnds(0);
  if (options_.metrics != nullptr && !internal) options_.metrics->RecordExecution();
  if (!launch.ok()) {
    if (group.size() == 1) {
      Fail(std::move(group.front()), launch.status());
    } else {
      for (Queued& q : group) {
        std::vector<Queued> alone;
        alone.push_back(std::move(q));
        StartLaunch(std::move(alone));
      }
    }
    return;
  }
  InFlight open{std::move(group), *std::move(launch), started, absl::OkStatus()};
  {
    absl::MutexLock lock(&mu_);
    ++open_launches_;
    // A backend without a pipeline (one launch at a time) has nothing to
    // overlap with this launch's Finish: with no other work waiting, the
    // launcher finishes it and answers its callers itself, saving the hand-off
    // to the completer. Otherwise the completer does, in start order.
    const bool answer_here =
        max_in_flight_ == 1 && in_flight_.empty() && !completing_ && queue_.empty();
    if (!answer_here) {
      in_flight_.push_back(std::move(open));
      return;
    }
    completing_ = true;  // as the completer marks what it holds
  }
  FinishLaunch(std::move(open));
}

void Executor::Fail(Queued q, absl::Status status) {
  InFlight failed;
  failed.members.push_back(std::move(q));
  failed.failed = std::move(status);
  absl::MutexLock lock(&mu_);
  in_flight_.push_back(std::move(failed));
}

void Executor::CompleterLoop() {
  while (true) {
    InFlight done;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !in_flight_.empty() || launcher_done_;
      };
      mu_.Await(absl::Condition(&ready));
      if (in_flight_.empty()) return;  // the launcher has exited: nothing more comes
      done = std::move(in_flight_.front());
      in_flight_.pop_front();
      completing_ = true;
    }
    FinishLaunch(std::move(done));
  }
}

void Executor::FinishLaunch(InFlight done) {
  if (done.launch == nullptr) {  // failed before launch
    Complete(done.members.front(), done.failed);
    done.members.clear();
    absl::MutexLock lock(&mu_);
    completing_ = false;
    return;
  }
  BackendTimings bt;
  CallBegins(1, done.launch.get(), &done.members);
  absl::Status status;
  try {
    status = done.launch->Finish(&bt);
  } catch (...) {
    status = StatusOfException(std::current_exception(), "launch");
  }
  // Members the watchdog failed (an abandoned launch) are gone from `done`.
  CallEnds(1);
  done.launch.reset();
  const int64_t wall_us = Micros(absl::Now() - done.started);
  {
    // The launch is over: room for the next one now, not after the
    // callbacks (which may take long, or shut the executor down).
    // `completing_` keeps WaitIdle false until they have run.
    absl::MutexLock lock(&mu_);
    --open_launches_;
  }
  if (!status.ok() && done.members.size() > 1) {
    // A packed launch failed as a whole: its members run again one by one,
    // ahead of newer work, so only a request that fails alone fails. (Once
    // the launcher has exited nothing would run them: they get the error.)
    absl::MutexLock lock(&mu_);
    if (!launcher_done_) {
      for (auto it = done.members.rbegin(); it != done.members.rend(); ++it) {
        it->rerun_alone = true;
        queued_tokens_.fetch_add(it->tokens, std::memory_order_relaxed);
        queue_.PushFront(std::move(*it));
      }
      ++submitted_;
      completing_ = false;
      return;
    }
  }
  for (Queued& q : done.members) {
    q.timings.host_to_device_us = bt.host_to_device_us;
    q.timings.device_to_host_us = bt.device_to_host_us;
    // A backend that does not time itself still gets the wall time of its
    // launch reported as compute.
    q.timings.compute_us =
        bt.compute_us > 0
            ? bt.compute_us
            : std::max<int64_t>(0, wall_us - bt.host_to_device_us - bt.device_to_host_us);
    q.timings.batch_size = static_cast<int>(done.members.size());
    Complete(q, status);
  }
  // Release the items (and whatever their callbacks hold) before
  // `completing_` clears, so WaitIdle returning means the front-end has
  // been told.
  done.members.clear();
  absl::MutexLock lock(&mu_);
  completing_ = false;
}

void Executor::CallBegins(int slot, PendingLaunch* launch, std::vector<Queued>* members) {
  absl::MutexLock lock(&mu_);
  call_since_[slot] = absl::Now();
  if (slot == 1) {
    finishing_launch_ = launch;
    finishing_members_ = members;
  }
  ++call_changes_;
}

void Executor::CallEnds(int slot) {
  bool recovered = false;
  {
    absl::MutexLock lock(&mu_);
    call_since_[slot] = absl::InfiniteFuture();
    if (slot == 1) {
      finishing_launch_ = nullptr;
      finishing_members_ = nullptr;
    }
    ++call_changes_;
    if (!stalled_.empty() && !CallOverdue(absl::Now())) {
      stalled_.clear();
      recovered = true;
    }
  }
  if (recovered) {
    spdlog::warn("device {} answers again: serving", options_.device);
    if (options_.on_health_change) options_.on_health_change();
  }
}

bool Executor::CallOverdue(absl::Time now) const {
  return std::min(call_since_[0], call_since_[1]) + options_.launch_timeout <= now;
}

void Executor::WatchdogLoop() {
  while (true) {
    std::vector<Queued> fail;
    std::string reason;
    {
      absl::MutexLock lock(&mu_);
      const int64_t seen = call_changes_;
      // Once a stall is reported, only a change (the call returning) matters.
      const absl::Time due =
          stalled_.empty() ? std::min(call_since_[0], call_since_[1]) + options_.launch_timeout
                           : absl::InfiniteFuture();
      auto changed = [this, seen]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || call_changes_ != seen;
      };
      if (mu_.AwaitWithDeadline(absl::Condition(&changed), due)) {
        if (stopping_) return;
        continue;
      }
      // The same call is still running past the timeout.
      const absl::Duration ran = absl::Now() - std::min(call_since_[0], call_since_[1]);
      stalled_ = absl::StrCat(
          "device ", options_.device, " stopped answering: a backend call has run for ",
          absl::FormatDuration(absl::Trunc(ran, absl::Milliseconds(1))),
          ", over the launch timeout of ", absl::FormatDuration(options_.launch_timeout),
          " (--launch_timeout); the request did not complete, retry");
      reason = stalled_;
      while (!queue_.empty()) fail.push_back(PopQueued());
      // The stuck launch's own requests go too, if the backend can promise
      // not to write into them any more; otherwise they wait for it.
      if (finishing_launch_ != nullptr && finishing_launch_->Abandon()) {
        for (Queued& q : *finishing_members_) fail.push_back(std::move(q));
        finishing_members_->clear();
      }
      watchdog_failing_ = true;
    }
    spdlog::error("{}: {} requests failed, new ones refused until it answers", reason, fail.size());
    for (Queued& q : fail) Complete(q, absl::UnavailableError(reason));
    fail.clear();
    {
      absl::MutexLock lock(&mu_);
      watchdog_failing_ = false;
    }
    if (options_.on_health_change) options_.on_health_change();
  }
}

}  // namespace attnserve
