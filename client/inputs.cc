// Random inputs and input shape checks (see inputs.h).
#include "client/inputs.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

absl::Status CheckCuSeqlens(const std::vector<int32_t>& cu, int64_t total, const char* name,
                            const char* tensor) {
  if (cu.front() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, "[0] must be 0, got ", cu.front()));
  }
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be non-decreasing, but ", name,
                                                     "[", i, "] = ", cu[i], " < ", name, "[", i - 1,
                                                     "] = ", cu[i - 1]));
    }
  }
  if (cu.back() != total) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must end at ", tensor, ".shape[0] = ", total, ", got ", cu.back()));
  }
  return absl::OkStatus();
}

}  // namespace

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64* rng) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& x : values) {
    do {
      x = RoundTo(dtype, dist(*rng));
    } while (std::fabs(x) < 1e-3f);
  }
  return *HostTensor::FromFloats(dtype, std::move(shape), values);
}

AttentionShape DenseAttentionShape(DType dtype, int batch, int seqlen_q, int seqlen_k, int heads_q,
                                   int heads_kv, int head_dim) {
  AttentionShape s;
  s.dtype = dtype;
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = head_dim;
  return s;
}

std::vector<int32_t> CuSeqlensFromLengths(const std::vector<int>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) cu[i + 1] = cu[i] + lengths[i];
  return cu;
}

absl::StatusOr<AttentionInputs> MakeRandomInputs(const AttentionShape& s, uint64_t seed) {
  const bool varlen = !s.seqlens_q.empty() || !s.seqlens_k.empty();
  if (s.heads_q <= 0 || s.heads_kv <= 0 || s.head_dim <= 0 || s.head_dim_v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heads_q, heads_kv and head_dim must be > 0 and head_dim_v >= 0, got ",
                     s.heads_q, ", ", s.heads_kv, ", ", s.head_dim, ", ", s.head_dim_v));
  }
  if (s.heads_q % s.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("heads_q must be a multiple of heads_kv, got ",
                                                   s.heads_q, " and ", s.heads_kv));
  }
  AttentionInputs in;
  int64_t rows_q, rows_k;
  if (varlen) {
    if (s.seqlens_q.size() != s.seqlens_k.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("seqlens_q and seqlens_k must list the same number of sequences, got ",
                       s.seqlens_q.size(), " and ", s.seqlens_k.size()));
    }
    int64_t tq = 0, tk = 0;
    for (size_t i = 0; i < s.seqlens_q.size(); ++i) {
      if (s.seqlens_q[i] < 0 || s.seqlens_k[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " has a negative length"));
      }
      tq += s.seqlens_q[i];
      tk += s.seqlens_k[i];
    }
    if (tq > INT32_MAX || tk > INT32_MAX) {
      return absl::InvalidArgumentError("varlen totals must fit in int32 (cu_seqlens are int32)");
    }
    in.cu_seqlens_q = CuSeqlensFromLengths(s.seqlens_q);
    in.cu_seqlens_k = CuSeqlensFromLengths(s.seqlens_k);
    rows_q = tq;
    rows_k = tk;
  } else {
    if (s.batch < 0 || s.seqlen_q < 0 || s.seqlen_k < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch, seqlen_q and seqlen_k must be >= 0, got ", s.batch, ", ", s.seqlen_q,
                       ", ", s.seqlen_k));
    }
    rows_q = int64_t{s.batch} * s.seqlen_q;
    rows_k = int64_t{s.batch} * s.seqlen_k;
  }
  std::mt19937_64 rng(seed);
  auto shape = [&](int64_t rows, int64_t seq, int heads) -> std::vector<int64_t> {
    if (varlen) return {rows, heads, s.head_dim};
    return {s.batch, seq, heads, s.head_dim};
  };
  in.q = RandomTensor(s.dtype, shape(rows_q, s.seqlen_q, s.heads_q), &rng);
  in.k = RandomTensor(s.dtype, shape(rows_k, s.seqlen_k, s.heads_kv), &rng);
  std::vector<int64_t> v_shape = shape(rows_k, s.seqlen_k, s.heads_kv);
  if (s.head_dim_v > 0) v_shape.back() = s.head_dim_v;
  in.v = RandomTensor(s.dtype, std::move(v_shape), &rng);
  return in;
}

