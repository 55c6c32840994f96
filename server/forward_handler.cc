// One ForwardRequest from receipt to a filled ForwardResponse; see forward_handler.h.
#include "server/forward_handler.h"

#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "server/server_timing.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// Client errors are routine for a server; only its own failures are errors.
spdlog::level::level_enum LogLevelFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss: return spdlog::level::err;
    default: return spdlog::level::info;
  }
}

// Binds O (Q's shape, OutputDType: BF16 for FP8 inputs) and LSE into
// `response` and `params`: where lent.place_outputs puts them, else in
// freshly allocated response buffers, so the backend writes straight into the
// bytes that go on the wire. Runs on the executor's launcher thread, where a
// throw would take the server down: an allocation failure is
// RESOURCE_EXHAUSTED (DESIGN §1) and leaves nothing bound.
absl::Status BindOutputs(const v1::ForwardRequest& request, const LentMemory& lent,
                         v1::ForwardResponse* response, AttnParams* params) {
  const v1::Tensor& q = request.q();
  const DType o_dtype = OutputDType(params->dtype);
  const size_t o_bytes = static_cast<size_t>(params->total_q * params->num_heads_q *
                                             params->head_dim * DTypeSize(o_dtype));
  const bool want_lse = request.options().return_lse();
  const int64_t lse_bytes = want_lse ? LseBytes(*params) : 0;
  void* placed_o = nullptr;
  float* placed_lse = nullptr;
  if (lent.place_outputs) {
    absl::Status placed =
        lent.place_outputs(static_cast<int64_t>(o_bytes), lse_bytes, &placed_o, &placed_lse);
    if (!placed.ok()) return placed;
  }
  try {
    v1::Tensor* o = response->mutable_o();
    o->set_dtype(static_cast<v1::DType>(o_dtype));
    *o->mutable_shape() = q.shape();
    if (placed_o == nullptr) {
      o->mutable_data()->resize(o_bytes);
      placed_o = o->mutable_data()->data();
    }
    params->o = placed_o;
    params->lse = nullptr;
    if (want_lse) {
      v1::Tensor* lse = response->mutable_lse();
      ShapeLseTensor(request, *params, lse, /*with_data=*/placed_lse == nullptr);
      params->lse =
          placed_lse != nullptr ? placed_lse : reinterpret_cast<float*>(lse->mutable_data()->data());
    }
  } catch (const std::bad_alloc&) {
    response->clear_o();
    response->clear_lse();
    params->o = nullptr;
    params->lse = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("o: cannot allocate ", o_bytes, " bytes of host memory for the output",
                     request.options().return_lse() ? " and lse" : ""));
  }
  return absl::OkStatus();
}

}  // namespace

ForwardHandler::ForwardHandler(ExecutorPool* executors, std::string backend_name,
                               const RequestLimits& limits, ServerMetrics* metrics)
    : executors_(executors),
      backend_name_(std::move(backend_name)),
      limits_(limits),
      metrics_(metrics) {}

void ForwardHandler::Start(const v1::ForwardRequest* request, v1::ForwardResponse* response,
                           const std::string& tenant, absl::Time deadline, std::shared_ptr<const std::atomic<bool>> cancelled,
                           Done done, LentMemory lent) {
  const absl::Time received = absl::Now();
  auto refuse = [&](const absl::Status& status) {
    WorkTimings timings;
    timings.total_us = absl::ToInt64Microseconds(absl::Now() - received);
    Complete(*request, response, status, timings, done);
  };

  absl::StatusOr<AttnParams> params = ValidateAndFillParams(*request, limits_, lent.inputs);
  if (!params.ok()) return refuse(params.status());

  WorkItem item;
  item.params = *params;
  item.received = received;
  item.deadline = deadline;
  item.cancelled = std::move(cancelled);
  item.tenant = tenant;
  item.bind_outputs = [request, response, lent = std::move(lent)](AttnParams* p) {
    return BindOutputs(*request, lent, response, p);
  };
  item.done = [this, request, response, done](const absl::Status& status,
                                              const WorkTimings& timings) {
    Complete(*request, response, status, timings, done);
  };
  absl::Status admitted = executors_->Submit(std::move(item));
  if (!admitted.ok()) refuse(admitted);
}

void ForwardHandler::Complete(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                              const absl::Status& status, const WorkTimings& timings,
                              const Done& done) const {
  // An over-long id was refused (kMaxRequestIdBytes); its answer carries only
  // the allowed prefix, so refusing it costs no more than serving a valid one.
  response->set_request_id(request.request_id().substr(0, kMaxRequestIdBytes));
  response->set_backend(backend_name_);
  if (!status.ok()) {
    // Partial outputs are meaningless and may be large: never send them.
    response->clear_o();
    response->clear_lse();
  }
  FillServerTiming(timings, response->mutable_timing());
  if (metrics_ != nullptr) {
    metrics_->RecordRequest(status, timings.queue_us, timings.host_to_device_us, timings.compute_us,
                            timings.device_to_host_us, timings.total_us);
  }

  // Shapes, dtype and outcome only: tensor bytes never reach the log.
  spdlog::log(
      LogLevelFor(status),
      "forward id=\"{}\" q={} k={} v={} dtype={} layout={} causal={} lse={} status={}{}{} "
      "device={} batch={} queue_us={} compute_us={} total_us={}",
      request.request_id().substr(0, kMaxLoggedIdChars), ShapeString(request.q().shape(), ","),
      ShapeString(request.k().shape(), ","), ShapeString(request.v().shape(), ","),
      v1::DType_Name(request.q().dtype()), request.cu_seqlens_q_size() > 0 ? "varlen" : "dense",
      request.options().causal(), request.options().return_lse(),
      absl::StatusCodeToString(status.code()),
      status.ok() ? "" : " error=", status.ok() ? std::string() : std::string(status.message()),
      timings.device, timings.batch_size, timings.queue_us, timings.compute_us, timings.total_us);
  done(status);
}

}  // namespace attnserve
