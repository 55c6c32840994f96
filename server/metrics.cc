// ServerMetrics: counters updated on the request path, Prometheus text built
// at scrape time; see metrics.h.
#include "server/metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/malloc_tuning.h"
#include "server/executor.h"

namespace attnserve {
namespace {

constexpr char kModelLabels[] = "model=\"attention\",version=\"1\"";

void AppendModelCounter(std::string* out, const char* name, const char* help,
                        const std::atomic<int64_t>& value) {
  AppendFamily(out, name, "counter", help,
               {{kModelLabels, absl::StrCat(value.load(std::memory_order_relaxed))}});
}

}  // namespace

void AppendFamily(std::string* out, const char* name, const char* type, const char* help,
                  const std::vector<std::pair<std::string, std::string>>& samples) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  for (const auto& [labels, value] : samples) {
    absl::StrAppend(out, name, "{", labels, "} ", value, "\n");
  }
}

void ServerMetrics::SetExtraSource(std::function<std::string()> source) {
  absl::MutexLock lock(&sources_mu_);
  extra_source_ = std::move(source);
}

const char* ServerMetrics::FailureReasonName(FailureReason reason) {
  switch (reason) {
    case FailureReason::kRejected: return "REJECTED";
    case FailureReason::kCanceled: return "CANCELED";
    case FailureReason::kBackend: return "BACKEND";
    case FailureReason::kOther: break;
  }
  return "OTHER";
}

ServerMetrics::FailureReason ServerMetrics::ReasonFor(const absl::Status& status) {
  switch (status.code()) {
    // Refused at admission: queue full, over a limit, draining.
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable: return FailureReason::kRejected;
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded: return FailureReason::kCanceled;
    // The backend could not run a valid request, or failed running it.
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnknown: return FailureReason::kBackend;
    default: return FailureReason::kOther;  // INVALID_ARGUMENT and the rest
  }
}

void ServerMetrics::RecordRequest(const absl::Status& status, const WorkTimings& t) {
  last_request_ms_.store(absl::ToUnixMillis(absl::Now()), std::memory_order_relaxed);
  if (!status.ok()) {
    failure_[static_cast<int>(ReasonFor(status))].fetch_add(1, std::memory_order_relaxed);
    return;
  }
  success_.fetch_add(1, std::memory_order_relaxed);
  request_duration_us_.fetch_add(t.total_us, std::memory_order_relaxed);
  queue_duration_us_.fetch_add(t.queue_us, std::memory_order_relaxed);
  compute_input_duration_us_.fetch_add(t.host_to_device_us, std::memory_order_relaxed);
  compute_infer_duration_us_.fetch_add(t.compute_us, std::memory_order_relaxed);
  compute_output_duration_us_.fetch_add(t.device_to_host_us, std::memory_order_relaxed);
}

ServerMetrics::Counters ServerMetrics::Snapshot() const {
  Counters c;
  c.success = success_.load(std::memory_order_relaxed);
  for (const auto& f : failure_) c.failure += f.load(std::memory_order_relaxed);
  c.executions = exec_count_.load(std::memory_order_relaxed);
  c.request_us = request_duration_us_.load(std::memory_order_relaxed);
  c.queue_us = queue_duration_us_.load(std::memory_order_relaxed);
  c.compute_input_us = compute_input_duration_us_.load(std::memory_order_relaxed);
  c.compute_infer_us = compute_infer_duration_us_.load(std::memory_order_relaxed);
  c.compute_output_us = compute_output_duration_us_.load(std::memory_order_relaxed);
  c.last_request_ms = last_request_ms_.load(std::memory_order_relaxed);
  return c;
}

void ServerMetrics::SetPendingSource(std::function<int64_t()> source) {
  absl::MutexLock lock(&sources_mu_);
  pending_source_ = std::move(source);
}

void ServerMetrics::SetDevices(std::vector<DeviceDescription> devices) {
  absl::MutexLock lock(&sources_mu_);
  devices_ = std::move(devices);
}

void ServerMetrics::SetDeviceUsageSource(std::function<std::vector<DeviceUsage>()> source) {
  absl::MutexLock lock(&sources_mu_);
  usage_source_ = std::move(source);
}

