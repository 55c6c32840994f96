// CUDA shared memory (Triton's cuda_shared_memory extension): a client's
// device allocation, opened from its cudaIpcMemHandle_t on the device it
// names. Only a CUDA build implements it; elsewhere Open answers UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/shm/shm_region.h"

namespace attnserve {

// True in a CUDA build that sees a GPU (then the cuda_shared_memory extension
// is offered).
bool CudaShmAvailable();

// Page-locks [data, data + bytes) of host memory for every CUDA device
// (cudaHostRegister, portable), so a CUDA backend's copies read and write it
// where it lies, with no staging copy. False where it cannot (no CUDA, or the
// driver refused): the memory is then used as it is, pageable.
bool PinHostMemory(void* data, uint64_t bytes);
// Undoes PinHostMemory (before the memory is unmapped).
void UnpinHostMemory(void* data);

// Opens `raw_handle` (the bytes of a cudaIpcMemHandle_t) on `device_id`;
// `byte_size` bytes of it become the region. `name` is for messages.
absl::StatusOr<std::unique_ptr<ShmRegion>> OpenCudaShmRegion(const std::string& name,
                                                             const std::string& raw_handle,
                                                             int64_t device_id, uint64_t byte_size);

}  // namespace attnserve
