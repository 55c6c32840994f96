// The FP32 attention row loop (SIMT, fp32 throughout, for the contract's 1e-5
// FP32 tolerance), shared by the contiguous and the paged FP32 kernels: one
// warp computes one (query row, head) over K/V rows from a row source
// (kv_rows.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/params.h"

namespace attnserve {
namespace cuda {

// Each lane holds D/32 elements of q and of the unnormalised output; exact
// online softmax with expf. Simple and correct, not fast: every row re-reads
// its keys from L2. Query i of sequence b (sk keys), head h; `rows` is the
// row source of (b, KVHead(p, h)). The score modifiers and masks of params.h
// apply in its order: ALiBi and bias after softcap; keys outside the element
// mask or the row's kept key blocks are skipped; the sink joins at the end.
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
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[h] : 0.f;
  const int64_t pairs_before = p.bias != nullptr || p.mask != nullptr ? PairsBefore(p, b) : 0;
  const int64_t bias_row =
      p.bias != nullptr ? PairOffset(p, p.bias_per_batch, p.bias_per_head, pairs_before, b, h, i, 0)
                        : 0;
  const int64_t mask_row =
      p.mask != nullptr ? PairOffset(p, p.mask_per_batch, p.mask_per_head, pairs_before, b, h, i, 0)
                        : 0;
  // The row's kept key blocks, walked left to right beside j.
  const int32_t* block = nullptr;
  const int32_t* block_end = nullptr;
  if (HasBlockMask(p)) {
    const int64_t rows_before = IsVarlen(p) ? BlockRowsBefore(p, b) : 0;
    const int64_t row = BlockRow(p, rows_before, b, h, i / p.block_q);
    block = p.block_col_idx + p.block_row_ptr[row];
    block_end = p.block_col_idx + p.block_row_ptr[row + 1];
  }
  float mx = -INFINITY, sum = 0.f;
  for (int j = lo; j <= hi; ++j) {
    if (block != nullptr) {
      while (block < block_end && (int64_t{*block} + 1) * p.block_k <= j) ++block;
      if (block == block_end) break;
      if (int64_t{*block} * p.block_k > j) {
        j = *block * p.block_k - 1;  // the loop's ++j lands on the block's first key
        continue;
      }
    }
    if (p.mask != nullptr && p.mask[mask_row + j] == 0) continue;
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
    if (p.alibi_slopes != nullptr) s += AlibiBias(slope, i, j, sq, sk);
    if (p.bias != nullptr) {
      if (p.bias_dtype == DType::kFP32) {
        s += static_cast<const float*>(p.bias)[bias_row + j];
      } else if (p.bias_dtype == DType::kFP16) {
        s += __half2float(static_cast<const __half*>(p.bias)[bias_row + j]);
      } else {
        s += __bfloat162float(static_cast<const __nv_bfloat16*>(p.bias)[bias_row + j]);
      }
    }
    if (s == -INFINITY) continue;  // a -inf bias removes the key
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
  if (p.sinks != nullptr) {
    // One more term of the denominator, with no value: rescale to the
    // larger of the max and the sink.
    const float sink = p.sinks[h];
    const float m = fmaxf(mx, sink);
    const float corr = expf(mx - m);  // 0 for a row that saw no key
    sum = sum * corr + expf(sink - m);
#pragma unroll
    for (int e = 0; e < kFp32MaxPerLane; ++e) o[e] *= corr;
    mx = m;
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