std::string ServerMetrics::RenderPrometheus() const {
  std::string out;
  AppendModelCounter(&out, "nv_inference_request_success",
                     "Number of successful inference requests, all batch sizes", success_);
  std::vector<std::pair<std::string, std::string>> failures;
  for (int r = 0; r < kNumFailureReasons; ++r) {
    failures.emplace_back(
        absl::StrCat(kModelLabels, ",reason=\"", FailureReasonName(FailureReason(r)), "\""),
        absl::StrCat(failure_[r].load(std::memory_order_relaxed)));
  }
  AppendFamily(&out, "nv_inference_request_failure", "counter",
               "Number of failed inference requests, all batch sizes", failures);
  AppendModelCounter(&out, "nv_inference_count",
                     "Number of inferences performed (one per successful request)", success_);
  AppendModelCounter(&out, "nv_inference_exec_count",
                     "Number of model executions performed (backend launches; a batched launch "
                     "serves several requests)",
                     exec_count_);
  AppendModelCounter(&out, "nv_inference_request_duration_us",
                     "Cumulative inference request duration in microseconds", request_duration_us_);
  AppendModelCounter(&out, "nv_inference_queue_duration_us",
                     "Cumulative inference queuing duration in microseconds", queue_duration_us_);
  AppendModelCounter(&out, "nv_inference_compute_input_duration_us",
                     "Cumulative compute input duration in microseconds (host to device)",
                     compute_input_duration_us_);
  AppendModelCounter(&out, "nv_inference_compute_infer_duration_us",
                     "Cumulative compute inference duration in microseconds",
                     compute_infer_duration_us_);
  AppendModelCounter(&out, "nv_inference_compute_output_duration_us",
                     "Cumulative inference compute output duration in microseconds (device to "
                     "host)",
                     compute_output_duration_us_);

  // Not Triton's: stream flow control (stream_flow_control.h) over every
  // streaming RPC: ForwardStream, ModelStreamInfer and AppendAttendStream.
  const struct {
    const char* name;
    const char* type;
    const char* help;
    int64_t value;
  } stream_samples[] = {
      {"attnserve_stream_held_requests", "gauge",
       "Requests that open streams hold (read, not yet answered and sent)",
       streams_.held_requests()},
      {"attnserve_stream_held_bytes", "gauge",
       "Bytes of requests and unsent responses that open streams hold", streams_.held_bytes()},
      {"attnserve_stream_paused", "gauge", "Streams whose reading is paused at their limits",
       streams_.paused_streams()},
      {"attnserve_stream_pauses_total", "counter", "Times a stream's reading paused at its limits",
       streams_.pauses_total()},
      {"attnserve_stream_peak_bytes", "gauge",
       "The most bytes one stream has held at once since start", streams_.peak_stream_bytes()},
  };
  for (const auto& m : stream_samples) {
    AppendFamily(&out, m.name, m.type, m.help, {{"", absl::StrCat(m.value)}});
  }
  // Per tenant (server/auth/call_admission.h): what its streams hold against
  // its budget, how many are open, and how many were refused at the cap.
  std::vector<std::pair<std::string, std::string>> held, open, refused;
  for (const auto& [tenant, share] : streams_.Shares()) {
    const std::string label = absl::StrCat("tenant=\"", tenant, "\"");
    held.emplace_back(label, absl::StrCat(share->held_bytes.load(std::memory_order_relaxed)));
    open.emplace_back(label, absl::StrCat(share->streams.load(std::memory_order_relaxed)));
    refused.emplace_back(label, absl::StrCat(share->refused.load(std::memory_order_relaxed)));
  }
  AppendFamily(&out, "attnserve_tenant_stream_held_bytes", "gauge",
               "Bytes of requests and unsent responses that one tenant's streams hold", held);
  AppendFamily(&out, "attnserve_tenant_streams", "gauge", "Streams one tenant has open", open);
  AppendFamily(&out, "attnserve_tenant_streams_refused_total", "counter",
               "Streams refused at --max_streams_per_tenant", refused);
  // Not Triton's: the allocator's account of the heap, which tells a leak
  // (in use grows) from memory the allocator keeps (free grows) when RSS
  // rises (the soak test samples both; tests/soak/README.md).
  const HeapUsage heap = ReadHeapUsage();
  AppendFamily(&out, "attnserve_heap_in_use_bytes", "gauge",
               "Heap bytes allocated and not yet freed (malloc arenas and mmap'd blocks)",
               {{"", absl::StrCat(heap.in_use_bytes)}});
  AppendFamily(&out, "attnserve_heap_free_bytes", "gauge",
               "Freed heap bytes the allocator keeps in its arenas for reuse",
               {{"", absl::StrCat(heap.free_bytes)}});

  absl::MutexLock lock(&sources_mu_);
  AppendFamily(&out, "nv_inference_pending_request_count", "gauge",
               "Instantaneous number of pending requests awaiting execution per-model.",
               {{kModelLabels, absl::StrCat(pending_source_ ? pending_source_() : 0)}});
  if (extra_source_) out += extra_source_();
  if (devices_.empty()) return out;
  // Triton labels GPUs by UUID; the backend description has none, so the
  // label carries the device index.
  auto gpu_label = [](int index) { return absl::StrCat("gpu_uuid=\"GPU-", index, "\""); };
  std::vector<std::pair<std::string, std::string>> total;
  for (const DeviceDescription& d : devices_) {
    total.emplace_back(gpu_label(d.index), absl::StrCat(d.total_memory_bytes));
  }
  AppendFamily(&out, "nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes", total);
  if (!usage_source_) return out;
  std::vector<std::pair<std::string, std::string>> used, util;
  for (const DeviceUsage& u : usage_source_()) {
    used.emplace_back(gpu_label(u.index), absl::StrCat(u.memory_used_bytes));
    util.emplace_back(gpu_label(u.index), absl::StrCat(u.utilization));
  }
  AppendFamily(&out, "nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes", used);
  AppendFamily(&out, "nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)", util);
  return out;
}

}  // namespace attnserve
