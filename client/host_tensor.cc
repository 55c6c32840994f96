// HostTensor and dtype helpers. The byte layout is the host's, which is the
// wire's on every platform attnserve targets (x86-64 and arm64 are
// little-endian), so encoding is a plain copy.
#include "client/host_tensor.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"

namespace attnserve {

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "fp16" || lower == "float16" || lower == "half") return DType::kFP16;
  if (lower == "bf16" || lower == "bfloat16") return DType::kBF16;
  if (lower == "fp32" || lower == "float32" || lower == "float") return DType::kFP32;
  if (lower == "fp8_e4m3" || lower == "float8_e4m3fn" || lower == "e4m3") return DType::kFP8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected fp16, bf16, fp32 or fp8_e4m3"));
}

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::FP16: return DType::kFP16;
    case v1::BF16: return DType::kBF16;
    case v1::FP32: return DType::kFP32;
    case v1::FP8_E4M3: return DType::kFP8E4M3;
    default: break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tensor dtype must be FP16, BF16, FP32 or FP8_E4M3, got ",
                   v1::DType_Name(dtype).empty() ? absl::StrCat(static_cast<int>(dtype))
                                                 : v1::DType_Name(dtype)));
}

v1::DType DTypeToProto(DType dtype) { return static_cast<v1::DType>(static_cast<int32_t>(dtype)); }

absl::StatusOr<int64_t> NumElementsOf(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = shape[i];
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), ": dimension ", i, " is negative"));
    }
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has more elements than int64 holds"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<HostTensor> HostTensor::FromFloats(DType dtype, std::vector<int64_t> shape,
                                                  absl::Span<const float> values) {
  absl::StatusOr<int64_t> n = NumElementsOf(shape);
  if (!n.ok()) return n.status();
  if (static_cast<int64_t>(values.size()) != *n) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(shape), " needs ", *n, " values, got ", values.size()));
  }
  std::string bytes(static_cast<size_t>(*n * DTypeSize(dtype)), '\0');
  for (int64_t i = 0; i < *n; ++i) StoreFromFloat(bytes.data(), dtype, i, values[i]);
  return HostTensor(dtype, std::move(shape), *n, std::move(bytes));
}

absl::StatusOr<HostTensor> HostTensor::FromBytes(DType dtype, std::vector<int64_t> shape,
                                                 std::string bytes) {
  absl::StatusOr<int64_t> n = NumElementsOf(shape);
  if (!n.ok()) return n.status();
  if (*n > std::numeric_limits<int64_t>::max() / DTypeSize(dtype) ||
      static_cast<int64_t>(bytes.size()) != *n * DTypeSize(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(DTypeName(dtype)),
                                                   ShapeString(shape), " needs ", *n, " * ",
                                                   DTypeSize(dtype), " bytes, got ", bytes.size()));
  }
  return HostTensor(dtype, std::move(shape), *n, std::move(bytes));
}

absl::StatusOr<HostTensor> HostTensor::FromProto(const v1::Tensor& tensor) {
  v1::Tensor copy = tensor;
  return FromProto(std::move(copy));
}

absl::StatusOr<HostTensor> HostTensor::FromProto(v1::Tensor&& tensor) {
  absl::StatusOr<DType> dtype = DTypeFromProto(tensor.dtype());
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  std::string bytes = std::move(*tensor.mutable_data());
  return FromBytes(*dtype, std::move(shape), std::move(bytes));
}

void HostTensor::CopyToProto(v1::Tensor* tensor) const {
  tensor->set_dtype(DTypeToProto(dtype_));
  tensor->mutable_shape()->Assign(shape_.begin(), shape_.end());
  tensor->set_data(bytes_);
}

void HostTensor::MoveToProto(v1::Tensor* tensor) && {
  tensor->set_dtype(DTypeToProto(dtype_));
  tensor->mutable_shape()->Assign(shape_.begin(), shape_.end());
  tensor->set_data(std::move(bytes_));
  bytes_.clear();
}

std::vector<float> HostTensor::ToFloats() const {
  std::vector<float> out(static_cast<size_t>(num_elements_));
  for (int64_t i = 0; i < num_elements_; ++i) out[i] = LoadAsFloat(bytes_.data(), dtype_, i);
  return out;
}

HostTensor HostTensor::ConvertTo(DType dtype) const {
  if (dtype == dtype_) return *this;
  std::string bytes(static_cast<size_t>(num_elements_ * DTypeSize(dtype)), '\0');
  for (int64_t i = 0; i < num_elements_; ++i) {
    StoreFromFloat(bytes.data(), dtype, i, LoadAsFloat(bytes_.data(), dtype_, i));
  }
  return HostTensor(dtype, shape_, num_elements_, std::move(bytes));
}

std::string HostTensor::DebugString() const {
  return absl::StrCat(std::string(DTypeName(dtype_)), ShapeString(shape_));
}

absl::StatusOr<HostTensor> HostTensor::SliceRows(int64_t begin, int64_t count) const {
  if (shape_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot slice rows of ", DebugString()));
  }
  if (begin < 0 || count < 0 || begin > shape_[0] || count > shape_[0] - begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows [", begin, ", ", begin + count, ") are outside ", DebugString()));
  }
  const int64_t row_bytes = shape_[0] == 0 ? 0 : static_cast<int64_t>(bytes_.size()) / shape_[0];
  std::vector<int64_t> shape = shape_;
  shape[0] = count;
  return FromBytes(dtype_, std::move(shape), bytes_.substr(begin * row_bytes, count * row_bytes));
}

absl::StatusOr<HostTensor> ConcatRows(absl::Span<const HostTensor> parts, DType empty_dtype,
                                      std::vector<int64_t> empty_shape) {
  if (parts.empty()) {
    if (!empty_shape.empty()) empty_shape[0] = 0;
    return HostTensor::FromBytes(empty_dtype, std::move(empty_shape), "");
  }
  const HostTensor& first = parts[0];
  if (first.rank() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot stack rows of ", first.DebugString()));
  }
  std::vector<int64_t> shape = first.shape();
  shape[0] = 0;
  size_t bytes = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const HostTensor& p = parts[i];
    if (p.dtype() != first.dtype() || p.rank() != first.rank() ||
        !std::equal(p.shape().begin() + 1, p.shape().end(), first.shape().begin() + 1)) {
      return absl::InvalidArgumentError(absl::StrCat("part ", i, " is ", p.DebugString(),
                                                     ", expected ", first.DebugString(),
                                                     " in all but the first dimension"));
    }
    shape[0] += p.dim(0);
    bytes += p.bytes().size();
  }
  std::string out;
  out.reserve(bytes);
  for (const HostTensor& p : parts) out += p.bytes();
  return HostTensor::FromBytes(first.dtype(), std::move(shape), std::move(out));
}

}  // namespace attnserve
