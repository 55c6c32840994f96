// The KServe v2 / Triton front-end as one object for AttnServer to own: the
// model registry (`attention`, `attention_dense`, and `attention_kv` over
// server-side K/V), the shared-memory registry, the gRPC
// service (registered on the native port) and the HTTP/REST server on a port
// of its own.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "grpcpp/impl/service_type.h"
#include "server/core/attention_runner.h"
#include "server/kserve/context.h"
#include "server/metrics.h"
#include "server/security/tls_files.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

class KserveGrpcService;
class KserveHttpServer;
class KvRunner;

struct KserveOptions {
  // Lets clients register shared-memory regions (--allow_client_shm).
  bool allow_client_shm = false;
  // How many regions may be registered at once (--max_shm_regions, ...).
  ShmLimits shm_limits;
  // HTTP/REST on http_host:http_port (0 picks a free one). Off by default
  // here so in-process servers bind nothing extra; main.cc turns it on
  // (--http_port, default 8000 as in Triton).
  bool http_enabled = false;
  std::string http_host = "0.0.0.0";
  int http_port = 8000;
  // What HTTP bodies and parsed JSON tensors may hold at once, over every
  // connection (the server's --max_buffered_bytes; 0: unbounded).
  int64_t max_buffered_bytes = 0;
  // HTTPS when set (server/security/tls_files.h); the server's TLS files.
  TlsFiles tls;
};

// What the `attention` model reports of the server's set-up.
struct KserveServerInfo {
  std::string backend;
  DType advertised_dtype = DType::kFP16;
  bool batching = false;
  absl::Duration batch_max_delay;
  int64_t max_request_bytes = 0;   // also the HTTP body limit
  absl::Duration kv_idle_timeout;  // attention_kv's config (--kv_idle_timeout)
};

class KserveFrontend {
 public:
  // `runner`, `kv_runner` and `metrics` must outlive the
  // front-end; `stream_limits` bound each ModelStreamInfer stream like every
  // other stream (stream_flow_control.h); `ready` says whether the server
  // serves.
  KserveFrontend(AttentionRunner* runner, KvRunner* kv_runner, ServerMetrics* metrics,
                 const KserveServerInfo& info, const KserveOptions& options,
                 const StreamLimits& stream_limits, std::function<bool()> ready);
  ~KserveFrontend();

  // Bearer-token authentication and tenant quotas for both transports (the
  // gRPC port authenticates before the services; HTTP in its pre-routing
  // handler). Both may be null; call before serving.
  void SetAuth(const Authenticator* auth, TenantDirectory* tenants) {
    context_.auth = auth;
    context_.tenants = tenants;
    context_.shm.set_tenants(tenants);
  }

  // The shared-memory regions clients registered, which the native API's
  // calls name too (one registry for both front-ends).
  ShmRegistry* shm_registry() { return &context_.shm; }
  // For grpc::ServerBuilder::RegisterService.
  grpc::Service* grpc_service();
  // Starts HTTP/REST when enabled. A port that cannot be bound is an error;
  // the caller decides whether to serve without it.
  absl::Status StartHttp();
  // The HTTP side's buffered bytes now and their bound, in Prometheus text.
  std::string RenderBufferedMetrics() const;
  // The bound HTTP port, 0 when off.
  int http_port() const { return http_port_.load(std::memory_order_acquire); }
  // Until every v2 call received so far has been answered; true when none is left.
  bool WaitForResponses(absl::Duration timeout) { return context_.in_flight.WaitForZero(timeout); }
  void StopHttp();

 private:
  const KserveOptions options_;
  const int64_t max_request_bytes_;
  KserveContext context_;
  std::unique_ptr<KserveGrpcService> grpc_;
  std::unique_ptr<KserveHttpServer> http_;
  std::atomic<int> http_port_{0};
};

}  // namespace attnserve
