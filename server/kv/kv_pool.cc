// The server's K/V caches and the append-and-attend path; see kv_pool.h.
#include "server/kv/kv_pool.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backend/check_params.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

bool ValidCacheId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status CheckGeometry(const KvGeometry& g) {
  if (g.num_layers < 1 || g.num_layers > kMaxKvLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_layers: expected [1, ", kMaxKvLayers, "], got ", g.num_layers));
  }
  if (g.num_heads_kv < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_heads_kv: expected >= 1, got ", g.num_heads_kv));
  }
  // Equal head dims: [8, 256]; V's differing (MLA): D up to 576, Dv up to
  // 512 (backend/check_params.h says why).
  const bool mla = g.head_dim_v != 0 && g.head_dim_v != g.head_dim;
  const int max_d = mla ? kMaxMlaHeadDimQk : 256;
  if (g.head_dim < 8 || g.head_dim > max_d || g.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.head_dim: expected a multiple of 8 in [8, ", max_d, "]",
                     mla ? " (geometry.head_dim_v differs)" : "", ", got ", g.head_dim));
  }
  if (g.head_dim_v < 0 ||
      (mla && (g.head_dim_v < 8 || g.head_dim_v > kMaxMlaHeadDimV || g.head_dim_v % 8 != 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.head_dim_v: expected 0 (head_dim) or a multiple of 8 in [8, ",
                     kMaxMlaHeadDimV, "], got ", g.head_dim_v));
  }
  if (g.v_in_k && KvHeadDimV(g) > g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.head_dim_v: expected <= head_dim ", g.head_dim,
        " with geometry.v_in_k (V is the first head_dim_v elements of each K row), got ",
        g.head_dim_v));
  }
  if (g.dtype == DType::kFP8E4M3) {
    // Q, O and the steps' K/V values are 16 or 32 bits; FP8 pages are
    // cache_dtype's (their scales are per token and KV head, not per tensor).
    return absl::InvalidArgumentError(
        "geometry.dtype: expected FP16, BF16 or FP32 (for FP8 pages set geometry.cache_dtype "
        "FP8_E4M3), got FP8_E4M3");
  }
  if (g.dtype != DType::kFP16 && g.dtype != DType::kBF16 && g.dtype != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.dtype: expected FP16, BF16 or FP32, got ", static_cast<int>(g.dtype)));
  }
  const bool same = g.cache_dtype == DType{0} || g.cache_dtype == g.dtype;
  const bool fp8 = g.cache_dtype == DType::kFP8E4M3 && g.dtype != DType::kFP32;
  if (!same && !fp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.cache_dtype: expected unset, geometry.dtype (", std::string(DTypeName(g.dtype)),
        ") or FP8_E4M3 (with dtype FP16 or BF16), got ",
        g.cache_dtype == DType::kFP8E4M3 ? std::string("FP8_E4M3 with dtype FP32")
                                         : absl::StrCat(static_cast<int>(g.cache_dtype))));
  }
  return absl::OkStatus();
}

// A call's shape: its steps' query and new K/V rows, attending over
// `seqlens_k` (the sequences' lengths after the append; null until reserved).
AttnShape ShapeOf(const KvAppendAttend& c, const int32_t* seqlens_k) {
  AttnShape s = PagedShape(c.dtype, static_cast<int32_t>(c.steps.size()), c.num_heads_q,
                           c.num_heads_kv, c.head_dim, c.cu_q.data(), c.cu_k.data(), seqlens_k);
  s.head_dim_v = c.head_dim_v;
  return s;
}

// The call's o (or its output place, checked) and lse.
absl::Status BindOutputs(KvAppendAttend& c) {
  const int64_t total_q = c.cu_q.back();
  const int64_t o_bytes =
      total_q * c.num_heads_q * (c.head_dim_v > 0 ? c.head_dim_v : c.head_dim) * DTypeSize(c.dtype);
  if (c.o_out != nullptr && c.o_out_bytes != o_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("o: expected an output place of ", o_bytes, " bytes, got ", c.o_out_bytes));
  }
  try {
    if (c.o_out == nullptr) c.o.resize(size_t(o_bytes));
    c.lse.resize(c.return_lse ? size_t(total_q * c.num_heads_q * 4) : 0);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", o_bytes, " bytes for the output"));
  }
  return absl::OkStatus();
}

