// PlanForward (backend/cuda/attn_fwd_plan.h) for MLA shapes (V's and O's
// head dim differing from Q's and K's, params.h head_dim_v), on the host:
// which (D, Dv) pair serves a call (DvKernelFor, Sm90DvKernelFor), which
// family and tile, GQA packing without the decode tile, split-KV workspace
// sized by Dv, none over a cache's pages, and the Hopper pair's tile fitting
// shared memory. Plain C++: runs in every build, GPU or not (without the
// Hopper kernels the sm90 expectations fall back to the portable plan).
#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/generated/kernel_set.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using cuda::PlanForward;

constexpr int kH100Sms = 132;

AttnParams Mla(int b, int sq, int sk, int hq, int hkv, int d = 192, int dv = 128,
               bool causal = false) {
  AttnShape s = DenseShape(DType::kBF16, b, sq, sk, hq, hkv, d);
  s.head_dim_v = dv;
  AttnOptions o;
  o.causal = causal;
  return MakeAttnParams(s, o, AttnPointers());
}

TEST(PlanMlaTest, PairsCoverTheirDims) {
  struct Row {
    int d, dv, want;  // want: the portable pair's D (0: none)
  };
  for (const Row& r : {Row{192, 128, 192}, Row{176, 112, 192}, Row{128, 64, 192}, Row{64, 128, 192},
                       Row{8, 16, 192}, Row{576, 512, 0}, Row{256, 128, 0}, Row{192, 136, 0}}) {
    const cuda::HeadDimPair k = cuda::DvKernelFor(r.d, r.dv);
    EXPECT_EQ(k.head_dim, r.want) << r.d << "/" << r.dv;
    if (r.want != 0) {
      EXPECT_EQ(k.head_dim_v, 128) << r.d << "/" << r.dv;
    }
  }
  // The Hopper pair only where both dims reach into its last 64-column box.
  for (const Row& r : {Row{192, 128, 192}, Row{176, 112, 192}, Row{136, 72, 192}, Row{128, 64, 0},
                       Row{192, 64, 0}, Row{64, 128, 0}, Row{576, 512, 0}}) {
    const int want = cuda::Sm90DvKernelFor(192, 128).head_dim == 192 ? r.want : 0;
    EXPECT_EQ(cuda::Sm90DvKernelFor(r.d, r.dv).head_dim, want) << r.d << "/" << r.dv;
  }
}

TEST(PlanMlaTest, PortablePlan) {
  // Prefill: the 192 pair on the prefill tile (no banded tile at 192).
  for (bool causal : {false, true}) {
    const Plan p = PlanForward(Mla(1, 2048, 2048, 16, 16, 192, 128, causal), kH100Sms);
    EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
    EXPECT_EQ(p.kernel_head_dim, 192);
    EXPECT_EQ(p.tile_kind, TileKind::kPrefill);
    EXPECT_EQ(p.banded, causal);
    EXPECT_EQ(p.num_splits, 1);
  }
  // Decode-sized with GQA: packed into M, but never the decode tile.
  const Plan d = PlanForward(Mla(2, 1, 4096, 16, 1), kH100Sms, /*allow_sm90=*/true);
  EXPECT_EQ(d.kernel_family, KernelFamily::kPortable);
  EXPECT_EQ(d.pack_gqa, 16);
  EXPECT_NE(d.tile_kind, TileKind::kDecode);
  // An equal-dims call of D 128 takes the decode tile there.
  AttnParams same = Mla(2, 1, 4096, 16, 1, 128, 0);
  EXPECT_EQ(PlanForward(same, kH100Sms).tile_kind, TileKind::kDecode);
}

TEST(PlanMlaTest, SplitWorkspaceHoldsRowsOfDv) {
  // A short run over a long context splits; partials are rows of Dv.
  const AttnParams p = Mla(1, 64, 8192, 2, 2);
  const Plan plan = PlanForward(p, kH100Sms);
  ASSERT_GT(plan.num_splits, 1);
  EXPECT_EQ(plan.workspace_bytes,
            cuda::kSplitCounterBytes + int64_t{plan.num_splits} * 2 * 64 * (128 + 1) * 4);
  EXPECT_EQ(plan.workspace_bytes, cuda::SplitWorkspaceBytes(p, plan.num_splits));
}

TEST(PlanMlaTest, NoPairNoKernel) {
  EXPECT_EQ(PlanForward(Mla(1, 128, 128, 4, 4, 576, 512), kH100Sms, true).kernel_head_dim, 0);
  EXPECT_EQ(PlanForward(Mla(1, 128, 128, 4, 4, 256, 128), kH100Sms, true).kernel_head_dim, 0);
  // A cache's pages: no MLA-shape kernel of this planner.
  EXPECT_EQ(PlanForward(Mla(1, 1, 128, 4, 4), kH100Sms, true, cuda::KvRows::kPages).kernel_head_dim,
            0);
}

TEST(PlanMlaTest, HopperPlan) {
  const bool hopper = cuda::Sm90DvKernelFor(192, 128).head_dim == 192;
  for (bool causal : {false, true}) {
    const Plan p = PlanForward(Mla(1, 2048, 2048, 16, 16, 192, 128, causal), kH100Sms, true);
    EXPECT_EQ(p.kernel_head_dim, 192);
    EXPECT_EQ(p.kernel_family, hopper ? KernelFamily::kSm90 : KernelFamily::kPortable);
    if (hopper) {
      EXPECT_EQ(p.tile_kind, TileKind::kPrefill) << "no long-key tile for the pair";
      EXPECT_EQ(p.num_splits, 1);
      EXPECT_EQ(p.banded, causal);
    }
  }
  // A block mask of 128 x 128 blocks fits the pair's 128-key tile.
  AttnParams bm = Mla(1, 1024, 1024, 4, 4);
  bm.block_q = bm.block_k = 128;
  EXPECT_EQ(PlanForward(bm, kH100Sms, true).kernel_family,
            hopper ? KernelFamily::kSm90 : KernelFamily::kPortable);
  // Dims the Hopper pair does not take stay portable.
  EXPECT_EQ(PlanForward(Mla(1, 1024, 1024, 4, 4, 128, 64), kH100Sms, true).kernel_family,
            KernelFamily::kPortable);
}

TEST(PlanMlaTest, HopperTileFitsSharedMemory) {
  const cuda::TileConfig t = cuda::Sm90DvTileFor(192, 128);
  ASSERT_EQ(t.head_dim, 192);
  EXPECT_EQ(t.block_n, 128);
  EXPECT_EQ(cuda::Sm90QSlots(t, 2, 128), 1);
  EXPECT_LE(cuda::Sm90SmemBytes(t, 2, 128), cuda::kSm90MaxSmemBytes);
  // The equal-dims 192 tile's figure, which a plan on the pair reports, is larger.
  EXPECT_LE(cuda::Sm90SmemBytes(t, 2, 128), cuda::Sm90SmemBytes(cuda::Sm90TileFor(192)));
  EXPECT_EQ(cuda::Sm90DvTileFor(192, 64).head_dim, 0);
}

}  // namespace
}  // namespace attnserve
