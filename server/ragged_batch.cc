// Packing compatible requests into one varlen launch; see ragged_batch.h.
#include "server/ragged_batch.h"

#include <algorithm>
#include <cstring>

#include "backend/dtype.h"

namespace attnserve {

bool CanShareLaunch(const AttnParams& a, const AttnParams& b) {
  return a.dtype == b.dtype && a.num_heads_q == b.num_heads_q &&
         a.num_heads_kv == b.num_heads_kv && a.head_dim == b.head_dim &&
         a.softmax_scale == b.softmax_scale && a.softcap == b.softcap &&
         a.is_causal == b.is_causal && a.window_left == b.window_left &&
         a.window_right == b.window_right && (a.lse != nullptr) == (b.lse != nullptr);
}

PackedBatch::PackedBatch(const std::vector<const AttnParams*>& members) : members_(members) {
  const AttnParams& first = *members.front();
  params_ = first;
  const size_t elem = DTypeSize(first.dtype);
  const size_t q_row = size_t(first.num_heads_q) * first.head_dim * elem;
  const size_t kv_row = size_t(first.num_heads_kv) * first.head_dim * elem;
  int64_t total_q = 0, total_k = 0;
  for (const AttnParams* m : members) {
    total_q += m->total_q;
    total_k += m->total_k;
  }
  q_.reset(new char[total_q * q_row]);
  o_.reset(new char[total_q * q_row]);
  k_.reset(new char[total_k * kv_row]);
  v_.reset(new char[total_k * kv_row]);
  cu_seqlens_q_.assign(1, 0);
  cu_seqlens_k_.assign(1, 0);
  int64_t q_off = 0, k_off = 0;
  int32_t max_q = 0, max_k = 0;
  for (const AttnParams* m : members) {
    q_row_offset_.push_back(q_off);
    if (m->total_q > 0) std::memcpy(q_.get() + q_off * q_row, m->q, m->total_q * q_row);
    if (m->total_k > 0) {
      std::memcpy(k_.get() + k_off * kv_row, m->k, m->total_k * kv_row);
      std::memcpy(v_.get() + k_off * kv_row, m->v, m->total_k * kv_row);
    }
    for (int b = 0; b < m->batch; ++b) {
      cu_seqlens_q_.push_back(static_cast<int32_t>(q_off + SeqStartQ(*m, b) + SeqLenQ(*m, b)));
      cu_seqlens_k_.push_back(static_cast<int32_t>(k_off + SeqStartK(*m, b) + SeqLenK(*m, b)));
      max_q = std::max(max_q, SeqLenQ(*m, b));
      max_k = std::max(max_k, SeqLenK(*m, b));
    }
    q_off += m->total_q;
    k_off += m->total_k;
  }
  if (first.lse != nullptr) lse_.resize(size_t(first.num_heads_q) * total_q);
  params_.q = q_.get();
  params_.k = k_.get();
  params_.v = v_.get();
  params_.o = o_.get();
  params_.lse = first.lse != nullptr ? lse_.data() : nullptr;
  params_.batch = static_cast<int32_t>(cu_seqlens_q_.size() - 1);
  params_.seqlen_q = max_q;
  params_.seqlen_k = max_k;
  params_.total_q = total_q;
  params_.total_k = total_k;
  params_.cu_seqlens_q = cu_seqlens_q_.data();
  params_.cu_seqlens_k = cu_seqlens_k_.data();
}

void PackedBatch::Scatter() const {
  const size_t q_row =
      size_t(params_.num_heads_q) * params_.head_dim * DTypeSize(params_.dtype);
  for (size_t i = 0; i < members_.size(); ++i) {
    const AttnParams& m = *members_[i];
    const int64_t off = q_row_offset_[i];
    if (m.total_q > 0) std::memcpy(m.o, o_.get() + off * q_row, m.total_q * q_row);
    if (m.lse == nullptr) continue;
    // Packed LSE is [Hq, Tq_total]; the member's is its own dense or varlen layout.
    for (int h = 0; h < m.num_heads_q; ++h) {
      for (int b = 0; b < m.batch; ++b) {
        const float* src = lse_.data() + int64_t{h} * params_.total_q + off + SeqStartQ(m, b);
        for (int r = 0; r < SeqLenQ(m, b); ++r) m.lse[LseOffset(m, b, h, r)] = src[r];
      }
    }
  }
}

}  // namespace attnserve