// Just before the launch: binds the call's outputs, reserves its pages (all or
// nothing) and builds its launch's params, once.
absl::StatusOr<PagedAttnParams> ReserveCall(KvCache& cache, KvAppendAttend& c) {
  RETURN_IF_ERROR(BindOutputs(c));
  RETURN_IF_ERROR(cache.Reserve(c.layer, c.steps, &c.reservation, *c.names));
  const KvReservation& r = c.reservation;
  AttnPointers io = c.inputs;
  io.o = c.o_out != nullptr ? c.o_out : c.o.data();
  io.lse = c.return_lse ? reinterpret_cast<float*>(c.lse.data()) : nullptr;
  PagedAttnParams p{};
  p.attn = MakeAttnParams(ShapeOf(c, r.seqlens.data()), c.options, io);
  p.pages = r.pages;
  p.block_table = r.block_table.data();
  p.block_table_stride = r.stride;
  p.seqlens_k = r.seqlens.data();
  p.copy_src = r.copy_src.data();
  p.copy_dst = r.copy_dst.data();
  p.num_page_copies = static_cast<int32_t>(r.copy_src.size());
  // FP8 rows with their scales (validated); otherwise the launch quantises.
  p.k_new_scale = c.k_scale;
  p.v_new_scale = c.v_scale;
  return p;
}

}  // namespace

namespace {

bool HostTensorsOn(const KvPoolOptions& options) {
  const char* env = std::getenv("ATTNSERVE_KV_HOST_TENSORS");
  return options.host_tensors && !(env != nullptr && std::string(env) == "0");
}

}  // namespace

KvPool::KvPool(const KvPoolOptions& options, std::vector<KvDevice> devices)
    : options_(options),
      devices_(std::move(devices)),
      host_tensors_(HostTensorsOn(options)),
      ledger_(std::make_shared<KvLedger>(options_.cache_bytes_per_device)) {
  for (size_t i = 0; i < devices_.size(); ++i) {
    budgets_.push_back(std::make_shared<DeviceBudget>(options_.cache_bytes_per_device));
  }
  if (options_.idle_timeout > absl::ZeroDuration()) {
    expiry_ = std::thread([this] { ExpiryLoop(); });
  }
}

KvPool::~KvPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (expiry_.joinable()) expiry_.join();
}

void KvPool::ExpiryLoop() {
  const absl::Duration period = IdleScanPeriod(options_.idle_timeout);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), period)) return;
    }
    ExpireIdle(absl::Now());
  }
}

std::shared_ptr<char> KvPool::AllocateHostTensor(int64_t bytes) const {
  if (bytes < 0) return nullptr;
  if (!host_tensors_ || devices_.empty()) {
    char* p = new (std::nothrow) char[static_cast<size_t>(std::max<int64_t>(bytes, 1))];
    if (p == nullptr) return nullptr;
    return std::shared_ptr<char>(p, std::default_delete<char[]>());
  }
  return devices_.front().backend->AllocateHostTensor(bytes);
}

void KvPool::ExpireIdle(absl::Time now) {
  if (options_.idle_timeout <= absl::ZeroDuration()) return;
  const absl::Time cutoff = now - options_.idle_timeout;
  std::vector<std::shared_ptr<KvCache>> caches;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, cache] : caches_) caches.push_back(cache);
  }
  for (const std::shared_ptr<KvCache>& cache : caches) {
    bool idle = false;
    cache->ExpireIdle(cutoff, &idle);
    if (!idle || cache->keep()) continue;
    absl::MutexLock lock(&mu_);
    auto it = caches_.find({cache->tenant(), cache->id()});
    if (it != caches_.end() && it->second == cache) {
      expired_sequences_gone_ += cache->Stats().expired_sequences;
      ++expired_caches_;
      caches_.erase(it);  // memory goes when the last holder lets go
    }
  }
}

