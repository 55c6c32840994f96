// The executor with a pipelined backend (max_launches_in_flight > 1): launches
// overlap up to the backend's bound, finish in the order they started, and a
// packed launch that fails when finished is rerun one member at a time;
// without a pipeline the launcher answers its own launch; K/V steps of one
// cache and layer share a launch.
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

namespace attnserve {
namespace {

// Launches whose Finish waits for the test to open a gate; StartForward can be
// held too. Items carry a tag in params.batch and no tensors.
class GatedPipelineBackend : public AttentionBackend {
 public:
  explicit GatedPipelineBackend(int depth) : depth_(depth) { description_.name = "gated"; }

  const BackendDescription& Describe() const override { return description_; }
  absl::StatusOr<Plan> CanImplement(const AttnParams&) const override { return Plan(); }
  absl::Status Forward(const Plan&, const AttnParams&, BackendTimings*) override {
    return absl::InternalError("the executor must use StartForward");
  }
  int max_launches_in_flight() const override { return depth_; }

  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan&,
                                                              const PackedBatch& batch) override {
    absl::MutexLock lock(&mu_);
    start_thread_ = std::this_thread::get_id();
    mu_.Await(absl::Condition(&start_open_));
    std::vector<int> tags;
    for (const AttnParams* m : batch.members()) tags.push_back(m->batch);
    starts_.push_back(tags);
    ++open_;
    max_open_ = std::max(max_open_, open_);
    return std::unique_ptr<PendingLaunch>(new Launch(this, batch.size()));
  }

  void SetStartOpen(bool open) {
    absl::MutexLock lock(&mu_);
    start_open_ = open;
  }
  void SetFinishOpen(bool open) {
    absl::MutexLock lock(&mu_);
    finish_open_ = open;
  }
  void AwaitStarts(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return starts_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
  }
  std::vector<std::vector<int>> starts() {
    absl::MutexLock lock(&mu_);
    return starts_;
  }
  int max_open() {
    absl::MutexLock lock(&mu_);
    return max_open_;
  }
  // The thread that called StartForward last.
  std::thread::id start_thread() {
    absl::MutexLock lock(&mu_);
    return start_thread_;
  }
  // Packed launches (two or more members) fail when finished.
  bool fail_packed = false;

 private:
  class Launch : public PendingLaunch {
   public:
    Launch(GatedPipelineBackend* b, int members) : b_(b), members_(members) {}
    absl::Status Finish(BackendTimings* timings) override {
      absl::MutexLock lock(&b_->mu_);
      b_->mu_.Await(absl::Condition(&b_->finish_open_));
      --b_->open_;
      timings->compute_us = 11;
      if (b_->fail_packed && members_ > 1) return absl::InternalError("packed launch failed");
      return absl::OkStatus();
    }

   private:
    GatedPipelineBackend* b_;
    int members_;
  };

