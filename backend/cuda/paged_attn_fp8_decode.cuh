// The FP8 cache's decode kernel (paged_attn_fp8.h says which calls it takes).
//
// Decode only streams K/V, so the kernel is built around the loads: each
// lane reads its share of a 16-key step with 16-byte loads straight into
// registers (the next step's loads are issued before this step's math, and
// the page id two steps ahead before that), and the codes are widened to
// FP16 in registers (cvt.rn.f16x2.e4m3x2 on sm_89+), never staged.
//
// Layouts, per warp and step (g = lane / 4, q = lane % 4):
//  - S = Q K^T on m16n8k16 (rows: packed query rows; two n8 tiles of keys).
//    The head dim is a reduction index, so Q and K may share any permutation
//    of it: lane q's k-step kk reads bytes 64 (kk / 4) + 16 q + 4 (kk % 4)
//    of its key's row, so each lane's K bytes are whole 16-byte loads.
//  - O^T = V^T P^T (m: head dim, n: 8 query rows, k: keys): the A operand
//    pairs two keys' codes at one column, so lane (g, q) loads D / 8 bytes at
//    column D / 8 x g of keys 2q, 2q + 1, 2q + 8, 2q + 9 and pairs them with
//    a byte permute; the B operand (P) is S's accumulator as it lies. O's
//    column order is undone when the warps merge through shared memory.
//  - Scales: a key's K scale multiplies its fp32 score; its V scale joins P
//    in the exponent: P' = exp2(s + log2 v_scale - m2), m2 a second running
//    max, so P' <= 1 rounds to FP16 as P does and O = exp2(m2 - m) sum(P' V)
//    / l. No rounded code x scale product is formed (docs/kv-cache.md).
//  - Q: BF16 values are not all FP16 ones, so each row is scaled by a power
//    of two (its largest |q| to [2^14, 2^15)) before FP16, exactly, and the
//    score multiplied back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/kv_quantize.cuh"
#include "backend/cuda/paged_attn.h"
#include "backend/cuda/paged_attn_fp8.h"
#include "backend/cuda/paged_decode_splits.cuh"

namespace attnserve {
namespace cuda {
namespace fp8_decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Two E4M3 codes (low byte first) to an FP16 pair, low half first.
__device__ __forceinline__ uint32_t Fp8x2ToHalf2(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t out;
  const uint16_t in = static_cast<uint16_t>(two);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
  return out;
#else
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return uint32_t{r.x} | (uint32_t{r.y} << 16);
#endif
}

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Read-once loads: no L1 allocation.
__device__ __forceinline__ uint4 LoadStream16(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}
__device__ __forceinline__ uint2 LoadStream8(const void* ptr) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(ptr));
  return v;
}
__device__ __forceinline__ float2 LoadStreamF2(const void* ptr) {
  float2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.f32 {%0,%1}, [%2];"
               : "=f"(v.x), "=f"(v.y)
               : "l"(ptr));
  return v;
}

// cp.async of 16 bytes (L2 only) into shared memory, and its group waits.
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

// The shared-memory ring variant's stage (kStages > 0, D 128): one warp
// step's K codes [16][128], V codes [16][128], then K's and V's 16 scales.
// 16-byte chunk c of row r sits at chunk c ^ ((r & 1) << 2) (K) or c ^ (r &
// 6) (V): each eight lanes' 16-byte reads then cover all 32 banks once.
constexpr int kRingStageBytes = 32 * 128 + 128;
__device__ __forceinline__ int RingK(int row, int chunk) {
  return row * 128 + ((chunk ^ ((row & 1) << 2)) * 16);
}
__device__ __forceinline__ int RingV(int row, int chunk) {
  return 2048 + row * 128 + ((chunk ^ (row & 6)) * 16);
}