absl::Status KvPool::CheckTenant(const std::string& tenant) const {
  if (tenants_ != nullptr && tenant == kWithdrawnTenant) {
    return absl::UnauthenticatedError(
        "the call's bearer token names no tenant (withdrawn, or more than one authorization "
        "header): send exactly one current token");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<KvCache>> KvPool::CreateCache(const std::string& tenant,
                                                             const KvCreateCache& r) {
  RETURN_IF_ERROR(CheckTenant(tenant));
  RETURN_IF_ERROR(CheckGeometry(r.geometry));
  KvGeometry geometry = r.geometry;
  if (geometry.cache_dtype == DType{0}) geometry.cache_dtype = geometry.dtype;
  const int page_size = r.page_size == 0 ? options_.default_page_size : r.page_size;
  if (page_size < kMinPageSize || page_size > kMaxPageSize || (page_size & (page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: expected 0 (default ", options_.default_page_size,
                     ") or a power of two in [16, 256], got ", r.page_size));
  }
  if ((r.capacity_tokens > 0) == (r.capacity_bytes > 0) || r.capacity_tokens < 0 ||
      r.capacity_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_tokens, capacity_bytes: expected exactly one of them > 0, got ",
                     r.capacity_tokens, " and ", r.capacity_bytes));
  }
  const int64_t page_bytes = KvGeometryPageBytes(geometry, page_size);
  // Divisions only: capacity_tokens may be as large as int64_t goes.
  const bool by_tokens = r.capacity_tokens > 0;
  const char* field = by_tokens ? "capacity_tokens" : "capacity_bytes";
  const int64_t asked = by_tokens ? r.capacity_tokens : r.capacity_bytes;
  const int64_t capacity_pages =
      by_tokens ? r.capacity_tokens / page_size + (r.capacity_tokens % page_size != 0 ? 1 : 0)
                : r.capacity_bytes / page_bytes;
  if (capacity_pages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at least one page (", page_bytes, " bytes), got ", asked));
  }
  if (devices_.empty()) return absl::UnimplementedError("K/V caches: the server has no device");
  ASSIGN_OR_RETURN(const std::vector<int> placed, PlaceCache(r));
  const int64_t n_devices = static_cast<int64_t>(placed.size());
  if (n_devices > 1 && (KvHeadDimV(geometry) != geometry.head_dim || geometry.v_in_k)) {
    // The launches of a spanning cache gather V rows and O rows of head_dim.
    return absl::InvalidArgumentError(absl::StrCat(
        "devices: a cache that spans devices takes geometry.head_dim_v 0 (or head_dim) and "
        "geometry.v_in_k false, got head_dim_v ",
        geometry.head_dim_v, " and v_in_k ", geometry.v_in_k ? "true" : "false"));
  }
  // A cache that spans devices splits its capacity evenly: each device's
  // share is a cache's capacity there.
  const int64_t per_device_max =
      std::min<int64_t>(int64_t{1} << 30, options_.cache_bytes_per_device / page_bytes);
  const int64_t max_pages = std::min<int64_t>(int64_t{1} << 30, per_device_max * n_devices);
  if (capacity_pages > max_pages) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": ", asked, " is ", capacity_pages, " pages of ", page_bytes, " bytes, more than ",
        n_devices == 1 ? "the device's" : absl::StrCat(n_devices, " devices'"),
        " K/V budget holds (--kv_cache_bytes ", options_.cache_bytes_per_device,
        n_devices == 1 ? "" : " each", ": at most ", max_pages, " pages)"));
  }
  if (capacity_pages < n_devices) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected at least one page (",
                                                   page_bytes, " bytes) per device, ", n_devices,
                                                   " devices, got ", asked));
  }
  if (!r.cache_id.empty() && !ValidCacheId(r.cache_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_id: expected 1..128 characters of [A-Za-z0-9._-], got '",
                     r.cache_id.substr(0, 64), "'"));
  }
  std::string id = r.cache_id;
  {
    absl::MutexLock lock(&mu_);
    if (id.empty()) {
      do {
        id = absl::StrCat("kv-", next_id_++);
      } while (caches_.count({tenant, id}) > 0);
    } else if (caches_.count({tenant, id}) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("cache_id: '", id, "' already exists"));
    }
  }
  std::vector<KvShardSpec> shards;
  for (int64_t k = 0; k < n_devices; ++k) {
    const size_t at = size_t(placed[size_t(k)]);
    shards.push_back({devices_[at].index, devices_[at].backend, budgets_[at],
                      capacity_pages / n_devices + (k < capacity_pages % n_devices ? 1 : 0)});
  }
  auto cache = std::make_shared<KvCache>(tenant, id, geometry, page_size, shards, ledger_);
  cache->set_keep(r.keep);
  // The ledger checks and charges in one step, so two concurrent creates
  // cannot both fit under a quota; a cache that goes refunds on destruction.
  RETURN_IF_ERROR(cache->Join());
  if (r.reserve) RETURN_IF_ERROR(cache->ReserveAll());
  absl::MutexLock lock(&mu_);
  if (!caches_.emplace(std::make_pair(tenant, id), cache).second) {
    return absl::AlreadyExistsError(absl::StrCat("cache_id: '", id, "' already exists"));
  }
  return cache;
}

