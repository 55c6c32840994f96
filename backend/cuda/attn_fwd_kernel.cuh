// The portable fused attention forward kernel (FlashAttention-2 loop order) on
// sm80+ tensor cores: mma.sync m16n8k16 with fp32 accumulation, ldmatrix
// fragment loads and cp.async K/V loads overlapped with compute. One CTA owns
// kBlockM query rows of one head (or of one KV head's packed query heads) and
// scans the K/V tiles they can see; S and P stay in registers; O is kept
// unnormalised in registers and normalised once; LSE is written once. Included
// only by the generated per-instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/kv_rows.cuh"
#include "backend/cuda/paged_attn.h"
#include "backend/cuda/score_mods.cuh"
#include "backend/cuda/split_combine.cuh"
#include "backend/params.h"

namespace attnserve {
namespace cuda {
namespace detail {

constexpr float kLn2 = 0.69314718055994530942f;

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 zero-fills the 16 bytes: rows past the sequence and head-dim
  // padding read as zeros, so they add nothing to Q.K or P.V.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Waits until at most kPending of this thread's newest commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max and sum over the 4 threads of a quad, which together hold one row of
// an m16n8 accumulator fragment.
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- Mask policies (as CUTLASS's FMHA does): which key tiles a CTA visits,
// which of those need the per-element test, and the grid order of m blocks.
// The per-element test itself is one rule for both (VisibleKeys' [lo, hi]).
// Banded = a causal and/or sliding-window band (causal is window_right = 0
// after FillParams); not banded = only the end of the sequence limits keys.
template <bool kBanded>
struct MaskPolicy;

template <>
struct MaskPolicy<false> {
  __device__ __forceinline__ static int MBlock(int x, int) { return x; }
  // Key tiles [*begin, *end) rows with visible keys [lo_first.., ..hi_last] need.
  __device__ __forceinline__ static void KeyTiles(int, int, int sk, int block_n, int* begin,
                                                  int* end) {
    *begin = 0;
    *end = (sk + block_n - 1) / block_n;
  }
  // Only the tile across the end of the sequence is masked.
  __device__ __forceinline__ static bool TileNeedsMask(int key0, int block_n, int sk, int, int) {
    return key0 + block_n > sk;
  }
};

template <>
struct MaskPolicy<true> {
  // CTAs with the most tiles first, so the tail of the grid is short ones.
  __device__ __forceinline__ static int MBlock(int x, int num) { return num - 1 - x; }
  // Tiles outside the band of every row of the CTA are skipped.
  __device__ __forceinline__ static void KeyTiles(int lo_first, int hi_last, int sk, int block_n,
                                                  int* begin, int* end) {
    *begin = max(lo_first, 0) / block_n;
    *end = hi_last < 0 ? 0 : min((sk + block_n - 1) / block_n, hi_last / block_n + 1);
  }
  // Band-interior tiles ([lo(last row), hi(first row)]) need no test.
  __device__ __forceinline__ static bool TileNeedsMask(int key0, int block_n, int sk, int lo_last,
                                                       int hi_first) {
    return key0 + block_n > sk || !(key0 >= lo_last && key0 + block_n - 1 <= hi_first);
  }
};

// Scores of keys outside a row's [lo, hi] become -inf. Row bounds are
// recomputed here rather than kept in registers: the main loop is at the
// 255-register limit and this runs on few tiles.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void MaskScores(float (&s)[kMTiles][kNTiles][4], const AttnParams& p,
                                           int key0, int row0, int rows, int G, int sq, int sk,
                                           int quad) {
#pragma unroll
  for (int r = 0; r < kMTiles * 2; ++r) {
    int lo, hi;
    VisibleKeys(p, min(FragmentRow(row0, r), rows - 1) / G, sq, sk, &lo, &hi);
    const int mt = r / 2, half = r % 2;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = key0 + nt * 8 + quad * 2 + e;
        if (j < lo || j > hi) s[mt][nt][half * 2 + e] = -INFINITY;
      }
  }
}

// softcap * tanh(s * scale / softcap), in the log2 domain.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void SoftcapScores(float (&s)[kMTiles][kNTiles][4], float in,
                                              float out) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = tanhf(s[mt][nt][e] * in) * out;
}

// One online-softmax step over a score tile: new row max, O and the sums
// rescaled, S replaced by P = exp2(S * score_log2 - max). row_max is in raw-
// score units; row_sum is this thread's partial sum (quad-reduced at the end).
template <int kMTiles, int kNTiles, int kDTiles>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[kMTiles][kNTiles][4],
                                              float (&row_max)[kMTiles * 2],
                                              float (&row_sum)[kMTiles * 2],
                                              float (&acc_o)[kMTiles][kDTiles][4],
                                              float score_log2) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 2 + half;
      float mx = row_max[r];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
        mx = fmaxf(mx, fmaxf(s[mt][nt][half * 2], s[mt][nt][half * 2 + 1]));
      mx = QuadMax(mx);
      // A row that has seen only masked keys keeps max -inf; subtracting 0
      // instead keeps exp2(-inf - -inf) from turning into NaN.
      const float mx_log2 = mx == -INFINITY ? 0.f : mx * score_log2;
      const float corr = Exp2(row_max[r] * score_log2 - mx_log2);
      row_max[r] = mx;
      row_sum[r] *= corr;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[mt][dt][half * 2] *= corr;
        acc_o[mt][dt][half * 2 + 1] *= corr;
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = Exp2(fmaf(s[mt][nt][half * 2 + e], score_log2, -mx_log2));
          s[mt][nt][half * 2 + e] = pv;
          row_sum[r] += pv;
        }
    }
}

// End of the scan: O normalised once, LSE (natural log; -inf for a row that
// saw no key) per fragment row.
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void NormalizeRows(float (&acc_o)[kMTiles][kDTiles][4],
                                              const float (&row_max)[kMTiles * 2],
                                              const float (&row_sum)[kMTiles * 2], float score_log2,
                                              float (&lse)[kMTiles * 2]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 2 + half;
      const float sum = QuadSum(row_sum[r]);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      lse[r] = sum > 0.f ? (row_max[r] * score_log2 + __log2f(sum)) * kLn2 : -INFINITY;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[mt][dt][half * 2] *= inv;
        acc_o[mt][dt][half * 2 + 1] *= inv;
      }
    }
}

