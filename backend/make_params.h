// MakeAttnParams: the one place an AttnParams is filled. The server (from a
// request), the client's verifier, tests and benchmarks all describe a call as
// a shape, options and pointers and get the same params back, so the default
// scale, the log2(e) factor and the causal/window normalisation are written
// once and --verify cannot agree with a server that drifted.
#pragma once

#include <cstdint>
#include <optional>

#include "backend/params.h"

namespace attnserve {

// The sizes of a call. Dense: `batch` sequences of seqlen_q queries and
// seqlen_k keys each, cu_seqlens null. Varlen: cu_seqlens_q/k hold batch+1
// offsets in HOST memory (read here: the totals are their last entries and
// seqlen_q/k the longest sequences; the seqlen fields are ignored). Paged
// (paged_kv.h): varlen over the new rows, plus seqlens_k.
struct AttnShape {
  DType dtype = DType::kFP16;
  int32_t batch = 0;
  int32_t num_heads_q = 0;
  int32_t num_heads_kv = 0;
  int32_t head_dim = 0;
  // V's and O's head dim when it differs from head_dim (MLA); 0: head_dim.
  int32_t head_dim_v = 0;
  int32_t seqlen_q = 0;
  int32_t seqlen_k = 0;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // Paged only: each sequence's keys after the append (batch entries, HOST).
  // cu_seqlens_k then counts the new rows alone, and seqlen_k is the longest
  // of these (the keys the launch attends over).
  const int32_t* seqlens_k = nullptr;
};

// A dense shape: `batch` sequences of seqlen_q queries and seqlen_k keys.
inline AttnShape DenseShape(DType dtype, int32_t batch, int32_t seqlen_q, int32_t seqlen_k,
                            int32_t num_heads_q, int32_t num_heads_kv, int32_t head_dim) {
  AttnShape s;
  s.dtype = dtype;
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.num_heads_q = num_heads_q;
  s.num_heads_kv = num_heads_kv;
  s.head_dim = head_dim;
  return s;
}

// A paged append-and-attend shape: `batch` sequences with new query rows
// cu_seqlens_q and new K/V rows cu_seqlens_k (varlen offsets), attending over
// seqlens_k[b] keys each (all HOST memory). seqlens_k may be null while the
// lengths are not known yet (a call's cost before its pages are reserved).
inline AttnShape PagedShape(DType dtype, int32_t batch, int32_t num_heads_q, int32_t num_heads_kv,
                            int32_t head_dim, const int32_t* cu_seqlens_q,
                            const int32_t* cu_seqlens_k, const int32_t* seqlens_k) {
  AttnShape s;
  s.dtype = dtype;
  s.batch = batch;
  s.num_heads_q = num_heads_q;
  s.num_heads_kv = num_heads_kv;
  s.head_dim = head_dim;
  s.cu_seqlens_q = cu_seqlens_q;
  s.cu_seqlens_k = cu_seqlens_k;
  s.seqlens_k = seqlens_k;
  return s;
}

// The call's options as the wire has them (attnserve.v1.AttentionOptions
// without return_lse, which is a question of outputs: set pointers.lse).
struct AttnOptions {
  std::optional<float> softmax_scale;  // unset: DefaultSoftmaxScale(D) = 1/sqrt(D) (score_range.h)
  bool causal = false;                 // bottom-right aligned
  std::optional<int32_t> window_left;  // unset: unlimited
  std::optional<int32_t> window_right;
  float softcap = 0.0f;  // 0: off
  // FP8 inputs' per-tensor descales; unset: 1 (AttnParams never holds an unset 0).
  std::optional<float> q_descale;
  std::optional<float> k_descale;
  std::optional<float> v_descale;
  bool batch_invariant = false;  // AttnParams::batch_invariant
};

// Score modifiers and masks: the AttnParams fields of the same names
// (params.h says what each means and its layout), in the memory q is in.
struct AttnMods {
  const float* alibi_slopes = nullptr;
  const float* sinks = nullptr;
  const void* bias = nullptr;
  DType bias_dtype = DType::kFP32;
  bool bias_per_batch = false;
  bool bias_per_head = false;
  const uint8_t* mask = nullptr;
  bool mask_per_batch = false;
  bool mask_per_head = false;
  int32_t block_q = 0;  // 0: no block mask
  int32_t block_k = 0;
  const int32_t* block_row_ptr = nullptr;
  const int32_t* block_col_idx = nullptr;
  bool block_per_batch = false;
  bool block_per_head = false;
};

// The tensors (host or device memory, as the consumer of the params says,
// or as `devices` places them). o and lse may be null until the caller binds
// outputs.
struct AttnPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  TensorDevices devices;
  AttnMods mods;
};

// Sizes and totals from `shape` (paged: total_k the new rows, seqlen_k the
// longest seqlens_k, total_pairs the sum of sq_b x seqlens_k[b]); softmax_scale defaulting to
// 1/sqrt(D) and softmax_scale_log2 = softmax_scale * kLog2e (params.h); causal folded into
// window_right = 0 (the causal bound wins over a wider right window); unset
// windows kNoWindow; unset descales 1. Checks nothing: callers validate first (the server's
// request validation) or build valid calls (tests), and CheckParams
// (CanImplement) guards the backends.
AttnParams MakeAttnParams(const AttnShape& shape, const AttnOptions& options,
                          const AttnPointers& pointers);

}  // namespace attnserve