absl::StatusOr<std::vector<int>> KvPool::PlaceCache(const KvCreateCache& r) {
  if (r.device.has_value() && (!r.devices.empty() || r.all_devices)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device, devices: expected at most one of them set, got device ", *r.device,
        " and devices [", absl::StrJoin(r.devices, ","), r.all_devices ? "all" : "", "]"));
  }
  auto position = [this](int32_t index) {
    auto it = std::find_if(devices_.begin(), devices_.end(),
                           [&](const KvDevice& d) { return d.index == index; });
    return it == devices_.end() ? -1 : static_cast<int>(it - devices_.begin());
  };
  std::vector<int> placed;
  if (r.all_devices) {
    for (size_t i = 0; i < devices_.size(); ++i) placed.push_back(static_cast<int>(i));
  } else if (!r.devices.empty()) {
    for (size_t i = 0; i < r.devices.size(); ++i) {
      const int at = position(r.devices[i]);
      if (at < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "devices[", i, "]: expected one of the server's devices (GetServerInfo), got ",
            r.devices[i]));
      }
      if (std::find(placed.begin(), placed.end(), at) != placed.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("devices[", i, "]: device ", r.devices[i], " is listed twice"));
      }
      placed.push_back(at);
    }
  } else if (r.device.has_value()) {
    const int at = position(*r.device);
    if (at < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: expected one of the server's devices (GetServerInfo), got ", *r.device));
    }
    placed.push_back(at);
  } else {
    placed.push_back(LeastCommittedDevice());
  }
  return placed;
}

int KvPool::LeastCommittedDevice() {
  // A new cache's pages come later: counting only pages in use would put
  // every cache created before the first append on one device. So each device
  // counts its caches' capacities too (a capacity is the most a cache takes).
  std::vector<int64_t> committed(devices_.size(), 0);
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, cache] : caches_) {
      const std::vector<int64_t> capacities = cache->shard_capacity_pages();
      for (size_t s = 0; s < capacities.size(); ++s) {
        for (size_t i = 0; i < devices_.size(); ++i) {
          if (devices_[i].index == cache->devices()[s]) {
            committed[i] += capacities[s] * cache->page_bytes();
          }
        }
      }
    }
  }
  int best = 0;
  for (size_t i = 0; i < devices_.size(); ++i) {
    committed[i] = std::max(committed[i], budgets_[i]->used());
    if (committed[i] < committed[size_t(best)]) best = static_cast<int>(i);
  }
  return best;
}

