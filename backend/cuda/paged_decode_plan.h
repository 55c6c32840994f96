// The split rule the paged decode kernels share (the FP8 cache's,
// paged_attn_fp8_plan.h, and the absorbed MLA's, paged_mla_plan.h): how many
// splits of the key range a launch takes and which units each split's CTA
// scans. A kernel counts keys in its own units (16-key chunks, 32-key tiles)
// and brings its own constants. Plain C++ (the kernels read UnitsPerSplit).
#pragma once

#include <algorithm>
#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Units per split of a CTA whose visible keys span n_units units. Batch-
// invariant launches: max(ceil(n_units / invariant_splits), invariant_min),
// a function of its own sequence alone (the combine adds the splits in split
// order); otherwise ceil(n_units / num_splits).
ATTN_HOST_DEVICE int DecodeUnitsPerSplit(int n_units, int num_splits, bool invariant,
                                         int invariant_splits, int invariant_min) {
  if (invariant) {
    const int per = (n_units + invariant_splits - 1) / invariant_splits;
    return per > invariant_min ? per : invariant_min;
  }
  return (n_units + num_splits - 1) / num_splits;
}

// A kernel's constants of the rule.
struct DecodeSplitRule {
  int invariant_splits;     // DecodeUnitsPerSplit's, for batch-invariant launches
  int invariant_min;        // (the same two the kernel passes)
  int min_units_per_split;  // fewest units a split takes when splitting for occupancy
  int64_t ctas_per_sm;      // resident CTAs per SM (the kernel's launch bounds)
};

// The split fields of a decode plan whose longest sequence spans n_units
// units and whose launch has ctas_per_split CTAs a split: tile_kind kDecode,
// banded, and num_splits: batch-invariant, enough for the longest sequence
// under DecodeUnitsPerSplit; otherwise the fewest splits whose CTAs (num_sms
// x ctas_per_sm a wave) fill >= 90% of the waves they take, each split at
// least min_units_per_split units, then as few as give each split the same
// units. A split launch (and every batch-invariant one, whose results must
// not depend on whether it split) takes the split workspace's layout for its
// fp32 partials. The caller sets kernel_head_dim and pack_gqa.
// Example (FP8, 2 CTAs per SM, 132 SMs, 8 CTAs a split, 512 chunks): 30
// splits are the first to fill 90% of a wave; 512 / 30 -> 18 chunks each,
// which 29 splits take.
inline Plan PlanDecodeSplits(const AttnParams& p, const DecodeSplitRule& rule, int64_t n_units,
                             int64_t ctas_per_split, int num_sms) {
  Plan plan;
  plan.tile_kind = TileKind::kDecode;
  plan.banded = IsBanded(p);
  int64_t splits = 1;
  if (p.batch_invariant) {
    const int64_t per = DecodeUnitsPerSplit(static_cast<int>(n_units), 1, true,
                                            rule.invariant_splits, rule.invariant_min);
    splits = std::max<int64_t>(1, (n_units + per - 1) / per);
  } else {
    const int64_t wave = std::max<int64_t>(1, int64_t{num_sms} * rule.ctas_per_sm);
    const int64_t max_splits =
        std::max<int64_t>(1, std::min<int64_t>(n_units / rule.min_units_per_split, kMaxSplits));
    double best_eff = 0.0;
    for (int64_t s = 1; s <= max_splits && ctas_per_split > 0; ++s) {
      const int64_t ctas = ctas_per_split * s;
      const double eff =
          static_cast<double>(ctas) / (static_cast<double>((ctas + wave - 1) / wave) * wave);
      if (eff > best_eff + 1e-9) {
        splits = s;
        best_eff = eff;
      }
      if (eff >= 0.9) break;
    }
    const int64_t per = std::max<int64_t>(1, (n_units + splits - 1) / splits);
    splits = std::max<int64_t>(1, (n_units + per - 1) / per);
  }
  plan.num_splits = static_cast<int32_t>(splits);
  if (splits > 1 || p.batch_invariant)
    plan.workspace_bytes = SplitWorkspaceBytes(p, plan.num_splits);
  return plan;
}

}  // namespace cuda
}  // namespace attnserve
