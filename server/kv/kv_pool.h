// The server's K/V caches (DESIGN §6): per-device budgets, the caches of every
// tenant, idle expiry, and the append-and-attend path through the cache's
// device executor. Protocol-independent: the gRPC front-end
// (server/kv_service.cc) decodes and validates, then calls this.
//
// Ordering: a call claims its (sequence, layer) pairs when it arrives
// (KvCache::Admit); one that names a pair an earlier call still holds waits
// for it, so calls on one sequence and layer apply in arrival order. A call
// that may go is submitted to the executor of the cache's device (never
// another) as paged work, where the pool reserves its pages just before the
// launch and builds its params (once), and commits or rolls back when the
// launch is over. A cache that spans devices reserves when the call may go
// and submits one launch per device and role (server/kv/span_launch.h) to
// those devices' executors; when all are over it merges their partial
// outputs, then commits, or rolls back if any failed.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/make_params.h"
#include "server/auth/tenants.h"
#include "server/executor.h"
#include "server/kv/kv_cache.h"
#include "server/kv/page_allocator.h"
#include "server/kv/span_launch.h"

namespace attnserve {

struct KvPoolOptions {
  // K/V bytes each device may hold over all its caches (--kv_cache_bytes).
  int64_t cache_bytes_per_device = int64_t{1} << 30;
  // Page size when CreateCache leaves it 0 (--kv_page_size).
  int default_page_size = 64;
  // Sequences and caches unused this long are removed (--kv_idle_timeout);
  // zero = never.
  absl::Duration idle_timeout = absl::Minutes(10);
  // Unary steps' q, k, v and o in the backend's host tensor memory
  // (AllocateHostTensor); false: heap memory and the message's own bytes, as
  // before (for A/B runs; ATTNSERVE_KV_HOST_TENSORS=0 in the environment
  // sets it false too).
  bool host_tensors = true;
};

// How often an expiry thread scans for what has been idle `idle_timeout`: a
// quarter of it (at most a second, at least 5 ms), so removal is at most 25% late.
inline absl::Duration IdleScanPeriod(absl::Duration idle_timeout) {
  return std::max(std::min(idle_timeout / 4, absl::Seconds(1)), absl::Milliseconds(5));
}

// One device's backend and executor (both outlive the pool).
struct KvDevice {
  AttentionBackend* backend;
  Executor* executor;
  int index;  // reported as the cache's device
};

struct KvCreateCache {
  KvGeometry geometry;
  int32_t page_size = 0;
  int64_t capacity_tokens = 0;
  int64_t capacity_bytes = 0;
  std::string cache_id;
  std::optional<int32_t> device;
  // Two or more devices: the cache spans them (its capacity split evenly,
  // each share charged to its device); exclusive with `device`. One: as
  // `device`. all_devices: every device of the server (the startup spec's
  // devices=all).
  std::vector<int32_t> devices;
  bool all_devices = false;
  bool reserve = false;
  // Never removed as a whole by idle expiry (--kv_startup_cache: clients
  // that cannot create it again rely on it); its idle sequences still expire.
  bool keep = false;
};

// One append-and-attend call, owned by the front-end until `done`.
struct KvAppendAttend {
  std::string cache_id;
  int32_t layer = 0;
  std::vector<KvStep> steps;
  // What the front-end decoded: the call's dtype, heads and head dim (the
  // cache's, and q's Hq), its options, and host pointers to the request's q,
  // k and v rows and its per-head score modifiers (inputs.mods: ALiBi slopes
  // and sinks, [Hq] each, carried into the launch's params; the pool binds o
  // and lse).
  DType dtype = DType::kFP16;
  int32_t num_heads_q = 0;
  int32_t num_heads_kv = 0;
  int32_t head_dim = 0;
  int32_t head_dim_v = 0;  // V's and O's when it differs (MLA); 0: head_dim
  AttnOptions options;
  AttnPointers inputs;
  // FP8 caches given FP8_E4M3 k and v: their scales [Tnew, Hkv] (request
  // memory; inputs.k/v then point at the codes). Null: k/v are `dtype` values.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool return_lse = false;
  // How the caller's protocol names the steps' fields (errors at reserve).
  const FieldNames* names = &ContractFieldNames();
  absl::Time received = absl::Now();
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<const std::atomic<bool>> cancelled;
  // Inputs read in place from memory their owner may take back (a client's
  // shared-memory region): called once the launch is done, before the
  // commit; an error fails the call and rolls it back. Null: nothing to check.
  std::function<absl::Status()> inputs_intact;
  // Host memory the launch writes o into instead of `o` (a client's mapped
  // output span, which outlives the call), and its size; null: `o`.
  char* o_out = nullptr;
  int64_t o_out_bytes = 0;
  // Outputs: o [Tq, Hq, D] bytes, lse [Hq, Tq] FP32 bytes, lengths after.
  std::string o;
  std::string lse;
  std::vector<int32_t> lengths;
  // The pool's working state: the steps' query and new row offsets, and
  // the pages reserved for the launch.
  std::vector<int32_t> cu_q, cu_k;
  KvReservation reservation;
  // A cache that spans devices: its launches (span_launch.h).
  std::vector<KvSpanGroup> span_groups;
  // And where its time went, set before `done` (long_context_bench prints
  // it): the host's work before the first launch (outputs bound, pages
  // reserved, launches built), each launch's timings (WorkTimings::device
  // says where it ran) and the merge of their partials.
  struct SpanTimes {
    int64_t prepare_us = 0;
    int64_t merge_us = 0;
    std::vector<WorkTimings> launches;
  };
  SpanTimes span_times;
};

struct KvPoolStats {
  int64_t caches = 0;
  int64_t sequences = 0;
  int64_t expired_sequences = 0;  // since start, all caches
  int64_t expired_caches = 0;
  struct Device {
    int index = 0;
    int64_t pages_used = 0;
    int64_t pages_capacity = 0;  // sum of the caches' capacities
    int64_t bytes_used = 0;      // allocated slabs
    int64_t bytes_limit = 0;
  };
  std::vector<Device> devices;
};

class KvPool {
 public:
  KvPool(const KvPoolOptions& options, std::vector<KvDevice> devices);
  // Stops the expiry thread; caches free their memory.
  ~KvPool();

