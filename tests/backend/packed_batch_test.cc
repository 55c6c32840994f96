// PackedBatch (backend/ragged_batch.h) gives each member exactly what its own
// launch gives: dense and varlen members, a zero-length sequence, LSE in both
// layouts; a single member keeps its layout; only matching options share a
// launch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/ragged_batch.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

// One member's inputs and outputs, FP32 so packed and single launches can be
// compared exactly.
struct Member {
  std::vector<float> q, k, v, o, lse;
  std::vector<int32_t> cu_q, cu_k;
  AttnParams p{};
};

std::unique_ptr<Member> MakeMember(int hq, int hkv, int d, const std::vector<int>& lq,
                                   const std::vector<int>& lk, bool varlen, unsigned seed) {
  auto m = std::make_unique<Member>();
  int64_t tq = 0, tk = 0;
  m->cu_q = {0};
  m->cu_k = {0};
  for (size_t b = 0; b < lq.size(); ++b) {
    tq += lq[b];
    tk += lk[b];
    m->cu_q.push_back(static_cast<int32_t>(tq));
    m->cu_k.push_back(static_cast<int32_t>(tk));
  }
  auto fill = [&](std::vector<float>* t, int64_t n) {
    t->resize(n);
    for (int64_t i = 0; i < n; ++i) (*t)[i] = std::sin(0.37f * (i + 1) * (seed + 1));
  };
  fill(&m->q, tq * hq * d);
  fill(&m->k, tk * hkv * d);
  fill(&m->v, tk * hkv * d);
  m->o.assign(tq * hq * d, NAN);
  m->lse.assign(tq * hq, NAN);
  AttnShape shape;
  shape.dtype = DType::kFP32;
  shape.batch = static_cast<int32_t>(lq.size());
  shape.num_heads_q = hq;
  shape.num_heads_kv = hkv;
  shape.head_dim = d;
  if (varlen) {
    shape.cu_seqlens_q = m->cu_q.data();
    shape.cu_seqlens_k = m->cu_k.data();
  } else {
    shape.seqlen_q = lq.front();
    shape.seqlen_k = lk.front();
  }
  AttnOptions options;
  options.causal = true;
  m->p = MakeAttnParams(shape, options,
                        {m->q.data(), m->k.data(), m->v.data(), m->o.data(), m->lse.data()});
  return m;
}

TEST(PackedBatchTest, EachMemberGetsWhatItsOwnLaunchGives) {
  std::vector<std::unique_ptr<Member>> members;
  members.push_back(MakeMember(4, 2, 16, {5, 5}, {7, 7}, /*varlen=*/false, 1));  // dense
  members.push_back(MakeMember(4, 2, 16, {3, 0, 9}, {4, 2, 9}, /*varlen=*/true, 2));
  members.push_back(MakeMember(4, 2, 16, {1}, {12}, /*varlen=*/false, 3));  // decode-like
  std::unique_ptr<AttentionBackend> cpu = MakeCpuBackend(1);
  // Each alone: the expected outputs.
  std::vector<std::vector<float>> want_o, want_lse;
  for (auto& m : members) {
    BackendTimings t;
    ASSERT_TRUE(PlanAndForward(*cpu, m->p, &t).ok());
    want_o.push_back(m->o);
    want_lse.push_back(m->lse);
    std::fill(m->o.begin(), m->o.end(), NAN);
    std::fill(m->lse.begin(), m->lse.end(), NAN);
  }
  std::vector<const AttnParams*> ptrs;
  for (auto& m : members) {
    ASSERT_TRUE(CanShareLaunch(members[0]->p, m->p));
    ptrs.push_back(&m->p);
  }
  HostPackedBatch packed(ptrs);
  EXPECT_EQ(packed.params().batch, 6);
  EXPECT_EQ(packed.params().total_q, 10 + 12 + 1);
  absl::StatusOr<Plan> plan = cpu->CanImplement(packed.params());
  ASSERT_TRUE(plan.ok());
  BackendTimings t;
  ASSERT_TRUE(cpu->Forward(*plan, packed.params(), &t).ok());
  packed.Scatter();
  for (size_t i = 0; i < members.size(); ++i) {
    SCOPED_TRACE(i);
    for (size_t j = 0; j < want_o[i].size(); ++j) {
      ASSERT_NEAR(members[i]->o[j], want_o[i][j], 1e-6) << "o " << j;
    }
    for (size_t j = 0; j < want_lse[i].size(); ++j) {
      if (std::isinf(want_lse[i][j])) {
        EXPECT_TRUE(std::isinf(members[i]->lse[j])) << "lse " << j;
      } else {
        ASSERT_NEAR(members[i]->lse[j], want_lse[i][j], 1e-5) << "lse " << j;
      }
    }
  }
}

TEST(PackedBatchTest, OneMemberKeepsItsLayoutThroughGatherAndScatter) {
  // The path every unbatched CUDA request takes: one dense member with LSE.
  auto m = MakeMember(4, 2, 16, {5, 5}, {7, 7}, /*varlen=*/false, 7);
  std::unique_ptr<AttentionBackend> cpu = MakeCpuBackend(1);
  BackendTimings t;
  ASSERT_TRUE(PlanAndForward(*cpu, m->p, &t).ok());
  const std::vector<float> want_o = m->o, want_lse = m->lse;
  std::fill(m->o.begin(), m->o.end(), NAN);
  std::fill(m->lse.begin(), m->lse.end(), NAN);
  HostPackedBatch packed({&m->p});
  EXPECT_EQ(packed.params().cu_seqlens_q, nullptr);  // dense stays dense
  EXPECT_EQ(packed.params().batch, 2);
  EXPECT_NE(packed.params().q, m->p.q);  // gathered into the batch's own memory
  ASSERT_TRUE(PlanAndForward(*cpu, packed.params(), &t).ok());
  packed.Scatter();
  EXPECT_EQ(m->o, want_o);
  for (size_t j = 0; j < want_lse.size(); ++j) {
    if (std::isinf(want_lse[j])) {
      EXPECT_TRUE(std::isinf(m->lse[j])) << j;
    } else {
      EXPECT_EQ(m->lse[j], want_lse[j]) << j;
    }
  }
}

TEST(PackedBatchTest, OnlyMatchingOptionsShareALaunch) {
  auto a = MakeMember(4, 2, 16, {5}, {5}, false, 1);
  auto b = MakeMember(4, 2, 16, {9}, {3}, true, 2);
  EXPECT_TRUE(CanShareLaunch(a->p, b->p));
  b->p.is_causal = false;
  b->p.window_right = kNoWindow;
  EXPECT_FALSE(CanShareLaunch(a->p, b->p));
  auto c = MakeMember(4, 4, 16, {5}, {5}, false, 3);  // other Hkv
  EXPECT_FALSE(CanShareLaunch(a->p, c->p));
  auto d = MakeMember(4, 2, 16, {5}, {5}, false, 4);
  d->p.lse = nullptr;
  EXPECT_FALSE(CanShareLaunch(a->p, d->p));
}

}  // namespace
}  // namespace attnserve
