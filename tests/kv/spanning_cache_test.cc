// K/V caches that span devices (docs/kv-cache.md, "Caches that span
// devices") on two CPU devices: a sequence longer than one device's pool
// decodes and matches the float64 reference over its whole length, appends
// open segments where the free pages are, a failed step changes nothing, an
// over-quota cache charges nothing, the log-sum-exp merge is exact for
// partials of very different sizes (an empty one too) and for FP16 and BF16
// caches, a step's launches start on the submitting thread only on pipelined
// backends, and what does not map onto segments is refused by name.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "backend/backend_factory.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"
#include "common/lse_merge.h"
#include "gtest/gtest.h"
#include "server/executor.h"
#include "server/kv/kv_pool.h"
#include "server/kv/kv_transfer.h"
#include "server/kv/segments.h"
#include "server/kv/startup_cache.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kPage = 16;
constexpr int64_t kRow = int64_t{kHkv} * kD;  // floats of one K (or V) row
// One page's K and V bytes (FP32).
constexpr int64_t kPageBytes = 2 * int64_t{kPage} * kRow * 4;

std::vector<float> Random(std::mt19937* rng, int64_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(*rng);
  return v;
}

// FP32 rule of backend/reference/tolerance.h: per output vector (row, head).
void ExpectMatchesReference(const std::vector<float>& o, const std::vector<float>& lse,
                            const ReferenceOutput& ref, int nq, const std::string& where) {
  ASSERT_EQ(o.size(), ref.o.size()) << where;
  for (int r = 0; r < nq; ++r) {
    for (int h = 0; h < kHq; ++h) {
      const size_t at = (size_t(r) * kHq + h) * kD;
      double scale = 0;
      for (int d = 0; d < kD; ++d) scale = std::max(scale, std::fabs(ref.o[at + d]));
      for (int d = 0; d < kD; ++d) {
        ASSERT_LE(std::fabs(o[at + d] - ref.o[at + d]),
                  tolerance::kFp32Rtol * scale + tolerance::kFp32Atol)
            << where << ": row " << r << " head " << h << " dim " << d;
      }
      const double l = ref.lse[size_t(h) * nq + r];
      const float got = lse[size_t(h) * nq + r];
      if (std::isinf(l)) {
        ASSERT_TRUE(std::isinf(got) && got < 0) << where << ": lse row " << r << " head " << h;
      } else {
        ASSERT_LE(std::fabs(got - l), tolerance::kFp32Rtol * std::fabs(l) + tolerance::kFp32LseAtol)
            << where << ": lse row " << r << " head " << h;
      }
    }
  }
}

// A pool over two gated CPU devices with `pages` pages of budget each.
class SpanningTest : public ::testing::Test {
 protected:
  SpanningTest() : ex0_(&backends_[0], ExecutorOptions{}), ex1_(&backends_[1], ExecutorOptions{}) {}

  void MakePool(int64_t pages_per_device) {
    KvPoolOptions o;
    // The pages plus the first device's sequence bookkeeping (a few hundred
    // bytes, less than a page).
    o.cache_bytes_per_device = pages_per_device * kPageBytes + kPageBytes;
    o.idle_timeout = absl::ZeroDuration();
    pool_ = std::make_unique<KvPool>(
        o, std::vector<KvDevice>{{&backends_[0], &ex0_, 0}, {&backends_[1], &ex1_, 1}});
  }

  std::shared_ptr<KvCache> Cache(int64_t pages, const std::string& tenant = "t") {
    KvCreateCache r;
    r.geometry = {1, kHkv, kD, DType::kFP32};
    r.page_size = kPage;
    r.capacity_tokens = pages * kPage;
    r.devices = {0, 1};
    absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->CreateCache(tenant, r);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? *cache : nullptr;
  }

  // One sequence's rows so far (the reference's K and V).
  struct History {
    std::vector<float> k, v;
    int32_t length() const { return static_cast<int32_t>(k.size() / size_t(kRow)); }
  };

  struct Result {
    absl::Status status;
    std::vector<float> o, lse;
  };

