// Region spans as tensor views; see region_view.h.
#include "server/shm/region_view.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

TensorView RegionSpan::AsTensor(int dtype, absl::Span<const int64_t> shape) const {
  TensorView view;
  view.dtype = dtype;
  view.shape = shape;
  view.bytes = bytes();
  view.device = device;
  return view;
}

absl::StatusOr<RegionSpan> ViewRegion(const ShmRegistry& registry, const std::string& tenant,
                                      absl::string_view field, const std::string& region,
                                      uint64_t offset, uint64_t byte_size) {
  absl::StatusOr<std::shared_ptr<ShmRegion>> acquired =
      registry.Acquire(tenant, region, offset, byte_size);
  if (!acquired.ok()) {
    return absl::Status(acquired.status().code(),
                        absl::StrCat(field, ": ", acquired.status().message()));
  }
  RegionSpan span;
  span.size = byte_size;
  if (char* device_base = (*acquired)->device_ptr(); device_base != nullptr) {
    span.data = device_base + offset;
    span.device = (*acquired)->device();
  } else if (char* host_base = (*acquired)->mapped(); host_base != nullptr) {
    span.data = host_base + offset;
    if (reinterpret_cast<uintptr_t>(span.data) % kRegionSpanAlignment != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".offset: expected a span starting ", kRegionSpanAlignment,
                       "-byte aligned in region '", region, "', got offset ", offset));
    }
  } else {
    // Every region kind is either mapped here or device memory.
    return absl::InternalError(
        absl::StrCat(field, ": region '", region, "' is neither mapped nor device memory"));
  }
  span.region = *std::move(acquired);
  return span;
}

}  // namespace attnserve
