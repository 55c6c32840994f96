// The one rule for merging partial attention results over disjoint key sets
// through their log-sum-exp (the rescaling the FlashAttention paper derives):
//   LSE = log sum_i exp(LSE_i),   O = sum_i exp(LSE_i - LSE) * O_i,
// with the largest LSE_i subtracted first so no exp overflows, in FP32. A
// partial that saw no key (LSE_i = -inf) contributes nothing whatever its O_i
// holds; when none saw a key, O is 0 and LSE is -inf. Used by the client
// (client/lse_merge.h, partials from several servers) and the server (a K/V
// cache whose sequences span devices, server/kv/span_launch.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attnserve {

// The merge's weights for one (query row, head) of `n` partials:
// weights[i] = exp(lse_i - LSE) (0 for a partial that saw no key); returns
// LSE, or -inf with every weight 0 when none saw a key. The caller has
// checked that no LSE is NaN or +inf.
inline float LseMergeWeights(int n, const float* lse, float* weights) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m = neg_inf;
  for (int i = 0; i < n; ++i) m = std::max(m, lse[i]);
  if (m == neg_inf) {
    std::fill(weights, weights + n, 0.0f);
    return neg_inf;
  }
  float total = 0.0f;
  for (int i = 0; i < n; ++i) {
    weights[i] = lse[i] == neg_inf ? 0.0f : std::exp(lse[i] - m);
    total += weights[i];
  }
  // total >= 1: the largest partial's weight is exp(0).
  for (int i = 0; i < n; ++i) weights[i] /= total;
  return m + std::log(total);
}

// Merges one (query row, head): `n` partial LSEs and their O rows of `dim`
// values, read as load(i, d). Writes the merged row to `out` and returns the
// merged LSE. `weights` is scratch of n floats. The caller has checked that no
// LSE is NaN or +inf.
template <typename Load>
float MergeLseRow(int n, const float* lse, int64_t dim, Load load, float* weights, float* out) {
  const float merged = LseMergeWeights(n, lse, weights);
  std::fill(out, out + dim, 0.0f);
  for (int i = 0; i < n; ++i) {
    if (weights[i] == 0.0f) continue;  // its O holds nothing of this row
    for (int64_t d = 0; d < dim; ++d) out[d] += weights[i] * load(i, d);
  }
  return merged;
}

}  // namespace attnserve
