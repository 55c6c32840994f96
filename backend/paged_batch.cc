// Packing append-and-attend calls of one cache layer into one paged launch;
// see paged_batch.h.
#include "backend/paged_batch.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "backend/ragged_batch.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

int64_t QRowBytes(const AttnParams& p) {
  return int64_t{p.num_heads_q} * p.head_dim * DTypeSize(p.dtype);
}
// O's rows have V's head dim (paged O is attn.dtype: never FP8).
int64_t ORowBytes(const AttnParams& p) {
  return int64_t{p.num_heads_q} * HeadDimV(p) * DTypeSize(p.dtype);
}
// A new K or V row as the call carries it: E4M3 codes when it gives scales
// (FP8 cache), else attn.dtype.
int64_t KvRowBytes(const PagedAttnParams& m) {
  const AttnParams& p = m.attn;
  return int64_t{p.num_heads_kv} * p.head_dim * (m.k_new_scale != nullptr ? 1 : DTypeSize(p.dtype));
}
// A new V row: Dv wide, none at all when V lives in K's pages (v_in_k).
int64_t VRowBytes(const PagedAttnParams& m) {
  const AttnParams& p = m.attn;
  if (m.pages.v_in_k) return 0;
  return int64_t{p.num_heads_kv} * HeadDimV(p) *
         (m.k_new_scale != nullptr ? 1 : DTypeSize(p.dtype));
}

}  // namespace

bool CanSharePagedLaunch(const PagedAttnParams& a, const PagedAttnParams& b) {
  // A cache's first slab never moves, so it names the cache; its page size and
  // slab size are fixed at creation. (num_slabs may differ: the cache grew
  // between the two reservations; Gather takes the member that saw the most.)
  return a.pages.k_slabs[0] == b.pages.k_slabs[0] && a.pages.page_size == b.pages.page_size &&
         a.pages.slab_shift == b.pages.slab_shift &&
         (a.k_new_scale == nullptr) == (b.k_new_scale == nullptr) && CanShareLaunch(a.attn, b.attn);
}

PagedBatch::PagedBatch(std::vector<const PagedAttnParams*> members) : members_(std::move(members)) {
  for (const PagedAttnParams* m : members_) {
    batch_ += m->attn.batch;
    total_q_ += m->attn.total_q;
    total_new_ += m->attn.total_k;
    block_table_stride_ = std::max(block_table_stride_, m->block_table_stride);
    num_page_copies_ += m->num_page_copies;
  }
}

int64_t PagedBatch::q_bytes() const { return total_q_ * QRowBytes(members_.front()->attn); }
int64_t PagedBatch::o_bytes() const { return total_q_ * ORowBytes(members_.front()->attn); }
int64_t PagedBatch::kv_new_bytes() const { return total_new_ * KvRowBytes(*members_.front()); }
int64_t PagedBatch::v_new_bytes() const { return total_new_ * VRowBytes(*members_.front()); }
bool PagedBatch::has_new_scales() const { return members_.front()->k_new_scale != nullptr; }
int64_t PagedBatch::kv_scale_bytes() const {
  return has_new_scales() ? total_new_ * members_.front()->attn.num_heads_kv * 4 : 0;
}
int64_t PagedBatch::lse_bytes() const {
  return wants_lse() ? int64_t{members_.front()->attn.num_heads_q} * total_q_ * 4 : 0;
}
int64_t PagedBatch::cu_seqlens_bytes() const { return (int64_t{batch_} + 1) * 4; }
int64_t PagedBatch::block_table_bytes() const { return int64_t{batch_} * block_table_stride_ * 4; }
int64_t PagedBatch::seqlens_bytes() const { return int64_t{batch_} * 4; }
int64_t PagedBatch::copies_bytes() const { return int64_t{num_page_copies_} * 4; }

