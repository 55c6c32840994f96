// The native K/V front-end: attnserve.v1.KvCache (kv.proto) on gRPC's
// callback API, on the same port as Attention. Thin: decode into the core's
// types, hand AppendAttend to the KvRunner (server/core/kv_runner.h) and the
// bookkeeping calls to the pool, map the status in one place
// (common/grpc_status.h). Bookkeeping answers on the gRPC thread (a short
// lock, no waiting); AppendAttend goes through the cache device's executor.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "attnserve/v1/kv.grpc.pb.h"
#include "common/cache_id_header.h"
#include "server/auth/authenticator.h"
#include "server/core/kv_runner.h"
#include "server/in_flight.h"
#include "server/kv/handoff.h"
#include "server/metrics.h"
#include "server/shm/shm_registry.h"
#include "server/stream_flow_control.h"

namespace attnserve {

struct KvStagedInputs;  // kv_messages.h

// Parses a raw AppendAttendRequest as gRPC's generated handler would (the
// same status for bytes that are none) and empties `bytes` either way, so that
// the raw bytes are released here rather than when the call is done.
grpc::Status ParseAppendAttend(grpc::ByteBuffer* bytes, v1::AppendAttendRequest* request);

// Unary AppendAttend is registered raw (bytes in, bytes out) so that its
// response's o and lse leave as slices that own them (common/
// tensor_wire_slices.h) instead of being copied into a serialized message;
// the request is parsed as gRPC would, except that q's, k's and v's bytes go
// from the received slices straight into the backend's host tensor memory
// (page-locked on CUDA: one DMA each). Every other method is typed.
class KvService final
    : public v1::KvCache::WithRawCallbackMethod_AppendAttend<v1::KvCache::CallbackService> {
 public:
  // `runner` and `metrics` (may be null) must outlive the service;
  // `stream_limits` bound each AppendAttendStream (stream_flow_control.h).
  KvService(KvRunner* runner, ServerMetrics* metrics, const StreamLimits& stream_limits);

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
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
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
  // The shared-memory regions q, k, v and output_shm may name
  // (server/native/shm_tensors.h); null: such calls are FAILED_PRECONDITION.
  // Set before serving.
  void set_shm(const ShmRegistry* shm) { shm_ = shm; }
  // --handoff_peer (server/kv/handoff.h): every call passes the gate first,
  // which may hold it (the cache is moving or being fetched) or answer it
  // (moved-to). Null (the default): no gate. Set before serving.
  void set_handoff(KvHandoffGate* gate) { gate_ = gate; }

  // Waits until every admitted AppendAttend (unary or stream request) has had
  // its response sent. True when none is left.
  bool WaitForResponses(absl::Duration timeout) { return in_flight_.WaitForZero(timeout); }

  // The pool's gauges in Prometheus text (ServerMetrics::SetExtraSource).
  static std::string RenderMetrics(const KvPoolStats& stats);

  // Decodes and starts one append-and-attend; `done` exactly once, after
  // `response` is complete. `request` and `response` stay valid until then.
  // `o_shared` (may be null): where o's bytes may go instead of response's
  // o.data (KvOutputPlace::shared; o.data is then empty), valid until `done`.
  // `staged` (may be null): q, k and v parsed out of the message
  // (ParseAppendAttendStaged), valid until `done`.
  void StartAppendAttend(CallMeta meta, const v1::AppendAttendRequest* request,
                         v1::AppendAttendResponse* response,
                         std::function<void(const absl::Status&)> done,
                         std::shared_ptr<const char>* o_shared = nullptr,
                         const KvStagedInputs* staged = nullptr);

 private:
  KvRunner* const runner_;
  KvPool* const pool_;
  const StreamLimits stream_limits_;
  ServerMetrics* const metrics_;
  const Authenticator* auth_ = nullptr;
  const ShmRegistry* shm_ = nullptr;
  KvHandoffGate* gate_ = nullptr;
  InFlightCounter in_flight_;

  // Answers a unary call through the gate: `body` runs once the call may go
  // (now, or later on another thread) and returns the call's status.
  // `read_only`: the call changes nothing (never fetched from the peer).
  grpc::ServerUnaryReactor* Gated(grpc::CallbackServerContext* context, const std::string& cache_id,
                                  bool create, std::function<absl::Status()> body,
                                  bool read_only = false);
};

}  // namespace attnserve
