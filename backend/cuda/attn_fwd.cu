// Host side of the CUDA forward path: launches the instantiation a Plan
// (attn_fwd_plan.h) chose and, for a split launch that does not combine in
// the kernel itself (prefill tiles; attn_fwd_kernel.cuh's FinishSplit
// combines decode tiles), the exact combine kernel. Also the FP32 path (a
// SIMT kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_fp32.cuh"
#include "backend/cuda/generated/kernel_dispatch.h"
#include "backend/cuda/kv_rows.cuh"
#include "backend/cuda/split_combine.cuh"

namespace attnserve {
namespace cuda {
namespace {

// Combine kernel (split launches of the prefill tiles, and decode with
// --combine=separate in attn_bench): one 256-thread CTA per (query row,
// head), running the same exact combine as the decode kernels' last split
// CTA (CombineSplitRows) over that one row: warp 0 computes the LSE and the
// split weights, then the threads split the row's 4-float chunks x the
// splits (8 threads per chunk at D = 128), so each thread has only a few
// independent 16-byte loads in its chain (one warp per row looping over
// every split was latency bound: 100 us at B=1 decode).
constexpr int kCombineThreads = 256;
constexpr int kCombineSmemFloats = 4 * kCombineThreads + kMaxSplits;  // a float4 per thread, a weight per split
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) CombineSplitsKernel(const FwdLaunch L) {
  __shared__ float4 smem[kCombineSmemFloats / 4];
  const AttnParams& p = L.p;
  const int64_t idx = blockIdx.x;  // = h * total_q + row, the partials' order
  const int h = static_cast<int>(idx / p.total_q);
  const int64_t row = idx % p.total_q;
  // Varlen LSE is [Hq, Tq]: LseOffset(b = 0, i = global row) is that index,
  // since cu_seqlens_q[0] = 0. Dense: split the row into (b, i).
  const int b = IsVarlen(p) ? 0 : static_cast<int>(row / p.seqlen_q);
  const int i = IsVarlen(p) ? static_cast<int>(row) : static_cast<int>(row % p.seqlen_q);
  // Row m = i of a one-head, unpacked query run that starts at row - i.
  const detail::QueryRows qr{1, h, row - i};
  detail::CombineSplitRows<T, 1, kCombineThreads>(L, qr, b, i, i + 1, reinterpret_cast<float*>(smem),
                                                  kCombineSmemFloats, threadIdx.x);
}

// FP32: one warp per (query row, head), attn_fwd_fp32.cuh's row loop over
// the request's own K/V tensors.
__global__ void __launch_bounds__(128) AttnFwdFp32Kernel(const FwdLaunch L) {
  const int i = blockIdx.x * 4 + threadIdx.x / 32;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  if (i >= SeqLenQ(L.p, b)) return;
  AttendRowFp32(L.p, b, h, i, ContiguousRows<float>::SeqLen(L, b),
                ContiguousRows<float>(L, b, KVHead(L.p, h)));
}

}  // namespace

FwdLaunch MakeFwdLaunch(const AttnParams& dev, const Plan& plan, void* workspace) {
  FwdLaunch l;
  l.p = dev;
  l.num_splits = plan.num_splits;
  l.pack_gqa = plan.pack_gqa;
  const TileConfig tile = TileFor(plan.tile_kind, plan.kernel_head_dim);
  l.num_m_blocks =
      static_cast<int>((int64_t{dev.seqlen_q} * plan.pack_gqa + tile.block_m - 1) / tile.block_m);
  const int64_t partial_rows = int64_t{plan.num_splits} * dev.num_heads_q * dev.total_q;
  const bool split = plan.num_splits > 1;
  l.split_tickets = split ? static_cast<int*>(workspace) : nullptr;
  l.o_accum = split ? reinterpret_cast<float*>(static_cast<char*>(workspace) + kSplitCounterBytes)
                    : nullptr;
  l.lse_accum = split ? l.o_accum + partial_rows * dev.head_dim : nullptr;
  // Only the decode tile's kernels fuse the combine (attn_fwd_kernel.cuh).
  l.fused_combine = split && plan.fused_combine && plan.tile_kind == TileKind::kDecode;
  l.scale_log2 = dev.softmax_scale * kLog2e;
  l.softcap_in = dev.softcap > 0.f ? dev.softmax_scale / dev.softcap : 0.f;
  l.softcap_out = dev.softcap * kLog2e;
  l.tile_kind = plan.tile_kind;
  return l;
}

cudaError_t ClearSplitCounters(void* workspace, cudaStream_t stream) {
  return cudaMemsetAsync(workspace, 0, kSplitCounterBytes, stream);
}

cudaError_t LaunchCombine(const FwdLaunch& l, cudaStream_t stream) {
  if (l.num_splits == 1 || l.fused_combine) return cudaSuccess;
  const AttnParams& dev = l.p;
  const unsigned blocks = static_cast<unsigned>(int64_t{dev.num_heads_q} * dev.total_q);
  if (dev.dtype == DType::kFP16) {
    CombineSplitsKernel<__half><<<blocks, kCombineThreads, 0, stream>>>(l);
  } else {
    CombineSplitsKernel<__nv_bfloat16><<<blocks, kCombineThreads, 0, stream>>>(l);
  }
  return cudaGetLastError();
}

cudaError_t LaunchForward(const AttnParams& dev, const Plan& plan, void* workspace,
                          cudaStream_t stream) {
  if (dev.total_q == 0 || dev.batch == 0) return cudaSuccess;
  const FwdLaunch l = MakeFwdLaunch(dev, plan, workspace);
  const cudaError_t err = RunForPlan(plan, dev.dtype, l, stream);
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
