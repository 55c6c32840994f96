// The exact combine of split-KV partials, shared by its two launch forms:
// the last split CTA of a decode tile's group (attn_fwd_kernel.cuh,
// FinishSplit) and the combine kernel of prefill-tile splits (attn_fwd.cu).
// Also the row mapping and partials layout both read. Device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {
namespace detail {

// CTA-external row m (of the M extent sq x G) -> its query head and row of q/o.
struct QueryRows {
  int G;
  int head;  // the CTA's head (a KV head when packed)
  int64_t q_start;
  __device__ __forceinline__ int64_t Row(int m, int* head_out) const {
    *head_out = G > 1 ? head * G + m % G : head;
    return q_start + m / G;
  }
};

// Index of (split, query head h, global row) in the fp32 partials.
__device__ __forceinline__ int64_t PartialIndex(const AttnParams& p, int split, int h,
                                                int64_t row) {
  return (int64_t{split} * p.num_heads_q + h) * p.total_q + row;
}

// The exact combine of split partials over rows [m0, min(m0 + kBlockM,
// rows)) of a query run: for each row, LSE = log sum_s exp(lse_s) and
// O = sum_s exp(lse_s - LSE) O_s over every split (exact up to fp32
// rounding; a row whose splits are all empty gets O = 0, LSE = -inf), in
// split order, so the result does not depend on which CTA finished last.
// The row's sink (params.h), when set (kSinks), joins here, once: a term of
// the LSE with no share of O (the splits leave theirs out).
// `smem` (smem_floats floats) holds a float4 per thread and the weights;
// rows go in passes of as many as the weights fit. A pass's outputs (rows x
// D/4 float4 chunks) are spread over the threads and, when there are fewer
// chunks than threads, each chunk's splits over several threads (summed
// through smem), so many independent L2 loads are in flight. Partials are
// read with ld.cg (L2 only): other SMs wrote them during this launch.
// Needs smem_floats >= 4 * kThreads + L.num_splits. kSinks: the launch may
// have sinks (a mods kernel; the plain kernels' combine never reads them).
// Batch-invariant launches (AttnParams::batch_invariant) sum each output
// over its splits of nonzero weight one after another, in split order, as the
// combine kernel does for them (attn_fwd.cu): the same bits whichever of the
// two combines, and however many empty splits trail a sequence's own.
template <typename T, int kBlockM, int kThreads, bool kSinks = false>
__device__ __forceinline__ void CombineSplitRows(const FwdLaunch& L, const QueryRows& qr, int b,
                                                 int m0, int rows, float* smem, int smem_floats,
                                                 int tid) {
  const AttnParams& p = L.p;
  const int splits = L.num_splits;
  const int warp = tid / 32, lane = tid % 32;
  constexpr int kWarps = kThreads / 32;
  const int n_rows = min(kBlockM, rows - m0);
  const int chunks = p.head_dim / 4;
  const int64_t stride = int64_t{p.num_heads_q} * p.total_q;  // between splits
  float4* red = reinterpret_cast<float4*>(smem);
  float* weight = smem + 4 * kThreads;
  const int per_pass = min(n_rows, (smem_floats - 4 * kThreads) / splits);
  for (int r0 = 0; r0 < n_rows; r0 += per_pass) {
    const int nr = min(per_pass, n_rows - r0);
    for (int r = warp; r < nr; r += kWarps) {
      const int m = m0 + r0 + r;
      int h;
      const int64_t row = qr.Row(m, &h);
      const float* lse_s = L.lse_accum + PartialIndex(p, 0, h, row);
      float mx = -INFINITY;
      for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldcg(lse_s + s * stride));
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      float sink = -INFINITY;
      if constexpr (kSinks) {
        if (p.sinks != nullptr) {
          sink = p.sinks[h];
          mx = fmaxf(mx, sink);
        }
      }
      float sum = 0.f;
      for (int s = lane; s < splits; s += 32) {
        const float l = __ldcg(lse_s + s * stride);
        if (l != -INFINITY) sum += expf(l - mx);
      }
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (sink != -INFINITY) sum += expf(sink - mx);
      const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);
      for (int s = lane; s < splits; s += 32) {
        const float l = __ldcg(lse_s + s * stride);
        weight[r * splits + s] = l == -INFINITY ? 0.f : expf(l - lse);
      }
      if (lane == 0 && p.lse != nullptr) p.lse[LseOffset(p, b, h, m / qr.G)] = lse;
    }
    __syncthreads();
    // Weighted sum over splits part, part + parts, ... of output chunk `it`.
    auto accumulate = [&](int it, int part, int parts) {
      const int r = it / chunks, c = it % chunks;
      int h;
      const int64_t row = qr.Row(m0 + r0 + r, &h);
      const float* src = L.o_accum + PartialIndex(p, 0, h, row) * p.head_dim + 4 * c;
      const float* w = weight + r * splits;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int s = part; s < splits; s += parts) {
        const float ws = w[s];
        const float4 x = __ldcg(reinterpret_cast<const float4*>(src + s * stride * p.head_dim));
        acc.x = fmaf(ws, x.x, acc.x);
        acc.y = fmaf(ws, x.y, acc.y);
        acc.z = fmaf(ws, x.z, acc.z);
        acc.w = fmaf(ws, x.w, acc.w);
      }
      return acc;
    };
    auto store = [&](int it, const float4& acc) {
      const int r = it / chunks, c = it % chunks;
      int h;
      const int64_t row = qr.Row(m0 + r0 + r, &h);
      alignas(8) const T out[4] = {T(acc.x), T(acc.y), T(acc.z), T(acc.w)};
      *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + QOffset(p, row, h) + 4 * c) =
          *reinterpret_cast<const uint2*>(out);
    };
    const int items = nr * chunks;
    if (p.batch_invariant) {
      // Splits of weight 0 (a sequence's trailing empty splits, which a
      // longer batch-mate adds) are skipped, not added as zeros: + 0 would
      // turn a -0 sum into +0.
      for (int it = tid; it < items; it += kThreads) {
        const int r = it / chunks, c = it % chunks;
        int h;
        const int64_t row = qr.Row(m0 + r0 + r, &h);
        const float* src = L.o_accum + PartialIndex(p, 0, h, row) * p.head_dim + 4 * c;
        const float* w = weight + r * splits;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < splits; ++s) {
          const float ws = w[s];
          if (ws == 0.f) continue;
          const float4 x = __ldcg(reinterpret_cast<const float4*>(src + s * stride * p.head_dim));
          acc.x = fmaf(ws, x.x, acc.x);
          acc.y = fmaf(ws, x.y, acc.y);
          acc.z = fmaf(ws, x.z, acc.z);
          acc.w = fmaf(ws, x.w, acc.w);
        }
        store(it, acc);
      }
    } else if (2 * items > kThreads) {
      for (int it = tid; it < items; it += kThreads) store(it, accumulate(it, 0, 1));
    } else {
      const int parts = kThreads / items;
      const int it = tid % items, part = tid / items;
      float4 acc = part < parts ? accumulate(it, part, parts) : make_float4(0.f, 0.f, 0.f, 0.f);
      red[tid] = acc;
      __syncthreads();
      if (part == 0) {
        for (int q = 1; q < parts; ++q) {
          const float4 x = red[q * items + it];
          acc.x += x.x;
          acc.y += x.y;
          acc.z += x.z;
          acc.w += x.w;
        }
        store(it, acc);
      }
    }
    __syncthreads();  // the next pass rewrites weight and red
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attnserve
