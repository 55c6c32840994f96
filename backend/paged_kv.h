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
//
// FP8 caches (KvPages::fp8_e4m3): rows hold E4M3 codes (1-byte elements at
// the same PageRowOffset), and each slab ends with its pages' scales, FP32
// [pages_per_slab, Hkv, page_size]: an element's value is code x the scale of
// its (token, kv head). One page's scales of one head are contiguous, so a
// kernel reading a tile of a page for one head reads its scales in one run.
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
  // Pages hold E4M3 codes plus scales (above); false: elements of attn.dtype.
  bool fp8_e4m3;
  // V is the first Dv (HeadDimV(attn)) elements of each K row (absorbed MLA:
  // one latent K/V head); v_slabs are unused, null, and pages hold K alone.
  // False: V rows [page_size, Hkv, Dv] at the same place in the V slabs.
  bool v_in_k = false;
};

// The contract's quantisation of one (token, kv head) row of D values:
// scale = max|x| / 448 (a zero row: 1), code = E4M3 of x / scale, rounded to
// nearest even. kFp8ScaleDivisor is E4M3's largest finite value.
constexpr float kFp8ScaleDivisor = 448.0f;
ATTN_HOST_DEVICE float Fp8RowScale(float max_abs) {
  return max_abs > 0.0f ? max_abs / kFp8ScaleDivisor : 1.0f;
}

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
// FP8 caches: byte offset, within its slab, of the scale of (token t of page
// p, kv head h): past the slab's codes, [in-slab page][head][token].
ATTN_HOST_DEVICE int64_t PageScaleOffset(const KvPages& kv, int32_t page, int32_t token_in_page,
                                         int32_t num_heads_kv, int32_t head_dim, int32_t head) {
  const int64_t codes = (int64_t{kv.page_size} * num_heads_kv * head_dim) << kv.slab_shift;
  const int64_t in_slab = page & ((int32_t{1} << kv.slab_shift) - 1);
  return codes + ((in_slab * num_heads_kv + head) * kv.page_size + token_in_page) * 4;
}
// Bytes one page's K (or V) takes in its slab: rows of `dtype`, or for an FP8
// cache 1-byte codes plus a 4-byte scale per (token, kv head). Host only.
inline int64_t KvPageBytes(int32_t page_size, int32_t num_heads_kv, int32_t head_dim, DType dtype,
                           bool fp8_e4m3) {
  const int64_t rows = int64_t{page_size} * num_heads_kv;
  return fp8_e4m3 ? rows * (head_dim + 4) : rows * head_dim * DTypeSize(dtype);
}

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
// varlen), attn.seqlen_q is the largest new-query count. V rows have Dv =
// HeadDimV(attn) elements; with pages.v_in_k the append writes K alone
// (attn.v, v_new_scale unused) and V is read from K's first Dv elements.
// FP8 caches (pages.fp8_e4m3; attn.dtype FP16 or BF16, Q's and O's): the
// append writes codes and scales. With k_new_scale/v_new_scale null, attn.k
// and attn.v are attn.dtype rows and the append quantises them (Fp8RowScale,
// round to nearest even); set, attn.k and attn.v hold E4M3 codes [Tnew, Hkv,
// D] and these their scales [Tnew, Hkv] (finite, > 0), copied as given.
struct PagedAttnParams {
  AttnParams attn;
  KvPages pages;
  const int32_t* block_table;  // [attn.batch, block_table_stride] page ids, in token order
  int32_t block_table_stride;  // >= max over b of ceil(seqlens_k[b] / page_size)
  const int32_t* seqlens_k;    // [attn.batch]: tokens of sequence b after the append
  const int32_t* copy_src;     // [num_page_copies]
  const int32_t* copy_dst;
  int32_t num_page_copies;
  const float* k_new_scale;  // FP8 caches only; see above
  const float* v_new_scale;
};

}  // namespace attnserve
