// The gRPC side of --handoff_peer (server/kv/handoff.h): the channel to the
// peer replica, the push of a cache into the peer's ImportSequences, the
// fetch of a missing cache (asking the peer to give it), and the moved-to
// trailing metadata of a KvCache answer.
//
// The fetch is the peer's push: a DropCache carrying the metadata
// kHandoffGiveHeader asks the peer to move the cache here (KvHandoffGate::
// Give: its calls wait, those in flight finish, it is pushed, then dropped
// there), so no append on the peer can fall between the copy and the drop.
//
// Acting as a tenant towards the peer: a fetch runs on behalf of the call
// that missed, so it carries that call's own authorization header, and the
// peer's push back carries the same; a drain has no caller, so it uses the
// first token the shared --auth_tokens_file lists for the cache's tenant
// (TokenOfTenant). Replicas must share the file.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/auth/tenants.h"
#include "server/kv/handoff.h"
#include "server/kv/kv_pool.h"
#include "server/security/tls_files.h"
#include "server/stream_flow_control.h"

namespace attnserve {

// Adds x-attnserve-moved-to to the call's trailing metadata when `status`
// is a MovedStatus.
void AddMovedToTrailer(grpc::ServerContextBase* context, const absl::Status& status);

// The caller's authorization header ("" when it sent none or several).
std::string AuthorizationOf(const grpc::CallbackServerContext* context);

// On a DropCache from the peer: move the cache to the peer instead of only
// dropping it (value "give").
inline constexpr char kHandoffGiveHeader[] = "x-attnserve-handoff";
// True when the call carries kHandoffGiveHeader: give.
bool AsksToGive(const grpc::CallbackServerContext* context);

// The gate's counters (KvHandoffGate::Counters) as attnserve_handoff_*
// families for /metrics.
std::string RenderHandoffMetrics(const KvHandoffGate& gate);

// Chunks one push holds at most: the UCX sender's window, or the gRPC push's
// queue (4) and the chunks being read, encoded and written.
inline constexpr int kPushWindowChunks = 8;

// A push's send window, charged while the push runs: chunks are asked for at
// `chunk_target` bytes and come at most `chunk_max` (whole pages of a layer).
struct PushWindow {
  int64_t chunk_target = 0;
  int64_t chunk_max = 0;
  int64_t held = 0;  // kPushWindowChunks x chunk_max, charged
  InFlightCharge tenant;
  ByteBudget* budget = nullptr;  // charged `held` when set
  PushWindow() = default;
  PushWindow(const PushWindow&) = delete;
  PushWindow& operator=(const PushWindow&) = delete;
  ~PushWindow();
};

// Sizes the window of a push of `tenant`'s cache to what `budget` and the
// tenant's bytes_in_flight in `tenants` allow (at most the default chunk, at
// least one page; no chunk above `pages_used` pages) and charges it to both
// (either may be null), waiting for room until `deadline`. RESOURCE_EXHAUSTED
// naming max_buffered_bytes or bytes_in_flight at the deadline, or at once
// when the window is larger than the limit itself.
absl::StatusOr<std::unique_ptr<PushWindow>> ChargePushWindow(
    const std::string& tenant, const std::string& cache_id, const KvGeometry& geometry,
    int32_t page_size, int64_t pages_used, ByteBudget* budget, TenantDirectory* tenants,
    absl::Time deadline);

class KvPeer {
 public:
  // `tls`: this server's own files (TLS to the peer when tls.cert_file is
  // set); `tokens_file`: the shared --auth_tokens_file (empty: no tokens).
  // A push's send window is charged to `budget` (the server's buffered
  // bytes) and to the cache's tenant in `tenants` (bytes_in_flight) while it
  // runs; either may be null (not charged). All must outlive the peer.
  static absl::StatusOr<std::unique_ptr<KvPeer>> Create(const HandoffOptions& options,
                                                        const TlsFiles& tls,
                                                        std::string tokens_file, KvPool* pool,
                                                        ByteBudget* budget = nullptr,
                                                        TenantDirectory* tenants = nullptr);

  // The gate's Fetch: asks the peer to give the cache here, as the caller.
  // OK once it is live here; NOT_FOUND when the peer does not hold it (or
  // cannot be reached); a MovedStatus naming the peer when the peer kept it.
  absl::Status Fetch(const KvHandoffGate::Call& call);

  // Copies `cache` to the peer before `deadline`, as the caller of
  // `authorization` (empty: as the cache's tenant by the tokens file).
  // Returns the payload bytes sent. Its send window (kPushWindowChunks
  // chunks, smaller chunks where the budget or the tenant's quota is small)
  // is charged first: it waits for room until `deadline`, and is refused
  // RESOURCE_EXHAUSTED naming the budget when one page's window can never fit.
  absl::StatusOr<int64_t> Push(const std::shared_ptr<KvCache>& cache, absl::Time deadline,
                               const std::string& authorization = std::string());

  // The drain: every cache the gate knows moves to the peer (a few at a
  // time), each dropped here once the peer holds it; then the gate answers
  // moved-to for `linger` (bounded by `deadline`).
  void Drain(KvHandoffGate* gate, absl::Time deadline);

 private:
  KvPeer(const HandoffOptions& options, std::shared_ptr<grpc::Channel> channel,
         std::string tokens_file, KvPool* pool, ByteBudget* budget, TenantDirectory* tenants);

  const HandoffOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::string tokens_file_;
  KvPool* const pool_;
  ByteBudget* const budget_;
  TenantDirectory* const tenants_;
};

}  // namespace attnserve
