// The batch-invariant decode split rule (attn_fwd_plan.h): a sequence of n
// key tiles takes splits of max(ceil(n / S), T) tiles, S =
// InvariantDecodeSplits(heads), T = InvariantMinTiles(); the launch's split
// count (InvariantDecodeGrid, LaunchSplits) covers every sequence up to the
// longest. Checked here: the numbers for given lengths, that every split of
// every shorter sequence lies inside the grid (a grid too small would drop
// keys), and PlanForward's and the launch's split counts and the workspace
// on the decode grid.
// Plain C++: runs in every build, GPU or not. Assumes
// ATTNSERVE_CUDA_INVARIANT_MIN_TILES is unset (it skips otherwise).
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/launch_splits.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using cuda::InvariantDecodeGrid;
using cuda::InvariantDecodeSplits;
using cuda::InvariantTilesPerSplit;

constexpr int kH100Sms = 132;

bool DefaultT() { return std::getenv("ATTNSERVE_CUDA_INVARIANT_MIN_TILES") == nullptr; }

AttnParams Decode(int b, int sk, int hq, int hkv) {
  AttnParams p = MakeAttnParams(DenseShape(DType::kBF16, b, 1, sk, hq, hkv, 128), AttnOptions(),
                                AttnPointers());
  p.batch_invariant = true;
  return p;
}

TEST(PlanInvariantSplitTest, SplitsPerHeadCount) {
  EXPECT_EQ(InvariantDecodeSplits(1), 128);
  EXPECT_EQ(InvariantDecodeSplits(8), 16);
  EXPECT_EQ(InvariantDecodeSplits(32), 4);
  EXPECT_EQ(InvariantDecodeSplits(48), 2);
  EXPECT_EQ(InvariantDecodeSplits(128), 1);
  EXPECT_EQ(InvariantDecodeSplits(1000), 1);
}

TEST(PlanInvariantSplitTest, TilesPerSplitAndGridForGivenLengths) {
  // S = 16 (8 KV heads), T = 8: splits of 8 tiles up to 16 x 8 = 128 tiles,
  // then 16 splits of ceil(n / 16).
  struct Row {
    int tiles, per, own_grid;
  };
  const Row rows[] = {{1, 8, 2},     {7, 8, 2},      {8, 8, 2},      {9, 8, 2},      {17, 8, 3},
                      {64, 8, 8},    {127, 8, 16},   {128, 8, 16},   {129, 9, 16},   {130, 9, 16},
                      {200, 13, 16}, {1024, 64, 16}, {1025, 65, 16}, {4096, 256, 16}};
  for (const Row& r : rows) {
    EXPECT_EQ(InvariantTilesPerSplit(r.tiles, 16, 8), r.per) << r.tiles;
    EXPECT_EQ(InvariantDecodeGrid(r.tiles, 16, 8), r.own_grid) << r.tiles;
  }
  // 129 tiles alone need only 15 splits of 9, but a launch with it as the
  // longest holds 16: a 128-tile batch-mate needs 16 of 8.
  EXPECT_EQ((129 + 8) / 9, 15);
  // No keys, or S = 1: one unsplit launch.
  EXPECT_EQ(InvariantDecodeGrid(0, 16, 8), 1);
  EXPECT_EQ(InvariantDecodeGrid(5000, 1, 8), 1);
  // T = 1 is the rule before T: ceil(n / S) per split, S splits past S tiles.
  EXPECT_EQ(InvariantTilesPerSplit(64, 16, 1), 4);
  EXPECT_EQ(InvariantDecodeGrid(64, 16, 1), 16);
  EXPECT_EQ(InvariantDecodeGrid(5, 16, 1), 5);
}