// The sinks of a mods kernel's unsplit rows (split rows get theirs in the
// combine), folded into the scan's state as one more key of score sink[h]
// and value 0: the row max and O rescaled, exp2(sink - max) added to the sum
// once per row (by the quad's first thread; the sums are quad-partial). A
// row that saw no key ends with O = 0 and sum 1 at max = sink, so LSE =
// sink. row_max is in raw-score units (times score_log2: log2 domain).
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void AddSinks(float (&acc_o)[kMTiles][kDTiles][4],
                                         float (&row_max)[kMTiles * 2],
                                         float (&row_sum)[kMTiles * 2], const AttnParams& p,
                                         const QueryRows& qr, int row0, int rows, int quad,
                                         float score_log2) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 2 + half;
      int h;
      qr.Row(min(FragmentRow(row0, r), rows - 1), &h);
      const float sink = __ldg(p.sinks + h) * kLog2e;
      const float mx = fmaxf(row_max[r] * score_log2, sink);
      const float corr = Exp2(row_max[r] * score_log2 - mx);
      row_max[r] = mx / score_log2;
      row_sum[r] = row_sum[r] * corr + (quad == 0 ? Exp2(sink - mx) : 0.f);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[mt][dt][half * 2] *= corr;
        acc_o[mt][dt][half * 2 + 1] *= corr;
      }
    }
}

// O's head dim and the element offset of (row, head) in o. kDistinctV: a
// kernel whose V and O rows have their own head dim (MLA shapes, HeadDimV);
// the other kernels keep reading head_dim, as before the value dim existed.
template <bool kDistinctV>
__device__ __forceinline__ int OutDim(const AttnParams& p) {
  return kDistinctV ? HeadDimV(p) : p.head_dim;
}
template <bool kDistinctV>
__device__ __forceinline__ int64_t OutOffset(const AttnParams& p, int64_t row, int head) {
  return kDistinctV ? OOffset(p, row, head) : QOffset(p, row, head);
}

// Epilogue of a CTA whose key range is empty (fully masked rows, Sk = 0, or an
// empty split): O = 0 and LSE = -inf (a mods kernel's unsplit row with
// sinks: its sink), written directly.
template <typename T, int kBlockM, int kThreads, bool kMods = false, bool kDistinctV = false>
__device__ __forceinline__ void StoreEmptyRows(const FwdLaunch& L, const QueryRows& qr, int b,
                                               int split, int m0, int rows, int tid) {
  const AttnParams& p = L.p;
  const int dv = OutDim<kDistinctV>(p);
  for (int idx = tid; idx < kBlockM; idx += kThreads) {
    const int m = m0 + idx;
    if (m >= rows) break;
    int h;
    const int64_t row = qr.Row(m, &h);
    if (L.num_splits > 1) {
      const int64_t acc = PartialIndex(p, split, h, row);
      for (int d = 0; d < dv; ++d) L.o_accum[acc * dv + d] = 0.f;
      L.lse_accum[acc] = -INFINITY;
    } else {
      T* o = static_cast<T*>(p.o) + OutOffset<kDistinctV>(p, row, h);
      for (int d = 0; d < dv; ++d) o[d] = T(0.f);
      if (p.lse != nullptr) {
        p.lse[LseOffset(p, b, h, m / qr.G)] = kMods && p.sinks != nullptr ? p.sinks[h] : -INFINITY;
      }
    }
  }
}

// Split epilogue: fp32 partials (each normalised by its own sum) and LSE
// straight from the fragments (decode-sized outputs); the group's last CTA
// (FinishSplit) or the combine kernel merges the splits.
template <int kMTiles, int kDTiles, bool kDistinctV = false>
__device__ __forceinline__ void StoreSplitPartials(const FwdLaunch& L, const QueryRows& qr,
                                                   int split,
                                                   const float (&acc_o)[kMTiles][kDTiles][4],
                                                   const float (&lse)[kMTiles * 2], int row0,
                                                   int rows, int quad) {
  const AttnParams& p = L.p;
  const int dv = OutDim<kDistinctV>(p);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row0 + mt * 16 + half * 8;
      if (m >= rows) continue;
      int h;
      const int64_t row = qr.Row(m, &h);
      const int64_t acc = PartialIndex(p, split, h, row);
      float* dst = L.o_accum + acc * dv;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int d = dt * 8 + quad * 2;
        if (d < dv) {
          *reinterpret_cast<float2*>(dst + d) =
              make_float2(acc_o[mt][dt][half * 2], acc_o[mt][dt][half * 2 + 1]);
        }
      }
      if (quad == 0) L.lse_accum[acc] = lse[mt * 2 + half];
    }
}

// End of every CTA of a fused-combine split launch (all threads call it).
// The CTA's partials are fenced device-wide, then it takes one ticket on its
// group's counter; the CTA holding the last ticket (splits - 1) knows every
// other split's partials are visible, resets the counter to zero (no other
// CTA touches it again this launch; the next launch on the stream starts
// after this one ends) and combines. No second launch and no idle GPU
// between the splits and the combine: the combines of finished groups run
// while other groups' splits still stream K/V.
template <typename T, int kBlockM, int kThreads, bool kSinks = false>
__device__ __forceinline__ void FinishSplit(const FwdLaunch& L, const QueryRows& qr, int b,
                                            int group, int m0, int rows, float* smem,
                                            int smem_floats, int tid) {
  __threadfence();  // this thread's partial stores, before the ticket below
  __syncthreads();
  int took_last = 0;
  if (tid == 0) {
    int* counter = L.split_tickets + group;
    took_last = atomicAdd(counter, 1) == L.num_splits - 1;
    if (took_last) {
      *counter = 0;
      __threadfence();  // the other splits' partials are read after their tickets
    }
  }
  // The verdict reaches every thread through the barrier itself (no shared
  // flag written by one thread and read by all: racecheck flagged one in the
  // Hopper decode kernel, whose fifth warp reaches here from a TMA loop).
  if (!__syncthreads_or(took_last)) return;
  CombineSplitRows<T, kBlockM, kThreads, kSinks>(L, qr, b, m0, rows, smem, smem_floats, tid);
}

