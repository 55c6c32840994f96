// Page-locked host memory for a call's tensors (CudaBackend::AllocateHostTensor):
// front-ends parse q, k and v into it and send o from it, so the copy engine
// reads and writes those bytes where they lie (one DMA, no staging copy).
// Blocks come in power-of-two sizes and go back to a free list when their
// last holder lets go: cudaHostAlloc and cudaFreeHost cost far more than a
// decode step, so steady serving allocates nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

namespace attnserve {

class PinnedHostPool : public std::enable_shared_from_this<PinnedHostPool> {
 public:
  // Below this a tensor is gathered into the staging buffer anyway
  // (kDirectHostCopyBytes), so it gets plain heap memory.
  static constexpr int64_t kMinPinnedBytes = 32 << 10;
  // Free blocks kept for reuse, in bytes; more are given back to the driver.
  static constexpr int64_t kMaxCachedBytes = int64_t{512} << 20;

  // Fresh blocks are allocated in `device`'s context (the calling thread's
  // current device is set to it), so a server on other GPUs than 0 never
  // creates a context on GPU 0.
  explicit PinnedHostPool(int device) : device_(device) {}
  ~PinnedHostPool() {
    for (auto& [size, blocks] : free_) {
      for (char* p : blocks) cudaFreeHost(p);
    }
  }

  // `bytes` of host memory, page-locked for every device when the driver
  // gives it (portable), else heap memory; null when neither is left.
  std::shared_ptr<char> Allocate(int64_t bytes) {
    if (bytes < kMinPinnedBytes) return Heap(bytes);
    const int64_t size = SizeClass(bytes);
    char* p = Take(size);
    if (p == nullptr) {
      void* fresh = nullptr;
      if (cudaSetDevice(device_) != cudaSuccess ||
          cudaHostAlloc(&fresh, static_cast<size_t>(size), cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();  // not sticky: the call falls back to pageable memory
        return Heap(bytes);
      }
      p = static_cast<char*>(fresh);
    }
    std::shared_ptr<PinnedHostPool> self = shared_from_this();
    return std::shared_ptr<char>(p, [self, size](char* block) { self->Give(block, size); });
  }

  int64_t cached_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }

 private:
  // Sixteenths of the power of two at or above `bytes`: a block is at most
  // 1/8 larger than what its caller is charged (whole powers of two let a
  // tenant hold nearly twice its in-flight bytes in page-locked memory).
  static int64_t SizeClass(int64_t bytes) {
    int64_t power = kMinPinnedBytes;
    while (power < bytes) power *= 2;
    const int64_t step = power / 16;
    return (bytes + step - 1) / step * step;
  }
  static std::shared_ptr<char> Heap(int64_t bytes) {
    char* p = new (std::nothrow) char[static_cast<size_t>(bytes > 0 ? bytes : 1)];
    if (p == nullptr) return nullptr;
    return std::shared_ptr<char>(p, std::default_delete<char[]>());
  }
  char* Take(int64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    char* p = it->second.back();
    it->second.pop_back();
    cached_ -= size;
    return p;
  }
  void Give(char* block, int64_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + size <= kMaxCachedBytes) {
        free_[size].push_back(block);
        cached_ += size;
        return;
      }
    }
    cudaFreeHost(block);
  }

  const int device_;
  mutable std::mutex mu_;
  std::map<int64_t, std::vector<char*>> free_;  // size class -> free blocks
  int64_t cached_ = 0;
};

}  // namespace attnserve
