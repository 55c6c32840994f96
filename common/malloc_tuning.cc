// TuneMallocForTensors; see malloc_tuning.h.
#include "common/malloc_tuning.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnserve {

void TuneMallocForTensors() {
#if defined(__GLIBC__)
  // Setting either threshold explicitly also turns off glibc's dynamic
  // adjustment of both.
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThresholdBytes));
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThresholdBytes));
#endif
}

}  // namespace attnserve