  const int depth_;
  BackendDescription description_;
  absl::Mutex mu_;
  bool start_open_ ABSL_GUARDED_BY(mu_) = true;
  bool finish_open_ ABSL_GUARDED_BY(mu_) = true;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  int max_open_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::vector<int>> starts_ ABSL_GUARDED_BY(mu_);
  std::thread::id start_thread_ ABSL_GUARDED_BY(mu_);
};

struct Result {
  int tag;
  absl::Status status;
  WorkTimings timings;
};

class Completions {
 public:
  WorkItem Item(int tag) {
    WorkItem item;
    item.params.batch = tag;
    item.done = [this, tag](const absl::Status& status, const WorkTimings& timings) {
      absl::MutexLock lock(&mu_);
      results_.push_back({tag, status, timings});
    };
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

TEST(ExecutorPipelineTest, KeepsUpToTheBackendsDepthInFlightAndFinishesInOrder) {
  GatedPipelineBackend backend(/*depth=*/3);
  ExecutorOptions options;
  options.device = 5;
  Executor executor(&backend, options);
  Completions c;
  backend.SetFinishOpen(false);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(executor.Submit(c.Item(i)).ok());
  backend.AwaitStarts(3);
  // Three launches open and none finished: the fourth waits for room.
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(backend.starts().size(), 3u);
  EXPECT_EQ(c.count(), 0u);
  EXPECT_TRUE(executor.running());
  backend.SetFinishOpen(true);
  std::vector<Result> results = c.Await(5);
  ASSERT_EQ(results.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(results[i].tag, i);
    EXPECT_TRUE(results[i].status.ok()) << results[i].status;
    EXPECT_EQ(results[i].timings.compute_us, 11);
    EXPECT_EQ(results[i].timings.device, 5);
  }
  EXPECT_EQ(backend.max_open(), 3);
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

TEST(ExecutorPipelineTest, PackedLaunchFailingAtFinishRerunsEachMemberAlone) {
  GatedPipelineBackend backend(/*depth=*/2);
  backend.fail_packed = true;
  ExecutorOptions options;
  options.batching = true;
  Executor executor(&backend, options);
  Completions c;
  // Hold the launcher inside the first start so the next three queue up and
  // are packed together.
  backend.SetStartOpen(false);
  ASSERT_TRUE(executor.Submit(c.Item(0)).ok());
  for (int i = 0; i < 200 && executor.queued() > 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  for (int i = 1; i <= 3; ++i) ASSERT_TRUE(executor.Submit(c.Item(i)).ok());
  backend.SetStartOpen(true);
  std::vector<Result> results = c.Await(4);
  ASSERT_EQ(results.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(results[i].tag, i);
    EXPECT_TRUE(results[i].status.ok()) << results[i].status;
    EXPECT_EQ(results[i].timings.batch_size, 1);
  }
  EXPECT_EQ(backend.starts(), std::vector<std::vector<int>>({{0}, {1, 2, 3}, {1}, {2}, {3}}));
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

TEST(ExecutorPipelineTest, ShutdownFromADoneCallbackNeitherDeadlocksNorLosesItems) {
  for (int depth : {1, 3}) {
    SCOPED_TRACE(depth);
    GatedPipelineBackend backend(depth);
    Completions c;
    {
      Executor executor(&backend, {});
      backend.SetFinishOpen(false);
      WorkItem first = c.Item(0);
      auto record = first.done;
      // The first completion shuts the executor down from the completer
      // thread while the launcher waits for room or has items queued.
      first.done = [&executor, record](const absl::Status& st, const WorkTimings& t) {
        record(st, t);
        executor.Shutdown();
      };
      ASSERT_TRUE(executor.Submit(std::move(first)).ok());
      for (int i = 1; i < 6; ++i) ASSERT_TRUE(executor.Submit(c.Item(i)).ok());
      backend.AwaitStarts(static_cast<size_t>(depth));
      backend.SetFinishOpen(true);
      std::vector<Result> results = c.Await(6);
      ASSERT_EQ(results.size(), 6u);
      EXPECT_TRUE(results[0].status.ok()) << results[0].status;
      for (const Result& r : results) {
        EXPECT_TRUE(r.status.ok() || absl::IsUnavailable(r.status)) << r.tag << ": " << r.status;
      }
      EXPECT_EQ(executor.Submit(c.Item(9)).code(), absl::StatusCode::kUnavailable);
    }  // the destructor joins both threads
  }
}

// A backend that answers its launches with nothing waiting behind them: the
// launcher that started the launch also answers it when the backend runs one
// launch at a time (no hand-off to the completer); with a pipeline the
// completer answers, so the launcher is free to start the next launch.
TEST(ExecutorPipelineTest, WithoutAPipelineTheLauncherAnswersItsOwnLaunch) {
  for (int depth : {1, 3}) {
    SCOPED_TRACE(depth);
    GatedPipelineBackend backend(depth);
    Executor executor(&backend, {});
    absl::Mutex mu;
    std::thread::id answered_on;
    bool answered = false;
    WorkItem item;
    item.done = [&](const absl::Status& st, const WorkTimings&) {
      EXPECT_TRUE(st.ok()) << st;
      absl::MutexLock lock(&mu);
      answered_on = std::this_thread::get_id();
      answered = true;
    };
    ASSERT_TRUE(executor.Submit(std::move(item)).ok());
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&answered));
    }
    ASSERT_TRUE(executor.WaitIdle(absl::Seconds(5)));
    absl::MutexLock lock(&mu);
    if (depth == 1) {
      EXPECT_EQ(answered_on, backend.start_thread());
    } else {
      EXPECT_NE(answered_on, backend.start_thread());
    }
  }
}

// K/V steps: records each paged launch's members (by a tag each call's
// params carry in seqlens_k[0]) and can hold the first launch.
class PagedRecorder : public AttentionBackend {
 public:
  PagedRecorder() { description_.name = "paged recorder"; }
  const BackendDescription& Describe() const override { return description_; }
  absl::StatusOr<Plan> CanImplement(const AttnParams&) const override { return Plan(); }
  absl::Status Forward(const Plan&, const AttnParams&, BackendTimings*) override {
    return absl::InternalError("no dense calls here");
  }
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams&) const override { return Plan(); }
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartPagedForward(
      const Plan&, const PagedBatch& batch) override {
    absl::MutexLock lock(&mu_);
    std::vector<int> tags;
    for (const PagedAttnParams* m : batch.members()) tags.push_back(m->seqlens_k[0]);
    launches_.push_back(tags);
    mu_.Await(absl::Condition(&open_));
    return std::unique_ptr<PendingLaunch>(new Done());
  }
  void SetOpen(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }
  void AwaitLaunches(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return launches_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
  }
  std::vector<std::vector<int>> launches() {
    absl::MutexLock lock(&mu_);
    return launches_;
  }

 private:
  class Done : public PendingLaunch {
   public:
    absl::Status Finish(BackendTimings*) override { return absl::OkStatus(); }
  };
  BackendDescription description_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<std::vector<int>> launches_ ABSL_GUARDED_BY(mu_);
};

// One decode step (one query, one new row) of cache `cache` (any distinct
// address) and `layer`, tagged `tag`, for `tenant`.
struct PagedStep {
  int32_t tag;
  int32_t cu[2] = {0, 1};
  char o[64] = {};
};
WorkItem StepItem(PagedStep* step, void* cache, int32_t layer, const std::string& tenant,
                  Completions* c) {
  WorkItem item = c->Item(step->tag);
  item.tenant = tenant;
  PagedWork work;
  work.cache = cache;
  work.layer = layer;
  work.rows = PagedShape(DType::kFP16, 1, 2, 1, 16, step->cu, step->cu, nullptr);
  work.reserve = [step, cache, rows = work.rows]() -> absl::StatusOr<PagedAttnParams> {
    AttnShape shape = rows;
    shape.seqlens_k = &step->tag;
    AttnPointers io;
    io.o = step->o;
    PagedAttnParams p{};
    p.attn = MakeAttnParams(shape, AttnOptions(), io);
    p.pages.k_slabs[0] = cache;  // names the cache, as a real cache's first slab does
    p.pages.v_slabs[0] = cache;
    p.pages.num_slabs = 1;
    p.pages.page_size = 16;
    p.pages.page_shift = 4;
    p.seqlens_k = &step->tag;
    return p;
  };
  item.paged = std::move(work);
  return item;
}

// Steps that arrive together from different streams and tenants on one cache
// and layer run as one launch; another layer or another cache runs on its own.
TEST(ExecutorPipelineTest, StepsOfOneCacheAndLayerShareALaunch) {
  PagedRecorder backend;
  ExecutorOptions options;
  options.batching = true;
  Executor executor(&backend, options);
  Completions c;
  int cache_a = 0, cache_b = 0;
  std::vector<PagedStep> steps(6);
  for (int i = 0; i < 6; ++i) steps[size_t(i)].tag = i;
  backend.SetOpen(false);
  ASSERT_TRUE(executor.Submit(StepItem(&steps[0], &cache_a, 0, "a", &c)).ok());
  backend.AwaitLaunches(1);  // held: the rest queue behind it
  ASSERT_TRUE(executor.Submit(StepItem(&steps[1], &cache_a, 0, "a", &c)).ok());
  ASSERT_TRUE(executor.Submit(StepItem(&steps[2], &cache_a, 0, "b", &c)).ok());
  ASSERT_TRUE(executor.Submit(StepItem(&steps[3], &cache_a, 1, "a", &c)).ok());
  ASSERT_TRUE(executor.Submit(StepItem(&steps[4], &cache_b, 0, "a", &c)).ok());
  ASSERT_TRUE(executor.Submit(StepItem(&steps[5], &cache_a, 0, "c", &c)).ok());
  backend.SetOpen(true);
  std::vector<Result> results = c.Await(6);
  for (const Result& r : results) EXPECT_TRUE(r.status.ok()) << r.tag << ": " << r.status;
  EXPECT_EQ(backend.launches(), std::vector<std::vector<int>>({{0}, {1, 2, 5}, {3}, {4}}));
  std::map<int, int> batch_of;
  for (const Result& r : results) batch_of[r.tag] = r.timings.batch_size;
  EXPECT_EQ(batch_of, (std::map<int, int>{{0, 1}, {1, 3}, {2, 3}, {3, 1}, {4, 1}, {5, 3}}));
  EXPECT_TRUE(executor.WaitIdle(absl::Seconds(5)));
}

}  // namespace
}  // namespace attnserve
