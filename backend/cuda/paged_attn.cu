// Host side and small kernels of the paged CUDA path (paged_attn.h): the page
// copies and the append of new K/V rows into their pages (K alone for MLA
// caches, paged_mla.h), the paged attention launch (the fused kernel with the
// paged row source, split-KV combined as on the contiguous path), and the
// paged FP32 kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/attn_fwd_fp32.cuh"
#include "backend/cuda/generated/kernel_dispatch.h"
#include "backend/cuda/kv_append.cuh"
#include "backend/cuda/kv_rows.cuh"
#include "backend/cuda/paged_attn.h"
#include "common/dtype.h"

namespace attnserve {
namespace cuda {
namespace {

// Page copies: CTA (x, i, kv) copies its share of page copy_src[i] to
// copy_dst[i] in K (kv = 0) or V (kv = 1; none for MLA caches, whose pages
// hold K alone), 16 bytes per thread per step.
// A page of [page_size, Hkv, D] elements is a multiple of 16 bytes (D is a
// multiple of 8).
__global__ void CopyPagesKernel(const __grid_constant__ KvPages pages, const int32_t* copy_src,
                                const int32_t* copy_dst, int64_t page_vecs, int num_heads_kv,
                                int head_dim, int elem_bytes) {
  const int i = blockIdx.y;
  void* const* slabs = blockIdx.z == 0 ? pages.k_slabs : pages.v_slabs;
  const int32_t from = copy_src[i];
  const int32_t to = copy_dst[i];
  const uint4* src = reinterpret_cast<const uint4*>(
      static_cast<const char*>(slabs[PageSlab(pages, from)]) +
      PageRowOffset(pages, from, 0, num_heads_kv, head_dim, 0) * elem_bytes);
  uint4* dst =
      reinterpret_cast<uint4*>(static_cast<char*>(slabs[PageSlab(pages, to)]) +
                               PageRowOffset(pages, to, 0, num_heads_kv, head_dim, 0) * elem_bytes);
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < page_vecs;
       v += int64_t{gridDim.x} * blockDim.x) {
    dst[v] = src[v];
  }
}

// Append: new row r (of Tnew) goes to its AppendSlot, one thread per 16
// bytes of a row (Hkv x D elements), K and (kWithV) V; MLA caches
// (pages.v_in_k) take K alone.
template <bool kWithV>
__global__ void AppendRowsKernel(const __grid_constant__ PagedAttnParams p, int row_vecs,
                                 int elem_bytes) {
  const int64_t total = p.attn.total_k * row_vecs;
  const int64_t row_elems = int64_t{p.attn.num_heads_kv} * p.attn.head_dim;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / row_vecs;
    const int c = static_cast<int>(idx % row_vecs);
    const PageSlot at = AppendSlot(p, r);
    const int64_t dst =
        PageRowOffset(p.pages, at.page, at.token, p.attn.num_heads_kv, p.attn.head_dim, 0) *
            elem_bytes +
        int64_t{c} * 16;
    const int64_t src = r * row_elems * elem_bytes + int64_t{c} * 16;
    const int slab = PageSlab(p.pages, at.page);
    *reinterpret_cast<uint4*>(static_cast<char*>(p.pages.k_slabs[slab]) + dst) =
        *reinterpret_cast<const uint4*>(static_cast<const char*>(p.attn.k) + src);
    if constexpr (kWithV) {
      *reinterpret_cast<uint4*>(static_cast<char*>(p.pages.v_slabs[slab]) + dst) =
          *reinterpret_cast<const uint4*>(static_cast<const char*>(p.attn.v) + src);
    }
  }
}

// FP32 over pages: one warp per (query row, head).
__global__ void __launch_bounds__(128)
    PagedAttnFwdFp32Kernel(const __grid_constant__ PagedFwdLaunch L) {
  const int i = blockIdx.x * 4 + threadIdx.x / 32;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const AttnParams& p = L.fwd.p;
  if (i >= SeqLenQ(p, b)) return;
  AttendRowFp32(p, b, h, i, PagedRows<float>::SeqLen(L, b), PagedRows<float>(L, b, KVHead(p, h)));
}

PagedFwdLaunch MakePagedLaunch(const PagedAttnParams& dev, const FwdLaunch& fwd) {
  PagedFwdLaunch l;
  l.fwd = fwd;
  l.kv.pages = dev.pages;
  l.kv.block_table = dev.block_table;
  l.kv.block_table_stride = dev.block_table_stride;
  l.kv.seqlens_k = dev.seqlens_k;
  return l;
}

}  // namespace

cudaError_t LaunchKvAppend(const PagedAttnParams& dev, cudaStream_t stream) {
  const int elem_bytes = static_cast<int>(DTypeSize(dev.attn.dtype));
  const int64_t row_bytes = int64_t{dev.attn.num_heads_kv} * dev.attn.head_dim * elem_bytes;
  if (dev.num_page_copies > 0) {
    if (dev.num_page_copies > 65535) return cudaErrorInvalidConfiguration;
    const int64_t page_vecs = row_bytes * dev.pages.page_size / 16;
    const unsigned x = static_cast<unsigned>(std::min<int64_t>((page_vecs + 255) / 256, 64));
    const unsigned kvs = dev.pages.v_in_k ? 1 : 2;
    CopyPagesKernel<<<dim3(x, dev.num_page_copies, kvs), 256, 0, stream>>>(
        dev.pages, dev.copy_src, dev.copy_dst, page_vecs, dev.attn.num_heads_kv, dev.attn.head_dim,
        elem_bytes);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (dev.attn.total_k > 0 && dev.attn.batch > 0) {
    const int row_vecs = static_cast<int>(row_bytes / 16);
    const int64_t total = dev.attn.total_k * row_vecs;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 4096));
    if (dev.pages.v_in_k) {
      AppendRowsKernel<false><<<blocks, 256, 0, stream>>>(dev, row_vecs, elem_bytes);
    } else {
      AppendRowsKernel<true><<<blocks, 256, 0, stream>>>(dev, row_vecs, elem_bytes);
    }
    return cudaGetLastError();
  }
  return cudaSuccess;
}

cudaError_t LaunchPagedForward(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                               cudaStream_t stream) {
  const AttnParams& p = dev.attn;
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  const PagedFwdLaunch l = MakePagedLaunch(dev, MakeFwdLaunch(p, plan, workspace));
  const cudaError_t err = RunForPlan(plan, p.dtype, l, stream);
  if (err != cudaSuccess) return err;
  return LaunchCombine(l.fwd, stream);
}

cudaError_t LaunchPagedForwardFp32(const PagedAttnParams& dev, cudaStream_t stream) {
  const AttnParams& p = dev.attn;
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  if (p.num_heads_q > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  FwdLaunch fwd{};
  fwd.p = p;
  const dim3 grid((p.seqlen_q + 3) / 4, p.num_heads_q, p.batch);
  PagedAttnFwdFp32Kernel<<<grid, 128, 0, stream>>>(MakePagedLaunch(dev, fwd));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
