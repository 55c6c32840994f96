// The server's own allocator settings, on top of common/malloc_tuning.h's
// (large tensors on mmap, given back when freed): what the allocator keeps
// for reuse stays level under steady traffic. Also reads
// the allocator's own account of the heap, so /metrics (and the soak test)
// can tell memory in use from free memory the allocator keeps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// malloc arenas the process may use (glibc's M_ARENA_MAX).
inline constexpr int kMallocArenas = 1;
// Free memory at the top of the heap that glibc keeps instead of giving it
// back at once (M_TRIM_THRESHOLD); more is returned when freed.
inline constexpr size_t kKeepFreeHeapTopBytes = size_t{64} << 20;

// Caps glibc's arenas at kMallocArenas and lets the heap keep up to
// kKeepFreeHeapTopBytes free at its top, raising common/malloc_tuning.h's
// kTrimThresholdBytes for the server (HeapTrimmer gives back the rest of
// what it keeps). Left alone, glibc gives a thread that finds its arena busy
// another one, up to 8 per core; gRPC runs each call on whichever of its
// threads is free, so over minutes more arenas each keep the freed,
// fragmented chunks of their busiest moment (buffers under
// kMmapThresholdBytes: a tensor of a few hundred KiB, a decoded request) and
// RSS climbs with no byte leaked. Measured with the 2-minute soak on 2 cores
// (tests/soak/README.md): heap in use flat at 10-15 MB in every run while
// RSS rose by up to 1.14x between the second and the last fifth (1.07x with
// 2 arenas; with one arena trimmed at glibc's default 128 KiB, RSS follows
// the requests in flight second by second and its medians wander 1.06-1.11x).
// (Fixing M_MMAP_THRESHOLD turned off glibc's own raising of the trim
// threshold, which would otherwise follow the largest freed block.) glibc's
// per-thread cache still serves small allocations without the arena's lock.
// Call once at start-up, after TuneMallocForTensors and before any thread
// runs. Not measured on many cores: one arena serialises malloc between
// threads that miss glibc's per-thread cache. No-op with another C library.
void UseBoundedMallocArenas();

// The allocator's account of the heap (glibc's mallinfo2, over all arenas).
struct HeapUsage {
  // Bytes handed out and not yet freed: chunks in the arenas plus mmap'd
  // allocations. Grows without bound only with a leak.
  int64_t in_use_bytes = 0;
  // Bytes freed into the arenas that the allocator keeps for reuse instead
  // of returning them (part of RSS where touched).
  int64_t free_bytes = 0;
};

// Zeros with another C library (or a glibc older than 2.33). Walks every
// arena under its lock: cheap enough for a scrape, not for the request path.
HeapUsage ReadHeapUsage();

// How often HeapTrimmer gives the heap's free pages back. Every 10 s made
// RSS a 10-s sawtooth whose medians over 24 one-second samples moved by up
// to 6% with no trend (soak runs 1.040, 1.058, 1.053). Every 2 s, RSS still
// carried the free pages requests had touched since the last trim, which
// wandered with the traffic (heap free 14-22 MB): 2-minute soaks 0.951 to
// 1.080, one of nine over the 1.05 rule. Every 0.5 s, side by side with 2 s
// (tests/soak/README.md): RSS under the soak 43-47 MB in 6-s medians against
// 45-53 (s.d. 1.8 against 3.1 MB), and the server's CPU time per call the
// same within the machine's noise (medians of 3 rounds, Echo of 1.5 MiB
// 1.25 against 1.22 ms, Forward 1.58 against 1.56 ms) for 8-15 more minor
// page faults per 1.5 MiB call.
inline constexpr absl::Duration kHeapTrimPeriod = absl::Milliseconds(500);

// Every kHeapTrimPeriod, gives back to the system the free pages the heap
// keeps: at its top (up to kKeepFreeHeapTopBytes between trims) and inside
// it, between live chunks (glibc's malloc_trim). Why: one arena that keeps
// its top still fragments: in a 2-minute soak its free bytes grew 27 -> 34 MB
// and RSS 1.09x with heap in use flat. Between trims RSS is the high-water
// mark of the period's requests in flight, so it is bounded by that plus
// the fragments no trim can free, and a leak still raises it. Costs a walk
// of the heap each period and page faults when trimmed pages are used again.
// No-op with another C library.
class HeapTrimmer {
 public:
  HeapTrimmer();
  // Stops and joins the thread.
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

 private:
  void Loop();

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve
