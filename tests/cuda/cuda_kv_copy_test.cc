// The CUDA backend's copies in and out of K/V memory (what moving sequences
// between servers reads and writes pages with): bytes written at an offset
// of a slab come back unchanged, and the bytes around them are untouched.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

TEST(CudaKvCopy, RoundTripsAtAnOffset) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  constexpr int64_t kBytes = 1 << 20;
  absl::StatusOr<void*> slab = backend->AllocateKvMemory(kBytes);
  ASSERT_TRUE(slab.ok()) << slab.status();
  char* base = static_cast<char*>(*slab);
  std::vector<char> zeros(kBytes, 0);
  ASSERT_TRUE(backend->CopyToKvMemory(base, zeros.data(), kBytes).ok());
  std::mt19937 rng(3);
  std::vector<char> rows(12345);
  for (char& c : rows) c = static_cast<char>(rng());
  const int64_t at = 4093;  // unaligned, as a page run's offset may be
  ASSERT_TRUE(backend->CopyToKvMemory(base + at, rows.data(), int64_t(rows.size())).ok());
  std::vector<char> back(kBytes, 1);
  ASSERT_TRUE(backend->CopyFromKvMemory(back.data(), base, kBytes).ok());
  EXPECT_EQ(0, std::memcmp(back.data() + at, rows.data(), rows.size()));
  for (int64_t i = 0; i < kBytes; ++i) {
    if (i >= at && i < at + int64_t(rows.size())) continue;
    ASSERT_EQ(back[size_t(i)], 0) << "byte " << i;
  }
  backend->FreeKvMemory(base);
}

}  // namespace
}  // namespace attnserve
