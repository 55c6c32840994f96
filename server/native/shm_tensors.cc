// Shared-memory spans of native calls; see shm_tensors.h.
#include "server/native/shm_tensors.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

// prod(shape) * sizeof(dtype), or nothing when the dtype is unknown or the
// shape is negative or absurd: the core refuses those, naming them.
std::optional<uint64_t> TensorBytes(const v1::Tensor& t) {
  if (t.dtype() < static_cast<int>(DType::kFP16) || t.dtype() > static_cast<int>(DType::kFP8E4M3))
    return std::nullopt;
  uint64_t n = static_cast<uint64_t>(DTypeSize(static_cast<DType>(t.dtype())));
  for (int64_t d : t.shape()) {
    if (d < 0 || (d > 0 && n > (uint64_t{1} << 62) / static_cast<uint64_t>(d))) {
      return std::nullopt;
    }
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

}  // namespace

absl::Status ShmCall::Input(absl::string_view field, const v1::Tensor& tensor, ShmRead how,
                            TensorView* view, int64_t* request_bytes) {
  if (!tensor.has_shm()) return absl::OkStatus();
  const v1::SharedTensor& ref = tensor.shm();
  if (!tensor.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shm: expected either data or a shared-memory span, got both (",
        tensor.data().size(), " bytes of ", field, ".data and region '", ref.region(), "')"));
  }
  if (const std::optional<uint64_t> bytes = TensorBytes(tensor);
      bytes.has_value() && *bytes != ref.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shm.byte_size: expected ", *bytes, " (",
                                                   field, "'s dtype and shape), got ",
                                                   ref.byte_size()));
  }
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(field,
                     ".shm: shared memory is off: the server must be started with "
                     "--allow_client_shm"));
  }
  const std::string where = absl::StrCat(field, ".shm");
  absl::StatusOr<RegionSpan> span =
      ViewRegion(*registry_, tenant_, where, ref.region(), ref.offset(), ref.byte_size());
  if (!span.ok()) return span.status();
  view->dtype = tensor.dtype();
  view->shape =
      absl::MakeConstSpan(tensor.shape().data(), static_cast<size_t>(tensor.shape_size()));
  view->absent = false;
  *request_bytes += static_cast<int64_t>(ref.byte_size());
  const bool copy = span->on_device() ? how == ShmRead::kHostInPlace || how == ShmRead::kCopy
                                      : how == ShmRead::kCopyHost || how == ShmRead::kCopy;
  if (!copy) {
    *view = span->AsTensor(tensor.dtype(), view->shape);
  } else {
    std::string* bytes = nullptr;
    try {
      bytes = &copies_.emplace_back(static_cast<size_t>(ref.byte_size()), '\0');
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat(where, ": cannot allocate ", ref.byte_size(),
                                                       " bytes of host memory to copy it"));
    }
    // Read checks the region is still all there after the copy.
    absl::Status read = span->region->Read(ref.offset(), ref.byte_size(), bytes->data());
    if (!read.ok()) return absl::Status(read.code(), absl::StrCat(where, ": ", read.message()));
    view->bytes = *bytes;
    view->device = kHostMemory;
  }
  spans_.push_back(*std::move(span));
  return absl::OkStatus();
}

absl::StatusOr<ShmOutput> ShmCall::Output(absl::string_view field, const v1::SharedTensor& ref) {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(field,
                     ": shared memory is off: the server must be started with "
                     "--allow_client_shm"));
  }
  absl::StatusOr<RegionSpan> span =
      ViewRegion(*registry_, tenant_, field, ref.region(), ref.offset(), ref.byte_size());
  if (!span.ok()) return span.status();
  spans_.push_back(*span);
  ShmOutput out;
  out.span = *std::move(span);
  out.offset = ref.offset();
  out.ref = &ref;
  return out;
}

absl::Status ShmCall::CheckIntact() const {
  for (const RegionSpan& span : spans_) {
    if (absl::Status intact = span.region->CheckIntact(); !intact.ok()) return intact;
  }
  return absl::OkStatus();
}

absl::Status CheckOutputSize(absl::string_view field, const v1::SharedTensor& ref, int64_t bytes) {
  if (ref.byte_size() == static_cast<uint64_t>(bytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size: expected ", bytes,
                                                 " (the output's bytes), got ", ref.byte_size()));
}

void ShapeSharedTensor(int dtype, const std::vector<int64_t>& shape, const v1::SharedTensor& ref,
                       v1::Tensor* out) {
  out->set_dtype(static_cast<v1::DType>(dtype));
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->clear_data();
  *out->mutable_shm() = ref;
}

}  // namespace attnserve
