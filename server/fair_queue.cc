// RequestCost: what one request costs the device, for FairQueue (fair_queue.h).
#include "server/fair_queue.h"

#include <algorithm>

#include "common/dtype.h"

namespace attnserve {

namespace {

// Q and O of every query row, K and V of every key row, and `pairs`
// query-key pairs.
int64_t Cost(DType dtype, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t total_q,
             int64_t total_k, int64_t pairs) {
  const int64_t width_q = heads_q * head_dim;
  const int64_t width_kv = heads_kv * head_dim;
  const int64_t bytes = (2 * total_q * width_q + 2 * total_k * width_kv) * DTypeSize(dtype);
  // Two matrix products (Q·Kᵀ and P·V), a multiply and an add each.
  const int64_t flops = 4 * pairs * width_q;
  return kCostPerRequest + std::max(bytes, flops / kCostFlopsPerByte);
}

// Query-key pairs: per sequence with varlen offsets, else B × Sq × Sk.
int64_t Pairs(int32_t batch, int32_t seqlen_q, int32_t seqlen_k, const int32_t* cu_seqlens_q,
              const int32_t* cu_seqlens_k) {
  if (cu_seqlens_q == nullptr || cu_seqlens_k == nullptr) {
    return int64_t{batch} * seqlen_q * seqlen_k;
  }
  int64_t pairs = 0;
  for (int32_t b = 0; b < batch; ++b) {
    pairs +=
        int64_t{cu_seqlens_q[b + 1] - cu_seqlens_q[b]} * (cu_seqlens_k[b + 1] - cu_seqlens_k[b]);
  }
  return pairs;
}

}  // namespace

int64_t RequestCost(const AttnParams& p) {
  return Cost(p.dtype, p.num_heads_q, p.num_heads_kv, p.head_dim, p.total_q, p.total_k,
              Pairs(p.batch, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k));
}

int64_t RequestCost(const AttnShape& s) {
  const bool varlen = s.cu_seqlens_q != nullptr && s.cu_seqlens_k != nullptr;
  const int64_t total_q = varlen ? s.cu_seqlens_q[s.batch] : int64_t{s.batch} * s.seqlen_q;
  const int64_t total_k = varlen ? s.cu_seqlens_k[s.batch] : int64_t{s.batch} * s.seqlen_k;
  return Cost(s.dtype, s.num_heads_q, s.num_heads_kv, s.head_dim, total_q, total_k,
              Pairs(s.batch, s.seqlen_q, s.seqlen_k, s.cu_seqlens_q, s.cu_seqlens_k));
}

int64_t RequestCost(const PagedAttnParams& p) {
  const AttnParams& a = p.attn;
  int64_t total_q = 0;
  int64_t total_k = 0;
  int64_t pairs = 0;
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t rows = SeqLenQ(a, b);
    total_q += rows;
    const int64_t context = p.seqlens_k != nullptr ? p.seqlens_k[b] : 0;
    total_k += context;
    pairs += rows * context;
  }
  return Cost(a.dtype, a.num_heads_q, a.num_heads_kv, a.head_dim, total_q, total_k, pairs);
}

}  // namespace attnserve
