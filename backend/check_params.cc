// CheckParams: see check_params.h.
#include "backend/check_params.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "backend/score_range.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

template <typename T>
absl::Status Invalid(const char* field, absl::string_view expected, const T& actual) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", actual));
}

// cu_seqlens of one side: B+1 offsets from 0, non-decreasing, last == total,
// no sequence longer than max_len (kernels size per-sequence work by it).
absl::Status CheckCuSeqlens(const char* field, const int32_t* cu, int32_t batch, int64_t total,
                            int32_t max_len) {
  if (cu == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected B+1 offsets (both cu_seqlens set for varlen), got null"));
  }
  if (cu[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[0]: expected 0, got ", cu[0]));
  }
  for (int32_t b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", b + 1, "]: expected >= ", field,
                                                     "[", b, "] = ", cu[b], ", got ", cu[b + 1]));
    }
    if (cu[b + 1] - cu[b] > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": sequence ", b, " has length ", cu[b + 1] - cu[b],
                       ", expected <= the max sequence length ", max_len));
    }
  }
  if (cu[batch] != total) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "[", batch, "]: expected total rows ", total, ", got ", cu[batch]));
  }
  return absl::OkStatus();
}

// FP8: finite and in (0, kMaxDescale]; any other dtype: exactly 1 (no scaling).
absl::Status CheckDescale(const char* field, float descale, DType dtype) {
  if (dtype != DType::kFP8E4M3) {
    if (descale == 1.0f) return absl::OkStatus();
    return Invalid(field, "1 (descales apply to FP8_E4M3 inputs only)", descale);
  }
  if (DescaleInRange(descale)) return absl::OkStatus();
  return Invalid(field, absl::StrCat("finite and in (0, ", kMaxDescale, "] (score_range.h)"),
                 descale);
}

// Per-head values (ALiBi slopes, sinks): finite, when set.
absl::Status CheckPerHead(const char* field, const float* values, int32_t heads) {
  if (values == nullptr) return absl::OkStatus();
  for (int32_t h = 0; h < heads; ++h) {
    if (!std::isfinite(values[h])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", h, "]: expected a finite value, got ", values[h]));
    }
  }
  return absl::OkStatus();
}

// A bias or mask's broadcast flags: varlen has only the per-sequence layout.
absl::Status CheckPairLayout(const AttnParams& p, const char* per_batch_field, bool per_batch) {
  if (IsVarlen(p) && !per_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat(per_batch_field,
                     ": expected true for a varlen call (its [Hq or 1, total_pairs] layout is "
                     "per sequence), got false"));
  }
  return absl::OkStatus();
}

