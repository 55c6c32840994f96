// MakeAttnParams; see make_params.h.
#include "backend/make_params.h"

#include <algorithm>

#include "backend/score_range.h"

namespace attnserve {

AttnParams MakeAttnParams(const AttnShape& shape, const AttnOptions& options,
                          const AttnPointers& pointers) {
  AttnParams p{};
  p.dtype = shape.dtype;
  p.q = pointers.q;
  p.k = pointers.k;
  p.v = pointers.v;
  p.o = pointers.o;
  p.lse = pointers.lse;
  p.devices = pointers.devices;
  p.batch = shape.batch;
  p.num_heads_q = shape.num_heads_q;
  p.num_heads_kv = shape.num_heads_kv;
  p.head_dim = shape.head_dim;
  // 0 stays 0 when equal, so params of ordinary calls are unchanged.
  p.head_dim_v = shape.head_dim_v == shape.head_dim ? 0 : shape.head_dim_v;
  if (shape.cu_seqlens_q != nullptr) {
    p.cu_seqlens_q = shape.cu_seqlens_q;
    p.cu_seqlens_k = shape.cu_seqlens_k;
    p.total_q = shape.cu_seqlens_q[shape.batch];
    p.total_k = shape.cu_seqlens_k[shape.batch];
    // Varlen kernels size per-sequence work by the longest sequence.
    // Paged: the keys are each sequence's whole length, not its new rows.
    for (int b = 0; b < shape.batch; ++b) {
      p.seqlen_q = std::max(p.seqlen_q, shape.cu_seqlens_q[b + 1] - shape.cu_seqlens_q[b]);
      p.seqlen_k = std::max(p.seqlen_k, shape.seqlens_k != nullptr
                                            ? shape.seqlens_k[b]
                                            : shape.cu_seqlens_k[b + 1] - shape.cu_seqlens_k[b]);
    }
  } else {
    p.seqlen_q = shape.seqlen_q;
    p.seqlen_k = shape.seqlen_k;
    p.total_q = int64_t{shape.batch} * shape.seqlen_q;
    p.total_k = int64_t{shape.batch} * shape.seqlen_k;
  }
  p.softmax_scale = options.softmax_scale.has_value() ? *options.softmax_scale
                                                      : DefaultSoftmaxScale(shape.head_dim);
  p.softmax_scale_log2 = p.softmax_scale * kLog2e;
  p.softcap = options.softcap;
  p.is_causal = options.causal;
  p.window_left = options.window_left.value_or(kNoWindow);
  // Causal is the window's right bound at the diagonal (params.h), whatever
  // window_right says: the contract makes the causal bound win.
  p.window_right = options.causal ? 0 : options.window_right.value_or(kNoWindow);
  p.q_descale = options.q_descale.value_or(1.0f);
  p.k_descale = options.k_descale.value_or(1.0f);
  p.v_descale = options.v_descale.value_or(1.0f);
  p.batch_invariant = options.batch_invariant;
  const AttnMods& m = pointers.mods;
  p.alibi_slopes = m.alibi_slopes;
  p.sinks = m.sinks;
  p.bias = m.bias;
  p.bias_dtype = m.bias_dtype;
  p.bias_per_batch = m.bias_per_batch;
  p.bias_per_head = m.bias_per_head;
  p.mask = m.mask;
  p.mask_per_batch = m.mask_per_batch;
  p.mask_per_head = m.mask_per_head;
  p.block_q = m.block_q;
  p.block_k = m.block_k;
  p.block_row_ptr = m.block_row_ptr;
  p.block_col_idx = m.block_col_idx;
  p.block_per_batch = m.block_per_batch;
  p.block_per_head = m.block_per_head;
  // Host cu_seqlens (the shape's) give the packed per-sequence extent; paged
  // calls (seqlens_k) carry no pair tensors.
  if (shape.cu_seqlens_q != nullptr) {
    // Paged: a step's bias or mask covers each sequence's whole key history
    // (its length after the append), not its new rows.
    for (int b = 0; b < shape.batch; ++b) {
      const int64_t sk = shape.seqlens_k != nullptr
                             ? shape.seqlens_k[b]
                             : shape.cu_seqlens_k[b + 1] - shape.cu_seqlens_k[b];
      p.total_pairs += int64_t{shape.cu_seqlens_q[b + 1] - shape.cu_seqlens_q[b]} * sk;
    }
  } else if (shape.cu_seqlens_q == nullptr) {
    p.total_pairs = int64_t{shape.batch} * shape.seqlen_q * shape.seqlen_k;
  }
  return p;
}

}  // namespace attnserve
