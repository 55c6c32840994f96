// Rolling restarts without losing sequences (docs/kv-transfer.md, kv.proto's
// "moved caches"): what a server started with --handoff_peer does with the
// K/V calls it gets. KvHandoffGate sits in front of every KvCache call:
//  - serving, the cache here: the call goes on, holding a pass (counted per
//    cache, so a drain knows when a cache has nothing in flight);
//  - serving, the cache not here: the call waits while the gate fetches the
//    cache from the peer (Fetch, the caller's tenant and authorization); it
//    then goes on, or gets the fetch's error (NOT_FOUND: the peer lacks it);
//  - a cache the peer asks for (its Fetch arrives here as Give): its calls
//    wait, those in flight finish, the cache is pushed to the peer and dropped
//    here, and the calls that waited get MovedStatus (the drain's path for
//    one cache, so no append can fall between the copy and the drop);
//  - draining: calls on the caches being moved wait until their cache has
//    moved and then get UNAVAILABLE "cache <id> moved to <peer>"
//    (MovedStatus); calls on caches not here (CreateCache included) get it at
//    once; calls on a cache that stays (its move failed) go on;
//  - read-only calls (GetCacheStats) never fetch: they answer from what is
//    here, or MovedStatus for a cache this server moved away (or drains);
//  - a stream's request on a cache this server moved away gets MovedStatus
//    rather than fetching it back: the stream ends there and its client
//    reopens it at the peer (a request read just after the move must not pull
//    the cache back ahead of the requests the move refused).
// Protocol-free: the gRPC front-end turns MovedStatus into the trailing
// metadata x-attnserve-moved-to (server/native/kv_moved.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cache_id_header.h"
namespace attnserve {

// server/kv/kv_pool.h; not included, so ServerOptions can carry
// HandoffOptions without the pool's types.
class KvCache;
class KvPool;

// --handoff_peer and what reaching it takes.
struct HandoffOptions {
  // host:port of the peer replica; empty: no handoff (a drain drops caches,
  // a missing cache is NOT_FOUND at once).
  std::string peer;
  // TLS to the peer, on when this server serves TLS: the PEM roots the
  // peer's certificate must chain to (empty: the system's), and for mutual
  // TLS the server's own --tls_cert/--tls_key are presented.
  std::string peer_ca_file;
  // After every cache has moved, how long the draining server still answers
  // moved-to (clients with no call in flight during the move learn where
  // their cache went) before it stops listening.
  absl::Duration linger = absl::Milliseconds(500);
  // Longest one fetch from the peer may take (a pull on miss).
  absl::Duration fetch_timeout = absl::Seconds(60);
  // What carries a pushed cache's pages: "auto" (UCX when this build has it
  // and the peer's import offers it, else the gRPC stream; the binary makes
  // it "grpc" without --ucx_port), "ucx" (a peer without UCX fails the push)
  // or "grpc".
  std::string transport = "auto";
};

// UNAVAILABLE "cache <id> moved to <address>", with the address as the
// status payload kMovedToHeader (the front-end's trailing metadata).
absl::Status MovedStatus(const std::string& cache_id, const std::string& address);
// The address a MovedStatus names; nullopt for any other status.
std::optional<std::string> MovedToOf(const absl::Status& status);

// The bearer token a server uses to act as `tenant` towards its peer: the
// first line of the shared tokens file that names the tenant (the replicas
// share one file, so the peer knows it). Empty `tokens_file`: no token.
// NOT_FOUND when the file names no token for the tenant.
absl::StatusOr<std::string> TokenOfTenant(const std::string& tokens_file,
                                          const std::string& tenant);

class KvHandoffGate {
 public:
  // One call at the gate.
  struct Call {
    std::string tenant;
    std::string cache_id;
    std::string authorization;  // the caller's header, for a fetch as the caller
    bool create = false;        // CreateCache: never fetched
    bool read_only = false;     // changes nothing: never fetched
    bool stream = false;        // a request of an AppendAttendStream
  };
  // Held by an admitted call until it has completed.
  using Pass = std::shared_ptr<void>;
  // Runs once: `refused` OK with a pass (go on), or the answer to give.
  using Go = std::function<void(const absl::Status& refused, Pass pass)>;
  // Brings (call.tenant, call.cache_id) here from the peer: OK when the cache
  // is live here; the error to answer otherwise. Runs on a gate thread.
  using Fetch = std::function<absl::Status(const Call& call)>;
  // Copies `cache` to the peer, as the caller of `authorization` (empty: as
  // the cache's tenant by the shared tokens file).
  // Returns the payload bytes sent.
  using Push = std::function<absl::StatusOr<int64_t>(const std::shared_ptr<KvCache>& cache,
                                                     const std::string& authorization)>;

