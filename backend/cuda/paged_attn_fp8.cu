// FP8 K/V caches on CUDA (paged_kv.h, paged_attn.h): the page copies and the
// append (quantising FP16/BF16 rows on the device, or copying given codes and
// scales), and the portable attention kernel over E4M3 pages.
//
// The decode kernel (paged_attn_fp8_decode.cuh) serves decode steps and
// short query runs at D 64 and 128 (PlanPagedFp8, paged_attn_fp8.h); the rest
// runs on the portable SIMT kernel below.
//
// The SIMT kernel streams the pages once per (sequence,
// query row, kv head): a CTA of four warps computes up to 8 query heads of
// one kv head (GQA: every K/V byte read once for all of them). Each
// warp takes 32-key chunks in turn; in a chunk each lane scores its own key
// (its K row's codes decoded to fp32, dotted with the heads' queries held in
// shared memory, times the row's scale), the warp updates its online softmax,
// then walks the chunk's keys with each lane accumulating its columns of P x
// (scale x V codes). The four warps' states merge through shared memory. The
// scales multiply fp32 scores and weights, never a rounded product, so the
// kernel is as accurate over the dequantised cache as a 16-bit kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/kv_append.cuh"
#include "backend/cuda/kv_quantize.cuh"
#include "backend/cuda/paged_attn.h"
#include "backend/cuda/paged_attn_fp8.h"
#include "backend/cuda/paged_attn_fp8_decode.cuh"

namespace attnserve {
namespace cuda {
namespace {

constexpr int kFp8Warps = 4;

// Page copies of an FP8 cache: CTA (x, i, kv) copies its share of page
// copy_src[i]'s codes and then its scales to copy_dst[i], 16 bytes a step
// (a page's codes are page_size * Hkv * D >= 128 bytes, its scales
// page_size * Hkv * 4 >= 64).
__global__ void CopyFp8PagesKernel(const __grid_constant__ KvPages pages, const int32_t* copy_src,
                                   const int32_t* copy_dst, int64_t code_vecs, int64_t scale_vecs,
                                   int num_heads_kv, int head_dim) {
  const int i = blockIdx.y;
  void* const* slabs = blockIdx.z == 0 ? pages.k_slabs : pages.v_slabs;
  const int32_t from = copy_src[i];
  const int32_t to = copy_dst[i];
  const char* src = static_cast<const char*>(slabs[PageSlab(pages, from)]);
  char* dst = static_cast<char*>(slabs[PageSlab(pages, to)]);
  const uint4* src_codes = reinterpret_cast<const uint4*>(
      src + PageRowOffset(pages, from, 0, num_heads_kv, head_dim, 0));
  uint4* dst_codes =
      reinterpret_cast<uint4*>(dst + PageRowOffset(pages, to, 0, num_heads_kv, head_dim, 0));
  const uint4* src_scales = reinterpret_cast<const uint4*>(
      src + PageScaleOffset(pages, from, 0, num_heads_kv, head_dim, 0));
  uint4* dst_scales =
      reinterpret_cast<uint4*>(dst + PageScaleOffset(pages, to, 0, num_heads_kv, head_dim, 0));
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < code_vecs + scale_vecs;
       v += int64_t{gridDim.x} * blockDim.x) {
    if (v < code_vecs)
      dst_codes[v] = src_codes[v];
    else
      dst_scales[v - code_vecs] = src_scales[v - code_vecs];
  }
}

// Append into an FP8 cache: one warp per (new row r, kv head h), K then V,
// at r's AppendSlot.
// Given scales: the codes (8 bytes a lane-step) and the scale as sent;
// otherwise the row of T values quantised (QuantiseRowWarp).
template <typename T>
__global__ void AppendFp8RowsKernel(const __grid_constant__ PagedAttnParams p) {
  const AttnParams& a = p.attn;
  const int hkv = a.num_heads_kv;
  const int d = a.head_dim;
  const int lane = threadIdx.x % 32;
  const int64_t warps = a.total_k * hkv;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t w = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; w < warps; w += stride) {
    const int64_t r = w / hkv;
    const int h = static_cast<int>(w % hkv);
    const PageSlot at = AppendSlot(p, r);
    const int slab = PageSlab(p.pages, at.page);
    const int64_t code_off = PageRowOffset(p.pages, at.page, at.token, hkv, d, h);
    const int64_t scale_off = PageScaleOffset(p.pages, at.page, at.token, hkv, d, h);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      char* base = static_cast<char*>(kv ? p.pages.v_slabs[slab] : p.pages.k_slabs[slab]);
      uint8_t* codes = reinterpret_cast<uint8_t*>(base + code_off);
      float* scale = reinterpret_cast<float*>(base + scale_off);
      const int64_t src_row = (r * hkv + h) * d;
      if (p.k_new_scale != nullptr) {
        const uint2* src =
            reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(kv ? a.v : a.k) + src_row);
        for (int c = lane; c < d / 8; c += 32) reinterpret_cast<uint2*>(codes)[c] = src[c];
        if (lane == 0) *scale = (kv ? p.v_new_scale : p.k_new_scale)[r * hkv + h];
      } else {
        const T* src = static_cast<const T*>(kv ? a.v : a.k) + src_row;
        const float s = QuantiseRowWarp<T>(src, d, codes, lane);
        if (lane == 0) *scale = s;
      }
    }
  }
}

