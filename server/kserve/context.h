// What the KServe v2 front-end's two transports (grpc_service.h, http_service.h)
// share: the models, the shared-memory regions, readiness and the server's
// identity. Built and owned by KserveFrontend (frontend.h).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "inference/grpc_service.pb.h"
#include "server/auth/authenticator.h"
#include "server/in_flight.h"
#include "server/kserve/model.h"
#include "server/shm/shm_registry.h"
#include "server/stream_flow_control.h"

namespace attnserve {

struct KserveContext {
  explicit KserveContext(bool allow_client_shm) : shm(allow_client_shm) {}

  ModelRegistry models;
  ShmRegistry shm;
  // True while the server serves (AttnServer's state; false while starting
  // and draining).
  std::function<bool()> ready;
  // v2 calls still owed a response, so a drain waits for them.
  InFlightCounter in_flight;
  // What one ModelStreamInfer stream may hold, and the server-wide gauge
  // (may be null) its ledger updates: the same flow control as every stream.
  StreamLimits stream_limits;
  StreamGauge* stream_gauge = nullptr;
  // What HTTP request bodies and their parsed tensors may hold at once, over
  // every connection (--max_buffered_bytes; 0: unbounded).
  ByteBudget buffered;
  // Authentication and tenant quotas (server/auth/); both null when off.
  const Authenticator* auth = nullptr;
  TenantDirectory* tenants = nullptr;

  // ServerMetadata: name "attnserve", the version and the extensions offered.
  void FillServerMetadata(inference::ServerMetadataResponse* out) const;
  // ModelStatistics for `name` (every model when empty).
  absl::Status FillStatistics(const std::string& name, const std::string& version,
                              inference::ModelStatisticsResponse* out) const;
  void FillRepositoryIndex(inference::RepositoryIndexResponse* out) const;
};

}  // namespace attnserve