  // Appends `n` random rows to `id` (expecting h's length) and attends `nq`
  // random queries; on success the rows join `h` and the output is checked
  // against the float64 reference over the whole sequence.
  Result Step(const std::shared_ptr<KvCache>& cache, uint64_t id, History* h, int n, int nq,
              AttnOptions options = {}, const std::string& where = "") {
    std::vector<float> q = Random(&rng_, int64_t{nq} * kHq * kD + 1);
    std::vector<float> k = Random(&rng_, n * kRow + 1), v = Random(&rng_, n * kRow + 1);
    auto c = std::make_shared<KvAppendAttend>();
    c->steps = {{id, h->length(), n, nq}};
    c->dtype = DType::kFP32;
    c->num_heads_q = kHq;
    c->num_heads_kv = kHkv;
    c->head_dim = kD;
    c->options = options;
    c->inputs.q = q.data();
    c->inputs.k = k.data();
    c->inputs.v = v.data();
    c->inputs.mods = mods_;
    c->return_lse = true;
    Result result;
    absl::Notification done;
    absl::Status s = pool_->AppendAttend(cache, c, [&](const absl::Status& st, const WorkTimings&) {
      result.status = st;
      done.Notify();
    });
    if (!s.ok()) return {s, {}, {}};
    done.WaitForNotification();
    if (!result.status.ok()) return result;
    result.o.resize(c->o.size() / 4);
    std::memcpy(result.o.data(), c->o.data(), c->o.size());
    result.lse.resize(c->lse.size() / 4);
    std::memcpy(result.lse.data(), c->lse.data(), c->lse.size());
    EXPECT_EQ(c->lengths, std::vector<int32_t>{h->length() + n});
    h->k.insert(h->k.end(), k.begin(), k.begin() + n * kRow);
    h->v.insert(h->v.end(), v.begin(), v.begin() + n * kRow);
    const int32_t len = h->length();
    AttnPointers io;
    io.q = q.data();
    io.k = h->k.data();
    io.v = h->v.data();
    io.mods = mods_;
    const AttnParams p =
        MakeAttnParams(DenseShape(DType::kFP32, 1, nq, len, kHq, kHkv, kD), options, io);
    ExpectMatchesReference(result.o, result.lse, ReferenceAttention(p), nq,
                           where.empty() ? "length " + std::to_string(len) : where);
    return result;
  }

  std::vector<int64_t> PagesUsed(const std::shared_ptr<KvCache>& cache) {
    std::vector<int64_t> used;
    for (const KvShardStats& s : cache->Stats().shards) used.push_back(s.pages_used);
    return used;
  }

  GatedCpuBackend backends_[2];
  Executor ex0_, ex1_;
  std::unique_ptr<KvPool> pool_;
  std::mt19937 rng_{7};
  AttnMods mods_;
};

// 230 tokens where each device's pool holds 160 (10 pages): a causal prefill,
// then one token per step, every step against the reference over the whole
// sequence. The last segment grows on device 0 until its 8 pages are full;
// the next token opens a segment on device 1.
TEST_F(SpanningTest, SequenceLongerThanOneDevicesPoolDecodes) {
  MakePool(10);
  auto cache = Cache(16);  // 8 pages on each device
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->spanning());
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  History h;
  AttnOptions causal;
  causal.causal = true;
  ASSERT_TRUE(Step(cache, 1, &h, 40, 40, causal).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{3, 0}));
  while (h.length() < 128) ASSERT_TRUE(Step(cache, 1, &h, 1, 1, causal).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 0}));
  ASSERT_TRUE(Step(cache, 1, &h, 1, 1, causal).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 1}));
  while (h.length() < 230) ASSERT_TRUE(Step(cache, 1, &h, 1, 1, causal).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 7}));
  EXPECT_GT(h.length(), 10 * kPage);  // longer than one device's whole pool
  // A chunk of several queries in the last segment, causal across both.
  ASSERT_TRUE(Step(cache, 1, &h, 5, 5, causal).status.ok());
  // Attend only, not causal, over both segments.
  ASSERT_TRUE(Step(cache, 1, &h, 0, 3).status.ok());
  EXPECT_EQ(*cache->Lengths(1), std::vector<int32_t>{h.length()});
  // Sinks join one partial only.
  std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};
  mods_.sinks = sinks.data();
  ASSERT_TRUE(Step(cache, 1, &h, 1, 1, causal, "with sinks").status.ok());
  mods_ = {};
}