// The V columns one lane holds: kE consecutive codes, loaded in one access.
template <int kE>
struct VWord;
template <>
struct VWord<2> {
  using Type = uint16_t;
};
template <>
struct VWord<4> {
  using Type = uint32_t;
};
template <>
struct VWord<8> {
  using Type = uint2;
};
__device__ __forceinline__ void DecodeV(uint16_t w, float* x) {
  const float2 a = Fp8DecodePair(w);
  x[0] = a.x;
  x[1] = a.y;
}
__device__ __forceinline__ void DecodeV(uint32_t w, float* x) {
  DecodeV(static_cast<uint16_t>(w & 0xffffu), x);
  DecodeV(static_cast<uint16_t>(w >> 16), x + 2);
}
__device__ __forceinline__ void DecodeV(uint2 w, float* x) {
  DecodeV(w.x, x);
  DecodeV(w.y, x + 4);
}

// CTA (x = kv head x head group, y = query row i, z = sequence b): query
// heads [h0, h0 + nh) of kv head `kv_head`, kHeads >= nh of them unrolled.
// kDPad: head_dim rounded up to 64, 128 or 256.
template <typename T, int kDPad, int kHeads>
__global__ void __launch_bounds__(kFp8Warps * 32)
    PagedFp8AttnKernel(const __grid_constant__ PagedFwdLaunch L) {
  constexpr int kE = kDPad / 32;
  using VW = typename VWord<kE>::Type;
  const AttnParams& p = L.fwd.p;
  const PagedKv& kv = L.kv;
  const int b = blockIdx.z;
  const int i = blockIdx.y;
  const int sq = SeqLenQ(p, b);
  if (i >= sq) return;
  const int group_size = p.num_heads_q / p.num_heads_kv;
  const int groups = (group_size + kHeads - 1) / kHeads;
  const int kv_head = blockIdx.x / groups;
  const int h0 = kv_head * group_size + (blockIdx.x % groups) * kHeads;
  const int nh = min(kHeads, (kv_head + 1) * group_size - h0);
  const int sk = kv.seqlens_k[b];
  const int d = p.head_dim;
  const int hkv = p.num_heads_kv;
  const int64_t q_row = SeqStartQ(p, b) + i;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  __shared__ __align__(16) float s_q[kHeads][kDPad];  // read as float4
  __shared__ float s_m[kFp8Warps][kHeads];
  __shared__ float s_l[kFp8Warps][kHeads];
  __shared__ float s_o[kFp8Warps][kHeads][kDPad];
  for (int idx = tid; idx < kHeads * kDPad; idx += kFp8Warps * 32) {
    const int g = idx / kDPad;
    const int c = idx % kDPad;
    s_q[g][c] = g < nh && c < d
                    ? KvToFloat<T>(static_cast<const T*>(p.q)[QOffset(p, q_row, h0 + g) + c])
                    : 0.0f;
  }
  __syncthreads();

  int lo, hi;
  VisibleKeys(p, i, sq, sk, &lo, &hi);
  const int32_t* table = kv.block_table + int64_t{b} * kv.block_table_stride;
  float m[kHeads], l[kHeads], acc[kHeads][kE];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.0f;
  }
  float slope[kHeads];
