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

#include "backend/cuda/attn_fwd.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {
namespace detail {

constexpr float kLn2 = 0.69314718055994530942f;

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 zero-fills the 16 bytes: rows past the sequence and head-dim
  // padding read as zeros, so they add nothing to Q.K or P.V.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

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
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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

}  // namespace detail

// kHeadDim: instantiated head dim (params.head_dim <= kHeadDim, zero-padded).
// kIsBanded: the request has a causal and/or sliding-window band (causal is
// window_right = 0 after FillParams); tiles outside the band are skipped and
// band-boundary tiles masked. Without it only the last, partial key tile is
// masked (by the same per-row [lo, hi] test, hi = Sk - 1).
// A 16-row (decode) tile is capped to 3 CTAs per SM (<= 168 registers): its
// 74 KB of smem allow 3, and 172 registers would allow only 2.
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, typename T, bool kIsBanded>
__global__ void __launch_bounds__(kNWarps * 32, kBlockM == 16 ? 3 : 1) AttnFwdKernel(const FwdLaunch L) {
  using namespace detail;
  constexpr int kThreads = kNWarps * 32;
  // m16 tiles per warp; a 16-row (decode) tile gives warp 0 the one m tile
  // and the other warps only load.
  constexpr int kMTiles = kBlockM >= 16 * kNWarps ? kBlockM / (16 * kNWarps) : 1;
  constexpr int kNTiles = kBlockN / 8;               // n8 tiles of S per row block
  constexpr int kDTiles = kHeadDim / 8;              // n8 tiles of O
  constexpr int kChunks = kHeadDim / 8;              // 16-byte chunks per row
  constexpr int kStride = kHeadDim + 8;              // smem row pitch (elements), +16 B pad
  static_assert((kBlockM % (16 * kNWarps) == 0 || kBlockM == 16) && kHeadDim % 16 == 0 && kBlockN % 16 == 0, "tile shape");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;
  T* sV = sK + kStages * kBlockN * kStride;  // sK: [kStages][kBlockN][kStride], sV likewise

  const AttnParams& p = L.p;
  const int G = L.pack_gqa;
  // Grid x enumerates (batch, split, m block); y the head (a KV head when packed).
  const int splits = L.num_splits;
  int m_block = blockIdx.x % L.num_m_blocks;
  const int bs = blockIdx.x / L.num_m_blocks;
  const int b = bs / splits;
  const int split = bs % splits;
  // Causal CTAs with the most tiles first, so the tail of the grid is short ones.
  if (kIsBanded) m_block = L.num_m_blocks - 1 - m_block;
  const int head = blockIdx.y;

  const int sq = SeqLenQ(p, b);
  const int sk = SeqLenK(p, b);
  const int rows = sq * G;  // M extent of this (batch, head) problem
  const int m0 = m_block * kBlockM;
  if (m0 >= rows) return;
  const int64_t q_start = SeqStartQ(p, b);
  const int64_t k_start = SeqStartK(p, b);
  const int kv_head = G > 1 ? head : KVHead(p, head);

  // Keys any row of this CTA can see: [lo(first row), hi(last row)], as both
  // bounds grow with the query index. Band-interior tiles: [lo(last), hi(first)].
  const int i_first = m0 / G;
  const int i_last = (min(rows, m0 + kBlockM) - 1) / G;
  int lo_first, hi_first, lo_last, hi_last;
  VisibleKeys(p, i_first, sq, sk, &lo_first, &hi_first);
  VisibleKeys(p, i_last, sq, sk, &lo_last, &hi_last);
  int n_begin = 0;
  int n_end = (sk + kBlockN - 1) / kBlockN;
  if (kIsBanded) {
    n_begin = max(lo_first, 0) / kBlockN;
    n_end = hi_last < 0 ? 0 : min(n_end, hi_last / kBlockN + 1);
  }
  if (splits > 1) {
    const int per_split = (max(n_end - n_begin, 0) + splits - 1) / splits;
    n_begin += split * per_split;
    n_end = min(n_end, n_begin + per_split);
  }

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane / 4;  // row within an 8-row half of a fragment
  const int quad = lane % 4;   // column pair within an n8 tile
  const int warp_row0 = warp * kMTiles * 16;
  // Warps whose rows all lie past the problem (decode: M of 1..16 rows) only
  // help load tiles; they skip the math.
  const bool warp_active = warp_row0 < kBlockM && m0 + warp_row0 < rows;

  // The thread's rows: r = mt * 2 + half -> CTA row warp_row0 + mt*16 + half*8 + group.
  auto thread_row = [&](int r) { return m0 + warp_row0 + (r / 2) * 16 + (r % 2) * 8 + group; };

  auto q_row = [&](int m, int* head_out) -> int64_t {  // CTA-external row m -> global row
    *head_out = G > 1 ? head * G + m % G : head;
    return q_start + m / G;
  };

  // ---- Output of a CTA whose key range is empty (fully masked rows, Sk = 0,
  // or an empty split): O = 0 and LSE = -inf, written directly.
  if (n_begin >= n_end) {
    for (int idx = tid; idx < kBlockM; idx += kThreads) {
      const int m = m0 + idx;
      if (m >= rows) break;
      int h;
      const int64_t row = q_row(m, &h);
      if (splits > 1) {
        const int64_t acc = (int64_t{split} * p.num_heads_q + h) * p.total_q + row;
        for (int d = 0; d < p.head_dim; ++d) L.o_accum[acc * p.head_dim + d] = 0.f;
        L.lse_accum[acc] = -INFINITY;
      } else {
        T* o = static_cast<T*>(p.o) + QOffset(p, row, h);
        for (int d = 0; d < p.head_dim; ++d) o[d] = T(0.f);
        if (p.lse != nullptr) p.lse[LseOffset(p, b, h, m / G)] = -INFINITY;
      }
    }
    return;
  }

  // ---- Tile loads (cp.async, 16 B per thread per step, zero-filled padding).
  const T* q_ptr = static_cast<const T*>(p.q);
  const T* k_base = static_cast<const T*>(p.k) + KVOffset(p, k_start, kv_head);
  const T* v_base = static_cast<const T*>(p.v) + KVOffset(p, k_start, kv_head);
  const int64_t kv_row_stride = int64_t{p.num_heads_kv} * p.head_dim;
  const int d_chunks = p.head_dim / 8;

  auto load_q = [&]() {
    for (int idx = tid; idx < kBlockM * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int m = m0 + r;
      const bool ok = m < rows && c < d_chunks;
      const T* src = q_ptr;
      if (ok) {
        int h;
        const int64_t row = q_row(m, &h);
        src = q_ptr + QOffset(p, row, h) + c * 8;
      }
      CpAsync16(sQ + r * kStride + c * 8, src, ok);
    }
  };
  // When the threads cover whole rows (kThreads % kChunks == 0) a thread
  // keeps one column chunk and steps down kRowsPerIt rows per copy from one
  // running pointer: the general form below let the compiler hoist one 64-bit
  // address per copy out of the tile loop, which spilled at D=128.
  constexpr bool kRowSteps = kThreads % kChunks == 0 && kBlockN % (kThreads / kChunks) == 0;
  constexpr int kRowsPerIt = kRowSteps ? kThreads / kChunks : 1;
  const int ld_r = tid / kChunks, ld_c = tid % kChunks;
  const bool ld_c_ok = ld_c < d_chunks;
  auto load_kv = [&](T* dst, const T* base, int n) {
    if constexpr (kRowSteps) {
      const int j0 = n * kBlockN + ld_r;
      const T* src = base + int64_t{j0} * kv_row_stride + ld_c * 8;
      T* d = dst + ld_r * kStride + ld_c * 8;
      const int64_t step = kRowsPerIt * kv_row_stride;
#pragma unroll
      for (int it = 0; it < kBlockN / kRowsPerIt; ++it) {
        const bool ok = ld_c_ok && j0 + it * kRowsPerIt < sk;
        CpAsync16(d + it * kRowsPerIt * kStride, ok ? src : base, ok);
        src += step;
      }
    } else {
#pragma unroll
      for (int it = 0; it < (kBlockN * kChunks + kThreads - 1) / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        const int r = idx / kChunks, c = idx % kChunks;
        const int j = n * kBlockN + r;
        const bool ok = idx < kBlockN * kChunks && j < sk && c < d_chunks;
        const T* src = ok ? base + j * kv_row_stride + c * 8 : base;
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
  const float score_log2 = use_softcap ? 1.f : L.scale_log2;

  // ldmatrix lane addresses (element offsets inside a tile).
  // A (Q, 16x16 at [row0, k0]): lanes 0-15 rows 0-15 at k0, lanes 16-31 at k0+8.
  const int a_off = (warp_row0 + (lane % 16)) * kStride + (lane / 16) * 8;
  // B of S = Q K^T (two n8 tiles x k16 from K rows): rows n0 + lane%8 + 8*(lane/16), col k0 + 8*((lane/8)%2).
  const int bk_off = ((lane % 8) + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
  // B of O = P V (k16 keys x two n8 d tiles, transposed): keys k0 + lane%8 + 8*((lane/8)%2), col d0 + 8*(lane/16).
  const int bv_off = ((lane % 8) + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;

  load_q();
  load_kv(sK, k_base, n_end - 1);
  if (kStages == 2) load_kv(sV, v_base, n_end - 1);
  CpAsyncCommit();

  // Tiles right to left: the first one is the partial (or band-edge) tile.
  for (int n = n_end - 1; n >= n_begin; --n) {
    const int stage = kStages == 2 ? (n_end - 1 - n) % 2 : 0;
    const T* tK = sK + stage * kBlockN * kStride;
    const T* tV = sV + stage * kBlockN * kStride;
    CpAsyncWaitAll();  // K[n] (with kStages 2 also V[n]; and Q) landed
    __syncthreads();   // ... for every thread; and all warps are done with the buffers reloaded next
    if (kStages == 2) {
      if (n > n_begin) {
        load_kv(sK + (stage ^ 1) * kBlockN * kStride, k_base, n - 1);
        load_kv(sV + (stage ^ 1) * kBlockN * kStride, v_base, n - 1);
        CpAsyncCommit();
      }
    } else {
      load_kv(sV, v_base, n);
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
    if (warp_active) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) LdMatrixX4(a[mt], sQ + a_off + mt * 16 * kStride + kk * 16);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t bfrag[4];
          LdMatrixX4(bfrag, tK + bk_off + np * 16 * kStride + kk * 16);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma16816<T>(s[mt][2 * np], a[mt], bfrag[0], bfrag[1]);
            Mma16816<T>(s[mt][2 * np + 1], a[mt], bfrag[2], bfrag[3]);
          }
        }
      }
    }

    if (kStages == 1) {
      CpAsyncWaitAll();  // V[n] landed
      __syncthreads();   // ... for every thread; and all warps are done with sK
      if (n > n_begin) {
        load_kv(sK, k_base, n - 1);
        CpAsyncCommit();
      }
    }
    if (!warp_active) continue;

    if (use_softcap) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = tanhf(s[mt][nt][e] * L.softcap_in) * L.softcap_out;
    }

    // Mask only tiles that straddle the Sk end or a band edge.
    const int key0 = n * kBlockN;
    const bool need_mask =
        key0 + kBlockN > sk || (kIsBanded && !(key0 >= lo_last && key0 + kBlockN - 1 <= hi_first));
    if (need_mask) {
      // Row bounds are recomputed here rather than kept in registers: the
      // main loop is at the 255-register limit and this runs on few tiles.
#pragma unroll
      for (int r = 0; r < kMTiles * 2; ++r) {
        int lo, hi;
        VisibleKeys(p, min(thread_row(r), rows - 1) / G, sq, sk, &lo, &hi);
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

    // Online softmax: new row max, rescale O and the sums, P = exp2(S - max).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mt * 2 + half;
        float mx = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][half * 2], s[mt][nt][half * 2 + 1]));
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

    // O += P V: the S accumulators of two n8 tiles are exactly the A fragment
    // of one k16 step, so P never leaves registers.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
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
        LdMatrixX4Trans(bfrag, tV + bv_off + kk * 16 * kStride + dp * 16);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma16816<T>(acc_o[mt][2 * dp], a[mt], bfrag[0], bfrag[1]);
          Mma16816<T>(acc_o[mt][2 * dp + 1], a[mt], bfrag[2], bfrag[3]);
        }
      }
    }
  }

  if (!warp_active) return;

  // ---- Epilogue: normalise once, LSE in natural log, store.
  float lse[kMTiles * 2];
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

  if (splits > 1) {
    // fp32 partials straight from the fragments (decode-sized outputs).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = m0 + warp_row0 + mt * 16 + half * 8 + group;
        if (m >= rows) continue;
        int h;
        const int64_t row = q_row(m, &h);
        const int64_t acc = (int64_t{split} * p.num_heads_q + h) * p.total_q + row;
        float* dst = L.o_accum + acc * p.head_dim;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int d = dt * 8 + quad * 2;
          if (d < p.head_dim) {
            *reinterpret_cast<float2*>(dst + d) = make_float2(acc_o[mt][dt][half * 2], acc_o[mt][dt][half * 2 + 1]);
          }
        }
        if (quad == 0) L.lse_accum[acc] = lse[mt * 2 + half];
      }
    return;
  }

  // Stage this warp's rows of O through its own rows of sQ (no other warp
  // reads them any more), then write 16-byte chunks coalesced along D. The
  // __syncwarp orders the warp's last ldmatrix reads of these rows before the
  // writes (racecheck flagged it with 2 stages, where no CTA barrier follows
  // the last Q.K^T).
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
    const int64_t row = q_row(m, &h);
    *reinterpret_cast<uint4*>(o_ptr + QOffset(p, row, h) + c * 8) =
        *reinterpret_cast<const uint4*>(sQ + (warp_row0 + rr) * kStride + c * 8);
  }
  if (p.lse != nullptr && quad == 0) {
#pragma unroll
    for (int r = 0; r < kMTiles * 2; ++r) {
      const int m = thread_row(r);
      if (m >= rows) continue;
      int h;
      q_row(m, &h);
      p.lse[LseOffset(p, b, h, m / G)] = lse[r];
    }
  }
}

