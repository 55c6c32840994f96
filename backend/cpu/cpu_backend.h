// CpuBackend: the fused attention algorithm of docs/design.md §3 on the host,
// multi-threaded over (sequence, query head, block of query rows). The
// embedded default where no GPU is usable, and the baseline of bench/cpu.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "backend/backend.h"
#include "common/thread_pool.h"

namespace attnserve {
namespace cpu {
class Scratch;
}  // namespace cpu

class CpuBackend : public AttentionBackend {
 public:
  // `threads` >= 1 (MakeCpuBackend maps 0 to the hardware thread count).
  explicit CpuBackend(int threads);

  const BackendDescription& Describe() const override { return description_; }
  // Every valid combination runs here, score modifiers and masks included
  // (dense and varlen): the plan is the default (trivial) one.
  absl::StatusOr<Plan> CanImplement(const AttnParams& params) const override;
  absl::Status Forward(const Plan& plan, const AttnParams& params,
                       BackendTimings* timings) override;

  // The paged K/V path (cpu_paged.cc): pages in host memory, read in place.
  absl::StatusOr<void*> AllocateKvMemory(int64_t bytes) override;
  void FreeKvMemory(void* memory) override;
  // CheckPagedParams (UNIMPLEMENTED for score modifiers and masks), then the
  // default (trivial) plan, as CanImplement.
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams& params) const override;
  absl::Status PagedForward(const Plan& plan, const PagedAttnParams& params,
                            BackendTimings* timings) override;

  // Plain heap memory (the kernels read host memory where it lies), counted
  // so that a test can see which tensors a front-end parsed into it.
  std::shared_ptr<char> AllocateHostTensor(int64_t bytes) override;
  struct HostTensorCounts {
    int64_t allocations = 0;  // since the backend was made
    int64_t bytes = 0;        // allocated since the backend was made
    int64_t live_bytes = 0;   // allocated and not yet freed
  };
  HostTensorCounts host_tensor_counts() const;

 private:
  struct HostTensorCounters {
    std::atomic<int64_t> allocations{0}, bytes{0}, live_bytes{0};
  };
  // Splits a call into (sequence, query head, query block) tasks and runs
  // `task` for each on the pool; the caller holds forward_mu_.
  using Task = std::function<void(int b, int h, int m_block, cpu::Scratch* scratch)>;
  absl::Status RunTasks(const AttnParams& params, const Task& task);

  BackendDescription description_;
  std::mutex forward_mu_;  // the pool runs one Forward at a time
  ThreadPool pool_;
  // Shared with the memory's deleters: a tensor may outlive the backend.
  const std::shared_ptr<HostTensorCounters> host_tensors_ = std::make_shared<HostTensorCounters>();
};

}  // namespace attnserve
