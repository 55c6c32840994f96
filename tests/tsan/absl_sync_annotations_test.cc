// TSan builds only: checks that tests/tsan/absl_sync_annotations.cc makes
// Debian's (uninstrumented) Abseil synchronisation visible to ThreadSanitizer.
// Each test hands plain, non-atomic data between threads through one absl
// primitive the project uses (MutexLock, Await, LockWhen, CondVar, TryLock,
// Notification). Without the annotations TSan reports a data race in the
// MutexLock, CondVar, TryLock and Notification tests (checked; scripts/
// sanitize.sh runs with halt_on_error=1, so each fails). The Await/LockWhen
// test passes either way: a waiter that blocks is woken through the library's
// pthread-based semaphore, which TSan does intercept; it is here to show that
// the wait wrappers' release-and-reacquire gives no false report either.
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace {

TEST(AbslSyncAnnotationsTest, MutexLockGuardsACounter) {
  absl::Mutex mu;
  long counter = 0;  // guarded by mu; deliberately not atomic
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        absl::MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(counter, 8000);
}

TEST(AbslSyncAnnotationsTest, AwaitAndLockWhenSeeTheWriterBeforeThem) {
  absl::Mutex mu;
  bool ready = false;
  std::vector<int> payload;  // written before `ready`, read after waiting for it
  std::thread awaiter([&] {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&ready));
    EXPECT_EQ(payload.size(), 3u);
  });
  std::thread lock_when([&] {
    mu.LockWhen(absl::Condition(&ready));
    EXPECT_EQ(payload.size(), 3u);
    mu.Unlock();
  });
  std::thread timed([&] {
    absl::MutexLock lock(&mu);
    while (!mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(5))) {
    }
    EXPECT_EQ(payload.size(), 3u);
  });
  {
    absl::MutexLock lock(&mu);
    payload = {1, 2, 3};
    ready = true;
  }
  awaiter.join();
  lock_when.join();
  timed.join();
}

TEST(AbslSyncAnnotationsTest, CondVarWaitHandsOver) {
  absl::Mutex mu;
  absl::CondVar cv;
  int turn = 0;
  long shared = 0;  // each thread adds on its turn
  auto player = [&](int me) {
    for (int round = 0; round < 200; ++round) {
      absl::MutexLock lock(&mu);
      while (turn != me) cv.Wait(&mu);
      ++shared;
      turn = 1 - me;
      cv.SignalAll();
    }
  };
  std::thread a(player, 0);
  std::thread b(player, 1);
  a.join();
  b.join();
  EXPECT_EQ(shared, 400);
}

TEST(AbslSyncAnnotationsTest, TryLockAndReaderLock) {
  absl::Mutex mu;
  long value = 0;
  std::thread writer([&] {
    for (int i = 0; i < 500; ++i) {
      while (!mu.TryLock()) {
      }
      ++value;
      mu.Unlock();
    }
  });
  long seen = 0;
  for (int i = 0; i < 500; ++i) {
    absl::ReaderMutexLock lock(&mu);
    seen = value;
  }
  writer.join();
  EXPECT_LE(seen, 500);
}

TEST(AbslSyncAnnotationsTest, NotificationPublishes) {
  std::vector<int> payload;
  absl::Notification done;
  absl::Notification timed_done;
  std::thread producer([&] {
    payload.assign(100, 7);
    done.Notify();
    timed_done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(payload.size(), 100u);
  ASSERT_TRUE(timed_done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(payload[99], 7);
  producer.join();
}

}  // namespace
