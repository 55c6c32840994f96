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

// A tensor in host memory (TensorDevices): the default everywhere.
constexpr int32_t kHostMemory = -1;

// Where q, k, v, o and lse lie: kHostMemory, or the index of the CUDA device
// whose memory holds them (a client's CUDA shared-memory region, read and
// written where it lies). Only the server's front-ends set a device; a
// backend that reads host memory alone refuses any other (CanImplement).
struct TensorDevices {
  int32_t q = kHostMemory;
  int32_t k = kHostMemory;
  int32_t v = kHostMemory;
  int32_t o = kHostMemory;
  int32_t lse = kHostMemory;
};

// Tensors are contiguous, row-major, in the layouts of docs/design.md §2:
//   dense:  q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv],
//           o [B, Sq, Hq, Dv], lse [B, Hq, Sq]
//   varlen: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], o [Tq, Hq, Dv],
//           lse [Hq, Tq]
// D is head_dim, Dv is HeadDimV() (equal to D except for MLA-style calls).
// A sequence b is a run of rows starting at SeqStartQ/K(b); row r of head h
// lives at element (r * H + h) * D (Dv for v and o). Every backend reads
// params the same way through the helpers below, so layout rules live in
// exactly one place.
struct AttnParams {
  DType dtype;

  // Memory the backend reads and writes. Whose memory (host or device) is
  // stated by the function that takes the params, except a tensor that
  // `devices` places on a device.
  const void* q;  // [.., Hq, D]
  const void* k;  // [.., Hkv, D]
  const void* v;  // [.., Hkv, Dv]
  void* o;        // [.., Hq, Dv]
  float* lse;     // nullptr unless the caller asked for it
  TensorDevices devices;

  int32_t batch;         // B (number of sequences)
  int32_t num_heads_q;   // Hq
  int32_t num_heads_kv;  // Hkv; Hq % Hkv == 0
  int32_t head_dim;      // D (Q's and K's): a multiple of 8 (CheckParams)
  // Dv, V's and O's head dim (MLA: Dqk 192 / Dv 128, or 576 / 512 absorbed).
  // 0 means "same as head_dim", so callers that set only head_dim stay
  // correct; read it through HeadDimV(). A backend without Dv != D refuses it.
  int32_t head_dim_v = 0;

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

  // Score modifiers and masks beyond the structural band, all off by default
  // (docs/design.md §2). A score goes through, in this order: s = q·k ×
  // softmax_scale; softcap; + ALiBi; + bias; then the band, the element mask
  // and the block mask remove keys; the sinks join the softmax denominator.
  // Every array lives where q does (host for the CPU backend, device for CUDA).
  //
  // ALiBi: [Hq] slopes; score += -alibi_slopes[h] × |diag − j| with diag the
  // bottom-right aligned diagonal i + (sk − sq) (FlashAttention's convention).
  const float* alibi_slopes = nullptr;
  // Attention sinks: [Hq] logits in the scores' units (natural log, after the
  // scale). Each adds exp(sink[h]) to its row's denominator and nothing to O;
  // LSE includes it, so a row that sees no key has O = 0 and LSE = sink[h].
  const float* sinks = nullptr;
  // Additive bias (FP32, FP16 or BF16 elements, bias_dtype) and boolean mask
  // (one byte per element, nonzero = attend), each [B or 1, Hq or 1, Sq, Sk]
  // dense or [Hq or 1, total_pairs] varlen (PairOffset), broadcast over the
  // batch (dense only) and/or the heads as their per_batch / per_head say.
  const void* bias = nullptr;
  DType bias_dtype = DType::kFP32;
  bool bias_per_batch = false;
  bool bias_per_head = false;
  const uint8_t* mask = nullptr;
  bool mask_per_batch = false;
  bool mask_per_head = false;
  // Block-sparse mask over (query block, key block) pairs, compressed sparse
  // rows: block_q = 0 means none. Rows are (sequence, head, query block) laid
  // out like a bias (BlockRow), broadcast as the flags say (varlen:
  // per_batch always); row r keeps the key blocks
  // block_col_idx[block_row_ptr[r] .. block_row_ptr[r + 1]), strictly
  // increasing. block_q and block_k are multiples of kBlockMaskGrain.
  int32_t block_q = 0;
  int32_t block_k = 0;
  const int32_t* block_row_ptr = nullptr;
  const int32_t* block_col_idx = nullptr;
  bool block_per_batch = false;
  bool block_per_head = false;
  // Total (query, key) pairs over all sequences, sum of sq_b × sk_b: the
  // per-sequence extent of a bias or mask with per_batch set (MakeAttnParams).
  int64_t total_pairs = 0;

  // Batch-invariant results (docs/design.md §3): each sequence's output bits
  // depend only on its own inputs and shape, never on the other sequences of
  // the launch, the batch size or the device's SM count. Backends plan such a
  // call with fixed splits and a fixed reduction order.
  bool batch_invariant = false;
};

// Block sizes of a block mask are multiples of this: the Hopper kernel's query
// tile is 128 rows, so no query tile straddles two block rows, and key tiles
// of 32, 64 or 128 keys lie in whole key blocks (a kernel whose key tile does
// not divide block_k leaves the call to one whose tile does).
constexpr int32_t kBlockMaskGrain = 128;

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

// Dv: V's and O's head dim (head_dim_v, or head_dim when it is 0).
ATTN_HOST_DEVICE int HeadDimV(const AttnParams& p) {
  return p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;
}

