// server/large_buffer_pool: sizes map to the classes that serve them, a freed
// block is reused whole by the next buffer of its class, what is kept is
// bounded and given back by Trim once idle, and many threads at once get
// distinct blocks.
#include "server/large_buffer_pool.h"

#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr size_t kKiB = 1024;

TEST(LargeBufferPoolTest, SizesMapToClasses) {
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(16 * kKiB - 1), 0u);  // malloc's
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(16 * kKiB), 20 * kKiB);
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(64 * kKiB), 64 * kKiB);
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(80 * kKiB), 80 * kKiB);
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(80 * kKiB + 1), 96 * kKiB);
  // A parsed 768 KiB tensor (std::string asks one more byte).
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(768 * kKiB + 1), 896 * kKiB);
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(1024 * kKiB), 1024 * kKiB);
  EXPECT_EQ(LargeBufferPool::BlockBytesFor(1024 * kKiB + 1), 0u);  // glibc maps it
}

TEST(LargeBufferPoolTest, ServesOnlyItsSizes) {
  LargeBufferPool pool(size_t{16} << 20, size_t{8} << 20);
  EXPECT_EQ(pool.Allocate(1000), nullptr);
  EXPECT_EQ(pool.Allocate(size_t{2} << 20), nullptr);
  void* p = pool.Allocate(100 * kKiB);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(pool.Owns(p));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  std::memset(p, 7, 100 * kKiB);  // writable
  int on_stack = 0;
  EXPECT_FALSE(pool.Owns(&on_stack));
  EXPECT_EQ(pool.usage().in_use_bytes, int64_t(112 * kKiB));
  pool.Free(p);
  EXPECT_EQ(pool.usage().in_use_bytes, 0);
  EXPECT_EQ(pool.usage().kept_bytes, int64_t(112 * kKiB));
}

TEST(LargeBufferPoolTest, FreedBlockIsReusedWholeByItsClass) {
  LargeBufferPool pool(size_t{16} << 20, size_t{8} << 20);
  void* a = pool.Allocate(700 * kKiB);
  void* small = pool.Allocate(70 * kKiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(small, nullptr);
  pool.Free(a);
  // The next buffer of a's class takes a's block; a smaller class never does.
  void* other_class = pool.Allocate(90 * kKiB);
  EXPECT_NE(other_class, a);
  void* b = pool.Allocate(650 * kKiB);
  EXPECT_EQ(b, a);
  pool.Free(b);
  pool.Free(small);
  pool.Free(other_class);
}

TEST(LargeBufferPoolTest, KeepsAtMostItsCapAndTrimGivesBackIdleBlocks) {
  constexpr size_t kBlock = 1024 * kKiB;
  LargeBufferPool pool(size_t{32} << 20, 4 * kBlock);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(pool.Allocate(kBlock));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), 1, kBlock);
  }
  for (void* p : blocks) pool.Free(p);
  // Four kept, four given back at once.
  EXPECT_EQ(pool.usage().kept_bytes, int64_t(4 * kBlock));
  // A given-back block comes back zeroed when reused.
  std::vector<void*> again;
  for (int i = 0; i < 6; ++i) again.push_back(pool.Allocate(kBlock));
  bool some_zeroed = false;
  for (void* p : again) some_zeroed |= static_cast<const char*>(p)[kBlock / 2] == 0;
  EXPECT_TRUE(some_zeroed);
  for (void* p : again) pool.Free(p);
  EXPECT_EQ(pool.usage().kept_bytes, int64_t(4 * kBlock));

  // The first Trim marks the period; two blocks are used in the next one, so
  // the other two sat idle and the second Trim gives them back.
  pool.Trim();
  void* x = pool.Allocate(kBlock);
  void* y = pool.Allocate(kBlock);
  pool.Free(x);
  pool.Free(y);
  pool.Trim();
  EXPECT_EQ(pool.usage().kept_bytes, int64_t(2 * kBlock));
  // Nothing used since: the rest goes too.
  pool.Trim();
  EXPECT_EQ(pool.usage().kept_bytes, 0);
  EXPECT_EQ(pool.usage().in_use_bytes, 0);
}

TEST(LargeBufferPoolTest, ARangeUsedUpLeavesItToMalloc) {
  LargeBufferPool pool(size_t{2} << 20, size_t{2} << 20);  // two 1 MiB blocks
  void* a = pool.Allocate(size_t{1} << 20);
  void* b = pool.Allocate(size_t{1} << 20);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.Allocate(size_t{1} << 20), nullptr);
  pool.Free(a);
  EXPECT_EQ(pool.Allocate(size_t{1} << 20), a);
  pool.Free(a);
  pool.Free(b);
}

TEST(LargeBufferPoolTest, ThreadsGetDistinctBlocks) {
  LargeBufferPool pool(size_t{64} << 20, size_t{16} << 20);
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  std::vector<std::thread> threads;
  std::vector<int> corrupted(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&pool, &corrupted, t] {
      for (int r = 0; r < kRounds; ++r) {
        const size_t bytes = (64 + 32 * size_t((t + r) % 4)) * kKiB;
        auto* p = static_cast<unsigned char*>(pool.Allocate(bytes));
        if (p == nullptr) continue;
        std::memset(p, t + 1, bytes);
        std::this_thread::yield();
        for (size_t i = 0; i < bytes; i += 4096) corrupted[t] += p[i] != t + 1;
        pool.Free(p);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(corrupted[t], 0) << "thread " << t;
  EXPECT_EQ(pool.usage().in_use_bytes, 0);
}

}  // namespace
}  // namespace attnserve
