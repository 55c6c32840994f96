// One Executor per backend (per GPU), and the dispatch of each request to the
// least-loaded one. With a single backend it is a thin wrapper over its
// executor.
#pragma once

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

  // Admits `item` to the least-loaded executor, load counted in full launches
  // outstanding: floor(outstanding tokens / batch_max_tokens), tokens being
  // Tq + Tk of admitted, unfinished requests. Ties go to the lowest device,
  // so small requests fill one device's batch before the next device gets
  // any (spreading them evenly would halve every batch while the GPUs idle
  // behind the transport: bench/NOTES-serving.md), while a device with a
  // launch's worth of work waiting sends the next request elsewhere. With
  // batching off a launch is one request, so the load is plain outstanding
  // tokens. A device whose queue is full passes the request on to the others;
  // RESOURCE_EXHAUSTED only when every queue is full. Same contract as
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
  // Devices whose executor is Healthy() (answering).
  int healthy() const;
  // Prometheus text: attnserve_device_healthy{device} (1 answering, 0 stopped)
  // and attnserve_tenant_queue_depth{tenant,device}: requests each tenant has
  // waiting for each device (tenants with none left out).
  std::string RenderDeviceGauges() const;

 private:
  std::vector<std::unique_ptr<Executor>> executors_;
  const int64_t tokens_per_launch_;
};

}  // namespace attnserve
