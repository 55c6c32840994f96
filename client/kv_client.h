// KvClient: the C++ client of the attnserve.v1 KvCache service (kv.proto,
// docs/kv-cache.md): K/V that stay on the server, so a decode step sends only
// its new tokens. A KvClient borrows the channels of an AttentionClient (one
// connection set serves both services) and follows its deadlines and
// wait-for-ready settings.
//
//   auto client = AttentionClient::Create("127.0.0.1:50051");
//   KvClient kv(**client);
//   CacheSpec spec;
//   spec.geometry = {/*num_layers=*/1, /*num_heads_kv=*/2, /*head_dim=*/64, DType::kFP16};
//   spec.capacity_tokens = 4096;
//   absl::StatusOr<v1::CacheStats> cache = kv.CreateCache(spec);
//   kv.CreateSequences(cache->cache_id(), {{/*sequence_id=*/1}});
//   AppendAttendInputs step;  // sequences, q, k, v (varlen rows), options
//   absl::StatusOr<AppendAttendResult> out = kv.AppendAttend(step);
//
// Every call carries the cache id in the metadata header kCacheIdHeader so an
// affinity proxy (deploy/proxy) sends all calls of a cache to the replica that
// holds it. Errors are absl::Status with the server's code and message; on
// NOT_FOUND the cache or sequence is gone (server restart, expiry, another
// replica): create it again and re-prefill.
//
// Moved caches (kv.proto, --handoff_peer): a replica that drains moves its
// caches to a peer and answers UNAVAILABLE with the trailing metadata
// x-attnserve-moved-to. The unary calls retry the same request (the same
// expected_length, so an append is never applied twice) per KvMovedOptions:
// at the named address (and every later call of that cache goes there), or
// at the same target after a short backoff (a proxy sends it on to the
// replica that now holds the cache once the drained one has gone).
//
// Streams follow too: a replica whose cache moves ends an AppendAttendStream
// with the same moved-to status once the requests it had started are
// answered; the requests it did not answer were refused with no state change
// (or never read). The stream then reopens itself (at the named address, or
// at the same target after a backoff) and sends those requests again in the
// order they were first sent, so every request is answered exactly once. A
// stream that ends any other way fails its unanswered requests as before.
//
// A separate class rather than more AttentionClient methods: the stateless
// Attention client stays what a serving stack without a cache links against,
// and the K/V types (geometry, steps, the stream object) live in one place.
#pragma once

#include <grpcpp/client_context.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "client/attention_client.h"
#include "client/host_tensor.h"
#include "common/cache_id_header.h"

namespace attnserve {

// Mirrors attnserve.v1.KvGeometry. Named apart from the server's KvGeometry
// (server/kv/kv_cache.h): a binary may link both (scripts/check-odr.py).
struct KvClientGeometry {
  int num_layers = 1;
  int num_heads_kv = 1;
  int head_dim = 64;
  DType dtype = DType::kFP16;
  // What the pages hold: DType{0} (unset: `dtype`) or kFP8E4M3 (E4M3 codes
  // with a scale per token and KV head; the server quantises 16-bit steps).
  DType cache_dtype = DType{0};
  // MLA caches: V rows of their own width (0: head_dim), or V read as the
  // first head_dim_v elements of each K row (v_in_k: steps carry no v).
  int head_dim_v = 0;
  bool v_in_k = false;
};

// Mirrors CreateCacheRequest: exactly one of capacity_tokens and
// capacity_bytes is > 0.
struct CacheSpec {
  KvClientGeometry geometry;
  int page_size = 0;  // 0: the server's default
  int64_t capacity_tokens = 0;
  int64_t capacity_bytes = 0;
  // Empty: KvClient::CreateCache picks a random one ("c-" and 16 hex digits)
  // so that even CreateCache carries the affinity header (a server-chosen id
  // would be unknown to the proxy until the reply). The raw CreateCache with
  // an empty id lets the server choose.
  std::string cache_id;
  std::optional<int> device;  // unset: the server chooses
  // Two or more: the cache spans these devices (docs/kv-cache.md, "Caches
  // that span devices"); exclusive with `device`.
  std::vector<int> devices;
  bool reserve = false;
};

// Mirrors SequenceSpec: empty, or a fork of the first fork_length tokens of
// fork_from (unset length: the source's whole length).
struct SequenceSpec {
  // So {7} and {8, 7, 16} read as "new sequence 7" and "8 forked from the
  // first 16 tokens of 7".
  SequenceSpec(uint64_t id = 0, std::optional<uint64_t> from = std::nullopt,
               std::optional<int32_t> length = std::nullopt)
      : sequence_id(id), fork_from(from), fork_length(length) {}

