// The interface every compute backend implements (CPU, CUDA), and the
// description of a backend that GetServerInfo reports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "backend/paged_batch.h"
#include "backend/paged_kv.h"
#include "backend/params.h"
#include "backend/plan.h"
#include "backend/ragged_batch.h"

namespace attnserve {

// Where the time of one Forward call went, in microseconds.
struct BackendTimings {
  int64_t host_to_device_us = 0;
  int64_t compute_us = 0;
  int64_t device_to_host_us = 0;
};

struct DeviceDescription {
  int index = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int64_t total_memory_bytes = 0;
  // "0000:1b:00.0" style (cudaDeviceGetPCIBusId); empty for CPU. Names the
  // device to tools such as NVML, whose indices need not match CUDA's.
  std::string pci_bus_id;
};

struct BackendDescription {
  std::string name;  // "cpu" or "cuda": the value of ForwardResponse.backend
  std::vector<DeviceDescription> devices;
  std::vector<DType> dtypes;
  int min_head_dim = 8;
  int max_head_dim = 256;
  int head_dim_multiple = 8;
  int cpu_threads = 0;
};

// A launch started by AttentionBackend::StartForward and not yet finished.
class PendingLaunch {
 public:
  virtual ~PendingLaunch() = default;
  // Blocks until the launch is done, writes every member's o (and lse) and
  // returns the launch's status and timings. Called once.
  virtual absl::Status Finish(BackendTimings* timings) = 0;
  // Called from another thread while Finish blocks past the executor's
  // launch timeout (a device that stopped answering): true when, from now
  // on, the launch will touch no member's memory (its later Finish writes no
  // o or lse), so the executor may fail the members at once and let their
  // memory go. The default, false, keeps them until Finish returns.
  virtual bool Abandon() { return false; }
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual const BackendDescription& Describe() const = 0;

  // The one check of a call, and its plan: CheckParams (INVALID_ARGUMENT for
  // params that break the contract's invariants), then this backend's
  // decision, or UNIMPLEMENTED (naming what is missing) for a valid
  // combination it does not support. Forward and StartForward take the plan
  // and trust it: they check nothing again. Call it on params with outputs
  // bound (it checks them too).
  virtual absl::StatusOr<Plan> CanImplement(const AttnParams& params) const = 0;

  // Computes attention as `plan` (CanImplement's for these params) says.
  // Every pointer in `params` (q, k, v, o, lse, cu_seqlens) is HOST memory,
  // except a tensor params.devices places on a CUDA device (a backend that
  // cannot read it refuses in CanImplement: CheckHostTensors); a device
  // backend stages host memory itself. Writes all of o (and lse when non-null).
  // Never throws or aborts: device errors come back as INTERNAL, allocation
  // failures as RESOURCE_EXHAUSTED.
  // Calls may come from any thread, but not concurrently: the server's
  // executor serialises them per backend instance.
  virtual absl::Status Forward(const Plan& plan, const AttnParams& params,
                               BackendTimings* timings) = 0;

  // The pipelined form the server's executor uses. StartForward begins one
  // launch over `batch` (one request, or several that CanShareLaunch, outputs
  // bound) and may return before it completes; PendingLaunch::Finish waits for
  // it. `plan` is CanImplement's plan for the first member; members that
  // CanShareLaunch differ only in sizes, so a backend whose plan depends on
  // sizes re-plans the packed params once (without re-checking them).
  // Up to max_launches_in_flight() launches may be started and not yet
  // finished; StartForward is called from one thread at a time, Finish from
  // one (possibly other) thread, in the order the launches were started. The
  // members' memory must stay valid until Finish returns. An error from
  // StartForward means nothing is in flight and no output was written.
  // The default runs the launch at once through Forward (packing several
  // members into host buffers, with the members' plan), so a backend without
  // a pipeline and with size-independent plans needs nothing.
  virtual absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan& plan,
                                                                      const PackedBatch& batch);
  virtual int max_launches_in_flight() const { return 1; }

  // --- K/V that live on the server (paged_kv.h, DESIGN §6) ---
  // The defaults answer UNIMPLEMENTED, so a backend without a paged path says so.

