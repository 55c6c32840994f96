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
  if (limits.max_streams_per_tenant < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_streams_per_tenant: expected >= 0 (0: no cap), got ", limits.max_streams_per_tenant));
  }
  if (limits.max_total_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_buffered_bytes: expected >= 0, got ", limits.max_total_bytes));
  }
  return absl::OkStatus();
}

namespace {
thread_local TenantStreamShare* opening_share = nullptr;

TenantStreamShare* TakeOpeningStreamShare() {
  TenantStreamShare* share = opening_share;
  opening_share = nullptr;
  return share;
}
}  // namespace

void SetOpeningStreamShare(TenantStreamShare* share) { opening_share = share; }

TenantStreamShare* StreamGauge::ShareOf(const std::string& tenant) {
  absl::MutexLock lock(&shares_mu_);
  std::unique_ptr<TenantStreamShare>& share = shares_[tenant];
  if (share == nullptr) share = std::make_unique<TenantStreamShare>();
  return share.get();
}

std::vector<std::pair<std::string, const TenantStreamShare*>> StreamGauge::Shares() const {
  absl::MutexLock lock(&shares_mu_);
  std::vector<std::pair<std::string, const TenantStreamShare*>> out;
  for (const auto& [tenant, share] : shares_) out.emplace_back(tenant, share.get());
  return out;
}

void StreamGauge::NotePeak(int64_t stream_bytes) {
  int64_t peak = peak_stream_bytes_.load(std::memory_order_relaxed);
  while (stream_bytes > peak &&
         !peak_stream_bytes_.compare_exchange_weak(peak, stream_bytes, std::memory_order_relaxed)) {
  }
}

StreamLedger::StreamLedger(const StreamLimits& limits, StreamGauge* gauge)
    : limits_(limits), gauge_(gauge), share_(TakeOpeningStreamShare()) {}

StreamLedger::~StreamLedger() {
  SetPaused(false);
  if (gauge_ != nullptr) gauge_->Add(-requests_, -bytes_);
  if (share_ != nullptr) share_->held_bytes.fetch_sub(bytes_, std::memory_order_relaxed);
}

void StreamLedger::AddRequest(int64_t bytes) {
  ++requests_;
  bytes_ += bytes;
  if (share_ != nullptr) share_->held_bytes.fetch_add(bytes, std::memory_order_relaxed);
  if (gauge_ != nullptr) {
    gauge_->Add(1, bytes);
    gauge_->NotePeak(bytes_);
  }
}

void StreamLedger::Resize(int64_t delta) {
  bytes_ += delta;
  if (share_ != nullptr) share_->held_bytes.fetch_add(delta, std::memory_order_relaxed);
  if (gauge_ != nullptr) {
    gauge_->Add(0, delta);
    gauge_->NotePeak(bytes_);
  }
}

void StreamLedger::RemoveRequest(int64_t bytes) {
  --requests_;
  bytes_ -= bytes;
  if (share_ != nullptr) share_->held_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  if (gauge_ != nullptr) gauge_->Add(-1, -bytes);
}

bool StreamLedger::Full() const {
  if (requests_ >= limits_.max_pending_requests || bytes_ >= limits_.max_pending_bytes) return true;
  // Server-wide and per tenant: only a stream that holds something pauses,
  // since only its own answers can resume it; each stream may thus hold one
  // request (and its response) beyond either budget.
  if (requests_ == 0) return false;
  if (share_ != nullptr) {
    const int64_t budget = share_->budget.load(std::memory_order_relaxed);
    if (budget > 0 && share_->held_bytes.load(std::memory_order_relaxed) >= budget) return true;
  }
  return gauge_ != nullptr && limits_.max_total_bytes > 0 &&
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