// FP16 and BF16 caches over both devices: the merge reads each partial's O
// in the cache's dtype and rounds the merged row once; decode steps and an
// attend-only step of several queries against the float64 reference with
// the low-precision rule (backend/reference/tolerance.h). Scores are large,
// so the partials' LSEs differ by much and a wrong weight fails.
TEST_F(SpanningTest, HalfPrecisionMergeMatchesReference) {
  MakePool(8);  // FP32-sized pages: a half-precision cache's 16 fit twice
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const std::string name(DTypeName(dtype));
    KvCreateCache r;
    r.geometry = {1, kHkv, kD, dtype};
    r.page_size = kPage;
    r.capacity_tokens = 16 * kPage;
    r.devices = {0, 1};
    r.cache_id = "half-" + name;
    absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->CreateCache("t", r);
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE((*cache)->CreateSequences({{1, {}, {}}}).ok());
    const int64_t es = DTypeSize(dtype);
    std::string hk, hv;  // the sequence's rows so far, in dtype
    auto rows = [&](int64_t n, float scale) {
      std::string b(size_t(n * es), '\0');
      const std::vector<float> f = Random(&rng_, n);
      for (int64_t i = 0; i < n; ++i) StoreFromFloat(b.data(), dtype, i, scale * f[size_t(i)]);
      return b;
    };
    auto step = [&](int n, int nq, bool causal) {
      const int32_t len = static_cast<int32_t>(hk.size() / size_t(kRow * es));
      const std::string q = rows(int64_t{nq} * kHq * kD + 1, 3.0f);
      const std::string k = rows(n * kRow + 1, 1.0f), v = rows(n * kRow + 1, 1.0f);
      auto c = std::make_shared<KvAppendAttend>();
      c->steps = {{1, len, n, nq}};
      c->dtype = dtype;
      c->num_heads_q = kHq;
      c->num_heads_kv = kHkv;
      c->head_dim = kD;
      c->options.causal = causal;
      c->inputs.q = q.data();
      c->inputs.k = k.data();
      c->inputs.v = v.data();
      c->return_lse = true;
      absl::Status status;
      absl::Notification done;
      ASSERT_TRUE(pool_
                      ->AppendAttend(*cache, c,
                                     [&](const absl::Status& st, const WorkTimings&) {
                                       status = st;
                                       done.Notify();
                                     })
                      .ok());
      done.WaitForNotification();
      ASSERT_TRUE(status.ok()) << status;
      hk.append(k.data(), size_t(n * kRow * es));
      hv.append(v.data(), size_t(n * kRow * es));
      AttnPointers io;
      io.q = q.data();
      io.k = hk.data();
      io.v = hv.data();
      AttnOptions options;
      options.causal = causal;
      const AttnParams p =
          MakeAttnParams(DenseShape(dtype, 1, nq, len + n, kHq, kHkv, kD), options, io);
      const ReferenceOutput ref = ReferenceAttention(p);
      const ReferenceOutput low = ReferenceAttentionLowPrecision(p);
      double err = 0, low_err = 0, lse_err = 0, low_lse_err = 0;
      for (size_t i = 0; i < ref.o.size(); ++i) {
        err = std::max(err, std::fabs(LoadAsFloat(c->o.data(), dtype, int64_t(i)) - ref.o[i]));
        low_err = std::max(low_err, std::fabs(low.o[i] - ref.o[i]));
      }
      const float* lse = reinterpret_cast<const float*>(c->lse.data());
      for (size_t i = 0; i < ref.lse.size(); ++i) {
        lse_err = std::max(lse_err, std::fabs(lse[i] - ref.lse[i]));
        low_lse_err = std::max(low_lse_err, std::fabs(low.lse[i] - ref.lse[i]));
      }
      const std::string where = name + " length " + std::to_string(len + n);
      EXPECT_LE(err, 2 * low_err + tolerance::OutputFloor(dtype)) << where;
      EXPECT_LE(lse_err, 2 * low_lse_err + tolerance::kLowpLseFloor) << where;
    };
    step(120, 1, true);                             // 8 pages on device 0
    for (int i = 0; i < 30; ++i) step(1, 1, true);  // a segment on device 1
    EXPECT_EQ(PagesUsed(*cache), (std::vector<int64_t>{8, 2})) << name;
    step(0, 3, false);  // attend only, several queries over both segments
  }
}

