// PlanForward: the CUDA forward path's choice of kernel, tile, split-KV and
// GQA packing for a call; see attn_fwd_plan.h. Plain C++ (no CUDA headers).
#include "backend/cuda/attn_fwd_plan.h"

#include <algorithm>
#include <cstdlib>

#include "backend/cuda/generated/kernel_set.h"
#include "backend/cuda/launch_splits.h"
#include "backend/cuda/mods_prefix.h"

namespace attnserve {
namespace cuda {
namespace {

// Resident CTAs of `t` per SM, estimated from its threads at t.regs registers
// each (64K registers per SM) and its shared memory (smem_bytes; 227 KB per
// SM on sm90, plus 1 KB the runtime reserves per CTA).
int64_t CtasPerSm(const TileConfig& t, int smem_bytes) {
  const int threads = t.num_warps * 32;
  return std::max(1, std::min(65536 / (t.regs * threads), (227 * 1024) / (smem_bytes + 1024)));
}

// CTAs per SM a split decode launch aims at when base alone is fewer. The
// decode tile fits 3 per SM, but fewer, longer splits are faster than a full
// 3-per-SM wave.
constexpr int64_t kDecodeCtasPerSm = 2;
// The Hopper decode kernel's: one. Its TMA ring keeps ~100 KB in flight per
// CTA, and one CTA per SM is at or above two by CUDA events and under Nsight
// Compute alike.
constexpr int64_t kSm90DecodeCtasPerSm = 1;

// Decode: splits of at least 2 key tiles, at most kMaxSplits. Base under
// ctas_per_sm per SM: as many splits as reach that. Otherwise the fewest
// splits whose CTAs fill >= 90% of the waves they take, else the fullest.
int64_t DecodeSplits(int64_t base, int64_t n_blocks, int64_t wave, int num_sms,
                     int64_t ctas_per_sm) {
  const int64_t max_splits = std::min<int64_t>(n_blocks / 2, kMaxSplits);
  if (base <= ctas_per_sm * num_sms) {
    return std::max<int64_t>(1, std::min<int64_t>(ctas_per_sm * num_sms / base, max_splits));
  }
  int64_t best = 1;
  double best_eff = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t ctas = base * s;
    const double eff =
        static_cast<double>(ctas) / (static_cast<double>((ctas + wave - 1) / wave) * wave);
    if (eff > best_eff + 1e-9) {
      best = s;
      best_eff = eff;
    }
    if (eff >= 0.9) break;
  }
  return best;
}

// The Hopper kernel for `p` (its head dim), or 0 when the family does not
// cover the call: it runs FP16/BF16 prefill, dense and varlen, with one KV
// tile loop per CTA (no split-KV, no GQA packing into M) and reads Q/K/V
// through TMA boxes of 64 columns that zero-fill past the head dim. The
// smallest compiled kernel at or above D serves it (D <= 64: 64; 72..128:
// 128; 136..192: 192; 200..256: 256) as long as D reaches into the kernel's
// last box: a dev build without the smaller kernels sends a call to the
// portable kernel rather than through boxes of zeros only. Sk = 0 (no keys)
// stays portable: a tensor map cannot have an empty dimension.
int Sm90HeadDimFor(const AttnParams& p, const Plan& portable) {
  if (p.seqlen_k == 0 || portable.pack_gqa != 1 || portable.tile_kind == TileKind::kDecode) {
    return 0;
  }
  // Prefill that the portable plan would split: taken when the query run is
  // long enough to fill 64-row warpgroup tiles; shorter ones keep split-KV.
  if (portable.num_splits > 1 && p.seqlen_q < 64) return 0;
  // MLA shapes (V's head dim differing): the compiled pair whose boxes the
  // call's dims reach into (Sm90DvKernelFor), on kSm90DvTileTable's tile.
  if (HeadDimV(p) != p.head_dim) return Sm90DvKernelFor(p.head_dim, HeadDimV(p)).head_dim;
  for (const TileConfig& t : kSm90TileTable) {
    if (t.head_dim < p.head_dim || !CompiledSm90HeadDim(t.head_dim)) continue;
    return p.head_dim > t.head_dim - 64 ? t.head_dim : 0;
  }
  return 0;
}

// True when the Hopper prefill kernel takes p's score modifiers: ALiBi,
// sinks, an FP16/BF16 bias, an element mask and a block mask (where
// Sm90BlockMaskFits) run there (attn_fwd_sm90.h); an FP32 bias runs on the
// portable kernel.
bool Sm90PrefillTakesMods(const AttnParams& p) {
  return p.bias == nullptr || p.bias_dtype == DType::kFP16 || p.bias_dtype == DType::kBF16;
}

// True when the Hopper decode kernel serves a decode-tile call of `p`: its
// table has the head dim exactly (Q rows are copied whole, so no padding
// columns), this build compiled it, and there are keys (a tensor map cannot
// have an empty dimension). Everything else the portable decode tile serves
// (varlen, a cache's pages, GQA packing, masks, softcap) it serves too.
bool Sm90DecodeCovers(const AttnParams& p) {
  return Sm90DecodeTileFor(p.head_dim).head_dim == p.head_dim &&
         CompiledSm90DecodeHeadDim(p.head_dim) && p.seqlen_k > 0;
}

}  // namespace

bool Fp8PvPlannedAt(int head_dim) {
  // D 192 is left out: its 112-key tile is not a whole number of k32 steps.
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

int InvariantMinTiles() {
  static const int tiles = [] {
    const char* env = std::getenv("ATTNSERVE_CUDA_INVARIANT_MIN_TILES");
    const int v = env != nullptr ? std::atoi(env) : 0;
    return v >= 1 && v <= kInvariantMinTilesMax ? v : kInvariantMinTiles;
  }();
  return tiles;
}

int LaunchSplits(const AttnParams& p, const Plan& plan) {
  if (!p.batch_invariant || plan.tile_kind != TileKind::kDecode || plan.num_splits <= 1) {
    return plan.num_splits;
  }
  const int64_t block_n = TileForPlan(plan).block_n;
  const int64_t tiles = (int64_t{p.seqlen_k} + block_n - 1) / block_n;
  return InvariantDecodeGrid(tiles, plan.num_splits, InvariantMinTiles());
}

TileConfig TileForPlan(const Plan& plan) {
  if (plan.kernel_family != KernelFamily::kSm90) {
    return TileFor(plan.tile_kind, plan.kernel_head_dim);
  }
  switch (plan.tile_kind) {
    case TileKind::kDecode: return Sm90DecodeTileFor(plan.kernel_head_dim);
    case TileKind::kLongKeys: return Sm90LongKeyTileFor(plan.kernel_head_dim);
    default: return Sm90TileFor(plan.kernel_head_dim);
  }
}

int PlanSmemBytes(const Plan& plan) {
  TileConfig tile = TileForPlan(plan);
  if (plan.kernel_family == KernelFamily::kSm90 && plan.fp8_pv && plan.fp8_extra_stage) {
    ++tile.stages;
  }
  if (plan.kernel_family != KernelFamily::kSm90) return SmemBytes(tile);
  return plan.tile_kind == TileKind::kDecode
             ? Sm90DecodeSmemBytes(tile)
             : Sm90SmemBytes(tile, plan.fp8_qk ? 1 : 2, 0, plan.fp8_pv ? 1 : 2);
}

// Split-KV heuristic. A CTA per (m block, head, batch) is "base"; a wave is
// num_sms x resident CTAs per SM (CtasPerSm). A second, partial wave costs as
// much as a full one, so splitting the key range aims at whole waves, with at
// least 2 key tiles per split (a split's fixed cost, Q load + epilogue +
// combine traffic, stays small against its tiles) and at most 128 splits.
// Launches of more than kMaxSplitGroups CTAs of base (one ticket counter
// each) never split; past about 10 waves none would anyway.
//  - Decode tile (M extent, seqlen_q x packed GQA heads, <= 16 rows): up to
//    kDecodeCtasPerSm CTAs per SM when base is fewer, else the fewest splits
//    that fill >= 90% of their waves (DecodeSplits).
//  - Otherwise, when base fills at most half a wave: splits = wave / base.
// On sm90 (allow_sm90) a decode tile call the Hopper decode kernel covers
// takes its tile (kSm90DecodeTileTable: 2 CTAs per SM fit, a wave of 264 on
// an H100) and splits aiming at one CTA per SM (kSm90DecodeCtasPerSm): B=1 x
// 8k, 8 CTAs of base -> 16 splits; B=16, 128 -> none.
// Worked examples on an H100 (132 SMs), D=128, tests/backend/plan_forward_test.cc
// checks each:
//  - Decode, B=1, Hq=32, Hkv=8, Sq=1, Sk=8192: the 4 query heads of a KV head
//    pack into M (4 rows: the decode tile, 16x64, 168 registers x 128 threads
//    and 74 KB smem -> 3 CTAs/SM, a wave of 396); base = 1 m block x 8 KV
//    heads = 8 CTAs, under 2 per SM: 264 / 8 = 33 splits; 128 key tiles / 33
//    -> 4 tiles each -> 32 splits of 256 keys, 256 CTAs.
//  - Decode, B=16, same heads, Sk=8192: base 128 CTAs; 264 / 128 = 2 splits.
//  - Decode, B=64, Hq=32, Hkv=8, Sq=1, Sk=4096: base 512 CTAs are 1.29 waves;
//    3 splits make 1536 CTAs = 3.88 waves (97%) -> 3 splits of 22 tiles.
//  - Prefill tile, B=1, Hq=Hkv=8, Sq=128, Sk=8192, no mask: 128x64 x 255
//    registers -> 2 CTAs/SM, a wave of 264; base = 8; 264 / 8 = 33 splits;
//    128 tiles / 33 -> 4 tiles each -> 32 splits of 256 keys.
//  - Prefill, B=1, Hq=32, Sq=Sk=1024: base 8 x 32 = 256 CTAs, over half a
//    wave: no split.
Plan PlanForward(const AttnParams& params, int num_sms, bool allow_sm90, KvRows kv) {
  if (params.dtype == DType::kFP8E4M3) {
    // The BF16 view's plan (its kernels write O as BF16, the FP8 contract);
    // on the Hopper prefill kernel Q K^T stays on the codes.
    AttnParams bf16 = params;
    bf16.dtype = DType::kBF16;
    // The Hopper kernel's FP8 Q K^T takes no score modifiers: such calls
    // run dequantised on the portable kernel.
    Plan plan = PlanForward(bf16, num_sms, allow_sm90 && !HasScoreMods(params), kv);
    plan.fp8_qk = plan.kernel_family == KernelFamily::kSm90 && plan.tile_kind != TileKind::kDecode;
    // ... and P V too where the tile's key width takes FP8 steps, at D 128
    // (Fp8PvPlannedAt: D 64 and 256 read V^T in 64-byte boxes, and wait for
    // their GPU run).
    plan.fp8_pv = plan.fp8_qk && Sm90Fp8PvFits(TileForPlan(plan).block_n) &&
                  Fp8PvPlannedAt(params.head_dim) && HeadDimV(params) == params.head_dim;
    // Its softmax with a quarter of the exp2 off the MUFU unit (faster in
    // the A/B of bench/NOTES-cuda.md's "FP8 P V on FP8 wgmma").
    plan.fp8_poly_exp2 = plan.fp8_pv;
    return plan;
  }
  const AttnParams& p = params;
  Plan plan;
  // MLA shapes (V/O head dim differing): a portable pair (the Hopper
  // family's below where it takes the call), tensors only.
  const bool distinct_v = HeadDimV(p) != p.head_dim;
  if (distinct_v) {
    if (kv == KvRows::kTensors) {
      plan.kernel_head_dim = DvKernelFor(p.head_dim, HeadDimV(p)).head_dim;
    }
  } else {
    for (const TileConfig& t : kTileTable) {
      if (t.head_dim >= p.head_dim && CompiledHeadDim(t.head_dim)) {
        plan.kernel_head_dim = t.head_dim;
        break;
      }
    }
  }
  if (plan.kernel_head_dim == 0) return plan;
  // Score modifiers and masks run on the banded instantiations, as kernels
  // of their own (the portable kernel's and the Hopper kernel's kMods): the
  // banded mask policy with no band sees every key, so one compiled set
  // serves mods with or without a band and the plain kernels stay as they are.
  const bool mods = HasScoreMods(p);
  plan.banded = IsBanded(p) || mods;
  // The banded tile is for a real band and for a bias or element mask (its
  // narrower score tile loads them with fewer registers live); ALiBi, sinks
  // and block masks without a band keep the prefill tile, whose wider key
  // tile re-reads Q fragments half as often.
  const bool banded_tile = IsBanded(p) || p.bias != nullptr || p.mask != nullptr;
  if (banded_tile && TileFor(TileKind::kBanded, plan.kernel_head_dim).head_dim != 0) {
    plan.tile_kind = TileKind::kBanded;
  }
  const int group = p.num_heads_q / std::max(p.num_heads_kv, 1);
  // Pack GQA heads into M for short query runs (decode, speculative steps):
  // otherwise each query head's CTA would stream the same K/V for 1..16 rows.
  // Not under a per-head block mask: a CTA skips the key blocks of one CSR
  // row, and packed rows of several heads would need several.
  const bool per_head_blocks = HasBlockMask(p) && p.block_per_head;
  plan.pack_gqa = (group > 1 && p.seqlen_q <= 16 && !per_head_blocks) ? group : 1;
  const int64_t rows = int64_t{p.seqlen_q} * plan.pack_gqa;
  if (rows <= kDecodeMaxRows && !distinct_v &&
      TileFor(TileKind::kDecode, plan.kernel_head_dim).head_dim != 0) {
    plan.tile_kind = TileKind::kDecode;
    if (allow_sm90 && Sm90DecodeCovers(p) && !mods) plan.kernel_family = KernelFamily::kSm90;
  }
  const TileConfig tile = TileForPlan(plan);
  const int64_t m_blocks = (rows + tile.block_m - 1) / tile.block_m;
  const int64_t heads = plan.pack_gqa > 1 ? p.num_heads_kv : p.num_heads_q;
  const int64_t base = m_blocks * heads * p.batch;
  const int64_t n_blocks = (int64_t{p.seqlen_k} + tile.block_n - 1) / tile.block_n;
  const int64_t wave = int64_t{num_sms} * CtasPerSm(tile, PlanSmemBytes(plan));
  int64_t splits = 1;
  if (p.batch_invariant) {
    // S, whatever the sizes and SM count (the launch runs as many of them as
    // its longest sequence needs: LaunchSplits); prefill tiles never split.
    if (plan.tile_kind == TileKind::kDecode && p.seqlen_k > 0) {
      plan.num_splits = InvariantDecodeSplits(heads);
    }
  } else if (base > kMaxSplitGroups) {
    // No split: one ticket counter per group would not fit the workspace's block.
  } else if (plan.tile_kind == TileKind::kDecode && base > 0 && n_blocks >= 4) {
    splits = DecodeSplits(
        base, n_blocks, wave, num_sms,
        plan.kernel_family == KernelFamily::kSm90 ? kSm90DecodeCtasPerSm : kDecodeCtasPerSm);
  } else if (base > 0 && base * 2 <= wave && n_blocks >= 4) {
    splits = std::min<int64_t>({wave / base, n_blocks / 2, kMaxSplits});
  }
  if (splits > 1) {
    // Equalise: with per = ceil(n_blocks / splits) tiles each, fewer splits may do.
    const int64_t per = (n_blocks + splits - 1) / splits;
    plan.num_splits = static_cast<int>((n_blocks + per - 1) / per);
  }
  if (plan.num_splits > 1) {
    plan.workspace_bytes = SplitWorkspaceBytes(p, plan.num_splits);
  }
  const int sm90_head_dim =
      allow_sm90 && kv == KvRows::kTensors && Sm90PrefillTakesMods(p) ? Sm90HeadDimFor(p, plan) : 0;
  // A block mask goes to the Hopper kernel only when its key tiles lie in
  // whole key blocks (Sm90BlockMaskFits), and then on kSm90TileTable's tile
  // (MLA shapes: kSm90DvTileTable's).
  const int sm90_block_n = distinct_v ? Sm90DvTileFor(sm90_head_dim, HeadDimV(p)).block_n
                                      : Sm90TileFor(sm90_head_dim).block_n;
  const bool sm90_blocks_fit =
      !HasBlockMask(p) ||
      (sm90_head_dim != 0 && Sm90BlockMaskFits(sm90_block_n, p.block_q, p.block_k));
  if (sm90_head_dim != 0 && sm90_blocks_fit) {
    plan.kernel_family = KernelFamily::kSm90;
    plan.kernel_head_dim = sm90_head_dim;
    // Both Hopper instantiations carry the mods kernels: a call without a
    // band takes the unbanded one's (no per-tile band test).
    plan.banded = IsBanded(p);
    const bool long_keys = p.seqlen_k >= kSm90LongKeysMinSk && !HasBlockMask(p) && !distinct_v &&
                           Sm90LongKeyTileFor(sm90_head_dim).head_dim != 0 &&
                           CompiledSm90LongKeyHeadDim(sm90_head_dim);
    plan.tile_kind = long_keys ? TileKind::kLongKeys : TileKind::kPrefill;
    plan.num_splits = 1;
    plan.workspace_bytes = Sm90ScheduleWorkspaceBytes(kDefaultSm90Schedule);
  }
  // A varlen bias, element mask or block mask: their per-sequence offsets
  // are staged after the counters (before any partials) once per launch.
  if (NeedsModsPrefix(p)) {
    plan.workspace_bytes = std::max(plan.workspace_bytes, kSplitCounterBytes) + ModsPrefixBytes(p);
  }
  // A block-masked Hopper launch: its item order after them (never split).
  if (plan.kernel_family == KernelFamily::kSm90 && plan.tile_kind != TileKind::kDecode &&
      ItemOrderBytes(p) > 0) {
    plan.workspace_bytes = ItemOrderOffset(p) + ItemOrderBytes(p);
  }
  return plan;
}

}  // namespace cuda
}  // namespace attnserve