// Direct epilogue: stage this warp's rows of O through its own rows of sQ (no
// other warp reads them any more), then write 16-byte chunks coalesced along
// D, and LSE. The first __syncwarp orders the warp's last ldmatrix reads of
// these rows before the writes (racecheck flagged it with 2 stages, where no
// CTA barrier follows the last Q.K^T). kChunks: 16-byte chunks of an O row
// (kDTiles of them); sQ's rows are at least that wide.
template <typename T, int kMTiles, int kDTiles, int kStride, int kChunks, bool kDistinctV = false>
__device__ __forceinline__ void StoreOutput(const AttnParams& p, const QueryRows& qr, int b,
                                            const float (&acc_o)[kMTiles][kDTiles][4],
                                            const float (&lse)[kMTiles * 2], T* sQ, int m0,
                                            int warp_row0, int rows, int lane) {
  const int group = lane / 4, quad = lane % 4;
  const int d_chunks = OutDim<kDistinctV>(p) / 8;
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int rr = warp_row0 + mt * 16 + half * 8 + group;
        *reinterpret_cast<uint32_t*>(sQ + rr * kStride + dt * 8 + quad * 2) =
            PackPair<T>(acc_o[mt][dt][half * 2], acc_o[mt][dt][half * 2 + 1]);
      }
  __syncwarp();
  T* o_ptr = static_cast<T*>(p.o);
  for (int idx = lane; idx < kMTiles * 16 * kChunks; idx += 32) {
    const int rr = idx / kChunks, c = idx % kChunks;
    const int m = m0 + warp_row0 + rr;
    if (m >= rows || c >= d_chunks) continue;
    int h;
    const int64_t row = qr.Row(m, &h);
    *reinterpret_cast<uint4*>(o_ptr + OutOffset<kDistinctV>(p, row, h) + c * 8) =
        *reinterpret_cast<const uint4*>(sQ + (warp_row0 + rr) * kStride + c * 8);
  }
  if (p.lse != nullptr && quad == 0) {
    const int row0 = m0 + warp_row0 + group;
#pragma unroll
    for (int r = 0; r < kMTiles * 2; ++r) {
      const int m = FragmentRow(row0, r);
      if (m >= rows) continue;
      int h;
      qr.Row(m, &h);
      p.lse[LseOffset(p, b, h, m / qr.G)] = lse[r];
    }
  }
}

// Key-split (decode) tiles: warps 1..kNWarps-1 hand their online-softmax
// state (one m16 tile: O fragments, row max, thread-partial row sums) to warp
// 0 through `exchange` (smem, stored [warp][value][lane] so each access is
// one conflict-free 128-byte row); warp 0 rescales every state to the common
// row max and adds them. Returns true for warp 0, which holds the merged
// state; the caller's barrier must precede the call (the buffers are reused).
template <int kComputeWarps, int kDTiles>
__device__ __forceinline__ bool MergeWarpStates(float* exchange, float (&acc_o)[1][kDTiles][4],
                                                float (&row_max)[2], float (&row_sum)[2],
                                                float score_log2, int warp, int lane) {
  constexpr int kValues = kDTiles * 4 + 4;
  if (warp > 0 && warp < kComputeWarps) {
    float* dst = exchange + (warp - 1) * kValues * 32 + lane;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[(dt * 4 + e) * 32] = acc_o[0][dt][e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dst[(kDTiles * 4 + h) * 32] = row_max[h];
      dst[(kDTiles * 4 + 2 + h) * 32] = row_sum[h];
    }
  }
  __syncthreads();
  if (warp > 0) return false;
#pragma unroll
  for (int w = 1; w < kComputeWarps; ++w) {
    const float* src = exchange + (w - 1) * kValues * 32 + lane;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other_max = src[(kDTiles * 4 + h) * 32];
      const float mx = fmaxf(row_max[h], other_max);
      // As in OnlineSoftmax: a row no warp has seen a key for stays at -inf
      // without turning the factors into NaN.
      const float mx_log2 = mx == -INFINITY ? 0.f : mx * score_log2;
      const float mine = Exp2(row_max[h] * score_log2 - mx_log2);
      const float theirs = Exp2(other_max * score_log2 - mx_log2);
      row_max[h] = mx;
      row_sum[h] = row_sum[h] * mine + src[(kDTiles * 4 + 2 + h) * 32] * theirs;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          acc_o[0][dt][h * 2 + e] =
              acc_o[0][dt][h * 2 + e] * mine + src[(dt * 4 + h * 2 + e) * 32] * theirs;
        }
    }
  }
  return true;
}

// One CTA of the forward grid (x: batch, split, m block; y: the head, a KV
// head when GQA heads are packed into M): its sequence, its rows of the M
// extent (sq x G) and the key tiles [n_begin, n_end) it scans, its split's
// share of those its rows can see. Keys any row can see: [lo(first row),
// hi(last row)], as both bounds grow with the query index; band-interior
// tiles: [lo(last row), hi(first row)]. With kMods the scan instead visits
// positions [t_begin, t_end) of `order` (the band's tiles in the block
// mask's kept blocks; a split takes a share of those positions, so splits
// balance by kept tiles).
struct CtaWork {
  int b, split, m_block, head, kv_head;
  int sq, sk, rows, m0;
  int lo_last, hi_first;
  int n_begin, n_end;
  int t_begin = 0, t_end = 0;
  KeyTileOrder order;
};

// Key tiles (or kept-tile positions) per split of a CTA whose scan has
// `tiles`: ceil(tiles / splits), or under batch-invariant decode a function
// of `tiles` alone (InvariantTilesPerSplit; the launch's splits cover the
// longest sequence, shorter ones leave the last splits empty). The branch is
// uniform over the launch.
__device__ __forceinline__ int SplitTiles(const FwdLaunch& L, int tiles) {
  if (L.invariant_splits > 0) {
    return InvariantTilesPerSplit(tiles, L.invariant_splits, L.invariant_min_tiles);
  }
  return (tiles + L.num_splits - 1) / L.num_splits;
}

// False when the CTA's rows lie past its problem (nothing to do).
template <int kBlockM, int kBlockN, bool kIsBanded, typename Rows, bool kMods = false>
__device__ __forceinline__ bool LocateCta(const typename Rows::Launch& launch, CtaWork* w) {
  using Mask = MaskPolicy<kIsBanded>;
  const FwdLaunch& L = Rows::Fwd(launch);
  const AttnParams& p = L.p;
  const int G = L.pack_gqa;
  const int splits = L.num_splits;
  const int bs = blockIdx.x / L.num_m_blocks;
  w->b = bs / splits;
  w->split = bs % splits;
  w->m_block = Mask::MBlock(blockIdx.x % L.num_m_blocks, L.num_m_blocks);
  w->head = blockIdx.y;
  w->sq = SeqLenQ(p, w->b);
  w->sk = Rows::SeqLen(launch, w->b);
  w->rows = w->sq * G;
  w->m0 = w->m_block * kBlockM;
  if (w->m0 >= w->rows) return false;
  w->kv_head = G > 1 ? w->head : KVHead(p, w->head);
  const int i_first = w->m0 / G;
  const int i_last = (min(w->rows, w->m0 + kBlockM) - 1) / G;
  int lo_first, hi_last;
  VisibleKeys(p, i_first, w->sq, w->sk, &lo_first, &w->hi_first);
  VisibleKeys(p, i_last, w->sq, w->sk, &w->lo_last, &hi_last);
  Mask::KeyTiles(lo_first, hi_last, w->sk, kBlockN, &w->n_begin, &w->n_end);
  if constexpr (kMods) {
    const int count =
        BlockMaskTiles<kBlockN>(p, ModsPrefixOf(L), w->b, G > 1 ? w->head * G : w->head, i_first,
                                w->n_begin, w->n_end, &w->order);
    const int per_split = SplitTiles(L, count);
    w->t_begin = w->split * per_split;
    w->t_end = min(count, w->t_begin + per_split);
  } else {
    if (splits > 1) {
      const int per_split = SplitTiles(L, max(w->n_end - w->n_begin, 0));
      w->n_begin += w->split * per_split;
      w->n_end = min(w->n_end, w->n_begin + per_split);
    }
  }
  return true;
}