template <int kHeadDim>
constexpr TileConfig TileFor() {
  for (const TileConfig& t : kTileTable) {
    if (t.head_dim == kHeadDim) return t;
  }
  return TileConfig{0, 0, 0, 0, 0, 0};
}
template <int kHeadDim>
constexpr TileConfig BandedTileFor() {
  for (const TileConfig& t : kBandedTileTable) {
    if (t.head_dim == kHeadDim) return t;
  }
  return TileConfig{0, 0, 0, 0, 0, 0};
}
template <int kHeadDim>
constexpr TileConfig DecodeTileFor() {
  for (const TileConfig& t : kDecodeTileTable) {
    if (t.head_dim == kHeadDim) return t;
  }
  return TileConfig{0, 0, 0, 0, 0, 0};
}

template <int kHeadDim, typename T, bool kIsBanded, int kKind>
cudaError_t RunAttnFwdTile(const FwdLaunch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile =
      kKind == 1   ? DecodeTileFor<kHeadDim>()
      : kKind == 2 ? BandedTileFor<kHeadDim>()
                   : TileFor<kHeadDim>();
  static_assert(kTile.head_dim == kHeadDim, "head dim missing from the tile table");
  auto kernel =
      AttnFwdKernel<kHeadDim, kTile.block_m, kTile.block_n, kTile.num_warps, kTile.stages, T, kIsBanded>;
  constexpr int kSmem = SmemBytes(kTile);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int64_t blocks_x = int64_t{launch.num_m_blocks} * launch.p.batch * launch.num_splits;
  const int heads = launch.pack_gqa > 1 ? launch.p.num_heads_kv : launch.p.num_heads_q;
  if (blocks_x == 0) return cudaSuccess;
  if (blocks_x > 0x7fffffff || heads > 65535) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(blocks_x), heads), kTile.num_warps * 32, kSmem, stream>>>(launch);
  return cudaGetLastError();
}

template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnFwd(const FwdLaunch& launch, cudaStream_t stream) {
  if constexpr (DecodeTileFor<kHeadDim>().head_dim == kHeadDim) {
    if (launch.tile_kind == 1) return RunAttnFwdTile<kHeadDim, T, kIsBanded, 1>(launch, stream);
  }
  if constexpr (kIsBanded && BandedTileFor<kHeadDim>().head_dim == kHeadDim) {
    if (launch.tile_kind == 2) return RunAttnFwdTile<kHeadDim, T, kIsBanded, 2>(launch, stream);
  }
  if (launch.tile_kind != 0) return cudaErrorInvalidValue;
  if constexpr (kIsBanded && BandedTileFor<kHeadDim>().head_dim == kHeadDim) {
    return cudaErrorInvalidValue;  // PlanForward gives banded requests tile_kind 2
  } else {
    return RunAttnFwdTile<kHeadDim, T, kIsBanded, 0>(launch, stream);
  }
}

}  // namespace cuda
}  // namespace attnserve
