// Packing append-and-attend calls for the same cache and layer into one paged
// launch (PagedAttnParams, paged_kv.h), the K/V twin of ragged_batch.h: q and
// the new K/V rows concatenated, cu_seqlens rebuilt, block tables restrided to
// the widest, seqlens_k and page copies concatenated; O and LSE scattered back.
// Calls of one cache and layer share one KvPages, so their page ids mean the
// same pages. Packing writes into buffers the caller provides (a device
// backend's pinned staging memory).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/paged_kv.h"
#include "common/host_copy.h"

namespace attnserve {

// True when `a` and `b` can run in one paged launch: the same pages (cache),
// dtype, heads, head dim, options, per-head score modifiers (ALiBi slopes and
// sinks equal value for value, or both absent; the launch reads member 0's)
// and whether LSE is wanted, and the new rows' form (FP8 codes with scales,
// or values to quantise or copy). Block tables of
// different calls of one cache and layer never name the same page for writing
// (the pool gives each sequence its own last page), so their appends do not
// race; two calls on the same sequence and layer are never packed together
// (the executor keeps them in arrival order, in separate launches).
bool CanSharePagedLaunch(const PagedAttnParams& a, const PagedAttnParams& b);

// Where the packed launch's host-built inputs and outputs live.
struct PagedBuffers {
  void* q = nullptr;      // [Tq, Hq, D]
  void* k_new = nullptr;  // [Tnew, Hkv, D]
  void* v_new = nullptr;
  float* k_scale = nullptr;  // [Tnew, Hkv] when the members give FP8 rows' scales
  float* v_scale = nullptr;
  void* o = nullptr;                // [Tq, Hq, Dv]
  float* lse = nullptr;             // [Hq, Tq] when the members want LSE
  int32_t* cu_seqlens_q = nullptr;  // [B+1]
  int32_t* cu_seqlens_k = nullptr;  // [B+1], of the new rows
  int32_t* block_table = nullptr;   // [B, block_table_stride()]
  int32_t* seqlens_k = nullptr;     // [B]
  int32_t* copy_src = nullptr;      // [num_page_copies()]
  int32_t* copy_dst = nullptr;
};

class PagedBatch {
 public:
  // Members' pointers are host memory except .pages; they must outlive the batch.
  explicit PagedBatch(std::vector<const PagedAttnParams*> members);

  int size() const { return static_cast<int>(members_.size()); }
  const std::vector<const PagedAttnParams*>& members() const { return members_; }
  bool wants_lse() const { return members_.front()->attn.lse != nullptr; }

  int32_t batch() const { return batch_; }  // sequences over all members
  int64_t total_q() const { return total_q_; }
  int64_t total_new() const { return total_new_; }
  int32_t block_table_stride() const { return block_table_stride_; }
  int32_t num_page_copies() const { return num_page_copies_; }
  // Bytes of each buffer of PagedBuffers, in its order.
  int64_t q_bytes() const;
  int64_t o_bytes() const;       // q's unless Dv != D
  int64_t kv_new_bytes() const;  // k_new's (and v_new's when Dv == D)
  int64_t v_new_bytes() const;   // v_new's: rows of Dv, 0 with pages.v_in_k
  // The members give FP8 codes with scales (PagedAttnParams::k_new_scale).
  bool has_new_scales() const;
  int64_t kv_scale_bytes() const;  // each of k_scale and v_scale (0 without)
  int64_t lse_bytes() const;
  int64_t cu_seqlens_bytes() const;  // each
  int64_t block_table_bytes() const;
  int64_t seqlens_bytes() const;
  int64_t copies_bytes() const;  // each of copy_src and copy_dst

  // Copies the members' inputs into `buffers` (bulk copies through `run`) and
  // returns the launch's params pointing at `buffers` (pages from member 0).
  PagedAttnParams Gather(const PagedBuffers& buffers, const CopyRunner& run = CopyRunner()) const;
  // Copies each member's rows of O and its LSE ([Hq, Tq_member]) back.
  void Scatter(const void* o, const float* lse, const CopyRunner& run = CopyRunner()) const;

 private:
  std::vector<const PagedAttnParams*> members_;
  int32_t batch_ = 0;
  int64_t total_q_ = 0;
  int64_t total_new_ = 0;
  int32_t block_table_stride_ = 0;
  int32_t num_page_copies_ = 0;
};

}  // namespace attnserve
