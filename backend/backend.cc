// The default, unpipelined AttentionBackend::StartForward and PlanAndForward;
// see backend.h.
#include "backend/backend.h"

#include <memory>
#include <new>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

// A launch that already ran and succeeded (a failed one is reported by
// StartForward itself): Finish only hands over its timings.
class CompletedLaunch final : public PendingLaunch {
 public:
  explicit CompletedLaunch(const BackendTimings& timings) : timings_(timings) {}
  absl::Status Finish(BackendTimings* timings) override {
    if (timings != nullptr) *timings = timings_;
    return absl::OkStatus();
  }

 private:
  BackendTimings timings_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PendingLaunch>> AttentionBackend::StartForward(
    const Plan& plan, const PackedBatch& batch) {
  BackendTimings timings;
  absl::Status status;
  if (batch.size() == 1) {
    status = Forward(plan, *batch.members().front(), &timings);
  } else {
    // Packing and unpacking are the copies a device backend does while
    // staging, so they count as the transfers.
    const absl::Time gather_start = absl::Now();
    std::unique_ptr<HostPackedBatch> packed_buffers;
    try {
      packed_buffers = std::make_unique<HostPackedBatch>(batch.members());
    } catch (const std::bad_alloc&) {
      // The contract: allocation failures are RESOURCE_EXHAUSTED, never thrown.
      return absl::ResourceExhaustedError("packing a batch: out of host memory");
    }
    HostPackedBatch& packed = *packed_buffers;
    const int64_t gather_us = absl::ToInt64Microseconds(absl::Now() - gather_start);
    status = Forward(plan, packed.params(), &timings);
    if (status.ok()) {
      const absl::Time scatter_start = absl::Now();
      packed.Scatter();
      timings.host_to_device_us += gather_us;
      timings.device_to_host_us += absl::ToInt64Microseconds(absl::Now() - scatter_start);
    }
  }
  // A failed launch wrote nothing a caller may use: report it now, as the
  // contract says, so the caller can rerun the members alone.
  if (!status.ok()) return status;
  return std::unique_ptr<PendingLaunch>(new CompletedLaunch(timings));
}

absl::Status PlanAndForward(AttentionBackend& backend, const AttnParams& params,
                            BackendTimings* timings) {
  ASSIGN_OR_RETURN(const Plan plan, backend.CanImplement(params));
  return backend.Forward(plan, params, timings);
}

// The paged path's defaults: a backend without one says so. (The packing
// default of StartPagedForward lands with PagedBatch's implementation.)
absl::StatusOr<void*> AttentionBackend::AllocateKvMemory(int64_t) {
  return absl::UnimplementedError("K/V caches: backend '" + Describe().name +
                                  "' has no paged path");
}
void AttentionBackend::FreeKvMemory(void*) {}
absl::Status AttentionBackend::PagedForward(const PagedAttnParams&, BackendTimings*) {
  return absl::UnimplementedError("K/V caches: backend '" + Describe().name +
                                  "' has no paged path");
}
absl::StatusOr<std::unique_ptr<PendingLaunch>> AttentionBackend::StartPagedForward(
    const PagedBatch&) {
  return absl::UnimplementedError("K/V caches: backend '" + Describe().name +
                                  "' has no paged path");
}

}  // namespace attnserve
