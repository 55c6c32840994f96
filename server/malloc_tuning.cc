// KeepLargeAllocationsOnMmap; see malloc_tuning.h.
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

}  // namespace attnserve
