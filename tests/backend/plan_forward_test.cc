// PlanForward (backend/cuda/attn_fwd_plan.h), the CUDA path's decision table,
// on the host: which kernel head dim serves a head dim in this build's set,
// which tile (prefill, decode, banded), GQA packing, split-KV counts (the
// worked examples of attn_fwd_plan.cc on an H100's 132 SMs) and the
// workspace. Plain C++: runs in every build, GPU or not.
#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/generated/kernel_set.h"
#include "backend/cuda/mods_prefix.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using cuda::PlanForward;

constexpr int kH100Sms = 132;

AttnParams Dense(int b, int sq, int sk, int hq, int hkv, int d, bool causal = false) {
  AttnOptions o;
  o.causal = causal;
  return MakeAttnParams(DenseShape(DType::kBF16, b, sq, sk, hq, hkv, d), o, AttnPointers());
}

TEST(PlanForwardTest, HeadDimIsServedByTheSmallestCompiledKernelAtOrAboveIt) {
  struct Row {
    int head_dim;
    int all_set;  // kernel head dim with every kernel compiled
    int dev_set;  // with ATTNSERVE_CUDA_KERNELS=dev (128 only); 0: none
  };
  const Row rows[] = {{8, 64, 128},    {64, 64, 128}, {72, 96, 128}, {96, 96, 128}, {104, 128, 128},
                      {128, 128, 128}, {136, 192, 0}, {192, 192, 0}, {200, 256, 0}, {256, 256, 0}};
  for (const Row& r : rows) {
#if defined(ATTNSERVE_CUDA_DEV_KERNELS)
    const int want = r.dev_set;
#else
    const int want = r.all_set;
#endif
    EXPECT_EQ(PlanForward(Dense(2, 300, 300, 4, 4, r.head_dim), kH100Sms).kernel_head_dim, want)
        << "head_dim " << r.head_dim;
  }
}

TEST(PlanForwardTest, CompiledSetMatchesTheTileTable) {
  for (int d : cuda::kCompiledHeadDims) {
    EXPECT_EQ(cuda::TileFor(TileKind::kPrefill, d).head_dim, d) << d;
  }
  EXPECT_EQ(cuda::TileFor(TileKind::kDecode, 192).head_dim, 0) << "no decode tile at 192";
  EXPECT_EQ(cuda::TileFor(TileKind::kBanded, 128).block_n, 32);
  EXPECT_EQ(cuda::TileFor(TileKind::kBanded, 64).head_dim, 0);
}

TEST(PlanForwardTest, TileKindAndBand) {
  // Causal prefill at 128: the banded table's 128x32 tile.
  Plan p = PlanForward(Dense(1, 1024, 1024, 2, 2, 128, /*causal=*/true), kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kBanded);
  EXPECT_TRUE(p.banded);
  // No mask: the prefill tile, not banded.
  p = PlanForward(Dense(1, 1024, 1024, 2, 2, 128), kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kPrefill);
  EXPECT_FALSE(p.banded);
  // A window without causal is a band too.
  AttnParams w = Dense(1, 1024, 1024, 2, 2, 128);
  w.window_left = 100;
  EXPECT_TRUE(PlanForward(w, kH100Sms).banded);
  // Decode (<= 16 rows after GQA packing) takes the decode tile, banded or not.
  p = PlanForward(Dense(1, 1, 4096, 32, 8, 128, /*causal=*/true), kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kDecode);
  EXPECT_TRUE(p.banded);
}

#if !defined(ATTNSERVE_CUDA_DEV_KERNELS)
TEST(PlanForwardTest, HeadDimsWithoutTheirOwnTilesKeepThePrefillTile) {
  // 64 has no banded tile; 192 has no decode tile.
  EXPECT_EQ(PlanForward(Dense(1, 512, 512, 2, 2, 64, true), kH100Sms).tile_kind,
            TileKind::kPrefill);
  const Plan p = PlanForward(Dense(1, 1, 4096, 8, 8, 192), kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kPrefill);
  EXPECT_EQ(p.kernel_head_dim, 192);
}
#endif

