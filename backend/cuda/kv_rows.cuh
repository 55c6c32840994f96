// Where the attention kernels read K/V rows from: the row-source policies
// (contiguous [.., Hkv, D] tensors, or a cache's pages through a block
// table), so one kernel body serves both. A policy is built per CTA or warp
// for one (sequence b, kv head) and answers "the address of row j of K / V".
#pragma once

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/paged_attn.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {

// K/V rows of sequence b in the request's own tensors (AttnParams k, v).
template <typename T>
struct ContiguousRows {
  using Launch = FwdLaunch;
  static constexpr bool kPaged = false;

  __host__ __device__ __forceinline__ static const FwdLaunch& Fwd(const Launch& l) { return l; }
  __device__ __forceinline__ static int SeqLen(const Launch& l, int b) { return SeqLenK(l.p, b); }

  __device__ __forceinline__ ContiguousRows(const Launch& l, int b, int kv_head)
      : k(static_cast<const T*>(l.p.k) + KVOffset(l.p, SeqStartK(l.p, b), kv_head)),
        v(static_cast<const T*>(l.p.v) + KVOffset(l.p, SeqStartK(l.p, b), kv_head)),
        stride(int64_t{l.p.num_heads_kv} * l.p.head_dim) {}

  // Row j of K (kv = 0) or V (kv = 1), element 0 of this kv head.
  __device__ __forceinline__ const T* Row(int kv, int j) const { return (kv ? v : k) + j * stride; }

  const T* k;
  const T* v;
  int64_t stride;  // elements between consecutive rows
};

// K/V rows of sequence b in a cache's pages. Consecutive rows inside one page
// are `stride` elements apart, as in a contiguous tensor; crossing a page
// boundary needs a new lookup (Row).
template <typename T>
struct PagedRows {
  using Launch = PagedFwdLaunch;
  static constexpr bool kPaged = true;

  __host__ __device__ __forceinline__ static const FwdLaunch& Fwd(const Launch& l) { return l.fwd; }
  __device__ __forceinline__ static int SeqLen(const Launch& l, int b) { return l.kv.seqlens_k[b]; }

  __device__ __forceinline__ PagedRows(const Launch& l, int b, int kv_head)
      : kv(l.kv),
        table(l.kv.block_table + int64_t{b} * l.kv.block_table_stride),
        kv_head(kv_head),
        num_heads_kv(l.fwd.p.num_heads_kv),
        head_dim(l.fwd.p.head_dim),
        stride(int64_t{l.fwd.p.num_heads_kv} * l.fwd.p.head_dim) {}

  // Page slab and element offset of row j (the same for K and V).
  __device__ __forceinline__ int64_t Locate(int j, int* slab) const {
    const int32_t page = __ldg(table + (j >> kv.pages.page_shift));
    *slab = PageSlab(kv.pages, page);
    return PageRowOffset(kv.pages, page, j & (kv.pages.page_size - 1), num_heads_kv, head_dim,
                         kv_head);
  }
  __device__ __forceinline__ const T* At(int kv_which, int slab, int64_t offset) const {
    return static_cast<const T*>(kv_which ? kv.pages.v_slabs[slab] : kv.pages.k_slabs[slab]) +
           offset;
  }
  __device__ __forceinline__ const T* Row(int kv_which, int j) const {
    int slab;
    const int64_t off = Locate(j, &slab);
    return At(kv_which, slab, off);
  }

  const PagedKv& kv;
  const int32_t* table;  // sequence b's block table
  int kv_head;
  int num_heads_kv;
  int head_dim;
  int64_t stride;  // Hkv * D: between consecutive rows of one page
};

}  // namespace cuda
}  // namespace attnserve
