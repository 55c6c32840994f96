// One AttentionCall from receipt to completion; see attention_runner.h.
#include "server/core/attention_runner.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "server/core/call_log.h"
#include "server/in_flight.h"
#include "spdlog/spdlog.h"

namespace attnserve {

AttentionRunner::AttentionRunner(ExecutorPool* executors, std::string backend_name,
                                 const RequestLimits& limits, ServerMetrics* metrics)
    : executors_(executors),
      backend_name_(std::move(backend_name)),
      limits_(limits),
      metrics_(metrics) {}

void AttentionRunner::Start(const AttentionCall* call, const FieldNames& names, Done done) {
  // Nothing may escape to the front-end's reactor: a throw after `done` was
  // handed on completes the call here, and a late completion is dropped.
  const Once<const absl::Status&, const WorkTimings&> once(std::move(done));
  auto refuse = [&](const absl::Status& status) {
    WorkTimings timings;
    timings.total_us = absl::ToInt64Microseconds(absl::Now() - call->meta.received);
    Complete(*call, names, status, timings, once.Callback());
  };
  try {
    StartOrThrow(call, names, once.Callback());
  } catch (...) {
    if (!once.ran()) refuse(StatusOfException(std::current_exception(), "forward"));
  }
}

void AttentionRunner::StartOrThrow(const AttentionCall* call, const FieldNames& names, Done done) {
  auto refuse = [&](const absl::Status& status) {
    WorkTimings timings;
    timings.total_us = absl::ToInt64Microseconds(absl::Now() - call->meta.received);
    Complete(*call, names, status, timings, done);
  };
  absl::StatusOr<AttnParams> params = ValidateAttentionCall(*call, limits_, names);
  if (!params.ok()) return refuse(params.status());
  // The score modifiers' arrays are read on the host (checks, packing).
  if (call->mods.bias.device != kHostMemory || call->mods.mask.device != kHostMemory) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        call->mods.bias.device != kHostMemory ? names.bias : names.mask,
        ": expected host memory (a message or a system shared-memory region), got device ",
        std::max(call->mods.bias.device, call->mods.mask.device), " memory")));
  }

  WorkItem item;
  item.params = *params;
  // Device-resident inputs (CUDA regions): the backend reads them where they lie.
  item.params.devices.q = call->q.device;
  item.params.devices.k = call->k.device;
  item.params.devices.v = call->v.device;
  item.received = call->meta.received;
  item.deadline = call->meta.deadline;
  item.cancelled = call->meta.cancelled;
  item.tenant = call->meta.tenant;
  item.bind_outputs = [call](AttnParams* p) -> absl::Status {
    const OutputLayout layout =
        OutputLayoutOf(*p, call->q.shape, call->q.shape.size() == 4, call->options.return_lse);
    void* o = nullptr;
    float* lse = nullptr;
    RETURN_IF_ERROR(call->sink(layout, &o, &lse));
    p->o = o;
    p->lse = layout.lse_shape.empty() ? nullptr : lse;
    p->devices.o = call->output_devices.o;
    p->devices.lse = p->lse != nullptr ? call->output_devices.lse : kHostMemory;
    return absl::OkStatus();
  };
  item.done = [this, call, &names, done](const absl::Status& status, const WorkTimings& timings) {
    Complete(*call, names, status, timings, done);
  };
  absl::Status admitted = executors_->Submit(std::move(item));
  if (!admitted.ok()) refuse(admitted);
}

void AttentionRunner::Complete(const AttentionCall& call, const FieldNames& names,
                               const absl::Status& status, const WorkTimings& timings,
                               const Done& done) const {
  if (metrics_ != nullptr) metrics_->RecordRequest(status, timings);
  const spdlog::level::level_enum level = CallLogLevel(status);
  if (spdlog::should_log(level)) {
    // Shapes, dtype and outcome only: tensor bytes never reach the log.
    spdlog::log(
        level,
        "forward id=\"{}\" q={} k={} v={} dtype={} layout={} causal={} lse={} status={}{}{} "
        "device={} batch={} queue_us={} compute_us={} total_us={}",
        call.meta.id.substr(0, kMaxLoggedIdChars), ShapeString(call.q.shape, ","),
        ShapeString(call.k.shape, ","), ShapeString(call.v.shape, ","),
        names.dtype_name(call.q.dtype), call.cu_seqlens_q.empty() ? "dense" : "varlen",
        call.options.causal, call.options.return_lse, absl::StatusCodeToString(status.code()),
        status.ok() ? "" : " error=", status.ok() ? std::string() : std::string(status.message()),
        timings.device, timings.batch_size, timings.queue_us, timings.compute_us, timings.total_us);
  }
  done(status, timings);
}

}  // namespace attnserve
