// One K/V cache (DESIGN §6, docs/kv-cache.md): a geometry on one device, or
// spanning several (each a shard with its own pages; a sequence's tokens then
// lie in segments, server/kv/segments.h), its pages (PageAllocator per shard),
// its sequences with a block table and a length per layer, and the
// bookkeeping that makes append-and-attend calls all-or-nothing and ordered:
//  - Admit/Release: a call claims its (sequence, layer) pairs; a call naming
//    a pair that an earlier call still holds waits, in arrival order, until
//    that call completes (Release hands back the calls that may go now).
//  - Reserve (at launch): checks each sequence's length, allocates the pages
//    the append needs and a copy-on-write page for a shared partial last page,
//    and builds the launch's block tables; nothing the sequence holds changes.
//  - Commit (the launch succeeded) makes the reservation the sequence's state;
//    Rollback (it failed) frees what Reserve allocated. A failed call changes
//    no sequence.
// Thread-safe: one mutex per cache.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backend/backend.h"
#include "server/auth/tenants.h"
#include "server/core/field_names.h"
#include "server/kv/page_allocator.h"
#include "server/kv/segments.h"

namespace attnserve {

// Bounds on what one call can make the server hold or send: a cache's layers
// (each sequence keeps a block table and a length per layer), the sequence
// ids one CreateSequences, FreeSequences or GetCacheStats call may name, and
// the per-layer lengths one GetCacheStats answer may carry.
inline constexpr int32_t kMaxKvLayers = 1024;
inline constexpr int kMaxKvIdsPerCall = 4096;
inline constexpr int64_t kMaxKvStatsLengths = int64_t{1} << 20;

// Host memory one sequence's bookkeeping takes (its map entry, and per layer
// a block table header and a length), charged like pages so that empty
// sequences cannot hold memory no quota sees.
inline int64_t KvSequenceBytes(int32_t num_layers) { return 256 + 32 * int64_t{num_layers}; }

// What each tenant's K/V caches reserve, and the rule that bounds it
// (TenantDirectory::CheckKv): capacity pages over all devices (the kv_pages
// quota) and, per device, bytes (each cache's capacity rounded up to whole
// slabs, plus its sequences' bookkeeping). With tenants configured, the
// reservations of a device never exceed its budget either, so a cache that
// was created can always grow to its capacity. Without tenants it only keeps
// the books. Thread-safe; its lock is taken last.
class KvLedger {
 public:
  explicit KvLedger(int64_t device_budget) : device_budget_(device_budget) {}
  void set_tenants(TenantDirectory* tenants) { tenants_ = tenants; }

  // All or nothing: RESOURCE_EXHAUSTED (quota, share or budget) or
  // UNAUTHENTICATED (the withdrawn tenant) and nothing charged.
  absl::Status Charge(const std::string& tenant, int device, int64_t pages, int64_t bytes);
  void Refund(const std::string& tenant, int device, int64_t pages, int64_t bytes);

