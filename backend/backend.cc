// The default, unpipelined AttentionBackend::StartForward and PlanAndForward;
// see backend.h.
#include "backend/backend.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

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

absl::Status NoPagedPath(const AttentionBackend& backend) {
  return absl::UnimplementedError("K/V caches: backend '" + backend.Describe().name +
                                  "' has no paged path");
}

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

absl::Status PlanAndPagedForward(AttentionBackend& backend, const PagedAttnParams& params,
                                 BackendTimings* timings) {
  ASSIGN_OR_RETURN(const Plan plan, backend.CanImplementPaged(params));
  return backend.PagedForward(plan, params, timings);
}

// The paged path's defaults: a backend without one says so.
absl::StatusOr<void*> AttentionBackend::AllocateKvMemory(int64_t) { return NoPagedPath(*this); }
void AttentionBackend::FreeKvMemory(void*) {}
absl::Status AttentionBackend::CopyFromKvMemory(void* host, const void* kv, int64_t bytes) {
  if (bytes > 0) std::memcpy(host, kv, static_cast<size_t>(bytes));
  return absl::OkStatus();
}
absl::Status AttentionBackend::CopyToKvMemory(void* kv, const void* host, int64_t bytes) {
  if (bytes > 0) std::memcpy(kv, host, static_cast<size_t>(bytes));
  return absl::OkStatus();
}
std::shared_ptr<char> AttentionBackend::AllocateHostTensor(int64_t bytes) {
  if (bytes < 0) return nullptr;
  char* p = new (std::nothrow) char[static_cast<size_t>(std::max<int64_t>(bytes, 1))];
  if (p == nullptr) return nullptr;
  return std::shared_ptr<char>(p, std::default_delete<char[]>());
}
absl::StatusOr<Plan> AttentionBackend::CanImplementPaged(const PagedAttnParams&) const {
  return NoPagedPath(*this);
}
absl::Status AttentionBackend::PagedForward(const Plan&, const PagedAttnParams&, BackendTimings*) {
  return NoPagedPath(*this);
}

absl::StatusOr<std::unique_ptr<PendingLaunch>> AttentionBackend::StartPagedForward(
    const Plan& plan, const PagedBatch& batch) {
  BackendTimings timings;
  if (batch.size() == 1) {
    RETURN_IF_ERROR(PagedForward(plan, *batch.members().front(), &timings));
    return std::unique_ptr<PendingLaunch>(new CompletedLaunch(timings));
  }
  // Several calls of one cache layer: pack them into host buffers (the copies
  // a device backend does while staging, so they count as the transfers).
  const absl::Time gather_start = absl::Now();
  std::vector<char> q, k, v, o;
  std::vector<float> lse, k_scale, v_scale;
  std::vector<int32_t> cu_q, cu_k, table, seqlens, copy_src, copy_dst;
  PagedBuffers buffers;
  try {
    q.resize(size_t(batch.q_bytes()));
    o.resize(size_t(batch.o_bytes()));
    k.resize(size_t(batch.kv_new_bytes()));
    v.resize(size_t(batch.v_new_bytes()));
    lse.resize(size_t(batch.lse_bytes() / 4));
    k_scale.resize(size_t(batch.kv_scale_bytes() / 4));
    v_scale.resize(k_scale.size());
    cu_q.resize(size_t(batch.cu_seqlens_bytes() / 4));
    cu_k.resize(cu_q.size());
    table.resize(size_t(batch.block_table_bytes() / 4));
    seqlens.resize(size_t(batch.seqlens_bytes() / 4));
    copy_src.resize(size_t(batch.copies_bytes() / 4));
    copy_dst.resize(copy_src.size());
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("packing a paged batch: out of host memory");
  }
  buffers.q = q.data();
  buffers.k_new = k.data();
  buffers.v_new = v.data();
  buffers.o = o.data();
  buffers.lse = lse.data();
  buffers.k_scale = k_scale.data();
  buffers.v_scale = v_scale.data();
  buffers.cu_seqlens_q = cu_q.data();
  buffers.cu_seqlens_k = cu_k.data();
  buffers.block_table = table.data();
  buffers.seqlens_k = seqlens.data();
  buffers.copy_src = copy_src.data();
  buffers.copy_dst = copy_dst.data();
  const PagedAttnParams packed = batch.Gather(buffers);
  const int64_t gather_us = absl::ToInt64Microseconds(absl::Now() - gather_start);
  // The members differ only in sizes (CanSharePagedLaunch): the first one's
  // plan serves a backend whose plans do not depend on sizes.
  RETURN_IF_ERROR(PagedForward(plan, packed, &timings));
  const absl::Time scatter_start = absl::Now();
  batch.Scatter(o.data(), lse.data());
  timings.host_to_device_us += gather_us;
  timings.device_to_host_us += absl::ToInt64Microseconds(absl::Now() - scatter_start);
  return std::unique_ptr<PendingLaunch>(new CompletedLaunch(timings));
}

}  // namespace attnserve
