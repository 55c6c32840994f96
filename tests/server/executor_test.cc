// The executor core with a scripted backend: completion and timings, queue
// bound, deadline, cancellation, FIFO order, draining, shutdown, and backend
// statuses (UNIMPLEMENTED from CanImplement, errors from Forward).
#include "server/executor.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

// Records the order of calls by reading params.batch as a tag; each Forward
// can be held until the test opens the gate.
class ScriptedBackend : public AttentionBackend {
 public:
  ScriptedBackend() { description_.name = "scripted"; }

  const BackendDescription& Describe() const override { return description_; }

  absl::StatusOr<Plan> CanImplement(const AttnParams& p) const override {
    if (p.head_dim == 200) return absl::UnimplementedError("head_dim 200: not in this build");
    return Plan();
  }

  absl::Status Forward(const Plan&, const AttnParams& p, BackendTimings* timings) override {
    {
      absl::MutexLock lock(&mu_);
      started_.push_back(p.batch);
      mu_.Await(absl::Condition(&open_));
    }
    timings->compute_us = 7;
    if (p.head_dim == 16) return absl::InternalError("device fault");
    return absl::OkStatus();
  }

  void Close() {
    absl::MutexLock lock(&mu_);
    open_ = false;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  // Waits until `n` Forward calls have started.
  void AwaitStarted(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return started_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
  }
  std::vector<int> started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }

 private:
  BackendDescription description_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<int> started_ ABSL_GUARDED_BY(mu_);
};

// Collects completions; each item's tag is params.batch.
class Completions {
 public:
  WorkItem Item(int tag, int head_dim = 64) {
    WorkItem item;
    item.params.batch = tag;
    item.params.head_dim = head_dim;
    item.done = [this, tag](const absl::Status& status, const WorkTimings& timings) {
      absl::MutexLock lock(&mu_);
      results_.push_back({tag, status, timings});
    };
    return item;
  }

  struct Result {
    int tag;
    absl::Status status;
    WorkTimings timings;
  };

  std::vector<Result> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return results_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
    return results_;
  }

 private:
  absl::Mutex mu_;
  std::vector<Result> results_ ABSL_GUARDED_BY(mu_);
};

TEST(ExecutorTest, RunsAndReportsTimings) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  bool bound = false;
  WorkItem item = c.Item(1);
  item.received = absl::Now() - absl::Milliseconds(5);
  item.bind_outputs = [&bound](AttnParams*) {
    bound = true;
    return absl::OkStatus();
  };
  ASSERT_TRUE(executor.Submit(std::move(item)).ok());
  auto results = c.Await(1);
  EXPECT_TRUE(results[0].status.ok()) << results[0].status;
  EXPECT_TRUE(bound);
  EXPECT_EQ(results[0].timings.compute_us, 7);
  EXPECT_GE(results[0].timings.queue_us, 0);
  EXPECT_GE(results[0].timings.total_us, 5000);  // counted from `received`
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

TEST(ExecutorTest, QueueFullIsResourceExhausted) {
  ScriptedBackend backend;
  ExecutorOptions options;
  options.max_queue_size = 2;
  Executor executor(&backend, options);
  Completions c;
  backend.Close();
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
  backend.AwaitStarted(1);  // running: no longer counts against the queue
  ASSERT_TRUE(executor.Submit(c.Item(1)).ok());
  ASSERT_TRUE(executor.Submit(c.Item(2)).ok());
  const absl::Status full = executor.Submit(c.Item(3));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("queue full"), absl::string_view::npos) << full;
  EXPECT_EQ(executor.queued(), 2);
  backend.Open();
  auto results = c.Await(3);
  for (const auto& r : results) EXPECT_TRUE(r.status.ok()) << r.status;
  // Room again once the queue drains.
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
  EXPECT_TRUE(executor.Submit(c.Item(4)).ok());
  c.Await(4);
}

