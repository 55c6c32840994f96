// Calls run on the submitting thread (ExecutorOptions::inline_max_cost): only
// when the executor is idle and the call is small (a K/V call's context
// counted once its pages are known), and with every rule of the launcher
// path kept: the queue bound, drain and WaitIdle, deadline and cancellation,
// fair order of what queues behind it, the watchdog, and Shutdown from `done`.
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backend/make_params.h"
#include "backend/paged_kv.h"
#include "gtest/gtest.h"
#include "server/executor.h"
#include "server/fair_queue.h"

namespace attnserve {
namespace {

constexpr int64_t kLimit = int64_t{1} << 16;  // inline_max_cost in these tests

// Dense launches tagged by params.batch, paged ones by -1, recording the
// thread that started each; starts and finishes can be held.
class RecordingBackend : public AttentionBackend {
 public:
  explicit RecordingBackend(int depth) : depth_(depth) { description_.name = "recording"; }

  const BackendDescription& Describe() const override { return description_; }
  absl::StatusOr<Plan> CanImplement(const AttnParams&) const override { return Plan(); }
  absl::Status Forward(const Plan&, const AttnParams&, BackendTimings*) override {
    return absl::InternalError("the executor must use StartForward");
  }
  int max_launches_in_flight() const override { return depth_; }
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams&) const override {
    absl::MutexLock lock(&mu_);
    ++paged_plans_;
    return Plan();
  }

  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan&,
                                                              const PackedBatch& batch) override {
    return Started(batch.members().front()->batch);
  }
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartPagedForward(const Plan&,
                                                                   const PagedBatch&) override {
    return Started(-1);
  }

  void SetStartOpen(bool open) {
    absl::MutexLock lock(&mu_);
    start_open_ = open;
  }
  void SetFinishOpen(bool open) {
    absl::MutexLock lock(&mu_);
    finish_open_ = open;
  }
  // Waits until `n` launches have begun (held ones included).
  void AwaitStarts(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return tags_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
  }
  std::vector<int> tags() {
    absl::MutexLock lock(&mu_);
    return tags_;
  }
  std::vector<std::thread::id> threads() {
    absl::MutexLock lock(&mu_);
    return threads_;
  }
  int max_concurrent_starts() {
    absl::MutexLock lock(&mu_);
    return max_starting_;
  }
  int paged_plans() {
    absl::MutexLock lock(&mu_);
    return paged_plans_;
  }

 private:
  class Launch : public PendingLaunch {
   public:
    explicit Launch(RecordingBackend* b) : b_(b) {}
    absl::Status Finish(BackendTimings* timings) override {
      absl::MutexLock lock(&b_->mu_);
      b_->mu_.Await(absl::Condition(&b_->finish_open_));
      timings->compute_us = 3;
      return absl::OkStatus();
    }

   private:
    RecordingBackend* b_;
  };

  absl::StatusOr<std::unique_ptr<PendingLaunch>> Started(int tag) {
    absl::MutexLock lock(&mu_);
    tags_.push_back(tag);
    threads_.push_back(std::this_thread::get_id());
    ++starting_;
    max_starting_ = std::max(max_starting_, starting_);
    mu_.Await(absl::Condition(&start_open_));
    --starting_;
    return std::unique_ptr<PendingLaunch>(new Launch(this));
  }

  const int depth_;
  BackendDescription description_;
  mutable absl::Mutex mu_;
  bool start_open_ ABSL_GUARDED_BY(mu_) = true;
  bool finish_open_ ABSL_GUARDED_BY(mu_) = true;
  int starting_ ABSL_GUARDED_BY(mu_) = 0;
  int max_starting_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int paged_plans_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> tags_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
};

struct Result {
  int tag;
  absl::Status status;
  std::thread::id thread;
};

class Completions {
 public:
  // A small dense call (RequestCost kCostPerRequest) tagged `tag`.
  WorkItem Item(int tag, const std::string& tenant = "") {
    WorkItem item;
    item.params.batch = tag;
    item.tenant = tenant;
    item.done = [this, tag](const absl::Status& status, const WorkTimings&) {
      absl::MutexLock lock(&mu_);
      results_.push_back({tag, status, std::this_thread::get_id()});
    };
    return item;
  }
  // A dense call whose bytes make it cost more than kLimit.
  WorkItem Large(int tag) {
    WorkItem item = Item(tag);
    item.params.dtype = DType::kFP16;
    item.params.num_heads_q = 1;
    item.params.num_heads_kv = 1;
    item.params.head_dim = 1024;
    item.params.total_q = 64;
    EXPECT_GT(RequestCost(item.params), kLimit);
    return item;
  }
  std::vector<Result> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return results_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
    return results_;
  }
  size_t count() {
    absl::MutexLock lock(&mu_);
    return results_.size();
  }

 private:
  absl::Mutex mu_;
  std::vector<Result> results_ ABSL_GUARDED_BY(mu_);
};

