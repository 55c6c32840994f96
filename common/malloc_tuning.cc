// TuneMallocForTensors, UseBoundedMallocArenas, ReadHeapUsage and HeapTrimmer;
// see malloc_tuning.h.
#include "common/malloc_tuning.h"

#if defined(__GLIBC__)
#include <malloc.h>
#include <pthread.h>
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

void UseBoundedMallocArenas() {
#if defined(__GLIBC__)
  mallopt(M_ARENA_MAX, kMallocArenas);
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(kKeepFreeHeapTopBytes));
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

HeapTrimmer::HeapTrimmer() {
  thread_ = std::thread([this] { Loop(); });
#if defined(__GLIBC__)
  // Named, so /proc/PID/task/*/comm tells it from a leaked thread.
  pthread_setname_np(thread_.native_handle(), "heap_trimmer");
#endif
}

HeapTrimmer::~HeapTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void HeapTrimmer::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), kHeapTrimPeriod)) return;
    }
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
  }
}

}  // namespace attnserve
