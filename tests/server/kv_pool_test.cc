// The K/V pool (server/kv): the page allocator (O(1) free list, slabs on
// demand, the device budget), a cache's sequences against a simple model over
// random operation sequences (forks, copy-on-write, truncate, free, rollback),
// and the pool's rules through a real executor and the CPU backend: tenants,
// ordering of calls on one sequence, all-or-nothing on failure, expiry.
#include "server/kv/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/executor.h"
#include "server/kv/kv_cache.h"
#include "server/kv/page_allocator.h"
#include "server/kv/startup_cache.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

TEST(PageAllocatorTest, SlabsOnDemandAndFreeList) {
  auto backend = MakeCpuBackend(1);
  auto budget = std::make_shared<DeviceBudget>(1 << 20);
  // 100 pages of 64 bytes: 4 pages per slab (100 / 32 rounded up to 4).
  PageAllocator a(backend.get(), budget, 16, 64, 100);
  EXPECT_EQ(a.pages().slab_shift, 2);
  EXPECT_EQ(a.pages().num_slabs, 0);
  EXPECT_EQ(budget->used(), 0);  // a maximum, not a reservation
  std::vector<int32_t> pages;
  ASSERT_TRUE(a.Allocate(5, &pages).ok());
  EXPECT_EQ(a.pages().num_slabs, 2);
  EXPECT_EQ(budget->used(), 2 * a.slab_bytes());
  EXPECT_EQ(a.pages_used(), 5);
  std::set<int32_t> distinct(pages.begin(), pages.end());
  EXPECT_EQ(distinct.size(), 5u);
  a.AddRef(pages[0]);
  a.Release(pages[0]);
  EXPECT_EQ(a.pages_used(), 5);  // still referenced once
  a.Release(pages[0]);
  EXPECT_EQ(a.pages_used(), 4);
  std::vector<int32_t> again;
  ASSERT_TRUE(a.Allocate(1, &again).ok());
  EXPECT_EQ(again[0], pages[0]);  // the free list hands it back first
  // Capacity: 100 pages at most, named in the error.
  std::vector<int32_t> more;
  const absl::Status full = a.Allocate(96, &more);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("needs 96 pages, 95 are free"), std::string::npos) << full;
  EXPECT_TRUE(more.empty());
  ASSERT_TRUE(a.Allocate(95, &more).ok());
  EXPECT_EQ(a.pages_free(), 0);
  for (int32_t p : more) EXPECT_LT(p, 100);
}

TEST(PageAllocatorTest, SharedBudgetAndReserve) {
  auto backend = MakeCpuBackend(1);
  auto budget =
      std::make_shared<DeviceBudget>(3 * 2 * 64 * 4);  // three slabs of 4 pages of 64 + 64 bytes
  PageAllocator a(backend.get(), budget, 16, 64, 128);
  PageAllocator b(backend.get(), budget, 16, 64, 128);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a.Allocate(8, &pages).ok());
  const absl::Status s = b.Allocate(8, &pages);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--kv_cache_bytes"), std::string::npos) << s;
  EXPECT_EQ(b.pages_used(), 0);
  PageAllocator c(backend.get(), budget, 16, 64, 8);
  EXPECT_EQ(c.ReserveAll().code(), absl::StatusCode::kResourceExhausted);
}

