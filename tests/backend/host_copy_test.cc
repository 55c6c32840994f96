// CopyInParallel gives the same bytes as memcpy whatever the chunking: copies
// of odd sizes, empty ones, and lists below and above the parallel threshold.
#include "common/host_copy.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(HostCopyTest, ParallelCopiesMatchSerialOnes) {
  ThreadPool pool(3);
  for (size_t min_chunk : {size_t{1}, size_t{1000}, size_t{1} << 20}) {
    SCOPED_TRACE(min_chunk);
    const std::vector<size_t> sizes = {0, 1, 4097, 250000, 3 * 1000 * 1000 + 7, 12};
    std::vector<std::vector<uint8_t>> src, dst;
    std::vector<HostCopy> copies;
    for (size_t i = 0; i < sizes.size(); ++i) {
      src.emplace_back(sizes[i]);
      for (size_t j = 0; j < sizes[i]; ++j) src.back()[j] = static_cast<uint8_t>(j * 31 + i);
      dst.emplace_back(sizes[i] + 16, 0xAB);  // tail guards against overruns
    }
    for (size_t i = 0; i < sizes.size(); ++i)
      copies.push_back({dst[i].data(), src[i].data(), sizes[i]});
    CopyInParallel(copies, &pool, min_chunk);
    for (size_t i = 0; i < sizes.size(); ++i) {
      for (size_t j = 0; j < sizes[i]; ++j) ASSERT_EQ(dst[i][j], src[i][j]) << i << " " << j;
      for (size_t j = sizes[i]; j < dst[i].size(); ++j)
        ASSERT_EQ(dst[i][j], 0xAB) << "overrun " << i;
    }
  }
}

}  // namespace
}  // namespace attnserve
