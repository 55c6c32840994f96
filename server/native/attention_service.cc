// Reactors for Forward, ForwardStream, Echo and GetServerInfo; see attention_service.h.
#include "server/native/attention_service.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backend/check_params.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/call_deadline.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"
#include "server/native/shm_calls.h"
#include "server/stream_reactor.h"
#include "server/tenant.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// Decodes `request` (reading its shared-memory spans from `shm`'s regions),
// holds its bytes against the tenant's quota and starts it on `runner`;
// `done` runs once the response is complete. `request` and `response` stay
// valid until then.
void StartForward(AttentionRunner* runner, TenantDirectory* tenants, const ShmRegistry* shm,
                  CallMeta meta, const v1::ForwardRequest* request, v1::ForwardResponse* response,
                  std::function<void(const absl::Status&)> done) {
  // The call and its regions live until its completion has run (the
  // completion holds them).
  auto call = std::make_shared<AttentionCall>(ForwardCallOf(*request, response, std::move(meta)));
  auto regions = std::make_shared<ShmCall>(shm, call->meta.tenant);
  std::function<void(const absl::Status&, const WorkTimings&)> finish =
      [runner, request, response, call, regions, done = std::move(done)](
          const absl::Status& status, const WorkTimings& timings) {
        // A region its owner shrank while the call ran fails the call.
        const absl::Status result = status.ok() ? regions->CheckIntact() : status;
        FinishForwardResponse(*request, result, timings, runner->backend_name(), response);
        done(result);
      };
  absl::Status decoded = ForwardShmInputs(*request, ShmRead::kInPlace, regions.get(), call.get());
  if (decoded.ok()) decoded = BindForwardShmOutputs(*request, response, regions.get(), call.get());
  const absl::Status held =
      decoded.ok() ? HoldInFlight(tenants, call->meta.tenant, call->request_bytes, &finish)
                   : decoded;
  if (!held.ok()) {
    WorkTimings timings;
    timings.total_us = absl::ToInt64Microseconds(absl::Now() - call->meta.received);
    return finish(held, timings);
  }
  runner->Start(call.get(), NativeFieldNames(), std::move(finish));
}

// Unary Forward: the runner's completion finishes the RPC with the mapped status.
class ForwardReactor final : public grpc::ServerUnaryReactor {
 public:
  ForwardReactor(AttentionRunner* runner, InFlightCounter* in_flight, TenantDirectory* tenants,
                 const ShmRegistry* shm, const Authenticator* auth,
                 const grpc::CallbackServerContext* context, const v1::ForwardRequest* request,
                 v1::ForwardResponse* response)
      : in_flight_(in_flight), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    // Finish may run before this constructor returns (a refused request);
    // the callback API holds it until the reactor is bound to the call. A
    // throw finishes the call with its status instead of escaping to gRPC.
    try {
      StartForward(runner, tenants, shm,
                   CallMetaOf(TenantOf(auth, context), DeadlineOf(context), cancelled_), request,
                   response, [this](const absl::Status& status) { FinishOnce(status); });
    } catch (...) {
      FinishOnce(StatusOfException(std::current_exception(), "Forward"));
    }
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override { delete this; }

 private:
  void FinishOnce(const absl::Status& status) {
    if (!finished_.exchange(true, std::memory_order_acq_rel)) Finish(ToGrpcStatus(status));
  }

  InFlightCounter::Hold in_flight_;  // from construction to OnDone
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  std::atomic<bool> finished_{false};
};

