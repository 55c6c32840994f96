// PlanPagedFp8 (backend/cuda/paged_attn_fp8_plan.h), the FP8 cache's plan on
// the host: which calls the decode kernel takes, its split counts on an
// H100's 132 SMs, the workspace, and the batch-invariant split rule (a
// sequence's splits a function of its own length, whatever the launch's
// split count). Plain C++: runs in every build, GPU or not.
#include <cstdint>

#include "backend/cuda/paged_attn_fp8_plan.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using cuda::PlanPagedFp8;

constexpr int kH100Sms = 132;

AttnParams Decode(int b, int sq, int sk, int hq, int hkv, int d, DType t = DType::kBF16) {
  AttnOptions o;
  o.causal = true;
  return MakeAttnParams(DenseShape(t, b, sq, sk, hq, hkv, d), o, AttnPointers());
}

TEST(PlanPagedFp8Test, DecodeKernelTakesShortRunsAtD64And128) {
  const Plan p = PlanPagedFp8(Decode(64, 1, 8192, 32, 8, 128), kH100Sms);
  EXPECT_EQ(p.kernel_head_dim, 128);
  EXPECT_EQ(p.tile_kind, TileKind::kDecode);
  EXPECT_EQ(p.pack_gqa, 4);
  EXPECT_EQ(PlanPagedFp8(Decode(4, 1, 100, 16, 1, 64, DType::kFP16), kH100Sms).kernel_head_dim, 64);
  // 16 packed rows: 4 queries x a group of 4; 20 are too many.
  EXPECT_EQ(PlanPagedFp8(Decode(2, 4, 500, 8, 2, 128), kH100Sms).kernel_head_dim, 128);
  // Everything else is the SIMT kernel's: Plan() (kernel head dim 0).
  const AttnParams others[] = {Decode(2, 5, 500, 8, 2, 128), Decode(2, 1, 500, 8, 2, 96),
                               Decode(2, 1, 500, 8, 2, 256), Decode(2, 1, 0, 8, 2, 128),
                               Decode(2, 1, 500, 8, 2, 128, DType::kFP32)};
  for (const AttnParams& a : others) {
    const Plan p2 = PlanPagedFp8(a, kH100Sms);
    EXPECT_EQ(p2.kernel_head_dim, 0)
        << "sq " << a.seqlen_q << " sk " << a.seqlen_k << " d " << a.head_dim;
    EXPECT_EQ(p2.workspace_bytes, 0);
  }
}

TEST(PlanPagedFp8Test, SplitsFillTheWavesOfTwoCtasPerSm) {
  // 64 x 8 CTAs are 1.94 waves of 264: no split, no workspace.
  const Plan full = PlanPagedFp8(Decode(64, 1, 8192, 32, 8, 128), kH100Sms);
  EXPECT_EQ(full.num_splits, 1);
  EXPECT_EQ(full.workspace_bytes, 0);
  // 16 x 8 = 128 CTAs: 2 splits fill 97% of a wave.
  EXPECT_EQ(PlanPagedFp8(Decode(16, 1, 8192, 32, 8, 128), kH100Sms).num_splits, 2);
  // 8 CTAs: 30 splits reach 90% of a wave; 512 chunks / 30 -> 18 each -> 29 splits.
  const AttnParams one = Decode(1, 1, 8192, 32, 8, 128);
  const Plan p = PlanPagedFp8(one, kH100Sms);
  EXPECT_EQ(p.num_splits, 29);
  EXPECT_EQ(p.workspace_bytes, cuda::SplitWorkspaceBytes(one, 29));
  // Short contexts keep at least 8 chunks (128 keys) per split.
  EXPECT_EQ(PlanPagedFp8(Decode(1, 1, 300, 32, 8, 128), kH100Sms).num_splits, 2);
  EXPECT_EQ(PlanPagedFp8(Decode(1, 1, 100, 32, 8, 128), kH100Sms).num_splits, 1);
}

TEST(PlanPagedFp8Test, InvariantSplitsDependOnTheSequenceAlone) {
  // A sequence's chunks per split do not depend on the launch's split count.
  for (int n = 0; n <= 3000; ++n) {
    const int per = cuda::Fp8ChunksPerSplit(n, 1, true);
    for (int splits : {2, 7, 32, 128}) {
      ASSERT_EQ(cuda::Fp8ChunksPerSplit(n, splits, true), per) << n << " chunks, " << splits;
    }
    EXPECT_GE(per, cuda::kFp8InvariantMinChunks);
    EXPECT_LE((n + per - 1) / per, cuda::kFp8InvariantSplits);
  }
  // The plan's split count covers the longest sequence, and every
  // invariant launch combines (workspace), split or not.
  AttnParams a = Decode(64, 1, 8192, 32, 8, 128);
  a.batch_invariant = true;
  const Plan p = PlanPagedFp8(a, kH100Sms);
  EXPECT_EQ(p.num_splits, 512 / cuda::Fp8ChunksPerSplit(512, 1, true));
  EXPECT_EQ(p.workspace_bytes, cuda::SplitWorkspaceBytes(a, p.num_splits));
  AttnParams short_one = Decode(1, 1, 100, 32, 8, 128);
  short_one.batch_invariant = true;
  const Plan s = PlanPagedFp8(short_one, kH100Sms);
  EXPECT_EQ(s.num_splits, 1);
  EXPECT_GT(s.workspace_bytes, 0);
  // Neither the SM count nor the batch moves an invariant plan.
  AttnParams other = a;
  other.batch = 3;
  EXPECT_EQ(PlanPagedFp8(other, 16).num_splits, p.num_splits);
}

}  // namespace
}  // namespace attnserve
