// How the absorbed-MLA paged decode kernel (paged_mla.cu) is planned: which
// calls it serves, its row tiles, and how many splits of the key range a
// launch takes. Plain C++ (the backend plans with it; the kernel reads the
// split rule), like paged_attn_fp8_plan.h.
#pragma once

#include <algorithm>
#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/paged_decode_plan.h"
#include "backend/paged_kv.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// The absorbed form's geometry: one K/V head of 512 latent + 64 rope dims,
// V the first 512 of each K row.
constexpr int kMlaHeadDim = 576;
constexpr int kMlaHeadDimV = 512;
// Keys a pipeline stage holds (a stage spans at most two pages of 16).
constexpr int kMlaKeyTile = 32;
// Batch-invariant launches: a sequence's n key tiles go to splits of
// max(ceil(n / kMlaInvariantSplits), kMlaInvariantMinTiles) tiles each, a
// function of its own length alone; the combine adds them in split order.
constexpr int kMlaInvariantSplits = 32;
constexpr int kMlaInvariantMinTiles = 16;
// Fewest key tiles a split takes when the planner splits for occupancy.
constexpr int kMlaMinTilesPerSplit = 4;

// Packed query rows (new tokens x query heads) one CTA computes: 16, 32 or
// 64, the smallest that holds a sequence's rows (more rows: several CTAs).
inline int MlaRowsPerCta(int rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }

// True when the kernel serves `p`: an absorbed cache (V inside K), 576 / 512,
// one K/V head, FP16 or BF16 pages. Anything else MLA-shaped is refused.
inline bool MlaDecodeCovers(const AttnParams& p, const KvPages& pages) {
  return pages.v_in_k && !pages.fp8_e4m3 && p.head_dim == kMlaHeadDim &&
         HeadDimV(p) == kMlaHeadDimV && p.num_heads_kv == 1 &&
         (p.dtype == DType::kBF16 || p.dtype == DType::kFP16);
}

// Key tiles per split of a CTA whose visible keys span n_tiles tiles.
ATTN_HOST_DEVICE int MlaTilesPerSplit(int n_tiles, int num_splits, bool invariant) {
  return DecodeUnitsPerSplit(n_tiles, num_splits, invariant, kMlaInvariantSplits,
                             kMlaInvariantMinTiles);
}

// Pipeline stages of the kernel with `rows` rows a CTA: as many 32-key
// stages as fit beside Q and the partial scores.
constexpr int MlaStages(int rows) { return rows == 16 ? 5 : rows == 32 ? 4 : 3; }
// Dynamic shared memory of that kernel: Q, the stage ring, the partial
// scores of 8 / (row groups) head-dim slices, six per-row words.
constexpr int MlaSmemBytes(int rows) {
  return rows * kMlaHeadDim * 2 + MlaStages(rows) * kMlaKeyTile * kMlaHeadDim * 2 +
         (rows == 64 ? 4 : 8) * rows * kMlaKeyTile * 4 + 6 * rows * 4;
}

// The plan of a call MlaDecodeCovers: kernel_head_dim 576, pack_gqa Hq, and
// the splits of PlanDecodeSplits over 32-key tiles, a split's CTAs batch x
// row blocks, one per SM, each split at least kMlaMinTilesPerSplit tiles.
// Its split workspace holds fp32 partials [split, total_q, Hq, Dv] and their
// log2-domain LSE [split, total_q, Hq] past the counters (unused here).
inline Plan PlanPagedMla(const AttnParams& p, int num_sms) {
  const int64_t rows = int64_t{p.seqlen_q} * p.num_heads_q;
  const int64_t per_cta = MlaRowsPerCta(static_cast<int>(std::min<int64_t>(rows, 64)));
  const int64_t row_blocks = (rows + per_cta - 1) / per_cta;
  const int64_t n_tiles = (int64_t{p.seqlen_k} + kMlaKeyTile - 1) / kMlaKeyTile;
  Plan plan =
      PlanDecodeSplits(p, {kMlaInvariantSplits, kMlaInvariantMinTiles, kMlaMinTilesPerSplit, 1},
                       n_tiles, int64_t{p.batch} * row_blocks, num_sms);
  plan.kernel_head_dim = kMlaHeadDim;
  plan.pack_gqa = p.num_heads_q;
  return plan;
}

}  // namespace cuda
}  // namespace attnserve