// An append goes whole to the last segment's device while it has the pages;
// otherwise to the device with the most free pages (the first on a tie).
TEST_F(SpanningTest, AppendsOpenSegmentsWhereFreePagesAre) {
  MakePool(8);
  auto cache = Cache(16);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  History a, b;
  ASSERT_TRUE(Step(cache, 1, &a, 100, 1).status.ok());  // 7 pages, tie: device 0
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 0}));
  // 40 more need 2 more pages on device 0, which has 1: a new segment on
  // device 1 (3 pages), leaving device 0's partial page as it is.
  ASSERT_TRUE(Step(cache, 1, &a, 40, 2).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 3}));
  // Another sequence: device 1 has 5 free, device 0 has 1.
  ASSERT_TRUE(Step(cache, 2, &b, 16, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 4}));
  // Sequence 1 keeps growing on device 1 (its last segment).
  ASSERT_TRUE(Step(cache, 1, &a, 8, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 4}));  // the partial page had room
  ASSERT_TRUE(Step(cache, 1, &a, 9, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 5}));
  // Sequence 2 needs 4 pages: device 1 has 3, device 0 has 1: refused.
  const Result full = Step(cache, 2, &b, 60, 1);
  EXPECT_EQ(full.status.code(), absl::StatusCode::kResourceExhausted) << full.status;
  EXPECT_NE(full.status.message().find("num_new_tokens"), std::string::npos) << full.status;
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(*cache->Lengths(2), std::vector<int32_t>{16});
  // One page fits where sequence 2's last segment is (device 1).
  ASSERT_TRUE(Step(cache, 2, &b, 16, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 6}));
  // Sequence 1's 3 more pages fit nowhere; 1 fits device 1, where its last
  // segment is.
  EXPECT_EQ(Step(cache, 1, &a, 40, 1).status.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(Step(cache, 1, &a, 20, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 7}));
  ASSERT_TRUE(Step(cache, 2, &b, 16, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{7, 8}));
  // Device 1 is full: sequence 2's next page opens a segment on device 0.
  ASSERT_TRUE(Step(cache, 2, &b, 16, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 8}));
  ASSERT_TRUE(Step(cache, 2, &b, 0, 4).status.ok());  // over its two segments
  ASSERT_TRUE(Step(cache, 1, &a, 0, 4).status.ok());
}

// With several layers a segment grows to at most its device's share over
// the layers, so one long sequence spreads each layer over both devices.
TEST_F(SpanningTest, SegmentsStayWithinTheDevicesShareOverLayers) {
  MakePool(16);
  KvCreateCache r;
  r.geometry = {2, kHkv, kD, DType::kFP32};
  r.page_size = kPage;
  r.capacity_tokens = 32 * kPage;  // 16 pages on each device: 8 per layer
  r.devices = {0, 1};
  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->CreateCache("t", r);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE((*cache)->CreateSequences({{1, {}, {}}}).ok());
  History h;
  ASSERT_TRUE(Step(*cache, 1, &h, 100, 1).status.ok());
  EXPECT_EQ(PagesUsed(*cache), (std::vector<int64_t>{7, 0}));
  // 9 pages would pass the 8 of one layer's share although device 0 has 9
  // free: a new segment, on device 1 (the most free pages).
  ASSERT_TRUE(Step(*cache, 1, &h, 40, 1).status.ok());
  EXPECT_EQ(PagesUsed(*cache), (std::vector<int64_t>{7, 3}));
  ASSERT_TRUE(Step(*cache, 1, &h, 1, 1).status.ok());
}

TEST(SegmentsTest, PlacementAndKeep) {
  // Extends while the last segment's shard has the pages.
  EXPECT_EQ(PlaceAppend({3, 9}, 0, 3, 4).shard, 0);
  EXPECT_TRUE(PlaceAppend({3, 9}, 0, 3, 4).extend);
  // Otherwise the most free pages, first on a tie; none with room: -1.
  EXPECT_EQ(PlaceAppend({3, 9}, 0, 4, 4).shard, 1);
  EXPECT_EQ(PlaceAppend({5, 5}, -1, -1, 4).shard, 0);
  EXPECT_EQ(PlaceAppend({3, 3}, 1, 4, 4).shard, -1);
  // Keep: segments starting at or past the length go.
  std::vector<KvSegment> segs = {{0, 0, 0}, {1, 100, 7}, {0, 140, 10}};
  EXPECT_EQ(KeepSegments(&segs, 150, 16), 11);
  EXPECT_EQ(segs.size(), 3u);
  EXPECT_EQ(KeepSegments(&segs, 140, 16), 10);
  EXPECT_EQ(segs.size(), 2u);
  EXPECT_EQ(KeepSegments(&segs, 101, 16), 8);
  EXPECT_EQ(KeepSegments(&segs, 100, 16), 7);
  EXPECT_EQ(segs.size(), 1u);
  EXPECT_EQ(KeepSegments(&segs, 0, 16), 0);
  EXPECT_TRUE(segs.empty());
  EXPECT_EQ(KeepSegments(&segs, 33, 16), 3);  // one device: no list
}

