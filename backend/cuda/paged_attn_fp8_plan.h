// How the FP8 cache's decode kernel (paged_attn_fp8_decode.cuh) is planned:
// which calls it serves, how many splits of the key range a launch takes,
// and the split rule its CTAs follow. Plain C++ (the backend and the CPU
// tests plan with it; the kernel reads the split rule), like attn_fwd_plan.h.
#pragma once

#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/paged_decode_plan.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Keys one warp takes per step; a step's keys lie in one page (pages hold a
// power of two >= 16 tokens), so one block-table read serves it.
constexpr int kFp8DecodeChunk = 16;
// Packed query rows (seqlen_q x the GQA group) one CTA computes at most.
constexpr int kFp8DecodeMaxRows = 16;
// Resident CTAs per SM the split rule assumes (the kernel's launch bounds).
constexpr int64_t kFp8DecodeCtasPerSm = 2;
// Batch-invariant launches: a sequence's n chunks go to splits of
// max(ceil(n / kFp8InvariantSplits), kFp8InvariantMinChunks) chunks each, a
// function of its own length alone; the combine adds them in split order.
constexpr int kFp8InvariantSplits = 32;
constexpr int kFp8InvariantMinChunks = 32;

// Steps a warp's loads run ahead of its math: one (each step in flight is
// D / 2 bytes of registers per lane). Two fits the registers of two CTAs per
// SM at D 128 with 8 rows; the bench's ablation row times it.
constexpr int Fp8DecodeAhead(int /*head_dim*/, int /*row_tiles*/) { return 1; }

// Steps of the per-warp shared-memory ring that cp.async fills instead of
// register loads (0: none). The ring keeps four steps of loads in flight per
// warp without the registers they would take, which the bench shows is what
// the load-bound D 128 decode lacks; D 64 has no ring variant.
constexpr int Fp8DecodeRingStages(int head_dim) { return head_dim == 128 ? 4 : 0; }

// True when the decode kernel serves `p` (FP16/BF16 q over an FP8 cache):
// D 64 or 128, at most kFp8DecodeMaxRows packed rows, keys present.
inline bool Fp8DecodeCovers(const AttnParams& p) {
  if (p.num_heads_kv <= 0 || p.seqlen_k <= 0) return false;
  const int64_t group = p.num_heads_q / p.num_heads_kv;
  return (p.head_dim == 64 || p.head_dim == 128) &&
         int64_t{p.seqlen_q} * group <= kFp8DecodeMaxRows &&
         (p.dtype == DType::kBF16 || p.dtype == DType::kFP16);
}

// Chunks per split of a sequence whose visible keys span n_chunks chunks.
ATTN_HOST_DEVICE int Fp8ChunksPerSplit(int n_chunks, int num_splits, bool invariant) {
  return DecodeUnitsPerSplit(n_chunks, num_splits, invariant, kFp8InvariantSplits,
                             kFp8InvariantMinChunks);
}

// The plan of an FP8-cache call: Plan() (the SIMT kernel) when the decode
// kernel does not cover it; else kernel_head_dim D, pack_gqa the group, and
// the splits of PlanDecodeSplits over 16-key chunks, a split's CTAs batch x
// Hkv, kFp8DecodeCtasPerSm per SM, each split at least 8 chunks (two steps
// per warp).
inline Plan PlanPagedFp8(const AttnParams& p, int num_sms) {
  if (!Fp8DecodeCovers(p)) return Plan();
  const int64_t n_chunks = (int64_t{p.seqlen_k} + kFp8DecodeChunk - 1) / kFp8DecodeChunk;
  Plan plan =
      PlanDecodeSplits(p, {kFp8InvariantSplits, kFp8InvariantMinChunks, 8, kFp8DecodeCtasPerSm},
                       n_chunks, int64_t{p.batch} * p.num_heads_kv, num_sms);
  plan.kernel_head_dim = p.head_dim;
  plan.pack_gqa = p.num_heads_q / p.num_heads_kv;
  return plan;
}

}  // namespace cuda
}  // namespace attnserve