PagedAttnParams PagedBatch::Gather(const PagedBuffers& buffers, const CopyRunner& run) const {
  const AttnParams& first = members_.front()->attn;
  const int64_t q_row = QRowBytes(first);
  const int64_t kv_row = KvRowBytes(*members_.front());
  const int64_t v_row = VRowBytes(*members_.front());
  const int64_t scale_row = int64_t{first.num_heads_kv} * 4;
  const bool scales = has_new_scales();
  const bool v_in_k = members_.front()->pages.v_in_k;  // no V rows, no V scales
  char* q = static_cast<char*>(buffers.q);
  char* k = static_cast<char*>(buffers.k_new);
  char* v = static_cast<char*>(buffers.v_new);
  std::vector<HostCopy> copies;
  int64_t q_off = 0, k_off = 0;
  int32_t seq = 0, max_q = 0, max_k = 0, copy = 0;
  const PagedAttnParams* widest = members_.front();
  buffers.cu_seqlens_q[0] = 0;
  buffers.cu_seqlens_k[0] = 0;
  for (const PagedAttnParams* m : members_) {
    const AttnParams& a = m->attn;
    if (m->pages.num_slabs > widest->pages.num_slabs) widest = m;
    copies.push_back({q + q_off * q_row, a.q, size_t(a.total_q * q_row)});
    copies.push_back({k + k_off * kv_row, a.k, size_t(a.total_k * kv_row)});
    if (!v_in_k) copies.push_back({v + k_off * v_row, a.v, size_t(a.total_k * v_row)});
    if (scales && a.total_k > 0) {
      copies.push_back({reinterpret_cast<char*>(buffers.k_scale) + k_off * scale_row,
                        m->k_new_scale, size_t(a.total_k * scale_row)});
      if (!v_in_k) {
        copies.push_back({reinterpret_cast<char*>(buffers.v_scale) + k_off * scale_row,
                          m->v_new_scale, size_t(a.total_k * scale_row)});
      }
    }
    for (int b = 0; b < a.batch; ++b) {
      buffers.cu_seqlens_q[seq + 1] = static_cast<int32_t>(q_off + a.cu_seqlens_q[b + 1]);
      buffers.cu_seqlens_k[seq + 1] = static_cast<int32_t>(k_off + a.cu_seqlens_k[b + 1]);
      buffers.seqlens_k[seq] = m->seqlens_k[b];
      max_q = std::max(max_q, SeqLenQ(a, b));
      max_k = std::max(max_k, m->seqlens_k[b]);
      // Rows of the table past a member's own stride are never read (its
      // sequences' lengths fit its stride); zero them so the table is defined.
      int32_t* row = buffers.block_table + int64_t{seq} * block_table_stride_;
      std::memcpy(row, m->block_table + int64_t{b} * m->block_table_stride,
                  size_t(m->block_table_stride) * 4);
      std::fill(row + m->block_table_stride, row + block_table_stride_, 0);
      ++seq;
    }
    for (int i = 0; i < m->num_page_copies; ++i, ++copy) {
      buffers.copy_src[copy] = m->copy_src[i];
      buffers.copy_dst[copy] = m->copy_dst[i];
    }
    q_off += a.total_q;
    k_off += a.total_k;
  }
  RunCopies(run, copies);
  PagedAttnParams p = *members_.front();
  p.pages = widest->pages;
  p.attn.q = q;
  p.attn.k = k;
  p.attn.v = v_in_k ? k : v;
  p.attn.o = buffers.o;
  p.attn.lse = wants_lse() ? buffers.lse : nullptr;
  p.attn.batch = batch_;
  p.attn.seqlen_q = max_q;
  p.attn.seqlen_k = max_k;
  p.attn.total_q = total_q_;
  p.attn.total_k = total_new_;
  p.attn.cu_seqlens_q = buffers.cu_seqlens_q;
  p.attn.cu_seqlens_k = buffers.cu_seqlens_k;
  p.block_table = buffers.block_table;
  p.block_table_stride = block_table_stride_;
  p.seqlens_k = buffers.seqlens_k;
  p.copy_src = buffers.copy_src;
  p.copy_dst = buffers.copy_dst;
  p.num_page_copies = num_page_copies_;
  p.k_new_scale = scales ? buffers.k_scale : nullptr;
  p.v_new_scale = scales && !v_in_k ? buffers.v_scale : nullptr;
  return p;
}

void PagedBatch::Scatter(const void* o, const float* lse, const CopyRunner& run) const {
  const int64_t q_row = ORowBytes(members_.front()->attn);
  const char* packed_o = static_cast<const char*>(o);
  std::vector<HostCopy> copies;
  int64_t off = 0;
  for (const PagedAttnParams* m : members_) {
    copies.push_back({m->attn.o, packed_o + off * q_row, size_t(m->attn.total_q * q_row)});
    off += m->attn.total_q;
  }
  RunCopies(run, copies);
  if (!wants_lse()) return;
  // Packed LSE is [Hq, Tq_total]; a member's is [Hq, Tq_member].
  off = 0;
  for (const PagedAttnParams* m : members_) {
    const AttnParams& a = m->attn;
    // A member without queries has no LSE rows; when no member has any, the
    // packed LSE is empty (null), and memcpy from null is undefined even for
    // 0 bytes.
    if (a.total_q == 0) continue;
    for (int h = 0; h < a.num_heads_q; ++h) {
      std::memcpy(a.lse + int64_t{h} * a.total_q, lse + int64_t{h} * total_q_ + off,
                  size_t(a.total_q) * 4);
    }
    off += a.total_q;
  }
}

}  // namespace attnserve
