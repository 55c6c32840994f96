// The server's metrics registry: lock-free counters and gauges that the request
// path updates, rendered on demand as Prometheus text with Triton Inference
// Server's metric names and labels (model="attention", version="1"), so
// dashboards built for Triton read attnserve unchanged. Knows nothing about
// HTTP; metrics_http.h serves the text.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"
#include "server/stream_flow_control.h"

namespace attnserve {

struct WorkTimings;  // server/executor.h, which includes this header

// Live readings of one device, from the source set with
// ServerMetrics::SetDeviceUsageSource (the server sets NvmlMonitor,
// server/gpu_monitor.h). Without a source only nv_gpu_memory_total_bytes
// (from the description) is exported.
struct DeviceUsage {
  int index = 0;
  int64_t memory_used_bytes = 0;
  double utilization = 0.0;  // 0..1, as Triton's nv_gpu_utilization
};

class ServerMetrics {
 public:
  // Triton's failure reasons (nv_inference_request_failure{reason=...}).
  enum class FailureReason { kRejected, kCanceled, kBackend, kOther };
  static constexpr int kNumFailureReasons = 4;
  static const char* FailureReasonName(FailureReason reason);  // "REJECTED", ...
  // The reason a request that ended with `status` counts under.
  static FailureReason ReasonFor(const absl::Status& status);

  // Per finished request (success or failure), from its final status and the
  // server timing it reports (µs). Durations accumulate for successes only,
  // as Triton's do, so duration / success count is the mean.
  void RecordRequest(const absl::Status& status, const WorkTimings& timings);
  // Per backend launch, which may serve several requests (nv_inference_exec_count).
  void RecordExecution() { exec_count_.fetch_add(1, std::memory_order_relaxed); }

  // Requests admitted and not yet started (nv_inference_pending_request_count),
  // read at render time. Unset: 0.
  void SetPendingSource(std::function<int64_t()> source);
  // Devices to report (nv_gpu_memory_total_bytes); empty for the CPU backend.
  void SetDevices(std::vector<DeviceDescription> devices);
  // Live device readings (nv_gpu_memory_used_bytes, nv_gpu_utilization).
  void SetDeviceUsageSource(std::function<std::vector<DeviceUsage>()> source);

  // More families, rendered at scrape time after the request metrics (the K/V
  // pool's gauges: server/kv_service.cc).
  void SetExtraSource(std::function<std::string()> source);

  // The Prometheus text exposition format (version 0.0.4).
  std::string RenderPrometheus() const;

  // Stream flow control (every streaming RPC): what the streams hold now (the ledgers update
  // it), rendered as attnserve_stream_* gauges.
  StreamGauge& streams() { return streams_; }
  const StreamGauge& streams() const { return streams_; }
  // The request counters and summed durations (µs) as they stand, for the
  // KServe v2 ModelStatistics call (server/kserve), which reports the same
  // numbers as /metrics.
  struct Counters {
    int64_t success = 0;
    int64_t failure = 0;  // all reasons
    int64_t executions = 0;
    int64_t request_us = 0;
    int64_t queue_us = 0;
    int64_t compute_input_us = 0;
    int64_t compute_infer_us = 0;
    int64_t compute_output_us = 0;
    int64_t last_request_ms = 0;  // Unix time of the last finished request; 0: none yet
  };
  Counters Snapshot() const;

  int64_t success_count() const { return success_.load(std::memory_order_relaxed); }
  int64_t exec_count() const { return exec_count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> success_{0};  // also nv_inference_count: one inference each
  std::atomic<int64_t> failure_[kNumFailureReasons] = {};
  std::atomic<int64_t> exec_count_{0};
  StreamGauge streams_;
  std::atomic<int64_t> request_duration_us_{0};
  std::atomic<int64_t> queue_duration_us_{0};
  std::atomic<int64_t> compute_input_duration_us_{0};
  std::atomic<int64_t> compute_infer_duration_us_{0};
  std::atomic<int64_t> compute_output_duration_us_{0};
  std::atomic<int64_t> last_request_ms_{0};

  // Set once at start-up, read at scrape time: a mutex keeps them simple and
  // stays off the request path.
  mutable absl::Mutex sources_mu_;
  std::function<int64_t()> pending_source_ ABSL_GUARDED_BY(sources_mu_);
  std::vector<DeviceDescription> devices_ ABSL_GUARDED_BY(sources_mu_);
  std::function<std::vector<DeviceUsage>()> usage_source_ ABSL_GUARDED_BY(sources_mu_);
  std::function<std::string()> extra_source_ ABSL_GUARDED_BY(sources_mu_);
};

// One metric family in the Prometheus text format: "# HELP", "# TYPE" and one
// sample line per (labels, value).
void AppendFamily(std::string* out, const char* name, const char* type, const char* help,
                  const std::vector<std::pair<std::string, std::string>>& samples);

}  // namespace attnserve