// S += Q K^T for one warp's kMTiles m16 row tiles and kNTiles n8 key tiles
// (the caller zeroes S: zeroing it here instead made the 128-row D = 128 tile
// spill): q and k point at the warp's ldmatrix lane addresses in padded smem
// tiles (rows kStride elements apart).
template <typename T, int kMTiles, int kNTiles, int kHeadDim, int kStride>
__device__ __forceinline__ void WarpScores(float (&s)[kMTiles][kNTiles][4], const T* q,
                                           const T* k) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) LdMatrixX4(a[mt], q + mt * 16 * kStride + kk * 16);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t bfrag[4];
      LdMatrixX4(bfrag, k + np * 16 * kStride + kk * 16);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        Mma16816<T>(s[mt][2 * np], a[mt], bfrag[0], bfrag[1]);
        Mma16816<T>(s[mt][2 * np + 1], a[mt], bfrag[2], bfrag[3]);
      }
    }
  }
}

// O += P V for one warp: the S accumulators of two n8 tiles are exactly the
// A fragment of one k16 step, so P never leaves registers. v: the warp's
// transposed-ldmatrix lane address in the padded V tile.
template <typename T, int kMTiles, int kNTiles, int kDTiles, int kStride>
__device__ __forceinline__ void WarpAccumulatePV(float (&acc_o)[kMTiles][kDTiles][4],
                                                 const float (&s)[kMTiles][kNTiles][4],
                                                 const T* v) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      a[mt][0] = PackPair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      a[mt][1] = PackPair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      a[mt][2] = PackPair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      a[mt][3] = PackPair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      uint32_t bfrag[4];
      LdMatrixX4Trans(bfrag, v + kk * 16 * kStride + dp * 16);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        Mma16816<T>(acc_o[mt][2 * dp], a[mt], bfrag[0], bfrag[1]);
        Mma16816<T>(acc_o[mt][2 * dp + 1], a[mt], bfrag[2], bfrag[3]);
      }
    }
  }
}

// FinishSplit for the CTA `w` (its group: the split siblings of its query
// tile). kSinks: a mods kernel's, whose combine adds the sinks.
template <typename T, int kBlockM, int kThreads, bool kSinks = false>
__device__ __forceinline__ void FinishCtaSplit(const FwdLaunch& L, const QueryRows& qr,
                                               const CtaWork& w, float* smem, int smem_floats,
                                               int tid) {
  FinishSplit<T, kBlockM, kThreads, kSinks>(L, qr, w.b,
                                            (w.head * L.p.batch + w.b) * L.num_m_blocks + w.m_block,
                                            w.m0, w.rows, smem, smem_floats, tid);
}

// End of a 16-row (decode) tile whose warps split the keys (every thread of
// the CTA calls it: it has CTA barriers). The warps' states are merged into
// warp 0 through `exchange` (the K/V buffers, dead by the first barrier),
// then O and LSE are stored directly (sQ stages the rows), or the split's
// partials and, with the fused combine, the CTA's ticket (FinishSplit, which
// may use all `smem_floats` of `smem`).
template <typename T, int kComputeWarps, int kDTiles, int kStride, int kThreads, bool kMods = false>
__device__ __forceinline__ void FinishDecodeTile(const FwdLaunch& L, const QueryRows& qr,
                                                 const CtaWork& w, float (&acc_o)[1][kDTiles][4],
                                                 float (&row_max)[2], float (&row_sum)[2],
                                                 float score_log2, bool warp_active,
                                                 float* exchange, T* sQ, float* smem,
                                                 int smem_floats) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const bool fused = L.num_splits > 1 && L.fused_combine;
  __syncthreads();
  const bool holds = MergeWarpStates<kComputeWarps, kDTiles>(exchange, acc_o, row_max, row_sum,
                                                             score_log2, warp, lane) &&
                     warp_active;
  if (!holds && !fused) return;
  float lse[2];
  if constexpr (kMods) {
    if (holds && L.num_splits == 1 && L.p.sinks != nullptr) {
      AddSinks(acc_o, row_max, row_sum, L.p, qr, w.m0 + lane / 4, w.rows, lane % 4, score_log2);
    }
  }
  if (holds) NormalizeRows(acc_o, row_max, row_sum, score_log2, lse);
  if (L.num_splits > 1) {
    if (holds) StoreSplitPartials(L, qr, w.split, acc_o, lse, w.m0 + lane / 4, w.rows, lane % 4);
    if (fused) FinishCtaSplit<T, 16, kThreads, kMods>(L, qr, w, smem, smem_floats, tid);
  } else {
    StoreOutput<T, 1, kDTiles, kStride, kDTiles>(L.p, qr, w.b, acc_o, lse, sQ, w.m0, 0, w.rows,
                                                 lane);
  }
}

}  // namespace detail

// K/V rows of sequence b in the request's own tensors when V's head dim
// differs from K's (MLA shapes, HeadDimV): kv_rows.cuh's ContiguousRows with
// V rows of Dv elements. Kept apart so the kernels of equal dims are
// unchanged.
template <typename T>
struct ContiguousRowsDv {
  using Launch = FwdLaunch;
  static constexpr bool kPaged = false;

  __host__ __device__ __forceinline__ static const FwdLaunch& Fwd(const Launch& l) { return l; }
  __device__ __forceinline__ static int SeqLen(const Launch& l, int b) { return SeqLenK(l.p, b); }

  __device__ __forceinline__ ContiguousRowsDv(const Launch& l, int b, int kv_head)
      : k(static_cast<const T*>(l.p.k) + KVOffset(l.p, SeqStartK(l.p, b), kv_head)),
        v(static_cast<const T*>(l.p.v) + VOffset(l.p, SeqStartK(l.p, b), kv_head)),
        stride(int64_t{l.p.num_heads_kv} * l.p.head_dim),
        v_stride(int64_t{l.p.num_heads_kv} * HeadDimV(l.p)) {}

