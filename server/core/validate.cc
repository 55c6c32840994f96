// The structural checks of every call; see validate.h.
#include "server/core/validate.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/check_params.h"
#include "backend/score_range.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "server/core/validate_mods.h"

namespace attnserve {
namespace {

constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

bool IsKnownDType(int code) {
  return code == static_cast<int>(DType::kFP16) || code == static_cast<int>(DType::kBF16) ||
         code == static_cast<int>(DType::kFP32) || code == static_cast<int>(DType::kFP8E4M3);
}

// prod(shape), saturating at kSaturated: dims are already bounded by kMaxDim,
// but four of them can still overflow int64.
int64_t Elements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > kSaturated / d) return kSaturated;
    n *= d;
  }
  return n;
}

// "q.dtype", "inputs['q'].shape[2]", ...
std::string Field(const char* tensor, absl::string_view field) {
  return absl::StrCat(tensor, ".", field);
}

absl::Status CheckKnownDType(const char* name, const TensorView& t, const FieldNames& n) {
  if (!IsKnownDType(t.dtype)) {
    return Invalid(absl::StrCat(Field(name, n.dtype),
                                ": expected FP16, BF16, FP32 or FP8_E4M3, got ",
                                n.dtype_name(t.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(const char* name, const TensorView& t, const TensorView& q,
                        const FieldNames& n) {
  RETURN_IF_ERROR(CheckKnownDType(name, t, n));
  if (t.dtype != q.dtype) {
    return Invalid(absl::StrCat(Field(name, n.dtype), ": expected ", n.dtype_name(q.dtype),
                                " (Q, K and V share one dtype), got ", n.dtype_name(t.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckDims(const char* name, const TensorView& t) {
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] < 0 || t.shape[i] > kMaxDim) {
      return Invalid(absl::StrCat(name, ".shape[", i, "]: expected 0 <= size <= ", kMaxDim,
                                  ", got ", t.shape[i], " (shape ", ShapeString(t.shape), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckByteLength(const char* name, const TensorView& t, const FieldNames& n) {
  const int64_t elements = Elements(t.shape);
  const int64_t elem_size = DTypeSize(static_cast<DType>(t.dtype));
  const int64_t actual = static_cast<int64_t>(t.bytes.size());
  if (elements > kSaturated / elem_size) {
    return Invalid(absl::StrCat(name, ".data: expected more than 2^63 bytes (",
                                n.dtype_name(t.dtype), " ", ShapeString(t.shape), "), got ", actual,
                                " bytes"));
  }
  const int64_t expected = elements * elem_size;
  if (actual != expected) {
    return Invalid(absl::StrCat(name, ".data: expected ", expected, " bytes (",
                                n.dtype_name(t.dtype), " ", ShapeString(t.shape), " = ", elements,
                                " elements x ", elem_size, " bytes), got ", actual, " bytes"));
  }
  return absl::OkStatus();
}

// One side's cu_seqlens: B+1 offsets from 0, non-decreasing, ending at `total`.
absl::Status CheckCuSeqlens(const char* name, absl::Span<const int32_t> cu, int64_t total,
                            const char* total_name) {
  if (cu.empty()) return Invalid(absl::StrCat(name, ": expected B+1 >= 1 offsets, got none"));
  if (cu[0] != 0) return Invalid(absl::StrCat(name, "[0]: expected 0, got ", cu[0]));
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return Invalid(absl::StrCat(name, "[", i, "]: expected >= ", name, "[", i - 1,
                                  "] = ", cu[i - 1], " (offsets never decrease), got ", cu[i]));
    }
  }
  const size_t last = cu.size() - 1;
  if (cu[last] != total) {
    return Invalid(absl::StrCat(name, "[", last, "]: expected ", total_name, " = ", total,
                                " (the last offset is the total row count), got ", cu[last]));
  }
  return absl::OkStatus();
}

absl::Status CheckShapes(const AttentionCall& c, const FieldNames& n) {
  const TensorView& q = c.q;
  const TensorView& k = c.k;
  const TensorView& v = c.v;
  const size_t rank = q.shape.size();
  if (rank != 4 && rank != 3) {
    return Invalid(absl::StrCat(
        n.q, ".shape: expected rank 4 (dense [B, Sq, Hq, D]) or 3 (varlen [Tq, Hq, D]), got rank ",
        rank, " ", ShapeString(q.shape)));
  }
  const bool dense = rank == 4;
  const char* kv_layout = dense ? "[B, Sk, Hkv, D]" : "[Tk, Hkv, D]";
  if (k.shape.size() != rank) {
    return Invalid(absl::StrCat(n.k, ".shape: expected rank ", rank, " like ", n.q, " (", kv_layout,
                                "), got rank ", k.shape.size(), " ", ShapeString(k.shape)));
  }
  if (v.shape.size() != rank) {
    return Invalid(absl::StrCat(n.v, ".shape: expected rank ", rank, " like ", n.q, " (", kv_layout,
                                "), got rank ", v.shape.size(), " ", ShapeString(v.shape)));
  }
  RETURN_IF_ERROR(CheckDims(n.q, q));
  RETURN_IF_ERROR(CheckDims(n.k, k));
  RETURN_IF_ERROR(CheckDims(n.v, v));
  RETURN_IF_ERROR(CheckByteLength(n.q, q, n));
  RETURN_IF_ERROR(CheckByteLength(n.k, k, n));
  RETURN_IF_ERROR(CheckByteLength(n.v, v, n));

  const size_t h_axis = rank - 2;
  const size_t d_axis = rank - 1;
  // V is K's shape except its head dim (Dv, which may differ: MLA).
  for (size_t i = 0; i < d_axis; ++i) {
    if (v.shape[i] != k.shape[i]) {
      std::vector<int64_t> want(k.shape.begin(), k.shape.end());
      want[d_axis] = v.shape[d_axis];
      return Invalid(absl::StrCat(n.v, ".shape: expected ", ShapeString(want), " (the shape of ",
                                  n.k, " but for its head dim), got ", ShapeString(v.shape)));
    }
  }
  if (dense && k.shape[0] != q.shape[0]) {
    return Invalid(absl::StrCat(n.k, ".shape[0]: expected batch ", q.shape[0], " (", n.q,
                                ".shape[0]), got ", k.shape[0]));
  }
  if (q.shape[h_axis] < 1) {
    return Invalid(
        absl::StrCat(n.q, ".shape[", h_axis, "]: expected Hq >= 1 heads, got ", q.shape[h_axis]));
  }
  if (k.shape[h_axis] < 1) {
    return Invalid(
        absl::StrCat(n.k, ".shape[", h_axis, "]: expected Hkv >= 1 heads, got ", k.shape[h_axis]));
  }
  if (q.shape[h_axis] % k.shape[h_axis] != 0) {
    return Invalid(absl::StrCat(n.k, ".shape[", h_axis,
                                "]: expected Hkv dividing Hq = ", q.shape[h_axis],
                                " (Hq % Hkv == 0 for GQA/MQA), got Hkv = ", k.shape[h_axis]));
  }
  const int64_t d = q.shape[d_axis];
  const int64_t dv = v.shape[d_axis];
  // Equal dims: [8, 256]. V's differing (MLA): Dqk up to 576, Dv up to 512
  // (backend/check_params.h says why).
  const int64_t max_d = dv == d ? kMaxHeadDim : kMaxMlaHeadDimQk;
  if (d < kMinHeadDim || d > max_d || d % kHeadDimMultiple != 0) {
    return Invalid(absl::StrCat(n.q, ".shape[", d_axis, "]: expected head dim D a multiple of ",
                                kHeadDimMultiple, " in [", kMinHeadDim, ", ", max_d, "]",
                                dv == d ? "" : absl::StrCat(" (V's head dim ", dv, " differs)"),
                                ", got ", d));
  }
  if (k.shape[d_axis] != d) {
    return Invalid(absl::StrCat(n.k, ".shape[", d_axis, "]: expected head dim ", d, " (", n.q,
                                ".shape[", d_axis, "]; Q and K share D), got ", k.shape[d_axis]));
  }
  if (dv != d && (dv < kMinHeadDim || dv > kMaxMlaHeadDimV || dv % kHeadDimMultiple != 0)) {
    return Invalid(absl::StrCat(n.v, ".shape[", d_axis, "]: expected V's head dim Dv = D (", d,
                                ") or a multiple of ", kHeadDimMultiple, " in [", kMinHeadDim, ", ",
                                kMaxMlaHeadDimV, "], got ", dv));
  }
  return absl::OkStatus();
}

absl::Status CheckTokens(const AttentionCall& c, const RequestLimits& limits) {
  const auto& qs = c.q.shape;
  const auto& ks = c.k.shape;
  // Dims are <= 2^31 here, so these products and the sum fit in int64.
  const bool dense = qs.size() == 4;
  const int64_t tokens = dense ? qs[0] * qs[1] + ks[0] * ks[1] : qs[0] + ks[0];
  if (tokens > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tokens: expected at most ", limits.max_tokens, " (--max_tokens) query + key rows (",
        dense ? "B*Sq + B*Sk" : "Tq + Tk", "), got ", tokens));
  }
  // Empty sequences cost no rows but each costs the backend its bookkeeping:
  // a dense batch counts against the same limit.
  if (dense && qs[0] > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("q.shape[0]: expected at most ",
                                                     limits.max_tokens,
                                                     " (--max_tokens) sequences, got ", qs[0]));
  }
  return absl::OkStatus();
}

absl::Status CheckSeqlens(const AttentionCall& c, const FieldNames& n) {
  const bool has_q = !c.cu_seqlens_q.empty();
  const bool has_k = !c.cu_seqlens_k.empty();
  if (c.q.shape.size() == 4) {
    if (has_q || has_k) {
      const char* name = has_q ? n.cu_seqlens_q : n.cu_seqlens_k;
      const size_t count = has_q ? c.cu_seqlens_q.size() : c.cu_seqlens_k.size();
      return Invalid(absl::StrCat(name,
                                  ": expected none for dense rank-4 tensors (varlen takes "
                                  "rank-3 [T, H, D] tensors), got ",
                                  count, " offsets"));
    }
    return absl::OkStatus();
  }
  if (!has_q && !has_k) {
    return Invalid(absl::StrCat(n.cu_seqlens_q,
                                ": expected B+1 offsets with rank-3 (varlen [T, H, D]) tensors, "
                                "got none (",
                                n.cu_seqlens_q, " and ", n.cu_seqlens_k, " both empty)"));
  }
  if (has_q != has_k) {
    const char* missing = has_q ? n.cu_seqlens_k : n.cu_seqlens_q;
    const char* present = has_q ? n.cu_seqlens_q : n.cu_seqlens_k;
    return Invalid(absl::StrCat(missing, ": expected B+1 offsets like ", present,
                                " (both or neither), got none"));
  }
  if (c.cu_seqlens_k.size() != c.cu_seqlens_q.size()) {
    return Invalid(absl::StrCat(n.cu_seqlens_k, ": expected ", c.cu_seqlens_q.size(),
                                " offsets (B+1, the length of ", n.cu_seqlens_q, "), got ",
                                c.cu_seqlens_k.size()));
  }
  RETURN_IF_ERROR(CheckCuSeqlens(n.cu_seqlens_q, c.cu_seqlens_q, c.q.shape[0], "Tq"));
  RETURN_IF_ERROR(CheckCuSeqlens(n.cu_seqlens_k, c.cu_seqlens_k, c.k.shape[0], "Tk"));
  return absl::OkStatus();
}

// One descale option: only for FP8 inputs, and then finite in (0, kMaxDescale].
absl::Status CheckDescale(const char* field, const std::optional<float>& value, int dtype,
                          const FieldNames& n) {
  if (!value.has_value()) return absl::OkStatus();
  if (dtype != static_cast<int>(DType::kFP8E4M3)) {
    return Invalid(absl::StrCat(n.option(field),
                                ": expected unset (descales apply to FP8_E4M3 inputs only), got ",
                                *value, " with ", n.dtype_name(dtype), " inputs"));
  }
  if (!DescaleInRange(*value)) {
    return Invalid(absl::StrCat(n.option(field), ": expected finite and in (0, ", kMaxDescale,
                                "] (leave unset for 1), got ", *value));
  }
  return absl::OkStatus();
}

// A tensor of rows [rows, heads, D] in the cache's dtype (or FP8_E4M3 codes
// when `fp8`: an FP8 cache's k and v given as codes); `heads` 0 means any
// positive multiple of `heads_multiple` (q's Hq). An absent tensor stands for
// zero rows.
absl::Status CheckRows(const char* name, const TensorView& t, const KvGeometry& g, int64_t rows,
                       int64_t heads, int64_t heads_multiple, int64_t dim, const FieldNames& n,
                       bool fp8 = false) {
  if (rows == 0 && t.absent) return absl::OkStatus();
  RETURN_IF_ERROR(ValidateTensor(name, t, n));
  if (fp8 && t.dtype != static_cast<int>(DType::kFP8E4M3)) {
    return Invalid(absl::StrCat(Field(name, n.dtype), ": expected FP8_E4M3 (as ", n.k, "), got ",
                                n.dtype_name(t.dtype)));
  }
  if (!fp8 && t.dtype != static_cast<int>(g.dtype)) {
    return Invalid(absl::StrCat(Field(name, n.dtype), ": expected the cache's dtype ",
                                n.dtype_name(static_cast<int>(g.dtype)),
                                IsFp8Cache(g) ? " (or FP8_E4M3 codes in k and v with k_scale and "
                                                "v_scale)"
                                              : "",
                                ", got ", n.dtype_name(t.dtype)));
  }
  const bool heads_ok =
      t.shape.size() == 3 &&
      (heads > 0 ? t.shape[1] == heads : t.shape[1] > 0 && t.shape[1] % heads_multiple == 0);
  if (t.shape.size() != 3 || t.shape[0] != rows || !heads_ok || t.shape[2] != dim) {
    return Invalid(absl::StrCat(
        name, ".shape: expected [", rows, ", ",
        heads > 0 ? absl::StrCat(heads) : absl::StrCat("Hq (a multiple of ", heads_multiple, ")"),
        ", ", dim, "] (rows from ", n.steps, ", the cache's geometry), got ",
        ShapeString(t.shape)));
  }
  return absl::OkStatus();
}

// An FP8 cache's row scales, FP32 [rows, Hkv], each finite and > 0: wanted
// exactly when k and v are FP8_E4M3 codes (the server quantises 16-bit rows).
absl::Status CheckKvScale(const char* name, const TensorView& t, const KvGeometry& g, int64_t rows,
                          bool wanted, const FieldNames& n) {
  if (!wanted) {
    if (t.absent) return absl::OkStatus();
    return Invalid(absl::StrCat(name,
                                ": expected unset (only with FP8_E4M3 k and v on a cache whose "
                                "geometry.cache_dtype is FP8_E4M3), got a tensor"));
  }
  if (t.absent) {
    return Invalid(absl::StrCat(name, ": expected FP32 [", rows, ", ", g.num_heads_kv,
                                "] (k and v are FP8_E4M3 codes), got none"));
  }
  RETURN_IF_ERROR(ValidateTensor(name, t, n));
  if (t.dtype != static_cast<int>(DType::kFP32)) {
    return Invalid(
        absl::StrCat(Field(name, n.dtype), ": expected FP32, got ", n.dtype_name(t.dtype)));
  }
  if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != g.num_heads_kv) {
    return Invalid(absl::StrCat(name, ".shape: expected [", rows, ", ", g.num_heads_kv,
                                "] (rows from ", n.steps, ", the cache's num_heads_kv), got ",
                                ShapeString(t.shape)));
  }
  for (int64_t i = 0; i < rows * g.num_heads_kv; ++i) {
    float x;
    std::memcpy(&x, t.bytes.data() + i * 4, 4);
    if (!(x > 0.0f) || !std::isfinite(x)) {
      return Invalid(absl::StrCat(name, ".data[", i, "]: expected a finite scale > 0, got ", x));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateTensor(const char* name, const TensorView& t, const FieldNames& n) {
  RETURN_IF_ERROR(CheckKnownDType(name, t, n));
  RETURN_IF_ERROR(CheckDims(name, t));
  return CheckByteLength(name, t, n);
}

absl::Status ValidateRequestId(absl::string_view id, const FieldNames& n) {
  if (id.size() > kMaxRequestIdBytes) {
    return Invalid(absl::StrCat(n.request_id, ": expected at most ", kMaxRequestIdBytes,
                                " bytes, got ", id.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const StatedOptions& o, int64_t head_dim, int dtype,
                             const FieldNames& n) {
  if (o.window_left.has_value() && *o.window_left < 0) {
    return Invalid(absl::StrCat(n.option("window_left"),
                                ": expected >= 0 (leave unset for unlimited), got ",
                                *o.window_left));
  }
  if (o.window_right.has_value() && *o.window_right < 0) {
    return Invalid(absl::StrCat(n.option("window_right"),
                                ": expected >= 0 (leave unset for unlimited), got ",
                                *o.window_right));
  }
  if (o.softmax_scale.has_value() && !SoftmaxScaleInRange(*o.softmax_scale)) {
    return Invalid(absl::StrCat(
        n.option("softmax_scale"), ": expected finite and in (0, ", kMaxSoftmaxScale,
        "] (larger overflows the scores; leave unset for 1/sqrt(D)), got ", *o.softmax_scale));
  }
  const float scale = o.softmax_scale.has_value() ? *o.softmax_scale
                                                  : DefaultSoftmaxScale(static_cast<int>(head_dim));
  if (!SoftcapInRange(o.softcap, scale)) {
    return Invalid(absl::StrCat(n.option("softcap"), ": expected 0 (off) or in [softmax_scale / ",
                                kMaxSoftcapFactor, ", ", kMaxSoftcap, "] = [", MinSoftcap(scale),
                                ", ", kMaxSoftcap, "] with softmax_scale = ", scale, ", got ",
                                o.softcap));
  }
  RETURN_IF_ERROR(CheckDescale("q_descale", o.q_descale, dtype, n));
  RETURN_IF_ERROR(CheckDescale("k_descale", o.k_descale, dtype, n));
  RETURN_IF_ERROR(CheckDescale("v_descale", o.v_descale, dtype, n));
  return absl::OkStatus();
}

absl::StatusOr<AttnParams> ValidateAttentionCall(const AttentionCall& c,
                                                 const RequestLimits& limits, const FieldNames& n) {
  if (c.request_bytes > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request: expected at most ", limits.max_request_bytes,
                     " bytes (--max_request_bytes), got ", c.request_bytes));
  }
  RETURN_IF_ERROR(ValidateRequestId(c.meta.id, n));
  RETURN_IF_ERROR(CheckDType(n.q, c.q, c.q, n));
  RETURN_IF_ERROR(CheckDType(n.k, c.k, c.q, n));
  RETURN_IF_ERROR(CheckDType(n.v, c.v, c.q, n));
  RETURN_IF_ERROR(CheckShapes(c, n));
  RETURN_IF_ERROR(CheckTokens(c, limits));
  RETURN_IF_ERROR(CheckSeqlens(c, n));
  const size_t rank = c.q.shape.size();
  const int64_t head_dim = c.q.shape[rank - 1];
  RETURN_IF_ERROR(ValidateOptions(c.options, head_dim, c.q.dtype, n));

  const size_t h_axis = rank - 2;
  AttnShape shape;
  shape.dtype = static_cast<DType>(c.q.dtype);
  shape.num_heads_q = static_cast<int32_t>(c.q.shape[h_axis]);
  shape.num_heads_kv = static_cast<int32_t>(c.k.shape[h_axis]);
  shape.head_dim = static_cast<int32_t>(head_dim);
  shape.head_dim_v = static_cast<int32_t>(c.v.shape[rank - 1]);
  if (rank == 4) {
    shape.batch = static_cast<int32_t>(c.q.shape[0]);
    shape.seqlen_q = static_cast<int32_t>(c.q.shape[1]);
    shape.seqlen_k = static_cast<int32_t>(c.k.shape[1]);
  } else {
    // The offsets were checked to end at the tensors' row counts.
    shape.batch = static_cast<int32_t>(c.cu_seqlens_q.size()) - 1;
    shape.cu_seqlens_q = c.cu_seqlens_q.data();
    shape.cu_seqlens_k = c.cu_seqlens_k.data();
  }
  AttnPointers pointers;
  pointers.q = c.q.bytes.data();
  pointers.k = c.k.bytes.data();
  pointers.v = c.v.bytes.data();
  const AttnOptions options = ToAttnOptions(c.options);
  // The mods are checked against the call's own sizes and lengths.
  ASSIGN_OR_RETURN(pointers.mods,
                   ValidateScoreMods(c.mods, MakeAttnParams(shape, options, pointers), n));
  return MakeAttnParams(shape, options, pointers);
}

OutputLayout OutputLayoutOf(const AttnParams& p, absl::Span<const int64_t> q_shape, bool dense,
                            bool return_lse) {
  OutputLayout out;
  out.o_dtype = OutputDType(p.dtype);
  // O is Q's shape with V's head dim.
  out.o_shape.assign(q_shape.begin(), q_shape.end());
  if (!out.o_shape.empty()) out.o_shape.back() = HeadDimV(p);
  out.o_bytes = p.total_q * p.num_heads_q * HeadDimV(p) * DTypeSize(out.o_dtype);
  if (return_lse) {
    out.lse_bytes = p.total_q * p.num_heads_q * int64_t{sizeof(float)};
    if (dense) {
      out.lse_shape = {p.batch, p.num_heads_q, p.seqlen_q};
    } else {
      out.lse_shape = {p.num_heads_q, p.total_q};
    }
  }
  return out;
}

absl::Status ValidateKvCall(const KvCall& c, const KvGeometry& g, const RequestLimits& limits,
                            const FieldNames& n) {
  if (c.request_bytes > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request: expected at most ", limits.max_request_bytes,
                     " bytes (--max_request_bytes), got ", c.request_bytes));
  }
  RETURN_IF_ERROR(ValidateRequestId(c.meta.id, n));
  if (c.layer < 0 || c.layer >= g.num_layers) {
    return Invalid(absl::StrCat(n.layer, ": expected [0, ", g.num_layers,
                                ") (the cache's layers), got ", c.layer));
  }
  if (c.steps.empty()) return Invalid(absl::StrCat(n.steps, ": expected at least one, got none"));
  int64_t total_q = 0, total_new = 0;
  std::set<uint64_t> ids;
  for (size_t i = 0; i < c.steps.size(); ++i) {
    const KvStepRequest& s = c.steps[i];
    const int index = static_cast<int>(i);
    if (!ids.insert(s.sequence_id).second) {
      return Invalid(
          absl::StrCat(n.step(index, "sequence_id"), ": ", s.sequence_id, " is listed twice"));
    }
    if (s.expected_length < 0 || s.num_new_tokens < 0 || s.num_queries < 0) {
      return Invalid(absl::StrCat(
          n.step(index, ""), ": expected expected_length, num_new_tokens, num_queries >= 0, got ",
          s.expected_length, ", ", s.num_new_tokens, ", ", s.num_queries));
    }
    total_q += s.num_queries;
    total_new += s.num_new_tokens;
  }
  if (total_q + total_new > limits.max_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat(n.steps, ": expected at most ", limits.max_tokens,
                     " query plus new rows (--max_tokens), got ", total_q + total_new));
  }
  RETURN_IF_ERROR(CheckRows(n.q, c.q, g, total_q, 0, g.num_heads_kv, g.head_dim, n));
  // An FP8 cache takes the step's K/V as the cache's dtype (quantised by the
  // server) or as FP8_E4M3 codes with k_scale and v_scale.
  const bool fp8_rows =
      IsFp8Cache(g) && !c.k.absent && c.k.dtype == static_cast<int>(DType::kFP8E4M3);
  RETURN_IF_ERROR(CheckRows(n.k, c.k, g, total_new, g.num_heads_kv, 1, g.head_dim, n, fp8_rows));
  if (g.v_in_k) {
    // V is read from K's rows: a v sent anyway would be silently ignored.
    if (!c.v.absent) {
      return Invalid(absl::StrCat(n.v,
                                  ": expected none (the cache's geometry.v_in_k: V is the "
                                  "first head_dim_v elements of each k row), got a tensor"));
    }
  } else {
    RETURN_IF_ERROR(
        CheckRows(n.v, c.v, g, total_new, g.num_heads_kv, 1, KvHeadDimV(g), n, fp8_rows));
  }
  RETURN_IF_ERROR(CheckKvScale("k_scale", c.k_scale, g, total_new, fp8_rows, n));
  RETURN_IF_ERROR(CheckKvScale("v_scale", c.v_scale, g, total_new, fp8_rows && !g.v_in_k, n));
  // A cache's dtype is never FP8 (server/kv), so descales are refused here.
  RETURN_IF_ERROR(ValidateOptions(c.options, g.head_dim, static_cast<int>(g.dtype), n));
  return ValidateKvScoreMods(c, g.num_heads_kv, n);
}

AttnOptions ToAttnOptions(const StatedOptions& o) {
  AttnOptions options;
  if (o.softmax_scale.has_value()) options.softmax_scale = *o.softmax_scale;
  options.causal = o.causal;
  if (o.window_left.has_value()) options.window_left = *o.window_left;
  if (o.window_right.has_value()) options.window_right = *o.window_right;
  options.softcap = o.softcap;
  if (o.q_descale.has_value()) options.q_descale = *o.q_descale;
  if (o.k_descale.has_value()) options.k_descale = *o.k_descale;
  if (o.v_descale.has_value()) options.v_descale = *o.v_descale;
  options.batch_invariant = o.batch_invariant;
  return options;
}

}  // namespace attnserve