#pragma unroll
  for (int g = 0; g < kHeads; ++g)
    slope[g] = p.alibi_slopes != nullptr && g < nh ? p.alibi_slopes[h0 + g] : 0.0f;
  const bool full_row = d == kDPad;

  for (int j0 = lo + warp * 32; j0 <= hi; j0 += kFp8Warps * 32) {
    const int j = j0 + lane;
    const bool valid = j <= hi;
    const int n_valid = min(32, hi - j0 + 1);
    // This lane's key: where its rows are, its scores.
    const uint8_t* v_row = nullptr;
    float v_scale = 0.0f;
    float s[kHeads];
#pragma unroll
    for (int g = 0; g < kHeads; ++g) s[g] = 0.0f;
    if (valid) {
      const int32_t page = __ldg(table + (j >> kv.pages.page_shift));
      const int slab = PageSlab(kv.pages, page);
      const int t = j & (kv.pages.page_size - 1);
      const int64_t code_off = PageRowOffset(kv.pages, page, t, hkv, d, kv_head);
      const int64_t scale_off = PageScaleOffset(kv.pages, page, t, hkv, d, kv_head);
      const char* k_slab = static_cast<const char*>(kv.pages.k_slabs[slab]);
      const char* v_slab = static_cast<const char*>(kv.pages.v_slabs[slab]);
      const uint2* k_row = reinterpret_cast<const uint2*>(k_slab + code_off);
      v_row = reinterpret_cast<const uint8_t*>(v_slab + code_off);
      const float k_scale = __ldg(reinterpret_cast<const float*>(k_slab + scale_off));
      v_scale = __ldg(reinterpret_cast<const float*>(v_slab + scale_off));
#pragma unroll
      for (int c = 0; c < kDPad / 8; ++c) {
        if (c * 8 >= d) break;
        const uint2 w = __ldg(k_row + c);
        float x[8];
        DecodeV(w, x);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&s_q[g][c * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&s_q[g][c * 8 + 4]);
          s[g] = fmaf(qa.x, x[0], s[g]);
          s[g] = fmaf(qa.y, x[1], s[g]);
          s[g] = fmaf(qa.z, x[2], s[g]);
          s[g] = fmaf(qa.w, x[3], s[g]);
          s[g] = fmaf(qb.x, x[4], s[g]);
          s[g] = fmaf(qb.y, x[5], s[g]);
          s[g] = fmaf(qb.z, x[6], s[g]);
          s[g] = fmaf(qb.w, x[7], s[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float sc = s[g] * k_scale * p.softmax_scale;
        if (p.softcap > 0.0f) sc = p.softcap * tanhf(sc / p.softcap);
        if (p.alibi_slopes != nullptr) sc += AlibiBias(slope[g], i, j, sq, sk);
        s[g] = sc * kLog2e;
      }
    }
    // Online softmax over the chunk (log2 domain); invalid lanes weigh 0.
    float pw[kHeads];
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      float mx = valid ? s[g] : -INFINITY;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[g], mx);
      const float alpha = exp2f(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      pw[g] = valid ? exp2f(s[g] - m_new) : 0.0f;
      l[g] = l[g] * alpha + pw[g];
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[g][e] *= alpha;
      m[g] = m_new;
    }
    // O += P (scale x V): the chunk's valid keys one by one, each lane its
    // kE columns; the V words are loaded first so the loads overlap.
    VW words[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(v_row), k));
      if (k < n_valid && full_row) {
        words[k] = __ldg(reinterpret_cast<const VW*>(row) + lane);
      } else if (k < n_valid) {
        uint8_t bytes[sizeof(VW)];
#pragma unroll
        for (int e = 0; e < kE; ++e) bytes[e] = lane * kE + e < d ? row[lane * kE + e] : 0;
        memcpy(&words[k], bytes, sizeof(VW));
      } else {
        memset(&words[k], 0, sizeof(VW));
      }
    }
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      if (k >= n_valid) break;
      const float vs = __shfl_sync(0xffffffffu, v_scale, k);
      float x[kE];
      DecodeV(words[k], x);
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float w = __shfl_sync(0xffffffffu, pw[g], k) * vs;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[g][e] = fmaf(w, x[e], acc[g][e]);
      }
    }
  }

  // Merge the four warps' states, then normalise (with the sink's share).
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    float sum = l[g];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = sum;
    }