ExecutorOptions InlineOptions() {
  ExecutorOptions o;
  o.inline_max_cost = kLimit;
  return o;
}

// Submits from a thread of its own (the call may run there and block).
class Submitter {
 public:
  Submitter(Executor* e, WorkItem item)
      : thread_([this, e, item = std::move(item)]() mutable {
          status_ = e->Submit(std::move(item));
        }) {}
  ~Submitter() {
    if (thread_.joinable()) thread_.join();
  }
  // Submit's status, once it has returned.
  absl::Status Join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  std::thread thread_;
};

TEST(ExecutorInlineTest, IdleExecutorRunsASmallCallOnTheSubmittingThread) {
  for (bool on : {true, false}) {
    SCOPED_TRACE(on);
    RecordingBackend backend(/*depth=*/1);
    ExecutorOptions options = InlineOptions();
    if (!on) options.inline_max_cost = 0;
    Executor executor(&backend, options);
    Completions c;
    ASSERT_TRUE(executor.Submit(c.Item(1)).ok());
    const std::thread::id self = std::this_thread::get_id();
    if (on) {
      // Answered before Submit returned, on this thread, start to finish.
      ASSERT_EQ(c.count(), 1u);
      EXPECT_EQ(c.Await(1)[0].thread, self);
      EXPECT_EQ(backend.threads()[0], self);
    } else {
      EXPECT_NE(c.Await(1)[0].thread, self);
      EXPECT_NE(backend.threads()[0], self);
    }
    EXPECT_TRUE(c.Await(1)[0].status.ok());
    EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
    EXPECT_EQ(executor.outstanding_work(), 0);
  }
}