  // One slab of `bytes` bytes of this backend's memory (device memory for a
  // GPU backend) for K or V pages, or RESOURCE_EXHAUSTED. The pool frees it
  // with FreeKvMemory once no launch that reads it is in flight.
  virtual absl::StatusOr<void*> AllocateKvMemory(int64_t bytes);
  virtual void FreeKvMemory(void* memory);
  // Copies between host memory and K/V memory (AllocateKvMemory's), waited
  // for: moving sequences between servers reads pinned pages and writes
  // staged ones, which no launch touches. The defaults copy host memory
  // (what a backend whose K/V memory is host memory needs).
  virtual absl::Status CopyFromKvMemory(void* host, const void* kv, int64_t bytes);
  virtual absl::Status CopyToKvMemory(void* kv, const void* host, int64_t bytes);

  // `bytes` of host memory for a call's input or output tensor that this
  // backend's launches read and write without staging it first (page-locked
  // memory for a GPU backend, so one DMA moves it), not zeroed; null when
  // none is left. Front-ends parse tensors into it and send outputs from it.
  // Usable from any thread and on every device of the server; the memory may
  // outlive the backend. The default is plain heap memory.
  virtual std::shared_ptr<char> AllocateHostTensor(int64_t bytes);

  // The one check of an append-and-attend call, and its plan, as CanImplement
  // for dense calls: CheckPagedParams (INVALID_ARGUMENT for params that would
  // reach outside the cache's pages or break the contract), then this
  // backend's decision, or UNIMPLEMENTED. PagedForward and StartPagedForward
  // take the plan and trust it. Call it on params with outputs bound and the
  // block table filled (host memory: it reads every row the lengths cover).
  virtual absl::StatusOr<Plan> CanImplementPaged(const PagedAttnParams& params) const;

  // One append-and-attend launch as `plan` (CanImplementPaged's for these
  // params) says, over host-memory inputs (everything but params.pages, which
  // is this backend's memory), waited for; the order of work is paged_kv.h's
  // (page copies, append, attend). Writes all of o (and lse). An error means
  // no visible output; appended rows may have been written past the
  // sequences' old lengths (the pool does not count them).
  virtual absl::Status PagedForward(const Plan& plan, const PagedAttnParams& params,
                                    BackendTimings* timings);

  // The pipelined form, as StartForward: one launch over `batch` (calls of one
  // cache and layer that CanSharePagedLaunch), `plan` CanImplementPaged's for
  // the first member (a backend whose plan depends on sizes re-plans the
  // packed params once, without re-checking them). Paged launches of one
  // backend run in the order they were started (a later launch may read rows
  // an earlier one appended). The default packs several members into host
  // buffers and runs PagedForward with `plan`, so a backend without a
  // pipeline and with size-independent plans needs nothing.
  virtual absl::StatusOr<std::unique_ptr<PendingLaunch>> StartPagedForward(const Plan& plan,
                                                                           const PagedBatch& batch);
};

// OK when every tensor of `params` is host memory; otherwise UNIMPLEMENTED
// naming the first one in device memory, for backends that read host memory
// only (`backend` names the backend in the message).
inline absl::Status CheckHostTensors(const AttnParams& params, const char* backend) {
  const TensorDevices& d = params.devices;
  const std::pair<const char*, int32_t> tensors[] = {
      {"q", d.q}, {"k", d.k}, {"v", d.v}, {"o", d.o}, {"lse", d.lse}};
  for (const auto& [name, device] : tensors) {
    if (device == kHostMemory) continue;
    return absl::UnimplementedError(absl::StrCat(
        backend, ": ", name, " is memory of CUDA device ", device,
        " (a CUDA shared-memory region); this backend reads and writes host memory only: "
        "use a system shared-memory region or the message"));
  }
  return absl::OkStatus();
}

// CanImplement, then Forward with its plan: for callers that run one call
// outside the server (tests, benchmarks, tools).
absl::Status PlanAndForward(AttentionBackend& backend, const AttnParams& params,
                            BackendTimings* timings);
// The same for one paged call: CanImplementPaged, then PagedForward.
absl::Status PlanAndPagedForward(AttentionBackend& backend, const PagedAttnParams& params,
                                 BackendTimings* timings);

}  // namespace attnserve
