// One Executor per backend (per GPU), and the dispatch of each request to the
// least-loaded one. With a single backend it is a thin wrapper over its
// executor.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "server/executor.h"

namespace attnserve {

class ExecutorPool {
 public:
  // One executor per backend, each with `options` and its backend's device
  // index (WorkTimings::device). The backends must outlive the pool.
  ExecutorPool(const std::vector<AttentionBackend*>& backends, const ExecutorOptions& options);

  // Admits `item` to the executor with the fewest outstanding tokens (Tq + Tk
  // of its admitted, unfinished requests), so a device busy with a long
  // request gets less new work; ties go round-robin. Same contract as
  // Executor::Submit.
  absl::Status Submit(WorkItem item);

  void StopAdmitting();
  // True when every executor went idle within `timeout` (one deadline for all).
  bool WaitIdle(absl::Duration timeout);
  void Shutdown();

  int size() const { return static_cast<int>(executors_.size()); }
  Executor& executor(int i) { return *executors_[i]; }
  // Requests queued on all executors.
  int queued() const;

 private:
  std::vector<std::unique_ptr<Executor>> executors_;
  std::atomic<unsigned> next_{0};  // where the round-robin tie-break starts
};

}  // namespace attnserve
