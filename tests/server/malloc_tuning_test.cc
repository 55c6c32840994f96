// common/malloc_tuning: the arena cap holds however many threads allocate at
// once (without it glibc gives each new thread an arena of its own, and the
// soak's RSS climbs; tests/soak/README.md), and ReadHeapUsage counts what is
// held and stops counting it when freed. Its own binary: the cap must be set
// before any other thread has allocated.
#include "common/malloc_tuning.h"

#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"
#include "tests/common/own_allocator.h"

namespace attnserve {
namespace {

// glibc's malloc_info lists one <heap nr="..."> element per arena.
int ArenaCount() {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* f = open_memstream(&text, &size);
  malloc_info(0, f);
  std::fclose(f);
  int n = 0;
  for (const char* p = text; (p = std::strstr(p, "<heap nr=")) != nullptr; ++p) ++n;
  std::free(text);
  return n;
}

TEST(MallocTuningTest, ThreadsShareTheBoundedArenas) {
#ifdef ATTNSERVE_OWN_ALLOCATOR
  GTEST_SKIP() << "a sanitizer's allocator replaces glibc's here";
#endif
  UseBoundedMallocArenas();
  TuneMallocForTensors();
  // Eight threads allocate at the same moment, each while holding a block:
  // uncapped, each would get a new arena.
  constexpr int kThreads = 8;
  absl::Barrier* start = new absl::Barrier(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([start] {
      if (start->Block()) delete start;
      std::vector<std::string> held;
      for (int j = 0; j < 200; ++j) held.emplace_back(size_t{4096} + size_t(j), 'x');
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ArenaCount(), kMallocArenas);
}

TEST(MallocTuningTest, HeapUsageCountsWhatIsHeld) {
#ifdef ATTNSERVE_OWN_ALLOCATOR
  GTEST_SKIP() << "a sanitizer's allocator replaces glibc's here";
#endif
  const HeapUsage before = ReadHeapUsage();
  constexpr size_t kBig = size_t{4} << 20;      // mmap'd (over kMmapThresholdBytes)
  constexpr size_t kSmall = size_t{256} << 10;  // from the arena
  char* big = static_cast<char*>(std::malloc(kBig));
  char* small = static_cast<char*>(std::malloc(kSmall));
  ASSERT_NE(big, nullptr);
  ASSERT_NE(small, nullptr);
  std::memset(big, 1, kBig);
  std::memset(small, 1, kSmall);
  const HeapUsage held = ReadHeapUsage();
  std::free(big);
  std::free(small);
  const HeapUsage after = ReadHeapUsage();
  EXPECT_GE(held.in_use_bytes - before.in_use_bytes, int64_t(kBig + kSmall));
  EXPECT_LE(after.in_use_bytes - before.in_use_bytes, int64_t{64} << 10);
  EXPECT_GE(after.free_bytes, 0);
}

}  // namespace
}  // namespace attnserve
