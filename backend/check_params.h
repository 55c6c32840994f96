// CheckParams: the contract's invariants (docs/design.md §2) on a filled AttnParams.
// Every backend's CanImplement starts here, so a kernel never sees params that
// break them; the server validates the wire request first and names wire
// fields, this is the last line of defence and names AttnParams fields.
#pragma once

#include "absl/status/status.h"
#include "backend/params.h"

namespace attnserve {

// Head dims when V's differs from Q's and K's (MLA; params.h head_dim_v).
// Dqk up to 576: the absorbed decode form's 512 latent + 64 rope dims. Dv up
// to 512: the latent width, the largest value head in use; O's accumulator
// (a CPU task's scratch, a GPU tile's registers) grows with Dv, so the bound
// keeps it fixed. Equal dims keep the [8, 256] every backend builds for.
inline constexpr int kMaxMlaHeadDimQk = 576;
inline constexpr int kMaxMlaHeadDimV = 512;

// head_dim and head_dim_v alone (CheckParams runs it): both multiples of 8;
// equal (head_dim_v 0 or head_dim) in [8, 256], else head_dim in [8, 576]
// and head_dim_v in [8, 512].
absl::Status CheckHeadDims(const AttnParams& p);

// For a backend whose kernels need Dv == D: UNIMPLEMENTED naming head_dim_v
// when V's head dim differs (the message starts with `backend`), else OK.
absl::Status RefuseDistinctHeadDimV(const AttnParams& p, const char* backend);

// OK, or INVALID_ARGUMENT naming the field, the expected and the actual value.
// Checks: dtype known; q/k/v_descale finite and in (0, kMaxDescale] for
// FP8_E4M3 and exactly 1 for any other dtype; batch >= 0; heads > 0 and Hq % Hkv == 0; head dims as
// CheckHeadDims says; sequence lengths >= 0; softmax_scale finite and
// positive; softcap finite and >= 0; windows >= -1 and window_right == 0 when
// causal (FillParams normalises it so kernels test only the window bounds);
// varlen cu_seqlens start at 0, never decrease, end at total, and no sequence
// is longer than seqlen_q/k; dense total == B * S; data pointers non-null when
// there is anything to read or write. Score modifiers and masks: ALiBi slopes
// and sinks finite; bias_dtype FP32/FP16/BF16; varlen bias, mask and block
// mask per sequence (per_batch set); total_pairs the sum of sq_b * sk_b when a
// bias or mask is set; block_q/block_k positive multiples of kBlockMaskGrain
// (both 0, with null CSR arrays, for none); block_row_ptr from 0 and
// non-decreasing; each row's block_col_idx strictly increasing and below its
// sequence's key blocks. Reads these arrays, so they must be host memory here
// (every backend's CanImplement takes host params).
absl::Status CheckParams(const AttnParams& p);

}  // namespace attnserve
