// CheckPagedParams: the invariants of one append-and-attend launch
// (paged_kv.h) that every backend's CanImplementPaged checks before a launch
// may touch its pages, so a bad block table or length can never write outside
// a cache.
#pragma once

#include "absl/status/status.h"
#include "backend/paged_kv.h"

namespace attnserve {

// The per-head score modifiers (params.h) a backend's paged kernels apply.
// Defaulted to none so a backend that adds none keeps refusing them.
struct PagedModSupport {
  bool alibi_slopes = false;
  bool sinks = false;
  // MLA geometry: V's head dim differing from K's (attn.head_dim_v) and V
  // read from K's pages (pages.v_in_k).
  bool mla = false;
  // A bias and element mask (attn.bias, attn.mask) over each sequence's whole
  // history: [Hq or 1, total_pairs], sequence b's block [sq_b, seqlens_k[b]].
  bool element_masks = false;
};

// OK, or INVALID_ARGUMENT naming the field, expected and actual values.
// Checks CheckParams(p.attn) (varlen, cu_seqlens_k over the new rows), the
// page geometry (page_size a power of two in [16, 256] matching page_shift,
// 1 <= num_slabs <= kMaxKvSlabs), every sequence's length after the append
// (>= its new rows, <= block_table_stride * page_size, seqlen_k its maximum)
// and every page id that the launch reads, writes or copies (< the pages of
// num_slabs slabs); an FP8 cache (pages.fp8_e4m3) only with FP16/BF16 Q and
// O, and given new-row scales (k_new_scale, v_new_scale: both or neither, FP8
// caches only) finite and > 0. With pages.v_in_k: Dv <= D, no v_new_scale
// (the K row's scale covers V) and attn.v unused (may be null). Reads the
// block table rows the lengths cover and the given scales (host memory).
// UNIMPLEMENTED for a block mask (no paged form; attend_pages is the paged
// sparsity), and for ALiBi slopes, sinks, a bias or an element mask unless
// `supported` says the caller's paged kernels apply them (the default: none,
// so a backend opts in); likewise for Dv != D or pages.v_in_k unless
// `supported.mla`. A paged bias or mask is laid out varlen over each
// sequence's whole history: attn.total_pairs = sum of sq_b x seqlens_k[b].
absl::Status CheckPagedParams(const PagedAttnParams& p,
                              PagedModSupport supported = PagedModSupport());

}  // namespace attnserve
