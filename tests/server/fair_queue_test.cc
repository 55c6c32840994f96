// The fair-share rule (server/fair_queue.h) on its own, deterministically:
// per-tenant order, shares by cost under deficit round robin, a small tenant
// behind a flood, riders charged to their tenant, the front lane, admission,
// and RequestCost's two regimes.
#include "server/fair_queue.h"

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

struct Item {
  std::string tenant;
  int seq;  // arrival order within its tenant
  int64_t cost;
};

void Push(FairQueue<Item>* q, const std::string& tenant, int seq, int64_t cost) {
  q->Push(tenant, cost, Item{tenant, seq, cost});
}

std::string Tenants(std::vector<Item> items) {
  std::string out;
  for (const Item& i : items) out += i.tenant;
  return out;
}

std::vector<Item> PopAll(FairQueue<Item>* q) {
  std::vector<Item> out;
  while (!q->empty()) out.push_back(q->Pop());
  return out;
}

TEST(FairQueueTest, OneTenantIsFifo) {
  FairQueue<Item> q(10);
  for (int i = 0; i < 20; ++i) Push(&q, "a", i, 1 + (i * 7) % 30);
  EXPECT_EQ(q.size(), 20);
  std::vector<Item> out = PopAll(&q);
  ASSERT_EQ(out.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(out[i].seq, i);
}

TEST(FairQueueTest, EqualCostsAlternate) {
  FairQueue<Item> q(5);
  for (int i = 0; i < 4; ++i) Push(&q, "a", i, 5);
  for (int i = 0; i < 4; ++i) Push(&q, "b", i, 5);
  EXPECT_EQ(Tenants(PopAll(&q)), "abababab");
}

TEST(FairQueueTest, SharesAreByCostNotByCount) {
  // a's items cost 4, b's cost 1, quantum 4: per round a runs one, b four.
  FairQueue<Item> q(4);
  for (int i = 0; i < 3; ++i) Push(&q, "a", i, 4);
  for (int i = 0; i < 12; ++i) Push(&q, "b", i, 1);
  EXPECT_EQ(Tenants(PopAll(&q)), "abbbbabbbbabbbb");
}

TEST(FairQueueTest, SmallTenantDoesNotWaitForTheFlood) {
  // The flood was queued first: 100 items of 100 each. Three small calls of
  // cost 1 arrive after it; quantum 10 (a flood item needs ten turns).
  FairQueue<Item> q(10);
  for (int i = 0; i < 100; ++i) Push(&q, "flood", i, 100);
  for (int i = 0; i < 3; ++i) Push(&q, "small", i, 1);
  std::vector<Item> out = PopAll(&q);
  int last_small = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].tenant == "small") last_small = static_cast<int>(i);
  }
  // All three go on small's first turn, before any flood item has saved up
  // enough: at most one flood item (none here) precedes them.
  EXPECT_LE(last_small, 3);
  EXPECT_EQ(out[0].tenant, "small");
}

TEST(FairQueueTest, BackloggedTenantsStayWithinOneQuantumPlusOneItem) {
  // Random costs, three tenants, all backlogged throughout: the cost served
  // to any two differs by at most quantum + the largest item, at every point.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> cost(1, 50);
  const int64_t quantum = 20;
  FairQueue<Item> q(quantum);
  std::map<std::string, int> next_seq;
  for (const std::string t : {"a", "b", "c"}) {
    for (int i = 0; i < 400; ++i) Push(&q, t, next_seq[t]++, cost(rng));
  }
  std::map<std::string, int64_t> served;
  std::map<std::string, int> seen_seq = {{"a", -1}, {"b", -1}, {"c", -1}};
  for (int n = 0; n < 600; ++n) {
    Item item = q.Pop();
    EXPECT_EQ(item.seq, seen_seq[item.tenant] + 1) << "order within " << item.tenant;
    seen_seq[item.tenant] = item.seq;
    served[item.tenant] += item.cost;
    for (const auto& [x, sx] : served) {
      for (const auto& [y, sy] : served) {
        EXPECT_LE(sx - sy, quantum + 50 + 50) << x << " vs " << y << " after " << n;
      }
    }
  }
}

