// Recorder: the thread-safe tally behind each `attnctl load` step.
#include "client/cli/load_recorder.h"

#include <algorithm>
#include <cmath>

namespace attnserve {
namespace cli {

double NearestRank(const std::vector<double>& samples, double q) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t rank = static_cast<int64_t>(std::ceil(q * n));
  return samples[std::clamp<int64_t>(rank - 1, 0, n - 1)];
}

namespace {

constexpr char kClientBacklog[] = "CLIENT_BACKLOG";

}  // namespace

void Recorder::Record(const Completion& c) {
  completed_.fetch_add(1, std::memory_order_relaxed);
  if (!c.code.empty()) failed_.fetch_add(1, std::memory_order_relaxed);
  if (c.done < window_start_ || c.done > window_end_) return;
  absl::MutexLock lock(&mu_);
  if (!c.code.empty()) {
    ++errors_by_code_[c.code];
    if (first_failure_.empty() && !c.failure.empty()) first_failure_ = c.failure;
    return;
  }
  latencies_ms_.push_back(absl::ToDoubleMilliseconds(c.done - c.sent));
  const v1::ServerTiming& t =
      c.timing != nullptr ? *c.timing : v1::ServerTiming::default_instance();
  queue_us_ += t.queue_us();
  h2d_us_ += t.host_to_device_us();
  compute_us_ += t.compute_us();
  d2h_us_ += t.device_to_host_us();
  batch_size_sum_ += std::max(1, t.batch_size());
  ++requests_by_device_[t.device()];
}

void Recorder::RecordDropped() {
  completed_.fetch_add(1, std::memory_order_relaxed);
  failed_.fetch_add(1, std::memory_order_relaxed);
  const absl::Time now = absl::Now();
  if (now < window_start_ || now > window_end_) return;
  absl::MutexLock lock(&mu_);
  ++errors_by_code_[kClientBacklog];
}

void Recorder::Summarize(StepResult* r) {
  absl::MutexLock lock(&mu_);
  r->seconds = absl::ToDoubleSeconds(window_end_ - window_start_);
  const int64_t ok = static_cast<int64_t>(latencies_ms_.size());
  for (const auto& [code, n] : errors_by_code_) r->errors += n;
  r->errors_by_code = errors_by_code_;
  r->first_error = first_failure_;
  r->requests_by_device = requests_by_device_;
  r->requests = ok + r->errors;
  r->req_per_s = ok / r->seconds;
  r->tokens_per_s = r->req_per_s * tokens_per_request_;
  r->tflops = r->req_per_s * flops_per_request_ / 1e12;
  if (ok == 0) return;
  std::sort(latencies_ms_.begin(), latencies_ms_.end());
  auto pct = [&](double q) { return NearestRank(latencies_ms_, q); };
  r->p50_ms = pct(0.50);
  r->p90_ms = pct(0.90);
  r->p95_ms = pct(0.95);
  r->p99_ms = pct(0.99);
  r->max_ms = latencies_ms_.back();
  double sum = 0;
  for (double l : latencies_ms_) sum += l;
  r->mean_ms = sum / ok;
  r->queue_ms = queue_us_ / 1e3 / ok;
  r->h2d_ms = h2d_us_ / 1e3 / ok;
  r->compute_ms = compute_us_ / 1e3 / ok;
  r->d2h_ms = d2h_us_ / 1e3 / ok;
  r->mean_batch_size = static_cast<double>(batch_size_sum_) / ok;
}

}  // namespace cli
}  // namespace attnserve
