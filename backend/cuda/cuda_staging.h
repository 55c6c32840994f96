// Internal to the CUDA backend's .cc files (cuda_backend.cc: the contiguous
// pipeline; cuda_paged.cc: the paged one): CUDA error mapping, the grow-only
// staging buffers and a pipeline slot's resources.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/paged_kv.h"
#include "common/dtype.h"
#include "common/host_copy.h"

namespace attnserve {

// cudaSuccess -> OK; out of memory -> RESOURCE_EXHAUSTED (the error cleared);
// anything else -> INTERNAL naming `what`.
inline absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so the next request runs
    return absl::ResourceExhaustedError(absl::StrCat("cuda: ", what, ": out of device memory"));
  }
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

#define ATTN_CUDA_RETURN_IF_ERROR(expr, what)         \
  do {                                                \
    const absl::Status _st = CudaError((expr), what); \
    if (!_st.ok()) return _st;                        \
  } while (0)

inline int64_t Align256(int64_t x) { return (x + 255) / 256 * 256; }

// A tensor in device memory (TensorDevices) is read or written where it lies
// when it is on the backend's device and starts at a multiple of this (the
// kernels' TMA and cp.async move 16-byte units); otherwise it is copied
// between its place and the slot's device buffer.
inline constexpr uintptr_t kInPlaceDeviceAlignment = 16;

// The `src_device` of an input in page-locked host memory (a client's
// shared-memory region the server registered with cudaHostRegister): the
// copy engine reads it where it lies, no copy into the staging buffer.
inline constexpr int kPageLockedHost = -2;

// Host inputs at least this large that lie in page-locked memory are copied
// to the device straight from there; a smaller one costs less to gather than
// a copy call of its own.
inline constexpr int64_t kDirectHostCopyBytes = 32 << 10;

// Whether `p` lies in page-locked host memory the devices can read
// (cudaHostRegister or cudaHostAlloc). A pageable pointer is not an error.
inline bool IsPageLockedHost(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: older runtimes answer an invalid value for pageable memory
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

// Queues a copy of `bytes` from `src` on device `src_device` to `dst` on
// `dst_device` on `stream`: within one device a device-to-device copy, across
// devices one peer copy (over NVLink or PCIe, without a host bounce where the
// devices can reach each other); from kPageLockedHost a host-to-device copy.
inline cudaError_t CopyBetweenDevices(void* dst, int dst_device, const void* src, int src_device,
                                      int64_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (src_device == kPageLockedHost) {
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream);
  }
  if (dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, static_cast<size_t>(bytes), stream);
}

// Hands out consecutive 256-byte aligned regions of one staging buffer: the
// launch layouts (StagingLayout, PagedLayout) take their tensors' offsets
// from it in order.
class StagingOffsets {
 public:
  // The offset of a new region of `bytes`.
  int64_t Take(int64_t bytes) {
    const int64_t at = end_;
    end_ += Align256(bytes);
    return at;
  }
  int64_t end() const { return end_; }

 private:
  int64_t end_ = 0;
};

// `ptr`, a pointer into the buffer at `from`, moved to the same offset in the
// buffer at `to` (both of one layout); null stays null.
template <typename T>
T* Rebased(T* ptr, const char* from, char* to) {
  if (ptr == nullptr) return nullptr;
  return reinterpret_cast<T*>(to + (reinterpret_cast<const char*>(ptr) - from));
}

// The same params with every tensor pointer (the score modifiers' arrays
// too) moved from `from` to `to`.
inline AttnParams RebaseAttnParams(const AttnParams& p, const char* from, char* to) {
  AttnParams d = p;
  d.q = Rebased(p.q, from, to);
  d.k = Rebased(p.k, from, to);
  d.v = Rebased(p.v, from, to);
  d.o = Rebased(p.o, from, to);
  d.lse = Rebased(p.lse, from, to);
  d.cu_seqlens_q = Rebased(p.cu_seqlens_q, from, to);
  d.cu_seqlens_k = Rebased(p.cu_seqlens_k, from, to);
  d.alibi_slopes = Rebased(p.alibi_slopes, from, to);
  d.sinks = Rebased(p.sinks, from, to);
  d.bias = Rebased(p.bias, from, to);
  d.mask = Rebased(p.mask, from, to);
  d.block_row_ptr = Rebased(p.block_row_ptr, from, to);
  d.block_col_idx = Rebased(p.block_col_idx, from, to);
  return d;
}