absl::Status KvPool::DropCache(const std::string& tenant, const std::string& cache_id) {
  RETURN_IF_ERROR(CheckTenant(tenant));
  absl::MutexLock lock(&mu_);
  auto it = caches_.find({tenant, cache_id});
  if (it == caches_.end()) {
    return absl::NotFoundError(absl::StrCat("cache '", cache_id, "' not found"));
  }
  expired_sequences_gone_ += it->second->Stats().expired_sequences;
  // Calls in flight hold the cache: its memory goes when the last one ends.
  caches_.erase(it);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<KvCache>> KvPool::Caches() {
  std::vector<std::shared_ptr<KvCache>> caches;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, cache] : caches_) caches.push_back(cache);
  return caches;
}

absl::StatusOr<std::shared_ptr<KvCache>> KvPool::Find(const std::string& tenant,
                                                      const std::string& cache_id) {
  RETURN_IF_ERROR(CheckTenant(tenant));
  absl::MutexLock lock(&mu_);
  auto it = caches_.find({tenant, cache_id});
  // Another tenant's cache reads exactly like a missing one.
  if (it == caches_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "cache '", cache_id.substr(0, 128),
        "' not found (never created, dropped, expired, or held by another replica): create it "
        "and re-prefill"));
  }
  it->second->Touch();
  return it->second;
}

Executor* KvPool::ExecutorOfDevice(int device) const {
  for (const KvDevice& d : devices_) {
    if (d.index == device) return d.executor;
  }
  return nullptr;
}

absl::Status KvPool::AppendAttend(const std::shared_ptr<KvCache>& cache,
                                  std::shared_ptr<KvAppendAttend> call, Done done) {
  // Refused now during a drain, even when it would wait for another call
  // (those already waiting still run).
  for (int device : cache->devices()) {
    Executor* executor = ExecutorOfDevice(device);
    if (executor == nullptr) return absl::InternalError("the cache's device has no executor");
    RETURN_IF_ERROR(executor->Admitting());
  }
  KvAppendAttend& c = *call;
  if (cache->spanning()) RETURN_IF_ERROR(CheckSpanningCall(c));
  c.cu_q.assign(1, 0);
  c.cu_k.assign(1, 0);
  for (const KvStep& st : c.steps) {
    c.cu_q.push_back(c.cu_q.back() + st.num_queries);
    c.cu_k.push_back(c.cu_k.back() + st.num_new);
  }
  auto ticket = std::make_shared<KvCache::Ticket>();
  ticket->layer = c.layer;
  for (const KvStep& st : c.steps) ticket->sequence_ids.push_back(st.sequence_id);
  ticket->go = [this, cache, call, done](const std::shared_ptr<KvCache::Ticket>& self) {
    Submit(cache, call, done, self, /*waited=*/true);
  };
  ASSIGN_OR_RETURN(const bool now, cache->Admit(ticket));
  // A call that waits is submitted by the Release of the call it waits for.
  if (now) Submit(cache, call, done, ticket, /*waited=*/false);
  return absl::OkStatus();
}

