// LargeBufferPool; see large_buffer_pool.h. Nothing here may allocate with
// operator new or malloc: the pool serves operator new.
#include "server/large_buffer_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

namespace attnserve {
namespace {

constexpr size_t kPageBytes = 4096;

// Four classes per doubling from kMinBytes: 80, 96, 112, 128, 160, ... KiB.
constexpr size_t ClassBytes(int c) {
  return (LargeBufferPool::kMinBytes << (c / 4)) / 4 * (5 + c % 4);
}
static_assert(ClassBytes(LargeBufferPool::kClasses - 1) == LargeBufferPool::kMaxBytes);
static_assert(ClassBytes(0) % kPageBytes == 0);

void* MapOrNull(size_t bytes, int protection) {
  void* p = mmap(nullptr, bytes, protection, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

std::atomic<LargeBufferPool*> process_pool{nullptr};

}  // namespace

LargeBufferPool::LargeBufferPool(size_t bytes_per_class, size_t max_kept_bytes)
    : bytes_per_class_(bytes_per_class / kPageBytes * kPageBytes), max_kept_bytes_(max_kept_bytes) {
  // Inaccessible until carved: reserving commits nothing.
  char* base = static_cast<char*>(MapOrNull(kClasses * bytes_per_class_, PROT_NONE));
  if (base == nullptr) return;
  size_t index_bytes = 0;
  for (int c = 0; c < kClasses; ++c) {
    index_bytes += 2 * sizeof(uint32_t) * (bytes_per_class_ / ClassBytes(c));
  }
  auto* indices = static_cast<uint32_t*>(MapOrNull(index_bytes, PROT_READ | PROT_WRITE));
  if (indices == nullptr) {
    munmap(base, kClasses * bytes_per_class_);
    return;
  }
  for (int c = 0; c < kClasses; ++c) {
    SizeClass& s = classes_[c];
    s.block_bytes = ClassBytes(c);
    s.begin = base + c * bytes_per_class_;
    s.capacity = static_cast<uint32_t>(bytes_per_class_ / s.block_bytes);
    s.kept = indices;
    s.released = indices + s.capacity;
    indices += 2 * s.capacity;
  }
  base_ = base;
}

size_t LargeBufferPool::BlockBytesFor(size_t bytes) {
  const int c = ClassFor(bytes);
  return c < 0 ? 0 : ClassBytes(c);
}

int LargeBufferPool::ClassFor(size_t bytes) {
  if (bytes < kMinBytes || bytes > kMaxBytes) return -1;
  int c = 0;
  while (ClassBytes(c) < bytes) ++c;
  return c;
}

void* LargeBufferPool::Allocate(size_t bytes) {
  const int c = ClassFor(bytes);
  if (c < 0 || base_ == nullptr) return nullptr;
  SizeClass& s = classes_[c];
  uint32_t index;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.num_kept > 0) {
      index = s.kept[--s.num_kept];
      s.kept_low_water = std::min(s.kept_low_water, s.num_kept);
      kept_bytes_.fetch_sub(static_cast<int64_t>(s.block_bytes), std::memory_order_relaxed);
    } else if (s.num_released > 0) {
      index = s.released[--s.num_released];
    } else if (s.carved < s.capacity) {
      // Commit the block's pages (counted by the kernel from now on).
      if (mprotect(s.begin + size_t{s.carved} * s.block_bytes, s.block_bytes,
                   PROT_READ | PROT_WRITE) != 0) {
        return nullptr;
      }
      index = s.carved++;
    } else {
      return nullptr;
    }
  }
  in_use_bytes_.fetch_add(static_cast<int64_t>(s.block_bytes), std::memory_order_relaxed);
  return s.begin + size_t{index} * s.block_bytes;
}

void LargeBufferPool::Free(void* p) {
  const size_t offset = static_cast<size_t>(static_cast<char*>(p) - base_);
  SizeClass& s = classes_[offset / bytes_per_class_];
  const auto index = static_cast<uint32_t>(offset % bytes_per_class_ / s.block_bytes);
  in_use_bytes_.fetch_sub(static_cast<int64_t>(s.block_bytes), std::memory_order_relaxed);
  const int64_t block = static_cast<int64_t>(s.block_bytes);
  // Over the cap: give the pages back now rather than keep them.
  if (kept_bytes_.fetch_add(block, std::memory_order_relaxed) + block >
      static_cast<int64_t>(max_kept_bytes_)) {
    kept_bytes_.fetch_sub(block, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(s.mu);
    Release(s, index);
    return;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.kept[s.num_kept++] = index;
}

void LargeBufferPool::Release(SizeClass& s, uint32_t index) {
  madvise(s.begin + size_t{index} * s.block_bytes, s.block_bytes, MADV_DONTNEED);
  s.released[s.num_released++] = index;
}

void LargeBufferPool::Trim() {
  if (base_ == nullptr) return;
  for (SizeClass& s : classes_) {
    std::lock_guard<std::mutex> lock(s.mu);
    // The oldest kept blocks (the bottom of the stack) were not taken since
    // the last Trim; the newer ones above them were in use recently.
    const uint32_t idle = s.kept_low_water;
    for (uint32_t i = 0; i < idle; ++i) Release(s, s.kept[i]);
    std::memmove(s.kept, s.kept + idle, sizeof(uint32_t) * (s.num_kept - idle));
    s.num_kept -= idle;
    s.kept_low_water = s.num_kept;
    kept_bytes_.fetch_sub(static_cast<int64_t>(idle) * static_cast<int64_t>(s.block_bytes),
                          std::memory_order_relaxed);
  }
}

LargeBufferPool::Usage LargeBufferPool::usage() const {
  Usage u;
  u.in_use_bytes = in_use_bytes_.load(std::memory_order_relaxed);
  u.kept_bytes = kept_bytes_.load(std::memory_order_relaxed);
  return u;
}

LargeBufferPool* ProcessLargeBufferPool() { return process_pool.load(std::memory_order_acquire); }

void SetProcessLargeBufferPool(LargeBufferPool* pool) {
  process_pool.store(pool, std::memory_order_release);
}

}  // namespace attnserve