TEST(PlanForwardTest, GqaHeadsPackIntoMOnlyForShortQueryRuns) {
  EXPECT_EQ(PlanForward(Dense(1, 1, 512, 32, 8, 128), kH100Sms).pack_gqa, 4);
  EXPECT_EQ(PlanForward(Dense(1, 16, 512, 32, 8, 128), kH100Sms).pack_gqa, 4);
  EXPECT_EQ(PlanForward(Dense(1, 17, 512, 32, 8, 128), kH100Sms).pack_gqa, 1);
  EXPECT_EQ(PlanForward(Dense(1, 1, 512, 8, 8, 128), kH100Sms).pack_gqa, 1);  // no group
}

// The worked examples in attn_fwd_plan.cc.
TEST(PlanForwardTest, DecodeB1AimsAtTwoCtasPerSm) {
  const AttnParams a = Dense(1, 1, 8192, 32, 8, 128);
  const Plan p = PlanForward(a, kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kDecode);
  EXPECT_EQ(p.pack_gqa, 4);
  EXPECT_EQ(p.num_splits, 32);  // 264 / 8 = 33 splits, equalised to 4 tiles each
  EXPECT_EQ(p.workspace_bytes, cuda::kSplitCounterBytes + int64_t{32} * 32 * 1 * (128 + 1) * 4);
  // Short contexts: at least 2 key tiles per split (1024 keys: 16 tiles).
  EXPECT_EQ(PlanForward(Dense(1, 1, 1024, 32, 8, 128), kH100Sms).num_splits, 8);
}

TEST(PlanForwardTest, DecodeB16TakesTwoSplits) {
  EXPECT_EQ(PlanForward(Dense(16, 1, 8192, 32, 8, 128), kH100Sms).num_splits, 2);
  EXPECT_EQ(PlanForward(Dense(16, 1, 1024, 32, 8, 128), kH100Sms).num_splits, 2);
}

TEST(PlanForwardTest, DecodeB64TakesFewSplitsOverWholeWaves) {
  EXPECT_EQ(PlanForward(Dense(64, 1, 4096, 32, 8, 128), kH100Sms).num_splits, 3);
}

TEST(PlanForwardTest, PrefillUnderHalfAWaveSplits) {
  const Plan p = PlanForward(Dense(1, 128, 8192, 8, 8, 128), kH100Sms);
  EXPECT_EQ(p.tile_kind, TileKind::kPrefill);
  EXPECT_EQ(p.num_splits, 32);
  EXPECT_EQ(p.workspace_bytes, cuda::kSplitCounterBytes + int64_t{32} * 8 * 128 * (128 + 1) * 4);
}

TEST(PlanForwardTest, PrefillOverHalfAWaveDoesNotSplit) {
  const Plan p = PlanForward(Dense(1, 1024, 1024, 32, 32, 128), kH100Sms);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.workspace_bytes, 0);
}

TEST(PlanForwardTest, FewKeyTilesNeverSplit) {
  // 3 key tiles: a split needs at least 2 of them, so 1 split.
  EXPECT_EQ(PlanForward(Dense(1, 1, 192, 32, 8, 128), kH100Sms).num_splits, 1);
  EXPECT_EQ(PlanForward(Dense(1, 64, 192, 2, 2, 128), kH100Sms).num_splits, 1);
  EXPECT_EQ(PlanForward(Dense(1, 1, 0, 32, 8, 128), kH100Sms).num_splits, 1);  // Sk = 0
}

TEST(PlanForwardTest, MoreGroupsThanTicketCountersNeverSplit) {
  // 64 KV heads x 256 sequences = 16384 groups > kMaxSplitGroups, on a GPU
  // large enough that they would otherwise split.
  const Plan p = PlanForward(Dense(256, 1, 8192, 256, 64, 128), 100000);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.workspace_bytes, 0);
}

TEST(PlanForwardTest, SplitsAreCappedAt128) {
  // One CTA of base on a large GPU, 1M keys: 128 splits at most.
  EXPECT_LE(PlanForward(Dense(1, 1, 1 << 20, 1, 1, 128), 1000).num_splits, 128);
}

