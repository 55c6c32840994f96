// The portable forward kernel's score modifiers and masks (params.h: ALiBi,
// additive bias, element mask, block mask; sinks are folded in at the end of
// the scan, attn_fwd_kernel.cuh's AddSinks): which key tiles a CTA scans under
// a block mask, and the per-element pass over a score tile. Only the kernels
// instantiated with kMods include this work; the others are unchanged.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/mods_prefix.cuh"
#include "backend/cuda/split_combine.cuh"
#include "backend/params.h"

namespace attnserve {
namespace cuda {
namespace detail {

// The thread's rows of an m16 x n8 fragment set: r = mt * 2 + half is CTA-
// external row row0 + mt * 16 + half * 8 (row0 = m0 + warp_row0 + group).
__device__ __forceinline__ int FragmentRow(int row0, int r) {
  return row0 + (r / 2) * 16 + (r % 2) * 8;
}

// The key tiles a CTA scans, right to left: scan position t is tile At(t).
// Without a block mask they are the band's tiles [n_begin, n_end), so
// At(t) = n_end - 1 - t. With one, they are the band's tiles inside the kept
// key blocks of the CTA's CSR row (a key block is per_block whole tiles,
// block_k being a multiple of every tile's block_n): the rightmost kept
// block's `first` tiles ending at first_end, then per_block tiles of each
// kept block to its left (the leftmost one cut off by the scan's count).
// The scan asks for positions in order (each block's index one step left of
// the last one's), so At keeps its block's column and has the next one's
// load in flight: no dependent global load per tile, and a shift instead of
// a division where per_block is a power of two.
struct KeyTileOrder {
  const int32_t* cols = nullptr;  // the row's kept key blocks (null: no block mask)
  int last = 0;                   // index in cols of the rightmost kept block in the band
  int first = 0;                  // its tiles in the band
  int first_end = 0;              // one past its last tile in the band
  int per_block = 1;              // key tiles per key block
  int per_shift = 0;              // log2(per_block) when a power of two, else -1
  int cur = -1;                   // index in cols of the block At last looked up
  int cur_col = 0;                // its column
  int next_col = 0;               // cols[cur - 1], loaded ahead

  __device__ __forceinline__ int At(int t) {
    if (t < first) return first_end - 1 - t;
    t -= first;
    const int q = per_shift >= 0 ? t >> per_shift : t / per_block;
    const int k = last - 1 - q;
    if (k != cur) {
      cur_col = k == cur - 1 ? next_col : __ldg(cols + k);
      // cols[k - 1] lies in the array for k > 0 (maybe another row's: unused then).
      next_col = k > 0 ? __ldg(cols + k - 1) : 0;
      cur = k;
    }
    return (cur_col + 1) * per_block - 1 - (t - q * per_block);
  }
};

// The scan order of the band's tiles [n_begin, n_end) for a CTA whose query
// rows [i_first, ..] all lie in query block i_first / block_q of sequence b
// (kBlockMaskGrain: every kernel's query tile, or a packed decode tile's few
// queries, stays inside one block row), head `head` (the first query head of
// a packed tile; the plan does not pack GQA heads under a per-head block
// mask). prefix: the launch's staged offsets (ModsPrefixOf; null when dense).
// Returns the number of tiles to scan.
template <int kBlockN>
__device__ __forceinline__ int BlockMaskTiles(const AttnParams& p, const int64_t* prefix, int b,
                                              int head, int i_first, int n_begin, int n_end,
                                              KeyTileOrder* order) {
  order->first = max(n_end - n_begin, 0);
  order->first_end = n_end;
  if (!HasBlockMask(p) || n_begin >= n_end) return order->first;
  const bool staged = IsVarlen(p) && prefix != nullptr;
  const int64_t row =
      StagedBlockRow(p, staged ? prefix[p.batch + 1 + b] : 0, staged ? prefix[2 * p.batch + 1] : 0,
                     b, head, i_first / p.block_q);
  const int beg = __ldg(p.block_row_ptr + row);
  const int end = __ldg(p.block_row_ptr + row + 1);
  const int per = p.block_k / kBlockN;
  order->cols = p.block_col_idx;
  order->per_block = per;
  order->per_shift = (per & (per - 1)) == 0 ? __ffs(per) - 1 : -1;
  order->first = 0;
  int count = 0;
  bool found = false;
  for (int k = end - 1; k >= beg; --k) {
    const int c = __ldg(p.block_col_idx + k);
    if (c * per >= n_end) continue;  // right of the band
    const int lo = max(c * per, n_begin), hi = min((c + 1) * per, n_end);
    if (lo >= hi) break;  // this block and every one left of it lie left of the band
    if (!found) {
      found = true;
      order->last = k;
      order->first = hi - lo;
      order->first_end = hi;
    }
    count += hi - lo;
  }
  return count;
}

// One element of an additive bias of dtype t, as float.
__device__ __forceinline__ float LoadBias(const void* bias, DType t, int64_t idx) {
  switch (t) {
    case DType::kFP16: return __half2float(static_cast<const __half*>(bias)[idx]);
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[idx]);
    default: return __ldg(static_cast<const float*>(bias) + idx);
  }
}

// The per-element pass of a mods kernel over one score tile (keys key0 ..,
// the thread's fragment columns), after softcap: every score goes to the log2
// domain (softcapped scores already are; others times scale_log2), ALiBi and
// the bias are added (times log2(e)), and keys outside the row's band, masked
// by the element mask or past the sequence become -inf. Rows past the tile's
// last row are computed as that row (their results are never stored).
// pairs_before: PairsBefore(p, b) (staged: ModsPrefixOf); to_log2: 1 for
// softcapped scores, else scale_log2.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void ModScores(float (&s)[kMTiles][kNTiles][4], const AttnParams& p,
                                          const QueryRows& qr, int b, int64_t pairs_before,
                                          float to_log2, int key0, int row0, int rows, int sq,
                                          int sk, int quad) {
#pragma unroll
  for (int r = 0; r < kMTiles * 2; ++r) {
    const int m = min(FragmentRow(row0, r), rows - 1);
    int h;
    qr.Row(m, &h);
    const int i = m / qr.G;
    int lo, hi;
    VisibleKeys(p, i, sq, sk, &lo, &hi);
    const float slope = p.alibi_slopes != nullptr ? __ldg(p.alibi_slopes + h) * kLog2e : 0.f;
    const int diag = i + (sk - sq);
    const int64_t bias_row = p.bias != nullptr ? PairOffset(p, p.bias_per_batch, p.bias_per_head,
                                                            pairs_before, b, h, i, 0)
                                               : 0;
    const int64_t mask_row = p.mask != nullptr ? PairOffset(p, p.mask_per_batch, p.mask_per_head,
                                                            pairs_before, b, h, i, 0)
                                               : 0;
    const int mt = r / 2, half = r % 2;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = key0 + nt * 8 + quad * 2 + e;
        float& x = s[mt][nt][half * 2 + e];
        if (j < lo || j > hi) {
          x = -INFINITY;
          continue;
        }
        const int dist = diag - j;
        float v = fmaf(slope, -static_cast<float>(dist < 0 ? -dist : dist), x * to_log2);
        if (p.bias != nullptr) v = fmaf(LoadBias(p.bias, p.bias_dtype, bias_row + j), kLog2e, v);
        if (p.mask != nullptr && __ldg(p.mask + mask_row + j) == 0) v = -INFINITY;
        x = v;
      }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attnserve
