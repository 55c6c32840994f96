// HostTensor: a tensor in host memory laid out exactly as the wire contract
// wants it (row-major, contiguous, little-endian bytes of one dtype), so it
// moves into and out of an attnserve.v1.Tensor without re-encoding.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/params.h"
#include "common/shape_string.h"

namespace attnserve {

// "fp16"/"float16"/"half", "bf16"/"bfloat16", "fp32"/"float32"/"float",
// "fp8_e4m3"/"float8_e4m3fn"/"e4m3", case-insensitive. INVALID_ARGUMENT naming the accepted
// spellings otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// The wire enum and back. DTYPE_UNSPECIFIED and unknown values are
// INVALID_ARGUMENT: a tensor must say what it holds.
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype);
v1::DType DTypeToProto(DType dtype);

// Elements of a tensor of this shape; INVALID_ARGUMENT for a negative dimension
// or a product that does not fit in int64.
absl::StatusOr<int64_t> NumElementsOf(absl::Span<const int64_t> shape);

class HostTensor {
 public:
  // An FP32 tensor of shape [0]: what an absent optional output looks like.
  HostTensor() : shape_{0} {}

  // Rounds each value to `dtype` (round to nearest even). `values` must hold
  // exactly prod(shape) elements.
  static absl::StatusOr<HostTensor> FromFloats(DType dtype, std::vector<int64_t> shape,
                                               absl::Span<const float> values);
  // Takes `bytes` as the encoded elements; the length must be prod(shape) * size.
  static absl::StatusOr<HostTensor> FromBytes(DType dtype, std::vector<int64_t> shape,
                                              std::string bytes);
  // Checks dtype and byte length, so a malformed response is an error here
  // rather than an out-of-bounds read later. The && overload steals the bytes.
  static absl::StatusOr<HostTensor> FromProto(const v1::Tensor& tensor);
  static absl::StatusOr<HostTensor> FromProto(v1::Tensor&& tensor);

  void CopyToProto(v1::Tensor* tensor) const;
  // Leaves this tensor's bytes empty; use when the request is built once.
  void MoveToProto(v1::Tensor* tensor) &&;

  // Every element widened to float (exact for FP16, BF16 and FP8; FP8 values
  // are the decoded codes, without any descale).
  std::vector<float> ToFloats() const;
  // The same values rounded to another dtype.
  HostTensor ConvertTo(DType dtype) const;

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t num_elements() const { return num_elements_; }
  const std::string& bytes() const { return bytes_; }
  const void* data() const { return bytes_.data(); }
  void* mutable_data() { return bytes_.data(); }

  std::string DebugString() const;  // "FP16[2, 128, 8, 64]"

  // Rows [begin, begin + count) of the first dimension, e.g. one sequence's
  // part of a varlen [T, H, D] tensor. INVALID_ARGUMENT for rank 0 or a range
  // outside [0, dim(0)].
  absl::StatusOr<HostTensor> SliceRows(int64_t begin, int64_t count) const;

 private:
  HostTensor(DType dtype, std::vector<int64_t> shape, int64_t num_elements, std::string bytes)
      : dtype_(dtype),
        shape_(std::move(shape)),
        num_elements_(num_elements),
        bytes_(std::move(bytes)) {}

  DType dtype_ = DType::kFP32;
  std::vector<int64_t> shape_;
  int64_t num_elements_ = 0;
  std::string bytes_;
};

// The varlen layout from per-sequence tensors: `parts` (same dtype, same
// dimensions after the first) stacked along the first dimension, e.g. the
// [n_i, H, D] rows of each sequence into one [sum n_i, H, D]. With no parts:
// an empty tensor of `empty_shape`'s trailing dimensions and `empty_dtype`.
// INVALID_ARGUMENT naming the first part that disagrees.
absl::StatusOr<HostTensor> ConcatRows(absl::Span<const HostTensor> parts, DType empty_dtype,
                                      std::vector<int64_t> empty_shape);

}  // namespace attnserve
