// A --handoff_peer push's send window (ChargePushWindow, server/native/
// kv_moved.h): sized to the server's budget and the tenant's bytes_in_flight,
// charged to both while it is held and given back after, waiting for room
// until its deadline, and refused at once when it could never fit. Built in
// every build: the gRPC push holds a window too.
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/native/kv_moved.h"

namespace attnserve {
namespace {

// One layer, 2 KV heads of 16 FP32: a 16-token page of K and V is 4 KiB.
KvGeometry Geometry() {
  KvGeometry g;
  g.num_layers = 1;
  g.num_heads_kv = 2;
  g.head_dim = 16;
  g.dtype = DType::kFP32;
  g.cache_dtype = DType::kFP32;
  return g;
}
constexpr int32_t kPage = 16;
constexpr int64_t kPageBytes = 4 << 10;

absl::StatusOr<std::unique_ptr<PushWindow>> Charge(ByteBudget* budget, TenantDirectory* tenants,
                                                   int64_t pages_used = 1000,
                                                   absl::Duration wait = absl::Seconds(20)) {
  return ChargePushWindow("t", "kv0", Geometry(), kPage, pages_used, budget, tenants,
                          absl::Now() + wait);
}

TEST(KvPushWindowTest, SizedToTheBudgetAndChargedWhileHeld) {
  ByteBudget budget(1 << 20);
  {
    auto w = Charge(&budget, nullptr);
    ASSERT_TRUE(w.ok()) << w.status();
    // 1 MiB over 8 chunks: 128 KiB chunks of whole pages.
    EXPECT_EQ((*w)->chunk_target, 128 << 10);
    EXPECT_EQ((*w)->chunk_max, 128 << 10);
    EXPECT_EQ((*w)->held, 1 << 20);
    EXPECT_EQ(budget.used(), 1 << 20);
  }
  EXPECT_EQ(budget.used(), 0);
  // No limit: the default 4 MiB chunk, but none above the pages in use.
  ByteBudget open(0);
  auto big = Charge(&open, nullptr, /*pages_used=*/100000);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ((*big)->held, kPushWindowChunks * (int64_t{4} << 20));
  auto small = Charge(&open, nullptr, /*pages_used=*/3);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->chunk_max, 3 * kPageBytes);
  EXPECT_EQ(open.used(), (*big)->held + (*small)->held);
}

TEST(KvPushWindowTest, ChargedToTheTenantWithinItsQuota) {
  TenantDirectory tenants;
  tenants.SetQuotas({{"t", TenantQuotas{64 << 10, 0, 0}}});
  ByteBudget budget(0);
  {
    auto w = Charge(&budget, &tenants);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->held, 64 << 10);  // 8 chunks of 2 pages
    // The tenant has nothing left while the window is held.
    EXPECT_EQ(tenants.ChargeInFlight("t", 1).status().code(), absl::StatusCode::kResourceExhausted);
  }
  EXPECT_TRUE(tenants.ChargeInFlight("t", 64 << 10).ok());
  // 8 pages do not fit in 16 KiB: refused at once, naming the quota.
  tenants.SetQuotas({{"t", TenantQuotas{16 << 10, 0, 0}}});
  const absl::Time start = absl::Now();
  auto refused = Charge(&budget, &tenants);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("bytes_in_flight"), std::string::npos)
      << refused.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(KvPushWindowTest, AWindowThatNeverFitsIsRefusedAtOnce) {
  ByteBudget budget(16 << 10);  // under 8 pages
  const absl::Time start = absl::Now();
  auto w = Charge(&budget, nullptr);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(w.status().message().find("max_buffered_bytes"), std::string::npos) << w.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(budget.used(), 0);
}

TEST(KvPushWindowTest, WaitsForRoomUntilItsDeadline) {
  ByteBudget budget(1 << 20);
  ASSERT_TRUE(budget.TryCharge(512 << 10));  // another holder
  // The deadline passes with the budget still held: refused, nothing charged.
  auto late = Charge(&budget, nullptr, 1000, absl::Milliseconds(50));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kResourceExhausted) << late.status();
  EXPECT_EQ(budget.used(), 512 << 10);
  // The other holder lets go while the push waits: it goes on.
  absl::StatusOr<std::unique_ptr<PushWindow>> got;
  std::thread push([&] { got = Charge(&budget, nullptr); });
  budget.Release(512 << 10);
  push.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(budget.used(), 1 << 20);
}

}  // namespace
}  // namespace attnserve
