// Process-wide allocator settings for a server whose buffers are large
// tensors: memory a finished request held goes back to the system.
#pragma once

#include <cstddef>

namespace attnserve {

// Allocations of at least this many bytes are served by mmap, and so
// returned to the system when freed.
inline constexpr size_t kMmapThresholdBytes = size_t{1} << 20;

// Fixes glibc's mmap threshold at kMmapThresholdBytes. Left alone, glibc
// raises the threshold after the first large free (up to 32 MiB on 64-bit),
// after which tensors of a few MiB come from the heap and freed ones stay in
// the process: after a cancelled ForwardStream that had held 5.8 GB, RSS
// stayed at 5.3 GB (issue 15). Call once at start-up, before any thread runs.
// No-op with another C library.
void KeepLargeAllocationsOnMmap();

}  // namespace attnserve
