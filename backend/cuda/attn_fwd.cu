// Host side of the CUDA forward path: launches the instantiation a Plan
// (attn_fwd_plan.h) chose and, for a split launch of the prefill tiles, the
// exact combine kernel (decode tiles combine in the forward kernel:
// attn_fwd_kernel.cuh's FinishSplit). Also the FP32 path (a SIMT kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_fp32.cuh"
#include "backend/cuda/generated/kernel_dispatch.h"
#include "backend/cuda/kv_rows.cuh"
#include "backend/cuda/launch_splits.h"
#include "backend/cuda/mods_prefix.cuh"

namespace attnserve {
namespace cuda {
namespace {

// Combine kernel of prefill-tile splits (decode tiles combine in the forward
// kernel: split_combine.cuh): one 256-thread CTA per (query row, head).
// LSE = log sum_s exp(lse_s); O = sum_s exp(lse_s - LSE) * O_s: exact up to
// fp32 rounding; a
// row whose splits are all empty gets O = 0, LSE = -inf. Threads are laid out
// as (split group) x (4-float chunk of D) so each thread has only
// num_splits / groups independent 16-byte loads in its chain (the first
// version, one warp per row looping over every split, was latency bound:
// 100 us at B=1 decode).
constexpr int kCombineThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    CombineSplitsKernel(const AttnParams p, int num_splits, const float* o_accum,
                        const float* lse_accum) {
  __shared__ float weight[128];
  __shared__ float4 part[kCombineThreads];
  __shared__ float lse_row;
  const int64_t idx = blockIdx.x;  // = h * total_q + row, the partials' order
  const int h = static_cast<int>(idx / p.total_q);
  const int64_t row = idx % p.total_q;
  const int64_t stride = int64_t{p.num_heads_q} * p.total_q;  // between splits
  const int tid = threadIdx.x;
  if (tid < 32) {
    float mx = -INFINITY;
    for (int s = tid; s < num_splits; s += 32) mx = fmaxf(mx, lse_accum[s * stride + idx]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    // The sink joins the LSE here, once (split_combine.cuh).
    const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
    mx = fmaxf(mx, sink);
    float sum = 0.f;
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      if (l != -INFINITY) sum += expf(l - mx);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sink != -INFINITY) sum += expf(sink - mx);
    const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      weight[s] = l == -INFINITY ? 0.f : expf(l - lse);
    }
    if (tid == 0) lse_row = lse;
  }
  __syncthreads();
  // Dv <= 256 is at most 64 float4 chunks, so one pass covers the row.
  const int dv = HeadDimV(p);
  const int chunks = dv / 4;
  if (p.batch_invariant) {
    // split_combine.cuh's order for these launches: each output summed over
    // its splits one after another (fmaf, split order), so this combine and
    // the fused one give the same bits.
    if (tid < chunks) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < num_splits; ++s) {
        const float w = weight[s];
        if (w == 0.f) continue;  // an empty split (as split_combine.cuh)
        const float4 x =
            *reinterpret_cast<const float4*>(o_accum + (s * stride + idx) * dv + 4 * tid);
        acc.x = fmaf(w, x.x, acc.x);
        acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z);
        acc.w = fmaf(w, x.w, acc.w);
      }
      T* out = static_cast<T*>(p.o) + OOffset(p, row, h) + 4 * tid;
      out[0] = T(acc.x);
      out[1] = T(acc.y);
      out[2] = T(acc.z);
      out[3] = T(acc.w);
    }
  } else {
    const int groups = kCombineThreads / chunks;
    const int c = tid % chunks;
    const int g = tid / chunks;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < groups) {
      for (int s = g; s < num_splits; s += groups) {
        const float w = weight[s];
        if (w == 0.f) continue;
        const float4 x =
            *reinterpret_cast<const float4*>(o_accum + (s * stride + idx) * dv + 4 * c);
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
      }
    }
    part[tid] = acc;
    __syncthreads();
    if (g == 0) {
      for (int gg = 1; gg < groups; ++gg) {
        const float4 x = part[gg * chunks + c];
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
      T* out = static_cast<T*>(p.o) + OOffset(p, row, h) + 4 * c;
      out[0] = T(acc.x);
      out[1] = T(acc.y);
      out[2] = T(acc.z);
      out[3] = T(acc.w);
    }
  }
  if (tid == 0 && p.lse != nullptr) {
    // Varlen LSE is [Hq, Tq]: LseOffset(b = 0, i = global row) is that index,
    // since cu_seqlens_q[0] = 0. Dense: split the row into (b, i).
    const int b = IsVarlen(p) ? 0 : static_cast<int>(row / p.seqlen_q);
    const int i = IsVarlen(p) ? static_cast<int>(row) : static_cast<int>(row % p.seqlen_q);
    p.lse[LseOffset(p, b, h, i)] = lse_row;
  }
}

// FP32: one warp per (query row, head), attn_fwd_fp32.cuh's row loop over
// the request's own K/V tensors.
__global__ void __launch_bounds__(128) AttnFwdFp32Kernel(const FwdLaunch L) {
  const int i = blockIdx.x * 4 + threadIdx.x / 32;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  if (i >= SeqLenQ(L.p, b)) return;
  AttendRowFp32(L.p, b, h, i, ContiguousRows<float>::SeqLen(L, b),
                ContiguousRows<float>(L, b, KVHead(L.p, h)));
}

}  // namespace

