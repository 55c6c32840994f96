// Dispatch by queued work over one executor per device; see executor_pool.h.
#include "server/executor_pool.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "server/metrics.h"

namespace attnserve {

ExecutorPool::ExecutorPool(const std::vector<AttentionBackend*>& backends,
                           const ExecutorOptions& options)
    : tokens_per_launch_(options.batching ? std::max<int64_t>(1, options.batch_max_tokens) : 0) {
  for (AttentionBackend* b : backends) {
    ExecutorOptions o = options;
    const std::vector<DeviceDescription>& devices = b->Describe().devices;
    o.device = devices.empty() ? 0 : devices.front().index;
    executors_.push_back(std::make_unique<Executor>(b, o));
  }
}

int ExecutorPool::Pick(int64_t tokens) const {
  const int n = size();
  // Loads are read without a lock: two requests arriving together may pick
  // the same device, which the next arrivals even out. Devices are scanned
  // from the one after the last chosen, so equal loads take turns.
  const int first = (last_.load(std::memory_order_relaxed) + 1) % n;
  absl::InlinedVector<int64_t, 8> work(size_t(n), 0);
  absl::InlinedVector<bool, 8> forming(size_t(n), false);
  int least = -1;
  for (int k = 0; k < n; ++k) {
    const size_t i = size_t((first + k) % n);
    work[i] = executors_[i]->outstanding_work();
    const int64_t queued = executors_[i]->queued_tokens();
    forming[i] = tokens_per_launch_ > 0 && queued > 0 && queued + tokens <= tokens_per_launch_;
    if (least < 0 || work[i] < work[size_t(least)]) least = static_cast<int>(i);
  }
  int pick = least;
  // Not forming a batch on the least-loaded device: the least busy device
  // whose batch is forming and whose work is within kJoinSlack takes it.
  if (!forming[size_t(least)]) {
    for (int k = 0; k < n; ++k) {
      const size_t i = size_t((first + k) % n);
      if (!forming[i] || work[i] > work[size_t(least)] + kJoinSlack) continue;
      if (pick == least || work[i] < work[size_t(pick)]) pick = static_cast<int>(i);
    }
  }
  last_.store(pick, std::memory_order_relaxed);
  return pick;
}

absl::Status ExecutorPool::Submit(WorkItem item) {
  const int n = size();
  if (n == 1) return executors_.front()->Submit(std::move(item));
  const int64_t tokens = WorkItemTokens(item);
  const int best = Pick(tokens);
  // A full queue on the chosen device is not the server's limit, nor is a
  // device that stopped answering (UNAVAILABLE while Healthy() says so): the
  // others are tried in order before the request is refused.
  auto try_next = [](const absl::Status& s, const Executor& e) {
    return absl::IsResourceExhausted(s) || (absl::IsUnavailable(s) && !e.Healthy().ok());
  };
  // Offer moves the item only when admitted: no copy per device tried.
  int last = best;
  absl::Status status = executors_[size_t(best)]->Offer(&item);
  for (int i = 0; i < n && try_next(status, *executors_[size_t(last)]); ++i) {
    if (i == best) continue;
    status = executors_[size_t(i)]->Offer(&item);
    last = i;
  }
  return status;
}

void ExecutorPool::StopAdmitting() {
  for (auto& e : executors_) e->StopAdmitting();
}

bool ExecutorPool::WaitIdle(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  bool idle = true;
  for (auto& e : executors_) {
    idle = e->WaitIdle(std::max(deadline - absl::Now(), absl::ZeroDuration())) && idle;
  }
  return idle;
}

void ExecutorPool::Shutdown() {
  for (auto& e : executors_) e->Shutdown();
}

int ExecutorPool::healthy() const {
  int count = 0;
  for (const auto& e : executors_) count += e->Healthy().ok() ? 1 : 0;
  return count;
}

std::string ExecutorPool::RenderDeviceGauges() const {
  std::vector<std::pair<std::string, std::string>> health;
  for (size_t d = 0; d < executors_.size(); ++d) {
    health.emplace_back(absl::StrCat("device=\"", d, "\""),
                        executors_[d]->Healthy().ok() ? "1" : "0");
  }
  std::vector<std::pair<std::string, std::string>> samples;
  for (size_t d = 0; d < executors_.size(); ++d) {
    // Tenant names are [A-Za-z0-9._-] (the tokens file checks) or server/tenant.h's
    // fixed names: no escaping needed in a label.
    for (const auto& [tenant, depth] : executors_[d]->queued_by_tenant()) {
      samples.emplace_back(absl::StrCat("tenant=\"", tenant, "\",device=\"", d, "\""),
                           absl::StrCat(depth));
    }
  }
  std::string out;
  AppendFamily(&out, "attnserve_device_healthy", "gauge",
               "1 while the device answers; 0 after a backend call ran past --launch_timeout, "
               "until it returns.",
               health);
  AppendFamily(&out, "attnserve_tenant_queue_depth", "gauge",
               "Requests a tenant has waiting for a device (fair-share queue).", samples);
  return out;
}

int ExecutorPool::queued() const {
  int total = 0;
  for (const auto& e : executors_) total += e->queued();
  return total;
}

}  // namespace attnserve