// One lane's V bytes of one key row: D / 8 of them.
template <int kD>
struct VRow;
template <>
struct VRow<128> {
  uint4 w;
  __device__ __forceinline__ void Load(const uint8_t* p) { w = LoadStream16(p); }
  __device__ __forceinline__ uint32_t Word(int i) const {
    return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
  }
  __device__ __forceinline__ void Zero() { w = make_uint4(0, 0, 0, 0); }
};
template <>
struct VRow<64> {
  uint2 w;
  __device__ __forceinline__ void Load(const uint8_t* p) { w = LoadStream8(p); }
  __device__ __forceinline__ uint32_t Word(int i) const { return i == 0 ? w.x : w.y; }
  __device__ __forceinline__ void Zero() { w = make_uint2(0, 0); }
};

__device__ __forceinline__ uint32_t Word4(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One warp step's registers: K rows g and 8 + g (D / 4 bytes each), V rows
// 2q, 2q + 1, 2q + 8, 2q + 9 (D / 8 bytes each), and the scales of keys
// 2q, 2q + 1 (x, y of [0]) and 2q + 8, 2q + 9 ([1]).
template <int kD>
struct Step {
  uint4 k[2][kD / 64];
  VRow<kD> v[4];
  float2 ks[2];
  float2 vs[2];
};

// CTA (split, kv head, sequence): packed rows r = i x group + (head within
// the group) of kv head blockIdx.y over the split's share of the keys.
// kAhead: steps a warp's register loads run ahead of its math; kStages > 0:
// instead, a ring of kStages steps per warp in shared memory filled by
// cp.async (D 128), the bench's ablation only.
template <typename T, int kD, int kRowTiles, int kAhead, int kStages = 0>
__global__ void __launch_bounds__(kThreads, kFp8DecodeCtasPerSm)
    PagedFp8DecodeKernel(const __grid_constant__ PagedDecodeLaunch L) {
  constexpr int kRows = 8 * kRowTiles;
  constexpr int kKSteps = kD / 16;
  constexpr int kMTiles = kD / 16;
  constexpr int kVBytes = kD / 8;
  constexpr int kQPad = kD + 8;
  const AttnParams& p = L.p;
  const PagedKv& kv = L.kv;
  const int split = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int sq = SeqLenQ(p, b);
  if (sq == 0) return;
  const int sk = kv.seqlens_k[b];
  const int group = p.num_heads_q / p.num_heads_kv;
  const int n_rows = sq * group;
  const int64_t q_start = SeqStartQ(p, b);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int qd = lane % 4;

  __shared__ __align__(16) __half s_q[kRows][kQPad];
  __shared__ float s_qmul[kRows];
  __shared__ float s_m[kWarps][kRows];
  __shared__ float s_l[kWarps][kRows];
  __shared__ float s_m2[kWarps][kRows];
  __shared__ float s_o[kWarps][kRows][kD + 1];

  // The keys some row sees, [lo_all, hi_all], and those every row sees,
  // [lo_every, hi_every] (both bounds grow with the query index).
  int lo_all, hi_all, lo_every, hi_every;
  VisibleKeys(p, 0, sq, sk, &lo_all, &hi_every);
  VisibleKeys(p, sq - 1, sq, sk, &lo_every, &hi_all);
  const int c_lo = lo_all / kFp8DecodeChunk;
  const int n_chunks = hi_all >= lo_all ? hi_all / kFp8DecodeChunk - c_lo + 1 : 0;
  const int per = Fp8ChunksPerSplit(n_chunks, L.num_splits, L.invariant);
  const int c_begin = c_lo + split * per;
  const int c_end = c_lo + min(n_chunks, (split + 1) * per);
  if (c_begin >= c_end && L.part_o != nullptr) {
    // An empty split: nothing for the combine to weigh.
    for (int idx = tid; idx < n_rows * kD; idx += kThreads) {
      const int r = idx / kD;
      const int64_t at = DecodePartialAt(p, split, q_start + r / group, h * group + r % group);
      L.part_o[at * kD + idx % kD] = 0.0f;
      if (idx % kD == 0) L.part_lse[at] = -INFINITY;
    }
    return;
  }

  // Q: 8 threads per row, each D / 8 values; the row's power-of-two scale.
  {
    constexpr int kPer = kD / 8;
    const int r = tid / 8;
    const int part = tid % 8;
    float x[kPer];
    float mx = 0.0f;
    const bool real = r < n_rows;
    const T* src = static_cast<const T*>(p.q) +
                   (real ? QOffset(p, q_start + r / group, h * group + r % group) : 0) +
                   part * kPer;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      x[c] = real ? KvToFloat<T>(src[c]) : 0.0f;
      mx = fmaxf(mx, fabsf(x[c]));
    }
#pragma unroll
    for (int off = 1; off < 8; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    int e = 0;
    if (mx > 0.0f && mx <= 3.0e38f) {
      int ex;
      frexpf(mx, &ex);  // mx < 2^ex
      e = 15 - ex;
    }
    if (r < kRows) {
#pragma unroll
      for (int c = 0; c < kPer; ++c) s_q[r][part * kPer + c] = __float2half_rn(ldexpf(x[c], e));
      if (part == 0) s_qmul[r] = ldexpf(1.0f, -e);
    }
  }
  __syncthreads();

  // Q fragments (A of S), the head dim in the K loads' order.
  uint32_t qa[kKSteps][4];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const int at = (kk / 4) * 64 + 16 * qd + 4 * (kk % 4);
    qa[kk][0] = *reinterpret_cast<const uint32_t*>(&s_q[g][at]);
    qa[kk][2] = *reinterpret_cast<const uint32_t*>(&s_q[g][at + 2]);
    if (kRowTiles == 2) {
      qa[kk][1] = *reinterpret_cast<const uint32_t*>(&s_q[g + 8][at]);
      qa[kk][3] = *reinterpret_cast<const uint32_t*>(&s_q[g + 8][at + 2]);
    } else {
      qa[kk][1] = 0;
      qa[kk][3] = 0;
    }
  }

  // This lane's score rows g + 8 rt: visible keys, score multipliers, mods.
  const bool mods = p.softcap > 0.0f || p.alibi_slopes != nullptr;
  int row_lo[kRowTiles], row_hi[kRowTiles], row_i[kRowTiles];
  float row_mul[kRowTiles], slope[kRowTiles];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt) {
    const int r = g + 8 * rt;
    row_i[rt] = r < n_rows ? r / group : 0;
    if (r < n_rows) {
      VisibleKeys(p, row_i[rt], sq, sk, &row_lo[rt], &row_hi[rt]);
    } else {
      row_lo[rt] = 0;  // padding rows (q = 0) see every key and are never stored
      row_hi[rt] = sk - 1;
    }
    row_mul[rt] = s_qmul[r] * (mods ? p.softmax_scale : p.softmax_scale_log2);
    slope[rt] =
        p.alibi_slopes != nullptr && r < n_rows ? p.alibi_slopes[h * group + r % group] : 0.0f;
  }

  float acc[kRowTiles][kMTiles][4];
  float m[kRowTiles], l[kRowTiles], m2[kRowTiles];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt) {
    m[rt] = -INFINITY;
    m2[rt] = -INFINITY;
    l[rt] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][mt][e] = 0.0f;
  }

  const int32_t* table = kv.block_table + int64_t{b} * kv.block_table_stride;
  const int64_t row_stride = int64_t{p.num_heads_kv} * kD;  // bytes between a head's rows
  const int hkv = p.num_heads_kv;
  auto page_of = [&](int c) -> int32_t {
    return c < c_end ? __ldg(table + ((c * kFp8DecodeChunk) >> kv.pages.page_shift)) : 0;
  };
  auto load = [&](int c, int32_t page, Step<kD>& x) {
    const int slab = PageSlab(kv.pages, page);
    const int t0 = (c * kFp8DecodeChunk) & (kv.pages.page_size - 1);
    const uint8_t* k_slab = static_cast<const uint8_t*>(kv.pages.k_slabs[slab]);
    const uint8_t* v_slab = static_cast<const uint8_t*>(kv.pages.v_slabs[slab]);
    const int64_t off = PageRowOffset(kv.pages, page, t0, hkv, kD, h);
    const int64_t scale_off = PageScaleOffset(kv.pages, page, t0, hkv, kD, h);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int cc = 0; cc < kD / 64; ++cc)
        x.k[nt][cc] = LoadStream16(k_slab + off + (8 * nt + g) * row_stride + cc * 64 + 16 * qd);
    const uint8_t* v_base = v_slab + off + kVBytes * g;