// The score modifiers' arrays of one call (params.h) in a staging layout:
// their sizes from the HOST params and their offsets, taken in order from
// `off` (0 bytes for an array the call does not have).
struct ScoreModArrays {
  int64_t alibi = 0, sinks = 0, bias = 0, mask = 0, row_ptr = 0, col_idx = 0;
  int64_t alibi_bytes = 0, sinks_bytes = 0, bias_bytes = 0, mask_bytes = 0;
  int64_t row_ptr_bytes = 0, col_idx_bytes = 0;

  ScoreModArrays() = default;
  ScoreModArrays(const AttnParams& p, StagingOffsets* off) {
    const int64_t heads = int64_t{p.num_heads_q} * 4;
    alibi_bytes = p.alibi_slopes != nullptr ? heads : 0;
    sinks_bytes = p.sinks != nullptr ? heads : 0;
    bias_bytes = p.bias != nullptr
                     ? PairElements(p, p.bias_per_batch, p.bias_per_head) * DTypeSize(p.bias_dtype)
                     : 0;
    mask_bytes = p.mask != nullptr ? PairElements(p, p.mask_per_batch, p.mask_per_head) : 0;
    if (HasBlockMask(p)) {
      const int64_t rows = BlockMaskRows(p);
      row_ptr_bytes = (rows + 1) * 4;
      col_idx_bytes = int64_t{p.block_row_ptr[rows]} * 4;
    }
    alibi = off->Take(alibi_bytes);
    sinks = off->Take(sinks_bytes);
    bias = off->Take(bias_bytes);
    mask = off->Take(mask_bytes);
    row_ptr = off->Take(row_ptr_bytes);
    col_idx = off->Take(col_idx_bytes);
  }

  // Copies `p`'s arrays (host memory) into the staging buffer at `base`
  // (through `run`) and returns p pointing at the copies.
  AttnParams Stage(const AttnParams& p, char* base, const CopyRunner& run) const {
    AttnParams d = p;
    std::vector<HostCopy> copies;
    auto stage = [&](const auto* src, int64_t at, int64_t bytes) {
      using Elem = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
      if (src == nullptr) return src;
      if (bytes > 0) copies.push_back({base + at, src, static_cast<size_t>(bytes)});
      return static_cast<const Elem*>(static_cast<const void*>(base + at));
    };
    d.alibi_slopes = stage(p.alibi_slopes, alibi, alibi_bytes);
    d.sinks = stage(p.sinks, sinks, sinks_bytes);
    d.bias = stage(static_cast<const char*>(p.bias), bias, bias_bytes);
    d.mask = stage(p.mask, mask, mask_bytes);
    d.block_row_ptr = stage(p.block_row_ptr, row_ptr, row_ptr_bytes);
    d.block_col_idx = stage(p.block_col_idx, col_idx, col_idx_bytes);
    RunCopies(run, copies);
    return d;
  }
};

// A slowly growing launch size should not reallocate each time, so buffers
// grow by at least 1.5x.
inline int64_t GrowTo(int64_t have, int64_t need) { return std::max(need, have + have / 2); }

// A grow-only buffer reused across launches, in device memory or in
// page-locked host memory. Pinned memory is what the copy engines read and
// write directly, so copies are asynchronous and run at full PCIe/NVLink-C2C
// speed. (From pageable memory the driver stages through its own pinned
// buffer, which costs the same host copy and serialises it with the host
// thread.)
class StagingBuffer {
 public:
  enum class Kind { kDevice, kPinnedHost };
  explicit StagingBuffer(Kind kind) : kind_(kind) {}
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer() { Free(); }

  char* ptr() const { return ptr_; }
  int64_t bytes() const { return bytes_; }

  // Makes room for `need` bytes (contents are not kept). `what` names the
  // buffer in an out-of-memory error.
  absl::Status Reserve(int64_t need, const char* what) {
    if (need <= bytes_) return absl::OkStatus();
    const int64_t want = GrowTo(bytes_, need);
    Free();
    void* p = nullptr;
    ATTN_CUDA_RETURN_IF_ERROR(
        kind_ == Kind::kDevice ? cudaMalloc(&p, static_cast<size_t>(want))
                               : cudaHostAlloc(&p, static_cast<size_t>(want), cudaHostAllocDefault),
        what);
    ptr_ = static_cast<char*>(p);
    bytes_ = want;
    return absl::OkStatus();
  }

