// CudaBackend: staging, planning, launching and error mapping for the CUDA
// kernels (backend/cuda/attn_fwd.h). CUDA errors become INTERNAL, allocation
// failures RESOURCE_EXHAUSTED; nothing aborts.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "backend/check_params.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/dtype.h"

namespace attnserve {
namespace {

absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so the next request runs
    return absl::ResourceExhaustedError(absl::StrCat("cuda: ", what, ": out of device memory"));
  }
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

#define ATTN_CUDA_RETURN_IF_ERROR(expr, what)                    \
  do {                                                           \
    const absl::Status _st = CudaError((expr), what);            \
    if (!_st.ok()) return _st;                                   \
  } while (0)

int64_t Align256(int64_t x) { return (x + 255) / 256 * 256; }

int64_t ElapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) return 0;
  return static_cast<int64_t>(ms * 1000.0f);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cuda: no usable GPU (",
                                               err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")"));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrCat("cuda: device ", device, " requested, ", count, " present"));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->device_ = device;
  cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda: device ", device, ": ", cudaGetErrorString(err)));
  }
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("cuda: device ", device, " (", prop.name, ") is sm", prop.major,
                                               prop.minor, "; the kernels need sm80 or later"));
  }
  b->num_sms_ = prop.multiProcessorCount;
  b->max_smem_per_block_ = static_cast<int>(prop.sharedMemPerBlockOptin);
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->stream_, cudaStreamNonBlocking), "stream");
  for (cudaEvent_t& e : b->events_) ATTN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "event");
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
  d.dtypes = {DType::kFP16, DType::kBF16, DType::kFP32};
  d.min_head_dim = 8;
  d.max_head_dim = cuda::HaveKernels(256) ? 256 : cuda::HaveKernels(192) ? 192 : 128;
  d.head_dim_multiple = 8;
  return b;
}