// The Hopper family (kSm90TileTable) when the caller allows it: dense
// prefill at the head dims it covers, the portable kernel for the rest.
TEST(PlanForwardTest, Sm90FamilyTakesDensePrefillItCovers) {
  if (!cuda::CompiledSm90HeadDim(128))
    GTEST_SKIP() << "this build has no sm_90a kernel for head dim 128";
  Plan p =
      PlanForward(Dense(2, 1024, 1024, 8, 2, 128, /*causal=*/true), kH100Sms, /*allow_sm90=*/true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.kernel_head_dim, 128);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_TRUE(p.banded);
  EXPECT_EQ(cuda::PlanSmemBytes(p), cuda::Sm90SmemBytes(cuda::Sm90TileFor(128)));
  // The dynamic persistent schedule, whose item counters are the
  // workspace's counter block.
  EXPECT_EQ(cuda::kDefaultSm90Schedule, cuda::Sm90Schedule::kPersistentDynamic);
  EXPECT_EQ(p.workspace_bytes, cuda::kSplitCounterBytes);
  // Not allowed (another GPU, ATTNSERVE_CUDA_PORTABLE=1): portable.
  EXPECT_EQ(PlanForward(Dense(2, 1024, 1024, 8, 2, 128), kH100Sms).kernel_family,
            KernelFamily::kPortable);
  // D = 72 reads into the second 64-column box of the 128 kernel.
  p = PlanForward(Dense(2, 512, 512, 4, 4, 72), kH100Sms, true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.kernel_head_dim, 128);
  // A long prefill the portable plan would split runs unsplit on sm90 (its
  // workspace: the schedule's item counters, no partials).
  p = PlanForward(Dense(1, 128, 8192, 8, 8, 128), kH100Sms, true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.workspace_bytes, cuda::Sm90ScheduleWorkspaceBytes(cuda::kDefaultSm90Schedule));
}

// The Hopper decode kernel (kSm90DecodeTileTable) takes decode tiles at its
// head dims exactly, splitting to one CTA per SM (the portable tile: two).
TEST(PlanForwardTest, Sm90DecodeTakesDecodeTilesItCovers) {
  if (!cuda::CompiledSm90DecodeHeadDim(128))
    GTEST_SKIP() << "this build has no sm_90a decode kernel for 128";
  Plan p = PlanForward(Dense(1, 1, 8192, 32, 8, 128), kH100Sms, /*allow_sm90=*/true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.tile_kind, TileKind::kDecode);
  EXPECT_EQ(p.pack_gqa, 4);
  // 8 CTAs of base (KV heads): 132 / 8 = 16 splits of 8 key tiles (portable: 32).
  EXPECT_EQ(p.num_splits, 16);
  EXPECT_EQ(PlanForward(Dense(1, 1, 8192, 32, 8, 128), kH100Sms).num_splits, 32);
  // B = 16: 128 CTAs of base already fill the SMs once: no split (portable: 2).
  EXPECT_EQ(PlanForward(Dense(16, 1, 8192, 32, 8, 128), kH100Sms, true).num_splits, 1);
  EXPECT_EQ(PlanForward(Dense(16, 1, 8192, 32, 8, 128), kH100Sms).num_splits, 2);
  EXPECT_EQ(cuda::PlanSmemBytes(p), cuda::Sm90DecodeSmemBytes(cuda::Sm90DecodeTileFor(128)));
  // B = 64 x Sk 4k: base 512 CTAs fill 97% of two 264-CTA waves: no split
  // (the portable tile, 396 a wave, takes 3).
  EXPECT_EQ(PlanForward(Dense(64, 1, 4096, 32, 8, 128), kH100Sms, true).num_splits, 1);
  // A head dim the kernel does not have exactly stays portable.
  EXPECT_EQ(PlanForward(Dense(1, 1, 8192, 32, 8, 72), kH100Sms, true).kernel_family,
            KernelFamily::kPortable);
}

