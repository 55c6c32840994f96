// K/V that live on the server (DESIGN §6, docs/kv-cache.md): where a cache's
// pages are, and the one plain struct that carries an append-and-attend call
// from the server's K/V pool to a kernel. POD and nvcc-safe, like params.h.
//
// A cache's memory is a set of slabs, each holding a power of two of pages,
// allocated on demand as the cache grows (its capacity is a maximum, not a
// reservation) and never moved. A page holds `page_size` consecutive tokens of
// one (sequence, layer): K rows [page_size, Hkv, D] in the K slab and the same
// rows of V at the same place in the V slab. Page ids are dense per cache:
// page p lives in slab p >> slab_shift at index p & (pages_per_slab - 1).
// Kernels resolve a page through `k_slabs`/`v_slabs` (a tiny table, read
// through the constant/L1 path) instead of one contiguous arena, so a cache
// grows without a reservation and without moving live pages.
#pragma once

#include <cstdint>

#include "backend/params.h"

namespace attnserve {

// Most slabs one cache may have: the slab size is chosen at creation as
// capacity / kMaxKvSlabs rounded up to a power of two pages, so a cache grows
// in steps of at most ~1/32 of its capacity.
constexpr int kMaxKvSlabs = 32;
// Page sizes the contract allows (tokens per page): powers of two in [16, 256].
constexpr int kMinPageSize = 16;
constexpr int kMaxPageSize = 256;

// Where one cache's pages are. Pointers are in the backend's memory (device
// memory for CUDA, host memory for the CPU backend).
struct KvPages {
  void* k_slabs[kMaxKvSlabs];  // nullptr past num_slabs
  void* v_slabs[kMaxKvSlabs];
  int32_t num_slabs;
  int32_t slab_shift;  // log2(pages per slab)
  int32_t page_size;   // tokens per page: a power of two in [16, 256]
  int32_t page_shift;  // log2(page_size)
};

// Row (token position) within its slab of token t of page p: a slab is
// pages_per_slab x page_size rows of [Hkv, D].
ATTN_HOST_DEVICE int64_t PageSlabRow(const KvPages& kv, int32_t page, int32_t token_in_page) {
  const int64_t in_slab = page & ((int32_t{1} << kv.slab_shift) - 1);
  return in_slab * kv.page_size + token_in_page;
}
// Element offset, within its slab, of (token t of page p, kv head h, 0).
ATTN_HOST_DEVICE int64_t PageRowOffset(const KvPages& kv, int32_t page, int32_t token_in_page,
                                       int32_t num_heads_kv, int32_t head_dim, int32_t head) {
  return (PageSlabRow(kv, page, token_in_page) * num_heads_kv + head) * head_dim;
}
ATTN_HOST_DEVICE int32_t PageSlab(const KvPages& kv, int32_t page) { return page >> kv.slab_shift; }

// One append-and-attend launch over `attn.batch` sequences of one cache layer:
//  1. page copies: for i < num_page_copies, copy page copy_src[i] to
//     copy_dst[i] (copy-on-write of a shared partial last page, done before
//     anything is appended);
//  2. append: sequence b's new rows, attn.k/attn.v rows
//     [attn.cu_seqlens_k[b], attn.cu_seqlens_k[b+1]) (varlen [Tnew, Hkv, D];
//     attn.total_k = Tnew), are written to token positions
//     [seqlens_k[b] - new_b, seqlens_k[b]) through sequence b's block table;
//  3. attend: q rows [attn.cu_seqlens_q[b], attn.cu_seqlens_q[b+1]) (varlen,
//     possibly empty) attend over all seqlens_k[b] tokens of sequence b, read
//     through its block table, with attn's options; causal is bottom-right
//     against seqlens_k[b], so new tokens see the prefix and the causal part
//     of themselves. attn.seqlen_k is the largest seqlens_k[b].
// attn.cu_seqlens_q and attn.cu_seqlens_k are always set (the layout is
// varlen), attn.seqlen_q is the largest new-query count.
struct PagedAttnParams {
  AttnParams attn;
  KvPages pages;
  const int32_t* block_table;  // [attn.batch, block_table_stride] page ids, in token order
  int32_t block_table_stride;  // >= max over b of ceil(seqlens_k[b] / page_size)
  const int32_t* seqlens_k;    // [attn.batch]: tokens of sequence b after the append
  const int32_t* copy_src;     // [num_page_copies]
  const int32_t* copy_dst;
  int32_t num_page_copies;
};

}  // namespace attnserve