// Echo's answer to a request: Forward's checks (so the same INVALID_ARGUMENT
// and RESOURCE_EXHAUSTED), then o = q and, with return_lse, a zero LSE of the
// shape Forward returns (dense [B, Hq, Sq], varlen [Hq, Tq]). Spans of
// shared memory are read and written as Forward's are (a CUDA region's
// bytes through the host).
absl::Status FillEcho(const v1::ForwardRequest& request, const RequestLimits& limits, ShmCall* shm,
                      v1::ForwardResponse* response) {
  AttentionCall call = ForwardCallOf(request, response, CallMeta{});
  RETURN_IF_ERROR(ForwardShmInputs(request, ShmRead::kHostInPlace, shm, &call));
  absl::StatusOr<AttnParams> params = ValidateAttentionCall(call, limits, NativeFieldNames());
  if (!params.ok()) return params.status();
  std::optional<ShmOutput> o, lse;
  if (request.has_output_shm()) {
    const v1::OutputRegions& out = request.output_shm();
    if (out.has_lse() && !call.options.return_lse) {
      return absl::InvalidArgumentError(
          "output_shm.lse: expected only with options.return_lse (there is no lse to write)");
    }
    if (out.has_o()) {
      ASSIGN_OR_RETURN(o, shm->Output("output_shm.o", out.o()));
      RETURN_IF_ERROR(
          CheckOutputSize("output_shm.o", out.o(), static_cast<int64_t>(call.q.bytes.size())));
    }
    if (out.has_lse()) {
      ASSIGN_OR_RETURN(lse, shm->Output("output_shm.lse", out.lse()));
    }
  }
  const std::vector<int64_t> q_shape(call.q.shape.begin(), call.q.shape.end());
  if (o.has_value()) {
    RETURN_IF_ERROR(o->span.region->Write(o->offset, call.q.bytes.data(), call.q.bytes.size()));
    ShapeSharedTensor(call.q.dtype, q_shape, *o->ref, response->mutable_o());
  } else {
    v1::Tensor* out = response->mutable_o();
    out->set_dtype(request.q().dtype());
    *out->mutable_shape() = request.q().shape();
    out->set_data(std::string(call.q.bytes));
  }
  if (call.options.return_lse) {
    const OutputLayout layout = OutputLayoutOf(*params, call.q.shape, call.q.shape.size() == 4,
                                               /*return_lse=*/true);
    if (lse.has_value()) {
      RETURN_IF_ERROR(CheckOutputSize("output_shm.lse", *lse->ref, layout.lse_bytes));
      const std::string zeros(static_cast<size_t>(layout.lse_bytes), '\0');
      RETURN_IF_ERROR(lse->span.region->Write(lse->offset, zeros.data(), zeros.size()));
      ShapeSharedTensor(static_cast<int>(DType::kFP32), layout.lse_shape, *lse->ref,
                        response->mutable_lse());
    } else {
      ShapeFloatTensor(layout.lse_shape, layout.lse_bytes, response->mutable_lse());
    }
  }
  return absl::OkStatus();
}

// Unary Echo: answered on the gRPC thread that delivered the request, since
// there is nothing to wait for (validation and one copy of q). Not counted in
// the nv_inference_* metrics, which describe attention work (ServerMetrics is
// fed by the AttentionRunner and the executor only); it does count as in flight,
// so a drain waits for its response to be sent.
class EchoReactor final : public grpc::ServerUnaryReactor {
 public:
  EchoReactor(const RequestLimits& limits, const std::string& backend_name,
              InFlightCounter* in_flight, TenantDirectory* tenants, const ShmRegistry* shm,
              const std::string& tenant, const v1::ForwardRequest* request,
              v1::ForwardResponse* response)
      : in_flight_(in_flight) {
    absl::Status status;
    try {
      status = Answer(limits, backend_name, tenants, shm, tenant, request, response);
    } catch (...) {
      status = StatusOfException(std::current_exception(), "Echo");
    }
    Finish(ToGrpcStatus(status));
  }

  void OnDone() override { delete this; }

 private:
  static absl::Status Answer(const RequestLimits& limits, const std::string& backend_name,
                             TenantDirectory* tenants, const ShmRegistry* shm,
                             const std::string& tenant, const v1::ForwardRequest* request,
                             v1::ForwardResponse* response) {
    const absl::Time received = absl::Now();
    // Echo holds nothing past this constructor: the quota is checked, not held.
    std::function<void()> nothing = [] {};
    absl::Status status =
        HoldInFlight(tenants, tenant, static_cast<int64_t>(request->ByteSizeLong()), &nothing);
    ShmCall regions(shm, tenant);
    if (status.ok()) status = FillEcho(*request, limits, &regions, response);
    if (!status.ok()) {
      response->clear_o();
      response->clear_lse();
    }
    // At most kMaxRequestIdBytes back, as Forward does.
    response->set_request_id(request->request_id().substr(0, kMaxRequestIdBytes));
    response->set_backend(backend_name);  // FillEcho sets o and lse only on success
    const int64_t total_us = absl::ToInt64Microseconds(absl::Now() - received);
    response->mutable_timing()->set_total_us(total_us);
    // Echo measures the transport ceiling: no log strings are built unless
    // debug logging is on.
    if (spdlog::should_log(spdlog::level::debug)) {
      spdlog::debug("echo id=\"{}\" q=[{}] status={} total_us={}",
                    request->request_id().substr(0, kMaxLoggedIdChars),
                    absl::StrJoin(request->q().shape(), ","),
                    absl::StatusCodeToString(status.code()), total_us);
    }
    return status;
  }

  InFlightCounter::Hold in_flight_;  // from construction to OnDone
};

using ForwardStreamReactor = PipelinedStreamReactor<v1::ForwardRequest, v1::ForwardResponse>;

