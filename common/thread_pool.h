// A small fixed thread pool (the CPU backend's compute, the CUDA backend's
// staging copies): threads are created once with the backend; each Run hands
// out task indices from an atomic counter to the workers and the calling
// thread, and returns when every task has finished.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attnserve {

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the caller of Run: num_threads - 1 workers start.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(worker, task) once for every task in [0, num_tasks), spread over
  // the pool; `worker` in [0, num_threads()) identifies the calling thread
  // (for per-thread scratch). Blocks until all tasks are done. Not reentrant:
  // one Run at a time.
  void Run(int64_t num_tasks, const std::function<void(int, int64_t)>& fn);

 private:
  void WorkerLoop(int worker);
  void Drain(int worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // bumped by each Run; guarded by mu_
  int busy_workers_ = 0;     // workers inside the current Run; guarded by mu_
  bool stop_ = false;        // guarded by mu_
  const std::function<void(int, int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
};

}  // namespace attnserve