  uint64_t sequence_id = 0;
  std::optional<uint64_t> fork_from;
  std::optional<int32_t> fork_length;
};

// One sequence's part of an append-and-attend call (SequenceStep).
struct KvClientStep {
  uint64_t sequence_id = 0;
  int32_t expected_length = 0;  // the sequence's length at the layer before the append
  int32_t num_new_tokens = 0;   // its rows of k/v
  int32_t num_queries = 0;      // its rows of q
  // The history pages (tokens before this call, page i = tokens [i * page_size,
  // (i + 1) * page_size)) the queries attend, strictly increasing; the pages
  // of the new tokens are always attended. Empty: every page.
  std::vector<int32_t> attend_pages = {};
};

// One append-and-attend call: q [sum num_queries, Hq, D] and k/v
// [sum num_new_tokens, Hkv, D], rows concatenated in `sequences` order
// (ConcatRows builds them from per-sequence tensors).
struct AppendAttendInputs {
  std::string cache_id;
  int layer = 0;
  std::vector<KvClientStep> sequences;
  HostTensor q;
  HostTensor k;
  HostTensor v;
  ForwardOptions options;
  std::string request_id;  // optional; the stream fills in one when empty
};

struct AppendAttendResult {
  std::string request_id;
  HostTensor o;                   // [sum num_queries, Hq, D]; SliceRows splits it
  std::optional<HostTensor> lse;  // FP32 [Hq, sum num_queries], with return_lse
  std::vector<int32_t> lengths;   // each sequence's length after the append
  ForwardTiming timing;
  std::string backend;
};

v1::KvGeometry KvGeometryToProto(const KvClientGeometry& geometry);
v1::CreateCacheRequest MakeCreateCacheRequest(const CacheSpec& spec);
// Copies the tensors' bytes; the && overload moves them.
v1::AppendAttendRequest MakeAppendAttendRequest(const AppendAttendInputs& inputs);
v1::AppendAttendRequest MakeAppendAttendRequest(AppendAttendInputs&& inputs);
// Decodes a response to `request`, checking O's dtype and shape, LSE's, and
// the number of lengths (INTERNAL: a server that breaks the contract), and
// turning a stream response's error_code into its status.
absl::StatusOr<AppendAttendResult> AppendAttendResultFromProto(
    const v1::AppendAttendRequest& request, v1::AppendAttendResponse&& response);

// Same-host shared memory (client/shm_arena.h): resets `arena`, moves the
// request's q, k and v into it and asks for O (and LSE) there, as
// PlaceForwardInArena does for Forward; a call without queries gets its
// empty O in the message.
absl::StatusOr<ShmOutputSpans> PlaceAppendAttendInArena(ShmArena& arena,
                                                        v1::AppendAttendRequest* request);
// Reads the outputs back into the response's o and lse; a response carrying
// an error (error_code) is left alone.
absl::Status TakeAppendAttendOutputs(const ShmArena& arena, const ShmOutputSpans& spans,
                                     v1::AppendAttendResponse* response);

// A bidirectional AppendAttendStream bound to one cache: a whole generation
// loop on one HTTP/2 stream, many requests in flight at once, each response
// matched to its request by request_id. Send may be called from many threads;
// callbacks run on the stream's reader thread, one at a time, so they must not
// block on another Send's completion. Obtain one from KvClient::OpenStream.
class AppendAttendStream {
 public:
  using Done = std::function<void(absl::StatusOr<v1::AppendAttendResponse>)>;

  ~AppendAttendStream();  // Finish() if not done yet
  AppendAttendStream(const AppendAttendStream&) = delete;
  AppendAttendStream& operator=(const AppendAttendStream&) = delete;

  // Writes `request` (a fresh request_id is set when it has none, or when its
  // id is already in flight: INVALID_ARGUMENT then) and returns at once;
  // `done` runs once with the response (a failed request: its status, and the
  // stream goes on) or, when the stream breaks, with the stream's status.
  // The cache_id must be the stream's (INVALID_ARGUMENT otherwise).
  absl::Status Send(v1::AppendAttendRequest request, Done done);
  // Sends and waits for that request's result, decoded and checked.
  absl::StatusOr<AppendAttendResult> Call(const AppendAttendInputs& inputs);
  absl::StatusOr<AppendAttendResult> Call(v1::AppendAttendRequest request);
  // The same through `arena` (one call at a time per arena; a caller with
  // several calls in flight on the stream gives each its own).
  absl::StatusOr<AppendAttendResult> Call(const AppendAttendInputs& inputs, ShmArena& arena);
  absl::StatusOr<AppendAttendResult> Call(v1::AppendAttendRequest request, ShmArena& arena);
  // Half-closes, waits for every response and returns the stream's status;
  // requests still unanswered then complete with it (or UNAVAILABLE).
  absl::Status Finish();

