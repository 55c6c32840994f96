// CudaBackend: the staging pipeline, planning, launching and error mapping
// for the CUDA kernels (backend/cuda/attn_fwd.h). CUDA errors become INTERNAL,
// allocation failures RESOURCE_EXHAUSTED; nothing aborts.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backend/backend_factory.h"
#include "backend/check_params.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/cuda_staging.h"
#include "backend/cuda/fp8_dequant.h"
#include "backend/cuda/generated/kernel_set.h"
#include "backend/cuda/pinned_host_pool.h"
#include "backend/ragged_batch.h"
#include "common/dtype.h"
#include "common/host_copy.h"
#include "common/status_macros.h"

namespace attnserve {

// Offsets of a launch's tensors in a slot's buffers, each 256-byte aligned.
// The score modifiers' arrays (the first member's: a call with a bias or a
// mask runs alone, and members that share a launch share their ALiBi slopes
// and sinks, CanShareLaunch) are inputs like Q, K and V: staged in the same
// buffers and copied in the same host-to-device copy.
struct StagingLayout {
  int64_t q = 0, k = 0, v = 0, cu_q = 0, cu_k = 0;
  ScoreModArrays mods;
  int64_t inputs_end = 0;
  int64_t o = 0, lse = 0, end = 0;

  explicit StagingLayout(const PackedBatch& batch) {
    StagingOffsets off;
    q = off.Take(batch.q_bytes());
    k = off.Take(batch.kv_bytes());
    v = off.Take(batch.v_bytes());
    cu_q = off.Take(batch.cu_seqlens_bytes());
    cu_k = off.Take(batch.cu_seqlens_bytes());
    mods = ScoreModArrays(*batch.members().front(), &off);
    inputs_end = off.end();
    o = off.Take(batch.o_bytes());  // BF16 for FP8 inputs
    lse = off.Take(batch.lse_bytes());
    end = std::max<int64_t>(off.end(), 256);
  }

  PackedBuffers In(char* base) const {
    PackedBuffers b;
    b.q = base + q;
    b.k = base + k;
    b.v = base + v;
    b.o = base + o;
    b.lse = reinterpret_cast<float*>(base + lse);
    b.cu_seqlens_q = reinterpret_cast<int32_t*>(base + cu_q);
    b.cu_seqlens_k = reinterpret_cast<int32_t*>(base + cu_k);
    return b;
  }
};

// The layout of a StartDirect launch. Host inputs first (q, k, v staged in
// the pinned buffer like StagingLayout's, cu_seqlens, the mods' arrays: one
// host-to-device copy), then the outputs that go to the host (one
// device-to-host copy), then, in the device buffer alone, room for the device
// tensors that cannot be used where they lie (another device's, or
// misaligned). A device tensor used in place takes no room.
struct DirectLayout {
  enum class Where { kStaged, kInPlace, kCopied };
  struct Tensor {
    Where where = Where::kStaged;
    int device = kHostMemory;
    int64_t at = 0;  // offset in the slot's buffers (staged or copied)
    int64_t bytes = 0;
  };
  Tensor q, k, v, o, lse;
  int64_t cu_q = 0, cu_k = 0, cu_bytes = 0;
  ScoreModArrays mods;
  int64_t inputs_end = 0;                   // staged inputs: [0, inputs_end)
  int64_t outputs_begin = 0, host_end = 0;  // outputs to the host
  int64_t end = 0;                          // the device buffer's size

  DirectLayout(const AttnParams& p, int here) {
    const PackedBatch sizes({&p});
    q = TensorOf(p.q, p.devices.q, sizes.q_bytes(), here);
    k = TensorOf(p.k, p.devices.k, sizes.kv_bytes(), here);
    v = TensorOf(p.v, p.devices.v, sizes.v_bytes(), here);
    o = TensorOf(p.o, p.devices.o, sizes.o_bytes(), here);
    lse = TensorOf(p.lse, p.devices.lse, sizes.lse_bytes(), here);
    StagingOffsets off;
    for (Tensor* t : {&q, &k, &v}) {
      if (t->where == Where::kStaged) t->at = off.Take(t->bytes);
    }
    cu_bytes = IsVarlen(p) ? (int64_t{p.batch} + 1) * 4 : 0;
    cu_q = off.Take(cu_bytes);
    cu_k = off.Take(cu_bytes);
    mods = ScoreModArrays(p, &off);
    inputs_end = off.end();
    outputs_begin = off.end();
    for (Tensor* t : {&o, &lse}) {
      if (t->where == Where::kStaged) t->at = off.Take(t->bytes);
    }
    host_end = std::max<int64_t>(off.end(), 256);
    for (Tensor* t : {&q, &k, &v, &o, &lse}) {
      if (t->where == Where::kCopied) t->at = off.Take(t->bytes);
    }
    end = std::max<int64_t>(off.end(), 256);
  }

