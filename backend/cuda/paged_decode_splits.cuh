// What the paged decode kernels that split the key range share (the FP8
// cache's, paged_attn_fp8_decode.cuh, and the absorbed MLA's, paged_mla.cu):
// their launch struct, the layout of their split partials and the kernel
// that combines them; the split rule is paged_decode_plan.h's. Their
// partials are not the fused kernel's (split_combine.cuh): normalised O with
// a log2-domain LSE, [split, total_q, Hq] rows, the sink joining in the
// combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/paged_attn.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {

struct PagedDecodeLaunch {
  AttnParams p;
  PagedKv kv;
  int num_splits;
  bool invariant;  // the split rule's batch-invariant form (paged_decode_plan.h)
  // Split partials: [split, total_q, Hq, Dv] normalised O and [split,
  // total_q, Hq] log2-domain LSE (DecodePartialAt); nullptr: the CTA writes
  // O and LSE itself.
  float* part_o;
  float* part_lse;
};

// The block tables of `dev` (device pointers) as the paged kernels read them.
inline PagedKv PagedKvOf(const PagedAttnParams& dev) {
  PagedKv kv;
  kv.pages = dev.pages;
  kv.block_table = dev.block_table;
  kv.block_table_stride = dev.block_table_stride;
  kv.seqlens_k = dev.seqlens_k;
  return kv;
}

// The launch of `dev` in num_splits splits; with `workspace` (the split
// workspace, SplitWorkspaceBytes) its partials of dv columns lie past the
// workspace's counters, else the CTAs write O themselves (one split).
inline PagedDecodeLaunch MakeDecodeLaunch(const PagedAttnParams& dev, int num_splits,
                                          void* workspace, int dv) {
  PagedDecodeLaunch l{};
  l.p = dev.attn;
  l.kv = PagedKvOf(dev);
  l.num_splits = num_splits;
  l.invariant = dev.attn.batch_invariant;
  if (workspace != nullptr) {
    l.part_o = reinterpret_cast<float*>(static_cast<char*>(workspace) + kSplitCounterBytes);
    l.part_lse = l.part_o + int64_t{num_splits} * dev.attn.total_q * dev.attn.num_heads_q * dv;
  }
  return l;
}

// Row of (split, global query row, query head) in the partials.
__device__ __forceinline__ int64_t DecodePartialAt(const AttnParams& p, int split, int64_t row,
                                                   int head) {
  return (int64_t{split} * p.total_q + row) * p.num_heads_q + head;
}

// Threads of the combine of kDv-wide partials: one per 4 columns, and at
// least one per split (each reads one split's LSE).
template <int kDv>
constexpr int DecodeCombineThreads() {
  return kDv / 4 > kMaxSplits ? kDv / 4 : kMaxSplits;
}

// The splits' partials of (q row blockIdx.x, query head blockIdx.y), thread
// d taking columns 4d..4d+3, added in split order (a fixed order: batch-
// invariant; splits of weight 0 skipped), with the sink's share. The splits'
// LSEs are read at once (one per thread) and their weights shared, so the
// partials' loads do not wait on one another.
template <typename T, int kDv>
__global__ void __launch_bounds__(DecodeCombineThreads<kDv>())
    CombineDecodeSplits(const __grid_constant__ PagedDecodeLaunch L) {
  constexpr int kThreads = DecodeCombineThreads<kDv>();
  static_assert(kDv % 4 == 0 && kThreads % 32 == 0, "float4 columns, whole warps");
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_max[kThreads / 32];
  const AttnParams& p = L.p;
  const int64_t row = blockIdx.x;
  const int head = blockIdx.y;
  const int tid = threadIdx.x;
  const int d = tid * 4;
  const bool has_cols = kDv / 4 >= kThreads || d < kDv;
  const int splits = L.num_splits;
  const int64_t stride = p.total_q * p.num_heads_q;
  const int64_t at = DecodePartialAt(p, 0, row, head);
  const float lse_s = tid < splits ? __ldcg(L.part_lse + tid * stride + at) : -INFINITY;
  float mx = lse_s;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (tid % 32 == 0) s_max[tid / 32] = mx;
  __syncthreads();
  float mm = s_max[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) mm = fmaxf(mm, s_max[i]);
  const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
  mm = fmaxf(mm, sink);
  if (tid < splits) s_w[tid] = mm == -INFINITY ? 0.0f : exp2f(lse_s - mm);
  __syncthreads();
  float total = 0.0f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mm != -INFINITY) {
    for (int s = 0; s < splits; ++s) total += s_w[s];  // split order (+0 leaves it alone)
    if (has_cols) {
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const float w = s_w[s];
        if (w == 0.0f) continue;
        const float4 x =
            __ldcg(reinterpret_cast<const float4*>(L.part_o + (s * stride + at) * kDv + d));
        o.x = fmaf(w, x.x, o.x);
        o.y = fmaf(w, x.y, o.y);
        o.z = fmaf(w, x.z, o.z);
        o.w = fmaf(w, x.w, o.w);
      }
    }
    if (p.sinks != nullptr) total += exp2f(sink - mm);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  if (has_cols) {
    alignas(8) const T out[4] = {T(o.x * inv), T(o.y * inv), T(o.z * inv), T(o.w * inv)};
    *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + OOffset(p, row, head) + d) =
        *reinterpret_cast<const uint2*>(out);
  }
  if (threadIdx.x == 0 && p.lse != nullptr) {
    // The row's sequence: the last b with cu_seqlens_q[b] <= row.
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (SeqStartQ(p, mid) <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    p.lse[LseOffset(p, lo, head, static_cast<int>(row - SeqStartQ(p, lo)))] =
        total > 0.0f ? (mm + log2f(total)) / kLog2e : -INFINITY;
  }
}

// Launches the combine of L's partials of width kDv on `stream`.
template <typename T, int kDv>
cudaError_t LaunchDecodeCombine(const PagedDecodeLaunch& L, cudaStream_t stream) {
  CombineDecodeSplits<T, kDv><<<dim3(static_cast<unsigned>(L.p.total_q), L.p.num_heads_q),
                                DecodeCombineThreads<kDv>(), 0, stream>>>(L);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