  const std::string& cache_id() const { return cache_id_; }
  int64_t in_flight() const;
  // Times the stream reopened after a moved-to end.
  int64_t reopened() const;

 private:
  friend class KvClient;
  // Requests are written as their encoding (TensorWireSlices: the tensors'
  // bytes as slices, not copied into a serialized message).
  using Rpc = grpc::ClientReaderWriter<grpc::ByteBuffer, v1::AppendAttendResponse>;
  // Where the stream goes on after a moved-to end naming `address`: the
  // channel to reopen it on, or the error that ends it.
  using Reopen = std::function<absl::StatusOr<grpc::ChannelInterface*>(const std::string& address)>;
  struct Pending {
    uint64_t order = 0;  // sending order, kept when sent again
    Done done;
    // Its encoding, kept to send again after a move (null when the stream
    // does not follow).
    std::shared_ptr<const grpc::ByteBuffer> request;
  };
  // `reopen` null: the stream does not follow moves.
  AppendAttendStream(std::string cache_id, grpc::ChannelInterface* channel, const CallOptions& call,
                     const ClientOptions& options, Reopen reopen, absl::Duration budget);
  void Open(grpc::ChannelInterface* channel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  void ReadLoop();
  // After a moved-to end: reopens and sends the unanswered requests again.
  // False when the stream cannot go on.
  bool FollowMove(const std::string& address);
  bool NotResending() const ABSL_SHARED_LOCKS_REQUIRED(write_mu_) { return !resending_; }

  const std::string cache_id_;
  const CallOptions call_;
  const ClientOptions options_;
  const Reopen reopen_;
  const absl::Duration budget_;
  absl::Mutex write_mu_;  // one Write at a time (gRPC's rule for a sync stream)
  // The RPC now and those it replaced (kept until the stream goes).
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_ ABSL_GUARDED_BY(write_mu_);
  std::vector<std::unique_ptr<Rpc>> rpcs_ ABSL_GUARDED_BY(write_mu_);
  Rpc* stream_ ABSL_GUARDED_BY(write_mu_) = nullptr;
  bool resending_ ABSL_GUARDED_BY(write_mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(write_mu_) = false;
  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // writes done or the stream broke
  int64_t reopened_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ = false;
  absl::Status final_status_;
  std::thread resender_;  // the reader's; joined by the reader
  std::thread reader_;
};

// What KvClient does with a moved-to answer (see the top of this file).
struct KvMovedOptions {
  enum class Policy {
    kFollow,  // retry at the named address (the client reaches replicas directly)
    kRetry,   // retry at the same target (a proxy), plain UNAVAILABLE included
    kOff,     // return the status
  };
  Policy policy = Policy::kFollow;
  // Longest a call keeps retrying before it returns the last status.
  absl::Duration budget = absl::Seconds(60);
};

class KvClient {
 public:
  // Borrows `client`'s channels; `client` must outlive this object.
  explicit KvClient(AttentionClient& client, KvMovedOptions moved = KvMovedOptions());

  // Returns the new cache's statistics (its id in cache_id()). See
  // CacheSpec::cache_id for how an empty id is filled.
  absl::StatusOr<v1::CacheStats> CreateCache(const CacheSpec& spec,
                                             const CallOptions& call = CallOptions());
  absl::StatusOr<v1::CacheStats> CreateCache(const v1::CreateCacheRequest& request,
                                             const CallOptions& call = CallOptions());
  absl::Status DropCache(const std::string& cache_id, const CallOptions& call = CallOptions());
  absl::StatusOr<v1::CacheStats> CreateSequences(const std::string& cache_id,
                                                 const std::vector<SequenceSpec>& sequences,
                                                 const CallOptions& call = CallOptions());
  // Truncates one layer, or every layer when `layer` is unset.
  absl::StatusOr<v1::CacheStats> Truncate(const std::string& cache_id, uint64_t sequence_id,
                                          int32_t length, std::optional<int32_t> layer,
                                          const CallOptions& call = CallOptions());
  absl::StatusOr<v1::CacheStats> FreeSequences(const std::string& cache_id,
                                               const std::vector<uint64_t>& sequence_ids,
                                               const CallOptions& call = CallOptions());
  // The cache's statistics and the per-layer lengths of `sequence_ids`.
  absl::StatusOr<v1::GetCacheStatsResponse> GetCacheStats(
      const std::string& cache_id, const std::vector<uint64_t>& sequence_ids = {},
      const CallOptions& call = CallOptions());

  // The raw RPC, and the typed call that builds the request and checks the
  // response's shapes.
  absl::StatusOr<v1::AppendAttendResponse> AppendAttend(const v1::AppendAttendRequest& request,
                                                        const CallOptions& call = CallOptions());
  // The same, moving q, k and v's bytes onto the wire instead of copying them
  // into a serialized message (common/tensor_wire_slices.h): `request` keeps
  // every other field (the tensors' dtypes and shapes too) but no tensor
  // bytes afterwards. The typed calls below send this way.
  absl::StatusOr<v1::AppendAttendResponse> AppendAttend(v1::AppendAttendRequest* request,
                                                        const CallOptions& call = CallOptions());
  absl::StatusOr<AppendAttendResult> AppendAttend(const AppendAttendInputs& inputs,
                                                  const CallOptions& call = CallOptions());
  // Both through `arena` (one call at a time per arena): q, k and v go into
  // it and O (and LSE) come back from it, read into the response's tensors.
  absl::StatusOr<v1::AppendAttendResponse> AppendAttend(v1::AppendAttendRequest request,
                                                        ShmArena& arena,
                                                        const CallOptions& call = CallOptions());
  absl::StatusOr<AppendAttendResult> AppendAttend(const AppendAttendInputs& inputs, ShmArena& arena,
                                                  const CallOptions& call = CallOptions());
  // Non-blocking AppendAttend on gRPC's callback API: `done` runs once, on a
  // gRPC thread. `request` is copied.
  void AppendAttendAsync(const v1::AppendAttendRequest& request, const CallOptions& call,
                         std::function<void(absl::StatusOr<v1::AppendAttendResponse>)> done);

  // Opens an AppendAttendStream for `cache_id` on channel `channel` (modulo
  // the number of channels), or at the address the cache moved to. The
  // stream has no deadline unless `call.timeout` sets one: a generation loop
  // outlives any one call. It follows moves per KvMovedOptions (the top of
  // this file), so it must not outlive this KvClient.
  absl::StatusOr<std::unique_ptr<AppendAttendStream>> OpenStream(
      const std::string& cache_id, int channel = 0, const CallOptions& call = CallOptions());

  // Retries after a moved-to answer so far (each retry counts once).
  int64_t moved_retries() const { return moved_retries_.load(std::memory_order_relaxed); }

 private:
  // One target's stub and its channel (AppendAttend and its stream send
  // their own encoding on the channel).
  struct Route {
    v1::KvCache::Stub* stub;
    grpc::ChannelInterface* channel;
  };
  // A context with the client's deadline and wait-for-ready and the cache id
  // header.
  void Prepare(const CallOptions& call, const std::string& cache_id,
               grpc::ClientContext* context) const;
  Route Next();
  // The route for a cache's calls: the address it moved to, else Next().
  Route RouteFor(const std::string& cache_id);
  // Routes the cache's calls to `address` from now on; its route.
  absl::StatusOr<Route> RouteTo(const std::string& cache_id, const std::string& address);
  // Runs `rpc` (a fresh context each attempt) and retries it per moved_.
  grpc::Status Invoke(const CallOptions& call, const std::string& cache_id,
                      const std::function<grpc::Status(const Route&, grpc::ClientContext*)>& rpc);

  AttentionClient& client_;
  const KvMovedOptions moved_;
  std::vector<std::unique_ptr<v1::KvCache::Stub>> stubs_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // stubs_[i]'s
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> moved_retries_{0};
  absl::Mutex routes_mu_;
  // Caches that moved, to the address they moved to, and a client per address.
  std::map<std::string, std::string> routes_ ABSL_GUARDED_BY(routes_mu_);
  std::map<std::string, std::unique_ptr<AttentionClient>> moved_clients_
      ABSL_GUARDED_BY(routes_mu_);
  std::map<std::string, std::unique_ptr<v1::KvCache::Stub>> moved_stubs_
      ABSL_GUARDED_BY(routes_mu_);
};

}  // namespace attnserve
