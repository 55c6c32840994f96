// RequestCost: what one request costs the device, for FairQueue (fair_queue.h).
#include "server/fair_queue.h"

#include <algorithm>

#include "common/dtype.h"

namespace attnserve {

int64_t RequestCost(const AttnParams& p) {
  const int64_t width_q = int64_t{p.num_heads_q} * p.head_dim;
  const int64_t width_kv = int64_t{p.num_heads_kv} * p.head_dim;
  // Q and O of every query row, K and V of every key row.
  const int64_t bytes = (2 * p.total_q * width_q + 2 * p.total_k * width_kv) * DTypeSize(p.dtype);
  // Query-key pairs: per sequence with varlen offsets, else B × Sq × Sk.
  int64_t pairs = int64_t{p.batch} * p.seqlen_q * p.seqlen_k;
  if (p.cu_seqlens_q != nullptr && p.cu_seqlens_k != nullptr) {
    pairs = 0;
    for (int32_t b = 0; b < p.batch; ++b) {
      pairs += int64_t{p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]} *
               (p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]);
    }
  }
  // Two matrix products (Q·Kᵀ and P·V), a multiply and an add each.
  const int64_t flops = 4 * pairs * width_q;
  return kCostPerRequest + std::max(bytes, flops / kCostFlopsPerByte);
}

}  // namespace attnserve