  // Row j of K (kv = 0) or V (kv = 1), element 0 of this kv head.
  __device__ __forceinline__ const T* Row(int kv, int j) const {
    return kv ? v + j * v_stride : k + j * stride;
  }

  const T* k;
  const T* v;
  int64_t stride;    // elements between consecutive K rows
  int64_t v_stride;  // ... and V rows
};

// The kernel body. kHeadDim: instantiated head dim (params.head_dim <=
// kHeadDim, zero-padded). kIsBanded: banded mask policy (MaskPolicy<true>):
// tiles outside the band are skipped and band-boundary tiles masked; without
// it only the last, partial key tile is masked. kMods (banded policy only):
// the score modifiers and masks of params.h (score_mods.cuh): block-masked
// tiles are never loaded; with ALiBi, a bias or an element mask every
// scanned tile gets the per-element pass (ModScores, in the log2 domain, so
// score_log2 is 1), else the band's tiles are masked as without mods; unsplit
// rows fold in their sinks (AddSinks). Rows: where K/V rows are read from
// (kv_rows.cuh: ContiguousRows for the request's tensors, PagedRows for a
// cache's pages); Rows::Launch is the kernel's argument. kHeadDimV: V's and
// O's head dim when it differs (MLA shapes: Q K^T over kHeadDim, P V and O
// over kHeadDimV <= kHeadDim, params' HeadDimV zero-padded to it; Rows is
// then ContiguousRowsDv). V tiles keep K's smem row pitch, their columns
// past HeadDimV zero-filled, and only the first kHeadDimV are read.
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, typename T,
          bool kIsBanded, typename Rows, bool kMods = false, int kHeadDimV = kHeadDim>