// A launch that fails on one device rolls the whole step back: lengths and
// pages as before, and the next step is right.
TEST_F(SpanningTest, FailedStepChangesNothing) {
  MakePool(8);
  auto cache = Cache(16);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  History h;
  ASSERT_TRUE(Step(cache, 1, &h, 120, 1).status.ok());  // 8 pages on device 0
  ASSERT_TRUE(Step(cache, 1, &h, 20, 1).status.ok());   // 2 on device 1
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 2}));
  const KvCacheStats before = cache->Stats();
  for (int device : {0, 1}) {
    backends_[device].paged_fail = true;
    History copy = h;
    const Result failed = Step(cache, 1, &copy, 13, 1);
    backends_[device].paged_fail = false;
    EXPECT_EQ(failed.status.code(), absl::StatusCode::kResourceExhausted) << failed.status;
    EXPECT_EQ(copy.length(), h.length());
    EXPECT_EQ(*cache->Lengths(1), std::vector<int32_t>{h.length()});
    EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 2}));
    EXPECT_EQ(cache->Stats().tokens, before.tokens);
  }
  // A stale expected_length changes nothing either.
  History stale = h;
  stale.k.resize(stale.k.size() - size_t(kRow));
  stale.v.resize(stale.v.size() - size_t(kRow));
  EXPECT_EQ(Step(cache, 1, &stale, 1, 1).status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 2}));
  ASSERT_TRUE(Step(cache, 1, &h, 13, 1).status.ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 3}));
}

// Forks share the prefix's pages on both devices; a truncate back into the
// first segment drops the second; both stay right.
TEST_F(SpanningTest, ForkAndTruncateAcrossSegments) {
  MakePool(8);
  auto cache = Cache(16);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  History h;
  ASSERT_TRUE(Step(cache, 1, &h, 120, 1).status.ok());
  ASSERT_TRUE(Step(cache, 1, &h, 20, 1).status.ok());  // segments [0,120) and [120,140)
  ASSERT_TRUE(cache->CreateSequences({{2, 1, 130}}).ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 2}));  // all shared
  History f = h;
  f.k.resize(size_t(130 * kRow));
  f.v.resize(size_t(130 * kRow));
  ASSERT_TRUE(Step(cache, 2, &f, 3, 1).status.ok());  // copy-on-write on device 1
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 3}));
  ASSERT_TRUE(Step(cache, 1, &h, 0, 2).status.ok());  // the source is untouched
  ASSERT_TRUE(cache->Truncate(1, std::nullopt, 100).ok());
  h.k.resize(size_t(100 * kRow));
  h.v.resize(size_t(100 * kRow));
  ASSERT_TRUE(Step(cache, 1, &h, 0, 2).status.ok());
  // Device 0 is full and the partial page is shared with the fork (a copy
  // would need a page there): a new segment on device 1.
  ASSERT_TRUE(Step(cache, 1, &h, 4, 1).status.ok());
  ASSERT_TRUE(Step(cache, 2, &f, 1, 1).status.ok());
  ASSERT_TRUE(cache->Free({1, 2}).ok());
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{0, 0}));
}

// Capacities are charged per device, all or nothing: a cache over the
// tenant's kv_pages quota is refused and leaves nothing charged, so one
// that fits exactly is created afterwards.
TEST_F(SpanningTest, OverQuotaRefusedWithNothingCharged) {
  MakePool(64);
  TenantDirectory tenants;
  tenants.SetQuotas({{"q", TenantQuotas{0, 10, 0}}});
  pool_->set_tenants(&tenants);
  KvCreateCache r;
  r.geometry = {1, kHkv, kD, DType::kFP32};
  r.page_size = kPage;
  r.devices = {0, 1};
  r.capacity_tokens = 12 * kPage;  // 6 pages on each device: 12 > 10
  const absl::Status over = pool_->CreateCache("q", r).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_NE(over.message().find("kv_pages"), std::string::npos) << over;
  r.capacity_tokens = 10 * kPage;
  absl::StatusOr<std::shared_ptr<KvCache>> fits = pool_->CreateCache("q", r);
  EXPECT_TRUE(fits.ok()) << fits.status();
  pool_->set_tenants(nullptr);
}