TEST(ExecutorInlineTest, WithAPipelineTheLaunchStartsHereAndTheCompleterAnswers) {
  RecordingBackend backend(/*depth=*/3);
  Executor executor(&backend, InlineOptions());
  Completions c;
  backend.SetFinishOpen(false);
  ASSERT_TRUE(executor.Submit(c.Item(1)).ok());  // returns with the launch open
  EXPECT_EQ(backend.threads()[0], std::this_thread::get_id());
  EXPECT_EQ(c.count(), 0u);
  EXPECT_TRUE(executor.running());
  backend.SetFinishOpen(true);
  EXPECT_NE(c.Await(1)[0].thread, std::this_thread::get_id());
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

TEST(ExecutorInlineTest, ACallOverTheLimitGoesToTheLauncher) {
  RecordingBackend backend(/*depth=*/1);
  Executor executor(&backend, InlineOptions());
  Completions c;
  ASSERT_TRUE(executor.Submit(c.Large(1)).ok());
  EXPECT_NE(c.Await(1)[0].thread, std::this_thread::get_id());
  EXPECT_NE(backend.threads()[0], std::this_thread::get_id());
}

TEST(ExecutorInlineTest, ACallMarkedNoInlineGoesToTheLauncher) {
  RecordingBackend backend(/*depth=*/1);
  Executor executor(&backend, InlineOptions());
  Completions c;
  WorkItem item = c.Item(1);
  item.no_inline = true;
  ASSERT_TRUE(executor.Submit(std::move(item)).ok());
  EXPECT_NE(c.Await(1)[0].thread, std::this_thread::get_id());
  EXPECT_NE(backend.threads()[0], std::this_thread::get_id());
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

// A K/V step: one query and one new row (small before its pages are known)
// over `context` keys.
struct Step {
  int32_t cu[2] = {0, 1};
  int32_t context = 16;
  char o[64] = {};
  int reserves = 0;
};
WorkItem StepItem(Step* step, Completions* c, int tag) {
  WorkItem item = c->Item(tag);
  PagedWork work;
  work.cache = step;
  work.rows = PagedShape(DType::kFP16, 1, 2, 1, 16, step->cu, step->cu, nullptr);
  work.reserve = [step, rows = work.rows]() -> absl::StatusOr<PagedAttnParams> {
    ++step->reserves;
    AttnShape shape = rows;
    shape.seqlens_k = &step->context;
    AttnPointers io;
    io.o = step->o;
    PagedAttnParams p{};
    p.attn = MakeAttnParams(shape, AttnOptions(), io);
    p.pages.k_slabs[0] = step;
    p.pages.v_slabs[0] = step;
    p.pages.num_slabs = 1;
    p.pages.page_size = 16;
    p.pages.page_shift = 4;
    p.seqlens_k = &step->context;
    return p;
  };
  item.paged = std::move(work);
  return item;
}

// Without a pipeline the submitting thread would run the whole step, context
// included: a step whose context is too long is made ready here (pages
// reserved and planned once) and launched by the launcher.
TEST(ExecutorInlineTest, AKvStepWithALongContextIsHandedToTheLauncherReady) {
  RecordingBackend backend(/*depth=*/1);
  Executor executor(&backend, InlineOptions());
  Completions c;
  Step short_step, long_step;
  long_step.context = 1 << 20;
  ASSERT_TRUE(executor.Submit(StepItem(&short_step, &c, 1)).ok());
  ASSERT_EQ(c.count(), 1u) << "the short step ran inline";
  ASSERT_TRUE(executor.Submit(StepItem(&long_step, &c, 2)).ok());
  const std::vector<Result> results = c.Await(2);
  for (const Result& r : results) EXPECT_TRUE(r.status.ok()) << r.tag << ": " << r.status;
  EXPECT_EQ(results[0].thread, std::this_thread::get_id());
  EXPECT_NE(results[1].thread, std::this_thread::get_id());
  EXPECT_EQ(backend.threads()[0], std::this_thread::get_id());
  EXPECT_NE(backend.threads()[1], std::this_thread::get_id());
  EXPECT_EQ(long_step.reserves, 1);
  EXPECT_EQ(backend.paged_plans(), 2);  // each step planned once
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

// While a call runs inline it holds the device as a launch by the launcher
// would: the queue bound counts what waits behind it, WaitIdle and running()
// see it, StopAdmitting refuses new calls and the admitted still run.
TEST(ExecutorInlineTest, ACallRunningInlineHoldsTheDeviceForBoundAndDrain) {
  RecordingBackend backend(/*depth=*/1);
  ExecutorOptions options = InlineOptions();
  options.max_queue_size = 1;
  Executor executor(&backend, options);
  Completions c;
  backend.SetStartOpen(false);
  Submitter first(&executor, c.Item(0));
  backend.AwaitStarts(1);
  EXPECT_EQ(executor.queued(), 0);
  EXPECT_TRUE(executor.running());
  EXPECT_GT(executor.outstanding_work(), 0);
  EXPECT_FALSE(executor.WaitIdle(absl::Milliseconds(20)));
  ASSERT_TRUE(executor.Submit(c.Item(1)).ok());  // queued behind it
  EXPECT_EQ(executor.queued(), 1);
  const absl::Status full = executor.Submit(c.Item(2));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  executor.StopAdmitting();
  EXPECT_EQ(executor.Submit(c.Item(3)).code(), absl::StatusCode::kUnavailable);
  // The launcher, woken by the queued call, must still wait for the device.
  EXPECT_FALSE(executor.WaitIdle(absl::Milliseconds(30)));
  EXPECT_EQ(backend.tags().size(), 1u);
  EXPECT_EQ(executor.queued(), 1);
  EXPECT_EQ(c.count(), 0u);
  backend.SetStartOpen(true);
  EXPECT_TRUE(first.Join().ok());
  const std::vector<Result> results = c.Await(2);
  EXPECT_EQ(results[0].tag, 0);
  EXPECT_EQ(results[1].tag, 1);
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
  EXPECT_EQ(backend.max_concurrent_starts(), 1);
}

TEST(ExecutorInlineTest, DeadlineAndCancellationStillStopACallBeforeCompute) {
  RecordingBackend backend(/*depth=*/1);
  Executor executor(&backend, InlineOptions());
  Completions c;
  WorkItem late = c.Item(1);
  late.deadline = absl::Now() - absl::Milliseconds(1);
  ASSERT_TRUE(executor.Submit(std::move(late)).ok());
  WorkItem gone = c.Item(2);
  gone.cancelled = std::make_shared<std::atomic<bool>>(true);
  ASSERT_TRUE(executor.Submit(std::move(gone)).ok());
  const std::vector<Result> results = c.Await(2);
  EXPECT_EQ(results[0].status.code(), absl::StatusCode::kDeadlineExceeded) << results[0].status;
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kCancelled) << results[1].status;
  EXPECT_TRUE(backend.tags().empty()) << "never computed";
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

// Calls that arrive while one runs inline queue, none runs on a submitting
// thread, and they leave in the fair queue's order, as behind a launch.
TEST(ExecutorInlineTest, WhatQueuesBehindAnInlineCallKeepsTheFairOrder) {
  std::map<bool, std::vector<int>> order;
  for (bool on : {true, false}) {
    SCOPED_TRACE(on);
    RecordingBackend backend(/*depth=*/1);
    ExecutorOptions options = InlineOptions();
    if (!on) options.inline_max_cost = 0;
    options.fair_quantum = kCostPerRequest;  // one small call per turn
    Executor executor(&backend, options);
    Completions c;
    backend.SetStartOpen(false);
    Submitter first(&executor, c.Item(0, "a"));
    backend.AwaitStarts(1);
    for (int tag : {1, 2, 3}) ASSERT_TRUE(executor.Submit(c.Item(tag, "a")).ok());
    ASSERT_TRUE(executor.Submit(c.Item(4, "b")).ok());
    EXPECT_EQ(executor.queued(), 4);
    backend.SetStartOpen(true);
    const std::vector<Result> results = c.Await(5);
    for (size_t i = 1; i < results.size(); ++i) {
      EXPECT_NE(results[i].thread, std::this_thread::get_id()) << results[i].tag;
    }
    order[on] = backend.tags();
    EXPECT_EQ(backend.max_concurrent_starts(), 1);
  }
  EXPECT_EQ(order[true], std::vector<int>({0, 1, 4, 2, 3}));
  EXPECT_EQ(order[true], order[false]);
}

// A call submitted from an inline call's `done` queues (no nesting) and the
// launcher runs it once the inline call has let go.
TEST(ExecutorInlineTest, ACallSubmittedFromDoneQueuesForTheLauncher) {
  RecordingBackend backend(/*depth=*/1);
  Executor executor(&backend, InlineOptions());
  Completions c;
  WorkItem first = c.Item(1);
  auto record = first.done;
  absl::Status resubmitted;
  first.done = [&](const absl::Status& s, const WorkTimings& t) {
    record(s, t);
    resubmitted = executor.Submit(c.Item(2));
  };
  ASSERT_TRUE(executor.Submit(std::move(first)).ok());
  EXPECT_TRUE(resubmitted.ok()) << resubmitted;
  const std::vector<Result> results = c.Await(2);
  EXPECT_EQ(results[0].thread, std::this_thread::get_id());
  EXPECT_NE(results[1].thread, std::this_thread::get_id());
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

// The watchdog sees a call stuck inline as one stuck on the launcher: the
// device is marked as not answering, queued calls fail, new ones are refused,
// and it serves again once the call returns.
TEST(ExecutorInlineTest, TheWatchdogCoversACallStuckInline) {
  RecordingBackend backend(/*depth=*/1);
  ExecutorOptions options = InlineOptions();
  options.launch_timeout = absl::Milliseconds(50);
  Executor executor(&backend, options);
  Completions c;
  backend.SetStartOpen(false);
  Submitter stuck(&executor, c.Item(0));
  backend.AwaitStarts(1);
  ASSERT_TRUE(executor.Submit(c.Item(1)).ok());
  const std::vector<Result> failed = c.Await(1);  // evidence: the watchdog failed the queued one
  EXPECT_EQ(failed[0].tag, 1);
  EXPECT_EQ(failed[0].status.code(), absl::StatusCode::kUnavailable) << failed[0].status;
  EXPECT_EQ(executor.Healthy().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(executor.Submit(c.Item(2)).code(), absl::StatusCode::kUnavailable);
  backend.SetStartOpen(true);
  EXPECT_TRUE(stuck.Join().ok());
  EXPECT_TRUE(c.Await(2)[1].status.ok());
  EXPECT_TRUE(executor.Healthy().ok());
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

TEST(ExecutorInlineTest, ShutdownFromAnInlineCallsDoneDoesNotDeadlock) {
  RecordingBackend backend(/*depth=*/1);
  Completions c;
  {
    Executor executor(&backend, InlineOptions());
    WorkItem item = c.Item(1);
    auto record = item.done;
    item.done = [&executor, record](const absl::Status& s, const WorkTimings& t) {
      record(s, t);
      executor.Shutdown();
    };
    ASSERT_TRUE(executor.Submit(std::move(item)).ok());
    EXPECT_TRUE(c.Await(1)[0].status.ok());
    EXPECT_EQ(executor.Submit(c.Item(2)).code(), absl::StatusCode::kUnavailable);
  }  // the destructor joins the threads
}

}  // namespace
}  // namespace attnserve
