// CudaBackend's paged K/V path (paged_kv.h, DESIGN §6): K/V slabs in device
// memory, and append-and-attend launches staged like Forward's (one H2D copy
// of every host input, the kernels, one D2H copy) on the pipeline's slots.
// Order on the device for one launch: page copies (copy-on-write), append of
// the new rows into their pages, attention over the pages (split-KV combined in the same launch).
// Paged launches of one backend run in start order: each waits, on its slot's
// stream, for the event the previous paged launch recorded after its kernels
// (so its H2D copy still overlaps the previous launch's compute).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/check_paged_params.h"
#include "backend/check_params.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_staging.h"
#include "backend/cuda/paged_attn.h"
#include "backend/cuda/paged_attn_fp8.h"
#include "backend/cuda/paged_mla.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

// Offsets of a paged launch's tensors in a slot's buffers, 256-byte aligned:
// inputs (q | k_new | v_new | cu_q | cu_k | block table | seqlens | copy
// src | copy dst | ALiBi slopes and sinks: the first member's, which every
// member shares, CanSharePagedLaunch), then outputs (o | lse).
struct PagedLayout {
  int64_t q = 0, k = 0, v = 0, k_scale = 0, v_scale = 0, cu_q = 0, cu_k = 0, table = 0, seqlens = 0,
          copy_src = 0, copy_dst = 0;
  ScoreModArrays mods;
  int64_t inputs_end = 0, o = 0, lse = 0, end = 0;

  explicit PagedLayout(const PagedBatch& batch) {
    StagingOffsets off;
    q = off.Take(batch.q_bytes());
    k = off.Take(batch.kv_new_bytes());
    v = off.Take(batch.kv_new_bytes());
    k_scale = off.Take(batch.kv_scale_bytes());  // FP8 rows' scales, when given
    v_scale = off.Take(batch.kv_scale_bytes());
    cu_q = off.Take(batch.cu_seqlens_bytes());
    cu_k = off.Take(batch.cu_seqlens_bytes());
    table = off.Take(batch.block_table_bytes());
    seqlens = off.Take(batch.seqlens_bytes());
    copy_src = off.Take(batch.copies_bytes());
    copy_dst = off.Take(batch.copies_bytes());
    mods = ScoreModArrays(batch.members().front()->attn, &off);
    inputs_end = off.end();
    o = off.Take(batch.q_bytes());
    lse = off.Take(batch.lse_bytes());
    end = std::max<int64_t>(off.end(), 256);
  }

  PagedBuffers In(char* base) const {
    PagedBuffers b;
    b.q = base + q;
    b.k_new = base + k;
    b.v_new = base + v;
    b.k_scale = reinterpret_cast<float*>(base + k_scale);
    b.v_scale = reinterpret_cast<float*>(base + v_scale);
    b.o = base + o;
    b.lse = reinterpret_cast<float*>(base + lse);
    b.cu_seqlens_q = reinterpret_cast<int32_t*>(base + cu_q);
    b.cu_seqlens_k = reinterpret_cast<int32_t*>(base + cu_k);
    b.block_table = reinterpret_cast<int32_t*>(base + table);
    b.seqlens_k = reinterpret_cast<int32_t*>(base + seqlens);
    b.copy_src = reinterpret_cast<int32_t*>(base + copy_src);
    b.copy_dst = reinterpret_cast<int32_t*>(base + copy_dst);
    return b;
  }
};

// The same params with every staged pointer moved from `from` to `to`.
PagedAttnParams RebasePaged(const PagedAttnParams& p, const char* from, char* to) {
  PagedAttnParams d = p;
  d.attn = RebaseAttnParams(p.attn, from, to);
  d.block_table = Rebased(p.block_table, from, to);
  d.seqlens_k = Rebased(p.seqlens_k, from, to);
  d.copy_src = Rebased(p.copy_src, from, to);
  d.copy_dst = Rebased(p.copy_dst, from, to);
  d.k_new_scale = Rebased(p.k_new_scale, from, to);
  d.v_new_scale = Rebased(p.v_new_scale, from, to);
  return d;
}

}  // namespace

absl::StatusOr<void*> CudaBackend::AllocateKvMemory(int64_t bytes) {
  if (bytes <= 0)
    return absl::InvalidArgumentError(absl::StrCat("kv memory bytes: expected > 0, got ", bytes));
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  void* p = nullptr;
  // CudaError maps cudaErrorMemoryAllocation to RESOURCE_EXHAUSTED and clears it.
  ATTN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, static_cast<size_t>(bytes)), "K/V slab");
  return p;
}

void CudaBackend::FreeKvMemory(void* memory) {
  if (memory == nullptr) return;
  cudaSetDevice(device_);
  cudaFree(memory);  // synchronises the device: no launch reads the slab any more
}

