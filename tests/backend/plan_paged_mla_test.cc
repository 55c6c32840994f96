// PlanPagedMla (backend/cuda/paged_mla_plan.h), the absorbed-MLA decode
// kernel's plan on the host: its row blocks, its split counts on an H100's
// 132 SMs (one CTA per SM, at least 4 key tiles a split), the workspace, and
// the batch-invariant rule it shares with the FP8 cache's decode kernel
// (paged_decode_plan.h). Plain C++: runs in every build, GPU or not.
#include <cstdint>

#include "backend/cuda/paged_mla_plan.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using cuda::PlanPagedMla;

constexpr int kH100Sms = 132;

AttnParams Absorbed(int b, int sq, int sk, int hq) {
  AttnOptions o;
  o.causal = true;
  AttnParams p = MakeAttnParams(DenseShape(DType::kBF16, b, sq, sk, hq, 1, 576), o, AttnPointers());
  p.head_dim_v = 512;
  return p;
}

TEST(PlanPagedMlaTest, PacksEveryQueryHeadOfTheOneKvHead) {
  const Plan p = PlanPagedMla(Absorbed(64, 1, 8192, 16), kH100Sms);
  EXPECT_EQ(p.kernel_head_dim, 576);
  EXPECT_EQ(p.tile_kind, TileKind::kDecode);
  EXPECT_EQ(p.pack_gqa, 16);
  EXPECT_EQ(PlanPagedMla(Absorbed(1, 4, 8192, 128), kH100Sms).pack_gqa, 128);
}

TEST(PlanPagedMlaTest, SplitsFillTheWavesOfOneCtaPerSm) {
  // 64 CTAs (one 16-row block each) are 48% of a wave; 2 splits fill 97%.
  const AttnParams b64 = Absorbed(64, 1, 8192, 16);
  const Plan p = PlanPagedMla(b64, kH100Sms);
  EXPECT_EQ(p.num_splits, 2);
  EXPECT_EQ(p.workspace_bytes, cuda::SplitWorkspaceBytes(b64, 2));
  EXPECT_EQ(PlanPagedMla(Absorbed(16, 1, 8192, 16), kH100Sms).num_splits, 8);
  // 128 heads: two 64-row blocks; 60 splits are the first to reach 90% of a
  // wave; 256 tiles / 60 -> 5 each, which 52 splits take.
  EXPECT_EQ(PlanPagedMla(Absorbed(1, 1, 8192, 128), kH100Sms).num_splits, 52);
  // 4 tokens x 128 heads: 8 row blocks; 15 splits of 18 tiles.
  EXPECT_EQ(PlanPagedMla(Absorbed(1, 4, 8192, 128), kH100Sms).num_splits, 15);
  // One CTA never fills a wave: as many splits as leave 4 tiles each.
  EXPECT_EQ(PlanPagedMla(Absorbed(1, 1, 8192, 16), kH100Sms).num_splits, 64);
  // 4 tiles are one split's minimum: no split, no workspace.
  const Plan short_one = PlanPagedMla(Absorbed(1, 1, 100, 16), kH100Sms);
  EXPECT_EQ(short_one.num_splits, 1);
  EXPECT_EQ(short_one.workspace_bytes, 0);
  EXPECT_EQ(PlanPagedMla(Absorbed(1, 1, 0, 16), kH100Sms).num_splits, 1);
}

TEST(PlanPagedMlaTest, InvariantSplitsDependOnTheSequenceAlone) {
  // A sequence's tiles per split do not depend on the launch's split count.
  for (int n = 0; n <= 3000; ++n) {
    const int per = cuda::MlaTilesPerSplit(n, 1, true);
    for (int splits : {2, 7, 32, 128}) {
      ASSERT_EQ(cuda::MlaTilesPerSplit(n, splits, true), per) << n << " tiles, " << splits;
    }
    EXPECT_GE(per, cuda::kMlaInvariantMinTiles);
    EXPECT_LE((n + per - 1) / per, cuda::kMlaInvariantSplits);
  }
  // 256 tiles at 16 a split; every invariant launch combines (workspace),
  // split or not; neither the SM count nor the batch moves the plan.
  AttnParams a = Absorbed(64, 1, 8192, 16);
  a.batch_invariant = true;
  const Plan p = PlanPagedMla(a, kH100Sms);
  EXPECT_EQ(p.num_splits, 16);
  EXPECT_EQ(p.workspace_bytes, cuda::SplitWorkspaceBytes(a, 16));
  AttnParams other = a;
  other.batch = 3;
  EXPECT_EQ(PlanPagedMla(other, 16).num_splits, 16);
  AttnParams empty = Absorbed(1, 1, 0, 16);
  empty.batch_invariant = true;
  const Plan e = PlanPagedMla(empty, kH100Sms);
  EXPECT_EQ(e.num_splits, 1);
  EXPECT_GT(e.workspace_bytes, 0);
}

}  // namespace
}  // namespace attnserve