  const KvPoolOptions& options() const { return options_; }

  // Per-tenant quotas (kv_pages: the capacities of a tenant's caches, summed)
  // and in-flight charges; null (the default) when authentication is off.
  // Set before serving.
  void set_tenants(TenantDirectory* tenants) {
    tenants_ = tenants;
    ledger_->set_tenants(tenants);
  }
  TenantDirectory* tenants() const { return tenants_; }

  absl::StatusOr<std::shared_ptr<KvCache>> CreateCache(const std::string& tenant,
                                                       const KvCreateCache& request);
  absl::Status DropCache(const std::string& tenant, const std::string& cache_id);
  // NOT_FOUND for an unknown cache, or another tenant's.
  absl::StatusOr<std::shared_ptr<KvCache>> Find(const std::string& tenant,
                                                const std::string& cache_id);
  // Every cache held now, of every tenant (a drain moves them all), in
  // (tenant, id) order; their idle clocks are not touched.
  std::vector<std::shared_ptr<KvCache>> Caches();

  using Done = std::function<void(const absl::Status& status, const WorkTimings& timings)>;
  // Admits `call` on `cache`: OK means `done` will be called exactly once
  // (after commit or rollback); an error means it will not and nothing changed.
  absl::Status AppendAttend(const std::shared_ptr<KvCache>& cache,
                            std::shared_ptr<KvAppendAttend> call, Done done);

  // Host memory for a call's tensors that every device's launches read and
  // write where it lies (AttentionBackend::AllocateHostTensor of the first
  // device's backend: page-locked for all devices on CUDA); null when none
  // is left. Heap memory when host tensors are off (KvPoolOptions).
  std::shared_ptr<char> AllocateHostTensor(int64_t bytes) const;
  bool host_tensors() const { return host_tensors_; }

  // Removes what has been idle for the timeout (the expiry thread calls it;
  // tests may too).
  void ExpireIdle(absl::Time now);
  KvPoolStats Stats();

 private:
  // Submits an admitted call to its device's executor; on refusal completes
  // it with the error (and releases it). `waited`: it queued behind another
  // call, so it was accepted before any drain that began since.
  void Submit(const std::shared_ptr<KvCache>& cache, const std::shared_ptr<KvAppendAttend>& call,
              const Done& done, const std::shared_ptr<KvCache::Ticket>& ticket, bool waited);
  // Submit for a cache that spans devices.
  void SubmitSpanning(const std::shared_ptr<KvCache>& cache,
                      const std::shared_ptr<KvAppendAttend>& call, const Done& done,
                      const std::shared_ptr<KvCache::Ticket>& ticket, bool waited);
  void Finish(const std::shared_ptr<KvCache>& cache, const KvCache::Ticket& ticket);
  // The positions in devices_ a create names (one for a cache on one device);
  // INVALID_ARGUMENT naming device or devices.
  absl::StatusOr<std::vector<int>> PlaceCache(const KvCreateCache& request);
  // Where a cache that names no device goes: the device whose caches' capacities
  // (or allocated bytes, when larger) add up to the least. Ties go to the first.
  int LeastCommittedDevice();
  // The executor of the cache's device: its calls go there only.
  Executor* ExecutorOf(const KvCache& cache) const { return ExecutorOfDevice(cache.device()); }
  Executor* ExecutorOfDevice(int device) const;
  void ExpiryLoop();
  // UNAUTHENTICATED for the withdrawn tenant (server/auth/tenants.h): it
  // owns nothing and may create nothing.
  absl::Status CheckTenant(const std::string& tenant) const;

  const KvPoolOptions options_;
  const std::vector<KvDevice> devices_;
  const bool host_tensors_;
  // Shared with each cache's allocator: a cache may outlive the pool.
  std::vector<std::shared_ptr<DeviceBudget>> budgets_;
  TenantDirectory* tenants_ = nullptr;
  // What each tenant's caches reserve (shared with the caches, which may
  // outlive the pool).
  const std::shared_ptr<KvLedger> ledger_;

  absl::Mutex mu_;
  // (tenant, cache id) -> cache.
  std::map<std::pair<std::string, std::string>, std::shared_ptr<KvCache>> caches_
      ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t expired_caches_ ABSL_GUARDED_BY(mu_) = 0;
  // Sequences of caches that are gone (dropped or expired) still count.
  int64_t expired_sequences_gone_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_;
};

}  // namespace attnserve