#pragma unroll
    for (int i = 0; i < 4; ++i) x.v[i].Load(v_base + (2 * qd + (i & 1) + 8 * (i / 2)) * row_stride);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      x.ks[i] = LoadStreamF2(k_slab + scale_off + 4 * (2 * qd + 8 * i));
      x.vs[i] = LoadStreamF2(v_slab + scale_off + 4 * (2 * qd + 8 * i));
    }
  };

  auto compute = [&](int c, Step<kD>& x) {
    const int j0 = c * kFp8DecodeChunk;
    // Keys past the sequence: their rows hold whatever the page held; zero
    // codes and unit scales keep P' x V finite (their scores are masked).
    if (j0 + kFp8DecodeChunk > sk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (j0 + 2 * qd + (i & 1) + 8 * (i / 2) >= sk) x.v[i].Zero();
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (j0 + 2 * qd + 8 * i >= sk) x.vs[i].x = 1.0f;
        if (j0 + 2 * qd + 8 * i + 1 >= sk) x.vs[i].y = 1.0f;
      }
    }
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t w = Word4(x.k[nt][kk / 4], kk % 4);
        MmaF16(s[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], Fp8x2ToHalf2(w),
               Fp8x2ToHalf2(w >> 16));
      }
    }
    const bool need_mask = j0 < lo_every || j0 + kFp8DecodeChunk - 1 > hi_every;
    float lv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      lv[nt][0] = __log2f(x.vs[nt].x);
      lv[nt][1] = __log2f(x.vs[nt].y);
    }
    uint32_t pb[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt) {
      float sc[2][2];
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float ks = e == 0 ? x.ks[nt].x : x.ks[nt].y;
          const int j = j0 + 8 * nt + 2 * qd + e;
          float v = s[nt][2 * rt + e] * ks * row_mul[rt];
          if (mods) {
            if (p.softcap > 0.0f) v = p.softcap * tanhf(v / p.softcap);
            if (p.alibi_slopes != nullptr) v += AlibiBias(slope[rt], row_i[rt], j, sq, sk);
            v *= kLog2e;
          }
          if (need_mask && (j < row_lo[rt] || j > row_hi[rt])) v = -INFINITY;
          sc[nt][e] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[rt], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[rt] - m_use);
      float sum = 0.0f;
      float t[2][2];
      float mx2 = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          sum += exp2f(sc[nt][e] - m_use);
          t[nt][e] = sc[nt][e] + lv[nt][e];
          mx2 = fmaxf(mx2, t[nt][e]);
        }
      }
      l[rt] = l[rt] * alpha + sum;
      m[rt] = m_new;
      mx2 = fmaxf(mx2, __shfl_xor_sync(0xffffffffu, mx2, 1));
      mx2 = fmaxf(mx2, __shfl_xor_sync(0xffffffffu, mx2, 2));
      const float m2_new = fmaxf(m2[rt], mx2);
      const float m2_use = m2_new == -INFINITY ? 0.0f : m2_new;
      const float alpha2 = exp2f(m2[rt] - m2_use);
      m2[rt] = m2_new;
      pb[rt][0] = PackHalf2(exp2f(t[0][0] - m2_use), exp2f(t[0][1] - m2_use));
      pb[rt][1] = PackHalf2(exp2f(t[1][0] - m2_use), exp2f(t[1][1] - m2_use));
      // O rows 8 rt + 2q and + 1 live in this lane; their alpha2 in lanes 8q, 8q + 4.
      const float a_lo = __shfl_sync(0xffffffffu, alpha2, 8 * qd);
      const float a_hi = __shfl_sync(0xffffffffu, alpha2, 8 * qd + 4);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        acc[rt][mt][0] *= a_lo;
        acc[rt][mt][1] *= a_hi;
        acc[rt][mt][2] *= a_lo;
        acc[rt][mt][3] *= a_hi;
      }
    }
    // O^T += V^T P^T, one m16 tile of head-dim columns at a time.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const uint32_t sel = (mt % 2) ? 0x7362u : 0x5140u;
      const uint32_t p01 = __byte_perm(x.v[0].Word(mt / 2), x.v[1].Word(mt / 2), sel);
      const uint32_t p23 = __byte_perm(x.v[2].Word(mt / 2), x.v[3].Word(mt / 2), sel);
      const uint32_t a0 = Fp8x2ToHalf2(p01);
      const uint32_t a1 = Fp8x2ToHalf2(p01 >> 16);
      const uint32_t a2 = Fp8x2ToHalf2(p23);
      const uint32_t a3 = Fp8x2ToHalf2(p23 >> 16);
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
        MmaF16(acc[rt][mt], a0, a1, a2, a3, pb[rt][0], pb[rt][1]);
    }
  };

  // The warp's steps: chunks c_begin + warp, + kWarps, ... With kAhead > 0
  // the loads of the step kAhead ahead are issued before this step's math,
  // and its page id one step before that.
  int c = c_begin + warp;
  if constexpr (kStages > 0) {
    static_assert(kStages == 0 || kD == 128, "the ring variant is D 128 only");
    extern __shared__ __align__(16) uint8_t ring_smem[];
    uint8_t* ring = ring_smem + warp * kStages * kRingStageBytes;
    const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    auto issue = [&](int cs, int32_t page, int slot) {
      const int slab = PageSlab(kv.pages, page);
      const int t0 = (cs * kFp8DecodeChunk) & (kv.pages.page_size - 1);
      const uint8_t* k_slab = static_cast<const uint8_t*>(kv.pages.k_slabs[slab]);
      const uint8_t* v_slab = static_cast<const uint8_t*>(kv.pages.v_slabs[slab]);
      const int64_t off = PageRowOffset(kv.pages, page, t0, hkv, kD, h);
      const int64_t scale_off = PageScaleOffset(kv.pages, page, t0, hkv, kD, h);
      const uint32_t st = ring_addr + slot * kRingStageBytes;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int ci = lane + 32 * j;
        const int row = ci / 8;
        const int ch = ci % 8;
        CpAsync16(st + RingK(row, ch), k_slab + off + row * row_stride + ch * 16);
        CpAsync16(st + RingV(row, ch), v_slab + off + row * row_stride + ch * 16);
      }
      if (lane < 8) {
        const uint8_t* slab_base = lane < 4 ? k_slab : v_slab;
        CpAsync16(st + 4096 + lane * 16, slab_base + scale_off + (lane % 4) * 16);
      }
    };
    auto read = [&](int slot, Step<kD>& x) {
      const uint8_t* st = ring + slot * kRingStageBytes;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int cc = 0; cc < kD / 64; ++cc)
          x.k[nt][cc] = *reinterpret_cast<const uint4*>(st + RingK(8 * nt + g, 4 * cc + qd));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x.v[i].w = *reinterpret_cast<const uint4*>(st + RingV(2 * qd + (i & 1) + 8 * (i / 2), g));
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        x.ks[i] = *reinterpret_cast<const float2*>(st + 4096 + 4 * (2 * qd + 8 * i));
        x.vs[i] = *reinterpret_cast<const float2*>(st + 4096 + 64 + 4 * (2 * qd + 8 * i));
      }
    };