absl::Status CudaBackend::CopyFromKvMemory(void* host, const void* kv, int64_t bytes) {
  if (bytes <= 0) return absl::OkStatus();
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host, kv, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost),
      "K/V pages to host");
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToKvMemory(void* kv, const void* host, int64_t bytes) {
  if (bytes <= 0) return absl::OkStatus();
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(kv, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
      "host to K/V pages");
  // From pageable memory cudaMemcpy returns once the bytes are staged, their
  // DMA maybe still queued on the legacy stream, which the slots' streams
  // (non-blocking) do not wait for: the copy is waited for here (backend.h).
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy), "host to K/V pages");
  return absl::OkStatus();
}

absl::StatusOr<Plan> CudaBackend::CanImplementPaged(const PagedAttnParams& p) const {
  // The paged kernels apply ALiBi and sinks (per query head); a bias, an
  // element mask or a block mask has no paged kernel here.
  const AttnParams& a = p.attn;
  // q and the new K/V rows may lie in device memory (StartPagedForward reads
  // them there); the outputs are the pool's host buffers.
  if (a.devices.o != kHostMemory || a.devices.lse != kHostMemory) {
    AttnParams outputs = a;
    outputs.devices.q = outputs.devices.k = outputs.devices.v = kHostMemory;
    RETURN_IF_ERROR(CheckHostTensors(outputs, "cuda: paged params"));
  }
  if (a.bias != nullptr || a.mask != nullptr || HasBlockMask(a)) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda: paged params: bias, mask and the block mask (block_q) expected unset on a paged "
        "call (the paged kernels apply alibi_slopes and sinks only), got",
        a.bias != nullptr ? " bias" : "", a.mask != nullptr ? " mask" : "",
        HasBlockMask(a) ? absl::StrCat(" block_q ", a.block_q) : ""));
  }
  // The launch's invariants (page geometry, lengths, every page id it reads,
  // writes or copies), then whether this build and device have its kernel.
  // CheckPagedParams may refuse every mod (backends without paged mods):
  // it sees the call without its slopes and sinks, which CheckParams checks.
  // MLA geometry runs on the absorbed kernel alone (paged_mla.h); any other
  // value head dim, or V inside K's pages of another shape, is refused.
  const bool mla = HeadDimV(a) != a.head_dim || p.pages.v_in_k;
  if (mla && !cuda::MlaDecodeCovers(a, p.pages)) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda: paged params: head_dim_v, pages.v_in_k: the CUDA MLA kernel takes the absorbed "
        "form alone (pages.v_in_k, head_dim ",
        cuda::kMlaHeadDim, ", head_dim_v ", cuda::kMlaHeadDimV,
        ", num_heads_kv 1, fp16 or bf16 pages, not fp8), got head_dim ", a.head_dim,
        ", head_dim_v ", HeadDimV(a), ", v_in_k ", p.pages.v_in_k ? "true" : "false",
        ", num_heads_kv ", a.num_heads_kv, ", dtype ", std::string(DTypeName(a.dtype)),
        p.pages.fp8_e4m3 ? ", fp8 pages" : ""));
  }
  PagedModSupport support;
  support.mla = mla;
  PagedAttnParams plain = p;
  plain.attn.alibi_slopes = nullptr;
  plain.attn.sinks = nullptr;
  RETURN_IF_ERROR(CheckPagedParams(plain, support));
  if (a.alibi_slopes != nullptr || a.sinks != nullptr) {
    AttnParams mods = a;
    if (p.pages.v_in_k) mods.v = mods.k;  // V lives in K's pages: the call has no v
    RETURN_IF_ERROR(CheckParams(mods));
  }
  if (mla) {
    const Plan plan = cuda::PlanPagedMla(a, num_sms_);
    const int64_t rows = int64_t{a.seqlen_q} * a.num_heads_q;
    const int smem =
        cuda::MlaSmemBytes(cuda::MlaRowsPerCta(static_cast<int>(std::min<int64_t>(rows, 64))));
    if (smem > max_smem_per_block_) {
      return absl::UnimplementedError(absl::StrCat(
          "cuda: paged params: head_dim_v ", cuda::kMlaHeadDimV, ": the absorbed MLA kernel needs ",
          smem, " bytes of shared memory; this device allows ", max_smem_per_block_));
    }
    return plan;
  }
  // FP8 caches: the decode kernel's plan, or Plan() for the SIMT kernel,
  // which takes any head dim (as FP32's does).
  if (p.pages.fp8_e4m3) return cuda::PlanPagedFp8(p.attn, num_sms_);
  if (p.attn.dtype == DType::kFP32) return Plan();
  return PlanFor(p.attn, cuda::KvRows::kPages);
}