std::string InputsSummary::ToString() const {
  const std::string dv =
      head_dim_v != 0 && head_dim_v != head_dim ? absl::StrCat(" Dv=", head_dim_v) : "";
  if (varlen) {
    return absl::StrCat("varlen B=", batch, " Tq=", total_q, " Tk=", total_k, " Hq=", heads_q,
                        " Hkv=", heads_kv, " D=", head_dim, dv, " ", std::string(DTypeName(dtype)));
  }
  return absl::StrCat("dense B=", batch, " Sq=", seqlen_q, " Sk=", seqlen_k, " Hq=", heads_q,
                      " Hkv=", heads_kv, " D=", head_dim, dv, " ", std::string(DTypeName(dtype)));
}

absl::StatusOr<InputsSummary> SummarizeInputs(const AttentionInputs& in) {
  InputsSummary s;
  s.dtype = in.q.dtype();
  if (in.k.dtype() != s.dtype || in.v.dtype() != s.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("q, k and v must share one dtype, got ",
                                                   in.q.DebugString(), ", ", in.k.DebugString(),
                                                   ", ", in.v.DebugString()));
  }
  s.varlen = !in.cu_seqlens_q.empty() || !in.cu_seqlens_k.empty();
  const int rank = s.varlen ? 3 : 4;
  const char* layout = s.varlen ? "varlen [T, H, D]" : "dense [B, S, H, D]";
  for (const auto& [name, t] :
       {std::pair<const char*, const HostTensor*>{"q", &in.q}, {"k", &in.k}, {"v", &in.v}}) {
    if (t->rank() != rank) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must have rank ", rank, " (", layout, "), got ", t->DebugString()));
    }
  }
  const int h = rank - 2, d = rank - 1;
  // V is K's shape but for its head dim (MLA: Dv != D).
  for (int i = 0; i < d; ++i) {
    if (in.k.dim(i) != in.v.dim(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("k and v must have the same shape but for the head dim, got ",
                       in.k.DebugString(), " and ", in.v.DebugString()));
    }
  }
  s.head_dim_v = in.v.dim(d);
  s.heads_q = in.q.dim(h);
  s.heads_kv = in.k.dim(h);
  s.head_dim = in.q.dim(d);
  if (in.k.dim(d) != s.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("k head dim must equal q's (", s.head_dim, "), got ", in.k.DebugString()));
  }
  if (s.heads_q <= 0 || s.heads_kv <= 0 || s.head_dim <= 0 || s.heads_q % s.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q heads must be a positive multiple of k heads, got ", s.heads_q, " and ", s.heads_kv));
  }
  if (s.varlen) {
    if (in.cu_seqlens_q.size() != in.cu_seqlens_k.size() || in.cu_seqlens_q.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cu_seqlens_q and cu_seqlens_k must both have B+1 entries, got ",
                       in.cu_seqlens_q.size(), " and ", in.cu_seqlens_k.size()));
    }
    s.batch = static_cast<int64_t>(in.cu_seqlens_q.size()) - 1;
    s.total_q = in.q.dim(0);
    s.total_k = in.k.dim(0);
    RETURN_IF_ERROR(CheckCuSeqlens(in.cu_seqlens_q, s.total_q, "cu_seqlens_q", "q"));
    RETURN_IF_ERROR(CheckCuSeqlens(in.cu_seqlens_k, s.total_k, "cu_seqlens_k", "k"));
    for (int64_t b = 0; b < s.batch; ++b) {
      s.seqlen_q = std::max<int64_t>(s.seqlen_q, in.cu_seqlens_q[b + 1] - in.cu_seqlens_q[b]);
      s.seqlen_k = std::max<int64_t>(s.seqlen_k, in.cu_seqlens_k[b + 1] - in.cu_seqlens_k[b]);
    }
  } else {
    if (in.k.dim(0) != in.q.dim(0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("k batch must equal q's (", in.q.dim(0), "), got ", in.k.DebugString()));
    }
    s.batch = in.q.dim(0);
    s.seqlen_q = in.q.dim(1);
    s.seqlen_k = in.k.dim(1);
    s.total_q = s.batch * s.seqlen_q;
    s.total_k = s.batch * s.seqlen_k;
  }
  return s;
}

}  // namespace attnserve
