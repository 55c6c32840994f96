// attn_bench's Hopper schedule ablation (bench-only: the production library
// holds only kDefaultSm90Schedule's kernels). Built for sm_90a with the
// Hopper kernel family (bench/cuda/CMakeLists.txt, attn_bench_sm90_ablation).
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// D = 128, BF16 prefill, either mask, with a chosen schedule
// (kDefaultSm90Schedule is what the planner's launches use). workspace:
// Sm90ScheduleWorkspaceBytes(schedule), counters zero.
cudaError_t LaunchForwardSm90Schedule(const AttnParams& dev, const Plan& plan,
                                      Sm90Schedule schedule, void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
