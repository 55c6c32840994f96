// The K/V front-end: attnserve.v1.KvCache (kv.proto) on gRPC's callback API,
// on the same port as Attention. Thin: decode, validate (naming wire fields),
// hand to the pool (server/kv/kv_pool.h), map the status in one place
// (common/grpc_status.h). Cache bookkeeping answers on the gRPC thread (a short
// lock, no waiting); AppendAttend goes through the cache device's executor.
#pragma once

#include <atomic>
#include <string>

#include "attnserve/v1/kv.grpc.pb.h"
#include "server/auth/authenticator.h"
#include "server/in_flight.h"
#include "server/kv/kv_pool.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/stream_flow_control.h"

namespace attnserve {

// The metadata header every K/V call should carry with its cache id, for
// proxy affinity (kv.proto). The server does not require it.
inline constexpr char kCacheIdHeader[] = "x-attnserve-cache-id";

class KvService final : public v1::KvCache::CallbackService {
 public:
  // `pool` and `metrics` (may be null) must outlive the service;
  // `stream_limits` bound each AppendAttendStream (stream_flow_control.h).
  KvService(KvPool* pool, std::string backend_name, const RequestLimits& limits,
            ServerMetrics* metrics, const StreamLimits& stream_limits);

  grpc::ServerUnaryReactor* CreateCache(grpc::CallbackServerContext* context,
                                        const v1::CreateCacheRequest* request,
                                        v1::CreateCacheResponse* response) override;
  grpc::ServerUnaryReactor* DropCache(grpc::CallbackServerContext* context,
                                      const v1::DropCacheRequest* request,
                                      v1::DropCacheResponse* response) override;
  grpc::ServerUnaryReactor* CreateSequences(grpc::CallbackServerContext* context,
                                            const v1::CreateSequencesRequest* request,
                                            v1::CreateSequencesResponse* response) override;
  grpc::ServerUnaryReactor* AppendAttend(grpc::CallbackServerContext* context,
                                         const v1::AppendAttendRequest* request,
                                         v1::AppendAttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AppendAttendRequest, v1::AppendAttendResponse>* AppendAttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Truncate(grpc::CallbackServerContext* context,
                                     const v1::TruncateRequest* request,
                                     v1::TruncateResponse* response) override;
  grpc::ServerUnaryReactor* FreeSequences(grpc::CallbackServerContext* context,
                                          const v1::FreeSequencesRequest* request,
                                          v1::FreeSequencesResponse* response) override;
  grpc::ServerUnaryReactor* GetCacheStats(grpc::CallbackServerContext* context,
                                          const v1::GetCacheStatsRequest* request,
                                          v1::GetCacheStatsResponse* response) override;

  // Who the calls are (server/tenant.h); null (the default) when
  // authentication is off. Set before serving.
  void set_auth(const Authenticator* auth) { auth_ = auth; }

  // New calls answer UNAVAILABLE from now on; admitted ones finish.
  void StopAdmitting() { draining_.store(true, std::memory_order_release); }
  // Waits until every admitted AppendAttend (unary or stream request) has had
  // its response sent. True when none is left.
  bool WaitForResponses(absl::Duration timeout) { return in_flight_.WaitForZero(timeout); }

  // The pool's gauges in Prometheus text (ServerMetrics::SetExtraSource).
  static std::string RenderMetrics(const KvPoolStats& stats);

  using Done = std::function<void(const absl::Status& status)>;
  // Decode, validate, submit one append-and-attend; `done` exactly once.
  // `request` and `response` must stay valid until then. The KServe v2 model
  // attention_kv (server/kserve/attention_kv_model.h) calls it too, so both
  // protocols share validation, limits, draining, metrics and messages; it
  // passes check_lengths false when its request names no expected_length (the
  // steps then append at whatever length arrival order left, kAnyLength).
  void StartAppendAttend(const std::string& tenant, absl::Time deadline,
                         const v1::AppendAttendRequest* request, v1::AppendAttendResponse* response,
                         std::shared_ptr<const std::atomic<bool>> cancelled, Done done,
                         bool check_lengths = true);
  // UNAVAILABLE while draining, else OK.
  absl::Status Draining() const;

 private:
  KvPool* const pool_;
  const std::string backend_name_;
  const RequestLimits limits_;
  const StreamLimits stream_limits_;
  ServerMetrics* const metrics_;
  const Authenticator* auth_ = nullptr;
  std::atomic<bool> draining_{false};
  InFlightCounter in_flight_;
};

}  // namespace attnserve
