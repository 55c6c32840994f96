// Host side of the CUDA forward path: picks the instantiation for a request,
// plans split-KV and GQA packing, launches the fused kernel and, when split,
// the exact combine kernel. Also the FP32 path (a SIMT kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_fp32.cuh"
#include "backend/cuda/kv_rows.cuh"

namespace attnserve {
namespace cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Which head dims this build compiled (ATTNSERVE_CUDA_KERNELS, see
// backend/cuda/CMakeLists.txt); all of them unless told otherwise.
constexpr bool CompiledHeadDim(int d) {
#if defined(ATTNSERVE_CUDA_DEV_KERNELS)
  return d == 128;
#else
  return d == 64 || d == 96 || d == 128 || d == 192 || d == 256;
#endif
}

// Combine: one 256-thread CTA per (query row, head). LSE = log sum_s
// exp(lse_s); O = sum_s exp(lse_s - LSE) * O_s: exact up to fp32 rounding; a
// row whose splits are all empty gets O = 0, LSE = -inf. Threads are laid out
// as (split group) x (4-float chunk of D) so each thread has only
// num_splits / groups independent 16-byte loads in its chain (the first
// version, one warp per row looping over every split, was latency bound:
// 100 us at B=1 decode).
constexpr int kCombineThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) CombineSplitsKernel(const AttnParams p, int num_splits,
                                                                      const float* o_accum, const float* lse_accum) {
  __shared__ float weight[128];
  __shared__ float4 part[kCombineThreads];
  __shared__ float lse_row;
  const int64_t idx = blockIdx.x;  // = h * total_q + row, the partials' order
  const int h = static_cast<int>(idx / p.total_q);
  const int64_t row = idx % p.total_q;
  const int64_t stride = int64_t{p.num_heads_q} * p.total_q;  // between splits
  const int tid = threadIdx.x;
  if (tid < 32) {
    float mx = -INFINITY;
    for (int s = tid; s < num_splits; s += 32) mx = fmaxf(mx, lse_accum[s * stride + idx]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      if (l != -INFINITY) sum += expf(l - mx);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);
    for (int s = tid; s < num_splits; s += 32) {
      const float l = lse_accum[s * stride + idx];
      weight[s] = l == -INFINITY ? 0.f : expf(l - lse);
    }
    if (tid == 0) lse_row = lse;
  }
  __syncthreads();
  // D <= 256 is at most 64 float4 chunks, so one pass covers the row.
  const int chunks = p.head_dim / 4;
  const int groups = kCombineThreads / chunks;
  const int c = tid % chunks;
  const int g = tid / chunks;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (g < groups) {
    for (int s = g; s < num_splits; s += groups) {
      const float w = weight[s];
      if (w == 0.f) continue;
      const float4 x = *reinterpret_cast<const float4*>(o_accum + (s * stride + idx) * p.head_dim + 4 * c);
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
  }
  part[tid] = acc;
  __syncthreads();
  if (g == 0) {
    for (int gg = 1; gg < groups; ++gg) {
      const float4 x = part[gg * chunks + c];
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    T* out = static_cast<T*>(p.o) + QOffset(p, row, h) + 4 * c;
    out[0] = T(acc.x);
    out[1] = T(acc.y);
    out[2] = T(acc.z);
    out[3] = T(acc.w);
  }
  if (tid == 0 && p.lse != nullptr) {
    // Varlen LSE is [Hq, Tq]: LseOffset(b = 0, i = global row) is that index,
    // since cu_seqlens_q[0] = 0. Dense: split the row into (b, i).
    const int b = IsVarlen(p) ? 0 : static_cast<int>(row / p.seqlen_q);
    const int i = IsVarlen(p) ? static_cast<int>(row) : static_cast<int>(row % p.seqlen_q);
    p.lse[LseOffset(p, b, h, i)] = lse_row;
  }
}

// FP32: one warp per (query row, head), attn_fwd_fp32.cuh's row loop over
// the request's own K/V tensors.
__global__ void __launch_bounds__(128) AttnFwdFp32Kernel(const FwdLaunch L) {
  const int i = blockIdx.x * 4 + threadIdx.x / 32;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  if (i >= SeqLenQ(L.p, b)) return;
  AttendRowFp32(L.p, b, h, i, ContiguousRows<float>::SeqLen(L, b), ContiguousRows<float>(L, b, KVHead(L.p, h)));
}

template <typename T, bool kIsCausal>
cudaError_t RunForHeadDim(int d, const FwdLaunch& l, cudaStream_t s) {
  switch (d) {
#if !defined(ATTNSERVE_CUDA_DEV_KERNELS)
    case 64: return RunAttnFwd<64, T, kIsCausal>(l, s);
    case 96: return RunAttnFwd<96, T, kIsCausal>(l, s);
    case 192: return RunAttnFwd<192, T, kIsCausal>(l, s);
    case 256: return RunAttnFwd<256, T, kIsCausal>(l, s);
#endif
    case 128: return RunAttnFwd<128, T, kIsCausal>(l, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool HaveKernels(int kernel_head_dim) { return CompiledHeadDim(kernel_head_dim); }

// Split-KV heuristic. A CTA per (m block, head, batch) is "base"; when base
// fills less than one wave of resident CTAs (num_sms x CTAs per SM, the latter
// estimated from the tile's threads at ~255 registers each and its shared
// memory), split the key range so base x splits fills exactly one wave:
// a second, partial wave would cost as much as a full one. At least 2 key
// tiles per split (a split's fixed cost, Q load + epilogue + combine traffic,
// stays small against its tiles) and at most 128 splits.
// Worked example, decode on an H100 (132 SMs), B=1, Hq=32, Hkv=8, Sq=1, Sk=8192,
// D=128 (tile 128x64, 128 threads x 255 regs -> 2 CTAs/SM -> a wave is 264):
// packing the 4 query heads of a KV head into M gives 1 m block x 8 KV heads
// = 8 CTAs; 264 / 8 = 33 splits; 8192 / 64 = 128 key tiles -> 4 tiles per
// split -> 32 splits (128/4) of 256 keys: 256 CTAs, one wave, each streaming
// 128 KB of K+V. B=16: base 128 -> 2 splits of 64 tiles (256 CTAs);
// B=8, Sk=64k: base 64 -> 4 splits; B=64: base 512 >= 264 -> no split.
LaunchPlan PlanForward(const AttnParams& p, int num_sms) {
  LaunchPlan plan;
  for (const TileConfig& t : kTileTable) {
    if (t.head_dim >= p.head_dim && CompiledHeadDim(t.head_dim)) {
      plan.kernel_head_dim = t.head_dim;
      plan.tile = t;
      break;
    }
  }
  if (plan.kernel_head_dim == 0) return plan;
  // Same test as LaunchForward's choice of the banded instantiation.
  if (p.window_left >= 0 || p.window_right >= 0) {
    for (const TileConfig& t : kCausalTileTable) {
      if (t.head_dim == plan.kernel_head_dim) {
        plan.tile = t;
        plan.tile_kind = 2;
      }
    }
  }
  const int group = p.num_heads_q / std::max(p.num_heads_kv, 1);
  // Pack GQA heads into M for short query runs (decode, speculative steps):
  // otherwise each query head's CTA would stream the same K/V for 1..16 rows.
  plan.pack_gqa = (group > 1 && p.seqlen_q <= 16) ? group : 1;
  const int64_t rows = int64_t{p.seqlen_q} * plan.pack_gqa;
  if (rows <= kDecodeMaxRows) {
    for (const TileConfig& t : kDecodeTileTable) {
      if (t.head_dim == plan.kernel_head_dim) {
        plan.tile = t;
        plan.tile_kind = 1;
      }
    }
  }
  const int64_t m_blocks = (rows + plan.tile.block_m - 1) / plan.tile.block_m;
  const int64_t heads = plan.pack_gqa > 1 ? p.num_heads_kv : p.num_heads_q;
  const int64_t base = m_blocks * heads * p.batch;
  const int64_t n_blocks = (int64_t{p.seqlen_k} + plan.tile.block_n - 1) / plan.tile.block_n;
  const int threads = plan.tile.num_warps * 32;
  const int64_t ctas_per_sm =
      std::max(1, std::min(65536 / (plan.tile.regs * threads), (227 * 1024) / (SmemBytes(plan.tile) + 1024)));
  const int64_t wave = int64_t{num_sms} * ctas_per_sm;
  if (plan.tile_kind == 1 && base > 0 && n_blocks >= 4) {
    // Decode: the fewest splits whose CTAs fill >= 90% of the waves they
    // take (B=1: 8 CTAs -> 45 splits of a 396-CTA wave; B=64, Sk=4k: 512 CTAs
    // are 1.29 waves -> 3 splits, 1536 CTAs = 3.9 waves), else the fullest;
    // splits of at least 2 tiles, at most 128.
    const int64_t max_splits = std::min<int64_t>(n_blocks / 2, 128);
    int64_t best = 1;
    double best_eff = 0.0;
    for (int64_t s = 1; s <= max_splits; ++s) {
      const int64_t ctas = base * s;
      const double eff = static_cast<double>(ctas) / (static_cast<double>((ctas + wave - 1) / wave) * wave);
      if (eff > best_eff + 1e-9) {
        best = s;
        best_eff = eff;
      }
      if (eff >= 0.9) break;
    }
    const int64_t per = (n_blocks + best - 1) / best;
    plan.num_splits = static_cast<int>(std::max<int64_t>((n_blocks + per - 1) / per, 1));
  } else if (base > 0 && base * 2 <= wave && n_blocks >= 4) {
    int64_t splits = wave / base;
    splits = std::min<int64_t>({splits, n_blocks / 2, 128});
    // Equalise: with per = ceil(n_blocks / splits) tiles each, fewer splits may do.
    const int64_t per = (n_blocks + splits - 1) / splits;
    splits = (n_blocks + per - 1) / per;
    plan.num_splits = static_cast<int>(std::max<int64_t>(splits, 1));
  }
  if (plan.num_splits > 1) {
    const int64_t partial_rows = int64_t{plan.num_splits} * p.num_heads_q * p.total_q;
    plan.workspace_bytes = partial_rows * (int64_t{p.head_dim} + 1) * 4;
  }
  return plan;
}

FwdLaunch MakeFwdLaunch(const AttnParams& dev, const LaunchPlan& plan, void* workspace) {
  FwdLaunch l;
  l.p = dev;
  l.num_splits = plan.num_splits;
  l.pack_gqa = plan.pack_gqa;
  l.num_m_blocks = static_cast<int>((int64_t{dev.seqlen_q} * plan.pack_gqa + plan.tile.block_m - 1) /
                                    plan.tile.block_m);
  const int64_t partial_rows = int64_t{plan.num_splits} * dev.num_heads_q * dev.total_q;
  l.o_accum = static_cast<float*>(workspace);
  l.lse_accum = plan.num_splits > 1 ? l.o_accum + partial_rows * dev.head_dim : nullptr;
  l.scale_log2 = dev.softmax_scale * kLog2e;
  l.softcap_in = dev.softcap > 0.f ? dev.softmax_scale / dev.softcap : 0.f;
  l.softcap_out = dev.softcap * kLog2e;
  l.tile_kind = plan.tile_kind;
  return l;
}

cudaError_t LaunchCombine(const FwdLaunch& l, cudaStream_t stream) {
  if (l.num_splits == 1) return cudaSuccess;
  const AttnParams& dev = l.p;
  const unsigned blocks = static_cast<unsigned>(int64_t{dev.num_heads_q} * dev.total_q);
  if (dev.dtype == DType::kFP16) {
    CombineSplitsKernel<__half><<<blocks, kCombineThreads, 0, stream>>>(dev, l.num_splits, l.o_accum, l.lse_accum);
  } else {
    CombineSplitsKernel<__nv_bfloat16><<<blocks, kCombineThreads, 0, stream>>>(dev, l.num_splits, l.o_accum, l.lse_accum);
  }
  return cudaGetLastError();
}

cudaError_t LaunchForward(const AttnParams& dev, const LaunchPlan& plan, void* workspace, cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  const FwdLaunch l = MakeFwdLaunch(dev, plan, workspace);
  const bool banded = dev.window_left >= 0 || dev.window_right >= 0;
  cudaError_t err;
  if (dev.dtype == DType::kFP16) {
    err = banded ? RunForHeadDim<__half, true>(plan.kernel_head_dim, l, stream)
                 : RunForHeadDim<__half, false>(plan.kernel_head_dim, l, stream);
  } else {
    err = banded ? RunForHeadDim<__nv_bfloat16, true>(plan.kernel_head_dim, l, stream)
                 : RunForHeadDim<__nv_bfloat16, false>(plan.kernel_head_dim, l, stream);
  }
  if (err != cudaSuccess) return err;
  return LaunchCombine(l, stream);
}

cudaError_t LaunchForwardFp32(const AttnParams& dev, cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  if (dev.num_heads_q > 65535 || dev.batch > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((dev.seqlen_q + 3) / 4, dev.num_heads_q, dev.batch);
  FwdLaunch l{};
  l.p = dev;
  AttnFwdFp32Kernel<<<grid, 128, 0, stream>>>(l);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