  static Tensor TensorOf(const void* ptr, int device, int64_t bytes, int here) {
    Tensor t;
    t.device = device;
    t.bytes = bytes;
    if (device == kHostMemory) {
      t.where = Where::kStaged;
    } else if (device == here && reinterpret_cast<uintptr_t>(ptr) % kInPlaceDeviceAlignment == 0) {
      t.where = Where::kInPlace;
    } else {
      t.where = Where::kCopied;
    }
    return t;
  }
};

std::shared_ptr<char> CudaBackend::AllocateHostTensor(int64_t bytes) {
  return host_tensors_->Allocate(bytes);
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("cuda: device ", device, " requested, ", count, " present"));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->device_ = device;
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("cuda: device ", device, ": ", cudaGetErrorString(err)));
  }
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("cuda: device ", device, " (", prop.name, ") is sm",
                                               prop.major, prop.minor,
                                               "; the kernels need sm80 or later"));
  }
  b->num_sms_ = prop.multiProcessorCount;
  b->allow_sm90_ = cuda::DeviceRunsSm90Kernels(device);
  b->max_smem_per_block_ = static_cast<int>(prop.sharedMemPerBlockOptin);
  // One thread packs too slowly for large launches: a few share the copies;
  // more would compete with gRPC's threads.
  const int copy_threads =
      static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 4, 1u, 4u));
  b->gather_pool_ = std::make_unique<ThreadPool>(copy_threads);
  b->scatter_pool_ = std::make_unique<ThreadPool>(copy_threads);
  b->host_tensors_ = std::make_shared<PinnedHostPool>(device);
  for (std::unique_ptr<Slot>& slot : b->slots_) {
    slot = std::make_unique<Slot>();
    ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking),
                              "stream");
    for (cudaEvent_t& e : slot->events) ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "event");
  }
  BackendDescription& d = b->description_;
  d.name = "cuda";
  DeviceDescription dev;
  dev.index = device;
  dev.name = prop.name;
  dev.compute_capability_major = prop.major;
  dev.compute_capability_minor = prop.minor;
  dev.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) == cudaSuccess) dev.pci_bus_id = bus_id;
  d.devices.push_back(dev);
  // FP8_E4M3: dequantised to BF16 on the device, then the BF16 kernels
  // (fp8_dequant.h; the hooks are in PlanFor and LaunchKernels).
  d.dtypes = {DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP8E4M3};
  d.min_head_dim = 8;
  d.max_head_dim =
      *std::max_element(std::begin(cuda::kCompiledHeadDims), std::end(cuda::kCompiledHeadDims));
  d.head_dim_multiple = 8;
  return b;
}

