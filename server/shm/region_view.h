// A span of a registered shared-memory region as the core's tensor view:
// host bytes where a system region is mapped here, device bytes where a CUDA
// region lies (the backend reads and writes those where they are: no host
// copy). Every front-end that names spans of regions (attnserve.v1's
// SharedTensor, KServe v2's shared_memory_* parameters) goes through here, so
// the bounds, tenancy and lifetime rules are ShmRegistry::Acquire's for all.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/core/call.h"
#include "server/shm/shm_region.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

// Host spans start at a multiple of this: the widest element a backend reads
// or writes on the host (FP32, and LSE), so no kernel sees a misaligned one.
// Device spans may start anywhere (the CUDA backend copies a misaligned one
// within the device).
inline constexpr uint64_t kRegionSpanAlignment = 4;

// [offset, offset + size) of a region, and the reference that keeps the
// region open while a call reads or writes it (hold it until the call's
// completion has run).
struct RegionSpan {
  std::shared_ptr<ShmRegion> region;
  // The span's first byte: a host address (system region, device
  // kHostMemory) or a device address on `device` (CUDA region).
  char* data = nullptr;
  uint64_t size = 0;
  int device = kHostMemory;

  bool on_device() const { return device != kHostMemory; }
  absl::string_view bytes() const { return absl::string_view(data, size); }
  // The span as an input tensor of `dtype` (the wire's code) and `shape`
  // (which must outlive the view, like the span).
  TensorView AsTensor(int dtype, absl::Span<const int64_t> shape) const;
};

// The tenant's region `region`, [offset, offset + byte_size) of it, as a
// span. `field` names the span in errors (e.g. "q.shm", "output_shm.o"):
// INVALID_ARGUMENT "<field>: ..." for an unknown region or a span outside it
// (ShmRegistry::Acquire's message after the field), FAILED_PRECONDITION for
// a region no longer intact or a server that takes no shared memory,
// INVALID_ARGUMENT "<field>.offset: ..." for a host span not aligned to
// kRegionSpanAlignment. Checks nothing about what the bytes hold: the caller
// compares byte_size with its tensor's size.
absl::StatusOr<RegionSpan> ViewRegion(const ShmRegistry& registry, const std::string& tenant,
                                      absl::string_view field, const std::string& region,
                                      uint64_t offset, uint64_t byte_size);

}  // namespace attnserve