  // Gives the memory back (bytes() is 0 until the next Reserve).
  void Free() {
    if (ptr_ != nullptr) kind_ == Kind::kDevice ? cudaFree(ptr_) : cudaFreeHost(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  const Kind kind_;
  char* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

inline int64_t ElapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) return 0;
  return static_cast<int64_t>(ms * 1000.0f);
}

// One pipeline stage's resources. A slot is busy from StartForward until its
// launch is finished (or abandoned); nothing else touches it meanwhile.
struct CudaBackend::Slot {
  cudaStream_t stream = nullptr;
  // Recorded around the phases: start, inputs on device, kernels done,
  // outputs in pinned memory.
  cudaEvent_t events[4] = {nullptr, nullptr, nullptr, nullptr};
  // The same layout in both: inputs (q | k | v | cu_q | cu_k) then outputs
  // (o | lse), so each direction is one copy.
  StagingBuffer host{StagingBuffer::Kind::kPinnedHost};
  StagingBuffer device{StagingBuffer::Kind::kDevice};
  StagingBuffer workspace{StagingBuffer::Kind::kDevice};  // split-KV tickets and partials
  // FP8 calls only: BF16 copies of q, k, v (fp8_dequant.h).
  StagingBuffer fp8_scratch{StagingBuffer::Kind::kDevice};
  bool busy = false;
};

// Makes the slot's split-KV workspace hold `plan`'s, and zeroes its split
// ticket counters (queued on the slot's stream) whenever it was
// (re)allocated: fresh device memory is garbage, and from then on every
// launch leaves the counters zero (attn_fwd_plan.h). A launch that fails to
// start touches no counter; one that faults leaves the context unusable.
inline absl::Status ReserveSplitWorkspace(CudaBackend::Slot* slot, const Plan& plan) {
  if (plan.workspace_bytes == 0) return absl::OkStatus();
  const int64_t had = slot->workspace.bytes();
  const absl::Status st = slot->workspace.Reserve(plan.workspace_bytes, "split-KV workspace");
  if (!st.ok()) return st;
  if (slot->workspace.bytes() != had) {
    const absl::Status cleared = CudaError(
        cuda::ClearSplitCounters(slot->workspace.ptr(), slot->stream), "clear split counters");
    // Not cleared: drop the buffer, so the next call allocates and clears again.
    if (!cleared.ok()) slot->workspace.Free();
    return cleared;
  }
  return absl::OkStatus();
}

// The params' tensor pointer that equals `at` (an input's place in the
// device buffer) pointed at `to` instead; false when none does.
inline bool Redirect(AttnParams* p, const char* at, const void* to) {
  for (const void** ptr : {&p->q, &p->k, &p->v}) {
    if (*ptr == at) {
      *ptr = to;
      return true;
    }
  }
  return false;
}
inline bool Redirect(PagedAttnParams* p, const char* at, const void* to) {
  return Redirect(&p->attn, at, to);
}

// A gathered input that lies in device memory: its place in the device
// buffer (`dst`) and where it lies.
struct DeviceInputCopy {
  char* dst;
  const void* src;
  int src_device;
  int64_t bytes;
};

// [from, end) without `holes` ([begin, end) pairs), as [begin, end) pairs.
inline std::vector<std::pair<int64_t, int64_t>> RangesOutside(
    int64_t from, int64_t end, std::vector<std::pair<int64_t, int64_t>> holes) {
  std::sort(holes.begin(), holes.end());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t at = from;
  for (const auto& [begin, stop] : holes) {
    if (begin > at && at < end) ranges.emplace_back(at, std::min(begin, end));
    at = std::max(at, stop);
  }
  if (at < end) ranges.emplace_back(at, end);
  return ranges;
}

// The parts of [0, end) of the staging buffer that hold gathered bytes: all
// of it but the places `direct` fills from elsewhere, as [begin, end) pairs.
inline std::vector<std::pair<int64_t, int64_t>> StagedRanges(
    const char* device, int64_t end, const std::vector<DeviceInputCopy>& direct) {
  std::vector<std::pair<int64_t, int64_t>> holes;
  for (const DeviceInputCopy& c : direct) {
    holes.emplace_back(c.dst - device, c.dst - device + c.bytes);
  }
  return RangesOutside(0, end, std::move(holes));
}

// Queues one staged launch on the slot's stream: the gathered inputs of
// [0, inputs_end) of the pinned buffer to the device (the places of
// `device_inputs` left out), then the device inputs and page-locked host
// inputs into their places, `kernels`, outputs [out_begin, out_end) back
// (those of `host_outputs` straight to their page-locked places, the rest
// into the pinned buffer), with the slot's four events around the phases.
inline absl::Status QueueStagedLaunch(CudaBackend::Slot* slot, int device, int64_t inputs_end,
                                      int64_t out_begin, int64_t out_end,
                                      const std::vector<DeviceInputCopy>& device_inputs,
                                      const std::function<absl::Status()>& kernels,
                                      const std::vector<CudaBackend::HostOutput>& host_outputs) {
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[0], slot->stream), "event");
  for (const auto& [begin, end] : StagedRanges(slot->device.ptr(), inputs_end, device_inputs)) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot->device.ptr() + begin, slot->host.ptr() + begin,
                        static_cast<size_t>(end - begin), cudaMemcpyHostToDevice, slot->stream),
        "copy inputs to device");
  }
  for (const DeviceInputCopy& c : device_inputs) {
    ATTN_CUDA_RETURN_IF_ERROR(
        CopyBetweenDevices(c.dst, device, c.src, c.src_device, c.bytes, slot->stream),
        "copy a device-memory input to the launch's device");
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[1], slot->stream), "event");
  const absl::Status st = kernels();
  if (!st.ok()) return st;
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[2], slot->stream), "event");
  std::vector<std::pair<int64_t, int64_t>> holes;
  for (const CudaBackend::HostOutput& out : host_outputs) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out.dst, slot->device.ptr() + out.offset, static_cast<size_t>(out.bytes),
                        cudaMemcpyDeviceToHost, slot->stream),
        "copy an output to its page-locked place");
    holes.emplace_back(out.offset, out.offset + out.bytes);
  }
  for (const auto& [begin, end] : RangesOutside(out_begin, out_end, std::move(holes))) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot->host.ptr() + begin, slot->device.ptr() + begin,
                        static_cast<size_t>(end - begin), cudaMemcpyDeviceToHost, slot->stream),
        "copy outputs to host");
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->events[3], slot->stream), "event");
  return absl::OkStatus();
}

