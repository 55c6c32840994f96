// The native API front-end: attnserve.v1.Attention on gRPC's callback API.
// Reactors decode each request into the core's AttentionCall, hand it to the
// AttentionRunner (and so the executor) and encode its completion; they never
// block a gRPC thread. Echo, the transport ceiling for benchmarks, answers on
// the spot after the same checks.
#pragma once

#include <atomic>

#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/backend.h"
#include "server/auth/authenticator.h"
#include "server/auth/tenants.h"
#include "server/core/attention_runner.h"
#include "server/in_flight.h"
#include "server/shm/shm_registry.h"
#include "server/stream_flow_control.h"

namespace attnserve {

// What GetServerInfo reports besides the backend's own description, and how
// much one ForwardStream may hold (stream_flow_control.h).
struct ServiceInfo {
  int64_t max_request_bytes = 0;
  int64_t max_tokens = 0;
  int max_queue_size = 0;
  StreamLimits stream_limits;
  StreamGauge* stream_gauge = nullptr;  // server-wide totals; may be null
  // The K/V cache service (GetServerInfo's kv and the "kv_cache" feature).
  bool kv_cache = false;
  int kv_default_page_size = 0;
  int64_t kv_cache_bytes = 0;
  int64_t kv_idle_timeout_ms = 0;
  // Per-tenant quotas (server/auth/tenants.h): each request's bytes are
  // charged to its tenant while it runs. Null: authentication off.
  TenantDirectory* tenants = nullptr;
  // Who the calls are (server/tenant.h); null when authentication is off.
  const Authenticator* auth = nullptr;
  // The UCX step port once bound (KvInfo.ucx_port, the "ucx" feature); may be null.
  const std::atomic<int>* ucx_port = nullptr;
};

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // `runner` must outlive the service. `backend` describes what serves
  // (with several GPUs, every device is listed).
  AttentionService(AttentionRunner* runner, BackendDescription backend, const ServiceInfo& info);

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;

  grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* ForwardStream(
      grpc::CallbackServerContext* context) override;

  // Forward's validation and limits, then q's bytes back as o; never reaches
  // the executor or the backend (see attention.proto).
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context,
                                 const v1::ForwardRequest* request,
                                 v1::ForwardResponse* response) override;

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;

  // The shared-memory regions q, k, v and output_shm may name (shm_tensors.h);
  // null: such calls are FAILED_PRECONDITION. Set before serving.
  void set_shm(const ShmRegistry* shm) { shm_ = shm; }

  // Waits until every Forward and Echo call and every ForwardStream request
  // received so far has had its response sent (or its call has ended). True
  // when none is left.
  bool WaitForResponses(absl::Duration timeout) { return in_flight_.WaitForZero(timeout); }

 private:
  AttentionRunner* const runner_;
  const BackendDescription backend_;
  const ServiceInfo info_;
  const ShmRegistry* shm_ = nullptr;
  InFlightCounter in_flight_;
};

// The capabilities GetServerInfo lists under `features`.
const std::vector<std::string>& ServerFeatures();

}  // namespace attnserve
