// One Executor per backend (per GPU), and the dispatch of each request to the
// least-loaded one. With a single backend it is a thin wrapper over its
// executor.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "server/executor.h"

namespace attnserve {

class ExecutorPool {
 public:
  // How much more work (RequestCost units) a device with a forming batch may
  // hold than the least-loaded one and still take a request into that batch:
  // about a launch's fixed price, so only requests whose own cost is of that
  // order (decode steps, tiny calls) stay together; large ones spread.
  static constexpr int64_t kJoinSlack = int64_t{1} << 20;

  // One executor per backend, each with `options` and its backend's device
  // index (WorkTimings::device). The backends must outlive the pool.
  ExecutorPool(const std::vector<AttentionBackend*>& backends, const ExecutorOptions& options);

  // Admits `item` to the executor with the least queued + in-launch work,
  // work being each request's estimated device time (RequestCost: bytes moved
  // or FLOPs, whichever is larger, plus a per-request constant), so a device
  // that drains its queue sooner gets more. Equal loads go to the device after
  // the last one chosen (round robin), so under saturation every device gets
  // its share. One exception keeps small requests batching at low load: with
  // batching on, a request joins a batch already forming in another device's
  // queue (queued, not yet launched, room under batch_max_tokens) when that
  // device's work exceeds the least by at most kJoinSlack: joining saves a
  // launch and costs the request little wait. A device whose queue is full
  // passes the request on to the others; RESOURCE_EXHAUSTED only when every
  // queue is full. Same contract as Executor::Submit.
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
  // The device for an item of `tokens` rows (see Submit).
  int Pick(int64_t tokens) const;

  std::vector<std::unique_ptr<Executor>> executors_;
  // Tokens one launch packs at most; 0 with batching off (no batch forms).
  const int64_t tokens_per_launch_;
  // The device chosen last: equal loads go to the next one after it. Read
  // and written without ordering: a lost update only shifts one tie.
  mutable std::atomic<int> last_{-1};
};

}  // namespace attnserve
