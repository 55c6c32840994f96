// CheckPagedParams; see check_paged_params.h.
#include "backend/check_paged_params.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "backend/check_params.h"
#include "common/status_macros.h"

namespace attnserve {

absl::Status CheckPagedParams(const PagedAttnParams& p, PagedModSupport supported) {
  const bool alibi = p.attn.alibi_slopes != nullptr && !supported.alibi_slopes;
  const bool sinks = p.attn.sinks != nullptr && !supported.sinks;
  const bool bias = p.attn.bias != nullptr && !supported.element_masks;
  const bool mask = p.attn.mask != nullptr && !supported.element_masks;
  if (alibi || sinks || bias || mask || HasBlockMask(p.attn)) {
    // A call this backend's paged kernels cannot run: a block mask has no
    // paged form (attend_pages is the paged sparsity); the per-head mods and
    // the element masks may lack a kernel.
    return absl::UnimplementedError(absl::StrCat(
        "paged params: ", supported.alibi_slopes ? "" : "alibi_slopes, ",
        supported.sinks ? "" : "sinks, ", supported.element_masks ? "" : "bias, mask, ",
        "the block mask (block_q) expected unset on a paged call (this backend's paged kernels "
        "do not apply them), got",
        alibi ? " alibi_slopes" : "", sinks ? " sinks" : "", bias ? " bias" : "",
        mask ? " mask" : "",
        HasBlockMask(p.attn) ? absl::StrCat(" block_q ", p.attn.block_q) : ""));
  }
  const bool element_masks = p.attn.bias != nullptr || p.attn.mask != nullptr;
  const bool v_in_k = p.pages.v_in_k;
  if ((HeadDimV(p.attn) != p.attn.head_dim || v_in_k) && !supported.mla) {
    return absl::UnimplementedError(absl::StrCat(
        "paged params: head_dim_v expected 0 or head_dim ", p.attn.head_dim,
        " and pages.v_in_k false (this backend's paged kernels need V pages as wide as K's), got "
        "head_dim_v ",
        p.attn.head_dim_v, ", v_in_k ", v_in_k ? "true" : "false"));
  }
  if (v_in_k && HeadDimV(p.attn) > p.attn.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged params: head_dim_v expected <= head_dim ", p.attn.head_dim,
        " with pages.v_in_k (V is the first Dv elements of each K row), got ", HeadDimV(p.attn)));
  }
  {
    // With V in K's pages the call's attn.v is never read.
    AttnParams attn = p.attn;
    if (v_in_k) attn.v = attn.k;
    if (element_masks && attn.cu_seqlens_q != nullptr && attn.cu_seqlens_k != nullptr) {
      // CheckParams counts pairs over the new rows; a paged bias or mask
      // covers each sequence's whole history (checked below, with seqlens_k).
      attn.total_pairs = 0;
      for (int b = 0; b < attn.batch; ++b) {
        attn.total_pairs += int64_t{SeqLenQ(attn, b)} * SeqLenK(attn, b);
      }
    }
    RETURN_IF_ERROR(CheckParams(attn));
  }
  if (p.attn.dtype == DType::kFP8E4M3) {
    // Q and O are never FP8 on a paged call; an FP8 cache says so in its pages.
    return absl::InvalidArgumentError(
        "paged params: attn.dtype expected FP16, BF16 or FP32 (an FP8 cache sets "
        "pages.fp8_e4m3), got FP8_E4M3");
  }
  if (p.pages.fp8_e4m3 && p.attn.dtype == DType::kFP32) {
    return absl::InvalidArgumentError(
        "paged params: attn.dtype expected FP16 or BF16 with an FP8 cache (pages.fp8_e4m3), got "
        "FP32");
  }
  if ((p.k_new_scale != nullptr && !v_in_k) != (p.v_new_scale != nullptr) ||
      (!p.pages.fp8_e4m3 && p.k_new_scale != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged params: k_new_scale and v_new_scale expected both set (FP8 rows, FP8 cache; "
        "k_new_scale alone with pages.v_in_k) or both unset, got k_new_scale ",
        p.k_new_scale != nullptr ? "set" : "unset", ", v_new_scale ",
        p.v_new_scale != nullptr ? "set" : "unset", " on a ",
        p.pages.fp8_e4m3 ? "FP8" : "16/32-bit", " cache"));
  }
  if (p.k_new_scale != nullptr) {
    // Given scales are copied into the pages as they are: a zero, negative
    // or non-finite one would make every later read of its row meaningless.
    const int64_t n = p.attn.total_k * p.attn.num_heads_kv;
    for (int64_t i = 0; i < n; ++i) {
      for (const float* s : {p.k_new_scale, p.v_new_scale}) {
        if (s == nullptr) continue;  // v_in_k: K's scales alone
        if (!(s[i] > 0.0f) || !std::isfinite(s[i])) {
          return absl::InvalidArgumentError(
              absl::StrCat("paged params: ", s == p.k_new_scale ? "k_new_scale" : "v_new_scale",
                           "[", i, "] expected finite and > 0, got ", s[i]));
        }
      }
    }
  }
  if (p.attn.cu_seqlens_q == nullptr || p.attn.cu_seqlens_k == nullptr) {
    return absl::InvalidArgumentError("paged params: cu_seqlens_q and cu_seqlens_k must be set");
  }
  const KvPages& kv = p.pages;
  if (kv.page_size < kMinPageSize || kv.page_size > kMaxPageSize ||
      (kv.page_size & (kv.page_size - 1)) != 0 || (1 << kv.page_shift) != kv.page_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged params: page_size expected a power of two in [", kMinPageSize, ", ", kMaxPageSize,
        "] equal to 1 << page_shift, got page_size ", kv.page_size, " page_shift ", kv.page_shift));
  }
  // No slab at all is a cache that has never held a token (slabs come with
  // the first append): a query-only call on its empty sequences is valid, and
  // with no pages every page id below is refused, so nothing can be touched.
  if (kv.num_slabs < 0 || kv.num_slabs > kMaxKvSlabs || kv.slab_shift < 0 || kv.slab_shift > 24) {
    return absl::InvalidArgumentError(absl::StrCat("paged params: num_slabs expected in [0, ",
                                                   kMaxKvSlabs, "], got ", kv.num_slabs,
                                                   " (slab_shift ", kv.slab_shift, ")"));
  }
  const int64_t num_pages = int64_t{kv.num_slabs} << kv.slab_shift;
  auto check_page = [&](const char* what, int64_t i, int32_t page) -> absl::Status {
    if (page < 0 || page >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("paged params: ", what, "[", i,
                                                     "] expected a page id in [0, ", num_pages,
                                                     "), got ", page));
    }
    return absl::OkStatus();
  };
  if (p.num_page_copies < 0 ||
      (p.num_page_copies > 0 && (p.copy_src == nullptr || p.copy_dst == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged params: num_page_copies ", p.num_page_copies, " without copy lists"));
  }
  for (int i = 0; i < p.num_page_copies; ++i) {
    RETURN_IF_ERROR(check_page("copy_src", i, p.copy_src[i]));
    RETURN_IF_ERROR(check_page("copy_dst", i, p.copy_dst[i]));
  }
  if (p.attn.batch > 0 && (p.seqlens_k == nullptr || p.block_table == nullptr)) {
    return absl::InvalidArgumentError("paged params: seqlens_k and block_table must be set");
  }
  int32_t longest = 0;
  for (int b = 0; b < p.attn.batch; ++b) {
    const int32_t len = p.seqlens_k[b];
    const int32_t added = SeqLenK(p.attn, b);
    if (len < added || int64_t{len} > int64_t{p.block_table_stride} * kv.page_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("paged params: seqlens_k[", b, "] expected in [", added, " (new rows), ",
                       int64_t{p.block_table_stride} * kv.page_size,
                       " (block_table_stride * page_size)], got ", len));
    }
    longest = std::max(longest, len);
    const int32_t pages = (len + kv.page_size - 1) >> kv.page_shift;
    for (int i = 0; i < pages; ++i) {
      RETURN_IF_ERROR(check_page("block_table", int64_t{b} * p.block_table_stride + i,
                                 p.block_table[int64_t{b} * p.block_table_stride + i]));
    }
  }
  if (p.attn.batch > 0 && longest != p.attn.seqlen_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged params: attn.seqlen_k expected the longest seqlens_k ", longest,
                     ", got ", p.attn.seqlen_k));
  }
  if (element_masks) {
    int64_t pairs = 0;
    for (int b = 0; b < p.attn.batch; ++b) pairs += int64_t{SeqLenQ(p.attn, b)} * p.seqlens_k[b];
    if (p.attn.total_pairs != pairs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "paged params: attn.total_pairs expected the sum of seqlen_q * seqlens_k[b] (a paged "
          "bias or mask covers each sequence's whole history) ",
          pairs, ", got ", p.attn.total_pairs));
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve
