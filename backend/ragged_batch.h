// Dynamic ragged batching: which requests may share one backend launch, and
// packing them into a single variable-length AttnParams (rows concatenated,
// cu_seqlens built, no padding) and scattering O and LSE back. Dense requests
// join as varlen sequences: [B, S, H, D] is byte-for-byte [B*S, H, D] with
// offsets 0, S, 2S, ..., and bottom-right causal alignment is per sequence in
// both layouts, so packing changes no result.
//
// Packing writes into buffers the caller provides: a device backend packs
// straight into its pinned staging memory, so joining a batch costs no host
// copy beyond the one staging needs anyway.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/params.h"
#include "common/host_copy.h"

namespace attnserve {

// True when `a` and `b` can run in one packed launch: the same dtype, heads,
// head dim and options (scale, softcap, causal, windows, FP8 descales,
// batch_invariant, whether LSE is
// wanted, which is known only once outputs are bound), and the same ALiBi
// slopes and sinks (per head, so a packed launch reads the first member's).
// A call with a bias, element mask or block mask shares with nothing: those
// are laid out over its own sequences; nor does a call with a tensor in
// device memory (TensorDevices), which the backend reads where it lies.
// Sequence lengths and layouts may differ.
// Reads the slopes and sinks, so both calls' mods must be in host memory.
bool CanShareLaunch(const AttnParams& a, const AttnParams& b);

// What a request costs against the batch token budget: Tq + Tk rows.
inline int64_t BatchTokens(const AttnParams& p) { return p.total_q + p.total_k; }

// Where the packed launch's tensors live (sizes from PackedBatch).
struct PackedBuffers {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;             // when the members want LSE
  int32_t* cu_seqlens_q = nullptr;  // when cu_seqlens_bytes() > 0
  int32_t* cu_seqlens_k = nullptr;
};

// One launch over members (one, or several that CanShareLaunch) whose outputs
// are bound. A single member keeps its own layout (dense stays dense); several
// become one varlen call. The members' memory must outlive the PackedBatch.
// Gather packs Q, K and V only: the launch's mods pointers are the first
// member's, in its memory (a device backend stages them itself).
class PackedBatch {
 public:
  explicit PackedBatch(std::vector<const AttnParams*> members);

  int size() const { return static_cast<int>(members_.size()); }
  const std::vector<const AttnParams*>& members() const { return members_; }
  bool wants_lse() const { return members_.front()->lse != nullptr; }

  // Bytes of each packed tensor.
  int64_t q_bytes() const { return total_q_ * q_row_bytes_; }
  int64_t o_bytes() const { return total_q_ * o_row_bytes_; }    // OutputDType (BF16 for FP8)
  int64_t kv_bytes() const { return total_k_ * kv_row_bytes_; }  // K (and V when Dv == D)
  int64_t v_bytes() const { return total_k_ * v_row_bytes_; }    // V: rows of Dv
  int64_t lse_bytes() const;
  int64_t cu_seqlens_bytes() const;  // each of cu_seqlens_q/k; 0 for one dense member

  // Copies the members' Q, K and V rows (and builds cu_seqlens) into
  // `buffers`, and returns the launch's params pointing at `buffers`. The
  // bulk copies go through `run` (serially when it is empty).
  AttnParams Gather(const PackedBuffers& buffers, const CopyRunner& run = CopyRunner()) const;
  // Copies each member's rows of O (through `run`) and its LSE (in its own
  // layout) from the packed outputs to the member's bound o/lse.
  void Scatter(const void* o, const float* lse, const CopyRunner& run = CopyRunner()) const;

 private:
  std::vector<const AttnParams*> members_;
  int64_t q_row_bytes_ = 0;
  int64_t o_row_bytes_ = 0;
  int64_t kv_row_bytes_ = 0;
  int64_t v_row_bytes_ = 0;
  int64_t total_q_ = 0;
  int64_t total_k_ = 0;
  int32_t batch_ = 0;  // sequences over all members
};

// A PackedBatch with its own host buffers, for backends that compute on host
// memory (the CPU backend, tests).
class HostPackedBatch {
 public:
  explicit HostPackedBatch(std::vector<const AttnParams*> members);
  const AttnParams& params() const { return params_; }
  void Scatter() const { packed_.Scatter(o_.get(), lse_.data()); }

 private:
  PackedBatch packed_;
  // Uninitialised on purpose: every byte is written by the gather or the
  // backend, and zero-filling would double the memory traffic of packing.
  std::unique_ptr<char[]> q_, k_, v_, o_;
  std::vector<float> lse_;
  std::vector<int32_t> cu_seqlens_q_, cu_seqlens_k_;
  AttnParams params_{};
};

}  // namespace attnserve
