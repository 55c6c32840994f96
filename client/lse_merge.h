// The exact merge of partial attention results over disjoint key sets: what a
// client does with the answers of several servers (or caches, or devices) that
// each hold part of a sequence's keys (context parallelism across replicas).
//
// Partial i attended the queries over its keys alone, returning O_i and
// LSE_i = log sum_j exp(s_ij) over its keys (return_lse). Attention over the
// union of the keys is then (the rescaling the FlashAttention paper derives)
//   LSE = log sum_i exp(LSE_i),   O = sum_i exp(LSE_i - LSE) * O_i,
// computed with the largest LSE_i subtracted first so no exp overflows, and
// accumulated in FP32. A partial whose row saw no key (LSE_i = -inf; its O_i
// is 0) contributes nothing, whatever its O_i holds; a row no partial saw a
// key for comes out O = 0, LSE = -inf, as the server answers it.
//
//   auto a = client_a->Forward(inputs_over_keys_a);  // options.return_lse
//   auto b = client_b->Forward(inputs_over_keys_b);
//   absl::StatusOr<MergedAttention> m = MergeAttentionPartials({&*a, &*b});
//
// Masks must be applied per partial so each key is seen under the same rule
// as in the whole: with bottom-right causal and a sequence split at positions
// that all lie before the first query, only the partial holding the last keys
// is causal (bottom-right over its own keys is then the whole sequence's
// rule) and the others are not. Sinks join one partial only (each partial
// with sinks would add the sink's term to the denominator again).
#pragma once

#include <initializer_list>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "client/attention_client.h"
#include "client/host_tensor.h"

namespace attnserve {

struct MergedAttention {
  HostTensor o;    // like each partial's O, in the dtype asked for
  HostTensor lse;  // FP32, like each partial's LSE
};

// Merges partials given as (O, LSE) pairs: O [..., S, H, D] (a Forward's
// dense [B, Sq, Hq, D], or the varlen/K/V layout [T, Hq, D]) in FP16, BF16 or
// FP32 (the partials' dtypes may differ), LSE FP32 [..., H, S] (the same
// leading dimensions; [B, Hq, Sq] or [Hq, T]). `out_dtype` unset: the first
// partial's dtype. INVALID_ARGUMENT naming the partial and the field
// (`partials[1].lse.shape`) for shapes that disagree, a dtype that is not one
// of these, no partials, or an LSE that is NaN or +inf.
absl::StatusOr<MergedAttention> MergeAttentionPartials(absl::Span<const HostTensor* const> outs,
                                                       absl::Span<const HostTensor* const> lses,
                                                       std::optional<DType> out_dtype = {});

// The same over Forward results or K/V results (anything with `o` and an
// optional `lse`): each must carry its LSE (INVALID_ARGUMENT naming the
// partial otherwise: ask with return_lse).
template <typename Result>
absl::StatusOr<MergedAttention> MergeAttentionPartials(absl::Span<const Result* const> results,
                                                       std::optional<DType> out_dtype = {}) {
  std::vector<const HostTensor*> outs, lses;
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i]->lse.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("partials[", i, "].lse: missing (call with return_lse)"));
    }
    outs.push_back(&results[i]->o);
    lses.push_back(&*results[i]->lse);
  }
  return MergeAttentionPartials(outs, lses, out_dtype);
}

inline absl::StatusOr<MergedAttention> MergeAttentionPartials(
    std::initializer_list<const ForwardResult*> results, std::optional<DType> out_dtype = {}) {
  return MergeAttentionPartials<ForwardResult>(
      absl::Span<const ForwardResult* const>(results.begin(), results.size()), out_dtype);
}

}  // namespace attnserve