TEST(ExecutorTest, DeadlinePassedWhileQueued) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  backend.Close();
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
  backend.AwaitStarted(1);
  WorkItem late = c.Item(1);
  late.deadline = absl::Now() + absl::Milliseconds(20);
  ASSERT_TRUE(executor.Submit(std::move(late)).ok());
  absl::SleepFor(absl::Milliseconds(40));
  backend.Open();
  auto results = c.Await(2);
  EXPECT_TRUE(results[0].status.ok());
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kDeadlineExceeded) << results[1].status;
  EXPECT_GE(results[1].timings.queue_us, 20000);
  EXPECT_EQ(backend.started(), std::vector<int>({0}));  // never computed
}

TEST(ExecutorTest, CancelledBeforeComputeIsDropped) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  backend.Close();
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
  backend.AwaitStarted(1);
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  WorkItem item = c.Item(1);
  item.cancelled = cancelled;
  ASSERT_TRUE(executor.Submit(std::move(item)).ok());
  cancelled->store(true);
  backend.Open();
  auto results = c.Await(2);
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kCancelled) << results[1].status;
  EXPECT_EQ(backend.started(), std::vector<int>({0}));
}

TEST(ExecutorTest, RunsInAdmissionOrder) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  backend.Close();
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(executor.Submit(c.Item(i)).ok());
  backend.Open();
  auto results = c.Await(10);
  EXPECT_EQ(backend.started(), std::vector<int>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(results[i].tag, i);
}

TEST(ExecutorTest, UnimplementedFromCanImplementSkipsCompute) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  ASSERT_TRUE(executor.Submit(c.Item(1, /*head_dim=*/200)).ok());
  auto results = c.Await(1);
  EXPECT_EQ(results[0].status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(backend.started().empty());
}

TEST(ExecutorTest, BackendErrorsAreReported) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  WorkItem bad_bind = c.Item(1);
  bad_bind.bind_outputs = [](AttnParams*) {
    return absl::ResourceExhaustedError("out of memory for o");
  };
  ASSERT_TRUE(executor.Submit(std::move(bad_bind)).ok());
  ASSERT_TRUE(executor.Submit(c.Item(2, /*head_dim=*/16)).ok());
  ASSERT_TRUE(executor.Submit(c.Item(3)).ok());
  auto results = c.Await(3);
  EXPECT_EQ(results[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(results[2].status.ok()) << "the executor keeps serving after errors";
}

TEST(ExecutorTest, StopAdmittingRefusesNewButRunsAdmitted) {
  ScriptedBackend backend;
  Executor executor(&backend, {});
  Completions c;
  backend.Close();
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
  ASSERT_TRUE(executor.Submit(c.Item(1)).ok());
  executor.StopAdmitting();
  const absl::Status refused = executor.Submit(c.Item(2));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("draining"), absl::string_view::npos) << refused;
  EXPECT_FALSE(executor.WaitIdle(absl::Milliseconds(20)));
  backend.Open();
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
  auto results = c.Await(2);
  EXPECT_TRUE(results[0].status.ok());
  EXPECT_TRUE(results[1].status.ok());
}

TEST(ExecutorTest, ShutdownCompletesQueuedWithUnavailable) {
  ScriptedBackend backend;
  Completions c;
  {
    Executor executor(&backend, {});
    backend.Close();
    ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
    backend.AwaitStarted(1);
    ASSERT_TRUE(executor.Submit(c.Item(1)).ok());
    ASSERT_TRUE(executor.Submit(c.Item(2)).ok());
    absl::Notification shut_down;
    std::thread stopper([&] {
      executor.Shutdown();
      shut_down.Notify();
    });
    // Evidence that Shutdown has begun (it stops admitting and marks the
    // queue in one step), not a fixed sleep: otherwise the held item could
    // finish first and item 1 start on a loaded machine.
    while (executor.Admitting().ok()) absl::SleepFor(absl::Milliseconds(1));
    // Shutdown waits for the running item; let it finish.
    EXPECT_FALSE(shut_down.HasBeenNotified());
    backend.Open();
    stopper.join();
    EXPECT_EQ(executor.Submit(c.Item(3)).code(), absl::StatusCode::kUnavailable);
    executor.Shutdown();  // idempotent
  }
  auto results = c.Await(3);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].status.ok());
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(results[2].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(backend.started(), std::vector<int>({0}));
}

