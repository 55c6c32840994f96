// Host side of the CUDA forward path: launches the instantiation a Plan
// (attn_fwd_plan.h) chose and, when split, the exact combine kernel. Also the
// FP32 path (a SIMT kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/generated/kernel_dispatch.h"

namespace attnserve {
namespace cuda {
namespace {

// Combine: one 256-thread CTA per (query row, head). LSE = log sum_s
// exp(lse_s); O = sum_s exp(lse_s - LSE) * O_s: exact up to fp32 rounding; a
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
    float sum = 0.f;
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      if (l != -INFINITY) sum += expf(l - mx);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      weight[s] = l == -INFINITY ? 0.f : expf(l - lse);
    }
    if (tid == 0) lse_row = lse;
  }
  __syncthreads();
  // D <= 256 is at most 64 float4 chunks, so one pass covers the row.
  const int chunks = p.head_dim / 4;
  const int groups = kCombineThreads / chunks;
  const int c = tid % chunks;
  const int g = tid / chunks;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (g < groups) {
    for (int s = g; s < num_splits; s += groups) {
      const float w = weight[s];
      if (w == 0.f) continue;
      const float4 x =
          *reinterpret_cast<const float4*>(o_accum + (s * stride + idx) * p.head_dim + 4 * c);
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
    T* out = static_cast<T*>(p.o) + QOffset(p, row, h) + 4 * c;
    out[0] = T(acc.x);
    out[1] = T(acc.y);
    out[2] = T(acc.z);
    out[3] = T(acc.w);
  }
  if (tid == 0 && p.lse != nullptr) {
    // Varlen LSE is [Hq, Tq]: LseOffset(b = 0, i = global row) is that index,
    // since cu_seqlens_q[0] = 0. Dense: split the row into (b, i).
    const int b = IsVarlen(p) ? 0 : static_cast<int>(row / p.seqlen_q);
    const int i = IsVarlen(p) ? static_cast<int>(row) : static_cast<int>(row % p.seqlen_q);
    p.lse[LseOffset(p, b, h, i)] = lse_row;
  }
}

// FP32: one warp per (query row, head); each lane holds D/32 elements of q and
// of the unnormalised output; exact online softmax in fp32 with expf. Simple
// and correct, not fast: every row re-reads its keys from L2.
constexpr int kFp32MaxPerLane = 256 / 32;
__global__ void __launch_bounds__(128) AttnFwdFp32Kernel(const AttnParams p) {
  const int i = blockIdx.x * 4 + threadIdx.x / 32;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int lane = threadIdx.x % 32;
  const int sq = SeqLenQ(p, b);
  const int sk = SeqLenK(p, b);
  if (i >= sq) return;
  const int64_t q_row = SeqStartQ(p, b) + i;
  const int kvh = KVHead(p, h);
  const float* q = static_cast<const float*>(p.q) + QOffset(p, q_row, h);
  const float* k = static_cast<const float*>(p.k) + KVOffset(p, SeqStartK(p, b), kvh);
  const float* v = static_cast<const float*>(p.v) + KVOffset(p, SeqStartK(p, b), kvh);
  const int64_t stride = int64_t{p.num_heads_kv} * p.head_dim;
  float qr[kFp32MaxPerLane], o[kFp32MaxPerLane];
#pragma unroll
  for (int e = 0; e < kFp32MaxPerLane; ++e) {
    const int d = lane + 32 * e;
    qr[e] = d < p.head_dim ? q[d] : 0.f;
    o[e] = 0.f;
  }
  int lo, hi;
  VisibleKeys(p, i, sq, sk, &lo, &hi);
  float mx = -INFINITY, sum = 0.f;
  for (int j = lo; j <= hi; ++j) {
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < kFp32MaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < p.head_dim) dot = fmaf(qr[e], k[j * stride + d], dot);
    }
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    float s = dot * p.softmax_scale;
    if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
    float w;
    if (s > mx) {
      const float corr = expf(mx - s);  // 0 on the first key
      sum *= corr;
#pragma unroll
      for (int e = 0; e < kFp32MaxPerLane; ++e) o[e] *= corr;
      mx = s;
      w = 1.f;
    } else {
      w = expf(s - mx);
    }
    sum += w;
#pragma unroll
    for (int e = 0; e < kFp32MaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < p.head_dim) o[e] = fmaf(w, v[j * stride + d], o[e]);
    }
  }
  float* out = static_cast<float*>(p.o) + QOffset(p, q_row, h);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int e = 0; e < kFp32MaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < p.head_dim) out[d] = o[e] * inv;
  }
  if (lane == 0 && p.lse != nullptr)
    p.lse[LseOffset(p, b, h, i)] = sum > 0.f ? mx + logf(sum) : -INFINITY;
}

}  // namespace

cudaError_t LaunchForward(const AttnParams& dev, const Plan& plan, void* workspace,
                          cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  FwdLaunch l;
  l.p = dev;
  l.num_splits = plan.num_splits;
  l.pack_gqa = plan.pack_gqa;
  const TileConfig tile = TileFor(plan.tile_kind, plan.kernel_head_dim);
  l.num_m_blocks =
      static_cast<int>((int64_t{dev.seqlen_q} * plan.pack_gqa + tile.block_m - 1) / tile.block_m);
  const int64_t partial_rows = int64_t{plan.num_splits} * dev.num_heads_q * dev.total_q;
  l.o_accum = static_cast<float*>(workspace);
  l.lse_accum = plan.num_splits > 1 ? l.o_accum + partial_rows * dev.head_dim : nullptr;
  l.scale_log2 = dev.softmax_scale * kLog2e;
  l.softcap_in = dev.softcap > 0.f ? dev.softmax_scale / dev.softcap : 0.f;
  l.softcap_out = dev.softcap * kLog2e;
  l.tile_kind = static_cast<int>(plan.tile_kind);
  cudaError_t err;
  if (dev.dtype == DType::kFP16) {
    err = plan.banded ? RunForHeadDim<__half, true>(plan.kernel_head_dim, l, stream)
                      : RunForHeadDim<__half, false>(plan.kernel_head_dim, l, stream);
  } else {
    err = plan.banded ? RunForHeadDim<__nv_bfloat16, true>(plan.kernel_head_dim, l, stream)
                      : RunForHeadDim<__nv_bfloat16, false>(plan.kernel_head_dim, l, stream);
  }
  if (err != cudaSuccess || plan.num_splits == 1) return err;
  const unsigned blocks = static_cast<unsigned>(int64_t{dev.num_heads_q} * dev.total_q);
  if (dev.dtype == DType::kFP16) {
    CombineSplitsKernel<__half>
        <<<blocks, kCombineThreads, 0, stream>>>(dev, plan.num_splits, l.o_accum, l.lse_accum);
  } else {
    CombineSplitsKernel<__nv_bfloat16>
        <<<blocks, kCombineThreads, 0, stream>>>(dev, plan.num_splits, l.o_accum, l.lse_accum);
  }
  return cudaGetLastError();
}

cudaError_t LaunchForwardFp32(const AttnParams& dev, cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  if (dev.num_heads_q > 65535 || dev.batch > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((dev.seqlen_q + 3) / 4, dev.num_heads_q, dev.batch);
  AttnFwdFp32Kernel<<<grid, 128, 0, stream>>>(dev);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
