// The FP32 attention row loop (SIMT, fp32 throughout, for the contract's 1e-5
// FP32 tolerance), shared by the contiguous and the paged FP32 kernels: one
// warp computes one (query row, head) over K/V rows from a row source
// (kv_rows.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/params.h"

namespace attnserve {
namespace cuda {

// Each lane holds D/32 elements of q and of the unnormalised output; exact
// online softmax with expf. Simple and correct, not fast: every row re-reads
// its keys from L2. Query i of sequence b (sk keys), head h; `rows` is the
// row source of (b, KVHead(p, h)).
constexpr int kFp32MaxPerLane = 256 / 32;
template <typename Rows>
__device__ __forceinline__ void AttendRowFp32(const AttnParams& p, int b, int h, int i, int sk,
                                              const Rows& rows) {
  const int lane = threadIdx.x % 32;
  const int sq = SeqLenQ(p, b);
  const int64_t q_row = SeqStartQ(p, b) + i;
  const float* q = static_cast<const float*>(p.q) + QOffset(p, q_row, h);
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
    const float* k = rows.Row(0, j);
    const float* v = rows.Row(1, j);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < kFp32MaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < p.head_dim) dot = fmaf(qr[e], k[d], dot);
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
      if (d < p.head_dim) o[e] = fmaf(w, v[d], o[e]);
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

}  // namespace cuda
}  // namespace attnserve