// A launch queued on a slot's stream. Finish waits for it and scatters the
// outputs; destroying an unfinished launch waits for the stream, so the slot
// never goes back to the pool with copies in flight.
class CudaBackend::Launch final : public PendingLaunch {
 public:
  // scatter(host, run) copies the outputs from the slot's pinned buffer
  // `host` to the members, its bulk copies through `run`.
  using Scatter = std::function<void(const char* host, const CopyRunner& run)>;
  Launch(CudaBackend* backend, Slot* slot, Scatter scatter, int64_t gather_us)
      : backend_(backend), slot_(slot), scatter_(std::move(scatter)), gather_us_(gather_us) {}

  ~Launch() override {
    if (slot_ == nullptr) return;
    cudaSetDevice(backend_->device_);
    cudaStreamSynchronize(slot_->stream);
    backend_->ReleaseSlot(slot_);
  }

  absl::Status Finish(BackendTimings* timings) override {
    absl::Status st = Wait(timings);
    // After an error the copies may still be running: the slot's buffers go
    // back to the pool only once its stream is idle.
    if (!st.ok()) cudaStreamSynchronize(slot_->stream);
    backend_->ReleaseSlot(slot_);
    slot_ = nullptr;
    return st;
  }

 private:
  absl::Status Wait(BackendTimings* timings) {
    ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(backend_->device_), "set device");
    ATTN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot_->events[3]), "forward");
    const absl::Time scatter_start = absl::Now();
    const char* host = slot_->host.ptr();
    ThreadPool* pool = backend_->scatter_pool_.get();
    scatter_(host, [pool](const std::vector<HostCopy>& copies) { CopyInParallel(copies, pool); });
    const int64_t scatter_us = absl::ToInt64Microseconds(absl::Now() - scatter_start);
    if (timings != nullptr) {
      // The host copies into and out of the staging buffer are part of the
      // transfers: they are what moving the bytes costs beyond the wire.
      timings->host_to_device_us = gather_us_ + ElapsedUs(slot_->events[0], slot_->events[1]);
      timings->compute_us = ElapsedUs(slot_->events[1], slot_->events[2]);
      timings->device_to_host_us = ElapsedUs(slot_->events[2], slot_->events[3]) + scatter_us;
    }
    return absl::OkStatus();
  }

  CudaBackend* const backend_;
  Slot* slot_;
  const Scatter scatter_;
  const int64_t gather_us_;
};

