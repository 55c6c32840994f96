// CheckPagedParams: the invariants of one append-and-attend launch
// (paged_kv.h) that every backend's CanImplementPaged checks before a launch
// may touch its pages, so a bad block table or length can never write outside
// a cache.
#pragma once

#include "absl/status/status.h"
#include "backend/paged_kv.h"

namespace attnserve {

// OK, or INVALID_ARGUMENT naming the field, expected and actual values.
// Checks CheckParams(p.attn) (varlen, cu_seqlens_k over the new rows), the
// page geometry (page_size a power of two in [16, 256] matching page_shift,
// 1 <= num_slabs <= kMaxKvSlabs), every sequence's length after the append
// (>= its new rows, <= block_table_stride * page_size, seqlen_k its maximum)
// and every page id that the launch reads, writes or copies (< the pages of
// num_slabs slabs). Reads the block table rows the lengths cover (host memory).
// UNIMPLEMENTED for score modifiers or masks (params.h's alibi_slopes, sinks,
// bias, mask, block mask): valid, but no paged kernel applies them yet.
absl::Status CheckPagedParams(const PagedAttnParams& p);

}  // namespace attnserve
