// The one plain struct that carries an attention call from the API to a kernel.
// POD and nvcc-safe: no proto, Abseil or spdlog includes, so CUDA translation
// units and the GPU machine (which has none of those libraries) can include it.
#pragma once

#include <cstdint>

#include "common/dtype.h"

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attnserve {

// O's dtype: the inputs' dtype, except FP8 inputs, whose O is BF16 (FP8 has
// too little precision for an output; docs/design.md §2).
ATTN_HOST_DEVICE DType OutputDType(DType t) { return t == DType::kFP8E4M3 ? DType::kBF16 : t; }

// log2(e): kernels use exp2, so their scales carry the change of base
// (AttnParams::softmax_scale_log2 and the CUDA launch's derived scales).
constexpr float kLog2e = 1.4426950408889634f;

// Window value meaning "no limit on this side".
constexpr int32_t kNoWindow = -1;

// Tensors are contiguous, row-major, in the layouts of docs/design.md §2:
//   dense:  q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], o like q, lse [B, Hq, Sq]
//   varlen: q [Tq, Hq, D],    k/v [Tk, Hkv, D],    o like q, lse [Hq, Tq]
// A sequence b is a run of rows starting at SeqStartQ/K(b); row r of head h
// lives at element (r * H + h) * D. Every backend reads params the same way
// through the helpers below, so layout rules live in exactly one place.
struct AttnParams {
  DType dtype;

  // Memory the backend reads and writes. Whose memory (host or device) is
  // stated by the function that takes the params.
  const void* q;  // [.., Hq, D]
  const void* k;  // [.., Hkv, D]
  const void* v;  // [.., Hkv, D]
  void* o;        // like q
  float* lse;     // nullptr unless the caller asked for it

  int32_t batch;         // B (number of sequences)
  int32_t num_heads_q;   // Hq
  int32_t num_heads_kv;  // Hkv; Hq % Hkv == 0
  int32_t head_dim;      // D: a multiple of 8 in [8, 256]

  // Dense: every sequence has these lengths. Varlen: the largest lengths.
  int32_t seqlen_q;
  int32_t seqlen_k;
  // Rows of q (B*Sq dense, Tq varlen) and of k/v (B*Sk dense, Tk varlen).
  int64_t total_q;
  int64_t total_k;

  // Varlen only, else nullptr: B+1 non-decreasing offsets starting at 0.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;

  float softmax_scale;       // multiplies Q·Kᵀ
  float softmax_scale_log2;  // softmax_scale * log2(e), for exp2-based kernels
  float softcap;             // 0 = off; else softcap * tanh(s / softcap)
  bool is_causal;
  // Normalised on the host (MakeAttnParams): causal sets window_right = 0, so
  // kernels test only the two window bounds. kNoWindow = unlimited.
  int32_t window_left;
  int32_t window_right;

  // FP8 only: the value of an input element is its decoded code times its
  // tensor's descale (finite, in (0, kMaxDescale], score_range.h). Every other
  // dtype has 1 here (CheckParams), so a kernel may ignore them. Defaulted so
  // params built field by field never carry a silent 0.
  float q_descale = 1.0f;
  float k_descale = 1.0f;
  float v_descale = 1.0f;
};

ATTN_HOST_DEVICE bool IsVarlen(const AttnParams& p) { return p.cu_seqlens_q != nullptr; }

ATTN_HOST_DEVICE int64_t SeqStartQ(const AttnParams& p, int b) {
  return IsVarlen(p) ? p.cu_seqlens_q[b] : int64_t{b} * p.seqlen_q;
}
ATTN_HOST_DEVICE int64_t SeqStartK(const AttnParams& p, int b) {
  return IsVarlen(p) ? p.cu_seqlens_k[b] : int64_t{b} * p.seqlen_k;
}
ATTN_HOST_DEVICE int SeqLenQ(const AttnParams& p, int b) {
  return IsVarlen(p) ? p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] : p.seqlen_q;
}
ATTN_HOST_DEVICE int SeqLenK(const AttnParams& p, int b) {
  return IsVarlen(p) ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : p.seqlen_k;
}

// Element offset of (row, head, 0) in q/o, and in k/v.
ATTN_HOST_DEVICE int64_t QOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_q + head) * p.head_dim;
}
ATTN_HOST_DEVICE int64_t KVOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_kv + head) * p.head_dim;
}
// Element offset of LSE for query i (0-based within sequence b) of head h.
ATTN_HOST_DEVICE int64_t LseOffset(const AttnParams& p, int b, int h, int i) {
  return IsVarlen(p) ? int64_t{h} * p.total_q + p.cu_seqlens_q[b] + i
                     : (int64_t{b} * p.num_heads_q + h) * p.seqlen_q + i;
}
// True when the call has a causal and/or sliding-window band (causal is
// window_right = 0 after MakeAttnParams): the one definition of "banded".
ATTN_HOST_DEVICE bool IsBanded(const AttnParams& p) {
  return p.window_left >= 0 || p.window_right >= 0;
}
// The KV head that query head h reads (GQA/MQA).
ATTN_HOST_DEVICE int KVHead(const AttnParams& p, int h) {
  return h / (p.num_heads_q / p.num_heads_kv);
}

// The keys query i of a sequence with lengths (sq, sk) may see: [*lo, *hi],
// empty when *lo > *hi. Bottom-right aligned, docs/design.md §2.
ATTN_HOST_DEVICE void VisibleKeys(const AttnParams& p, int i, int sq, int sk, int* lo, int* hi) {
  const int diag = i + (sk - sq);
  int l = 0;
  int h = sk - 1;
  if (p.window_left >= 0 && diag - p.window_left > l) l = diag - p.window_left;
  if (p.window_right >= 0 && diag + p.window_right < h) h = diag + p.window_right;
  *lo = l;
  *hi = h;
}

}  // namespace attnserve
