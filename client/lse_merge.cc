// The log-sum-exp merge of partial attention results (lse_merge.h).
#include "client/lse_merge.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/lse_merge.h"
#include "common/shape_string.h"

namespace attnserve {
namespace {

bool IsOutputDType(DType t) { return t == DType::kFP16 || t == DType::kBF16 || t == DType::kFP32; }

std::string Field(size_t i, const char* name) { return absl::StrCat("partials[", i, "].", name); }

// O [..., S, H, D] and LSE [..., H, S], checked against the first partial's O.
absl::Status CheckPartial(size_t i, const HostTensor& o, const HostTensor& lse,
                          const std::vector<int64_t>& o_shape) {
  if (!IsOutputDType(o.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(Field(i, "o.dtype"),
                                                   ": expected FP16, BF16 or FP32, got ",
                                                   std::string(DTypeName(o.dtype()))));
  }
  if (o.rank() < 3) {
    return absl::InvalidArgumentError(absl::StrCat(Field(i, "o.shape"),
                                                   ": expected [..., S, H, D] (rank >= 3), got ",
                                                   ShapeString(o.shape())));
  }
  if (o.shape() != o_shape) {
    return absl::InvalidArgumentError(absl::StrCat(Field(i, "o.shape"), ": expected ",
                                                   ShapeString(o_shape), " (partials[0].o), got ",
                                                   ShapeString(o.shape())));
  }
  if (lse.dtype() != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(Field(i, "lse.dtype"), ": expected FP32, got ",
                                                   std::string(DTypeName(lse.dtype()))));
  }
  // LSE is O's shape with [S, H, D] replaced by [H, S].
  const size_t r = o_shape.size();
  std::vector<int64_t> want(o_shape.begin(), o_shape.end() - 3);
  want.push_back(o_shape[r - 2]);
  want.push_back(o_shape[r - 3]);
  if (lse.shape() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(Field(i, "lse.shape"), ": expected ", ShapeString(want), " (o is ",
                     ShapeString(o_shape), "), got ", ShapeString(lse.shape())));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MergedAttention> MergeAttentionPartials(absl::Span<const HostTensor* const> outs,
                                                       absl::Span<const HostTensor* const> lses,
                                                       std::optional<DType> out_dtype) {
  if (outs.empty()) return absl::InvalidArgumentError("partials: expected at least one, got 0");
  if (outs.size() != lses.size()) {
    return absl::InvalidArgumentError(absl::StrCat("partials: expected one lse per o, got ",
                                                   outs.size(), " o and ", lses.size(), " lse"));
  }
  const std::vector<int64_t> o_shape = outs[0]->shape();
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i] == nullptr || lses[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("partials[", i, "]: null tensor"));
    }
    const absl::Status st = CheckPartial(i, *outs[i], *lses[i], o_shape);
    if (!st.ok()) return st;
  }
  const DType dtype = out_dtype.value_or(outs[0]->dtype());
  if (!IsOutputDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("out_dtype: expected FP16, BF16 or FP32, got ",
                                                   std::string(DTypeName(dtype))));
  }
  const size_t r = o_shape.size();
  const int64_t seq = o_shape[r - 3], heads = o_shape[r - 2], dim = o_shape[r - 1];
  const int64_t lead = outs[0]->num_elements() == 0 || seq * heads * dim == 0
                           ? 0
                           : outs[0]->num_elements() / (seq * heads * dim);
  const size_t n = outs.size();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  std::vector<float> lse_out(static_cast<size_t>(lead * heads * seq), neg_inf);
  std::vector<float> o_out(static_cast<size_t>(outs[0]->num_elements()), 0.0f);
  std::vector<float> weight(n);
  std::vector<float> row_lse(n);
  for (int64_t b = 0; b < lead; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t lse_at = (b * heads + h) * seq + s;
        for (size_t i = 0; i < n; ++i) {
          const float l = static_cast<const float*>(lses[i]->data())[lse_at];
          if (std::isnan(l) || l == std::numeric_limits<float>::infinity()) {
            return absl::InvalidArgumentError(absl::StrCat(
                Field(i, "lse.data"), "[", lse_at, "]: expected a finite value or -inf, got ", l));
          }
          row_lse[i] = l;
        }
        const int64_t o_at = ((b * seq + s) * heads + h) * dim;
        lse_out[lse_at] = MergeLseRow(
            static_cast<int>(n), row_lse.data(), dim,
            [&](int i, int64_t d) {
              return LoadAsFloat(outs[size_t(i)]->data(), outs[size_t(i)]->dtype(), o_at + d);
            },
            weight.data(), o_out.data() + o_at);
      }
    }
  }
  absl::StatusOr<HostTensor> o = HostTensor::FromFloats(dtype, o_shape, o_out);
  if (!o.ok()) return o.status();
  std::vector<int64_t> lse_shape = lses[0]->shape();
  absl::StatusOr<HostTensor> lse = HostTensor::FromFloats(DType::kFP32, lse_shape, lse_out);
  if (!lse.ok()) return lse.status();
  return MergedAttention{*std::move(o), *std::move(lse)};
}

}  // namespace attnserve