#pragma unroll
    for (int e = 0; e < kE; ++e) s_o[warp][g][lane * kE + e] = acc[g][e];
  }
  __syncthreads();
  for (int idx = tid; idx < nh * kDPad; idx += kFp8Warps * 32) {
    const int g = idx / kDPad;
    const int c = idx % kDPad;
    if (c >= d) continue;
    float mm = -INFINITY;
    for (int w = 0; w < kFp8Warps; ++w) mm = fmaxf(mm, s_m[w][g]);
    const float sink = p.sinks != nullptr ? p.sinks[h0 + g] * kLog2e : -INFINITY;
    mm = fmaxf(mm, sink);
    float total = 0.0f, o = 0.0f;
    if (mm != -INFINITY) {
      for (int w = 0; w < kFp8Warps; ++w) {
        const float f = exp2f(s_m[w][g] - mm);
        total += s_l[w][g] * f;
        o += s_o[w][g][c] * f;
      }
      if (p.sinks != nullptr) total += exp2f(sink - mm);
    }
    const float out = total > 0.0f ? o / total : 0.0f;
    static_cast<T*>(p.o)[QOffset(p, q_row, h0 + g) + c] = static_cast<T>(out);
    if (c == 0 && p.lse != nullptr) {
      p.lse[LseOffset(p, b, h0 + g, i)] = total > 0.0f ? (mm + log2f(total)) / kLog2e : -INFINITY;
    }
  }
}

template <typename T, int kDPad>
cudaError_t LaunchFp8Heads(const PagedFwdLaunch& l, dim3 grid_base, int group_size,
                           cudaStream_t stream) {
  // Heads per CTA: 1 (MHA), 4 (groups of 2 to 4) or 8; fewer instantiations
  // keep the build short, a group of 2 computes two idle heads.
  auto launch = [&](auto heads) {
    constexpr int kHeads = decltype(heads)::value;
    const int groups = (group_size + kHeads - 1) / kHeads;
    const dim3 grid(grid_base.x * groups, grid_base.y, grid_base.z);
    PagedFp8AttnKernel<T, kDPad, kHeads><<<grid, kFp8Warps * 32, 0, stream>>>(l);
    return cudaGetLastError();
  };
  if (group_size <= 1) return launch(std::integral_constant<int, 1>());
  if (group_size <= 4) return launch(std::integral_constant<int, 4>());
  return launch(std::integral_constant<int, 8>());
}

template <typename T>
cudaError_t LaunchFp8(const PagedFwdLaunch& l, cudaStream_t stream) {
  const AttnParams& p = l.fwd.p;
  const dim3 grid(p.num_heads_kv, p.seqlen_q, p.batch);
  const int group = p.num_heads_q / p.num_heads_kv;
  if (p.head_dim <= 64) return LaunchFp8Heads<T, 64>(l, grid, group, stream);
  if (p.head_dim <= 128) return LaunchFp8Heads<T, 128>(l, grid, group, stream);
  return LaunchFp8Heads<T, 256>(l, grid, group, stream);
}

