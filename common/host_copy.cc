// Serial and parallel host copies; see host_copy.h.
#include "common/host_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace attnserve {

void RunCopies(const CopyRunner& run, const std::vector<HostCopy>& copies) {
  if (run) {
    run(copies);
  } else {
    CopySerially(copies);
  }
}

void CopySerially(const std::vector<HostCopy>& copies) {
  for (const HostCopy& c : copies) {
    if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
  }
}

void CopyInParallel(const std::vector<HostCopy>& copies, ThreadPool* pool, size_t min_chunk_bytes) {
  size_t total = 0;
  for (const HostCopy& c : copies) total += c.bytes;
  const int threads = pool == nullptr ? 1 : pool->num_threads();
  if (threads == 1 || total < 2 * min_chunk_bytes) return CopySerially(copies);
  // About four chunks per thread, so unequal copies still balance.
  const size_t chunk = std::max(min_chunk_bytes, total / (size_t(threads) * 4) + 1);
  std::vector<HostCopy> chunks;
  for (const HostCopy& c : copies) {
    for (size_t off = 0; off < c.bytes; off += chunk) {
      chunks.push_back({static_cast<char*>(c.dst) + off, static_cast<const char*>(c.src) + off,
                        std::min(chunk, c.bytes - off)});
    }
  }
  pool->Run(static_cast<int64_t>(chunks.size()), [&chunks](int, int64_t i) {
    std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].bytes);
  });
}

}  // namespace attnserve