 private:
  struct Held {
    int64_t pages = 0;
    std::map<int, int64_t> bytes;  // per device
  };
  const int64_t device_budget_;
  TenantDirectory* tenants_ = nullptr;
  absl::Mutex mu_;
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> device_total_ ABSL_GUARDED_BY(mu_);
};

struct KvGeometry {
  int32_t num_layers = 0;
  int32_t num_heads_kv = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kFP32;  // Q, O and the steps' K/V values
  // What the pages hold: `dtype`, or FP8_E4M3 (codes with a scale per token
  // and KV head, paged_kv.h). Unset (0) as sent means `dtype`; a created
  // cache always holds the resolved value.
  DType cache_dtype = DType{0};
  // V's head dim when it differs from head_dim (MLA); 0 = head_dim.
  int32_t head_dim_v = 0;
  // V is the first Dv elements of each K row: the pages hold K alone
  // (KvPages::v_in_k), the steps carry no v.
  bool v_in_k = false;
};

// True for a cache whose pages hold E4M3 codes and scales.
inline bool IsFp8Cache(const KvGeometry& g) { return g.cache_dtype == DType::kFP8E4M3; }
// V's head dim: head_dim_v, or head_dim when it is 0.
inline int32_t KvHeadDimV(const KvGeometry& g) {
  return g.head_dim_v > 0 ? g.head_dim_v : g.head_dim;
}
// Bytes one page of K, and of V (none when V lives in K's pages), takes
// (codes and scales for an FP8 cache).
inline int64_t KvKPageBytes(const KvGeometry& g, int page_size) {
  return KvPageBytes(page_size, g.num_heads_kv, g.head_dim, g.dtype, IsFp8Cache(g));
}
inline int64_t KvVPageBytes(const KvGeometry& g, int page_size) {
  if (g.v_in_k) return 0;
  return KvPageBytes(page_size, g.num_heads_kv, KvHeadDimV(g), g.dtype, IsFp8Cache(g));
}
// Bytes one page of K plus V takes: what the cache is charged per page.
inline int64_t KvGeometryPageBytes(const KvGeometry& g, int page_size) {
  return KvKPageBytes(g, page_size) + KvVPageBytes(g, page_size);
}

// A new sequence, optionally forked from a prefix of another (all layers).
struct KvSequenceSpec {
  uint64_t sequence_id = 0;
  std::optional<uint64_t> fork_from;
  std::optional<int32_t> fork_length;  // unset: the source's whole length
};

// KvStep::expected_length that checks nothing: the call appends at whatever
// length its earlier calls on the pair left (KServe v2's attention_kv without
// an expected_length parameter; arrival order still applies).
inline constexpr int32_t kAnyLength = -1;

// One sequence's part of an append-and-attend call.
struct KvStep {
  uint64_t sequence_id = 0;
  int32_t expected_length = 0;
  int32_t num_new = 0;
  int32_t num_queries = 0;
  // Logical pages of the history to attend, strictly increasing (checked
  // without the sequence by ValidateAttendPages); empty: every page. Memory
  // of the call, alive until it completes.
  absl::Span<const int32_t> attend_pages = {};
};

// One device's part of a cache: its pages come from that device's budget.
struct KvShardSpec {
  int device = 0;
  AttentionBackend* backend = nullptr;
  std::shared_ptr<DeviceBudget> budget;
  int64_t capacity_pages = 0;
};

// One segment of one step of a call on a cache that spans devices: a launch
// on its shard attends the step's queries over its tokens (the last segment
// also takes the step's new rows and any copy-on-write page).
struct KvSpanPart {
  int32_t step = 0;
  int32_t shard = 0;
  bool last = false;
  int32_t tokens = 0;          // after the append
  int32_t new_tokens = 0;      // appended here (last segment only)
  std::vector<int32_t> pages;  // the shard's page ids, in token order
  int32_t copy_src = -1;       // shard page ids of a copy-on-write, or -1
  int32_t copy_dst = -1;
};

// What Reserve set aside for one call: the launch's tables (host memory the
// PagedAttnParams point at) and each sequence's page list after the call.
struct KvReservation {
  KvPages pages{};
  std::vector<int32_t> block_table;  // [steps, stride]: the pages each step attends
  int32_t stride = 1;
  // Tokens each step attends: its length after the append, or fewer with
  // attend_pages (the launch's seqlens_k).
  std::vector<int32_t> seqlens;
  std::vector<int32_t> lengths;  // each sequence's length after the append
  std::vector<int32_t> copy_src, copy_dst;
  std::vector<std::vector<int32_t>> tables;  // per step: the page list after commit
  std::vector<int32_t> fresh;                // pages allocated (freed on rollback)
  std::vector<int32_t> replaced;             // shared pages a copy replaced (released on commit)
  // A cache that spans devices (ReserveSpanning): the launch parts, each
  // shard's pages, and per step its segments after commit (`tables` holds
  // the block tables; block_table, stride and copies are unused).
  std::vector<KvSpanPart> parts;
  std::vector<KvPages> shard_pages;
  std::vector<int> shard_devices;
  std::vector<std::vector<KvSegment>> segments;
  bool active = false;
};

struct KvShardStats {
  int32_t device = 0;
  int64_t capacity_pages = 0;
  int64_t pages_used = 0;
  int64_t bytes_allocated = 0;
};

struct KvCacheStats {
  std::string cache_id;
  KvGeometry geometry;
  int32_t page_size = 0;
  int32_t device = 0;
  int64_t capacity_pages = 0;
  int64_t pages_used = 0;
  int64_t page_bytes = 0;
  int64_t sequences = 0;
  int64_t expired_sequences = 0;
  int64_t tokens = 0;
  int64_t bytes_allocated = 0;
  std::vector<KvShardStats> shards;  // one per device the cache spans
};

class KvCache {
 public:
  // A call that may wait for another on one of its (sequence, layer) pairs.
  struct Ticket {
    int32_t layer = 0;
    std::vector<uint64_t> sequence_ids;
    // Run by whoever Release returned the ticket to, outside the lock, when
    // the call may go (the ticket is passed in, so `go` need not hold it).
    std::function<void(const std::shared_ptr<Ticket>& self)> go;
  };

