// attnserve.v1 tensors that name spans of registered shared-memory regions
// (Tensor.shm, OutputRegions) as the core's views: the bounds, tenancy and
// lifetime rules are server/shm/region_view.h's (ShmRegistry::Acquire), the
// same as KServe v2's. What is added here is the native API's part: the field
// names, byte_size against the tensor's own size, data and shm both set, and
// which spans are read where they lie and which are copied.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "server/core/call.h"
#include "server/shm/region_view.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

// How a span of one tensor reaches the core.
enum class ShmRead {
  kInPlace,      // where it lies: host bytes of a mapped region, device bytes of a CUDA one
  kHostInPlace,  // a mapped region's bytes where they lie; a CUDA region's copied to the host
  kCopyHost,     // a mapped region's bytes copied (a shrink fails the copy, not a later
                 // commit); a CUDA region's on the device
  kCopy,         // copied to the host from either kind
};

// An output span: where the backend (or the front-end, after the call)
// writes o or lse instead of into the response.
struct ShmOutput {
  RegionSpan span;
  uint64_t offset = 0;  // in the region, for ShmRegion::Write
  const v1::SharedTensor* ref = nullptr;
};

// The shared-memory side of one call: the spans it reads and writes and the
// references that keep their regions open. Held until the call's completion
// has run.
class ShmCall {
 public:
  ShmCall(const ShmRegistry* registry, std::string tenant)
      : registry_(registry), tenant_(std::move(tenant)) {}

  // Sets *view to `tensor`'s bytes when it names a span (tensor.shm set);
  // leaves it alone otherwise. `field` is the wire name ("q",
  // "options.bias"). INVALID_ARGUMENT naming `<field>.shm...` for data and
  // shm both set, a byte_size other than the tensor's bytes, an unknown
  // region or a span outside it; FAILED_PRECONDITION for a server without
  // --allow_client_shm or a region no longer intact. Adds the span's bytes
  // to *request_bytes (read in place or copied, they count like received
  // bytes toward --max_request_bytes and the tenant's in-flight quota).
  absl::Status Input(absl::string_view field, const v1::Tensor& tensor, ShmRead how,
                     TensorView* view, int64_t* request_bytes);

  // The span `ref` names as an output (`field`: "output_shm.o"); byte_size is
  // checked against the output when its size is known (CheckOutputSize).
  absl::StatusOr<ShmOutput> Output(absl::string_view field, const v1::SharedTensor& ref);

  // The first region of this call no longer intact (shrunk by its owner
  // while the call used it), as FAILED_PRECONDITION naming it.
  absl::Status CheckIntact() const;

  bool any() const { return !spans_.empty(); }

 private:
  const ShmRegistry* const registry_;
  const std::string tenant_;
  std::vector<RegionSpan> spans_;  // every span this call holds
  std::list<std::string> copies_;  // bytes copied out of regions (views point here)
};

// INVALID_ARGUMENT "<field>.byte_size: ..." unless `ref` is exactly `bytes`
// (what the output holds).
absl::Status CheckOutputSize(absl::string_view field, const v1::SharedTensor& ref, int64_t bytes);

// Makes `out` a tensor of `dtype` and `shape` whose bytes lie in `ref`'s span.
void ShapeSharedTensor(int dtype, const std::vector<int64_t>& shape, const v1::SharedTensor& ref,
                       v1::Tensor* out);

}  // namespace attnserve
