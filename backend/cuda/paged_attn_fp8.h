// The FP8 cache's decode kernel (paged_attn_fp8_decode.cuh): its launch, and
// its plan (paged_attn_fp8_plan.h). nvcc-safe, free of Abseil, like paged_attn.h.
//
// The kernel streams E4M3 pages with 16-byte loads into registers, widens the
// codes to FP16 there and runs both products on mma.sync: one warp takes 16
// keys at a time for up to 16 packed query rows (a decode step's GQA group,
// or a short speculative run). Calls it does not cover (longer query runs,
// other head dims) run on the portable SIMT kernel (LaunchPagedForwardFp8
// without a plan, paged_attn.h).
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/paged_attn_fp8_plan.h"
#include "backend/paged_kv.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Attention of dev.attn.q over an FP8 cache as `plan` = PlanPagedFp8(dev.attn,
// ...) says: the decode kernel (and, with a workspace, the combine of its
// splits) or, for Plan(), the SIMT kernel. `workspace` holds
// plan.workspace_bytes (the split workspace; its counters are not used).
cudaError_t LaunchPagedForwardFp8(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                                  cudaStream_t stream);

// The bench's ablation (bench/cuda/fp8_kv_bench.cu), BF16 q, D 128, <= 8
// packed rows, in `num_splits` splits (1: none): variant 0..2, the decode
// kernel with its register loads that many steps ahead of its math; 3, a
// 4-step shared-memory ring per warp filled by cp.async instead.
cudaError_t LaunchPagedFp8DecodeAblation(const PagedAttnParams& dev, int num_splits, int variant,
                                         void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
