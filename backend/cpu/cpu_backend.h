// CpuBackend: the fused attention algorithm of DESIGN.md §3 on the host,
// multi-threaded over (sequence, query head, block of query rows). The
// embedded default where no GPU is usable, and the baseline of bench/cpu.
#pragma once

#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "backend/backend.h"
#include "common/thread_pool.h"

namespace attnserve {

class CpuBackend : public AttentionBackend {
 public:
  // `threads` >= 1 (MakeCpuBackend maps 0 to the hardware thread count).
  explicit CpuBackend(int threads);

  const BackendDescription& Describe() const override { return description_; }
  // Every valid combination runs here: the plan is the default (trivial) one.
  absl::StatusOr<Plan> CanImplement(const AttnParams& params) const override;
  absl::Status Forward(const Plan& plan, const AttnParams& params,
                       BackendTimings* timings) override;

 private:
  BackendDescription description_;
  std::mutex forward_mu_;  // the pool runs one Forward at a time
  ThreadPool pool_;
};

}  // namespace attnserve
