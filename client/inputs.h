// Random attention inputs of a given shape (for attnctl forward, load tests and
// client tests), and the shape facts of an AttentionInputs that the CLI prints
// and the verifier needs.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attnserve {

// Dense when seqlens_q is empty: q [batch, seqlen_q, heads_q, head_dim], k/v
// [batch, seqlen_k, heads_kv, head_dim]. Varlen otherwise: one length per
// sequence in seqlens_q and seqlens_k (same count, zeros allowed); batch and
// seqlen_q/k are then ignored.
struct AttentionShape {
  DType dtype = DType::kFP16;
  int batch = 1;
  int seqlen_q = 128;
  int seqlen_k = 128;
  int heads_q = 8;
  int heads_kv = 8;
  int head_dim = 64;
  int head_dim_v = 0;  // V's (and O's) head dim when it differs (MLA); 0: head_dim
  std::vector<int> seqlens_q;
  std::vector<int> seqlens_k;
};

// A dense shape (no varlen lists): q [batch, seqlen_q, heads_q, head_dim],
// k and v [batch, seqlen_k, heads_kv, head_dim].
AttentionShape DenseAttentionShape(DType dtype, int batch, int seqlen_q, int seqlen_k, int heads_q,
                                   int heads_kv, int head_dim);

// A tensor of `shape` with fresh normal(0, 1) values rounded to the dtype,
// none of magnitude below 1e-3 (zeros hide indexing bugs), drawn from `rng`.
HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64* rng);

// Offsets 0, l0, l0+l1, ... (B+1 entries).
std::vector<int32_t> CuSeqlensFromLengths(const std::vector<int>& lengths);

// Fresh normal(0, 1) values rounded to the dtype, redrawn while their magnitude
// is below 1e-3 so no input is zero (zeros hide indexing bugs). The same seed
// gives the same inputs. Options are left at their defaults. INVALID_ARGUMENT
// for negative sizes, mismatched varlen lists or Hq % Hkv != 0.
absl::StatusOr<AttentionInputs> MakeRandomInputs(const AttentionShape& shape, uint64_t seed);

// The sizes an AttentionInputs describes, derived from its tensors.
struct InputsSummary {
  bool varlen = false;
  int64_t batch = 0;
  int64_t seqlen_q = 0;  // varlen: the longest sequence
  int64_t seqlen_k = 0;
  int64_t total_q = 0;  // rows of q: B*Sq or Tq
  int64_t total_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;  // V's and O's (v's last dim): head_dim except for MLA shapes
  DType dtype = DType::kFP32;

  // "dense B=2 Sq=128 Sk=128 Hq=8 Hkv=2 D=64 BF16" or "varlen B=3 Tq=20 ...";
  // " Dv=128" after D when V's head dim differs.
  std::string ToString() const;
};

// INVALID_ARGUMENT, naming the tensor, when q/k/v do not form a valid dense or
// varlen call (rank, Q/K/V agreement, GQA divisibility, cu_seqlens). Head-dim
// limits are left to the server, which knows what it supports.
absl::StatusOr<InputsSummary> SummarizeInputs(const AttentionInputs& inputs);

}  // namespace attnserve
