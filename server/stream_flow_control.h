// Flow control for every streaming RPC (ForwardStream, KServe ModelStreamInfer,
// K/V AppendAttendStream; all run PipelinedStreamReactor, stream_reactor.h):
// how much one stream may hold (requests read but not yet answered, and
// answers not yet sent), the per-stream ledger the stream's reactor keeps, and
// the server-wide gauge /metrics reports.
//
// Why: a client that sends many large requests and never reads its responses
// made the server hold every request and response. With a ledger, the reactor stops reading a
// stream's next request while the stream holds `max_pending_requests` requests or
// `max_pending_bytes` bytes, and reads again once responses have gone out. The
// client's further messages then wait in gRPC's HTTP/2 flow-control window (a
// few MiB at most), so what one stream holds is bounded by
//   max_pending_bytes + one request (the read that crossed the budget) + its response,
// and at most max_pending_requests requests.
//
// Per tenant: a stream opened through the call admission interceptor
// (server/auth/call_admission.h) also charges what it holds to its tenant's
// share, and pauses while the tenant's streams together hold the tenant's
// bytes_in_flight quota; so a tenant's streams hold at most that quota plus,
// per stream, one request and its response (and the tenant has at most
// --max_streams_per_tenant streams).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

struct StreamLimits {
  // Requests one stream may hold (read, and not yet answered or not yet
  // sent); reading pauses at this many.
  int max_pending_requests = 64;
  // Bytes of those requests and responses (serialized sizes); reading pauses
  // at this many. A request is released once it has been answered, so an
  // answered-but-unsent request counts only its response.
  int64_t max_pending_bytes = int64_t{256} << 20;
  // Every stream of the server together (0: unbounded; main.cc sets it from
  // --max_buffered_bytes).
  int64_t max_total_bytes = 0;
  // Streams one tenant may have open at once (0: no cap); a stream beyond it
  // is refused before any of its messages is read (server/auth/call_admission.h).
  int64_t max_streams_per_tenant = 64;
};

// A server-wide byte budget shared by callers that buffer bytes outside
// gRPC's own accounting (the HTTP front-end's bodies and parsed tensors).
// Thread-safe; lock-free.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit = 0) : limit_(limit) {}
  void set_limit(int64_t limit) { limit_.store(limit, std::memory_order_relaxed); }
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  // Charges `bytes` unless that would exceed the limit (0: unlimited).
  bool TryCharge(int64_t bytes) {
    const int64_t limit = this->limit();
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (limit > 0 && used + bytes > limit) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> limit_;
  std::atomic<int64_t> used_{0};
};

// INVALID_ARGUMENT naming the option unless both limits are > 0.
absl::Status CheckStreamLimits(const StreamLimits& limits);

// What one tenant's streams hold together (requests read and not yet
// answered, answers not yet sent), the budget they pause at (0: none) and how
// many are open. Lives as long as its gauge.
struct TenantStreamShare {
  std::atomic<int64_t> held_bytes{0};
  std::atomic<int64_t> budget{0};
  std::atomic<int64_t> streams{0};
  std::atomic<int64_t> refused{0};  // streams refused at the per-tenant limit
};

// The share the next StreamLedger built on this thread charges, taken (and
// cleared) by that ledger. The call admission interceptor sets it just before
// gRPC runs a streaming method's handler, which builds the stream's reactor
// and ledger on the same thread (gRPC runs the handler inline once every
// interceptor has proceeded).
void SetOpeningStreamShare(TenantStreamShare* share);

// Totals over every stream of one server, updated by the ledgers (lock-free)
// and read by /metrics and tests.
class StreamGauge {
 public:
  // The share of `tenant`, created on first use (tenants are the names of the
  // tokens file, or "default").
  TenantStreamShare* ShareOf(const std::string& tenant);
  // Every tenant's share, by name (for /metrics).
  std::vector<std::pair<std::string, const TenantStreamShare*>> Shares() const;

  int64_t held_requests() const { return held_requests_.load(std::memory_order_relaxed); }
  int64_t held_bytes() const { return held_bytes_.load(std::memory_order_relaxed); }
  // Streams whose reading is paused now, and pauses ever.
  int64_t paused_streams() const { return paused_streams_.load(std::memory_order_relaxed); }
  int64_t pauses_total() const { return pauses_total_.load(std::memory_order_relaxed); }
  // The most bytes one stream has held at once since the server started.
  int64_t peak_stream_bytes() const { return peak_stream_bytes_.load(std::memory_order_relaxed); }

 private:
  friend class StreamLedger;
  void Add(int64_t requests, int64_t bytes) {
    held_requests_.fetch_add(requests, std::memory_order_relaxed);
    held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void NotePeak(int64_t stream_bytes);

  std::atomic<int64_t> held_requests_{0};
  std::atomic<int64_t> held_bytes_{0};
  std::atomic<int64_t> paused_streams_{0};
  std::atomic<int64_t> pauses_total_{0};
  std::atomic<int64_t> peak_stream_bytes_{0};
  mutable absl::Mutex shares_mu_;
  std::map<std::string, std::unique_ptr<TenantStreamShare>> shares_ ABSL_GUARDED_BY(shares_mu_);
};

// One stream's ledger. Not thread-safe: the reactor calls it under its mutex.
// Every byte added is taken away again by the time the ledger is destroyed
// (the destructor gives back whatever is left, so the gauge never drifts).
class StreamLedger {
 public:
  // `gauge` may be null (no server-wide totals) and must outlive the ledger.
  StreamLedger(const StreamLimits& limits, StreamGauge* gauge);
  ~StreamLedger();
  StreamLedger(const StreamLedger&) = delete;
  StreamLedger& operator=(const StreamLedger&) = delete;

  // A request of `bytes` was read.
  void AddRequest(int64_t bytes);
  // A held request's bytes changed by `delta` (its request was released, its
  // response filled).
  void Resize(int64_t delta);
  // A request was answered and sent (or dropped); `bytes` is what it still held.
  void RemoveRequest(int64_t bytes);

  // Whether the stream holds as much as its limits allow: read no more.
  bool Full() const;
  // Records that reading paused (true) or resumed (false), for the gauge.
  void SetPaused(bool paused);
  bool paused() const { return paused_; }

  int64_t requests() const { return requests_; }
  int64_t bytes() const { return bytes_; }

 private:
  const StreamLimits limits_;
  StreamGauge* const gauge_;
  TenantStreamShare* const share_;  // null: the stream charges no tenant
  int64_t requests_ = 0;
  int64_t bytes_ = 0;
  bool paused_ = false;
};

}  // namespace attnserve