TEST(FairQueueTest, RidersArePaidForByTheirTenant) {
  // b's two items ride along in a's launch (TakeIf); b then owes their cost
  // and a runs first until the debt is repaid.
  FairQueue<Item> q(10);
  for (int i = 0; i < 4; ++i) Push(&q, "a", i, 10);
  for (int i = 0; i < 4; ++i) Push(&q, "b", i, 10);
  Item head = q.Pop();
  EXPECT_EQ(head.tenant, "a");
  std::vector<Item> riders;
  int taken = 0;
  q.TakeIf([&](const Item& i) { return i.tenant == "b" && taken++ < 2; }, &riders);
  ASSERT_EQ(riders.size(), 2u);
  EXPECT_EQ(riders[0].seq, 0);  // in b's arrival order
  EXPECT_EQ(riders[1].seq, 1);
  // Left: a1..a3, b2, b3. b's turns take it from -20 to -10, then 0, so a
  // runs twice before b's next item; then they alternate.
  EXPECT_EQ(Tenants(PopAll(&q)), "aabab");
}

TEST(FairQueueTest, FrontLaneGoesFirst) {
  FairQueue<Item> q(10);
  Push(&q, "a", 0, 1);
  q.PushFront(Item{"r", 1, 0});
  q.PushFront(Item{"r", 0, 0});
  EXPECT_EQ(q.size(), 3);
  std::vector<Item> out = PopAll(&q);
  EXPECT_EQ(Tenants(out), "rra");
  EXPECT_EQ(out[0].seq, 0);
  EXPECT_EQ(out[1].seq, 1);
}

TEST(FairQueueTest, AdmissionKeepsRoomForTenantsBelowTheirShare) {
  FairQueue<Item> q(10);
  const int64_t limit = 4;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(q.HasRoom("a", limit));
    Push(&q, "a", i, 1);
  }
  EXPECT_FALSE(q.HasRoom("a", limit));  // full, and a holds it all
  // b holds nothing: its share of 4 between two tenants is 2.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(q.HasRoom("b", limit));
    Push(&q, "b", i, 1);
  }
  EXPECT_FALSE(q.HasRoom("b", limit));
  // A third tenant's share is 4 / 3 = 1.
  EXPECT_TRUE(q.HasRoom("c", limit));
  Push(&q, "c", 0, 1);
  EXPECT_FALSE(q.HasRoom("c", limit));
  EXPECT_EQ(q.Depths(), (std::map<std::string, int64_t>{{"a", 4}, {"b", 2}, {"c", 1}}));
  PopAll(&q);
  EXPECT_TRUE(q.Depths().empty());
  EXPECT_TRUE(q.HasRoom("a", limit));
}

AttnParams Shape(int64_t tq, int64_t tk) {
  AttnParams p{};
  p.dtype = DType::kFP16;
  p.batch = 1;
  p.num_heads_q = 8;
  p.num_heads_kv = 8;
  p.head_dim = 128;
  p.seqlen_q = static_cast<int32_t>(tq);
  p.seqlen_k = static_cast<int32_t>(tk);
  p.total_q = tq;
  p.total_k = tk;
  return p;
}

TEST(RequestCostTest, DecodeIsChargedByBytesPrefillByFlops) {
  const int64_t width = 8 * 128;
  // Decode, 1 query over 4096 keys: bytes dominate (K and V read once).
  const int64_t decode_bytes = (2 * 1 * width + 2 * 4096 * width) * 2;
  EXPECT_EQ(RequestCost(Shape(1, 4096)), kCostPerRequest + decode_bytes);
  // Prefill, 4096 × 4096: FLOPs / kCostFlopsPerByte dominate.
  const int64_t prefill_flops = 4 * int64_t{4096} * 4096 * width;
  EXPECT_EQ(RequestCost(Shape(4096, 4096)), kCostPerRequest + prefill_flops / kCostFlopsPerByte);
  // Varlen counts pairs per sequence: two sequences of 2048 are half the
  // pairs of one of 4096.
  AttnParams varlen = Shape(4096, 4096);
  const int32_t cu[] = {0, 2048, 4096};
  varlen.batch = 2;
  varlen.cu_seqlens_q = cu;
  varlen.cu_seqlens_k = cu;
  EXPECT_EQ(RequestCost(varlen), kCostPerRequest + prefill_flops / 2 / kCostFlopsPerByte);
  // An empty request still costs its launch.
  EXPECT_EQ(RequestCost(AttnParams{}), kCostPerRequest);
}

}  // namespace
}  // namespace attnserve
