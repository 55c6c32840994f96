// Process-wide allocator settings for programs whose buffers are tensors
// (the server and attnctl): memory a finished request held goes back to the
// system, and the buffers every request needs are not faulted in anew.
#pragma once

#include <cstddef>

namespace attnserve {

// Allocations of at least this many bytes are served by mmap, and so
// returned to the system when freed.
inline constexpr size_t kMmapThresholdBytes = size_t{1} << 20;

// Free memory up to this much at the top of a malloc arena stays mapped.
// glibc's default (128 KiB) gives back the space of every freed message of a
// few hundred KiB, so the next request faults it in again, page by page: on
// the 2-core development machine a 64-sequence decode step's 0.5-1 MiB of
// request and response cost ~0.5 ms of page faults in the server alone, and
// an Echo of those bytes took 1.77 ms at p50 instead of 0.64 ms. 8 MiB per
// arena keeps several such messages; larger tensors are mmap'ed anyway. The
// server raises it (server/malloc_tuning.h: one arena, trimmed every 0.5 s).
inline constexpr size_t kTrimThresholdBytes = size_t{8} << 20;

// Fixes glibc's mmap threshold at kMmapThresholdBytes and its trim threshold
// at kTrimThresholdBytes. Left alone, glibc raises the mmap threshold after
// the first large free (up to 32 MiB on 64-bit), after which tensors of a few
// MiB come from the heap and freed ones stay in the process: after a
// cancelled ForwardStream that had held 5.8 GB, RSS stayed at 5.3 GB (issue
// 15). Call once at start-up, before any thread runs. No-op with another C
// library.
void TuneMallocForTensors();

}  // namespace attnserve