absl::Status CudaBackend::LaunchPagedKernels(const Plan& plan, const PagedAttnParams& dev,
                                             Slot* slot) {
  if (paged_done_ == nullptr) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&paged_done_, cudaEventDisableTiming),
                              "event");
  } else {
    // Start order: the previous paged launch may have appended rows this one
    // reads (or written pages this one copies).
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(slot->stream, paged_done_, 0),
                              "order paged launches");
  }
  if (dev.pages.v_in_k) {
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchMlaKvAppend(dev, slot->stream),
                              "MLA page copies and append");
    RETURN_IF_ERROR(ReserveSplitWorkspace(slot, plan));
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchPagedMla(dev, plan, slot->workspace.ptr(), slot->stream),
                              "paged MLA decode kernel");
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(paged_done_, slot->stream), "event");
    return absl::OkStatus();
  }
  if (dev.pages.fp8_e4m3) {
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchKvAppendFp8(dev, slot->stream),
                              "FP8 page copies and append");
    RETURN_IF_ERROR(ReserveSplitWorkspace(slot, plan));
    ATTN_CUDA_RETURN_IF_ERROR(
        cuda::LaunchPagedForwardFp8(dev, plan, slot->workspace.ptr(), slot->stream),
        "paged FP8 cache forward kernel");
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(paged_done_, slot->stream), "event");
    return absl::OkStatus();
  }
  ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchKvAppend(dev, slot->stream), "page copies and append");
  if (dev.attn.dtype == DType::kFP32) {
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchPagedForwardFp32(dev, slot->stream),
                              "paged fp32 forward kernel");
  } else {
    RETURN_IF_ERROR(ReserveSplitWorkspace(slot, plan));
    ATTN_CUDA_RETURN_IF_ERROR(
        cuda::LaunchPagedForward(dev, plan, slot->workspace.ptr(), slot->stream),
        "paged forward kernel");
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(paged_done_, slot->stream), "event");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PendingLaunch>> CudaBackend::StartPagedForward(
    const Plan& plan, const PagedBatch& batch) {
  // The gathered params point at the first member's slopes and sinks:
  // staged beside the other inputs, then moved to the device buffer with them.
  auto rebase = [this, &batch](const PagedAttnParams& staged, char* host, char* device) {
    const PagedLayout layout(batch);
    PagedAttnParams p = staged;
    p.attn = layout.mods.Stage(staged.attn, host, [this](const std::vector<HostCopy>& c) {
      CopyInParallel(c, gather_pool_.get());
    });
    return RebasePaged(p, host, device);
  };
  // A lone member's q and new rows in device memory (CanSharePagedLaunch
  // keeps such calls alone) are read where they lie or copied on the device.
  std::vector<DeviceInput> device_inputs;
  if (batch.size() == 1) {
    const AttnParams& a = batch.members().front()->attn;
    const std::pair<const void*, int> inputs[] = {
        {a.q, a.devices.q}, {a.k, a.devices.k}, {a.v, a.devices.v}};
    for (const auto& [ptr, device] : inputs) {
      if (device != kHostMemory && ptr != nullptr) device_inputs.push_back({ptr, device});
    }
  } else {
    for (const PagedAttnParams* m : batch.members()) {
      if (HasDeviceTensors(m->attn)) {
        return absl::InvalidArgumentError(
            "cuda: a paged call with a device-memory tensor cannot share a packed launch");
      }
    }
  }
  // Each member's o, where the packed o holds it: one in page-locked memory
  // (a buffer the answer is sent from) is written by the device-to-host copy.
  std::vector<HostOutput> host_outputs;
  {
    const PagedLayout layout(batch);
    const AttnParams& first = batch.members().front()->attn;
    const int64_t o_row = int64_t{first.num_heads_q} * HeadDimV(first) * DTypeSize(first.dtype);
    int64_t row = 0;
    for (const PagedAttnParams* m : batch.members()) {
      const int64_t bytes = int64_t{m->attn.total_q} * o_row;
      if (m->attn.o != nullptr && m->attn.devices.o == kHostMemory && bytes > 0) {
        host_outputs.push_back({m->attn.o, layout.o + row * o_row, bytes});
      }
      row += m->attn.total_q;
    }
  }
  return StartStaged<PagedLayout>(
      batch, rebase,
      [this, &plan, &batch](const PagedAttnParams& dev, Slot* slot) {
        // One member: its plan. Several were checked and planned one by one
        // and share everything but sizes (CanSharePagedLaunch), so the packed
        // launch only needs its own split and tile decision (PlanFor reads
        // sizes only, so the device params do).
        if (batch.size() == 1 || dev.attn.dtype == DType::kFP32) {
          return LaunchPagedKernels(plan, dev, slot);
        }
        if (dev.pages.v_in_k) {
          return LaunchPagedKernels(cuda::PlanPagedMla(dev.attn, num_sms_), dev, slot);
        }
        if (dev.pages.fp8_e4m3) {
          return LaunchPagedKernels(cuda::PlanPagedFp8(dev.attn, num_sms_), dev, slot);
        }
        ASSIGN_OR_RETURN(const Plan packed_plan, PlanFor(dev.attn, cuda::KvRows::kPages));
        return LaunchPagedKernels(packed_plan, dev, slot);
      },
      device_inputs, host_outputs);
}

absl::Status CudaBackend::PagedForward(const Plan& plan, const PagedAttnParams& params,
                                       BackendTimings* timings) {
  ASSIGN_OR_RETURN(std::unique_ptr<PendingLaunch> launch,
                   StartPagedForward(plan, PagedBatch({&params})));
  return launch->Finish(timings);
}

}  // namespace attnserve