// kAhead: the steps a warp's loads run ahead of its math; negative: the
// production choice (the shared-memory ring where the head dim has one, else
// Fp8DecodeAhead's register loads).
template <typename T, int kD, int kAhead = -1>
cudaError_t LaunchDecode(const PagedDecodeLaunch& l, cudaStream_t stream) {
  const AttnParams& p = l.p;
  const int rows = p.seqlen_q * (p.num_heads_q / p.num_heads_kv);
  const dim3 grid(l.num_splits, p.num_heads_kv, p.batch);
  constexpr int kStages = kAhead < 0 ? Fp8DecodeRingStages(kD) : 0;
  if constexpr (kStages > 0) {
    constexpr int kSmem = fp8_decode::kWarps * kStages * fp8_decode::kRingStageBytes;
    auto kernel = rows <= 8 ? fp8_decode::PagedFp8DecodeKernel<T, kD, 1, 0, kStages>
                            : fp8_decode::PagedFp8DecodeKernel<T, kD, 2, 0, kStages>;
    // Per launch: the attribute belongs to the current device's context.
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    kernel<<<grid, fp8_decode::kThreads, kSmem, stream>>>(l);
  } else if (rows <= 8) {
    constexpr int kA = kAhead >= 0 ? kAhead : Fp8DecodeAhead(kD, 1);
    fp8_decode::PagedFp8DecodeKernel<T, kD, 1, kA><<<grid, fp8_decode::kThreads, 0, stream>>>(l);
  } else {
    constexpr int kA = kAhead >= 0 ? kAhead : Fp8DecodeAhead(kD, 2);
    fp8_decode::PagedFp8DecodeKernel<T, kD, 2, kA><<<grid, fp8_decode::kThreads, 0, stream>>>(l);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || l.part_o == nullptr) return err;
  return LaunchDecodeCombine<T, kD>(l, stream);
}