CudaBackend::~CudaBackend() {
  // Best effort: errors here cannot be reported to anyone.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (buffer_ != nullptr) cudaFree(buffer_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::CanImplement(const AttnParams& params) const {
  const absl::Status st = CheckParams(params);
  if (!st.ok()) return st;
  if (params.dtype == DType::kFP32) return absl::OkStatus();
  const cuda::LaunchPlan plan = cuda::PlanForward(params, num_sms_);
  if (plan.kernel_head_dim == 0) {
    return absl::UnimplementedError(absl::StrCat("cuda: head_dim ", params.head_dim,
                                                 " has no kernel in this build (ATTNSERVE_CUDA_KERNELS=dev "
                                                 "compiles head dim 128 only)"));
  }
  if (cuda::SmemBytes(plan.tile) > max_smem_per_block_) {
    const DeviceDescription& dev = description_.devices[0];
    return absl::UnimplementedError(absl::StrCat("cuda: head_dim ", params.head_dim, " uses the ",
                                                 plan.kernel_head_dim, " tile, which needs ",
                                                 cuda::SmemBytes(plan.tile), " bytes of shared memory; sm",
                                                 dev.compute_capability_major, dev.compute_capability_minor,
                                                 " allows ", max_smem_per_block_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureCapacity(int64_t bytes) {
  if (bytes <= buffer_bytes_) return absl::OkStatus();
  if (buffer_ != nullptr) cudaFree(buffer_);
  buffer_ = nullptr;
  buffer_bytes_ = 0;
  // Grow by 1.5x so a slowly growing request size does not reallocate each time.
  const int64_t want = std::max(bytes, buffer_bytes_ + buffer_bytes_ / 2);
  ATTN_CUDA_RETURN_IF_ERROR(cudaMalloc(&buffer_, static_cast<size_t>(want)), "staging buffer");
  buffer_bytes_ = want;
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureWorkspace(int64_t bytes) {
  if (bytes <= workspace_bytes_) return absl::OkStatus();
  if (workspace_ != nullptr) cudaFree(workspace_);
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, static_cast<size_t>(bytes)), "split-KV workspace");
  workspace_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status CudaBackend::ForwardDevice(const AttnParams& dev) {
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  if (dev.dtype == DType::kFP32) {
    ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchForwardFp32(dev, stream_), "fp32 forward kernel");
    return absl::OkStatus();
  }
  const cuda::LaunchPlan plan = cuda::PlanForward(dev, num_sms_);
  if (plan.kernel_head_dim == 0) return absl::UnimplementedError("cuda: no kernel for this head_dim");
  const absl::Status st = EnsureWorkspace(plan.workspace_bytes);
  if (!st.ok()) return st;
  ATTN_CUDA_RETURN_IF_ERROR(cuda::LaunchForward(dev, plan, workspace_, stream_), "forward kernel");
  return absl::OkStatus();
}

absl::Status CudaBackend::Forward(const AttnParams& params, BackendTimings* timings) {
  const absl::Status can = CanImplement(params);
  if (!can.ok()) return can;
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "set device");
  const int64_t es = DTypeSize(params.dtype);
  const int64_t q_bytes = params.total_q * params.num_heads_q * params.head_dim * es;
  const int64_t kv_bytes = params.total_k * params.num_heads_kv * params.head_dim * es;
  const int64_t lse_bytes = params.lse != nullptr ? params.num_heads_q * params.total_q * 4 : 0;
  const int64_t cu_bytes = IsVarlen(params) ? (int64_t{params.batch} + 1) * 4 : 0;
  // One buffer: q | k | v | o | lse | cu_q | cu_k, each 256-byte aligned.
  int64_t off = 0;
  const int64_t q_off = off;
  off += Align256(q_bytes);
  const int64_t k_off = off;
  off += Align256(kv_bytes);
  const int64_t v_off = off;
  off += Align256(kv_bytes);
  const int64_t o_off = off;
  off += Align256(q_bytes);
  const int64_t lse_off = off;
  off += Align256(lse_bytes);
  const int64_t cuq_off = off;
  off += Align256(cu_bytes);
  const int64_t cuk_off = off;
  off += Align256(cu_bytes);
  absl::Status st = EnsureCapacity(std::max<int64_t>(off, 256));
  if (!st.ok()) return st;
  char* base = static_cast<char*>(buffer_);

  AttnParams dev = params;
  dev.q = base + q_off;
  dev.k = base + k_off;
  dev.v = base + v_off;
  dev.o = base + o_off;
  dev.lse = params.lse != nullptr ? reinterpret_cast<float*>(base + lse_off) : nullptr;
  dev.cu_seqlens_q = IsVarlen(params) ? reinterpret_cast<const int32_t*>(base + cuq_off) : nullptr;
  dev.cu_seqlens_k = IsVarlen(params) ? reinterpret_cast<const int32_t*>(base + cuk_off) : nullptr;

  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_), "event");
  auto h2d = [&](const void* dst, const void* src, int64_t n) {
    return n == 0 ? cudaSuccess
                  : cudaMemcpyAsync(const_cast<void*>(dst), src, static_cast<size_t>(n), cudaMemcpyHostToDevice,
                                    stream_);
  };
  ATTN_CUDA_RETURN_IF_ERROR(h2d(dev.q, params.q, q_bytes), "copy q to device");
  ATTN_CUDA_RETURN_IF_ERROR(h2d(dev.k, params.k, kv_bytes), "copy k to device");
  ATTN_CUDA_RETURN_IF_ERROR(h2d(dev.v, params.v, kv_bytes), "copy v to device");
  if (cu_bytes > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(h2d(dev.cu_seqlens_q, params.cu_seqlens_q, cu_bytes), "copy cu_seqlens_q");
    ATTN_CUDA_RETURN_IF_ERROR(h2d(dev.cu_seqlens_k, params.cu_seqlens_k, cu_bytes), "copy cu_seqlens_k");
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[1], stream_), "event");
  st = ForwardDevice(dev);
  if (!st.ok()) return st;
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2], stream_), "event");
  if (q_bytes > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(params.o, dev.o, static_cast<size_t>(q_bytes), cudaMemcpyDeviceToHost, stream_),
        "copy o to host");
  }
  if (lse_bytes > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(params.lse, dev.lse, static_cast<size_t>(lse_bytes), cudaMemcpyDeviceToHost, stream_),
        "copy lse to host");
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[3], stream_), "event");
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "forward");
  if (timings != nullptr) {
    timings->host_to_device_us = ElapsedUs(events_[0], events_[1]);
    timings->compute_us = ElapsedUs(events_[1], events_[2]);
    timings->device_to_host_us = ElapsedUs(events_[2], events_[3]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(int device) {
  auto b = CudaBackend::Create(device);
  if (!b.ok()) return b.status();
  return std::unique_ptr<AttentionBackend>(std::move(*b));
}

}  // namespace attnserve