CudaBackend::~CudaBackend() {
  // Best effort: errors here cannot be reported to anyone. Slots are idle by
  // now (every Launch releases its slot), so the buffers are free to go.
  cudaSetDevice(device_);
  for (std::unique_ptr<Slot>& slot : slots_) {
    if (slot == nullptr) continue;
    if (slot->stream != nullptr) cudaStreamSynchronize(slot->stream);
    for (cudaEvent_t e : slot->events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (slot->stream != nullptr) cudaStreamDestroy(slot->stream);
  }
  if (paged_done_ != nullptr) cudaEventDestroy(paged_done_);
}

absl::StatusOr<Plan> CudaBackend::CanImplement(const AttnParams& params) const {
  RETURN_IF_ERROR(CheckParams(params));
  // MLA shapes (V's head dim differing) run on the FP16/BF16 portable
  // kernels (PlanFor); the SIMT FP32 kernel and the FP8 dequantise step
  // read V rows of head_dim.
  if (HeadDimV(params) != params.head_dim &&
      (params.dtype == DType::kFP32 || params.dtype == DType::kFP8E4M3)) {
    return absl::UnimplementedError(
        absl::StrCat("cuda: head_dim_v expected 0 or head_dim ", params.head_dim, " for dtype ",
                     std::string(DTypeName(params.dtype)),
                     " (V's own head dim runs in FP16 and BF16), got ", params.head_dim_v));
  }
  if (params.dtype == DType::kFP32) return Plan();  // the SIMT kernel takes any head dim
  return PlanFor(params);
}

absl::StatusOr<Plan> CudaBackend::PlanFor(const AttnParams& params, cuda::KvRows kv) const {
  // FP8 params are planned as the kernel that runs them (PlanForward).
  const Plan plan = cuda::PlanForward(params, num_sms_, allow_sm90_, kv);
  if (plan.kernel_head_dim == 0 && HeadDimV(params) != params.head_dim) {
    std::string pairs;
    for (const cuda::HeadDimPair& k : cuda::kCompiledDvHeadDims) {
      if (k.head_dim != 0)
        absl::StrAppend(&pairs, pairs.empty() ? "" : ", ", k.head_dim, "/", k.head_dim_v);
    }
    return absl::UnimplementedError(absl::StrCat(
        "cuda: head_dim ", params.head_dim, " with head_dim_v ", params.head_dim_v,
        " has no kernel", kv == cuda::KvRows::kPages ? " over a cache's pages" : " in this build",
        " (head_dim/head_dim_v pairs compiled for the request's own K/V: ",
        pairs.empty() ? "none" : pairs, ")"));
  }
  if (plan.kernel_head_dim == 0) {
    return absl::UnimplementedError(
        absl::StrCat("cuda: head_dim ", params.head_dim,
                     " has no kernel in this build (ATTNSERVE_CUDA_KERNELS=dev "
                     "compiles head dim 128 only)"));
  }
  const int smem = cuda::PlanSmemBytes(plan);
  if (smem > max_smem_per_block_) {
    const DeviceDescription& dev = description_.devices[0];
    return absl::UnimplementedError(absl::StrCat(
        "cuda: head_dim ", params.head_dim, " uses the ", plan.kernel_head_dim,
        " tile, which needs ", smem, " bytes of shared memory; sm", dev.compute_capability_major,
        dev.compute_capability_minor, " allows ", max_smem_per_block_));
  }
  return plan;
}

CudaBackend::Slot* CudaBackend::AcquireSlot() {
  std::unique_lock<std::mutex> lock(slots_mu_);
  while (true) {
    for (std::unique_ptr<Slot>& slot : slots_) {
      if (!slot->busy) {
        slot->busy = true;
        return slot.get();
      }
    }
    slot_freed_.wait(lock);
  }
}

void CudaBackend::ReleaseSlot(Slot* slot) {
  {
    std::lock_guard<std::mutex> lock(slots_mu_);
    slot->busy = false;
  }
  slot_freed_.notify_one();
}

absl::Status CudaBackend::LaunchKernels(const Plan& plan, const AttnParams& dev, Slot* slot) {
  if (dev.dtype == DType::kFP8E4M3) {
    // FP8: BF16 copies in the slot's scratch (of V alone when Q K^T runs on
    // the codes: plan.fp8_qk; none, but V^T's codes, when P V does too:
    // plan.fp8_pv), then the kernel of `plan`, O written as BF16.
    RETURN_IF_ERROR(slot->fp8_scratch.Reserve(cuda::Fp8ScratchBytes(dev, plan.fp8_qk, plan.fp8_pv),
                                              "FP8 dequantise buffer"));
    AttnParams bf16;
    ATTN_CUDA_RETURN_IF_ERROR(cuda::DequantiseFp8(dev, plan.fp8_qk, plan.fp8_pv,
                                                  slot->fp8_scratch.ptr(), slot->stream, &bf16),
                              "fp8 dequantise kernel");
    return LaunchKernels(plan, bf16, slot);
  }
  if (dev.dtype == DType::kFP32) {
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchForwardFp32(dev, slot->stream), "fp32 forward kernel");
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(ReserveSplitWorkspace(slot, plan));
  ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchForward(dev, plan, slot->workspace.ptr(), slot->stream),
                            "forward kernel");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PendingLaunch>> CudaBackend::StartForward(const Plan& plan,
                                                                         const PackedBatch& batch) {
  // Several members share a launch only as CanShareLaunch allows: the
  // arrays of a bias, element mask or block mask belong to one call, and
  // tensors in device memory are read where they lie.
  if (batch.size() > 1) {
    for (const AttnParams* m : batch.members()) {
      if (m->bias != nullptr || m->mask != nullptr || HasBlockMask(*m) || HasDeviceTensors(*m)) {
        return absl::InvalidArgumentError(
            "cuda: a call with a bias, element mask, block mask or device-memory tensor cannot "
            "share a packed launch");
      }
    }
  } else if (HasDeviceTensors(*batch.members().front())) {
    return StartDirect(plan, *batch.members().front());
  }
  // The gathered params point at the first member's mod arrays: staged
  // beside Q, K and V, then moved to the device buffer with them.
  auto rebase = [this, &batch](const AttnParams& staged, char* host, char* device) {
    const StagingLayout layout(batch);
    const AttnParams p = layout.mods.Stage(staged, host, [this](const std::vector<HostCopy>& c) {
      CopyInParallel(c, gather_pool_.get());
    });
    return RebaseAttnParams(p, host, device);
  };
  return StartStaged<StagingLayout>(batch, rebase,
                                    [this, &plan, &batch](const AttnParams& dev, Slot* slot) {
                                      // One member: its plan. Several: the members were checked and
                                      // planned one by one and share everything but sizes
                                      // (CanShareLaunch), so the packed params only need their own
                                      // split and tile decision (PlanForward reads sizes only, so
                                      // the device params do).
                                      if (batch.size() == 1 || dev.dtype == DType::kFP32)
                                        return LaunchKernels(plan, dev, slot);
                                      ASSIGN_OR_RETURN(const Plan packed_plan, PlanFor(dev));
                                      return LaunchKernels(packed_plan, dev, slot);
                                    });
}

absl::StatusOr<std::unique_ptr<PendingLaunch>> CudaBackend::StartDirect(const Plan& plan,
                                                                        const AttnParams& p) {
  using Where = DirectLayout::Where;
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  Slot* slot = AcquireSlot();
  auto fail = [this, slot](absl::Status st) {
    cudaStreamSynchronize(slot->stream);
    ReleaseSlot(slot);
    return st;
  };
  const DirectLayout layout(p, device_);
  absl::Status st = slot->host.Reserve(layout.host_end, "pinned staging buffer");
  if (st.ok()) st = slot->device.Reserve(layout.end, "device staging buffer");
  if (!st.ok()) return fail(st);
  char* const host = slot->host.ptr();
  char* const device = slot->device.ptr();

  // The host inputs into the pinned buffer.
  const absl::Time gather_start = absl::Now();
  const CopyRunner run = [this](const std::vector<HostCopy>& c) {
    CopyInParallel(c, gather_pool_.get());
  };
  std::vector<HostCopy> copies;
  const std::pair<const DirectLayout::Tensor*, const void*> inputs[] = {
      {&layout.q, p.q}, {&layout.k, p.k}, {&layout.v, p.v}};
  for (const auto& [t, src] : inputs) {
    if (t->where == Where::kStaged && t->bytes > 0) {
      copies.push_back({host + t->at, src, static_cast<size_t>(t->bytes)});
    }
  }
  if (layout.cu_bytes > 0) {
    copies.push_back({host + layout.cu_q, p.cu_seqlens_q, static_cast<size_t>(layout.cu_bytes)});
    copies.push_back({host + layout.cu_k, p.cu_seqlens_k, static_cast<size_t>(layout.cu_bytes)});
  }
  RunCopies(run, copies);
  AttnParams mods = layout.mods.Stage(p, host, run);
  const int64_t gather_us = absl::ToInt64Microseconds(absl::Now() - gather_start);

  // The launch's params: the mods and cu_seqlens in the device buffer, each
  // tensor where it lies or in its room there.
  mods.q = mods.k = mods.v = nullptr;
  mods.o = nullptr;
  mods.lse = nullptr;
  mods.cu_seqlens_q = mods.cu_seqlens_k = nullptr;
  AttnParams dev = RebaseAttnParams(mods, host, device);
  auto place = [device](const DirectLayout::Tensor& t, const void* resident) {
    return t.where == Where::kInPlace ? static_cast<char*>(const_cast<void*>(resident))
                                      : device + t.at;
  };
  dev.q = place(layout.q, p.q);
  dev.k = place(layout.k, p.k);
  dev.v = place(layout.v, p.v);
  dev.o = place(layout.o, p.o);
  dev.lse = p.lse != nullptr ? reinterpret_cast<float*>(place(layout.lse, p.lse)) : nullptr;
  if (layout.cu_bytes > 0) {
    dev.cu_seqlens_q = reinterpret_cast<int32_t*>(device + layout.cu_q);
    dev.cu_seqlens_k = reinterpret_cast<int32_t*>(device + layout.cu_k);
  }
  dev.devices = TensorDevices();  // all of it this device's memory now

  auto queue = [&]() -> absl::Status {
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[0], slot->stream), "event");
    if (layout.inputs_end > 0) {
      ATTN_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(device, host, static_cast<size_t>(layout.inputs_end),
                          cudaMemcpyHostToDevice, slot->stream),
          "copy inputs to device");
    }
    for (const auto& [t, src] : inputs) {
      if (t->where != Where::kCopied) continue;
      ATTN_CUDA_RETURN_IF_ERROR(
          CopyBetweenDevices(device + t->at, device_, src, t->device, t->bytes, slot->stream),
          "copy a device-memory input to the launch's device");
    }
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[1], slot->stream), "event");
    RETURN_IF_ERROR(LaunchKernels(plan, dev, slot));
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[2], slot->stream), "event");
    const std::pair<const DirectLayout::Tensor*, void*> outputs[] = {{&layout.o, p.o},
                                                                     {&layout.lse, p.lse}};
    for (const auto& [t, dst] : outputs) {
      if (t->where != Where::kCopied || dst == nullptr) continue;
      ATTN_CUDA_RETURN_IF_ERROR(
          CopyBetweenDevices(dst, t->device, device + t->at, device_, t->bytes, slot->stream),
          "copy an output to its device");
    }
    if (layout.host_end > layout.outputs_begin) {
      ATTN_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(host + layout.outputs_begin, device + layout.outputs_begin,
                          static_cast<size_t>(layout.host_end - layout.outputs_begin),
                          cudaMemcpyDeviceToHost, slot->stream),
          "copy outputs to host");
    }
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[3], slot->stream), "event");
    return absl::OkStatus();
  };
  st = queue();
  if (!st.ok()) return fail(st);
  // The outputs that go to the host leave the pinned buffer in Finish.
  Launch::Scatter scatter = [layout, o = p.o, lse = p.lse](const char* from,
                                                           const CopyRunner& run) {
    std::vector<HostCopy> out;
    if (layout.o.where == Where::kStaged && layout.o.bytes > 0) {
      out.push_back({o, from + layout.o.at, static_cast<size_t>(layout.o.bytes)});
    }
    if (lse != nullptr && layout.lse.where == Where::kStaged && layout.lse.bytes > 0) {
      out.push_back({lse, from + layout.lse.at, static_cast<size_t>(layout.lse.bytes)});
    }
    RunCopies(run, out);
  };
  return std::unique_ptr<PendingLaunch>(new Launch(this, slot, std::move(scatter), gather_us));
}

absl::Status CudaBackend::Forward(const Plan& plan, const AttnParams& params,
                                  BackendTimings* timings) {
  ASSIGN_OR_RETURN(std::unique_ptr<PendingLaunch> launch,
                   StartForward(plan, PackedBatch({&params})));
  return launch->Finish(timings);
}

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "cuda: no usable GPU (", err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")"));
  }
  return count;
}

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(int device) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, CudaBackend::Create(device));
  return std::unique_ptr<AttentionBackend>(std::move(b));
}

}  // namespace attnserve