// ForwardStream (server/stream_reactor.h): every request goes to the runner;
// a failed one becomes a response with error_code/error_message. The stream
// is bounded by `limits` (stream_flow_control.h).
ForwardStreamReactor* NewForwardStreamReactor(AttentionRunner* runner, InFlightCounter* in_flight,
                                              const grpc::CallbackServerContext* context,
                                              const StreamLimits& limits, StreamGauge* gauge,
                                              TenantDirectory* tenants, const ShmRegistry* shm,
                                              const Authenticator* auth) {
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto start = [runner, cancelled, deadline = DeadlineOf(context), tenants, shm,
                who = StreamTenantOf(auth, context)](ForwardStreamReactor::Call* call,
                                                     ForwardStreamReactor::Done done) {
    // A token withdrawn since the stream opened stops it, request by request.
    if (absl::Status valid = who->StillValid(); !valid.ok()) {
      call->response.set_request_id(call->request.request_id().substr(0, kMaxRequestIdBytes));
      return done(valid);
    }
    StartForward(runner, tenants, shm, CallMetaOf(who->tenant(), deadline, cancelled),
                 &call->request, &call->response, std::move(done));
  };
  auto fail = [](ForwardStreamReactor::Call* call, const absl::Status& status) {
    call->response.set_error_code(ToRpcCode(status));
    call->response.set_error_message(std::string(status.message()));
  };
  return new ForwardStreamReactor(in_flight, std::move(cancelled), std::move(start),
                                  std::move(fail), limits, gauge);
}

}  // namespace

const std::vector<std::string>& ServerFeatures() {
  static const auto* features = new std::vector<std::string>{
      "causal",     "sliding_window", "softcap", "gqa",    "mqa",       "varlen",
      "return_lse", "forward_stream", "echo",    "health", "reflection"};
  return *features;
}

AttentionService::AttentionService(AttentionRunner* runner, BackendDescription backend,
                                   const ServiceInfo& info)
    : runner_(runner), backend_(std::move(backend)), info_(info) {}

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* context,
                                                    const v1::ForwardRequest* request,
                                                    v1::ForwardResponse* response) {
  return new ForwardReactor(runner_, &in_flight_, info_.tenants, shm_, info_.auth, context, request,
                            response);
}

grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* AttentionService::ForwardStream(
    grpc::CallbackServerContext* context) {
  return NewForwardStreamReactor(runner_, &in_flight_, context, info_.stream_limits,
                                 info_.stream_gauge, info_.tenants, shm_, info_.auth);
}

grpc::ServerUnaryReactor* AttentionService::Echo(grpc::CallbackServerContext* context,
                                                 const v1::ForwardRequest* request,
                                                 v1::ForwardResponse* response) {
  // The tenant owns the regions a request names, so it is looked up whenever
  // quotas or shared memory need it.
  const bool need_tenant = info_.tenants != nullptr || (shm_ != nullptr && shm_->allowed());
  return new EchoReactor(runner_->limits(), backend_.name, &in_flight_, info_.tenants, shm_,
                         need_tenant ? TenantOf(info_.auth, context) : std::string(), request,
                         response);
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  const BackendDescription& d = backend_;
  response->set_version(ATTNSERVE_VERSION);
  response->set_backend(d.name);
  for (const DeviceDescription& device : d.devices) {
    v1::DeviceInfo* out = response->add_devices();
    out->set_index(device.index);
    out->set_name(device.name);
    out->set_compute_capability_major(device.compute_capability_major);
    out->set_compute_capability_minor(device.compute_capability_minor);
    out->set_total_memory_bytes(device.total_memory_bytes);
  }
  for (DType t : d.dtypes) response->add_dtypes(static_cast<v1::DType>(t));
  response->set_min_head_dim(d.min_head_dim);
  response->set_max_head_dim(d.max_head_dim);
  response->set_head_dim_multiple(d.head_dim_multiple);
  // MLA shapes pass the same checks on every backend (backend/check_params.h);
  // a backend without a kernel for one answers UNIMPLEMENTED naming head_dim_v.
  response->set_max_head_dim_qk(kMaxMlaHeadDimQk);
  response->set_max_head_dim_v(kMaxMlaHeadDimV);
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_request_bytes(info_.max_request_bytes);
  limits->set_max_tokens(info_.max_tokens);
  limits->set_max_queue_size(info_.max_queue_size);
  limits->set_max_stream_pending_requests(info_.stream_limits.max_pending_requests);
  limits->set_max_stream_pending_bytes(info_.stream_limits.max_pending_bytes);
  for (const std::string& f : ServerFeatures()) response->add_features(f);
  if (info_.kv_cache) {
    response->add_features("kv_cache");
    v1::KvInfo* kv = response->mutable_kv();
    for (int size = kMinPageSize; size <= kMaxPageSize; size *= 2) kv->add_page_sizes(size);
    kv->set_default_page_size(info_.kv_default_page_size);
    kv->set_cache_bytes_per_device(info_.kv_cache_bytes);
    kv->set_idle_timeout_ms(info_.kv_idle_timeout_ms);
    const int ucx_port = info_.ucx_port != nullptr ? info_.ucx_port->load() : 0;
    if (ucx_port > 0) {
      kv->set_ucx_port(ucx_port);
      response->add_features("ucx");
    }
  }
  response->set_cpu_threads(d.cpu_threads);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attnserve
