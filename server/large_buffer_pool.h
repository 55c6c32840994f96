// A cache of the server's large buffers (16 KiB to 1 MiB: the tensors of a
// parsed request, a response's outputs, the CPU backend's packed batches) in
// its own address range, out of malloc's heap. Why: in one heap these
// buffers, freed and reused at a different size, leave holes that the small
// long-lived objects around them (gRPC call state, K/V bookkeeping) split and
// pin; trimming cannot give back a page with one live byte, so over a
// 30-minute soak RSS grew about 1.15x with the heap's bytes in use flat
// (tests/soak/README.md). Here a buffer comes from a block of one of 24 size
// classes (four per doubling: at most 25% of a block unused), blocks of a
// class are interchangeable, so a freed one is reused whole by the next
// buffer of its class and nothing else ever lands between them.
//
// Freed blocks stay mapped for reuse (no page faults for the next request,
// which is why malloc's heap kept them too: common/malloc_tuning.h); Trim
// gives back the blocks that sat unused through a whole trim period, so what
// is kept follows the recent peak of buffers in flight, as HeapTrimmer does
// for the heap. Installed as the server's operator new for these sizes
// (server/large_buffer_new.cc); everything else still comes from malloc.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace attnserve {

class LargeBufferPool {
 public:
  // Smaller buffers come from malloc; so do those of more than kMaxBytes
  // (glibc maps each on its own: common/malloc_tuning.h's kMmapThresholdBytes).
  static constexpr size_t kMinBytes = size_t{16} << 10;
  static constexpr size_t kMaxBytes = size_t{1} << 20;
  static constexpr int kClasses = 24;

  // Reserves kClasses * bytes_per_class of address space (inaccessible and
  // uncommitted until a block is first handed out). Keeps at most
  // max_kept_bytes of freed blocks mapped. If the reservation fails the pool
  // serves nothing (Allocate returns nullptr) and the caller uses malloc.
  LargeBufferPool(size_t bytes_per_class, size_t max_kept_bytes);
  // The address range stays reserved: the pool lives as long as the process.
  ~LargeBufferPool() = default;
  LargeBufferPool(const LargeBufferPool&) = delete;
  LargeBufferPool& operator=(const LargeBufferPool&) = delete;

  // A block of at least `bytes`, 4 KiB-aligned; nullptr when `bytes` is
  // outside [kMinBytes, kMaxBytes] or the class's range is used up.
  void* Allocate(size_t bytes);
  // Whether `p` came from Allocate (an address check: cheap on every free).
  bool Owns(const void* p) const {
    return base_ != nullptr && p >= static_cast<const void*>(base_) &&
           p < static_cast<const void*>(base_ + kClasses * bytes_per_class_);
  }
  // Takes back a block from Allocate.
  void Free(void* p);
  // Gives back to the system the kept blocks that no Allocate needed since
  // the last Trim.
  void Trim();

  struct Usage {
    int64_t in_use_bytes = 0;  // blocks handed out and not freed
    int64_t kept_bytes = 0;    // freed blocks kept mapped for reuse
  };
  Usage usage() const;

  // The class size that serves `bytes` (for tests); 0 outside the range.
  static size_t BlockBytesFor(size_t bytes);

 private:
  struct SizeClass {
    std::mutex mu;
    size_t block_bytes = 0;
    char* begin = nullptr;  // the class's range
    uint32_t capacity = 0;  // blocks that fit in it
    uint32_t carved = 0;    // blocks made accessible so far
    // Freed blocks by index: `kept` are mapped (most recently freed last),
    // `released` were given back and fault in zero pages when reused.
    uint32_t* kept = nullptr;
    uint32_t num_kept = 0;
    uint32_t* released = nullptr;
    uint32_t num_released = 0;
    // The fewest kept blocks since the last Trim: that many sat unused.
    uint32_t kept_low_water = 0;
  };
  static int ClassFor(size_t bytes);
  // Gives the block's pages back; it stays accessible for reuse.
  void Release(SizeClass& c, uint32_t index);

  const size_t bytes_per_class_;
  const size_t max_kept_bytes_;
  char* base_ = nullptr;
  SizeClass classes_[kClasses];
  std::atomic<int64_t> in_use_bytes_{0};
  std::atomic<int64_t> kept_bytes_{0};
};

// The pool the server's operator new uses, or nullptr in a program without
// server/large_buffer_new.cc (tests) or with a sanitizer's allocator.
LargeBufferPool* ProcessLargeBufferPool();
// Called once by large_buffer_new.cc.
void SetProcessLargeBufferPool(LargeBufferPool* pool);

}  // namespace attnserve