void KvPool::Submit(const std::shared_ptr<KvCache>& cache,
                    const std::shared_ptr<KvAppendAttend>& call, const Done& done,
                    const std::shared_ptr<KvCache::Ticket>& ticket, bool waited) {
  if (cache->spanning()) return SubmitSpanning(cache, call, done, ticket, waited);
  WorkItem item;
  item.received = call->received;
  item.deadline = call->deadline;
  item.cancelled = call->cancelled;
  // A call that waited was admitted before a drain that began meanwhile: it
  // still runs (a drain finishes what it accepted).
  item.follows_admitted = waited;
  item.tenant = cache->tenant();
  PagedWork work;
  work.cache = cache.get();
  work.layer = call->layer;
  work.rows = ShapeOf(*call, /*seqlens_k=*/nullptr);
  KvCache* raw_cache = cache.get();
  KvAppendAttend* c = call.get();
  work.reserve = [raw_cache, c] { return ReserveCall(*raw_cache, *c); };
  item.paged = std::move(work);
  item.done = [this, cache, call, done, ticket](const absl::Status& launched,
                                                const WorkTimings& timings) {
    absl::Status status = launched;
    if (status.ok() && call->inputs_intact) status = call->inputs_intact();
    if (status.ok()) {
      cache->Commit(call->layer, call->steps, &call->reservation);
      call->lengths = call->reservation.lengths;
    } else {
      cache->Rollback(&call->reservation);
    }
    // The next call on these sequences may go before this one's response is
    // sent: its state is committed.
    Finish(cache, *ticket);
    done(status, timings);
  };
  Executor* executor = ExecutorOf(*cache);
  // Only the cache's device holds its pages: never another executor.
  const absl::Status admitted = executor != nullptr
                                    ? executor->Submit(std::move(item))
                                    : absl::InternalError("the cache's device has no executor");
  if (!admitted.ok()) {
    Finish(cache, *ticket);
    done(admitted, WorkTimings{});
  }
}

void KvPool::SubmitSpanning(const std::shared_ptr<KvCache>& cache,
                            const std::shared_ptr<KvAppendAttend>& call, const Done& done,
                            const std::shared_ptr<KvCache::Ticket>& ticket, bool waited) {
  KvAppendAttend& c = *call;
  const absl::Time t_prepare = absl::Now();
  // Reserved now, not at each launch: the launches on several devices must
  // see one reservation. Calls on the same (sequence, layer) still apply in
  // order (the next one goes after this one's Release).
  absl::Status status = BindOutputs(c);
  if (status.ok()) status = cache->ReserveSpanning(c.layer, c.steps, &c.reservation, *c.names);
  if (status.ok()) {
    status = BuildSpanGroups(c, &c.span_groups);
    if (!status.ok()) cache->Rollback(&c.reservation);
  }
  if (!status.ok()) {
    Finish(cache, *ticket);
    done(status, WorkTimings{});
    return;
  }
  const size_t n_groups = c.span_groups.size();
  c.span_times = {};
  c.span_times.launches.resize(n_groups);
  struct Join {
    absl::Mutex mu;
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    absl::Status status ABSL_GUARDED_BY(mu);
    WorkTimings timings ABSL_GUARDED_BY(mu);
  };
  auto join = std::make_shared<Join>();
  {
    absl::MutexLock lock(&join->mu);
    join->remaining = n_groups;
    join->timings.device = cache->device();
  }
  // Runs once, after the last launch: the merge, then commit or rollback.
  auto complete = [this, cache, call, done, ticket, join] {
    absl::Status status;
    WorkTimings timings;
    {
      absl::MutexLock lock(&join->mu);
      status = join->status;
      timings = join->timings;
    }
    if (status.ok() && call->inputs_intact) status = call->inputs_intact();
    if (status.ok()) {
      const absl::Time t_merge = absl::Now();
      MergeSpanGroups(*call, call->span_groups);
      call->span_times.merge_us = absl::ToInt64Microseconds(absl::Now() - t_merge);
      cache->Commit(call->layer, call->steps, &call->reservation);
      call->lengths = call->reservation.lengths;
    } else {
      cache->Rollback(&call->reservation);
    }
    call->span_groups.clear();
    Finish(cache, *ticket);
    done(status, timings);
  };
  // Each launch reports into its own slot of span_times (written before the
  // last launch's `complete`, which reads them, under join's lock).
  KvAppendAttend::SpanTimes* times = &c.span_times;
  auto launched = [join, complete, times](size_t gi, const absl::Status& s, const WorkTimings& t) {
    bool last = false;
    {
      absl::MutexLock lock(&join->mu);
      if (!s.ok() && join->status.ok()) join->status = s;
      times->launches[gi] = t;
      WorkTimings& w = join->timings;
      w.queue_us = std::max(w.queue_us, t.queue_us);
      w.host_to_device_us = std::max(w.host_to_device_us, t.host_to_device_us);
      w.compute_us = std::max(w.compute_us, t.compute_us);
      w.device_to_host_us = std::max(w.device_to_host_us, t.device_to_host_us);
      last = --join->remaining == 0;
    }
    if (last) complete();
  };
  c.span_times.prepare_us = absl::ToInt64Microseconds(absl::Now() - t_prepare);
  // The groups live in the call until `complete`; each launch's params are
  // built already (BuildSpanGroups orders them: the steps' last segments,
  // which also append, start first).
  // By index: once the last launch is submitted, `complete` may clear them.
  for (size_t gi = 0; gi < n_groups; ++gi) {
    KvSpanGroup& g = c.span_groups[gi];
    const int device = c.reservation.shard_devices[size_t(g.shard)];
    const KvDevice* at = nullptr;
    for (const KvDevice& d : devices_) {
      if (d.index == device) at = &d;
    }
    WorkItem item;
    item.received = c.received;
    item.deadline = c.deadline;
    item.cancelled = c.cancelled;
    item.follows_admitted = waited;
    item.tenant = cache->tenant();
    // The devices' launches run at once. A backend with a pipeline only
    // starts a launch on the submitting thread (its completer waits for it),
    // so this thread may start them all back to back without waking each
    // device's launcher; without one the whole launch would run here, one
    // device after the other.
    item.no_inline = n_groups > 1 && (at == nullptr || at->backend->max_launches_in_flight() <= 1);
    PagedWork work;
    work.cache = &g;  // its own launch: never shared with another call's
    work.layer = c.layer;
    work.rows = PagedShape(c.dtype, g.params.attn.batch, c.num_heads_q, c.num_heads_kv, c.head_dim,
                           g.cu_q.data(), g.cu_k.data(), nullptr);
    const PagedAttnParams* params = &g.params;
    work.reserve = [params]() -> absl::StatusOr<PagedAttnParams> { return *params; };
    item.paged = std::move(work);
    item.done = [launched, gi](const absl::Status& s, const WorkTimings& t) { launched(gi, s, t); };
    Executor* executor = at != nullptr ? at->executor : nullptr;
    const absl::Status admitted = executor != nullptr
                                      ? executor->Submit(std::move(item))
                                      : absl::InternalError("the cache's device has no executor");
    if (!admitted.ok()) launched(gi, admitted, WorkTimings{});
  }
}

