// What the CUDA benchmarks share: the CUDA-error return macro, tracked
// device allocations (a version's peak_mem_bytes) and the random fill.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace attnserve {

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                            \
      return false;                                                                      \
    }                                                                                    \
  } while (0)

// Tracked device allocations (peak_mem_bytes of a version).
struct Arena {
  std::vector<void*> ptrs;
  int64_t bytes = 0;
  void* Alloc(int64_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<int64_t>(n, 256)) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    ptrs.push_back(p);
    bytes += n;
    return p;
  }
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
};

template <typename T>
__global__ void FillRandom(T* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    const float u = (h & 0xffffff) / float(1 << 24) * 2.f - 1.f;  // (-1, 1), never all zero
    x[i] = T(u);
  }
}

}  // namespace attnserve
