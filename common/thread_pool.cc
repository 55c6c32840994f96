// ThreadPool: see thread_pool.h.
#include "common/thread_pool.h"

namespace attnserve {

ThreadPool::ThreadPool(int num_threads) {
  for (int w = 1; w < num_threads; ++w) workers_.emplace_back([this, w] { WorkerLoop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Drain(int worker) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    (*fn_)(worker, task);
  }
}

void ThreadPool::Run(int64_t num_tasks, const std::function<void(int, int64_t)>& fn) {
  if (num_tasks <= 0) return;
  // One task (or no workers): waking threads would only add latency.
  if (num_tasks == 1 || workers_.empty()) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(0, t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    num_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  Drain(0);
  // Workers may still be finishing their last task; fn_ must outlive them.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return busy_workers_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain(worker);
    std::lock_guard<std::mutex> lock(mu_);
    if (--busy_workers_ == 0) done_cv_.notify_one();
  }
}

}  // namespace attnserve
