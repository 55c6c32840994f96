// Runs one AttentionCall from any front-end: the structural check (errors in
// the caller's field names), admission to a device's executor, outputs bound
// through the call's sink just before compute, the metrics and the one log
// line per call. Front-ends only decode their wire format into the call and
// encode the outcome; they never see params, plans or executors.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "server/core/call.h"
#include "server/core/field_names.h"
#include "server/core/validate.h"
#include "server/executor.h"
#include "server/executor_pool.h"
#include "server/metrics.h"

namespace attnserve {

class AttentionRunner {
 public:
  // Called exactly once per call with its final status and where its time went.
  using Done = std::function<void(const absl::Status& status, const WorkTimings& timings)>;

  // `executors` and `metrics` (may be null) must outlive the runner.
  AttentionRunner(ExecutorPool* executors, std::string backend_name, const RequestLimits& limits,
                  ServerMetrics* metrics = nullptr);

  // Starts `call`, whose views and sink stay valid until `done` has run
  // (possibly before Start returns, for a refused call; otherwise on an
  // executor thread). Never blocks. `names` must outlive the call.
  void Start(const AttentionCall* call, const FieldNames& names, Done done);

  const RequestLimits& limits() const { return limits_; }
  const std::string& backend_name() const { return backend_name_; }

 private:
  // Start without the exception boundary.
  void StartOrThrow(const AttentionCall* call, const FieldNames& names, Done done);
  // Records the call in the metrics and the log, then calls `done`.
  void Complete(const AttentionCall& call, const FieldNames& names, const absl::Status& status,
                const WorkTimings& timings, const Done& done) const;

  ExecutorPool* const executors_;
  const std::string backend_name_;
  const RequestLimits limits_;
  ServerMetrics* const metrics_;
};

}  // namespace attnserve
