// CudaBackend: the AttentionBackend that runs the fused CUDA kernels on one
// device, as a pipeline of staging slots so that consecutive launches overlap.
//
// Each slot owns a stream, a pinned host staging buffer, a device buffer, a
// split-KV workspace and four events. A launch packs its requests' inputs
// straight into a free slot's pinned buffer (PackedBatch::Gather), then queues
// one host-to-device copy, the kernel(s) and one device-to-host copy on the
// slot's stream and returns; Finish waits for that stream and copies the
// outputs out to each request (PackedBatch::Scatter). With kPipelineDepth
// slots, launch n+1 is packed and copied in while launch n computes and
// launch n-1 is copied out. Buffers grow to the largest launch seen and are
// reused, so steady-state serving allocates nothing; memory is bounded by
// kPipelineDepth x (largest launch) of pinned host and of device memory.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "common/thread_pool.h"

namespace attnserve {

class PinnedHostPool;

class CudaBackend final : public AttentionBackend {
 public:
  // Three slots keep every stage busy: one packing (host), one copying in or
  // computing (device), one copying out and scattering (host, another thread).
  static constexpr int kPipelineDepth = 3;

  // UNAVAILABLE when `device` does not exist or cannot be initialised.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;

  const BackendDescription& Describe() const override { return description_; }
  // CheckParams, then PlanForward's plan (FP32: the SIMT kernel, any head
  // dim). UNIMPLEMENTED in two documented cases: no compiled kernel at or
  // above params.head_dim (ATTNSERVE_CUDA_KERNELS=dev builds 128 only), or a
  // tile that needs more shared memory than this device allows per CTA
  // (head dims 192/256 on sm86/sm89).
  absl::StatusOr<Plan> CanImplement(const AttnParams& params) const override;
  // One launch of `params` through the pipeline, waited for.
  absl::Status Forward(const Plan& plan, const AttnParams& params,
                       BackendTimings* timings) override;
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan& plan,
                                                              const PackedBatch& batch) override;
  int max_launches_in_flight() const override { return kPipelineDepth; }