// The block mask: block sizes, CSR row pointers and column indices. Walks the
// rows in storage order ([B or 1, Hq or 1, query blocks] dense, [Hq or 1,
// query blocks of all sequences] varlen) so each row's columns are checked
// against its own sequence's key blocks: O(rows + nnz) host reads.
absl::Status CheckBlockMask(const AttnParams& p) {
  if (!HasBlockMask(p)) {
    if (p.block_q != 0) {
      return Invalid("block_q",
                     absl::StrCat("0 (no block mask) or a positive multiple of kBlockMaskGrain (",
                                  kBlockMaskGrain, ")"),
                     p.block_q);
    }
    if (p.block_k != 0 || p.block_row_ptr != nullptr || p.block_col_idx != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_q: expected a positive multiple of ", kBlockMaskGrain,
          " when block_k or block_row_ptr/block_col_idx are set, got 0 (block_k ", p.block_k, ")"));
    }
    return absl::OkStatus();
  }
  if (p.block_q % kBlockMaskGrain != 0) {
    return Invalid("block_q",
                   absl::StrCat("a positive multiple of kBlockMaskGrain (", kBlockMaskGrain, ")"),
                   p.block_q);
  }
  if (p.block_k <= 0 || p.block_k % kBlockMaskGrain != 0) {
    return Invalid("block_k",
                   absl::StrCat("a positive multiple of kBlockMaskGrain (", kBlockMaskGrain, ")"),
                   p.block_k);
  }
  if (IsVarlen(p) && !p.block_per_batch) {
    return absl::InvalidArgumentError(
        "block_per_batch: expected true for a varlen call (its rows are per sequence), got false");
  }
  if (p.block_row_ptr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("block_row_ptr: expected ", BlockMaskRows(p) + 1,
                                                   " row offsets (block_q is set), got null"));
  }
  if (p.block_row_ptr[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_row_ptr[0]: expected 0, got ", p.block_row_ptr[0]));
  }
  const int64_t rows = BlockMaskRows(p);
  if (p.block_row_ptr[rows] > 0 && p.block_col_idx == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_col_idx: expected ", p.block_row_ptr[rows],
                     " column indices (block_row_ptr's last entry), got null"));
  }
  const int heads = p.block_per_head ? p.num_heads_q : 1;
  const int outer = IsVarlen(p) ? heads : (p.block_per_batch ? p.batch : 1);
  const int inner = IsVarlen(p) ? p.batch : heads;
  // Only sequences with query blocks own rows: walking the others would cost
  // B x Hq steps that no byte of the call paid for.
  std::vector<int> owners;
  for (int b = 0; b < (IsVarlen(p) ? p.batch : std::min(p.batch, 1)); ++b) {
    if (BlockRowsOf(p, b) > 0) owners.push_back(b);
  }
  const bool dense_rows = !IsVarlen(p) && !owners.empty();
  int64_t row = 0;
  for (int x = 0; x < (IsVarlen(p) ? outer : (dense_rows ? outer : 0)); ++x) {
    for (int yi = 0; yi < (IsVarlen(p) ? static_cast<int>(owners.size()) : inner); ++yi) {
      // Dense: x is the sequence (0 when shared), y the head; varlen the reverse.
      const int y = IsVarlen(p) ? owners[yi] : yi;
      const int b = IsVarlen(p) ? y : x;
      const int64_t key_blocks = (int64_t{SeqLenK(p, b)} + p.block_k - 1) / p.block_k;
      for (int r = 0; r < BlockRowsOf(p, b); ++r, ++row) {
        const int32_t first = p.block_row_ptr[row];
        const int32_t last = p.block_row_ptr[row + 1];
        if (last < first) {
          return absl::InvalidArgumentError(absl::StrCat("block_row_ptr[", row + 1,
                                                         "]: expected >= block_row_ptr[", row,
                                                         "] = ", first, ", got ", last));
        }
        for (int32_t e = first; e < last; ++e) {
          const int32_t c = p.block_col_idx[e];
          if (c < 0 || c >= key_blocks) {
            return absl::InvalidArgumentError(
                absl::StrCat("block_col_idx[", e, "]: expected a key block in [0, ", key_blocks,
                             ") (ceil(seqlen_k ", SeqLenK(p, b), " / block_k ", p.block_k,
                             ") of sequence ", b, ", row ", row, "), got ", c));
          }
          if (e > first && c <= p.block_col_idx[e - 1]) {
            return absl::InvalidArgumentError(absl::StrCat(
                "block_col_idx[", e, "]: expected > block_col_idx[", e - 1, "] = ",
                p.block_col_idx[e - 1], " (strictly increasing within row ", row, "), got ", c));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

// Score modifiers and masks (params.h), all optional.
absl::Status CheckScoreMods(const AttnParams& p) {
  RETURN_IF_ERROR(CheckPerHead("alibi_slopes", p.alibi_slopes, p.num_heads_q));
  RETURN_IF_ERROR(CheckPerHead("sinks", p.sinks, p.num_heads_q));
  if (p.bias != nullptr) {
    if (p.bias_dtype != DType::kFP32 && p.bias_dtype != DType::kFP16 &&
        p.bias_dtype != DType::kBF16) {
      return Invalid("bias_dtype", "one of FP16 (1), BF16 (2), FP32 (3)",
                     static_cast<int32_t>(p.bias_dtype));
    }
    RETURN_IF_ERROR(CheckPairLayout(p, "bias_per_batch", p.bias_per_batch));
  }
  if (p.mask != nullptr) RETURN_IF_ERROR(CheckPairLayout(p, "mask_per_batch", p.mask_per_batch));
  if (p.bias != nullptr || p.mask != nullptr) {
    // Pair offsets of varlen sequences (and per-batch dense ones) stride by it.
    int64_t pairs = 0;
    for (int b = 0; b < p.batch; ++b) pairs += int64_t{SeqLenQ(p, b)} * SeqLenK(p, b);
    if (p.total_pairs != pairs) {
      return absl::InvalidArgumentError(
          absl::StrCat("total_pairs: expected the sum of seqlen_q * seqlen_k over sequences ",
                       pairs, ", got ", p.total_pairs));
    }
  }
  return CheckBlockMask(p);
}

}  // namespace

absl::Status CheckHeadDims(const AttnParams& p) {
  if (p.head_dim_v != 0 && p.head_dim_v != p.head_dim) {
    // MLA-style: Dqk and Dv bounded apart (check_params.h says why).
    if (p.head_dim < 8 || p.head_dim > kMaxMlaHeadDimQk || p.head_dim % 8 != 0) {
      return Invalid("head_dim",
                     absl::StrCat("a multiple of 8 in [8, ", kMaxMlaHeadDimQk, "] (head_dim_v ",
                                  p.head_dim_v, " differs)"),
                     p.head_dim);
    }
    if (p.head_dim_v < 8 || p.head_dim_v > kMaxMlaHeadDimV || p.head_dim_v % 8 != 0) {
      return Invalid(
          "head_dim_v",
          absl::StrCat("0 (same as head_dim) or a multiple of 8 in [8, ", kMaxMlaHeadDimV, "]"),
          p.head_dim_v);
    }
    return absl::OkStatus();
  }
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return Invalid("head_dim", "a multiple of 8 in [8, 256]", p.head_dim);
  }
  return absl::OkStatus();
}

absl::Status RefuseDistinctHeadDimV(const AttnParams& p, const char* backend) {
  if (HeadDimV(p) == p.head_dim) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      backend, ": head_dim_v expected 0 or head_dim ", p.head_dim,
      " (this backend's kernels need V's head dim equal to Q's and K's; the CPU backend runs "
      "MLA shapes), got ",
      p.head_dim_v));
}

absl::Status CheckParams(const AttnParams& p) {
  if (p.dtype != DType::kFP16 && p.dtype != DType::kBF16 && p.dtype != DType::kFP32 &&
      p.dtype != DType::kFP8E4M3) {
    return Invalid("dtype", "one of FP16 (1), BF16 (2), FP32 (3), FP8_E4M3 (4)",
                   static_cast<int32_t>(p.dtype));
  }
  RETURN_IF_ERROR(CheckDescale("q_descale", p.q_descale, p.dtype));
  RETURN_IF_ERROR(CheckDescale("k_descale", p.k_descale, p.dtype));
  RETURN_IF_ERROR(CheckDescale("v_descale", p.v_descale, p.dtype));
  if (p.batch < 0) return Invalid("batch", ">= 0", p.batch);
  if (p.num_heads_q <= 0) return Invalid("num_heads_q", "> 0", p.num_heads_q);
  if (p.num_heads_kv <= 0) return Invalid("num_heads_kv", "> 0", p.num_heads_kv);
  if (p.num_heads_q % p.num_heads_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads_q: expected a multiple of num_heads_kv (", p.num_heads_kv,
                     "), got ", p.num_heads_q));
  }
  RETURN_IF_ERROR(CheckHeadDims(p));
  if (p.seqlen_q < 0) return Invalid("seqlen_q", ">= 0", p.seqlen_q);
  if (p.seqlen_k < 0) return Invalid("seqlen_k", ">= 0", p.seqlen_k);
  if (!SoftmaxScaleInRange(p.softmax_scale)) {
    return Invalid("softmax_scale", absl::StrCat("finite and in (0, ", kMaxSoftmaxScale, "]"),
                   p.softmax_scale);
  }
  const float expected_log2 = p.softmax_scale * kLog2e;
  if (!(std::fabs(p.softmax_scale_log2 - expected_log2) <= 1e-6f * expected_log2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale_log2: expected softmax_scale * log2(e) = ", expected_log2,
                     ", got ", p.softmax_scale_log2));
  }
  if (!SoftcapInRange(p.softcap, p.softmax_scale)) {
    return Invalid("softcap",
                   absl::StrCat("0 (off) or in [softmax_scale / ", kMaxSoftcapFactor, ", ",
                                kMaxSoftcap, "] (score_range.h)"),
                   p.softcap);
  }
  if (p.window_left < kNoWindow)
    return Invalid("window_left", ">= -1 (-1 = unlimited)", p.window_left);
  if (p.window_right < kNoWindow) {
    return Invalid("window_right", ">= -1 (-1 = unlimited)", p.window_right);
  }
  if (p.is_causal && p.window_right != 0) {
    return Invalid("window_right", "0 when is_causal (FillParams folds causal into the window)",
                   p.window_right);
  }
  if (IsVarlen(p) || p.cu_seqlens_k != nullptr) {
    RETURN_IF_ERROR(CheckCuSeqlens("cu_seqlens_q", p.cu_seqlens_q, p.batch, p.total_q, p.seqlen_q));
    RETURN_IF_ERROR(CheckCuSeqlens("cu_seqlens_k", p.cu_seqlens_k, p.batch, p.total_k, p.seqlen_k));
  } else {
    if (p.total_q != int64_t{p.batch} * p.seqlen_q) {
      return absl::InvalidArgumentError(
          absl::StrCat("total_q: expected batch * seqlen_q = ", int64_t{p.batch} * p.seqlen_q,
                       ", got ", p.total_q));
    }
    if (p.total_k != int64_t{p.batch} * p.seqlen_k) {
      return absl::InvalidArgumentError(
          absl::StrCat("total_k: expected batch * seqlen_k = ", int64_t{p.batch} * p.seqlen_k,
                       ", got ", p.total_k));
    }
  }
  if (p.total_q > 0 && (p.q == nullptr || p.o == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("q/o: expected non-null data for ", p.total_q, " query rows, got null"));
  }
  if (p.total_k > 0 && (p.k == nullptr || p.v == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k/v: expected non-null data for ", p.total_k, " key rows, got null"));
  }
  return CheckScoreMods(p);
}

}  // namespace attnserve
