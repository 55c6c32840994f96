// Device side of mods_prefix.h: where a launch's staged per-sequence offsets
// lie (ModsPrefixOf, read by the kernels) and the one-CTA scan that writes
// them from cu_seqlens before the forward kernel (StageModsPrefix,
// LaunchForward).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/mods_prefix.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {

// The staged arrays of launch F: pairs_before at [0, B], rows_before at
// [B + 1, 2B + 1]; null when the call needs none (dense, or no pair-layout
// modifier). The workspace is the split tickets' (split) or the item
// counters' (unsplit) block.
__host__ __device__ __forceinline__ const int64_t* ModsPrefixOf(const FwdLaunch& F) {
  if (!NeedsModsPrefix(F.p)) return nullptr;
  const int* ws = F.num_splits > 1 ? F.split_tickets : F.item_counters;
  if (ws == nullptr) return nullptr;
  return reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(ws) + kModsPrefixOffset);
}

// The item order of a block-masked Hopper launch F of num_items items
// (ItemOrderBytes): null when the call has none (no block mask, too many
// items, no workspace).
__host__ __device__ __forceinline__ int* ItemOrderOf(const FwdLaunch& F, int64_t num_items) {
  const int64_t bytes = ItemOrderBytes(F.p);
  if (bytes == 0 || num_items * 4 > bytes || F.num_splits > 1 || F.item_counters == nullptr) {
    return nullptr;
  }
  return reinterpret_cast<int*>(reinterpret_cast<char*>(F.item_counters) + ItemOrderOffset(F.p));
}

namespace detail {

constexpr int kPrefixThreads = 1024;

// One CTA: thread t sums a contiguous run of sequences, a block-wide scan
// gives each run its start, then each thread writes its run's offsets.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    StageModsPrefixKernel(const AttnParams p, int64_t* out) {
  __shared__ int64_t warp_pairs[kThreads / 32], warp_rows[kThreads / 32];
  const int batch = p.batch;
  const bool blocks = HasBlockMask(p);
  const int per = (batch + kThreads - 1) / kThreads;
  const int s0 = min(batch, static_cast<int>(threadIdx.x) * per);
  const int s1 = min(batch, s0 + per);
  int64_t pairs = 0, rows = 0;
  for (int s = s0; s < s1; ++s) {
    pairs += int64_t{SeqLenQ(p, s)} * SeqLenK(p, s);
    if (blocks) rows += BlockRowsOf(p, s);
  }
  // Inclusive scan within the warp, then over the warps' totals.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t ip = pairs, ir = rows;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t yp = __shfl_up_sync(0xffffffffu, ip, o);
    const int64_t yr = __shfl_up_sync(0xffffffffu, ir, o);
    if (lane >= o) {
      ip += yp;
      ir += yr;
    }
  }
  if (lane == 31) {
    warp_pairs[warp] = ip;
    warp_rows[warp] = ir;
  }
  __syncthreads();
  if (warp == 0) {
    int64_t wp = lane < kThreads / 32 ? warp_pairs[lane] : 0;
    int64_t wr = lane < kThreads / 32 ? warp_rows[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t yp = __shfl_up_sync(0xffffffffu, wp, o);
      const int64_t yr = __shfl_up_sync(0xffffffffu, wr, o);
      if (lane >= o) {
        wp += yp;
        wr += yr;
      }
    }
    if (lane < kThreads / 32) {
      warp_pairs[lane] = wp;
      warp_rows[lane] = wr;
    }
  }
  __syncthreads();
  int64_t np = ip - pairs + (warp > 0 ? warp_pairs[warp - 1] : 0);
  int64_t nr = ir - rows + (warp > 0 ? warp_rows[warp - 1] : 0);
  int64_t* pairs_before = out;
  int64_t* rows_before = out + batch + 1;
  for (int s = s0; s < s1; ++s) {
    pairs_before[s] = np;
    rows_before[s] = nr;
    np += int64_t{SeqLenQ(p, s)} * SeqLenK(p, s);
    if (blocks) nr += BlockRowsOf(p, s);
  }
  if (threadIdx.x == kThreads - 1) {
    pairs_before[batch] = warp_pairs[kThreads / 32 - 1];
    rows_before[batch] = warp_rows[kThreads / 32 - 1];
  }
}

}  // namespace detail

// Writes launch l's offsets (nothing when it needs none) on `stream`,
// before its forward kernel. cudaErrorInvalidValue without a workspace (the
// plan reserves it: PlanForward).
inline cudaError_t StageModsPrefix(const FwdLaunch& l, cudaStream_t stream) {
  if (!NeedsModsPrefix(l.p)) return cudaSuccess;
  const int64_t* out = ModsPrefixOf(l);
  if (out == nullptr) return cudaErrorInvalidValue;
  detail::StageModsPrefixKernel<detail::kPrefixThreads>
      <<<1, detail::kPrefixThreads, 0, stream>>>(l.p, const_cast<int64_t*>(out));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
