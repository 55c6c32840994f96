// CUDA IPC regions for the cuda_shared_memory extension; see cuda_shm_region.h.
// Calls hand the backend the region's device address (device_ptr), so q, k,
// v, o and lse are read and written where they lie; Read and Write (device to
// host, host to device) serve what the server reads on the host (per-head
// lists, masks) and the K/V model's outputs (the pool's are host memory).
#include "server/shm/cuda_shm_region.h"

#include "absl/strings/str_cat.h"

#if ATTNSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cstring>
#endif

namespace attnserve {

#if ATTNSERVE_HAVE_CUDA
namespace {

absl::Status CudaError(const std::string& name, const char* what, cudaError_t err) {
  return absl::InvalidArgumentError(absl::StrCat("CUDA shared memory region '", name, "': ", what,
                                                 " failed: ", cudaGetErrorString(err)));
}

// A peer process's allocation opened in this one; closed on destruction.
class CudaShmRegion final : public ShmRegion {
 public:
  CudaShmRegion(std::string name, int device, void* base, uint64_t byte_size)
      : name_(std::move(name)), device_(device), base_(base), byte_size_(byte_size) {}
  ~CudaShmRegion() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }

  uint64_t byte_size() const override { return byte_size_; }
  char* device_ptr() const override { return static_cast<char*>(base_); }
  int device() const override { return device_; }
  absl::Status Read(uint64_t offset, uint64_t size, void* dst) const override {
    // Request threads may not have this device current.
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) {
      err = cudaMemcpy(dst, static_cast<char*>(base_) + offset, size, cudaMemcpyDeviceToHost);
    }
    return err == cudaSuccess ? absl::OkStatus() : CudaError(name_, "reading", err);
  }
  absl::Status Write(uint64_t offset, const void* src, uint64_t size) override {
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) {
      err = cudaMemcpy(static_cast<char*>(base_) + offset, src, size, cudaMemcpyHostToDevice);
    }
    return err == cudaSuccess ? absl::OkStatus() : CudaError(name_, "writing", err);
  }

 private:
  const std::string name_;
  const int device_;
  void* const base_;
  const uint64_t byte_size_;
};

}  // namespace

bool CudaShmAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

bool PinHostMemory(void* data, uint64_t bytes) {
  if (!CudaShmAvailable()) return false;
  if (cudaHostRegister(data, bytes, cudaHostRegisterPortable) == cudaSuccess) return true;
  cudaGetLastError();  // not sticky: the region is used pageable
  return false;
}

void UnpinHostMemory(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> OpenCudaShmRegion(const std::string& name,
                                                             const std::string& raw_handle,
                                                             int64_t device_id,
                                                             uint64_t byte_size) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // No driver or no GPU: the server cannot take CUDA regions at all,
    // whatever the request says (checked first, so the answer is the same
    // for every request on such a machine).
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA shared memory region '", name,
                     "': no usable GPU (cudaGetDeviceCount: ", cudaGetErrorString(err), ")"));
  }
  if (raw_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA shared memory region '", name, "': raw_handle: expected ", sizeof(cudaIpcMemHandle_t),
        " bytes (a cudaIpcMemHandle_t), got ", raw_handle.size()));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA shared memory region '", name, "': byte_size: expected > 0, got 0"));
  }
  if (device_id < 0 || device_id >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA shared memory region '", name,
                                                   "': device_id: expected 0..", count - 1,
                                                   ", got ", device_id));
  }
  err = cudaSetDevice(static_cast<int>(device_id));
  if (err != cudaSuccess) return CudaError(name, "cudaSetDevice", err);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw_handle.data(), sizeof(handle));
  void* base = nullptr;
  err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return CudaError(name, "cudaIpcOpenMemHandle", err);
  return std::make_unique<CudaShmRegion>(name, static_cast<int>(device_id), base, byte_size);
}

#else  // !ATTNSERVE_HAVE_CUDA

bool CudaShmAvailable() { return false; }
bool PinHostMemory(void*, uint64_t) { return false; }
void UnpinHostMemory(void*) {}

absl::StatusOr<std::unique_ptr<ShmRegion>> OpenCudaShmRegion(const std::string& name,
                                                             const std::string&, int64_t,
                                                             uint64_t) {
  return absl::UnimplementedError(absl::StrCat("CUDA shared memory region '", name,
                                               "': this attnserve was built without CUDA"));
}

#endif

}  // namespace attnserve