// A cache driven the way the executor drives it, with the backend's copy and
// append emulated here, checked against a model: every sequence's tokens per
// layer (one float per token: D = 8, Hkv = 1, FP32, value in lane 0).
class CacheModelTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 2;
  static constexpr int kPageSize = 16;
  CacheModelTest()
      : backend_(MakeCpuBackend(1)),
        budget_(std::make_shared<DeviceBudget>(int64_t{1} << 24)),
        cache_("t", "c", KvGeometry{kLayers, 1, 8, DType::kFP32}, kPageSize, 48, 0, backend_.get(),
               budget_) {}

  float* Row(const KvPages& kv, void* const* slabs, int32_t page, int token) {
    return static_cast<float*>(slabs[PageSlab(kv, page)]) + PageRowOffset(kv, page, token, 1, 8, 0);
  }

  // What the backend does with a reservation: copies, then the new rows.
  void Emulate(const KvReservation& r, const std::vector<KvStep>& steps,
               const std::vector<std::vector<float>>& values) {
    const int64_t page_floats = kPageSize * 8;
    for (size_t i = 0; i < r.copy_src.size(); ++i) {
      std::memcpy(Row(r.pages, r.pages.k_slabs, r.copy_dst[i], 0),
                  Row(r.pages, r.pages.k_slabs, r.copy_src[i], 0), page_floats * 4);
    }
    for (size_t i = 0; i < steps.size(); ++i) {
      const int32_t first = r.seqlens[i] - steps[i].num_new;
      for (int t = 0; t < steps[i].num_new; ++t) {
        const int pos = first + t;
        const int32_t page = r.block_table[i * r.stride + pos / kPageSize];
        Row(r.pages, r.pages.k_slabs, page, pos % kPageSize)[0] = values[i][t];
      }
    }
  }

  // Every sequence's content and length equal the model's; pages_used counts
  // the distinct pages the sequences hold.
  void Verify() {
    std::set<int32_t> held;
    for (const auto& [id, layers] : model_) {
      for (int l = 0; l < kLayers; ++l) {
        KvReservation r;
        std::vector<KvStep> steps = {{id, int32_t(layers[l].size()), 0, 0}};
        ASSERT_TRUE(cache_.Reserve(l, steps, &r).ok());
        ASSERT_EQ(r.seqlens[0], int32_t(layers[l].size()));
        for (size_t t = 0; t < layers[l].size(); ++t) {
          const int32_t page = r.block_table[t / kPageSize];
          ASSERT_EQ(Row(r.pages, r.pages.k_slabs, page, int(t % kPageSize))[0], layers[l][t])
              << "sequence " << id << " layer " << l << " token " << t;
        }
        for (size_t p = 0; p < (layers[l].size() + kPageSize - 1) / kPageSize; ++p)
          held.insert(r.block_table[p]);
        cache_.Rollback(&r);
      }
    }
    EXPECT_EQ(cache_.Stats().pages_used, int64_t(held.size()));
    EXPECT_EQ(cache_.Stats().sequences, int64_t(model_.size()));
  }

  std::unique_ptr<AttentionBackend> backend_;
  std::shared_ptr<DeviceBudget> budget_;
  KvCache cache_;
  std::map<uint64_t, std::vector<std::vector<float>>> model_;
  float next_value_ = 1.0f;
};

TEST_F(CacheModelTest, RandomOperations) {
  std::mt19937 rng(5);
  uint64_t next_id = 1;
  int appended = 0, exhausted = 0, forks = 0, cows = 0;
  for (int iter = 0; iter < 600; ++iter) {
    const int op = int(rng() % 10);
    std::vector<uint64_t> ids;
    for (const auto& [id, unused] : model_) ids.push_back(id);
    auto pick = [&] { return ids[rng() % ids.size()]; };
    if (op == 0 || ids.empty()) {
      const uint64_t id = next_id++;
      ASSERT_TRUE(cache_.CreateSequences({{id, {}, {}}}).ok());
      model_[id] = std::vector<std::vector<float>>(kLayers);
    } else if (op == 1) {
      const uint64_t src = pick();
      int32_t shortest = INT32_MAX;
      for (const auto& l : model_[src]) shortest = std::min<int32_t>(shortest, int32_t(l.size()));
      const int32_t len = int32_t(rng() % (shortest + 1));
      const uint64_t id = next_id++;
      ASSERT_TRUE(cache_.CreateSequences({{id, src, len}}).ok());
      model_[id] = model_[src];
      for (auto& l : model_[id]) l.resize(size_t(len));
      ++forks;
    } else if (op <= 6) {
      // An append over 1..3 distinct sequences at one layer.
      const int layer = int(rng() % kLayers);
      std::set<uint64_t> chosen;
      const int n = 1 + int(rng() % 3);
      for (int i = 0; i < n; ++i) chosen.insert(pick());
      std::vector<KvStep> steps;
      std::vector<std::vector<float>> values;
      for (uint64_t id : chosen) {
        const int added = int(rng() % 40);
        steps.push_back({id, int32_t(model_[id][layer].size()), added, 0});
        values.emplace_back();
        for (int t = 0; t < added; ++t) values.back().push_back(next_value_++);
      }
      const int64_t used_before = cache_.Stats().pages_used;
      KvReservation r;
      const absl::Status s = cache_.Reserve(layer, steps, &r);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
        EXPECT_EQ(cache_.Stats().pages_used, used_before);
        ++exhausted;
      } else {
        cows += int(r.copy_src.size());
        Emulate(r, steps, values);
        if (rng() % 8 == 0) {
          cache_.Rollback(&r);  // a failed launch: nothing changes
        } else {
          cache_.Commit(layer, steps, &r);
          for (size_t i = 0; i < steps.size(); ++i) {
            auto& l = model_[steps[i].sequence_id][layer];
            l.insert(l.end(), values[i].begin(), values[i].end());
          }
          ++appended;
        }
      }
    } else if (op == 7) {
      const uint64_t id = pick();
      const bool all = rng() % 2 == 0;
      const int layer = int(rng() % kLayers);
      int32_t limit = INT32_MAX;
      for (int l = 0; l < kLayers; ++l) {
        if (all || l == layer) limit = std::min<int32_t>(limit, int32_t(model_[id][l].size()));
      }
      const int32_t len = int32_t(rng() % (limit + 1));
      ASSERT_TRUE(
          cache_.Truncate(id, all ? std::nullopt : std::optional<int32_t>(layer), len).ok());
      for (int l = 0; l < kLayers; ++l) {
        if (all || l == layer) model_[id][l].resize(size_t(len));
      }
    } else {
      const uint64_t id = pick();
      ASSERT_TRUE(cache_.Free({id}).ok());
      model_.erase(id);
    }
    Verify();
    if (HasFatalFailure()) return;
  }
  // The run exercised what it is meant to.
  EXPECT_GT(appended, 100);
  EXPECT_GT(forks, 20);
  EXPECT_GT(cows, 5);
  EXPECT_GT(exhausted, 0);
}