// Element offset of (row, head, 0) in q, and in k. With Dv == D (every call
// but an MLA-style one) they are also the offsets in o and v.
ATTN_HOST_DEVICE int64_t QOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_q + head) * p.head_dim;
}
ATTN_HOST_DEVICE int64_t KVOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_kv + head) * p.head_dim;
}
// Element offset of (row, head, 0) in o, and in v: rows of Dv.
ATTN_HOST_DEVICE int64_t OOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_q + head) * HeadDimV(p);
}
ATTN_HOST_DEVICE int64_t VOffset(const AttnParams& p, int64_t row, int head) {
  return (row * p.num_heads_kv + head) * HeadDimV(p);
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

ATTN_HOST_DEVICE bool HasBlockMask(const AttnParams& p) { return p.block_q > 0; }
// True when any of q, k, v, o and lse is device memory (TensorDevices).
ATTN_HOST_DEVICE bool HasDeviceTensors(const AttnParams& p) {
  const TensorDevices& d = p.devices;
  return d.q != kHostMemory || d.k != kHostMemory || d.v != kHostMemory || d.o != kHostMemory ||
         d.lse != kHostMemory;
}
// True when any score modifier or tensor mask is on (kernels without them refuse).
ATTN_HOST_DEVICE bool HasScoreMods(const AttnParams& p) {
  return p.alibi_slopes != nullptr || p.sinks != nullptr || p.bias != nullptr ||
         p.mask != nullptr || HasBlockMask(p);
}

// (query, key) pairs of sequences 0..b-1 (O(b) for varlen; callers hoist it
// per sequence).
ATTN_HOST_DEVICE int64_t PairsBefore(const AttnParams& p, int b) {
  if (!IsVarlen(p)) return int64_t{b} * p.seqlen_q * p.seqlen_k;
  int64_t n = 0;
  for (int s = 0; s < b; ++s) n += int64_t{SeqLenQ(p, s)} * SeqLenK(p, s);
  return n;
}
// Element offset of (query i, key j) of sequence b, head h in a bias or mask
// with the given broadcast flags; pairs_before = PairsBefore(p, b).
//   dense  [B or 1, Hq or 1, Sq, Sk]
//   varlen [Hq or 1, total_pairs]: per head, the sequences' [sq_b, sk_b]
//          blocks one after another (per_batch is always set)
ATTN_HOST_DEVICE int64_t PairOffset(const AttnParams& p, bool per_batch, bool per_head,
                                    int64_t pairs_before, int b, int h, int i, int j) {
  const int64_t sk = SeqLenK(p, b);
  const int64_t hh = per_head ? h : 0;
  if (IsVarlen(p)) return hh * p.total_pairs + pairs_before + i * sk + j;
  const int64_t heads = per_head ? p.num_heads_q : 1;
  const int64_t bb = per_batch ? b : 0;
  return ((bb * heads + hh) * p.seqlen_q + i) * sk + j;
}

// Query blocks of sequence b, and of sequences 0..b-1 (O(b) for varlen).
// 64-bit sum: block_q may be near INT32_MAX (the result then fits an int).
ATTN_HOST_DEVICE int BlockRowsOf(const AttnParams& p, int b) {
  return static_cast<int>((int64_t{SeqLenQ(p, b)} + p.block_q - 1) / p.block_q);
}
ATTN_HOST_DEVICE int64_t BlockRowsBefore(const AttnParams& p, int b) {
  if (!IsVarlen(p)) return int64_t{b} * BlockRowsOf(p, 0);
  int64_t n = 0;
  for (int s = 0; s < b; ++s) n += BlockRowsOf(p, s);
  return n;
}
// Rows of the block mask's CSR, laid out like a bias's (sequence, head) grid:
//   dense  [B or 1, Hq or 1, query blocks]
//   varlen [Hq or 1, query blocks of all sequences] (block_per_batch set)
ATTN_HOST_DEVICE int64_t BlockMaskRows(const AttnParams& p) {
  const int64_t rows = p.block_per_batch ? BlockRowsBefore(p, p.batch) : BlockRowsOf(p, 0);
  return rows * (p.block_per_head ? p.num_heads_q : 1);
}
// The CSR row of query block r of sequence b, head h; rows_before =
// BlockRowsBefore(p, b).
ATTN_HOST_DEVICE int64_t BlockRow(const AttnParams& p, int64_t rows_before, int b, int h, int r) {
  const int64_t hh = p.block_per_head ? h : 0;
  if (IsVarlen(p)) return hh * BlockRowsBefore(p, p.batch) + rows_before + r;
  const int64_t heads = p.block_per_head ? p.num_heads_q : 1;
  const int64_t bb = p.block_per_batch ? b : 0;
  return (bb * heads + hh) * BlockRowsOf(p, 0) + r;
}

// Elements of a bias or mask with these flags.
ATTN_HOST_DEVICE int64_t PairElements(const AttnParams& p, bool per_batch, bool per_head) {
  const int64_t pairs = per_batch ? p.total_pairs : int64_t{p.seqlen_q} * p.seqlen_k;
  return pairs * (per_head ? p.num_heads_q : 1);
}

// ALiBi's additive term for query i, key j of a sequence with lengths (sq, sk).
ATTN_HOST_DEVICE float AlibiBias(float slope, int i, int j, int sq, int sk) {
  const int dist = i + (sk - sq) - j;
  return -slope * static_cast<float>(dist < 0 ? -dist : dist);
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
