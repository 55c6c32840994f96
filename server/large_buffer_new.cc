// The server's replacement of the global operator new and delete (linked into
// attnserve only): buffers of LargeBufferPool's sizes come from the process's
// LargeBufferPool, everything else from malloc, as before. Operator new is
// what allocates a protobuf bytes field (std::string), so this moves every
// request's and response's tensors, and the CPU backend's packed batches, out
// of malloc's heap (large_buffer_pool.h says why). Under a sanitizer its own
// allocator stays in charge and nothing here is defined.
#include <cstdlib>
#include <new>

#include "server/large_buffer_pool.h"
#include "common/own_allocator.h"

#ifndef ATTNSERVE_OWN_ALLOCATOR

namespace attnserve {
namespace {

// Address space per size class: this many blocks of the class in flight at
// once before its buffers come from malloc again (256 of 1 MiB, 13107 of
// 20 KiB); 6 GiB of address space in all, none of it committed until used.
constexpr size_t kPoolBytesPerClass = size_t{256} << 20;
// Freed blocks kept mapped at most, between Trims (server/malloc_tuning.h's
// HeapTrimmer trims every 2 s).
constexpr size_t kPoolMaxKeptBytes = size_t{32} << 20;

// Made on the first operator new (before main, by a static initialiser) and
// never destroyed: operator delete may run after every destructor.
LargeBufferPool& Pool() {
  alignas(LargeBufferPool) static unsigned char storage[sizeof(LargeBufferPool)];
  static LargeBufferPool* const pool = [] {
    auto* p = ::new (storage) LargeBufferPool(kPoolBytesPerClass, kPoolMaxKeptBytes);
    SetProcessLargeBufferPool(p);
    return p;
  }();
  return *pool;
}

void* AllocateOrNull(size_t bytes) {
  if (bytes >= LargeBufferPool::kMinBytes && bytes <= LargeBufferPool::kMaxBytes) {
    if (void* p = Pool().Allocate(bytes)) return p;
  }
  return std::malloc(bytes == 0 ? 1 : bytes);
}

// The standard's loop: the new-handler may free memory; without one, throw.
void* AllocateOrThrow(size_t bytes) {
  while (true) {
    if (void* p = AllocateOrNull(bytes)) return p;
    std::new_handler handler = std::get_new_handler();
    if (handler == nullptr) throw std::bad_alloc();
    handler();
  }
}

void Deallocate(void* p) noexcept {
  if (p == nullptr) return;
  LargeBufferPool& pool = Pool();
  if (pool.Owns(p)) {
    pool.Free(p);
  } else {
    std::free(p);
  }
}

}  // namespace
}  // namespace attnserve

void* operator new(size_t bytes) { return attnserve::AllocateOrThrow(bytes); }
void* operator new[](size_t bytes) { return attnserve::AllocateOrThrow(bytes); }
void* operator new(size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return attnserve::AllocateOrThrow(bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return attnserve::AllocateOrThrow(bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { attnserve::Deallocate(p); }
void operator delete[](void* p) noexcept { attnserve::Deallocate(p); }
void operator delete(void* p, size_t) noexcept { attnserve::Deallocate(p); }
void operator delete[](void* p, size_t) noexcept { attnserve::Deallocate(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { attnserve::Deallocate(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { attnserve::Deallocate(p); }
// The aligned forms are libstdc++'s (aligned_alloc and free): the pool never
// serves them.

#endif  // ATTNSERVE_OWN_ALLOCATOR
