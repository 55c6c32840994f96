// Device side of the append into a cache's pages (paged_attn.cu for 16-bit
// and MLA caches, paged_attn_fp8.cu for FP8 ones): where a new K/V row goes.
#pragma once

#include <cstdint>

#include "backend/paged_kv.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {

// A token's place in its sequence's pages.
struct PageSlot {
  int32_t page;  // page id (PageSlab, PageRowOffset)
  int token;     // token within the page
};

// New row r (of attn.total_k, varlen over attn.cu_seqlens_k) of sequence b
// goes to token seqlens_k[b] - new_b + (r - cu_seqlens_k[b]) of b's pages.
__device__ __forceinline__ PageSlot AppendSlot(const PagedAttnParams& p, int64_t r) {
  const AttnParams& a = p.attn;
  // The sequence of row r: the last b with cu_seqlens_k[b] <= r.
  int lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.cu_seqlens_k[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int b = lo;
  const int new_b = a.cu_seqlens_k[b + 1] - a.cu_seqlens_k[b];
  const int t = p.seqlens_k[b] - new_b + static_cast<int>(r - a.cu_seqlens_k[b]);
  return {p.block_table[int64_t{b} * p.block_table_stride + (t >> p.pages.page_shift)],
          t & (p.pages.page_size - 1)};
}

}  // namespace cuda
}  // namespace attnserve
