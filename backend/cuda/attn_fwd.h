// Host-visible interface of the CUDA forward kernels: the launch struct the
// kernels read and the launch entry points. The tile tables and the planner
// are in attn_fwd_plan.h (plain C++), the compiled set of head dims in
// generated/kernel_set.h. nvcc-safe and free of Abseil so .cu files include it; the
// CUDA backend (.cc) maps the cudaError_t results to absl::Status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Everything a forward kernel reads. `p` holds DEVICE pointers here.
struct FwdLaunch {
  AttnParams p;
  int num_splits;      // 1: write p.o / p.lse; > 1: write the fp32 partials below
  float* o_accum;      // [num_splits, Hq, total_q, Dv], each split normalised by its own sum
  float* lse_accum;    // [num_splits, Hq, total_q], natural log; -inf for an empty split
  int* split_tickets;  // one counter per tile group, zero at rest (attn_fwd_plan.h)
  int* item_counters;  // Hopper kPersistentDynamic: [next item, CTAs done], zero at rest
  bool fused_combine;  // split decode tile: the last split CTA of a group combines
  int pack_gqa;        // query heads of one KV head packed into M (1 = off)
  int num_m_blocks;    // ceil(seqlen_q * pack_gqa / kBlockM), seqlen_q the max over sequences
  float scale_log2;    // softmax_scale * log2(e): raw Q.K -> log2-domain score (no softcap)
  float softcap_in;    // softmax_scale / softcap: raw Q.K -> argument of tanh
  float softcap_out;   // softcap * log2(e): tanh -> log2-domain score
  TileKind tile_kind;  // the plan's tile table (TileFor)
  // A batch-invariant decode split launch: S and T of its split rule
  // (InvariantTilesPerSplit, attn_fwd_plan.h); 0 otherwise (ceil(tiles /
  // num_splits) per split).
  int invariant_splits;
  int invariant_min_tiles;
  bool poly_exp2;    // Plan::fp8_poly_exp2 (the Hopper kernel's FP8 P V only)
  bool extra_stage;  // Plan::fp8_extra_stage (likewise)
};

// True when `device` is compute capability 9.0, this build has the Hopper
// kernels (ATTNSERVE_CUDA_SM90) and ATTNSERVE_CUDA_PORTABLE is not "1" (the
// override that keeps every launch on the portable kernel, so tests and
// benchmarks can compare both families on one GPU). PlanForward's allow_sm90.
bool DeviceRunsSm90Kernels(int device);

// Launches the forward (and, for a split plan of the prefill tiles, the
// combine kernel) on `stream`. `dev` holds device pointers; `workspace` has
// plan.workspace_bytes and its split counters are zero (ClearSplitCounters).
cudaError_t LaunchForward(const AttnParams& dev, const Plan& plan, void* workspace,
                          cudaStream_t stream);

// The launch struct of `plan` over device params `dev` (workspace: the
// plan's split counters and partials), and the exact combine kernel of its
// splits (nothing when unsplit or when the kernel combined them:
// fused_combine). Shared by LaunchForward and the paged launch (paged_attn.h).
FwdLaunch MakeFwdLaunch(const AttnParams& dev, const Plan& plan, void* workspace);
cudaError_t LaunchCombine(const FwdLaunch& launch, cudaStream_t stream);

// Zeroes the split ticket counters at the start of a split-KV workspace
// (kSplitCounterBytes). Once per allocation: every launch leaves them zero.
cudaError_t ClearSplitCounters(void* workspace, cudaStream_t stream);

// The FP32 path: a SIMT online-softmax kernel (one warp per query row and
// head) in fp32 throughout, for the contract's 1e-5 FP32 tolerance.
cudaError_t LaunchForwardFp32(const AttnParams& dev, cudaStream_t stream);

// Per-instantiation launcher, defined in attn_fwd_kernel.cuh and explicitly
// instantiated in the generated files (one per head dim x dtype x mask x arch
// set). T is __half or __nv_bfloat16; kIsBanded: the call has a causal and/or
// sliding-window band (IsBanded).
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnFwd(const FwdLaunch& launch, cudaStream_t stream);
// ... for calls whose V and O head dim (HeadDimV) differs from Q's and K's
// (MLA shapes): Q K^T over kHeadDim, P V and O over kHeadDimV < kHeadDim,
// each zero-padded; the request's K/V tensors only.
template <int kHeadDim, int kHeadDimV, typename T, bool kIsBanded>
cudaError_t RunAttnFwdDv(const FwdLaunch& launch, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
