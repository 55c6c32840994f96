// Least-loaded dispatch over one executor per device; see executor_pool.h.
#include "server/executor_pool.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"

namespace attnserve {

ExecutorPool::ExecutorPool(const std::vector<AttentionBackend*>& backends,
                           const ExecutorOptions& options)
    // Without batching every request is its own launch: plain least tokens.
    : tokens_per_launch_(options.batching ? std::max<int64_t>(1, options.batch_max_tokens) : 1) {
  for (AttentionBackend* b : backends) {
    ExecutorOptions o = options;
    const std::vector<DeviceDescription>& devices = b->Describe().devices;
    o.device = devices.empty() ? 0 : devices.front().index;
    executors_.push_back(std::make_unique<Executor>(b, o));
  }
}

absl::Status ExecutorPool::Submit(WorkItem item) {
  const int n = size();
  if (n == 1) return executors_.front()->Submit(std::move(item));
  // Loads are read without a lock: two requests arriving together may pick
  // the same device, which the next arrivals even out.
  int best = 0;
  int64_t best_load = executors_[0]->outstanding_tokens() / tokens_per_launch_;
  for (int i = 1; i < n && best_load > 0; ++i) {
    const int64_t load = executors_[i]->outstanding_tokens() / tokens_per_launch_;
    if (load < best_load) {
      best = i;
      best_load = load;
    }
  }
  // A full queue on the chosen device is not the server's limit, nor is a
  // device that stopped answering (UNAVAILABLE while Healthy() says so): the
  // others are tried in order before the request is refused. (Small requests
  // count as no load, so they all pick device 0 until its queue fills.)
  auto try_next = [](const absl::Status& s, const Executor& e) {
    return absl::IsResourceExhausted(s) || (absl::IsUnavailable(s) && !e.Healthy().ok());
  };
  int last = best;
  absl::Status status = executors_[best]->Submit(item);
  for (int i = 0; i < n && try_next(status, *executors_[last]); ++i) {
    if (i == best) continue;
    status = executors_[i]->Submit(item);
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
