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
#include "server/kv/handoff.h"
#include "server/kv/kv_pool.h"
#include "server/security/tls_files.h"

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

class KvPeer {
 public:
  // `tls`: this server's own files (TLS to the peer when tls.cert_file is
  // set); `tokens_file`: the shared --auth_tokens_file (empty: no tokens).
  // `pool` must outlive the peer.
  static absl::StatusOr<std::unique_ptr<KvPeer>> Create(const HandoffOptions& options,
                                                        const TlsFiles& tls,
                                                        std::string tokens_file, KvPool* pool);

  // The gate's Fetch: asks the peer to give the cache here, as the caller.
  // OK once it is live here; NOT_FOUND when the peer does not hold it (or
  // cannot be reached); a MovedStatus naming the peer when the peer kept it.
  absl::Status Fetch(const KvHandoffGate::Call& call);

  // Copies `cache` to the peer before `deadline`, as the caller of
  // `authorization` (empty: as the cache's tenant by the tokens file).
  // Returns the payload bytes sent.
  absl::StatusOr<int64_t> Push(const std::shared_ptr<KvCache>& cache, absl::Time deadline,
                               const std::string& authorization = std::string());

  // The drain: every cache the gate knows moves to the peer (a few at a
  // time), each dropped here once the peer holds it; then the gate answers
  // moved-to for `linger` (bounded by `deadline`).
  void Drain(KvHandoffGate* gate, absl::Time deadline);

 private:
  KvPeer(const HandoffOptions& options, std::shared_ptr<grpc::Channel> channel,
         std::string tokens_file, KvPool* pool);

  const HandoffOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::string tokens_file_;
  KvPool* const pool_;
};

}  // namespace attnserve
