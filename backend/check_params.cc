// CheckParams: see check_params.h.
#include "backend/check_params.h"

#include <cmath>
#include <cstdint>

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

}  // namespace

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
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return Invalid("head_dim", "a multiple of 8 in [8, 256]", p.head_dim);
  }
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
  return absl::OkStatus();
}

}  // namespace attnserve
