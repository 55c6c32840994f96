// Host memory copies run in parallel: staging a launch (PackedBatch::Gather
// and Scatter) moves megabytes per request, and one thread's memcpy (about
// 5 GB/s) made the CUDA backend's launcher thread the server's bottleneck
// under load (bench/NOTES-serving.md).
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "common/thread_pool.h"

namespace attnserve {

struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

// Runs a list of copies; PackedBatch takes one so a backend decides how.
using CopyRunner = std::function<void(const std::vector<HostCopy>&)>;

// Every copy in turn on the calling thread.
void CopySerially(const std::vector<HostCopy>& copies);

// Through `run` when set, else serially (the packers' default).
void RunCopies(const CopyRunner& run, const std::vector<HostCopy>& copies);

// Splits the copies into chunks of at least `min_chunk_bytes` and spreads them
// over `pool` (the caller included). Small lists run serially: waking the pool
// costs more than copying a few hundred kilobytes.
void CopyInParallel(const std::vector<HostCopy>& copies, ThreadPool* pool,
                    size_t min_chunk_bytes = size_t{1} << 20);

}  // namespace attnserve