// What a spanning cache cannot do is refused by name, before anything moves.
TEST_F(SpanningTest, RefusesWhatDoesNotMapOntoSegments) {
  MakePool(8);
  auto cache = Cache(16);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->CreateSequences({{1, {}, {}}}).ok());
  History h;
  ASSERT_TRUE(Step(cache, 1, &h, 125, 1).status.ok());  // 8 pages on device 0
  ASSERT_TRUE(Step(cache, 1, &h, 3, 1).status.ok());    // the partial page: still device 0
  ASSERT_TRUE(Step(cache, 1, &h, 4, 1).status.ok());    // device 1
  AttnOptions window;
  window.window_left = 8;
  History copy = h;
  Result r = Step(cache, 1, &copy, 1, 1, window);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("options.window_left"), std::string::npos) << r.status;
  std::vector<float> slopes(kHq, 0.1f);
  mods_.alibi_slopes = slopes.data();
  r = Step(cache, 1, &copy, 1, 1);
  mods_ = {};
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("options.alibi_slopes"), std::string::npos) << r.status;
  // Causal queries must lie in the last segment (4 tokens on device 1).
  AttnOptions causal;
  causal.causal = true;
  r = Step(cache, 1, &copy, 1, 6, causal);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("num_queries"), std::string::npos) << r.status;
  EXPECT_EQ(*cache->Lengths(1), std::vector<int32_t>{h.length()});
  EXPECT_EQ(PagesUsed(cache), (std::vector<int64_t>{8, 1}));
  // Export moves one device's pages only.
  const absl::Status exported = KvExporter::Start(cache, KvExportOptions{}).status();
  EXPECT_EQ(exported.code(), absl::StatusCode::kUnimplemented) << exported;
  EXPECT_NE(exported.message().find("spans 2 devices"), std::string::npos) << exported;
  // Device lists are checked.
  KvCreateCache bad;
  bad.geometry = {1, kHkv, kD, DType::kFP32};
  bad.capacity_tokens = 64;
  bad.devices = {0, 0};
  EXPECT_NE(pool_->CreateCache("t", bad).status().message().find("devices[1]"), std::string::npos);
  bad.devices = {0, 5};
  EXPECT_NE(pool_->CreateCache("t", bad).status().message().find("devices[1]"), std::string::npos);
  bad.devices = {0, 1};
  bad.device = 0;
  EXPECT_EQ(pool_->CreateCache("t", bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// The CPU backend recording the thread that starts each paged launch.
// Pipelined, it only records at the start and runs the launch in Finish (as a
// GPU backend queues its work there and waits for it in Finish), with two
// launches in flight; otherwise it runs the launch at the start.
class StartRecordingBackend final : public CpuBackend {
 public:
  explicit StartRecordingBackend(bool pipelined) : CpuBackend(1), pipelined_(pipelined) {}
  int max_launches_in_flight() const override { return pipelined_ ? 2 : 1; }
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartPagedForward(
      const Plan& plan, const PagedBatch& batch) override {
    {
      absl::MutexLock lock(&mu_);
      starts_.push_back(std::this_thread::get_id());
    }
    if (!pipelined_) return CpuBackend::StartPagedForward(plan, batch);
    return std::unique_ptr<PendingLaunch>(new Deferred(this, plan, batch.members()));
  }
  std::vector<std::thread::id> TakeStarts() {
    absl::MutexLock lock(&mu_);
    return std::move(starts_);
  }

 private:
  class Deferred final : public PendingLaunch {
   public:
    Deferred(StartRecordingBackend* b, const Plan& plan,
             std::vector<const PagedAttnParams*> members)
        : b_(b), plan_(plan), members_(std::move(members)) {}
    absl::Status Finish(BackendTimings* timings) override {
      absl::StatusOr<std::unique_ptr<PendingLaunch>> launch =
          b_->CpuBackend::StartPagedForward(plan_, PagedBatch(members_));
      if (!launch.ok()) return launch.status();
      return (*launch)->Finish(timings);
    }

   private:
    StartRecordingBackend* const b_;
    const Plan plan_;
    const std::vector<const PagedAttnParams*> members_;
  };

  const bool pipelined_;
  absl::Mutex mu_;
  std::vector<std::thread::id> starts_ ABSL_GUARDED_BY(mu_);
};

// With small calls inline (--inline_max_cost), a step over both devices
// starts each device's launch on the submitting thread when the backend is
// pipelined (only the start runs there), and never there when it is not
// (the whole launch would, one device after the other); right either way.
TEST(SpanningInlineTest, PipelinedDevicesStartOnTheSubmittingThread) {
  for (bool pipelined : {true, false}) {
    const std::string where = pipelined ? "pipelined" : "not pipelined";
    StartRecordingBackend b0(pipelined), b1(pipelined);
    ExecutorOptions eo;
    eo.inline_max_cost = int64_t{1} << 22;
    Executor ex0(&b0, eo), ex1(&b1, eo);
    KvPoolOptions o;
    o.cache_bytes_per_device = 9 * kPageBytes;
    o.idle_timeout = absl::ZeroDuration();
    KvPool pool(o, std::vector<KvDevice>{{&b0, &ex0, 0}, {&b1, &ex1, 1}});
    KvCreateCache r;
    r.geometry = {1, kHkv, kD, DType::kFP32};
    r.page_size = kPage;
    r.capacity_tokens = 16 * kPage;
    r.devices = {0, 1};
    absl::StatusOr<std::shared_ptr<KvCache>> cache = pool.CreateCache("t", r);
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE((*cache)->CreateSequences({{1, {}, {}}}).ok());
    std::mt19937 rng(5);
    std::vector<float> hk, hv;
    for (int n : {120, 20, 1}) {  // 8 pages on device 0, then a segment on device 1
      const int32_t len = static_cast<int32_t>(hk.size() / size_t(kRow));
      std::vector<float> q = Random(&rng, int64_t{kHq} * kD);
      std::vector<float> k = Random(&rng, n * kRow), v = Random(&rng, n * kRow);
      auto c = std::make_shared<KvAppendAttend>();
      c->steps = {{1, len, n, 1}};
      c->dtype = DType::kFP32;
      c->num_heads_q = kHq;
      c->num_heads_kv = kHkv;
      c->head_dim = kD;
      c->options.causal = true;
      c->inputs.q = q.data();
      c->inputs.k = k.data();
      c->inputs.v = v.data();
      c->return_lse = true;
      // Both devices idle, so the executors may take the call inline.
      ASSERT_TRUE(ex0.WaitIdle(absl::Seconds(30)) && ex1.WaitIdle(absl::Seconds(30)));
      b0.TakeStarts();
      b1.TakeStarts();
      absl::Status status;
      absl::Notification done;
      ASSERT_TRUE(pool.AppendAttend(*cache, c,
                                    [&](const absl::Status& st, const WorkTimings&) {
                                      status = st;
                                      done.Notify();
                                    })
                      .ok());
      done.WaitForNotification();
      ASSERT_TRUE(status.ok()) << status;
      hk.insert(hk.end(), k.begin(), k.end());
      hv.insert(hv.end(), v.begin(), v.end());
      AttnPointers io;
      io.q = q.data();
      io.k = hk.data();
      io.v = hv.data();
      const AttnParams p =
          MakeAttnParams(DenseShape(DType::kFP32, 1, 1, len + n, kHq, kHkv, kD), c->options, io);
      std::vector<float> got_o(c->o.size() / 4), got_lse(c->lse.size() / 4);
      std::memcpy(got_o.data(), c->o.data(), c->o.size());
      std::memcpy(got_lse.data(), c->lse.data(), c->lse.size());
      ExpectMatchesReference(got_o, got_lse, ReferenceAttention(p), 1,
                             where + " length " + std::to_string(len + n));
      if (n != 1) continue;
      // The decode step: one launch per device.
      const std::vector<std::thread::id> s0 = b0.TakeStarts(), s1 = b1.TakeStarts();
      ASSERT_EQ(s0.size(), 1u) << where;
      ASSERT_EQ(s1.size(), 1u) << where;
      const std::thread::id here = std::this_thread::get_id();
      EXPECT_EQ(s0[0] == here, pipelined) << where;
      EXPECT_EQ(s1[0] == here, pipelined) << where;
    }
    EXPECT_EQ(*(*cache)->Lengths(1), std::vector<int32_t>{141}) << where;
  }
}

// The merge rule against the float64 reference: keys split into partials of
// 1, 0 and 299 keys (and 150/150), each attended alone on the CPU backend,
// merged by MergeLseRow. The empty partial carries LSE -inf and garbage O.
TEST(LseMergeTest, ExactForUnevenAndEmptyPartials) {
  std::mt19937 rng(11);
  const int sq = 3, sk = 300;
  std::vector<float> q = Random(&rng, int64_t{sq} * kHq * kD);
  std::vector<float> k = Random(&rng, int64_t{sk} * kRow);
  std::vector<float> v = Random(&rng, int64_t{sk} * kRow);
  // Larger scores make the partials' LSEs differ by more.
  for (float& x : q) x *= 4.0f;
  auto backend = MakeCpuBackend(1);
  AttnOptions options;
  AttnPointers all;
  all.q = q.data();
  all.k = k.data();
  all.v = v.data();
  const ReferenceOutput ref = ReferenceAttention(
      MakeAttnParams(DenseShape(DType::kFP32, 1, sq, sk, kHq, kHkv, kD), options, all));
  for (const std::vector<int>& split : {std::vector<int>{1, 0, 299}, std::vector<int>{150, 150}}) {
    std::vector<std::vector<float>> os, lses;
    int begin = 0;
    for (int n : split) {
      std::vector<float> o(size_t(sq) * kHq * kD, std::nanf(""));
      std::vector<float> lse(size_t(sq) * kHq, -std::numeric_limits<float>::infinity());
      if (n > 0) {
        AttnPointers io;
        io.q = q.data();
        io.k = k.data() + begin * kRow;
        io.v = v.data() + begin * kRow;
        io.o = o.data();
        io.lse = lse.data();
        const AttnParams p =
            MakeAttnParams(DenseShape(DType::kFP32, 1, sq, n, kHq, kHkv, kD), options, io);
        ASSERT_TRUE(PlanAndForward(*backend, p, nullptr).ok());
      }
      os.push_back(std::move(o));
      lses.push_back(std::move(lse));
      begin += n;
    }
    const int parts = static_cast<int>(split.size());
    std::vector<float> merged_o(size_t(sq) * kHq * kD), merged_lse(size_t(sq) * kHq);
    std::vector<float> row_lse(static_cast<size_t>(parts));
    std::vector<float> weights(static_cast<size_t>(parts));
    for (int h = 0; h < kHq; ++h) {
      for (int r = 0; r < sq; ++r) {
        for (int i = 0; i < parts; ++i) row_lse[size_t(i)] = lses[size_t(i)][size_t(h * sq + r)];
        const size_t at = (size_t(r) * kHq + h) * kD;
        merged_lse[size_t(h * sq + r)] = MergeLseRow(
            parts, row_lse.data(), kD, [&](int i, int64_t d) { return os[size_t(i)][at + d]; },
            weights.data(), merged_o.data() + at);
      }
    }
    ExpectMatchesReference(merged_o, merged_lse, ref, sq, "split " + std::to_string(split[0]));
  }
  // No partial saw a key: O 0, LSE -inf.
  const float none[2] = {-std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
  float out[kD], weights[2];
  EXPECT_EQ(MergeLseRow(
                2, none, kD, [](int, int64_t) { return std::nanf(""); }, weights, out),
            -std::numeric_limits<float>::infinity());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

TEST(CpuDevicesTest, CountAndBounds) {
  auto two = MakeCpuBackends(2, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->size(), 2u);
  BackendOptions o;
  o.kind = "cpu";
  o.cpu_devices = 3;
  auto three = MakeBackends(o);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->size(), 3u);
  const absl::Status zero = MakeCpuBackends(0, 1).status();
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.message().find("--cpu_devices"), std::string::npos) << zero;
}

TEST(StartupSpecTest, Devices) {
  auto spec = ParseStartupCaches(
      "a:layers=1,hkv=8,d=128,dtype=BF16,capacity_tokens=4096,devices=0+1;"
      "b:layers=1,hkv=8,d=128,dtype=BF16,capacity_tokens=4096,devices=all");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ((*spec)[0].create.devices, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE((*spec)[1].create.all_devices);
  const absl::Status bad =
      ParseStartupCaches("a:layers=1,hkv=8,d=128,dtype=BF16,capacity_tokens=64,devices=0+x")
          .status();
  EXPECT_NE(bad.message().find("devices"), std::string::npos) << bad;
}

}  // namespace
}  // namespace attnserve
