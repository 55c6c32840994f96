// Runs one native-API (attnserve.v1) ForwardRequest: validation, admission to
// the executor, output allocation, the ForwardResponse and the one log line per
// request. Shared by the unary Forward and the ForwardStream reactors, which
// only decide how the finished response travels.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/backend.h"
#include "server/executor.h"
#include "server/executor_pool.h"
#include "server/metrics.h"
#include "server/request_validation.h"

namespace attnserve {

// Memory outside the messages that a front-end lends one request (the
// KServe v2 front-end's shared-memory regions): inputs read where they lie,
// outputs written where the client asked for them, so a request's tensors are
// never copied into or out of request-sized buffers. The lender keeps the
// memory valid until the request's `done` has run.
struct LentMemory {
  LentInputs inputs;
  // Runs on the executor once the request is valid, just before compute, with
  // o's and lse's byte counts (lse 0 unless return_lse): sets *o and *lse to
  // where the backend writes them, or leaves either null for the response's
  // own buffer (the response's tensor then has its dtype and shape but no
  // data). An error fails the request before compute. Unset: the response.
  std::function<absl::Status(int64_t o_bytes, int64_t lse_bytes, void** o, float** lse)>
      place_outputs;
};

// Request ids are client-chosen; a log line keeps at most this many of their
// characters, so it stays one short line whatever they send.
inline constexpr size_t kMaxLoggedIdChars = 128;

class ForwardHandler {
 public:
  // Called exactly once per request with its final status. On OK the response
  // holds o (and lse), timing, backend and request_id; otherwise request_id,
  // timing and backend only (the caller decides how to report the error).
  using Done = std::function<void(const absl::Status& status)>;

  // `executors` (and `metrics`, which records every finished request when
  // set) must outlive the handler.
  ForwardHandler(ExecutorPool* executors, std::string backend_name, const RequestLimits& limits,
                 ServerMetrics* metrics = nullptr);

  // Starts `request`. `request` and `response` must stay valid until `done`
  // runs, which may happen before Start returns (a refused request) or later on
  // the executor's thread. Never blocks. `tenant` (tenant.h) is whom the
  // device's fair share is counted for. `lent` (LentMemory) replaces the
  // request's tensor bytes and the response's output buffers where it says.
  void Start(const v1::ForwardRequest* request, v1::ForwardResponse* response,
             const std::string& tenant, absl::Time deadline,
             std::shared_ptr<const std::atomic<bool>> cancelled, Done done,
             LentMemory lent = {});

  const RequestLimits& limits() const { return limits_; }

 private:
  // Fills the parts of `response` every outcome has, logs the request line and
  // calls `done`.
  void Complete(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                const absl::Status& status, const WorkTimings& timings, const Done& done) const;

  ExecutorPool* const executors_;
  const std::string backend_name_;
  const RequestLimits limits_;
  ServerMetrics* const metrics_;
};

}  // namespace attnserve
