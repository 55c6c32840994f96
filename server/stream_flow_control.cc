// StreamGauge and StreamLedger; see stream_flow_control.h.
#include "server/stream_flow_control.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status CheckStreamLimits(const StreamLimits& limits) {
  if (limits.max_pending_requests <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream_max_pending_requests: expected > 0, got ", limits.max_pending_requests));
  }
  if (limits.max_pending_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream_max_pending_bytes: expected > 0, got ", limits.max_pending_bytes));
  }
  if (limits.max_total_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_buffered_bytes: expected >= 0, got ", limits.max_total_bytes));
  }
  return absl::OkStatus();
}

void StreamGauge::NotePeak(int64_t stream_bytes) {
  int64_t peak = peak_stream_bytes_.load(std::memory_order_relaxed);
  while (stream_bytes > peak &&
         !peak_stream_bytes_.compare_exchange_weak(peak, stream_bytes, std::memory_order_relaxed)) {
  }
}

StreamLedger::StreamLedger(const StreamLimits& limits, StreamGauge* gauge)
    : limits_(limits), gauge_(gauge) {}

StreamLedger::~StreamLedger() {
  SetPaused(false);
  if (gauge_ != nullptr) gauge_->Add(-requests_, -bytes_);
}

void StreamLedger::AddRequest(int64_t bytes) {
  ++requests_;
  bytes_ += bytes;
  if (gauge_ != nullptr) {
    gauge_->Add(1, bytes);
    gauge_->NotePeak(bytes_);
  }
}

void StreamLedger::Resize(int64_t delta) {
  bytes_ += delta;
  if (gauge_ != nullptr) {
    gauge_->Add(0, delta);
    gauge_->NotePeak(bytes_);
  }
}

void StreamLedger::RemoveRequest(int64_t bytes) {
  --requests_;
  bytes_ -= bytes;
  if (gauge_ != nullptr) gauge_->Add(-1, -bytes);
}

bool StreamLedger::Full() const {
  if (requests_ >= limits_.max_pending_requests || bytes_ >= limits_.max_pending_bytes) return true;
  // Server-wide: only a stream that holds something pauses, since only its own
  // answers can resume it; each stream may thus hold one request beyond it.
  return requests_ > 0 && gauge_ != nullptr && limits_.max_total_bytes > 0 &&
         gauge_->held_bytes() >= limits_.max_total_bytes;
}

void StreamLedger::SetPaused(bool paused) {
  if (paused == paused_) return;
  paused_ = paused;
  if (gauge_ == nullptr) return;
  gauge_->paused_streams_.fetch_add(paused ? 1 : -1, std::memory_order_relaxed);
  if (paused) gauge_->pauses_total_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace attnserve