#pragma unroll
    for (int u = 0; u < kStages - 1; ++u) {
      const int cu = c + u * kWarps;
      if (cu < c_end) issue(cu, page_of(cu), u);
      CpAsyncCommit();
    }
    int32_t page_next = page_of(c + (kStages - 1) * kWarps);
    for (int k = 0; c < c_end; c += kWarps, ++k) {
      // Refill the slot the previous step read (every lane passed its
      // __syncwarp), then wait for this step's group.
      const int ahead = c + (kStages - 1) * kWarps;
      const int32_t page = page_next;
      page_next = page_of(ahead + kWarps);
      if (ahead < c_end) issue(ahead, page, (k + kStages - 1) % kStages);
      CpAsyncCommit();
      CpAsyncWait<kStages - 1>();
      __syncwarp();
      Step<kD> x;
      read(k % kStages, x);
      __syncwarp();
      compute(c, x);
    }
    CpAsyncWait<0>();
  } else if (kAhead == 1) {
    int32_t page1 = page_of(c);
    int32_t page2 = page_of(c + kWarps);
    Step<kD> cur;
    if (c < c_end) load(c, page1, cur);
    page1 = page2;
    for (; c < c_end; c += kWarps) {
      page2 = page_of(c + 2 * kWarps);
      Step<kD> next;
      if (c + kWarps < c_end) load(c + kWarps, page1, next);
      compute(c, cur);
      cur = next;
      page1 = page2;
    }
  } else if (kAhead > 1) {
    // Buffer u of the unrolled body holds the step u mod (kAhead + 1).
    constexpr int kBufs = kAhead + 1;
    Step<kD> buf[kBufs];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int cu = c + u * kWarps;
      if (cu < c_end) load(cu, page_of(cu), buf[u]);
    }
    int32_t page_next = page_of(c + kAhead * kWarps);
    for (; c < c_end; c += kBufs * kWarps) {
#pragma unroll
      for (int u = 0; u < kBufs; ++u) {
        const int cu = c + u * kWarps;
        const int ahead = cu + kAhead * kWarps;
        const int32_t page = page_next;
        page_next = page_of(ahead + kWarps);
        if (ahead < c_end) load(ahead, page, buf[(u + kAhead) % kBufs]);
        if (cu < c_end) compute(cu, buf[u]);
      }
    }
  } else {
    for (; c < c_end; c += kWarps) {
      Step<kD> cur;
      load(c, page_of(c), cur);
      compute(c, cur);
    }
  }

  // Merge the warps: row stats from lanes q = 0, O columns undone.
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt) {
    float sum = l[rt];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (qd == 0) {
      s_m[warp][g + 8 * rt] = m[rt];
      s_l[warp][g + 8 * rt] = sum;
      s_m2[warp][g + 8 * rt] = m2[rt];
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int d = kVBytes * g + 2 * mt;
      const int r = 8 * rt + 2 * qd;
      s_o[warp][r][d] = acc[rt][mt][0];
      s_o[warp][r + 1][d] = acc[rt][mt][1];
      s_o[warp][r][d + 1] = acc[rt][mt][2];
      s_o[warp][r + 1][d + 1] = acc[rt][mt][3];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < n_rows * kD; idx += kThreads) {
    const int r = idx / kD;
    const int d = idx % kD;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, s_m[w][r]);
    float total = 0.0f, o = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        total += s_l[w][r] * exp2f(s_m[w][r] - mm);
        o += s_o[w][r][d] * exp2f(s_m2[w][r] - mm);
      }
    }
    const int head = h * group + r % group;
    const int64_t row = q_start + r / group;
    if (L.part_o != nullptr) {
      const int64_t at = DecodePartialAt(p, split, row, head);
      L.part_o[at * kD + d] = total > 0.0f ? o / total : 0.0f;
      if (d == 0) L.part_lse[at] = total > 0.0f ? mm + log2f(total) : -INFINITY;
      continue;
    }
    if (p.sinks != nullptr) {
      const float sink = p.sinks[head] * kLog2e;
      const float mn = fmaxf(mm, sink);
      const float f = mm == -INFINITY ? 0.0f : exp2f(mm - mn);
      total = total * f + exp2f(sink - mn);
      o *= f;
      mm = mn;
    }
    static_cast<T*>(p.o)[QOffset(p, row, head) + d] =
        static_cast<T>(total > 0.0f ? o / total : 0.0f);
    if (d == 0 && p.lse != nullptr) {
      p.lse[LseOffset(p, b, head, static_cast<int>(row - q_start))] =
          total > 0.0f ? (mm + log2f(total)) / kLog2e : -INFINITY;
    }
  }
}

}  // namespace fp8_decode
}  // namespace cuda
}  // namespace attnserve