bool DeviceRunsSm90Kernels(int device) {
#if defined(ATTNSERVE_CUDA_SM90)
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const char* portable = std::getenv("ATTNSERVE_CUDA_PORTABLE");
  return major == 9 && minor == 0 && !(portable != nullptr && std::strcmp(portable, "1") == 0);
#else
  (void)device;
  return false;
#endif
}

FwdLaunch MakeFwdLaunch(const AttnParams& dev, const Plan& plan, void* workspace) {
  FwdLaunch l;
  l.p = dev;
  l.num_splits = LaunchSplits(dev, plan);  // plan.num_splits, or fewer (invariant decode)
  l.pack_gqa = plan.pack_gqa;
  const TileConfig tile = TileForPlan(plan);
  l.num_m_blocks =
      static_cast<int>((int64_t{dev.seqlen_q} * plan.pack_gqa + tile.block_m - 1) / tile.block_m);
  const int64_t partial_rows = int64_t{plan.num_splits} * dev.num_heads_q * dev.total_q;
  const bool split = plan.num_splits > 1;
  l.split_tickets = split ? static_cast<int*>(workspace) : nullptr;
  // An unsplit plan with a workspace: the Hopper schedule's item counters
  // (Sm90ScheduleWorkspaceBytes). The slot's buffer may be there for others.
  l.item_counters = !split && plan.workspace_bytes > 0 ? static_cast<int*>(workspace) : nullptr;
  // Partials after the counters and any staged modifier offsets (mods_prefix.h).
  l.o_accum = split ? reinterpret_cast<float*>(static_cast<char*>(workspace) + kSplitCounterBytes +
                                               ModsPrefixBytes(dev))
                    : nullptr;
  l.lse_accum = split ? l.o_accum + partial_rows * HeadDimV(dev) : nullptr;
  // Decode tiles combine in the forward kernel (FinishSplit): never slower
  // than the combine kernel on the decode grid. It takes one ticket counter
  // per group: a batch-invariant launch with more groups than the counter
  // block holds (the planner splits it whatever its size) combines in the
  // combine kernel instead, with the same bits (split_combine.cuh).
  const int64_t groups = int64_t{l.num_m_blocks} * dev.batch *
                         (plan.pack_gqa > 1 ? dev.num_heads_kv : dev.num_heads_q);
  l.fused_combine = split && plan.tile_kind == TileKind::kDecode && groups <= kMaxSplitGroups;
  // Batch-invariant decode splits: each CTA sizes its split from its own
  // sequence's key tiles and S = the plan's split count (LocateCta); the
  // launch runs as many splits as the longest sequence needs (LaunchSplits).
  const bool invariant = split && dev.batch_invariant && plan.tile_kind == TileKind::kDecode;
  l.invariant_splits = invariant ? plan.num_splits : 0;
  l.invariant_min_tiles = invariant ? InvariantMinTiles() : 0;
  // The FP8 path's Q K^T runs on the codes: their descales join the scale.
  const float qk_scale = dev.softmax_scale * (plan.fp8_qk ? dev.q_descale * dev.k_descale : 1.f);
  l.scale_log2 = qk_scale * kLog2e;
  l.softcap_in = dev.softcap > 0.f ? qk_scale / dev.softcap : 0.f;
  l.softcap_out = dev.softcap * kLog2e;
  l.tile_kind = plan.tile_kind;
  l.poly_exp2 = plan.fp8_pv && plan.fp8_poly_exp2;
  l.extra_stage = plan.fp8_pv && plan.fp8_extra_stage;
  return l;
}

cudaError_t ClearSplitCounters(void* workspace, cudaStream_t stream) {
  return cudaMemsetAsync(workspace, 0, kSplitCounterBytes, stream);
}

cudaError_t LaunchCombine(const FwdLaunch& l, cudaStream_t stream) {
  if (l.num_splits == 1 || l.fused_combine) return cudaSuccess;
  const AttnParams& dev = l.p;
  const unsigned blocks = static_cast<unsigned>(int64_t{dev.num_heads_q} * dev.total_q);
  if (dev.dtype == DType::kFP16) {
    CombineSplitsKernel<__half>
        <<<blocks, kCombineThreads, 0, stream>>>(dev, l.num_splits, l.o_accum, l.lse_accum);
  } else {
    CombineSplitsKernel<__nv_bfloat16>
        <<<blocks, kCombineThreads, 0, stream>>>(dev, l.num_splits, l.o_accum, l.lse_accum);
  }
  return cudaGetLastError();
}

cudaError_t LaunchForward(const AttnParams& dev, const Plan& plan, void* workspace,
                          cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  const FwdLaunch l = MakeFwdLaunch(dev, plan, workspace);
  // A varlen bias / mask / block mask: its per-sequence offsets, once.
  cudaError_t err = StageModsPrefix(l, stream);
  if (err != cudaSuccess) return err;
  err = RunForPlan(plan, dev.dtype, l, stream);
  if (err != cudaSuccess) return err;
  return LaunchCombine(l, stream);
}

cudaError_t LaunchForwardFp32(const AttnParams& dev, cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  if (dev.num_heads_q > 65535 || dev.batch > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((dev.seqlen_q + 3) / 4, dev.num_heads_q, dev.batch);
  FwdLaunch l{};
  l.p = dev;
  AttnFwdFp32Kernel<<<grid, 128, 0, stream>>>(l);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
