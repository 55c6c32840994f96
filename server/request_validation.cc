// ForwardRequest validation and FillParams; see request_validation.h. The
// checks run cheapest first and stop at the first failure, so one message
// names one field.
#include "server/request_validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backend/make_params.h"
#include "backend/score_range.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

std::string WireDTypeName(int value) {
  const std::string& name = v1::DType_Name(static_cast<v1::DType>(value));
  return name.empty() ? absl::StrCat("unknown dtype ", value) : name;
}

bool IsKnownDType(int value) {
  return value == v1::FP16 || value == v1::BF16 || value == v1::FP32 || value == v1::FP8_E4M3;
}

// prod(shape), saturating at kSaturated: dims are already bounded by kMaxDim,
// but four of them can still overflow int64.
int64_t Elements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d != 0 && n > kSaturated / d) return kSaturated;
    n *= d;
  }
  return n;
}

absl::Status CheckDType(const char* name, const v1::Tensor& t, const v1::Tensor& q) {
  if (!IsKnownDType(t.dtype())) {
    return Invalid(absl::StrCat(name, ".dtype: expected FP16, BF16, FP32 or FP8_E4M3, got ",
                                WireDTypeName(t.dtype())));
  }
  if (t.dtype() != q.dtype()) {
    return Invalid(absl::StrCat(name, ".dtype: expected ", WireDTypeName(q.dtype()),
                                " (Q, K and V share one dtype), got ", WireDTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

absl::Status CheckDims(const char* name, const v1::Tensor& t) {
  for (int i = 0; i < t.shape_size(); ++i) {
    if (t.shape(i) < 0 || t.shape(i) > kMaxDim) {
      return Invalid(absl::StrCat(name, ".shape[", i, "]: expected 0 <= size <= ", kMaxDim,
                                  ", got ", t.shape(i), " (shape ", ShapeString(t.shape()), ")"));
    }
  }
  return absl::OkStatus();
}

// A tensor's bytes: lent ones (LentInputs) when set, else its own data.
absl::string_view BytesOf(const v1::Tensor& t, absl::string_view lent) {
  return lent.data() != nullptr ? lent : absl::string_view(t.data());
}

// `bytes` are the tensor's data (BytesOf).
absl::Status CheckByteLength(const char* name, const v1::Tensor& t, absl::string_view bytes) {
  const int64_t elements = Elements(t);
  const int64_t elem_size = DTypeSize(static_cast<DType>(t.dtype()));
  const int64_t actual = static_cast<int64_t>(bytes.size());
  if (elements > kSaturated / elem_size) {
    return Invalid(absl::StrCat(name, ".data: expected more than 2^63 bytes (",
                                WireDTypeName(t.dtype()), " ", ShapeString(t.shape()), "), got ",
                                actual, " bytes"));
  }
  const int64_t expected = elements * elem_size;
  if (actual != expected) {
    return Invalid(absl::StrCat(name, ".data: expected ", expected, " bytes (",
                                WireDTypeName(t.dtype()), " ", ShapeString(t.shape()), " = ",
                                elements, " elements x ", elem_size, " bytes), got ", actual,
                                " bytes"));
  }
  return absl::OkStatus();
}

// One side's cu_seqlens: B+1 offsets from 0, non-decreasing, ending at `total`.
absl::Status CheckCuSeqlens(const char* name, const google::protobuf::RepeatedField<int32_t>& cu,
                            int64_t total, const char* total_name) {
  if (cu.empty()) return Invalid(absl::StrCat(name, ": expected B+1 >= 1 offsets, got none"));
  if (cu[0] != 0) return Invalid(absl::StrCat(name, "[0]: expected 0, got ", cu[0]));
  for (int i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return Invalid(absl::StrCat(name, "[", i, "]: expected >= ", name, "[", i - 1,
                                  "] = ", cu[i - 1], " (offsets never decrease), got ", cu[i]));
    }
  }
  const int last = cu.size() - 1;
  if (cu[last] != total) {
    return Invalid(absl::StrCat(name, "[", last, "]: expected ", total_name, " = ", total,
                                " (the last offset is the total row count), got ", cu[last]));
  }
  return absl::OkStatus();
}

absl::Status CheckShapes(const v1::ForwardRequest& r, const LentInputs& lent) {
  const v1::Tensor& q = r.q();
  const v1::Tensor& k = r.k();
  const v1::Tensor& v = r.v();
  const int rank = q.shape_size();
  if (rank != 4 && rank != 3) {
    return Invalid(absl::StrCat(
        "q.shape: expected rank 4 (dense [B, Sq, Hq, D]) or 3 (varlen [Tq, Hq, D]), got rank ",
        rank, " ", ShapeString(q.shape())));
  }
  const bool dense = rank == 4;
  const char* kv_layout = dense ? "[B, Sk, Hkv, D]" : "[Tk, Hkv, D]";
  if (k.shape_size() != rank) {
    return Invalid(absl::StrCat("k.shape: expected rank ", rank, " like q (", kv_layout,
                                "), got rank ", k.shape_size(), " ", ShapeString(k.shape())));
  }
  if (v.shape_size() != rank) {
    return Invalid(absl::StrCat("v.shape: expected rank ", rank, " like q (", kv_layout,
                                "), got rank ", v.shape_size(), " ", ShapeString(v.shape())));
  }
  RETURN_IF_ERROR(CheckDims("q", q));
  RETURN_IF_ERROR(CheckDims("k", k));
  RETURN_IF_ERROR(CheckDims("v", v));
  RETURN_IF_ERROR(CheckByteLength("q", q, BytesOf(q, lent.q)));
  RETURN_IF_ERROR(CheckByteLength("k", k, BytesOf(k, lent.k)));
  RETURN_IF_ERROR(CheckByteLength("v", v, BytesOf(v, lent.v)));

  for (int i = 0; i < rank; ++i) {
    if (v.shape(i) != k.shape(i)) {
      return Invalid(absl::StrCat("v.shape: expected ", ShapeString(k.shape()),
                                  " (the shape of k), got ", ShapeString(v.shape())));
    }
  }
  const int h_axis = rank - 2;
  const int d_axis = rank - 1;
  if (dense && k.shape(0) != q.shape(0)) {
    return Invalid(
        absl::StrCat("k.shape[0]: expected batch ", q.shape(0), " (q.shape[0]), got ", k.shape(0)));
  }
  if (q.shape(h_axis) < 1) {
    return Invalid(
        absl::StrCat("q.shape[", h_axis, "]: expected Hq >= 1 heads, got ", q.shape(h_axis)));
  }
  if (k.shape(h_axis) < 1) {
    return Invalid(
        absl::StrCat("k.shape[", h_axis, "]: expected Hkv >= 1 heads, got ", k.shape(h_axis)));
  }
  if (q.shape(h_axis) % k.shape(h_axis) != 0) {
    return Invalid(absl::StrCat("k.shape[", h_axis,
                                "]: expected Hkv dividing Hq = ", q.shape(h_axis),
                                " (Hq % Hkv == 0 for GQA/MQA), got Hkv = ", k.shape(h_axis)));
  }
  const int64_t d = q.shape(d_axis);
  if (d < kMinHeadDim || d > kMaxHeadDim || d % kHeadDimMultiple != 0) {
    return Invalid(absl::StrCat("q.shape[", d_axis, "]: expected head dim D a multiple of ",
                                kHeadDimMultiple, " in [", kMinHeadDim, ", ", kMaxHeadDim,
                                "], got ", d));
  }
  if (k.shape(d_axis) != d) {
    return Invalid(absl::StrCat("k.shape[", d_axis, "]: expected head dim ", d, " (q.shape[",
                                d_axis, "]; V has the same D as K), got ", k.shape(d_axis)));
  }
  return absl::OkStatus();
}

absl::Status CheckTokens(const v1::ForwardRequest& r, const RequestLimits& limits) {
  const auto& qs = r.q().shape();
  const auto& ks = r.k().shape();
  // Dims are <= 2^31 here, so these products and the sum fit in int64.
  const bool dense = qs.size() == 4;
  const int64_t tokens = dense ? qs[0] * qs[1] + ks[0] * ks[1] : qs[0] + ks[0];
  if (tokens > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tokens: expected at most ", limits.max_tokens, " (--max_tokens) query + key rows (",
        dense ? "B*Sq + B*Sk" : "Tq + Tk", "), got ", tokens));
  }
  return absl::OkStatus();
}

absl::Status CheckSeqlens(const v1::ForwardRequest& r) {
  const bool has_q = !r.cu_seqlens_q().empty();
  const bool has_k = !r.cu_seqlens_k().empty();
  if (r.q().shape_size() == 4) {
    if (has_q || has_k) {
      const char* name = has_q ? "cu_seqlens_q" : "cu_seqlens_k";
      const int n = has_q ? r.cu_seqlens_q_size() : r.cu_seqlens_k_size();
      return Invalid(absl::StrCat(name,
                                  ": expected none for dense rank-4 tensors (varlen takes "
                                  "rank-3 [T, H, D] tensors), got ",
                                  n, " offsets"));
    }
    return absl::OkStatus();
  }
  if (!has_q && !has_k) {
    return Invalid(
        "cu_seqlens_q: expected B+1 offsets with rank-3 (varlen [T, H, D]) tensors, got none "
        "(cu_seqlens_q and cu_seqlens_k both empty)");
  }
  if (has_q != has_k) {
    const char* missing = has_q ? "cu_seqlens_k" : "cu_seqlens_q";
    const char* present = has_q ? "cu_seqlens_q" : "cu_seqlens_k";
    return Invalid(absl::StrCat(missing, ": expected B+1 offsets like ", present,
                                " (both or neither), got none"));
  }
  if (r.cu_seqlens_k_size() != r.cu_seqlens_q_size()) {
    return Invalid(absl::StrCat("cu_seqlens_k: expected ", r.cu_seqlens_q_size(),
                                " offsets (B+1, the length of cu_seqlens_q), got ",
                                r.cu_seqlens_k_size()));
  }
  RETURN_IF_ERROR(CheckCuSeqlens("cu_seqlens_q", r.cu_seqlens_q(), r.q().shape(0), "Tq"));
  RETURN_IF_ERROR(CheckCuSeqlens("cu_seqlens_k", r.cu_seqlens_k(), r.k().shape(0), "Tk"));
  return absl::OkStatus();
}

// One descale option: only for FP8 inputs, and then finite in (0, kMaxDescale].
absl::Status CheckDescale(const char* field, bool has, float value, int dtype) {
  if (!has) return absl::OkStatus();
  if (dtype != v1::FP8_E4M3) {
    return Invalid(absl::StrCat("options.", field,
                                ": expected unset (descales apply to FP8_E4M3 inputs only), got ",
                                value, " with ", WireDTypeName(dtype), " inputs"));
  }
  if (!DescaleInRange(value)) {
    return Invalid(absl::StrCat("options.", field, ": expected finite and in (0, ", kMaxDescale,
                                "] (leave unset for 1), got ", value));
  }
  return absl::OkStatus();
}

// `head_dim` is the validated D (the default scale depends on it), `dtype`
// the inputs' (descales are FP8-only). The ranges of softmax_scale, softcap
// and the descales are backend/score_range.h's.
absl::Status CheckOptions(const v1::AttentionOptions& o, int64_t head_dim, int dtype) {
  if (o.has_window_left() && o.window_left() < 0) {
    return Invalid(absl::StrCat(
        "options.window_left: expected >= 0 (leave unset for unlimited), got ", o.window_left()));
  }
  if (o.has_window_right() && o.window_right() < 0) {
    return Invalid(absl::StrCat(
        "options.window_right: expected >= 0 (leave unset for unlimited), got ", o.window_right()));
  }
  if (o.has_softmax_scale() && !SoftmaxScaleInRange(o.softmax_scale())) {
    return Invalid(absl::StrCat("options.softmax_scale: expected finite and in (0, ",
                                kMaxSoftmaxScale,
                                "] (larger overflows the scores; leave unset for 1/sqrt(D)), got ",
                                o.softmax_scale()));
  }
  const float scale = o.has_softmax_scale() ? o.softmax_scale()
                                            : DefaultSoftmaxScale(static_cast<int>(head_dim));
  if (!SoftcapInRange(o.softcap(), scale)) {
    return Invalid(absl::StrCat("options.softcap: expected 0 (off) or in [softmax_scale / ",
                                kMaxSoftcapFactor, ", ", kMaxSoftcap, "] = [", MinSoftcap(scale),
                                ", ", kMaxSoftcap, "] with softmax_scale = ", scale, ", got ",
                                o.softcap()));
  }
  RETURN_IF_ERROR(CheckDescale("q_descale", o.has_q_descale(), o.q_descale(), dtype));
  RETURN_IF_ERROR(CheckDescale("k_descale", o.has_k_descale(), o.k_descale(), dtype));
  RETURN_IF_ERROR(CheckDescale("v_descale", o.has_v_descale(), o.v_descale(), dtype));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateForwardRequest(const v1::ForwardRequest& request,
                                    const RequestLimits& limits, const LentInputs& lent) {
  // Lent bytes count as if they were in the message: a request's size limit
  // does not depend on how its tensors travel.
  const int64_t bytes = static_cast<int64_t>(request.ByteSizeLong() + lent.q.size() +
                                             lent.k.size() + lent.v.size());
  if (bytes > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("request: expected at most ",
                                                     limits.max_request_bytes,
                                                     " bytes (--max_request_bytes), got ", bytes));
  }
  RETURN_IF_ERROR(ValidateRequestId(request.request_id()));
  RETURN_IF_ERROR(CheckDType("q", request.q(), request.q()));
  RETURN_IF_ERROR(CheckDType("k", request.k(), request.q()));
  RETURN_IF_ERROR(CheckDType("v", request.v(), request.q()));
  RETURN_IF_ERROR(CheckShapes(request, lent));
  RETURN_IF_ERROR(CheckTokens(request, limits));
  RETURN_IF_ERROR(CheckSeqlens(request));
  const int64_t head_dim = request.q().shape(request.q().shape_size() - 1);
  RETURN_IF_ERROR(CheckOptions(request.options(), head_dim, request.q().dtype()));
  return absl::OkStatus();
}

AttnParams FillParams(const v1::ForwardRequest& request, const LentInputs& lent) {
  const v1::Tensor& q = request.q();
  const v1::Tensor& k = request.k();
  const int h_axis = q.shape_size() - 2;
  AttnShape shape;
  shape.dtype = static_cast<DType>(q.dtype());
  shape.num_heads_q = static_cast<int32_t>(q.shape(h_axis));
  shape.num_heads_kv = static_cast<int32_t>(k.shape(h_axis));
  shape.head_dim = static_cast<int32_t>(q.shape(h_axis + 1));
  if (q.shape_size() == 4) {
    shape.batch = static_cast<int32_t>(q.shape(0));
    shape.seqlen_q = static_cast<int32_t>(q.shape(1));
    shape.seqlen_k = static_cast<int32_t>(k.shape(1));
  } else {
    // Validation checked that the offsets end at the tensors' row counts.
    shape.batch = request.cu_seqlens_q_size() - 1;
    shape.cu_seqlens_q = request.cu_seqlens_q().data();
    shape.cu_seqlens_k = request.cu_seqlens_k().data();
  }
  AttnPointers pointers;
  pointers.q = BytesOf(q, lent.q).data();
  pointers.k = BytesOf(k, lent.k).data();
  pointers.v = BytesOf(request.v(), lent.v).data();
  return MakeAttnParams(shape, OptionsFromWire(request.options()), pointers);
}

AttnOptions OptionsFromWire(const v1::AttentionOptions& o) {
  AttnOptions options;
  if (o.has_softmax_scale()) options.softmax_scale = o.softmax_scale();
  options.causal = o.causal();
  if (o.has_window_left()) options.window_left = o.window_left();
  if (o.has_window_right()) options.window_right = o.window_right();
  options.softcap = o.softcap();
  if (o.has_q_descale()) options.q_descale = o.q_descale();
  if (o.has_k_descale()) options.k_descale = o.k_descale();
  if (o.has_v_descale()) options.v_descale = o.v_descale();
  return options;
}

absl::Status ValidateRequestId(const std::string& id) {
  if (id.size() > kMaxRequestIdBytes) {
    return Invalid(absl::StrCat("request_id: expected at most ", kMaxRequestIdBytes,
                                " bytes, got ", id.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const v1::AttentionOptions& options, int64_t head_dim, int dtype) {
  return CheckOptions(options, head_dim, dtype);
}

absl::Status ValidateTensorBytes(const char* name, const v1::Tensor& tensor) {
  if (!IsKnownDType(tensor.dtype())) {
    return Invalid(absl::StrCat(name, ".dtype: expected FP16, BF16, FP32 or FP8_E4M3, got ",
                                WireDTypeName(tensor.dtype())));
  }
  RETURN_IF_ERROR(CheckDims(name, tensor));
  return CheckByteLength(name, tensor, tensor.data());
}

absl::StatusOr<AttnParams> ValidateAndFillParams(const v1::ForwardRequest& request,
                                                 const RequestLimits& limits,
                                                 const LentInputs& lent) {
  RETURN_IF_ERROR(ValidateForwardRequest(request, limits, lent));
  return FillParams(request, lent);
}

int64_t LseElements(const AttnParams& p) { return p.total_q * p.num_heads_q; }

int64_t LseBytes(const AttnParams& p) { return LseElements(p) * int64_t{sizeof(float)}; }

void ShapeLseTensor(const v1::ForwardRequest& request, const AttnParams& params, v1::Tensor* lse,
                    bool with_data) {
  lse->set_dtype(v1::FP32);
  lse->clear_shape();
  if (request.q().shape_size() == 4) {
    lse->add_shape(params.batch);
    lse->add_shape(params.num_heads_q);
    lse->add_shape(params.seqlen_q);
  } else {
    lse->add_shape(params.num_heads_q);
    lse->add_shape(params.total_q);
  }
  if (with_data) {
    lse->mutable_data()->resize(static_cast<size_t>(LseBytes(params)));
  } else {
    lse->clear_data();
  }
}

}  // namespace attnserve