// FP8 E4M3 calls plan as their BF16 view; on the Hopper prefill kernel Q K^T
// stays on the codes (fp8_qk), and P V runs on them too where the key tile
// takes k32 steps (fp8_pv), with smaller Q, K and V tiles in smem.
TEST(PlanForwardTest, Fp8PlansTheKernelThatRunsIt) {
  AttnParams fp8 = Dense(2, 1024, 1024, 8, 2, 128, /*causal=*/true);
  fp8.dtype = DType::kFP8E4M3;
  Plan p = PlanForward(fp8, kH100Sms);
  EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
  EXPECT_FALSE(p.fp8_qk);
  EXPECT_EQ(p.kernel_head_dim, 128);
  if (!cuda::CompiledSm90HeadDim(128))
    GTEST_SKIP() << "this build has no sm_90a kernel for head dim 128";
  p = PlanForward(fp8, kH100Sms, /*allow_sm90=*/true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_TRUE(p.fp8_qk);
  EXPECT_TRUE(p.fp8_pv);
  EXPECT_TRUE(p.fp8_poly_exp2);
  EXPECT_FALSE(p.fp8_extra_stage);
  EXPECT_EQ(cuda::PlanSmemBytes(p), cuda::Sm90SmemBytes(cuda::Sm90TileFor(128), 1, 0, 1));
  EXPECT_LT(cuda::PlanSmemBytes(p), cuda::Sm90SmemBytes(cuda::Sm90TileFor(128), 1));
  // A decode step dequantises all three (the decode kernel is BF16).
  AttnParams step = Dense(2, 1, 4096, 32, 8, 128);
  step.dtype = DType::kFP8E4M3;
  EXPECT_FALSE(PlanForward(step, kH100Sms, true).fp8_qk);
  EXPECT_FALSE(PlanForward(step, kH100Sms, true).fp8_pv);
  // D 64 and 256 run P V on FP8 wgmma too.
  for (int d : {64, 256}) {
    if (!cuda::CompiledSm90HeadDim(d)) continue;
    AttnParams other = Dense(2, 1024, 1024, 8, 2, d, /*causal=*/true);
    other.dtype = DType::kFP8E4M3;
    const Plan q = PlanForward(other, kH100Sms, true);
    EXPECT_TRUE(q.fp8_qk) << d;
    EXPECT_TRUE(q.fp8_pv) << d;
  }
  // FP8 P V needs whole k32 steps in 64- or 128-key V^T boxes: every Hopper
  // tile but D 192's 112 keys.
  for (const cuda::TileConfig& t : cuda::kSm90TileTable) {
    EXPECT_EQ(cuda::Sm90Fp8PvFits(t.block_n), t.head_dim != 192) << t.head_dim;
  }
  EXPECT_TRUE(cuda::Sm90Fp8PvFits(cuda::Sm90LongKeyTileFor(64).block_n));
}

// Varlen prefill and every head dim, through the next kernel up (boxes
// zero-fill past D); the kernel for a head dim as Sm90HeadDimFor says.
TEST(PlanForwardTest, Sm90FamilyTakesVarlenAndEveryHeadDim) {
  if (!cuda::CompiledSm90HeadDim(128))
    GTEST_SKIP() << "this build has no sm_90a kernel for head dim 128";
  AttnParams varlen = Dense(2, 512, 512, 4, 4, 128);
  const int32_t cu[3] = {0, 300, 512};
  varlen.cu_seqlens_q = cu;
  varlen.cu_seqlens_k = cu;
  Plan p = PlanForward(varlen, kH100Sms, true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.tile_kind, TileKind::kPrefill);
  // Over a cache's pages the prefill stays portable (the Hopper prefill
  // kernel reads tensors only); decode takes the Hopper decode kernel.
  EXPECT_EQ(PlanForward(varlen, kH100Sms, true, cuda::KvRows::kPages).kernel_family,
            KernelFamily::kPortable);
  if (cuda::CompiledSm90DecodeHeadDim(128)) {
    EXPECT_EQ(PlanForward(Dense(2, 1, 4096, 32, 8, 128), kH100Sms, true, cuda::KvRows::kPages)
                  .kernel_family,
              KernelFamily::kSm90);
  }
  struct Row {
    int head_dim, kernel;
  };
  for (const Row r : {Row{8, 64}, Row{40, 64}, Row{64, 64}, Row{72, 128}, Row{96, 128},
                      Row{136, 192}, Row{160, 192}, Row{192, 192}, Row{200, 256}, Row{256, 256}}) {
    if (!cuda::CompiledSm90HeadDim(r.kernel)) continue;
    p = PlanForward(Dense(2, 512, 512, 4, 4, r.head_dim), kH100Sms, true);
    EXPECT_EQ(p.kernel_family, KernelFamily::kSm90) << "D " << r.head_dim;
    EXPECT_EQ(p.kernel_head_dim, r.kernel) << "D " << r.head_dim;
  }
  if (cuda::CompiledSm90HeadDim(192)) {
    EXPECT_EQ(cuda::PlanSmemBytes(PlanForward(Dense(2, 512, 512, 4, 4, 192), kH100Sms, true)),
              cuda::Sm90SmemBytes(cuda::Sm90TileFor(192)));
    EXPECT_LE(cuda::Sm90SmemBytes(cuda::Sm90TileFor(192)), cuda::kSm90MaxSmemBytes);
  }
}

// Key ranges of kSm90LongKeysMinSk and more take the wider key tile where
// kSm90LongKeyTileTable lists one for the kernel head dim (64, which also
// serves D < 64); shorter ones, other head dims and the portable family keep
// their tiles. Varlen goes by its longest sequence (params.seqlen_k).
TEST(PlanForwardTest, Sm90LongKeyRangesTakeTheWideKeyTile) {
  if (!cuda::CompiledSm90LongKeyHeadDim(64)) {
    GTEST_SKIP() << "this build has no sm_90a long-key kernel for head dim 64";
  }
  const int min_sk = cuda::kSm90LongKeysMinSk;
  Plan p = PlanForward(Dense(1, 300, min_sk, 4, 2, 64, true), kH100Sms, true);
  EXPECT_EQ(p.kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(p.tile_kind, TileKind::kLongKeys);
  EXPECT_EQ(cuda::TileForPlan(p).block_n, cuda::Sm90LongKeyTileFor(64).block_n);
  EXPECT_GT(cuda::Sm90LongKeyTileFor(64).block_n, cuda::Sm90TileFor(64).block_n);
  EXPECT_EQ(cuda::PlanSmemBytes(p), cuda::Sm90SmemBytes(cuda::Sm90LongKeyTileFor(64)));
  EXPECT_LE(cuda::PlanSmemBytes(p), cuda::kSm90MaxSmemBytes);
  EXPECT_EQ(PlanForward(Dense(1, 300, 5000, 4, 2, 40), kH100Sms, true).tile_kind,
            TileKind::kLongKeys);
  EXPECT_EQ(PlanForward(Dense(1, 300, min_sk - 1, 4, 2, 64), kH100Sms, true).tile_kind,
            TileKind::kPrefill);
  EXPECT_EQ(PlanForward(Dense(1, 300, min_sk, 4, 2, 64), kH100Sms, false).tile_kind,
            TileKind::kPrefill);
  if (cuda::CompiledSm90HeadDim(128)) {
    EXPECT_EQ(PlanForward(Dense(1, 300, 2 * min_sk, 4, 2, 128), kH100Sms, true).tile_kind,
              TileKind::kPrefill);
  }
  AttnParams varlen = Dense(2, 300, min_sk + 10, 4, 4, 64);
  const int32_t cu_q[3] = {0, 100, 300};
  const int32_t cu_k[3] = {0, 10, min_sk + 10 + 10};
  varlen.cu_seqlens_q = cu_q;
  varlen.cu_seqlens_k = cu_k;
  EXPECT_EQ(PlanForward(varlen, kH100Sms, true).tile_kind, TileKind::kLongKeys);
  AttnParams fp8 = Dense(1, 300, min_sk, 4, 2, 64);
  fp8.dtype = DType::kFP8E4M3;
  p = PlanForward(fp8, kH100Sms, true);
  EXPECT_EQ(p.tile_kind, TileKind::kLongKeys);
  EXPECT_TRUE(p.fp8_qk);
  EXPECT_EQ(cuda::PlanSmemBytes(p), cuda::Sm90SmemBytes(cuda::Sm90LongKeyTileFor(64), 1, 0, 1));
}

TEST(PlanForwardTest, Sm90FamilyLeavesWhatItDoesNotCoverPortable) {
  // Short split prefill, Sk = 0.
  EXPECT_EQ(PlanForward(Dense(1, 32, 8192, 8, 8, 128), kH100Sms, true).kernel_family,
            KernelFamily::kPortable);
  EXPECT_EQ(PlanForward(Dense(1, 64, 0, 8, 8, 128), kH100Sms, true).kernel_family,
            KernelFamily::kPortable);
  if (!cuda::CompiledSm90HeadDim(64) && cuda::CompiledSm90HeadDim(128)) {
    // A dev build (128 only): D = 40 would read the 128 kernel's second box
    // as zeros only; the portable kernel serves it.
    EXPECT_EQ(PlanForward(Dense(2, 512, 512, 4, 4, 40), kH100Sms, true).kernel_family,
              KernelFamily::kPortable);
  }
}

// Score modifiers and masks: the portable kernel's banded instantiation
// (its kMods kernel; the banded tile with a band, a bias or an element mask); no GQA packing under
// a per-head block mask (a CTA follows one CSR row); split-KV as without them. Only the fields'
// presence matters here, so the pointers are dummies.
TEST(PlanForwardTest, ScoreModsTakeTheBandedKernels) {
  const float dummy = 0.f;
  const int32_t dummy_i = 0;
  auto with = [&](AttnParams a, int which) {
    switch (which) {
      case 0: a.alibi_slopes = &dummy; break;
      case 1: a.sinks = &dummy; break;
      case 2:
        a.bias = &dummy;
        a.bias_dtype = DType::kBF16;
        break;
      case 3: a.mask = reinterpret_cast<const uint8_t*>(&dummy); break;
      default:
        a.block_q = a.block_k = 128;
        a.block_row_ptr = &dummy_i;
        a.block_col_idx = &dummy_i;
        a.block_per_head = true;
        break;
    }
    return a;
  };
  for (int which = 0; which < 5; ++which) {
    SCOPED_TRACE(which);
    // Prefill: every mod on the Hopper kernel where this build has it.
    const bool hopper = cuda::CompiledSm90HeadDim(128);
    Plan p = PlanForward(with(Dense(4, 1024, 1024, 8, 8, 128), which), kH100Sms, true);
    EXPECT_EQ(p.kernel_family, hopper ? KernelFamily::kSm90 : KernelFamily::kPortable);
    // Hopper: the unbanded instantiation's mods kernels without a band.
    EXPECT_EQ(p.banded, !hopper);
    // A bias or element mask takes the banded tile (fewer registers live
    // while loading them), the others the prefill tile.
    const TileKind portable_tile =
        which == 2 || which == 3 ? TileKind::kBanded : TileKind::kPrefill;
    EXPECT_EQ(p.tile_kind, hopper ? TileKind::kPrefill : portable_tile);
    EXPECT_EQ(p.num_splits, 1);
    // Without the Hopper family: the portable banded instantiation for every
    // kind; the banded tile with a band.
    p = PlanForward(with(Dense(4, 1024, 1024, 8, 8, 128), which), kH100Sms, false);
    EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
    EXPECT_TRUE(p.banded);
    EXPECT_EQ(p.tile_kind, portable_tile);
    p = PlanForward(with(Dense(4, 1024, 1024, 8, 8, 128, true), which), kH100Sms, false);
    EXPECT_EQ(p.tile_kind, TileKind::kBanded);
    // Decode: the portable decode tile, GQA packed, split like a plain call.
    p = PlanForward(with(Dense(1, 1, 8192, 32, 8, 128), which), kH100Sms, true);
    EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
    EXPECT_EQ(p.tile_kind, TileKind::kDecode);
    EXPECT_TRUE(p.banded);
    EXPECT_EQ(p.pack_gqa, which == 4 ? 1 : 4) << "per-head block mask: unpacked";
    EXPECT_EQ(p.num_splits, PlanForward(which == 4 ? Dense(1, 1, 8192, 32, 32, 128)
                                                   : Dense(1, 1, 8192, 32, 8, 128),
                                        kH100Sms)
                                .num_splits);
    // Short prefill over long keys splits as the plain call does.
    p = PlanForward(with(Dense(1, 128, 8192, 8, 8, 128), which), kH100Sms, false);
    EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
    EXPECT_GT(p.num_splits, 1);
    // FP8 inputs with mods: dequantised on the portable kernel.
    AttnParams fp8 = with(Dense(4, 1024, 1024, 8, 8, 128), which);
    fp8.dtype = DType::kFP8E4M3;
    p = PlanForward(fp8, kH100Sms, true);
    EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
    EXPECT_FALSE(p.fp8_qk);
  }
  // A varlen bias, mask or block mask: the workspace holds the per-sequence
  // offsets after the counters (mods_prefix.h), split (before the partials) or not.
  {
    const int32_t cu[4] = {0, 100, 100, 700};
    AttnParams base = Dense(3, 600, 600, 8, 8, 128);
    base.cu_seqlens_q = base.cu_seqlens_k = cu;
    base.total_q = base.total_k = 700;
    const AttnParams v = with(base, 3);
    for (bool sm90 : {true, false}) {
      const Plan vp = PlanForward(v, kH100Sms, sm90);
      const int64_t partials = vp.num_splits > 1 ? cuda::SplitWorkspaceBytes(v, vp.num_splits)
                                                 : cuda::kSplitCounterBytes;
      EXPECT_EQ(vp.workspace_bytes, partials + 2 * 8 * 4);
    }
    EXPECT_FALSE(cuda::NeedsModsPrefix(with(base, 0))) << "ALiBi reads no pair layout";
  }
  // An FP32 bias runs on the portable kernel.
  AttnParams bias32 = with(Dense(4, 1024, 1024, 8, 8, 128), 2);
  bias32.bias_dtype = DType::kFP32;
  EXPECT_EQ(PlanForward(bias32, kH100Sms, true).kernel_family, KernelFamily::kPortable);
  // A block mask whose key blocks the Hopper tile does not divide stays
  // portable (Sm90BlockMaskFits), and never takes the long-key tile.
  if (cuda::CompiledSm90HeadDim(128)) {
    AttnParams blocks = with(Dense(1, 16384, 16384, 8, 8, 128), 4);
    const Plan fits = PlanForward(blocks, kH100Sms, true);
    EXPECT_EQ(fits.kernel_family, KernelFamily::kSm90);
    EXPECT_EQ(fits.tile_kind, TileKind::kPrefill);
    EXPECT_EQ(cuda::Sm90BlockMaskFits(cuda::Sm90TileFor(128).block_n, 128, 128), true);
    // Its workspace: the counters, then the item order (16 bytes per item).
    EXPECT_EQ(fits.workspace_bytes, cuda::kSplitCounterBytes + int64_t{128} * 8 * 16);
  }
  // A block mask shared by the heads keeps GQA packing.
  AttnParams shared = with(Dense(1, 1, 8192, 32, 8, 128), 4);
  shared.block_per_head = false;
  EXPECT_EQ(PlanForward(shared, kH100Sms, true).pack_gqa, 4);
  AttnParams per_head = shared;
  per_head.block_per_head = true;
  EXPECT_EQ(PlanForward(per_head, kH100Sms, true).pack_gqa, 1);
  // A cache's pages (ALiBi and sinks, the paged kernels' mods): the portable
  // kernel, prefill and decode alike (neither Hopper kernel applies them to pages).
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which);
    for (const AttnParams& a : {with(Dense(4, 1024, 1024, 8, 8, 128), which),
                                with(Dense(1, 1, 8192, 32, 8, 128), which)}) {
      const Plan p = PlanForward(a, kH100Sms, true, cuda::KvRows::kPages);
      EXPECT_EQ(p.kernel_family, KernelFamily::kPortable);
      EXPECT_TRUE(p.banded);
    }
  }
  // Without mods nothing changes: unbanded prefill is not banded.
  EXPECT_FALSE(PlanForward(Dense(4, 1024, 1024, 8, 8, 128), kH100Sms).banded);
}

}  // namespace
}  // namespace attnserve