void KvPool::Finish(const std::shared_ptr<KvCache>& cache, const KvCache::Ticket& ticket) {
  for (const std::shared_ptr<KvCache::Ticket>& next : cache->Release(ticket)) next->go(next);
}

KvPoolStats KvPool::Stats() {
  KvPoolStats s;
  std::vector<std::shared_ptr<KvCache>> caches;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, cache] : caches_) caches.push_back(cache);
    s.expired_caches = expired_caches_;
    s.expired_sequences = expired_sequences_gone_;
  }
  for (size_t i = 0; i < devices_.size(); ++i) {
    KvPoolStats::Device d;
    d.index = devices_[i].index;
    d.bytes_used = budgets_[i]->used();
    d.bytes_limit = budgets_[i]->limit();
    s.devices.push_back(d);
  }
  s.caches = static_cast<int64_t>(caches.size());
  for (const std::shared_ptr<KvCache>& cache : caches) {
    const KvCacheStats cs = cache->Stats();
    s.sequences += cs.sequences;
    s.expired_sequences += cs.expired_sequences;
    for (const KvShardStats& shard : cs.shards) {
      for (KvPoolStats::Device& d : s.devices) {
        if (d.index != shard.device) continue;
        d.pages_used += shard.pages_used;
        d.pages_capacity += shard.capacity_pages;
      }
    }
  }
  return s;
}

}  // namespace attnserve
