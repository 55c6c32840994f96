// KeepLargeAllocationsOnMmap, UseBoundedMallocArenas and ReadHeapUsage; see
// malloc_tuning.h.
#include "server/malloc_tuning.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnserve {

void KeepLargeAllocationsOnMmap() {
#if defined(__GLIBC__)
  // Setting M_MMAP_THRESHOLD explicitly also turns off its dynamic adjustment.
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThresholdBytes));
#endif
}

void UseBoundedMallocArenas() {
#if defined(__GLIBC__)
  mallopt(M_ARENA_MAX, kMallocArenas);
#endif
}

HeapUsage ReadHeapUsage() {
  HeapUsage usage;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  // uordblks: allocated chunks in the arenas; hblkhd: mmap'd allocations;
  // fordblks: free chunks the arenas keep.
  usage.in_use_bytes = static_cast<int64_t>(m.uordblks + m.hblkhd);
  usage.free_bytes = static_cast<int64_t>(m.fordblks);
#endif
  return usage;
}

}  // namespace attnserve