__device__ __forceinline__ void AttnFwdBody(const typename Rows::Launch& launch) {
  using namespace detail;
  using Mask = MaskPolicy<kIsBanded>;
  static_assert(!kMods || kIsBanded, "mods run the banded mask policy");
  constexpr bool kDistinctV = kHeadDimV != kHeadDim;
  static_assert(!kDistinctV || (kHeadDimV < kHeadDim && kHeadDimV % 16 == 0 &&
                                std::is_same<Rows, ContiguousRowsDv<T>>::value && kBlockM != 16),
                "a distinct value dim: narrower than Q's, the request's tensors, no decode tile");
  constexpr int kThreads = kNWarps * 32;
  // m16 tiles per warp. A 16-row (decode) tile splits the keys instead: all
  // warps hold the same 16 rows, warp w < kComputeWarps computes keys
  // [w, w + 1) x kWarpKeys of every tile with its own online softmax, and the
  // warps' states are merged once at the end (MergeWarpStates); every warp
  // loads. A tile's math is then spread over several warps' issue slots
  // instead of one warp's dependent chain.
  constexpr bool kKeySplit = kBlockM == 16 && kNWarps > 1;
  constexpr int kComputeWarps = !kKeySplit               ? kNWarps
                                : kBlockN / 16 < kNWarps ? kBlockN / 16
                                                         : kNWarps;
  constexpr int kMTiles = kBlockM >= 16 * kNWarps ? kBlockM / (16 * kNWarps) : 1;
  constexpr int kWarpKeys =
      kKeySplit ? kBlockN / kComputeWarps : kBlockN;  // keys of a tile this warp computes
  constexpr int kNTiles = kWarpKeys / 8;              // n8 tiles of S per row block
  static_assert(kWarpKeys % 16 == 0, "a warp's key slice must be whole k16 steps");
  static_assert(!kKeySplit || (kComputeWarps - 1) * (kHeadDim / 2 + 4) * 32 * 4 <=
                                  kStages * kBlockN * (kHeadDim + 8) * 2,
                "the warps' states must fit the K buffers they are merged through");
  constexpr int kDTiles = kHeadDimV / 8;  // n8 tiles of O
  constexpr int kChunks = kHeadDim / 8;   // 16-byte chunks per row
  constexpr int kStride = kHeadDim + 8;   // smem row pitch (elements), +16 B pad
  static_assert(
      (kBlockM % (16 * kNWarps) == 0 || kBlockM == 16) && kHeadDim % 16 == 0 && kBlockN % 16 == 0,
      "tile shape");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;
  T* sV = sK + kStages * kBlockN * kStride;  // sK: [kStages][kBlockN][kStride], sV likewise

  const FwdLaunch& L = Rows::Fwd(launch);
  const AttnParams& p = L.p;
  const int G = L.pack_gqa;
  const int splits = L.num_splits;
  CtaWork w;
  if (!LocateCta<kBlockM, kBlockN, kIsBanded, Rows, kMods>(launch, &w)) return;
  const int b = w.b, split = w.split, head = w.head, kv_head = w.kv_head;
  const int sq = w.sq, sk = w.sk, rows = w.rows, m0 = w.m0;
  const int lo_last = w.lo_last, hi_first = w.hi_first;
  // The scan runs u from u_end - 1 down to u_begin over key tile tile_at(u):
  // the tile itself without mods, else scan position t = u_end - 1 - u +
  // t_begin of CtaWork's order (so the loop below is the same code for both).
  const int u_begin = kMods ? w.t_begin : w.n_begin;
  const int u_end = kMods ? w.t_end : w.n_end;
  auto tile_at = [&](int u) {
    if constexpr (kMods) {
      return w.order.At(u_end - 1 - u + u_begin);
    } else {
      return u;
    }
  };
  const QueryRows qr{G, head, SeqStartQ(p, b)};

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane / 4;  // row within an 8-row half of a fragment
  const int quad = lane % 4;   // column pair within an n8 tile
  const int warp_row0 = kKeySplit ? 0 : warp * kMTiles * 16;
  const int warp_key0 =
      kKeySplit ? warp * kWarpKeys : 0;     // first key of this warp's slice of a tile
  const int row0 = m0 + warp_row0 + group;  // the thread's first fragment row
  // Warps whose rows all lie past the problem, or past the key split, skip
  // the math (they still load).
  const bool warp_active = warp_row0 < kBlockM && m0 + warp_row0 < rows && warp < kComputeWarps;

  // Fused combine (FinishSplit), decode tiles only (MakeFwdLaunch): a 128-row
  // tile's group holds up to 128 rows x 128 splits of partials, too much for
  // one CTA to combine quickly, and the epilogue below is kept as it was for
  // the prefill tiles (any change to it added spills at D = 128). `finish`:
  // the group of this CTA's query tile (its split siblings) takes tickets;
  // the combine may use all of the (by then dead) dynamic smem.
  constexpr bool kCanFuse = kBlockM == 16;
  const bool fused = kCanFuse && splits > 1 && L.fused_combine;
  constexpr int kSmemFloats =
      (kBlockM + 2 * kStages * kBlockN) * kStride * static_cast<int>(sizeof(T)) / 4;
  auto finish = [&]() {
    FinishCtaSplit<T, kBlockM, kThreads, kMods>(L, qr, w, reinterpret_cast<float*>(smem_raw),
                                                kSmemFloats, tid);
  };

  if (u_begin >= u_end) {
    StoreEmptyRows<T, kBlockM, kThreads, kMods, kDistinctV>(L, qr, b, split, m0, rows, tid);
    if (fused) finish();
    return;
  }

  // ---- Tile loads (cp.async, 16 B per thread per step, zero-filled padding).
  const T* q_ptr = static_cast<const T*>(p.q);
  const Rows kv(launch, b, kv_head);
  const int d_chunks = p.head_dim / 8;
  // V's 16-byte chunks per row (its tile's columns past them zero-filled).
  const int dv_chunks = kDistinctV ? HeadDimV(p) / 8 : d_chunks;

  auto load_q = [&]() {
    for (int idx = tid; idx < kBlockM * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int m = m0 + r;
      const bool ok = m < rows && c < d_chunks;
      const T* src = q_ptr;
      if (ok) {
        int h;
        const int64_t row = qr.Row(m, &h);
        src = q_ptr + QOffset(p, row, h) + c * 8;
      }
      CpAsync16(sQ + r * kStride + c * 8, src, ok);
    }
  };
  // When the threads cover whole rows (kThreads % kChunks == 0) a thread
  // keeps one column chunk and steps down rows from one running pointer: the
  // general form below let the compiler hoist one 64-bit address per copy out
  // of the tile loop, which spilled at D=128. Contiguous rows: the thread's
  // rows are ld_r + it * kRowsPerIt (interleaved). Paged rows: the thread
  // owns kRowsPerThread consecutive rows (blocked), which lie in one page
  // (kRowsPerThread divides every page size), so one block-table lookup per
  // tile serves all its copies.
  constexpr bool kRowSteps = kThreads % kChunks == 0 && kBlockN % (kThreads / kChunks) == 0;
  constexpr int kRowsPerIt = kRowSteps ? kThreads / kChunks : 1;
  constexpr int kRowsPerThread = kBlockN / kRowsPerIt;
  static_assert(!kRowSteps || kMinPageSize % kRowsPerThread == 0,
                "a thread's rows must share a page");
  const int ld_r = tid / kChunks, ld_c = tid % kChunks;
  const bool ld_c_ok = ld_c < d_chunks;
  // which: 0 = K, 1 = V.
  auto load_kv = [&](T* dst, int which, int n) {
    [[maybe_unused]] const int row_chunks = kDistinctV && which ? dv_chunks : d_chunks;
    if constexpr (kRowSteps && Rows::kPaged) {
      const int j0 = n * kBlockN + ld_r * kRowsPerThread;
      const T* src = kv.Row(which, min(j0, sk - 1)) + ld_c * 8;
      const T* valid = src;
      T* d = dst + ld_r * kRowsPerThread * kStride + ld_c * 8;
#pragma unroll
      for (int it = 0; it < kRowsPerThread; ++it) {
        const bool ok = ld_c_ok && j0 + it < sk;
        CpAsync16(d + it * kStride, ok ? src : valid, ok);
        src += kv.stride;
      }
    } else if constexpr (kRowSteps) {
      const T* base = kv.Row(which, 0);
      const int j0 = n * kBlockN + ld_r;
      int64_t row_stride = kv.stride;
      bool c_ok = ld_c_ok;
      if constexpr (kDistinctV) {
        row_stride = which ? kv.v_stride : kv.stride;
        c_ok = ld_c < row_chunks;
      }
      const T* src = base + int64_t{j0} * row_stride + ld_c * 8;
      T* d = dst + ld_r * kStride + ld_c * 8;
      const int64_t step = kRowsPerIt * row_stride;
#pragma unroll
      for (int it = 0; it < kRowsPerThread; ++it) {
        const bool ok = c_ok && j0 + it * kRowsPerIt < sk;
        CpAsync16(d + it * kRowsPerIt * kStride, ok ? src : base, ok);
        src += step;
      }
    } else {
#pragma unroll
      for (int it = 0; it < (kBlockN * kChunks + kThreads - 1) / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        const int r = idx / kChunks, c = idx % kChunks;
        const int j = n * kBlockN + r;
        const bool ok = idx < kBlockN * kChunks && j < sk && c < row_chunks;
        const T* src = ok ? kv.Row(which, j) + c * 8 : q_ptr;
        if (idx < kBlockN * kChunks) CpAsync16(dst + r * kStride + c * 8, src, ok);
      }
    }
  };

  // ---- Accumulators: O (unnormalised), running row max (raw-score units) and
  // thread-partial row sums.
  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  float row_max[kMTiles * 2], row_sum[kMTiles * 2];
#pragma unroll
  for (int r = 0; r < kMTiles * 2; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }
  const bool use_softcap = p.softcap > 0.f;
  // Multiplier taking a (possibly capped) score to the log2 domain.
  // A mods kernel takes the per-element pass (ModScores) only for the mods
  // that act per element; a block mask (whole tiles) and sinks (the end)
  // leave the tiles to the plain kernel's band masking.
  const bool elementwise =
      kMods && (p.alibi_slopes != nullptr || p.bias != nullptr || p.mask != nullptr);
  const float score_log2 = elementwise || use_softcap ? 1.f : L.scale_log2;
  // Varlen: the launch's staged offsets (mods_prefix.cuh); dense: unused.
  const int64_t pairs_before =
      kMods && (p.bias != nullptr || p.mask != nullptr) && IsVarlen(p) ? ModsPrefixOf(L)[b] : 0;

  // ldmatrix lane addresses (element offsets inside a tile).
  // A (Q, 16x16 at [row0, k0]): lanes 0-15 rows 0-15 at k0, lanes 16-31 at k0+8.
  const int a_off = (warp_row0 + (lane % 16)) * kStride + (lane / 16) * 8;
  // B of S = Q K^T (two n8 tiles x k16 from K rows): rows n0 + lane%8 + 8*(lane/16), col k0 +
  // 8*((lane/8)%2).
  const int bk_off = ((lane % 8) + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
  // B of O = P V (k16 keys x two n8 d tiles, transposed): keys k0 + lane%8 + 8*((lane/8)%2), col d0
  // + 8*(lane/16).
  const int bv_off = ((lane % 8) + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;

  load_q();
  load_kv(sK, 0, tile_at(u_end - 1));
  if (kStages >= 2) load_kv(sV, 1, tile_at(u_end - 1));
  CpAsyncCommit();
  // A ring of kStages >= 3: the next kStages - 2 tiles are requested up front
  // too, one commit group per tile (empty groups keep the count uniform).
#pragma unroll
  for (int i = 1; i + 1 < kStages; ++i) {
    if (u_end - 1 - i >= u_begin) {
      load_kv(sK + i * kBlockN * kStride, 0, tile_at(u_end - 1 - i));
      load_kv(sV + i * kBlockN * kStride, 1, tile_at(u_end - 1 - i));
    }
    CpAsyncCommit();
  }

  // Tiles right to left: the first one is the partial (or band-edge) tile.
  for (int u = u_end - 1; u >= u_begin; --u) {
    const int n = tile_at(u);
    const int stage = kStages >= 2 ? (u_end - 1 - u) % kStages : 0;
    const T* tK = sK + (stage * kBlockN + warp_key0) * kStride;  // this warp's key slice
    const T* tV = sV + (stage * kBlockN + warp_key0) * kStride;
    // K[n] (with kStages >= 2 also V[n]; and Q) landed ...
    if constexpr (kStages >= 3) {
      CpAsyncWait<kStages - 2>();
    } else {
      CpAsyncWaitAll();
    }
    __syncthreads();  // ... for every thread; and all warps are done with the buffers reloaded next
    if constexpr (kStages >= 3) {
      const int next = u - (kStages - 1);
      if (next >= u_begin) {
        const int ring = (u_end - 1 - u + kStages - 1) % kStages;
        load_kv(sK + ring * kBlockN * kStride, 0, tile_at(next));
        load_kv(sV + ring * kBlockN * kStride, 1, tile_at(next));
      }
      CpAsyncCommit();
    } else if (kStages == 2) {
      if (u > u_begin) {
        load_kv(sK + (stage ^ 1) * kBlockN * kStride, 0, tile_at(u - 1));
        load_kv(sV + (stage ^ 1) * kBlockN * kStride, 1, tile_at(u - 1));
        CpAsyncCommit();
      }
    } else {
      load_kv(sV, 1, n);
      CpAsyncCommit();
    }

    // S = Q K^T for this warp's rows.
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
    if (warp_active) WarpScores<T, kMTiles, kNTiles, kHeadDim, kStride>(s, sQ + a_off, tK + bk_off);

    if (kStages == 1) {
      CpAsyncWaitAll();  // V[n] landed
      __syncthreads();   // ... for every thread; and all warps are done with sK
      if (u > u_begin) {
        load_kv(sK, 0, tile_at(u - 1));
        CpAsyncCommit();
      }
    }
    if (!warp_active) continue;

    if (use_softcap) SoftcapScores(s, L.softcap_in, L.softcap_out);
    const int key0 = n * kBlockN + warp_key0;
    if (elementwise) {
      ModScores(s, p, qr, b, pairs_before, use_softcap ? 1.f : L.scale_log2, key0, row0, rows, sq,
                sk, quad);
    } else if (Mask::TileNeedsMask(key0, kWarpKeys, sk, lo_last, hi_first)) {
      MaskScores(s, p, key0, row0, rows, G, sq, sk, quad);
    }
    OnlineSoftmax(s, row_max, row_sum, acc_o, score_log2);

    WarpAccumulatePV<T, kMTiles, kNTiles, kDTiles, kStride>(acc_o, s, tV + bv_off);
  }

  if constexpr (kCanFuse) {
    static_assert(kKeySplit, "the 16-row tile splits its keys over the warps");
    FinishDecodeTile<T, kComputeWarps, kDTiles, kStride, kThreads, kMods>(
        L, qr, w, acc_o, row_max, row_sum, score_log2, warp_active, reinterpret_cast<float*>(sK),
        sQ, reinterpret_cast<float*>(smem_raw), kSmemFloats);
  } else {
    if (!warp_active) return;
    float lse[kMTiles * 2];
    if constexpr (kMods) {
      if (splits == 1 && p.sinks != nullptr) {
        AddSinks(acc_o, row_max, row_sum, p, qr, row0, rows, quad, score_log2);
      }
    }
    NormalizeRows(acc_o, row_max, row_sum, score_log2, lse);
    if (splits > 1) {
      StoreSplitPartials<kMTiles, kDTiles, kDistinctV>(L, qr, split, acc_o, lse, row0, rows, quad);
    } else {
      StoreOutput<T, kMTiles, kDTiles, kStride, kHeadDimV / 8, kDistinctV>(
          p, qr, b, acc_o, lse, sQ, m0, warp_row0, rows, lane);
    }
  }
}

// The kernels: one body, two row sources. A 16-row (decode) tile is capped to
// 3 CTAs per SM (<= 168 registers): its 74 KB of smem allow 3, and 172
// registers would allow only 2. The paged launch is a __grid_constant__ so
// its slab tables are indexed in place (no local copy of the argument).
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, typename T,
          bool kIsBanded, bool kMods = false>
__global__ void __launch_bounds__(kNWarps * 32, kBlockM == 16 ? 3 : 1)
    AttnFwdKernel(const FwdLaunch L) {
  AttnFwdBody<kHeadDim, kBlockM, kBlockN, kNWarps, kStages, T, kIsBanded, ContiguousRows<T>, kMods>(
      L);
}
// ... with V and O rows of kHeadDimV (MLA shapes).
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, int kStages,
          typename T, bool kIsBanded, bool kMods = false>
__global__ void __launch_bounds__(kNWarps * 32, 1) AttnFwdKernelDv(const FwdLaunch L) {
  AttnFwdBody<kHeadDim, kBlockM, kBlockN, kNWarps, kStages, T, kIsBanded, ContiguousRowsDv<T>,
              kMods, kHeadDimV>(L);
}
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, typename T,
          bool kIsBanded, bool kMods = false>
__global__ void __launch_bounds__(kNWarps * 32, kBlockM == 16 ? 3 : 1)
    PagedAttnFwdKernel(const __grid_constant__ PagedFwdLaunch L) {
  AttnFwdBody<kHeadDim, kBlockM, kBlockN, kNWarps, kStages, T, kIsBanded, PagedRows<T>, kMods>(L);
}

// Launches `kernel` (either row source's, or the Hopper decode kernel's) with
// `tile`'s grid and `smem` bytes of dynamic shared memory.
template <typename Kernel, typename Launch>
cudaError_t LaunchTileKernel(Kernel kernel, const TileConfig& tile, int smem, const FwdLaunch& fwd,
                             const Launch& launch, cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int64_t blocks_x = int64_t{fwd.num_m_blocks} * fwd.p.batch * fwd.num_splits;
  const int heads = fwd.pack_gqa > 1 ? fwd.p.num_heads_kv : fwd.p.num_heads_q;
  if (blocks_x == 0) return cudaSuccess;
  if (blocks_x > 0x7fffffff || heads > 65535) return cudaErrorInvalidConfiguration;
  // One ticket counter per group and one combine weight per split
  // (PlanForward keeps split launches within both).
  if (fwd.num_splits > kMaxSplits ||
      (fwd.fused_combine && int64_t{fwd.num_m_blocks} * fwd.p.batch * heads > kMaxSplitGroups)) {
    return cudaErrorInvalidValue;
  }
  kernel<<<dim3(static_cast<unsigned>(blocks_x), heads), tile.num_warps * 32, smem, stream>>>(
      launch);
  return cudaGetLastError();
}

// The mods kernel (kMods, banded policy) of `kKind`'s tile for either row
// source. Score modifiers and masks run in the banded instantiation only
// (PlanForward marks such calls banded); on pages only ALiBi and sinks
// (CanImplementPaged refuses the other mods). kHeadDimV != kHeadDim: the
// MLA-shape kernel on kHeadDim's tile (the request's tensors only).
template <int kHeadDim, typename T, TileKind kKind, typename Rows, int kHeadDimV = kHeadDim>
cudaError_t RunAttnFwdModsTile(const typename Rows::Launch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile = TileFor(kKind, kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head dim missing from the tile table");
  if constexpr (Rows::kPaged) {
    return LaunchTileKernel(PagedAttnFwdKernel<kHeadDim, kTile.block_m, kTile.block_n,
                                               kTile.num_warps, kTile.stages, T, true, true>,
                            kTile, SmemBytes(kTile), Rows::Fwd(launch), launch, stream);
  } else if constexpr (kHeadDimV != kHeadDim) {
    return LaunchTileKernel(AttnFwdKernelDv<kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n,
                                            kTile.num_warps, kTile.stages, T, true, true>,
                            kTile, SmemBytes(kTile), launch, launch, stream);
  } else {
    return LaunchTileKernel(AttnFwdKernel<kHeadDim, kTile.block_m, kTile.block_n, kTile.num_warps,
                                          kTile.stages, T, true, true>,
                            kTile, SmemBytes(kTile), launch, launch, stream);
  }
}

template <int kHeadDim, typename T, bool kIsBanded, TileKind kKind, typename Rows,
          int kHeadDimV = kHeadDim>
cudaError_t RunAttnFwdTile(const typename Rows::Launch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile = TileFor(kKind, kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head dim missing from the tile table");
  if constexpr (kIsBanded) {
    if (HasScoreMods(Rows::Fwd(launch).p)) {
      return RunAttnFwdModsTile<kHeadDim, T, kKind, Rows, kHeadDimV>(launch, stream);
    }
  }
  if constexpr (Rows::kPaged) {
    return LaunchTileKernel(PagedAttnFwdKernel<kHeadDim, kTile.block_m, kTile.block_n,
                                               kTile.num_warps, kTile.stages, T, kIsBanded>,
                            kTile, SmemBytes(kTile), Rows::Fwd(launch), launch, stream);
  } else if constexpr (kHeadDimV != kHeadDim) {
    return LaunchTileKernel(AttnFwdKernelDv<kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n,
                                            kTile.num_warps, kTile.stages, T, kIsBanded>,
                            kTile, SmemBytes(kTile), launch, launch, stream);
  } else {
    return LaunchTileKernel(AttnFwdKernel<kHeadDim, kTile.block_m, kTile.block_n, kTile.num_warps,
                                          kTile.stages, T, kIsBanded>,
                            kTile, SmemBytes(kTile), Rows::Fwd(launch), launch, stream);
  }
}

// True when `kind`'s table has a tile for kHeadDim (only kPrefill covers every head dim).
template <int kHeadDim>
constexpr bool HasTile(TileKind kind) {
  return TileFor(kind, kHeadDim).head_dim == kHeadDim;
}

// Picks the tile the plan chose (FwdLaunch::tile_kind) for either row source
// (kHeadDimV != kHeadDim: never the decode tile; PlanForward gives such calls none).
template <int kHeadDim, typename T, bool kIsBanded, typename Rows, int kHeadDimV = kHeadDim>
cudaError_t RunAttnFwdRows(const typename Rows::Launch& launch, cudaStream_t stream) {
  const TileKind tile_kind = Rows::Fwd(launch).tile_kind;
  if constexpr (kHeadDimV == kHeadDim && HasTile<kHeadDim>(TileKind::kDecode)) {
    if (tile_kind == TileKind::kDecode) {
      return RunAttnFwdTile<kHeadDim, T, kIsBanded, TileKind::kDecode, Rows>(launch, stream);
    }
  }
  if constexpr (kIsBanded && HasTile<kHeadDim>(TileKind::kBanded)) {
    if (tile_kind == TileKind::kBanded) {
      return RunAttnFwdTile<kHeadDim, T, kIsBanded, TileKind::kBanded, Rows, kHeadDimV>(launch,
                                                                                        stream);
    }
  }
  if (tile_kind != TileKind::kPrefill) return cudaErrorInvalidValue;
  if constexpr (kIsBanded && HasTile<kHeadDim>(TileKind::kBanded)) {
    // PlanForward gives a real band TileKind::kBanded; mods without one keep
    // the prefill tile (its mods kernel only: no plain banded kernel on it).
    const AttnParams& p = Rows::Fwd(launch).p;
    if (IsBanded(p) || !HasScoreMods(p)) return cudaErrorInvalidValue;
    return RunAttnFwdModsTile<kHeadDim, T, TileKind::kPrefill, Rows, kHeadDimV>(launch, stream);
  } else {
    return RunAttnFwdTile<kHeadDim, T, kIsBanded, TileKind::kPrefill, Rows, kHeadDimV>(launch,
                                                                                       stream);
  }
}

template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnFwd(const FwdLaunch& launch, cudaStream_t stream) {
  return RunAttnFwdRows<kHeadDim, T, kIsBanded, ContiguousRows<T>>(launch, stream);
}

template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnFwd(const PagedFwdLaunch& launch, cudaStream_t stream) {
  return RunAttnFwdRows<kHeadDim, T, kIsBanded, PagedRows<T>>(launch, stream);
}

template <int kHeadDim, int kHeadDimV, typename T, bool kIsBanded>
cudaError_t RunAttnFwdDv(const FwdLaunch& launch, cudaStream_t stream) {
  static_assert(kHeadDimV != kHeadDim, "equal dims run RunAttnFwd");
  return RunAttnFwdRows<kHeadDim, T, kIsBanded, ContiguousRowsDv<T>, kHeadDimV>(launch, stream);
}

}  // namespace cuda
}  // namespace attnserve