template <typename Layout, typename Batch, typename Rebase, typename Kernels>
absl::StatusOr<std::unique_ptr<PendingLaunch>> CudaBackend::StartStaged(
    const Batch& batch, Rebase rebase, Kernels kernels,
    const std::vector<DeviceInput>& device_inputs, const std::vector<HostOutput>& host_outputs) {
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  Slot* slot = AcquireSlot();
  // Until the Launch owns the slot, an error must hand it back with nothing
  // in flight.
  auto fail = [this, slot](absl::Status st) {
    cudaStreamSynchronize(slot->stream);
    ReleaseSlot(slot);
    return st;
  };
  const Layout layout(batch);
  absl::Status st = slot->host.Reserve(layout.end, "pinned staging buffer");
  if (st.ok()) st = slot->device.Reserve(layout.end, "device staging buffer");
  if (!st.ok()) return fail(st);

  const absl::Time gather_start = absl::Now();
  ThreadPool* pool = gather_pool_.get();
  char* const host = slot->host.ptr();
  char* const device = slot->device.ptr();
  // A copy from device memory is not run on the host: it becomes the
  // input's place in the device buffer, filled after the host-to-device copy.
  std::vector<DeviceInputCopy> from_device;
  const auto staged = batch.Gather(layout.In(host), [&](const std::vector<HostCopy>& copies) {
    std::vector<HostCopy> on_host;
    for (const HostCopy& c : copies) {
      const auto in = std::find_if(device_inputs.begin(), device_inputs.end(),
                                   [&](const DeviceInput& d) { return d.ptr == c.src; });
      if (in == device_inputs.end()) {
        // A large input in page-locked memory (a registered shared-memory
        // region) goes to the device straight from where it lies.
        if (static_cast<int64_t>(c.bytes) >= kDirectHostCopyBytes && IsPageLockedHost(c.src)) {
          from_device.push_back({device + (static_cast<char*>(c.dst) - host), c.src,
                                 kPageLockedHost, static_cast<int64_t>(c.bytes)});
        } else {
          on_host.push_back(c);
        }
      } else {
        from_device.push_back({device + (static_cast<char*>(c.dst) - host), c.src, in->device,
                               static_cast<int64_t>(c.bytes)});
      }
    }
    CopyInParallel(on_host, pool);
  });
  const int64_t gather_us = absl::ToInt64Microseconds(absl::Now() - gather_start);
  auto dev = rebase(staged, host, device);
  // One on this device at an aligned address is read where it lies.
  std::vector<DeviceInputCopy> copies;
  for (const DeviceInputCopy& c : from_device) {
    const bool here = c.src_device == device_ &&
                      reinterpret_cast<uintptr_t>(c.src) % kInPlaceDeviceAlignment == 0;
    if (!here || !Redirect(&dev, c.dst, c.src)) copies.push_back(c);
  }

  // A large output in page-locked memory (a buffer the answer is sent
  // from) is written by the device-to-host copy; the scatter skips it.
  std::vector<HostOutput> direct_out;
  for (const HostOutput& out : host_outputs) {
    if (out.bytes >= kDirectHostCopyBytes && IsPageLockedHost(out.dst)) direct_out.push_back(out);
  }
  st = QueueStagedLaunch(
      slot, device_, layout.inputs_end, layout.o, layout.end, copies,
      [&]() { return kernels(dev, slot); }, direct_out);
  if (!st.ok()) return fail(st);
  Launch::Scatter scatter = [batch, layout, direct_out](const char* host, const CopyRunner& run) {
    CopyRunner left = run;
    if (!direct_out.empty()) {
      left = [&run, &direct_out](const std::vector<HostCopy>& copies) {
        std::vector<HostCopy> rest;
        for (const HostCopy& c : copies) {
          const bool written =
              std::any_of(direct_out.begin(), direct_out.end(), [&](const HostOutput& out) {
                return out.dst == c.dst && static_cast<size_t>(out.bytes) == c.bytes;
              });
          if (!written) rest.push_back(c);
        }
        RunCopies(run, rest);
      };
    }
    batch.Scatter(host + layout.o, reinterpret_cast<const float*>(host + layout.lse), left);
  };
  return std::unique_ptr<PendingLaunch>(new Launch(this, slot, std::move(scatter), gather_us));
}

}  // namespace attnserve
