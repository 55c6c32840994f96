// CudaBackend: the AttentionBackend that runs the fused CUDA kernels on one
// device. It stages the host tensors of a request into device buffers it keeps
// and grows across requests, runs on its own stream and times each phase with
// CUDA events.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"

namespace attnserve {

class CudaBackend final : public AttentionBackend {
 public:
  // UNAVAILABLE when `device` does not exist or cannot be initialised.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;

  const BackendDescription& Describe() const override { return description_; }
  absl::Status CanImplement(const AttnParams& params) const override;
  absl::Status Forward(const AttnParams& params, BackendTimings* timings) override;

  // Device-resident forward: every pointer in `dev` is device memory (the
  // benchmark and the tests of the kernels themselves use this). Runs on the
  // backend's stream and does not synchronise it.
  absl::Status ForwardDevice(const AttnParams& dev);
  cudaStream_t stream() const { return stream_; }

 private:
  CudaBackend() = default;
  absl::Status EnsureCapacity(int64_t bytes);
  absl::Status EnsureWorkspace(int64_t bytes);

  int device_ = 0;
  int num_sms_ = 0;
  int max_smem_per_block_ = 0;  // opt-in dynamic shared memory per CTA
  BackendDescription description_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t events_[4] = {nullptr, nullptr, nullptr, nullptr};
  void* buffer_ = nullptr;  // staging for q, k, v, o, lse, cu_seqlens
  int64_t buffer_bytes_ = 0;
  void* workspace_ = nullptr;  // split-KV partials
  int64_t workspace_bytes_ = 0;
};

}  // namespace attnserve
