// Host-visible interface of the paged CUDA path (K/V in a cache's pages,
// paged_kv.h): the launch struct the paged kernels read, the append and page
// copy launch, and the paged attention launches (FP16/BF16 through the one
// fused kernel body of attn_fwd_kernel.cuh with the paged row source; FP32
// through a SIMT kernel). nvcc-safe and free of Abseil, like attn_fwd.h.
//
// The decode interface the Hopper path builds on is LaunchPagedForward: a
// PagedAttnParams with DEVICE pointers (q/o/lse, block_table, seqlens_k,
// cu_seqlens_q), a Plan from PlanForward(params.attn, num_sms) and its
// workspace; K/V rows are found as kv_rows.cuh's PagedRows says.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/paged_kv.h"

namespace attnserve {
namespace cuda {

// Where the paged kernels find sequence b's K/V rows (device pointers):
// row j of kv head h is in page block_table[b * block_table_stride +
// (j >> pages.page_shift)], at PageRowOffset(pages, page, j & (page_size - 1),
// Hkv, D, h) of slab PageSlab(pages, page); the sequence has seqlens_k[b] rows.
struct PagedKv {
  KvPages pages;
  const int32_t* block_table;
  int32_t block_table_stride;
  const int32_t* seqlens_k;
};

// Everything a paged forward kernel reads: the contiguous launch (its p.k,
// p.v and p.cu_seqlens_k are not read) plus the block tables.
struct PagedFwdLaunch {
  FwdLaunch fwd;
  PagedKv kv;
};

// Page copies (copy-on-write), then the scatter of the new K/V rows
// (dev.attn.k/v, varlen over dev.attn.cu_seqlens_k) to their token positions
// [seqlens_k[b] - new_b, seqlens_k[b]) through the block tables; two kernels
// on `stream` (the copies must finish before any row is written), none when
// there is nothing to do. `dev` holds device pointers.
cudaError_t LaunchKvAppend(const PagedAttnParams& dev, cudaStream_t stream);

// Attention of dev.attn.q over the sequences' pages, FP16/BF16: the kernel as
// `plan` = PlanForward(dev.attn, ...) says (decode splits combine in it; the
// prefill tiles' in the combine kernel). `workspace` has plan.workspace_bytes,
// its split counters zero (ClearSplitCounters once per allocation).
cudaError_t LaunchPagedForward(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                               cudaStream_t stream);

// FP32: one warp per (query row, head), fp32 throughout (the contract's 1e-5).
cudaError_t LaunchPagedForwardFp32(const PagedAttnParams& dev, cudaStream_t stream);

// FP8 caches (dev.pages.fp8_e4m3; paged_attn_fp8.cu): the page copies with
// their scales, then the append (quantising FP16/BF16 rows, or copying codes
// and k/v_new_scale as given), on `stream`.
cudaError_t LaunchKvAppendFp8(const PagedAttnParams& dev, cudaStream_t stream);
// Attention of FP16/BF16 q over an FP8 cache's pages (codes x scale), the
// portable SIMT kernel; any head dim of the contract.
cudaError_t LaunchPagedForwardFp8(const PagedAttnParams& dev, cudaStream_t stream);

// Per-instantiation launcher of the paged kernel (RunAttnFwd's overload for
// the paged launch), defined in attn_fwd_kernel.cuh and instantiated in the
// generated paged_attn_fwd_*.cu files (generate_kernels.py).
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnFwd(const PagedFwdLaunch& launch, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
