// Packing compatible requests into one varlen launch; see ragged_batch.h.
#include "backend/ragged_batch.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/dtype.h"

namespace attnserve {

namespace {

// Per-head values (ALiBi slopes, sinks) that mean the same for both calls:
// both absent, or the same Hq values (a packed launch reads the first's).
bool SamePerHead(const float* a, const float* b, int heads) {
  if (a == nullptr || b == nullptr) return a == b;
  return std::memcmp(a, b, sizeof(float) * static_cast<size_t>(heads)) == 0;
}

}  // namespace

bool CanShareLaunch(const AttnParams& a, const AttnParams& b) {
  // A bias, element mask or block mask is laid out over its own call's
  // sequences; packing would have to rebuild it, so such calls run alone.
  // So do calls with a tensor in device memory: they are read where they lie.
  const bool alone = a.bias != nullptr || a.mask != nullptr || HasBlockMask(a) ||
                     b.bias != nullptr || b.mask != nullptr || HasBlockMask(b) ||
                     HasDeviceTensors(a) || HasDeviceTensors(b);
  return !alone && a.dtype == b.dtype && a.num_heads_q == b.num_heads_q &&
         a.num_heads_kv == b.num_heads_kv && a.head_dim == b.head_dim &&
         HeadDimV(a) == HeadDimV(b) && a.softmax_scale == b.softmax_scale &&
         a.softcap == b.softcap && a.is_causal == b.is_causal && a.window_left == b.window_left &&
         a.window_right == b.window_right && a.q_descale == b.q_descale &&
         a.k_descale == b.k_descale && a.v_descale == b.v_descale &&
         (a.lse != nullptr) == (b.lse != nullptr) &&
         SamePerHead(a.alibi_slopes, b.alibi_slopes, a.num_heads_q) &&
         SamePerHead(a.sinks, b.sinks, a.num_heads_q) && a.batch_invariant == b.batch_invariant;
}

PackedBatch::PackedBatch(std::vector<const AttnParams*> members) : members_(std::move(members)) {
  const AttnParams& first = *members_.front();
  const int64_t elem = DTypeSize(first.dtype);
  q_row_bytes_ = int64_t{first.num_heads_q} * first.head_dim * elem;
  o_row_bytes_ = int64_t{first.num_heads_q} * HeadDimV(first) * DTypeSize(OutputDType(first.dtype));
  kv_row_bytes_ = int64_t{first.num_heads_kv} * first.head_dim * elem;
  v_row_bytes_ = int64_t{first.num_heads_kv} * HeadDimV(first) * elem;
  for (const AttnParams* m : members_) {
    total_q_ += m->total_q;
    total_k_ += m->total_k;
    batch_ += m->batch;
  }
}

int64_t PackedBatch::lse_bytes() const {
  return wants_lse() ? int64_t{members_.front()->num_heads_q} * total_q_ * 4 : 0;
}

int64_t PackedBatch::cu_seqlens_bytes() const {
  if (members_.size() == 1 && !IsVarlen(*members_.front())) return 0;
  return (int64_t{batch_} + 1) * 4;
}

AttnParams PackedBatch::Gather(const PackedBuffers& buffers, const CopyRunner& run) const {
  char* q = static_cast<char*>(buffers.q);
  char* k = static_cast<char*>(buffers.k);
  char* v = static_cast<char*>(buffers.v);
  std::vector<HostCopy> copies;
  if (members_.size() == 1) {
    // Alone, a request keeps its own layout: only the memory changes.
    AttnParams p = *members_.front();
    copies.push_back({q, p.q, size_t(q_bytes())});
    copies.push_back({k, p.k, size_t(kv_bytes())});
    copies.push_back({v, p.v, size_t(v_bytes())});
    RunCopies(run, copies);
    if (IsVarlen(p)) {
      std::memcpy(buffers.cu_seqlens_q, p.cu_seqlens_q, cu_seqlens_bytes());
      std::memcpy(buffers.cu_seqlens_k, p.cu_seqlens_k, cu_seqlens_bytes());
      p.cu_seqlens_q = buffers.cu_seqlens_q;
      p.cu_seqlens_k = buffers.cu_seqlens_k;
    }
    p.q = q;
    p.k = k;
    p.v = v;
    p.o = buffers.o;
    p.lse = p.lse != nullptr ? buffers.lse : nullptr;
    return p;
  }
  int32_t* cu_q = buffers.cu_seqlens_q;
  int32_t* cu_k = buffers.cu_seqlens_k;
  int64_t q_off = 0, k_off = 0;
  int32_t max_q = 0, max_k = 0, seq = 0;
  cu_q[0] = 0;
  cu_k[0] = 0;
  for (const AttnParams* m : members_) {
    copies.push_back({q + q_off * q_row_bytes_, m->q, size_t(m->total_q * q_row_bytes_)});
    copies.push_back({k + k_off * kv_row_bytes_, m->k, size_t(m->total_k * kv_row_bytes_)});
    copies.push_back({v + k_off * v_row_bytes_, m->v, size_t(m->total_k * v_row_bytes_)});
    for (int b = 0; b < m->batch; ++b) {
      ++seq;
      cu_q[seq] = static_cast<int32_t>(q_off + SeqStartQ(*m, b) + SeqLenQ(*m, b));
      cu_k[seq] = static_cast<int32_t>(k_off + SeqStartK(*m, b) + SeqLenK(*m, b));
      max_q = std::max(max_q, SeqLenQ(*m, b));
      max_k = std::max(max_k, SeqLenK(*m, b));
    }
    q_off += m->total_q;
    k_off += m->total_k;
  }
  RunCopies(run, copies);
  AttnParams p = *members_.front();
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = buffers.o;
  p.lse = wants_lse() ? buffers.lse : nullptr;
  p.batch = batch_;
  p.seqlen_q = max_q;
  p.seqlen_k = max_k;
  p.total_q = total_q_;
  p.total_k = total_k_;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  return p;
}

void PackedBatch::Scatter(const void* o, const float* lse, const CopyRunner& run) const {
  const char* packed_o = static_cast<const char*>(o);
  std::vector<HostCopy> copies;
  int64_t off = 0;  // first packed q row of the member
  for (const AttnParams* m : members_) {
    copies.push_back({m->o, packed_o + off * o_row_bytes_, size_t(m->total_q * o_row_bytes_)});
    off += m->total_q;
  }
  RunCopies(run, copies);
  if (members_.size() == 1) {
    const AttnParams& m = *members_.front();
    if (m.lse != nullptr && lse_bytes() > 0) std::memcpy(m.lse, lse, lse_bytes());
    return;
  }
  off = 0;
  for (const AttnParams* mp : members_) {
    const AttnParams& m = *mp;
    if (m.lse != nullptr) {
      // Packed LSE is [Hq, Tq_total]; the member's is its own dense or varlen layout.
      for (int h = 0; h < m.num_heads_q; ++h) {
        for (int b = 0; b < m.batch; ++b) {
          const float* src = lse + int64_t{h} * total_q_ + off + SeqStartQ(m, b);
          for (int r = 0; r < SeqLenQ(m, b); ++r) m.lse[LseOffset(m, b, h, r)] = src[r];
        }
      }
    }
    off += m.total_q;
  }
}

HostPackedBatch::HostPackedBatch(std::vector<const AttnParams*> members)
    : packed_(std::move(members)) {
  q_.reset(new char[packed_.q_bytes()]);
  o_.reset(new char[packed_.o_bytes()]);
  k_.reset(new char[packed_.kv_bytes()]);
  v_.reset(new char[packed_.v_bytes()]);
  lse_.resize(static_cast<size_t>(packed_.lse_bytes() / 4));
  cu_seqlens_q_.resize(static_cast<size_t>(packed_.cu_seqlens_bytes() / 4));
  cu_seqlens_k_.resize(cu_seqlens_q_.size());
  PackedBuffers buffers;
  buffers.q = q_.get();
  buffers.k = k_.get();
  buffers.v = v_.get();
  buffers.o = o_.get();
  buffers.lse = lse_.data();
  buffers.cu_seqlens_q = cu_seqlens_q_.data();
  buffers.cu_seqlens_k = cu_seqlens_k_.data();
  params_ = packed_.Gather(buffers);
}

}  // namespace attnserve
