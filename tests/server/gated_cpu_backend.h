// The real CPU backend behind a gate, for server tests: Close() holds every
// Forward until Open() (to fill the queue or keep a request in flight), calls
// and paged plans are counted, softcap can be declared unsupported
// (UNIMPLEMENTED from CanImplement), and launches over a number of query rows
// can fail as a device out-of-memory would.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/cpu/cpu_backend.h"

namespace attnserve {

// The CPU backend counting its paged plans. Any re-plan goes through the
// virtual CanImplementPaged, from the backend itself or from a wrapper.
class PlanCountingCpuBackend final : public CpuBackend {
 public:
  explicit PlanCountingCpuBackend(int threads) : CpuBackend(threads) {}
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams& p) const override {
    paged_plans_.fetch_add(1, std::memory_order_relaxed);
    return CpuBackend::CanImplementPaged(p);
  }
  int paged_plans() const { return paged_plans_.load(std::memory_order_relaxed); }

 private:
  mutable std::atomic<int> paged_plans_{0};
};

class GatedCpuBackend : public AttentionBackend {
 public:
  explicit GatedCpuBackend(bool softcap_unimplemented = false)
      : inner_(std::make_unique<PlanCountingCpuBackend>(2)),
        softcap_unimplemented_(softcap_unimplemented) {}

  const BackendDescription& Describe() const override { return inner_->Describe(); }

  absl::StatusOr<Plan> CanImplement(const AttnParams& p) const override {
    if (softcap_unimplemented_ && p.softcap != 0.0f) {
      return absl::UnimplementedError("softcap: not supported by this backend build");
    }
    return inner_->CanImplement(p);
  }

  absl::Status Forward(const Plan& plan, const AttnParams& p, BackendTimings* timings) override {
    {
      absl::MutexLock lock(&mu_);
      ++calls_;
      launch_rows_.push_back(p.total_q);
      mu_.Await(absl::Condition(&open_));
    }
    if (oom_over_rows >= 0 && p.total_q > oom_over_rows) {
      return absl::ResourceExhaustedError("device out of memory (simulated)");
    }
    return inner_->Forward(plan, p, timings);
  }

  // The paged path: the inner backend's memory; launches gated and counted
  // like Forward, failing as an out-of-memory would when paged_fail is set.
  absl::StatusOr<void*> AllocateKvMemory(int64_t bytes) override {
    return inner_->AllocateKvMemory(bytes);
  }
  void FreeKvMemory(void* memory) override { inner_->FreeKvMemory(memory); }
  absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams& p) const override {
    return inner_->CanImplementPaged(p);
  }
  absl::Status PagedForward(const Plan& plan, const PagedAttnParams& p,
                            BackendTimings* timings) override {
    {
      absl::MutexLock lock(&mu_);
      ++calls_;
      ++paged_launches_;
      mu_.Await(absl::Condition(&open_));
    }
    if (paged_fail) return absl::ResourceExhaustedError("device out of memory (simulated)");
    return inner_->PagedForward(plan, p, timings);
  }

  // Launches over this many query rows fail with RESOURCE_EXHAUSTED; -1: never.
  int64_t oom_over_rows = -1;
  std::atomic<bool> paged_fail{false};

  void Close() {
    absl::MutexLock lock(&mu_);
    open_ = false;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // Query rows (total_q) of each Forward launch, in the order they began.
  std::vector<int64_t> launch_rows() {
    absl::MutexLock lock(&mu_);
    return launch_rows_;
  }
  // PagedForward calls begun, and CanImplementPaged plans made.
  int paged_launches() {
    absl::MutexLock lock(&mu_);
    return paged_launches_;
  }
  int paged_plans() const { return inner_->paged_plans(); }
  // Waits until `n` Forward calls have begun (held ones included).
  void AwaitCalls(int n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return calls_ >= n; };
    mu_.Await(absl::Condition(&enough));
  }

 private:
  std::unique_ptr<PlanCountingCpuBackend> inner_;
  const bool softcap_unimplemented_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int paged_launches_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> launch_rows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
