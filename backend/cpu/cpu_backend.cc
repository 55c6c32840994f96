// CpuBackend (see cpu_backend.h) and MakeCpuBackend: splits
// the call into (sequence, head, query-block) tasks and runs them on the pool.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <new>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "backend/check_params.h"
#include "backend/cpu/cpu_attention_kernel.h"
#include "common/status_macros.h"

namespace attnserve {

CpuBackend::CpuBackend(int threads) : pool_(std::max(1, threads)) {
  description_.name = "cpu";
  // FP8_E4M3 codes are dequantised (code x descale) as the rows are loaded.
  description_.dtypes = {DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP8E4M3};
  description_.cpu_threads = pool_.num_threads();
}

absl::StatusOr<Plan> CpuBackend::CanImplement(const AttnParams& params) const {
  // Every valid combination runs here: the checks are the contract's.
  RETURN_IF_ERROR(CheckParams(params));
  RETURN_IF_ERROR(CheckHostTensors(params, "cpu"));
  return Plan();
}

absl::Status CpuBackend::Forward(const Plan& /*plan*/, const AttnParams& params,
                                 BackendTimings* timings) {
  std::lock_guard<std::mutex> lock(forward_mu_);
  const auto start = std::chrono::steady_clock::now();
  // The varlen modifier offsets, once per call (not per task).
  cpu::SeqPrefix prefix;
  if (!prefix.Build(params)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate the per-sequence offsets for batch ", params.batch));
  }
  RETURN_IF_ERROR(
      RunTasks(params, [&params, &prefix](int b, int h, int m_block, cpu::Scratch* scratch) {
        cpu::AttentionTask(params, prefix, b, h, m_block, scratch);
      }));
  if (timings != nullptr) {
    timings->compute_us = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count();
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::RunTasks(const AttnParams& params, const Task& run_task) {
  // tasks_before[b]: tasks of sequences < b; sequence b has
  // Hq × ceil(Sq_b / kBlockM) tasks (none for an empty query sequence).
  const int batch = params.batch;
  std::unique_ptr<int64_t[]> tasks_before(new (std::nothrow) int64_t[batch + 1]);
  if (!tasks_before) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot allocate the task table for batch ", batch));
  }
  tasks_before[0] = 0;
  for (int b = 0; b < batch; ++b) {
    const int64_t m_blocks = (SeqLenQ(params, b) + cpu::kBlockM - 1) / cpu::kBlockM;
    tasks_before[b + 1] = tasks_before[b] + m_blocks * params.num_heads_q;
  }
  const int64_t num_tasks = tasks_before[batch];

  // Each worker allocates its scratch on its first task, so a call with few
  // tasks costs only the tiles of the threads that actually ran.
  std::vector<std::unique_ptr<cpu::Scratch>> scratch(num_tasks > 0 ? pool_.num_threads() : 0);
  std::atomic<bool> out_of_memory{false};
  pool_.Run(num_tasks, [&](int worker, int64_t task) {
    std::unique_ptr<cpu::Scratch>& mine = scratch[worker];
    if (!mine) {
      mine = cpu::Scratch::Create(params.head_dim, HeadDimV(params));
      if (!mine) {
        out_of_memory.store(true, std::memory_order_relaxed);
        return;
      }
    }
    const int b = static_cast<int>(
        std::upper_bound(tasks_before.get(), tasks_before.get() + batch + 1, task) -
        tasks_before.get() - 1);
    const int64_t m_blocks = (SeqLenQ(params, b) + cpu::kBlockM - 1) / cpu::kBlockM;
    const int64_t rem = task - tasks_before[b];
    const int h = static_cast<int>(rem / m_blocks);
    // Last query blocks first: under a causal mask they see the most keys, and
    // starting the longest tasks first evens out the threads' finishing times.
    const int m_block = static_cast<int>(m_blocks - 1 - rem % m_blocks);
    run_task(b, h, m_block, mine.get());
  });
  if (out_of_memory.load()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate ", cpu::Scratch::BytesFor(params.head_dim, HeadDimV(params)),
        " bytes of per-thread scratch"));
  }
  return absl::OkStatus();
}

std::unique_ptr<AttentionBackend> MakeCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace attnserve