  // Paged K/V (cuda_paged.cc). Paged launches share the slots with Forward's;
  // each queues its H2D copy on its slot's stream, then waits (an event) for
  // the previous paged launch's kernels before its own page copies, append
  // and attention, so paged kernels run in start order while copies overlap.
  absl::StatusOr<void*> AllocateKvMemory(int64_t bytes) override;
  void FreeKvMemory(void* memory) override;
  absl::Status CopyFromKvMemory(void* host, const void* kv, int64_t bytes) override;
  absl::Status CopyToKvMemory(void* kv, const void* host, int64_t bytes) override;
  // CheckPagedParams (keeps the kernels inside the cache's memory), then the
  // plan of the paged kernel (PlanFor over pages; FP32: the SIMT kernel), or
  // UNIMPLEMENTED as CanImplement. The launch runs this plan.
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams& params) const override;
  absl::Status PagedForward(const Plan& plan, const PagedAttnParams& params,
                            BackendTimings* timings) override;
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartPagedForward(
      const Plan& plan, const PagedBatch& batch) override;
  // Page-locked memory from a pool (pinned_host_pool.h): a tensor parsed
  // into it goes to the device in one DMA, and an o sent from it is written
  // by the device-to-host copy itself. Small tensors get heap memory.
  std::shared_ptr<char> AllocateHostTensor(int64_t bytes) override;

  // A pipeline slot and a launch queued on one (cuda_staging.h; internal to
  // the backend's .cc files).
  struct Slot;
  class Launch;
  // An input tensor of a launch's lone member in device memory
  // (TensorDevices): `ptr` on `device`. The staged launch reads it where it
  // lies when it is on the backend's device and aligned, else copies it into
  // its place in the device buffer (one peer copy from another device).
  struct DeviceInput {
    const void* ptr;
    int device;
  };
  // A member's output that lies in host memory, and where the launch's
  // device buffer holds it (`offset` bytes in): the staged launch copies it
  // there from the device straight when it is page-locked and large, else
  // through the pinned staging buffer as before.
  struct HostOutput {
    void* dst;
    int64_t offset;
    int64_t bytes;
  };

 private:
  CudaBackend() = default;
  // Blocks until a slot is free (the executor keeps at most kPipelineDepth
  // launches open, so in the server this does not wait).
  Slot* AcquireSlot();
  void ReleaseSlot(Slot* slot);
  // The staging pipeline of StartForward and StartPagedForward (defined in
  // cuda_staging.h): a free slot, Layout(batch)'s buffers, the members
  // gathered into pinned memory, one H2D copy, kernels(device params, slot),
  // one D2H copy; the Launch's Finish scatters. rebase(params, host, device)
  // moves the gathered params' pointers from the pinned to the device buffer.
  // `device_inputs`: inputs of a lone member that lie in device memory
  // (DeviceInput); the gather leaves them out of the pinned buffer.
  // `host_outputs`: the members' outputs that may be written straight from
  // the device (HostOutput); the scatter leaves those it wrote out.
  template <typename Layout, typename Batch, typename Rebase, typename Kernels>
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartStaged(
      const Batch& batch, Rebase rebase, Kernels kernels,
      const std::vector<DeviceInput>& device_inputs = {},
      const std::vector<HostOutput>& host_outputs = {});
  // One call with tensors in device memory (params.devices), alone in its
  // launch: those on this device are read and written where they lie (no
  // copy; a misaligned one is copied within the device), those on another
  // device go through one peer copy each way; host tensors are staged as
  // StartStaged stages them.
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartDirect(const Plan& plan,
                                                             const AttnParams& params);
  // The plan for FP16/BF16 params (PlanForward; FP8 params are planned as
  // their BF16 view, the kernel that runs them), or UNIMPLEMENTED when this
  // build or this device has no kernel for them. Checks nothing else.
  // The Hopper family serves what it covers when the device has it
  // (allow_sm90_); kv: the request's K/V or a cache's pages (CudaPaged).
  absl::StatusOr<Plan> PlanFor(const AttnParams& params,
                               cuda::KvRows kv = cuda::KvRows::kTensors) const;
  // Queues the kernel(s) for device-resident `dev` on the slot's stream.
  absl::Status LaunchKernels(const Plan& plan, const AttnParams& dev, Slot* slot);
  // Queues a paged launch's kernels (page copies, append, attention as
  // `plan` says) for device-resident `dev` on the slot's stream.
  absl::Status LaunchPagedKernels(const Plan& plan, const PagedAttnParams& dev, Slot* slot);

  int device_ = 0;
  int num_sms_ = 0;
  int max_smem_per_block_ = 0;  // opt-in dynamic shared memory per CTA
  // cuda::DeviceRunsSm90Kernels: plans may take the Hopper kernels (what
  // they cover: PlanForward).
  bool allow_sm90_ = false;
  BackendDescription description_;
  std::unique_ptr<Slot> slots_[kPipelineDepth];
  // Packing into and unpacking out of the pinned buffers, in parallel: one
  // pool for StartForward's thread and one for Finish's, which run at once.
  std::unique_ptr<ThreadPool> gather_pool_;
  std::unique_ptr<ThreadPool> scatter_pool_;
  std::mutex slots_mu_;
  std::condition_variable slot_freed_;
  // Recorded after each paged launch's kernels; the next paged launch's
  // stream waits for it (StartPagedForward is called from one thread at a
  // time, so "the previous" is well defined). Created on first use.
  cudaEvent_t paged_done_ = nullptr;
  // Shared with the blocks it hands out, which may outlive the backend.
  std::shared_ptr<PinnedHostPool> host_tensors_;
};

}  // namespace attnserve
