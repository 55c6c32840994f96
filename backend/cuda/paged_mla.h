// The absorbed-MLA paged path (paged_mla.cu): caches whose one K/V head holds
// 576 dims (512 latent + 64 rope) with V the first 512 of each K row
// (KvPages::v_in_k), so pages hold K alone. nvcc-safe, free of Abseil.
//
// The decode kernel packs a sequence's new tokens x query heads as the M
// dimension of mma.sync tiles (16, 32 or 64 rows a CTA), so every query head
// shares each K tile: a ring of 32-key stages in shared memory is filled by
// cp.async, S = Q K^T runs over 576 dims and O += P V over the stage's first
// 512 (no second load). Long contexts split over CTAs; a combine kernel adds
// the splits in split order.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/paged_mla_plan.h"
#include "backend/paged_kv.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Page copies (copy-on-write, K slabs only), then the scatter of the new K
// rows (dev.attn.k, varlen over cu_seqlens_k) into their pages, on `stream`:
// LaunchKvAppend (paged_attn.h), which takes pages.v_in_k caches' K alone.
cudaError_t LaunchMlaKvAppend(const PagedAttnParams& dev, cudaStream_t stream);

// Attention of dev.attn.q over an absorbed cache (MlaDecodeCovers) as `plan`
// = PlanPagedMla(dev.attn, ...) says; `workspace` holds plan.workspace_bytes.
cudaError_t LaunchPagedMla(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                           cudaStream_t stream);

// The bench's ablation (bench/cuda/mla_decode_bench.cu): the kernel with
// `rows_per_cta` (16, 32 or 64) packed rows a CTA whatever the call's rows,
// running the first `phases` of each stage's three (S, softmax, P V; below 3
// BF16 only, and O is not meaningful): 0 is the stage ring streaming the
// keys with no math, the pipeline's own ceiling. overlap (BF16, phases 3):
// each stage's S runs beside the previous stage's P V, P in a buffer of its
// own (two barriers a stage instead of three, one stage fewer in flight).
cudaError_t LaunchPagedMlaAblation(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                                   int rows_per_cta, int phases, bool overlap, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
