// Dynamic ragged batching: which requests may share one backend launch, and
// packing them into a single variable-length AttnParams (rows concatenated,
// cu_seqlens built, no padding) and scattering O and LSE back. Dense requests
// join as varlen sequences: [B, S, H, D] is byte-for-byte [B*S, H, D] with
// offsets 0, S, 2S, ..., and bottom-right causal alignment is per sequence in
// both layouts, so packing changes no result.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/params.h"

namespace attnserve {

// True when `a` and `b` can run in one packed launch: the same dtype, heads,
// head dim and options (scale, softcap, causal, windows, whether LSE is
// wanted, which is known only once outputs are bound). Sequence lengths and
// layouts may differ.
bool CanShareLaunch(const AttnParams& a, const AttnParams& b);

// What a request costs against the batch token budget: Tq + Tk rows.
inline int64_t BatchTokens(const AttnParams& p) { return p.total_q + p.total_k; }

// One packed launch built from members whose outputs are already bound.
// Owns the packed buffers; the members' memory must outlive it.
class PackedBatch {
 public:
  explicit PackedBatch(const std::vector<const AttnParams*>& members);

  // The varlen call over all members' sequences, pointing at the packed buffers.
  const AttnParams& params() const { return params_; }
  int size() const { return static_cast<int>(members_.size()); }

  // Copies each member's rows of O (and its LSE, in its own layout) from the
  // packed outputs to the member's bound o/lse.
  void Scatter() const;

 private:
  std::vector<const AttnParams*> members_;
  std::vector<int64_t> q_row_offset_;  // first packed q row of each member
  // Uninitialised on purpose: every byte is written by the gather or the
  // backend, and zero-filling would double the memory traffic of packing.
  std::unique_ptr<char[]> q_, k_, v_, o_;
  std::vector<float> lse_;
  std::vector<int32_t> cu_seqlens_q_, cu_seqlens_k_;
  AttnParams params_{};
};

}  // namespace attnserve
