// `attnctl load`'s bookkeeping: Recorder collects call completions from many
// threads and summarises one step into a StepResult (throughput, latency
// percentiles, server timing means, errors by code). It knows nothing of the
// RPC that made a call, so every loop reports through it the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {
namespace cli {

// Nearest-rank percentile of sorted, non-empty `samples`: the smallest sample
// with at least the fraction q of the samples at or below it.
double NearestRank(const std::vector<double>& samples, double q);

// One call's end, whatever the RPC.
struct Completion {
  absl::Time sent;      // when it was sent (open loop: its scheduled arrival)
  absl::Time done;      // when its answer arrived
  std::string code;     // "" on success, else a status code name or CHECK_FAILED
  std::string failure;  // "CODE: message" when `code` is set
  const v1::ServerTiming* timing = nullptr;  // the server's timing, on success
};

// One step's results, as reported and written to CSV/JSON.
struct StepResult {
  std::string mode;  // "closed" or "open"
  int concurrency = 0;
  double rate = 0.0;
  double seconds = 0.0;
  int64_t requests = 0;  // completed in the window, failed or not
  int64_t errors = 0;
  std::map<std::string, int64_t> errors_by_code;
  double req_per_s = 0.0, tokens_per_s = 0.0, tflops = 0.0;
  double p50_ms = 0, p90_ms = 0, p95_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  // Means over successful responses of the server's timing, in ms.
  double queue_ms = 0, h2d_ms = 0, compute_ms = 0, d2h_ms = 0;
  double mean_batch_size = 0;  // requests per backend launch, as the server reports
  // Successful responses by the device that ran them (ServerTiming.device).
  std::map<int, int64_t> requests_by_device;
  std::string first_error;
};

// Collects completions from many threads. Only those ending inside the
// measurement window count; everything counts toward the progress line.
class Recorder {
 public:
  // `tokens_per_request` and `flops_per_request` turn req/s into tokens/s
  // and TFLOP/s.
  Recorder(absl::Time window_start, absl::Time window_end, int64_t tokens_per_request,
           double flops_per_request)
      : window_start_(window_start),
        window_end_(window_end),
        tokens_per_request_(tokens_per_request),
        flops_per_request_(flops_per_request) {}

  void Record(const Completion& c);
  // An arrival the client could not send (open loop, too many in flight).
  void RecordDropped();

  int64_t completed() const { return completed_.load(std::memory_order_relaxed); }
  int64_t failed() const { return failed_.load(std::memory_order_relaxed); }

  // Fills the measured fields of `r` (not mode, concurrency or rate).
  void Summarize(StepResult* r);

 private:
  const absl::Time window_start_, window_end_;
  const int64_t tokens_per_request_;
  const double flops_per_request_;
  std::atomic<int64_t> completed_{0}, failed_{0};
  absl::Mutex mu_;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::string first_failure_ ABSL_GUARDED_BY(mu_);  // "CODE: message"
  int64_t queue_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t h2d_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compute_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t d2h_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t batch_size_sum_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> requests_by_device_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cli
}  // namespace attnserve