TEST_F(CacheModelTest, StaleLengthNamesActualAndChangesNothing) {
  ASSERT_TRUE(cache_.CreateSequences({{7, {}, {}}}).ok());
  KvReservation r;
  ASSERT_TRUE(cache_.Reserve(0, {{7, 0, 20, 0}}, &r).ok());
  cache_.Commit(0, {{7, 0, 20, 0}}, &r);
  const absl::Status s = cache_.Reserve(0, {{7, 0, 20, 0}}, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("has 20 tokens at layer 0, the call expected 0"), std::string::npos)
      << s;
  EXPECT_EQ((*cache_.Lengths(7))[0], 20);
  EXPECT_EQ(cache_.Stats().pages_used, 2);
}

TEST_F(CacheModelTest, CreateErrorsAreAllOrNothing) {
  ASSERT_TRUE(cache_.CreateSequences({{1, {}, {}}}).ok());
  EXPECT_EQ(cache_.CreateSequences({{2, {}, {}}, {1, {}, {}}}).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cache_.CreateSequences({{3, {}, {}}, {4, 99, {}}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_.CreateSequences({{5, 1, 3}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_.Stats().sequences, 1);
  EXPECT_EQ(cache_.Free({1, 2}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_.Stats().sequences, 1);
  EXPECT_EQ(cache_.Truncate(1, std::nullopt, 1).code(), absl::StatusCode::kInvalidArgument);
}

// A call's claim on `ids` at `layer`, as the pool makes one.
std::shared_ptr<KvCache::Ticket> MakeTicket(int layer, std::vector<uint64_t> ids) {
  auto t = std::make_shared<KvCache::Ticket>();
  t->layer = layer;
  t->sequence_ids = std::move(ids);
  return t;
}

TEST_F(CacheModelTest, ClaimsOrderCallsOnOneSequenceLayer) {
  ASSERT_TRUE(cache_.CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  auto a = MakeTicket(0, {1});
  auto b = MakeTicket(0, {1, 2});  // waits for a (sequence 1)
  auto c = MakeTicket(0, {2});     // waits for b (arrival order on sequence 2)
  auto d = MakeTicket(1, {1});     // another layer: goes
  EXPECT_TRUE(*cache_.Admit(a));
  EXPECT_FALSE(*cache_.Admit(b));
  EXPECT_FALSE(*cache_.Admit(c));
  EXPECT_TRUE(*cache_.Admit(d));
  EXPECT_EQ(cache_.Admit(MakeTicket(0, {9})).status().code(), absl::StatusCode::kNotFound);
  // Busy sequences cannot be freed or truncated.
  EXPECT_EQ(cache_.Free({1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache_.Truncate(2, 0, 0).code(), absl::StatusCode::kFailedPrecondition);
  auto ready = cache_.Release(*a);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0], b);
  EXPECT_TRUE(cache_.Release(*d).empty());
  ready = cache_.Release(*b);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0], c);
  EXPECT_TRUE(cache_.Release(*c).empty());
  EXPECT_TRUE(cache_.Free({1, 2}).ok());
}

// v2's sequence_end racing other calls: the end is deferred to the last call
// in flight (queued ones included), later calls are refused, and the sequence
// is gone once that call releases.
TEST_F(CacheModelTest, FreeWhenIdleWaitsForTheLastCallInFlight) {
  ASSERT_TRUE(cache_.CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  auto running = MakeTicket(0, {1});
  auto queued = MakeTicket(0, {1});  // waits behind `running`
  auto other_layer = MakeTicket(1, {1});
  EXPECT_TRUE(*cache_.Admit(running));
  EXPECT_FALSE(*cache_.Admit(queued));
  EXPECT_TRUE(*cache_.Admit(other_layer));
  absl::StatusOr<bool> freed = cache_.FreeWhenIdle(1);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_FALSE(*freed);  // deferred
  const absl::Status late = cache_.Admit(MakeTicket(2, {1})).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(late.message().find("sequence 1 is ending"), std::string::npos) << late;
  ASSERT_EQ(cache_.Release(*running).size(), 1u);  // `queued` goes
  EXPECT_TRUE(cache_.Lengths(1).ok());
  EXPECT_TRUE(cache_.Release(*other_layer).empty());
  EXPECT_TRUE(cache_.Lengths(1).ok());  // `queued` still in flight
  EXPECT_TRUE(cache_.Release(*queued).empty());
  EXPECT_EQ(cache_.Lengths(1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(cache_.Lengths(2).ok());
  // An idle sequence is freed at once; an unknown one is NOT_FOUND.
  freed = cache_.FreeWhenIdle(2);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_TRUE(*freed);
  EXPECT_EQ(cache_.Lengths(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_.FreeWhenIdle(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_.Stats().pages_used, 0);
}

// --kv_startup_cache: the spec syntax; what the pool checks (geometry,
// budget) is tested with the pool.
TEST(StartupCacheTest, ParsesSpecsAndNamesTheBadKey) {
  absl::StatusOr<std::vector<KvStartupCache>> caches = ParseStartupCaches(
      "a:layers=2,hkv=8,d=128,dtype=bf16,page_size=64,capacity_tokens=4096 ; "
      "b:layers=1,hkv=1,d=64,dtype=FP32,capacity_bytes=1048576,device=0,reserve=1,tenant=t1");
  ASSERT_TRUE(caches.ok()) << caches.status();
  ASSERT_EQ(caches->size(), 2u);
  const KvCreateCache& a = (*caches)[0].create;
  EXPECT_EQ(a.cache_id, "a");
  EXPECT_EQ(a.geometry.num_layers, 2);
  EXPECT_EQ(a.geometry.num_heads_kv, 8);
  EXPECT_EQ(a.geometry.head_dim, 128);
  EXPECT_EQ(a.geometry.dtype, DType::kBF16);
  EXPECT_EQ(a.page_size, 64);
  EXPECT_EQ(a.capacity_tokens, 4096);
  EXPECT_TRUE(a.keep);
  EXPECT_EQ((*caches)[0].tenant, "");
  const KvCreateCache& b = (*caches)[1].create;
  EXPECT_EQ(b.capacity_bytes, 1048576);
  EXPECT_EQ(b.device, 0);
  EXPECT_TRUE(b.reserve);
  EXPECT_EQ((*caches)[1].tenant, "t1");
  EXPECT_EQ(a.geometry.head_dim_v, 0);
  EXPECT_FALSE(a.geometry.v_in_k);
  EXPECT_TRUE(ParseStartupCaches("")->empty());
  // MLA caches: V's own width, and V inside K.
  caches = ParseStartupCaches(
      "m:layers=1,hkv=1,d=576,dv=512,v_in_k=1,dtype=BF16,capacity_tokens=64;"
      "n:layers=1,hkv=2,d=192,dv=128,v_in_k=0,dtype=FP16,capacity_tokens=64");
  ASSERT_TRUE(caches.ok()) << caches.status();
  ASSERT_EQ(caches->size(), 2u);
  EXPECT_EQ((*caches)[0].create.geometry.head_dim, 576);
  EXPECT_EQ((*caches)[0].create.geometry.head_dim_v, 512);
  EXPECT_TRUE((*caches)[0].create.geometry.v_in_k);
  EXPECT_EQ((*caches)[1].create.geometry.head_dim_v, 128);
  EXPECT_FALSE((*caches)[1].create.geometry.v_in_k);
  const std::pair<const char*, const char*> bad[] = {
      {"layers=1", "expected ID:key=value"},
      {"a:layers=x,hkv=1,d=64,dtype=FP16,capacity_tokens=1",
       "cache 'a': layers: expected an integer >= 1, got 'x'"},
      {"a:layers=1,hkv=1,d=64,dtype=FP8,capacity_tokens=1",
       "dtype: expected FP16, BF16 or FP32, got 'FP8'"},
      {"a:layers=1,hkv=1,d=64,capacity_tokens=1", "missing key 'dtype'"},
      {"a:layers=1,hkv=1,d=64,dtype=FP16", "exactly one of capacity_tokens and capacity_bytes"},
      {"a:layers=1,layers=2", "key 'layers' given twice"},
      {"a:layers=1,heads=2", "unknown key 'heads'"},
      {"a:layers=1,hkv=1,d=64,dv=0,dtype=FP16,capacity_tokens=1",
       "dv: expected an integer >= 1, got '0'"},
      {"a:layers=1,hkv=1,d=64,v_in_k=yes,dtype=FP16,capacity_tokens=1",
       "v_in_k: expected 0 or 1, got 'yes'"},
      {"a:layers=1,hkv=1,d=64,dtype=FP16,capacity_tokens=1;a:layers=1,hkv=1,d=64,dtype=FP16,"
       "capacity_tokens=1",
       "named twice"},
  };
  for (const auto& [spec, message] : bad) {
    const absl::Status st = ParseStartupCaches(spec).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(st.message().find(message), std::string::npos) << spec << " -> " << st;
  }
}

// The pool over a real executor and the (gated) CPU backend.
class PoolTest : public ::testing::Test {
 protected:
  explicit PoolTest(const ExecutorOptions& options = ExecutorOptions{})
      : executor_(&backend_, options) {}
  void MakePool(absl::Duration idle = absl::ZeroDuration()) {
    KvPoolOptions o;
    o.cache_bytes_per_device = int64_t{1} << 24;
    o.idle_timeout = idle;
    pool_ = std::make_unique<KvPool>(o, std::vector<KvDevice>{{&backend_, &executor_, 0}});
  }
  std::shared_ptr<KvCache> Cache(const std::string& tenant = "t") {
    KvCreateCache r;
    r.geometry = {1, 1, 8, DType::kFP32};
    r.capacity_tokens = 4096;
    auto cache = pool_->CreateCache(tenant, r);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return *cache;
  }
  // An append of `n` rows (and one query) to sequence `id` expecting `len`.
  std::shared_ptr<KvAppendAttend> Call(uint64_t id, int32_t len, int32_t n) {
    auto c = std::make_shared<KvAppendAttend>();
    c->steps = {{id, len, n, 1}};
    data_.emplace_back(size_t(8 * (n + 1)), 0.5f);
    // What the front-end decodes; the pool builds the params.
    c->dtype = DType::kFP32;
    c->num_heads_q = 1;
    c->num_heads_kv = 1;
    c->head_dim = 8;
    c->options.softmax_scale = 0.35f;
    c->inputs.q = c->inputs.k = c->inputs.v = data_.back().data();
    return c;
  }
  struct Result {
    absl::Notification done;
    absl::Status status;
  };
  std::shared_ptr<Result> Run(const std::shared_ptr<KvCache>& cache,
                              const std::shared_ptr<KvAppendAttend>& call) {
    auto result = std::make_shared<Result>();
    const absl::Status s =
        pool_->AppendAttend(cache, call, [result](const absl::Status& st, const WorkTimings&) {
          result->status = st;
          result->done.Notify();
        });
    if (!s.ok()) {
      result->status = s;
      result->done.Notify();
    }
    return result;
  }

  GatedCpuBackend backend_;
  Executor executor_;
  std::unique_ptr<KvPool> pool_;
  std::deque<std::vector<float>> data_;
};

TEST_F(PoolTest, TenantsAndNames) {
  MakePool();
  auto cache = Cache("alice");
  EXPECT_EQ(pool_->Find("bob", cache->id()).status().code(), absl::StatusCode::kNotFound);
  // Word for word what a never-created id gets.
  EXPECT_EQ(
      absl::StrReplaceAll(pool_->Find("bob", "never").status().message(), {{"never", cache->id()}}),
      absl::StrReplaceAll(pool_->Find("bob", cache->id()).status().message(),
                          {{"never", cache->id()}}));
  EXPECT_EQ(pool_->DropCache("bob", cache->id()).code(), absl::StatusCode::kNotFound);
  KvCreateCache r;
  r.geometry = {1, 1, 8, DType::kFP32};
  r.capacity_tokens = 64;
  r.cache_id = cache->id();
  EXPECT_EQ(pool_->CreateCache("alice", r).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(pool_->CreateCache("bob", r).ok());  // names are per tenant
  r.page_size = 24;
  EXPECT_EQ(pool_->CreateCache("carol", r).status().code(), absl::StatusCode::kInvalidArgument);
  r.page_size = 0;
  r.capacity_bytes = 10;
  EXPECT_EQ(pool_->CreateCache("carol", r).status().code(), absl::StatusCode::kInvalidArgument);
  r.capacity_bytes = 0;
  r.capacity_tokens = int64_t{1} << 40;
  EXPECT_EQ(pool_->CreateCache("carol", r).status().code(), absl::StatusCode::kResourceExhausted);
  r.capacity_tokens = 64;
  r.device = 3;
  EXPECT_EQ(pool_->CreateCache("carol", r).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool_->DropCache("alice", cache->id()).ok());
  EXPECT_EQ(pool_->Find("alice", cache->id()).status().code(), absl::StatusCode::kNotFound);
}

// capacity_tokens near 2^63 once overflowed into a negative page count and an
// error naming capacity_bytes; num_layers had no upper bound.
TEST_F(PoolTest, CapacityAndLayersAreBoundedNamingTheField) {
  MakePool();
  KvCreateCache r;
  r.geometry = {1, 1, 8, DType::kFP32};
  r.capacity_tokens = std::numeric_limits<int64_t>::max();
  absl::Status s = pool_->CreateCache("t", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("capacity_tokens"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("capacity_bytes"), std::string::npos) << s;
  r.capacity_tokens = 0;
  r.capacity_bytes = std::numeric_limits<int64_t>::max();
  s = pool_->CreateCache("t", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("capacity_bytes"), std::string::npos) << s;
  r.capacity_bytes = 0;
  r.capacity_tokens = 64;
  r.geometry.num_layers = kMaxKvLayers + 1;
  s = pool_->CreateCache("t", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("num_layers"), std::string::npos) << s;
  r.geometry.num_layers = kMaxKvLayers;
  EXPECT_TRUE(pool_->CreateCache("t", r).ok());
}

// Each sequence's per-layer bookkeeping is charged: to the device budget
// (empty sequences once held memory nothing counted), and to the tenant's
// kv_pages quota in pages of its cache.
TEST_F(PoolTest, SequenceBookkeepingIsCharged) {
  MakePool();
  KvCreateCache r;
  r.geometry = {kMaxKvLayers, 1, 8, DType::kFP32};
  r.page_size = 16;
  r.capacity_tokens = 32;
  auto cache = pool_->CreateCache("t", r);
  ASSERT_TRUE(cache.ok()) << cache.status();
  // 16 MiB of budget: a few hundred sequences of 1024 layers, not unbounded.
  const int64_t per_sequence = KvSequenceBytes(kMaxKvLayers);
  const int64_t fit = (int64_t{1} << 24) / per_sequence;
  std::vector<KvSequenceSpec> specs;
  for (int64_t i = 0; i < fit + 1; ++i) specs.push_back({uint64_t(i), {}, {}});
  absl::Status s = (*cache)->CreateSequences(specs);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ((*cache)->Stats().sequences, 0);  // all or nothing
  specs.resize(size_t(fit / 2));
  ASSERT_TRUE((*cache)->CreateSequences(specs).ok());
  EXPECT_GE(pool_->Stats().devices[0].bytes_used, int64_t(specs.size()) * per_sequence);
  std::vector<uint64_t> ids;
  for (const KvSequenceSpec& spec : specs) ids.push_back(spec.sequence_id);
  ASSERT_TRUE((*cache)->Free(ids).ok());
  EXPECT_EQ(pool_->Stats().devices[0].bytes_used, 0);

  // kv_pages=4: the cache's 2 pages plus one sequence's 33 KB of
  // bookkeeping (33 pages of 1 KiB) do not fit.
  TenantDirectory tenants;
  tenants.SetQuotas({{"q", TenantQuotas{0, 4, 0}}});
  pool_->set_tenants(&tenants);
  auto limited = pool_->CreateCache("q", r);
  ASSERT_TRUE(limited.ok()) << limited.status();
  s = (*limited)->CreateSequences({{1, {}, {}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("kv_pages"), std::string::npos) << s;
  r.geometry.num_layers = 1;
  r.capacity_tokens = 16;  // one page, and two sequences' 576 bytes one more: 4 in all
  auto small = pool_->CreateCache("q", r);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE((*small)->CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  pool_->set_tenants(nullptr);
}

TEST_F(PoolTest, IdListsAreBounded) {
  MakePool();
  auto cache = Cache();
  std::vector<KvSequenceSpec> specs;
  std::vector<uint64_t> ids;
  for (int i = 0; i <= kMaxKvIdsPerCall; ++i) {
    specs.push_back({uint64_t(i), {}, {}});
    ids.push_back(uint64_t(i));
  }
  EXPECT_EQ(cache->CreateSequences(specs).code(), absl::StatusCode::kInvalidArgument);
  specs.pop_back();
  ASSERT_TRUE(cache->CreateSequences(specs).ok());
  EXPECT_EQ(cache->Free(ids).code(), absl::StatusCode::kInvalidArgument);
  ids.pop_back();
  EXPECT_TRUE(cache->Free(ids).ok());
}

// The tenant of a call whose credentials name none owns nothing and is
// refused by every stateful call (it once shared caches between callers).
TEST_F(PoolTest, WithdrawnTenantIsRefused) {
  MakePool();
  TenantDirectory tenants;
  tenants.SetQuotas({{"a", TenantQuotas{}}});
  pool_->set_tenants(&tenants);
  KvCreateCache r;
  r.geometry = {1, 1, 8, DType::kFP32};
  r.capacity_tokens = 64;
  r.cache_id = "c";
  EXPECT_EQ(pool_->CreateCache(kWithdrawnTenant, r).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(pool_->Find(kWithdrawnTenant, "c").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(pool_->DropCache(kWithdrawnTenant, "c").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tenants.ChargeInFlight(kWithdrawnTenant, 1).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tenants.CheckShmRegions(kWithdrawnTenant, 0).code(),
            absl::StatusCode::kUnauthenticated);
  pool_->set_tenants(nullptr);
}

// The fair share (SECURITY.md): without a kv_pages quota a tenant may
// reserve at most --kv_cache_bytes / (tenants in the tokens file) of a
// device, and capacities are reserved at creation, so a cache that was
// created can always grow to its capacity. Before, one tenant without a
// quota could take the whole pool and others' first appends failed.
TEST_F(PoolTest, TenantsWithoutAQuotaGetAFairShare) {
  MakePool();
  TenantDirectory tenants;
  tenants.SetQuotas({{"a", TenantQuotas{}},
                     {"b", TenantQuotas{}},
                     {"big", TenantQuotas{0, int64_t{1} << 20, 0}}});
  pool_->set_tenants(&tenants);
  const int64_t budget = int64_t{1} << 24;
  KvCreateCache r;
  r.geometry = {1, 1, 8, DType::kFP32};  // 1 KiB pages of 16 tokens
  r.page_size = 16;
  r.capacity_bytes = budget / 2;
  absl::Status s = pool_->CreateCache("a", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("kv_share"), std::string::npos) << s;
  r.capacity_bytes = budget / 4;
  ASSERT_TRUE(pool_->CreateCache("a", r).ok());
  r.capacity_bytes = budget / 16;
  EXPECT_TRUE(pool_->CreateCache("a", r).ok());
  EXPECT_EQ(pool_->CreateCache("a", r).status().code(), absl::StatusCode::kResourceExhausted);
  // The explicit quota is the operator's, but never more than is left.
  r.capacity_bytes = budget / 4 * 3;
  s = pool_->CreateCache("big", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--kv_cache_bytes"), std::string::npos) << s;
  r.capacity_bytes = budget / 4;
  ASSERT_TRUE(pool_->CreateCache("big", r).ok());
  // b's share is intact: its cache fills to capacity.
  r.capacity_tokens = 0;
  r.capacity_bytes = budget / 4;
  auto b = pool_->CreateCache("b", r);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->ReserveAll().ok());
  pool_->set_tenants(nullptr);
}

TEST_F(PoolTest, CallsOnOneSequenceApplyInArrivalOrder) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  backend_.Close();
  auto first = Run(cache, Call(1, 0, 20));
  backend_.AwaitCalls(1);
  // Sent while the first is in flight, naming the length after it.
  auto second = Run(cache, Call(1, 20, 5));
  auto stale = Run(cache, Call(1, 0, 20));  // a retry of the first
  backend_.Open();
  first->done.WaitForNotification();
  second->done.WaitForNotification();
  stale->done.WaitForNotification();
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_TRUE(second->status.ok()) << second->status;
  EXPECT_EQ(stale->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale->status.message().find("has 25 tokens"), std::string::npos) << stale->status;
  EXPECT_EQ((*cache->Lengths(1))[0], 25);
}

// Batching on: calls of one cache and layer that queue together share a launch.
class BatchingPoolTest : public PoolTest {
 protected:
  BatchingPoolTest() : PoolTest(Batching()) {}
  static ExecutorOptions Batching() {
    ExecutorOptions o;
    o.batching = true;
    return o;
  }
};

// A K/V call is checked and planned once (CanImplementPaged, just before its
// launch) and the launch runs that plan: nothing plans it again, whether it
// runs alone or packed with other calls of its cache and layer.
TEST_F(BatchingPoolTest, PagedCallsArePlannedOnce) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}, {2, {}, {}}, {3, {}, {}}}).ok());
  backend_.Close();
  auto first = Run(cache, Call(1, 0, 20));
  backend_.AwaitCalls(1);
  EXPECT_EQ(backend_.paged_plans(), 1);
  // Queued while the first holds the launcher: one launch for both.
  auto second = Run(cache, Call(2, 0, 5));
  auto third = Run(cache, Call(3, 0, 7));
  backend_.Open();
  for (const auto& call : {first, second, third}) {
    call->done.WaitForNotification();
    EXPECT_TRUE(call->status.ok()) << call->status;
  }
  EXPECT_EQ(backend_.paged_launches(), 2);
  EXPECT_EQ(backend_.paged_plans(), 3);
  EXPECT_EQ((*cache->Lengths(2))[0], 5);
  EXPECT_EQ((*cache->Lengths(3))[0], 7);
}

// The executor's completer may drop the last reference to a cache (held by a
// finished call's callback) after the pool is gone: the cache's pages go back
// to a device budget it shares, which must still be alive. Here the cache
// outlives the pool deterministically (ASan would see a freed budget).
TEST_F(PoolTest, CacheOutlivesItsPool) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  auto call = Run(cache, Call(1, 0, 20));
  call->done.WaitForNotification();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_GT(cache->Stats().pages_used, 0);
  pool_.reset();
  cache.reset();  // gives its pages back to the (still alive) device budget
}

TEST_F(PoolTest, FailedLaunchChangesNothing) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  auto ok = Run(cache, Call(1, 0, 10));
  ok->done.WaitForNotification();
  ASSERT_TRUE(ok->status.ok());
  const int64_t pages = cache->Stats().pages_used;
  backend_.paged_fail = true;
  auto failed = Run(cache, Call(1, 10, 30));
  failed->done.WaitForNotification();
  EXPECT_EQ(failed->status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*cache->Lengths(1))[0], 10);
  EXPECT_EQ(cache->Stats().pages_used, pages);
  backend_.paged_fail = false;
  auto retry = Run(cache, Call(1, 10, 30));
  retry->done.WaitForNotification();
  EXPECT_TRUE(retry->status.ok()) << retry->status;
  EXPECT_EQ((*cache->Lengths(1))[0], 40);
}

// Inputs read in place from memory their owner took back during the launch
// (a shrunk shared-memory region): the call fails after the launch and the
// append does not commit.
TEST_F(PoolTest, InputsNoLongerIntactRollBack) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  auto ok = Run(cache, Call(1, 0, 10));
  ok->done.WaitForNotification();
  ASSERT_TRUE(ok->status.ok());
  const int64_t pages = cache->Stats().pages_used;
  auto call = Call(1, 10, 70);
  int checked = 0;
  call->inputs_intact = [&checked] {
    ++checked;
    return absl::FailedPreconditionError("region 'r' shrank");
  };
  auto failed = Run(cache, call);
  failed->done.WaitForNotification();
  EXPECT_EQ(failed->status.code(), absl::StatusCode::kFailedPrecondition) << failed->status;
  EXPECT_EQ(checked, 1);
  EXPECT_EQ((*cache->Lengths(1))[0], 10);
  EXPECT_EQ(cache->Stats().pages_used, pages);
  call = Call(1, 10, 70);
  call->inputs_intact = [] { return absl::OkStatus(); };
  auto retry = Run(cache, call);
  retry->done.WaitForNotification();
  EXPECT_TRUE(retry->status.ok()) << retry->status;
  EXPECT_EQ((*cache->Lengths(1))[0], 80);
}

TEST_F(PoolTest, IdleSequencesAndCachesExpire) {
  MakePool(absl::Hours(1));  // the thread never fires; ExpireIdle is driven here
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  auto call = Run(cache, Call(1, 0, 10));
  call->done.WaitForNotification();
  pool_->ExpireIdle(absl::Now());
  EXPECT_EQ(cache->Stats().sequences, 2);  // nothing idle for an hour yet
  pool_->ExpireIdle(absl::Now() + absl::Hours(2));
  EXPECT_EQ(cache->Stats().sequences, 0);
  EXPECT_EQ(cache->Stats().pages_used, 0);
  const KvPoolStats s = pool_->Stats();
  EXPECT_EQ(s.caches, 0);
  EXPECT_EQ(s.expired_caches, 1);
  EXPECT_EQ(s.expired_sequences, 2);
  EXPECT_EQ(pool_->Find("t", cache->id()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PoolTest, DrainRunsCallsThatWaited) {
  MakePool();
  auto cache = Cache();
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  backend_.Close();
  auto first = Run(cache, Call(1, 0, 1));
  backend_.AwaitCalls(1);
  auto second = Run(cache, Call(1, 1, 1));  // accepted, waiting for the first
  executor_.StopAdmitting();
  auto late = Run(cache, Call(1, 2, 1));  // after the drain began: refused
  backend_.Open();
  first->done.WaitForNotification();
  second->done.WaitForNotification();
  late->done.WaitForNotification();
  EXPECT_TRUE(first->status.ok());
  EXPECT_TRUE(second->status.ok()) << second->status;
  EXPECT_EQ(late->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*cache->Lengths(1))[0], 2);
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// Caches that name no device spread over the devices by what they may take
// (their capacities), not by pages in use, which are none before the first
// append: created back to back they alternate, and a large one counts large.
TEST(PlacementTest, CachesSpreadByCapacityBeforeAnyAppend) {
  GatedCpuBackend backends[2];
  Executor executor0(&backends[0], ExecutorOptions{});
  Executor executor1(&backends[1], ExecutorOptions{});
  KvPoolOptions o;
  o.cache_bytes_per_device = int64_t{1} << 24;
  o.idle_timeout = absl::ZeroDuration();
  KvPool pool(o, {{&backends[0], &executor0, 0}, {&backends[1], &executor1, 1}});
  auto create = [&](int64_t tokens) {
    KvCreateCache r;
    r.geometry = {1, 1, 8, DType::kFP32};
    r.capacity_tokens = tokens;
    absl::StatusOr<std::shared_ptr<KvCache>> cache = pool.CreateCache("t", r);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? (*cache)->device() : -1;
  };
  EXPECT_EQ(create(4096), 0);
  EXPECT_EQ(create(4096), 1);
  EXPECT_EQ(create(16384), 0);  // both hold 4096: the first device
  EXPECT_EQ(create(4096), 1);   // device 0 now holds 20480, device 1 4096
  EXPECT_EQ(create(4096), 1);   // 20480 against 8192
}

}  // namespace
}  // namespace attnserve