// Fair share (fair_queue.h): a tenant's flood of large requests, queued
// first, does not hold back another tenant's small ones, which start as soon
// as the running launch ends; each tenant's own order is kept.
TEST(ExecutorTest, SmallTenantRunsAheadOfAnotherTenantsFlood) {
  ScriptedBackend backend;
  ExecutorOptions options;
  options.fair_quantum = 1 << 20;
  Executor executor(&backend, options);
  Completions c;
  auto large = [&](int tag) {
    WorkItem item = c.Item(tag);
    item.tenant = "flood";
    item.params.dtype = DType::kFP32;
    item.params.num_heads_q = item.params.num_heads_kv = 1;
    item.params.total_q = item.params.total_k = 4096;  // RequestCost ~4 MiB
    return item;
  };
  backend.Close();
  ASSERT_TRUE(executor.Submit(large(0)).ok());
  backend.AwaitStarted(1);  // the launcher is held in this launch
  for (int i = 1; i < 10; ++i) ASSERT_TRUE(executor.Submit(large(i)).ok());
  for (int i = 100; i < 103; ++i) {
    WorkItem item = c.Item(i);
    item.tenant = "small";
    ASSERT_TRUE(executor.Submit(std::move(item)).ok());
  }
  EXPECT_EQ(executor.queued_by_tenant(),
            (std::map<std::string, int64_t>{{"flood", 9}, {"small", 3}}));
  backend.Open();
  c.Await(13);
  EXPECT_EQ(backend.started(), std::vector<int>({0, 100, 101, 102, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// A device that stops answering: a launch whose Finish blocks until Resume.
// The watchdog (launch_timeout) fails the stuck launch's request (the launch
// can be abandoned) and the queued one with UNAVAILABLE, refuses new ones,
// reports Healthy() false, and the executor serves again once Finish returns.
class StuckLaunch : public PendingLaunch {
 public:
  explicit StuckLaunch(absl::Notification* resume) : resume_(resume) {}
  absl::Status Finish(BackendTimings*) override {
    resume_->WaitForNotification();
    return absl::UnavailableError("launch abandoned");
  }
  bool Abandon() override { return true; }  // it never writes outputs

 private:
  absl::Notification* resume_;
};

class HangingBackend : public ScriptedBackend {
 public:
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan& plan,
                                                              const PackedBatch& batch) override {
    if (hang.exchange(false)) return std::make_unique<StuckLaunch>(&resume);
    return ScriptedBackend::StartForward(plan, batch);
  }
  std::atomic<bool> hang{false};
  absl::Notification resume;
};

TEST(ExecutorTest, DeviceThatStopsAnsweringIsTimedOutAndRecovers) {
  HangingBackend backend;
  ExecutorOptions options;
  options.launch_timeout = absl::Milliseconds(50);
  std::atomic<int> health_changes{0};
  options.on_health_change = [&] { health_changes.fetch_add(1); };
  Executor executor(&backend, options);
  Completions c;
  backend.hang = true;
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());  // its launch never completes
  auto first = c.Await(1);                       // failed by the watchdog, not by the launch
  EXPECT_EQ(first[0].status.code(), absl::StatusCode::kUnavailable) << first[0].status;
  EXPECT_NE(first[0].status.message().find("stopped answering"), absl::string_view::npos);
  const absl::Status health = executor.Healthy();
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable);
  const absl::Status refused = executor.Submit(c.Item(1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  backend.resume.Notify();  // the fault clears: Finish returns
  const absl::Time cleared = absl::Now();
  while (!executor.Healthy().ok()) {
    ASSERT_LT(absl::Now() - cleared, absl::Seconds(1)) << "not serving again within 1 s";
    absl::SleepFor(absl::Milliseconds(1));  // polling the state, not a fixed wait
  }
  ASSERT_TRUE(executor.Submit(c.Item(2)).ok());
  auto all = c.Await(2);
  EXPECT_TRUE(all[1].status.ok()) << all[1].status;
  EXPECT_EQ(all[1].tag, 2);
  // Down, then up (the watchdog's report may land after the recovery's).
  const absl::Time since = absl::Now();
  while (health_changes.load() < 2 && absl::Now() - since < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_GE(health_changes.load(), 2);
}

}  // namespace
}  // namespace attnserve