// For every S and T the backend can take and every longest length N up to
// a bound: each sequence of n <= N tiles has all its tiles in splits
// [0, grid(N)), its split boundaries are those it has alone, and the grid
// never shrinks as N grows (members planned alike stay so packed).
TEST(PlanInvariantSplitTest, GridCoversEveryShorterSequence) {
  for (int s : {1, 2, 4, 16, 32, 128}) {
    for (int t : {1, 2, 8, 16, 64}) {
      int prev_grid = 1;
      int need_max = 1;  // the most splits any n <= N needs
      for (int n = 1; n <= 3000; ++n) {
        const int per = InvariantTilesPerSplit(n, s, t);
        ASSERT_GE(per, t);
        const int need = (n + per - 1) / per;
        ASSERT_LE(need, s) << "s " << s << " t " << t << " n " << n;
        need_max = need > need_max ? need : need_max;
        const int grid = InvariantDecodeGrid(n, s, t);
        ASSERT_GE(grid, need_max) << "s " << s << " t " << t << " n " << n;
        ASSERT_LE(grid, s > 1 ? s : 1) << "s " << s << " t " << t << " n " << n;
        ASSERT_GE(grid, prev_grid) << "s " << s << " t " << t << " n " << n;
        if (s > 1) ASSERT_GE(grid, 2);
        prev_grid = grid;
      }
    }
  }
}

// The plan holds S splits whatever the lengths (its workspace; calls of any
// length plan alike, so the executor packs them); the launch runs as many as
// the longest sequence needs (LaunchSplits).
TEST(PlanInvariantSplitTest, PlanForwardAndLaunchSplitsOnTheDecodeGrid) {
  if (!DefaultT()) GTEST_SKIP() << "ATTNSERVE_CUDA_INVARIANT_MIN_TILES is set";
  ASSERT_EQ(cuda::InvariantMinTiles(), cuda::kInvariantMinTiles);
  struct Row {
    int b, sk, hq, hkv, planned, launched;
  };
  // Hq 32 / Hkv 8: S = 16; 64-key tiles. Hq = Hkv = 32 (no GQA packing):
  // S = 4.
  const Row rows[] = {{1, 8192, 32, 8, 16, 16}, {16, 8192, 32, 8, 16, 16},
                      {64, 4096, 32, 8, 16, 8}, {8, 65536, 32, 8, 16, 16},
                      {64, 512, 32, 8, 16, 2},  {64, 100, 32, 8, 16, 2},
                      {2, 8193, 32, 8, 16, 16}, {3, 0, 32, 8, 1, 1},
                      {64, 4096, 32, 32, 4, 4}, {64, 1000, 32, 32, 4, 2}};
  for (bool sm90 : {false, true}) {
    for (const Row& r : rows) {
      for (int sms : {20, 108, kH100Sms}) {
        const AttnParams p = Decode(r.b, r.sk, r.hq, r.hkv);
        const Plan plan = cuda::PlanForward(p, sms, sm90);
        if (plan.kernel_head_dim == 0) GTEST_SKIP() << "no D = 128 kernel in this build";
        ASSERT_EQ(plan.tile_kind, TileKind::kDecode);
        EXPECT_EQ(plan.num_splits, r.planned)
            << "b " << r.b << " sk " << r.sk << " hkv " << r.hkv << " sms " << sms;
        EXPECT_EQ(cuda::LaunchSplits(p, plan), r.launched)
            << "b " << r.b << " sk " << r.sk << " hkv " << r.hkv << " sms " << sms;
        EXPECT_EQ(plan.workspace_bytes,
                  r.planned > 1 ? cuda::SplitWorkspaceBytes(p, r.planned) : int64_t{0});
      }
    }
  }
  // Not invariant: the launch runs the plan's own count.
  AttnParams p = Decode(64, 4096, 32, 8);
  p.batch_invariant = false;
  const Plan plan = cuda::PlanForward(p, kH100Sms, true);
  EXPECT_EQ(cuda::LaunchSplits(p, plan), plan.num_splits);
}

}  // namespace
}  // namespace attnserve