  // `ledger` (may be null) is charged by Join and by sequences' bookkeeping.
  KvCache(std::string tenant, std::string id, const KvGeometry& geometry, int page_size,
          int64_t capacity_pages, int device, AttentionBackend* backend,
          std::shared_ptr<DeviceBudget> budget, std::shared_ptr<KvLedger> ledger = nullptr);
  // A cache over several devices (two or more shards: spanning()); the first
  // shard's device is device() and holds the sequences' bookkeeping charge.
  KvCache(std::string tenant, std::string id, const KvGeometry& geometry, int page_size,
          const std::vector<KvShardSpec>& shards, std::shared_ptr<KvLedger> ledger = nullptr);
  // Refunds what Join and the live sequences charged.
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Charges the cache's capacity to its tenant (the pool, before the cache
  // is shared); on error nothing is charged.
  absl::Status Join();
  // The device bytes the cache holds at full capacity (whole slabs).
  int64_t ceiling_bytes() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    int64_t bytes = 0;
    for (const auto& a : shards_) bytes += a->ceiling_bytes();
    return bytes;
  }

  const std::string& tenant() const { return tenant_; }
  const std::string& id() const { return id_; }
  const KvGeometry& geometry() const { return geometry_; }
  int page_size() const { return page_size_; }
  // Pages the cache may grow to over all its devices (fixed at creation; no
  // lock needed).
  int64_t capacity_pages() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    int64_t pages = 0;
    for (const auto& a : shards_) pages += a->capacity_pages();
    return pages;
  }
  // Pages each shard may grow to, in devices() order (fixed; no lock needed).
  std::vector<int64_t> shard_capacity_pages() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    std::vector<int64_t> pages;
    for (const auto& a : shards_) pages.push_back(a->capacity_pages());
    return pages;
  }
  // The first (or only) device; devices(): every device, one per shard.
  int device() const { return device_; }
  const std::vector<int>& devices() const { return devices_; }
  // True when the cache's sequences may hold pages on several devices.
  bool spanning() const { return devices_.size() > 1; }
  // KvCreateCache::keep: set once by the pool before the cache is shared.
  void set_keep(bool keep) { keep_ = keep; }
  bool keep() const { return keep_; }
  // Bytes of one page's K plus V.
  int64_t page_bytes() const;

  // Allocates the whole capacity now (CreateCache's reserve).
  absl::Status ReserveAll();

  // All or nothing: ALREADY_EXISTS, NOT_FOUND (fork source), INVALID_ARGUMENT
  // (fork_length) for any spec creates none.
  absl::Status CreateSequences(const std::vector<KvSequenceSpec>& specs,
                               const FieldNames& names = FieldNames());
  // New length at one layer or every layer; FAILED_PRECONDITION while the
  // sequence has calls in flight.
  absl::Status Truncate(uint64_t sequence_id, std::optional<int32_t> layer, int32_t length);
  // All or nothing.
  absl::Status Free(const std::vector<uint64_t>& sequence_ids);
  // Frees the sequence now when no call on it is in flight (true); otherwise
  // marks it so the last of those calls frees it on Release (false), and new
  // calls on it fail with FAILED_PRECONDITION meanwhile. NOT_FOUND for an
  // unknown sequence. This is v2's sequence_end, which may race the calls
  // before it on the same sequence.
  absl::StatusOr<bool> FreeWhenIdle(uint64_t sequence_id);
  absl::StatusOr<std::vector<int32_t>> Lengths(uint64_t sequence_id);
  KvCacheStats Stats();

  // NOT_FOUND for an unknown sequence (nothing claimed); otherwise the call is
  // claimed (true: it may go now) or queued behind an earlier one (false: its
  // `go` runs from a later Release).
  absl::StatusOr<bool> Admit(const std::shared_ptr<Ticket>& ticket);
  // The call is over: its claims go, and the calls that may go now are
  // claimed and returned (run their `go`).
  std::vector<std::shared_ptr<Ticket>> Release(const Ticket& ticket);

  absl::Status Reserve(int32_t layer, const std::vector<KvStep>& steps, KvReservation* r,
                       const FieldNames& names = FieldNames());
  // A cache that spans devices: Reserve's counterpart (attend_pages is
  // refused). Each step's append goes to one device whole: its last
  // segment's while that shard has the pages and the segment stays within
  // the shard's capacity over the layers, else a new segment on the shard
  // with the most free pages; RESOURCE_EXHAUSTED when none has them. Fills
  // r->parts (a step with no token still gets an empty last part on its
  // placement's shard, so its queries are answered) and r->segments.
  absl::Status ReserveSpanning(int32_t layer, const std::vector<KvStep>& steps, KvReservation* r,
                               const FieldNames& names = FieldNames());
  void Commit(int32_t layer, const std::vector<KvStep>& steps, KvReservation* r);
  void Rollback(KvReservation* r);

  // Removes sequences idle since before `cutoff` with no call in flight;
  // returns how many. True in *idle when the cache itself is idle (no call
  // since before cutoff, none in flight).
  int64_t ExpireIdle(absl::Time cutoff, bool* idle);
  void Touch();

 private:
  // Pins pages for an export, stages imported rows in pages of the cache and
  // makes them a live sequence (server/kv/kv_transfer.cc).
  friend class KvTransferAccess;

  struct Sequence {
    std::vector<std::vector<int32_t>> pages;  // per layer: the block table
    std::vector<int32_t> lengths;             // per layer, committed
    // Per layer, a cache that spans devices only: where the tokens lie.
    std::vector<std::vector<KvSegment>> segments;
    int active_calls = 0;         // admitted and not released
    bool free_when_idle = false;  // FreeWhenIdle ran while busy
    absl::Time last_used;
  };
  using Key = std::pair<uint64_t, int32_t>;

  absl::StatusOr<Sequence*> Find(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every removal of a sequence goes through here, once, before the erase:
  // its pages and its bookkeeping charge go back.
  void ReleaseSequence(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges (count > 0) or refunds (< 0) the bookkeeping of `count`
  // sequences to the ledger and the device budget; a charge is all or nothing.
  absl::Status ChargeSequences(int64_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TruncateLayer(Sequence& s, int layer, int32_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Page ids in block tables are the cache's: shard s's page p is
  // shard_base_[s] + p (a cache on one device: its allocator's ids).
  int ShardOf(int32_t page) const;
  void AddRefPage(int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleasePage(int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int32_t RefsOf(int32_t page) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string tenant_;
  bool keep_ = false;
  const std::string id_;
  const KvGeometry geometry_;
  const int page_size_;
  const int device_;
  const std::vector<int> devices_;  // per shard
  const std::shared_ptr<DeviceBudget> budget_;
  const std::shared_ptr<KvLedger> ledger_;
  bool joined_ = false;  // Join charged the capacity

  absl::Mutex mu_;
  // One allocator per shard; allocator_ is the first (the only one of a
  // cache on one device, which export and import use).
  std::vector<std::unique_ptr<PageAllocator>> shards_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> shard_base_;
  PageAllocator& allocator_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Sequence> sequences_ ABSL_GUARDED_BY(mu_);
  std::set<Key> claimed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Ticket>> waiting_ ABSL_GUARDED_BY(mu_);
  int64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t active_calls_ ABSL_GUARDED_BY(mu_) = 0;
  // Sequences' bookkeeping charged, in bytes and in pages of this cache
  // (the kv_pages quota counts pages).
  int64_t bookkeeping_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bookkeeping_pages_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
