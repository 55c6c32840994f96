// Process-wide allocator settings for programs whose buffers are tensors:
// TuneMallocForTensors for the server and attnctl (large tensors on mmap,
// messages not faulted in anew), and the server's own on top of it (one
// bounded arena trimmed by HeapTrimmer, ReadHeapUsage for /metrics and the
// soak test). Why each setting, with the soak's figures: tests/soak/README.md
// and bench/NOTES-kv.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// Allocations of at least this many bytes are served by mmap, and so
// returned to the system when freed.
inline constexpr size_t kMmapThresholdBytes = size_t{1} << 20;

// Free memory up to this much at the top of a malloc arena stays mapped:
// glibc's default (128 KiB) gives back the space of every freed message of a
// few hundred KiB, so the next request faults it in again page by page.
inline constexpr size_t kTrimThresholdBytes = size_t{8} << 20;

// Fixes glibc's mmap threshold at kMmapThresholdBytes and its trim threshold
// at kTrimThresholdBytes. Left alone, glibc raises the mmap threshold after
// the first large free (up to 32 MiB on 64-bit), after which freed tensors of
// a few MiB stay in the process. Call once at start-up, before any thread
// runs. No-op with another C library.
void TuneMallocForTensors();

// malloc arenas the server may use (glibc's M_ARENA_MAX).
inline constexpr int kMallocArenas = 1;
// Free memory at the top of the heap that glibc keeps instead of giving it
// back at once (M_TRIM_THRESHOLD); more is returned when freed.
inline constexpr size_t kKeepFreeHeapTopBytes = size_t{64} << 20;

// Caps glibc's arenas at kMallocArenas and raises the trim threshold to
// kKeepFreeHeapTopBytes (HeapTrimmer gives back the rest of what it keeps).
// Left alone, glibc gives a thread that finds its arena busy another one, up
// to 8 per core; gRPC runs each call on whichever thread is free, so each
// arena keeps the fragments of its busiest moment and RSS climbs with no byte
// leaked. glibc's per-thread cache still serves small allocations without
// the arena's lock; on many cores one arena may serialise the rest. Call once
// at start-up, after TuneMallocForTensors and before any thread runs. No-op
// with another C library.
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

// How often HeapTrimmer gives the heap's free pages back: longer periods let
// RSS carry whatever free pages the traffic touched since the last trim.
inline constexpr absl::Duration kHeapTrimPeriod = absl::Milliseconds(500);

// Every kHeapTrimPeriod, gives back to the system the free pages the heap
// keeps: at its top (up to kKeepFreeHeapTopBytes between trims) and between
// live chunks (glibc's malloc_trim), since one arena that keeps its top still
// fragments. RSS is then bounded by the period's requests in flight plus the
// fragments no trim can free, and a leak still raises it. Costs a walk of
// the heap each period and page faults when trimmed pages are used again.
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