// The decode launch of `dev` in `num_splits` splits (MakeDecodeLaunch), its
// grids' bounds checked.
cudaError_t CheckedDecodeLaunch(const PagedAttnParams& dev, int num_splits, void* workspace,
                                PagedDecodeLaunch* l) {
  const AttnParams& p = dev.attn;
  if (p.batch > 65535 || p.num_heads_kv > 65535 || p.num_heads_q > 65535 ||
      p.total_q > 0x7fffffff || num_splits < 1 || num_splits > kMaxSplits) {
    return cudaErrorInvalidConfiguration;
  }
  if (workspace == nullptr && num_splits > 1) return cudaErrorInvalidValue;
  *l = MakeDecodeLaunch(dev, num_splits, workspace, p.head_dim);
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchPagedForwardFp8(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                                  cudaStream_t stream) {
  if (plan.kernel_head_dim == 0) return LaunchPagedForwardFp8(dev, stream);
  const AttnParams& p = dev.attn;
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  if (plan.kernel_head_dim != p.head_dim || !Fp8DecodeCovers(p)) return cudaErrorInvalidValue;
  if (plan.workspace_bytes > 0 &&
      (workspace == nullptr || plan.workspace_bytes < SplitWorkspaceBytes(p, plan.num_splits))) {
    return cudaErrorInvalidValue;
  }
  PagedDecodeLaunch l;
  const cudaError_t err =
      CheckedDecodeLaunch(dev, plan.num_splits, plan.workspace_bytes > 0 ? workspace : nullptr, &l);
  if (err != cudaSuccess) return err;
  const bool bf16 = p.dtype == DType::kBF16;
  if (p.head_dim == 64) {
    return bf16 ? LaunchDecode<__nv_bfloat16, 64>(l, stream) : LaunchDecode<__half, 64>(l, stream);
  }
  return bf16 ? LaunchDecode<__nv_bfloat16, 128>(l, stream) : LaunchDecode<__half, 128>(l, stream);
}

cudaError_t LaunchPagedFp8DecodeAblation(const PagedAttnParams& dev, int num_splits, int variant,
                                         void* workspace, cudaStream_t stream) {
  const AttnParams& p = dev.attn;
  if (p.dtype != DType::kBF16 || p.head_dim != 128 ||
      p.seqlen_q * (p.num_heads_q / p.num_heads_kv) > 8 || variant < 0 || variant > 3) {
    return cudaErrorInvalidValue;
  }
  PagedDecodeLaunch l;
  cudaError_t err = CheckedDecodeLaunch(dev, num_splits, num_splits > 1 ? workspace : nullptr, &l);
  if (err != cudaSuccess) return err;
  const dim3 grid(l.num_splits, p.num_heads_kv, p.batch);
  auto ring = [&](auto stages) {
    constexpr int kStages = decltype(stages)::value;
    constexpr int kSmem = fp8_decode::kWarps * kStages * fp8_decode::kRingStageBytes;
    auto kernel = fp8_decode::PagedFp8DecodeKernel<__nv_bfloat16, 128, 1, 0, kStages>;
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    kernel<<<grid, fp8_decode::kThreads, kSmem, stream>>>(l);
    return cudaSuccess;
  };
  if (variant == 3) {
    err = ring(std::integral_constant<int, 4>());
    if (err != cudaSuccess) return err;
  } else {
    auto kernel = variant == 0   ? fp8_decode::PagedFp8DecodeKernel<__nv_bfloat16, 128, 1, 0>
                  : variant == 1 ? fp8_decode::PagedFp8DecodeKernel<__nv_bfloat16, 128, 1, 1>
                                 : fp8_decode::PagedFp8DecodeKernel<__nv_bfloat16, 128, 1, 2>;
    kernel<<<grid, fp8_decode::kThreads, 0, stream>>>(l);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess || l.part_o == nullptr) return err;
  return LaunchDecodeCombine<__nv_bfloat16, 128>(l, stream);
}

cudaError_t LaunchKvAppendFp8(const PagedAttnParams& dev, cudaStream_t stream) {
  const AttnParams& a = dev.attn;
  if (dev.num_page_copies > 0) {
    if (dev.num_page_copies > 65535) return cudaErrorInvalidConfiguration;
    const int64_t rows = int64_t{dev.pages.page_size} * a.num_heads_kv;
    const int64_t code_vecs = rows * a.head_dim / 16;
    const int64_t scale_vecs = rows * 4 / 16;
    const unsigned x =
        static_cast<unsigned>(std::min<int64_t>((code_vecs + scale_vecs + 255) / 256, 64));
    CopyFp8PagesKernel<<<dim3(x, dev.num_page_copies, 2), 256, 0, stream>>>(
        dev.pages, dev.copy_src, dev.copy_dst, code_vecs, scale_vecs, a.num_heads_kv, a.head_dim);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (a.total_k > 0 && a.batch > 0) {
    const int64_t warps = a.total_k * a.num_heads_kv;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((warps + 7) / 8, 4096));
    if (a.dtype == DType::kBF16) {
      AppendFp8RowsKernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(dev);
    } else {
      AppendFp8RowsKernel<__half><<<blocks, 256, 0, stream>>>(dev);
    }
    return cudaGetLastError();
  }
  return cudaSuccess;
}

cudaError_t LaunchPagedForwardFp8(const PagedAttnParams& dev, cudaStream_t stream) {
  const AttnParams& p = dev.attn;
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  if (p.seqlen_q > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  PagedFwdLaunch l{};
  l.fwd.p = p;
  l.kv = PagedKvOf(dev);
  if (p.dtype == DType::kBF16) return LaunchFp8<__nv_bfloat16>(l, stream);
  if (p.dtype == DType::kFP16) return LaunchFp8<__half>(l, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace attnserve