  // `pool` must outlive the gate; `fetch` null: nothing is fetched.
  KvHandoffGate(KvPool* pool, std::string peer, Fetch fetch, Push push);
  ~KvHandoffGate();  // waits for running fetches
  KvHandoffGate(const KvHandoffGate&) = delete;
  KvHandoffGate& operator=(const KvHandoffGate&) = delete;

  const std::string& peer() const { return peer_; }

  // `go` runs now or, for a call that must wait, later on another thread.
  void Enter(Call call, Go go);

  // The drain (server/native/kv_moved.h drives it): from now on calls wait
  // or are sent to the peer (above). Returns every cache the pool holds.
  std::vector<std::shared_ptr<KvCache>> BeginDrain();
  // True once no admitted call holds a pass on the cache; false at deadline.
  bool WaitIdle(const std::string& tenant, const std::string& cache_id, absl::Time deadline);
  // The cache is on the peer now (`bytes` of payload pushed): its waiting
  // calls, and later ones, get MovedStatus.
  void Moved(const std::string& tenant, const std::string& cache_id, int64_t bytes);
  // The move failed: its waiting calls go on (and meet the drain's refusal).
  void Release(const std::string& tenant, const std::string& cache_id);

  // The peer asked for the tenant's cache: it moves there (see the top of
  // this file). `done` runs once, on a gate thread: OK once the peer holds
  // it, NOT_FOUND when it is not here, or why it stays here.
  void Give(const std::string& tenant, const std::string& cache_id,
            const std::string& authorization, std::function<void(const absl::Status&)> done);

  // What the gate has done since start (/metrics: RenderHandoffMetrics).
  struct Counters {
    int64_t refused_moved = 0;  // calls answered MovedStatus
    int64_t pushed = 0;         // caches moved to the peer (drain and give)
    int64_t bytes_pushed = 0;   // their payload bytes
    int64_t fetches = 0;        // fetches started (a call missed the cache)
    int64_t fetched = 0;        // of those, the cache came here
    int64_t failures = 0;       // pushes that failed, fetches that failed other than NOT_FOUND
  };
  Counters counters() const;
  // Caches fetched from the peer, and moved to it, since start (tests).
  int64_t fetched() const;
  int64_t moved() const;

 private:
  using Key = std::pair<std::string, std::string>;  // (tenant, cache id)
  struct Waiting {
    Call call;
    Go go;
  };
  struct Entry {
    int64_t passes = 0;
    bool fetching = false;
    std::vector<Waiting> waiting;
  };
  Pass PassFor(const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Returned(const Key& key);
  void RunFetch(Call call);
  // Runs `work` on a thread of the gate, first joining those that finished
  // (fetches and gives come and go for the server's life).
  void Spawn(std::function<void()> work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets an entry with nothing left in it.
  void Tidy(const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvPool* const pool_;
  const std::string peer_;
  const Fetch fetch_;
  const Push push_;
  mutable absl::Mutex mu_;
  absl::CondVar idle_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::set<Key> moving_ ABSL_GUARDED_BY(mu_);  // the drain's, until Moved or Release
  std::set<Key> moved_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  Counters counters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::set<std::thread::id> finished_ ABSL_GUARDED_BY(mu_);  // to join at the next Spawn
};

}  // namespace attnserve
