// Batch-invariant results on the GPU (AttnParams::batch_invariant,
// docs/design.md §3): a request's output bytes alone equal its bytes packed
// into one varlen launch with random others, as the server's executor packs
// calls planned alike (SamePlanned):
//  - decode, B = 1 alone against B = 64 packed with random context lengths
//    (without the option the planner splits the two launches differently and
//    the bytes differ: the test can fail);
//  - decode under the split rule's edges (attn_fwd_plan.h: splits of
//    max(ceil(tiles / S), T) tiles, the launch's count covering the
//    longest): sequences shorter than T tiles, at S x T tiles and one past
//    it, and long enough for S splits, alone against packed with a few mates
//    of very different lengths, so the packed launch holds more splits than
//    the target's own;
//  - decode with more tile groups than the fused combine's counters hold
//    (the combine kernel then runs, with the same bits as the fused one);
//  - prefill alone against packed varlen (the Hopper kernel on sm_90), every
//    dtype.
// Each alone result is also checked against the float64 reference. Without a
// GPU every test reports SKIPPED.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/backend.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/launch_splits.h"
#include "backend/ragged_batch.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

std::string Bytes(const HostBuffers& buf) {
  std::string s(static_cast<const char*>(buf.o()), static_cast<size_t>(buf.o_bytes()));
  if (buf.lse() != nullptr) {
    s.append(reinterpret_cast<const char*>(buf.lse()),
             static_cast<size_t>(buf.lse_elements()) * sizeof(float));
  }
  return s;
}

// Bytes that differ between a and b (all of them when the sizes differ).
int64_t Differing(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return static_cast<int64_t>(std::max(a.size(), b.size()));
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

struct Outcome {
  std::string alone, packed;
  Plan alone_plan, packed_plan;
  int alone_splits = 0, packed_splits = 0;  // what each launch ran (cuda::LaunchSplits)
  bool ok = false;
};

// True when this build has a kernel for the case (a KERNELS=dev build has
// the D 128 kernels only: the 256 cases skip).
bool Runs(AttentionBackend* backend, const HostBuffers& buf) {
  absl::StatusOr<Plan> plan = backend->CanImplement(buf.params());
  if (!plan.ok()) std::printf("skipped (%s)\n", std::string(plan.status().message()).c_str());
  return plan.ok();
}

// `target` alone, then packed at position `at` among `mates` (one launch).
Outcome AloneAndPacked(AttentionBackend* backend, HostBuffers* target,
                       const std::vector<std::unique_ptr<HostBuffers>>& mates, int at,
                       bool invariant) {
  Outcome out;
  AttnParams alone = target->params();
  alone.batch_invariant = invariant;
  absl::StatusOr<Plan> plan = backend->CanImplement(alone);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  out.alone_plan = *plan;
  out.alone_splits = cuda::LaunchSplits(alone, *plan);
  BackendTimings t;
  target->Poison();
  absl::Status s = backend->Forward(*plan, alone, &t);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return out;
  EXPECT_TRUE(CheckOutput(*target));
  out.alone = Bytes(*target);

  std::vector<AttnParams> mate_params;
  for (const auto& m : mates) {
    mate_params.push_back(m->params());
    mate_params.back().batch_invariant = invariant;
  }
  std::vector<const AttnParams*> members;
  for (int i = 0; i <= static_cast<int>(mates.size()); ++i) {
    if (i == at) members.push_back(&alone);
    if (i < static_cast<int>(mates.size())) members.push_back(&mate_params[i]);
  }
  HostPackedBatch packed(members);
  const AttnParams launch = packed.params();
  plan = backend->CanImplement(launch);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  out.packed_plan = *plan;
  out.packed_splits = cuda::LaunchSplits(launch, *plan);
  target->Poison();
  s = backend->Forward(*plan, launch, &t);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return out;
  packed.Scatter();
  out.packed = Bytes(*target);
  out.ok = true;
  return out;
}

AttentionBackend* Backend() {
  std::string why;
  AttentionBackend* b = testing_util::SharedCudaBackend(&why);
  if (b == nullptr) std::printf("no usable CUDA device: %s\n", why.c_str());
  return b;
}

TestCase Decode(DType t, int d, int hq, int hkv, int sk, uint32_t seed) {
  TestCase tc;
  tc.dtype = t;
  tc.head_dim = d;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.seqlen_q = 1;
  tc.seqlen_k = sk;
  tc.seed = seed;
  return tc;
}

// B = 1 alone against B = 64 packed with 63 random decode mates.
TEST(CudaBatchInvarianceTest, DecodeAloneEqualsPackedIntoB64) {
  AttentionBackend* backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device";
  std::mt19937 rng(5);
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int d : {64, 128}) {
      for (int sk : {3000, 20000}) {
        SCOPED_TRACE(absl::StrCat("dtype ", static_cast<int>(t), " d ", d, " sk ", sk));
        HostBuffers target(Decode(t, d, 32, 8, sk, 1 + sk + d));
        if (!Runs(backend, target)) continue;
        std::vector<std::unique_ptr<HostBuffers>> mates;
        for (int i = 0; i < 63; ++i) {
          const int mate_sk = std::uniform_int_distribution<int>(1, 8192)(rng);
          mates.push_back(std::make_unique<HostBuffers>(Decode(t, d, 32, 8, mate_sk, 100 + i)));
        }
        const int at = std::uniform_int_distribution<int>(0, 63)(rng);
        const Outcome on = AloneAndPacked(backend, &target, mates, at, /*invariant=*/true);
        ASSERT_TRUE(on.ok);
        EXPECT_TRUE(SamePlanned(on.alone_plan, on.packed_plan));
        EXPECT_EQ(Differing(on.alone, on.packed), 0) << "splits alone " << on.alone_plan.num_splits
                                                     << ", packed " << on.packed_plan.num_splits;
        if (t == DType::kFP32) continue;  // the FP32 kernel never splits: invariant either way
        // Without the option the two launches split differently: some bytes
        // change (what the option is for, and proof the comparison can fail).
        const Outcome off = AloneAndPacked(backend, &target, mates, at, /*invariant=*/false);
        ASSERT_TRUE(off.ok);
        if (off.alone_plan.num_splits != off.packed_plan.num_splits) {
          EXPECT_GT(Differing(off.alone, off.packed), 0)
              << "splits alone " << off.alone_plan.num_splits << ", packed "
              << off.packed_plan.num_splits;
        }
      }
    }
  }
}

// The invariant split rule at its edges. S = 16 (8 KV heads) or 4 (32
// unpacked heads), T = InvariantMinTiles(); 64-key tiles. Targets: under T
// tiles (one non-empty split of 2), a few T (splits of exactly T), S x T
// tiles (S splits of T), one tile past it (splits of T + 1: fewer than S
// alone, S packed) and over twice S x T (S splits of more than T). Mates: one
// under T tiles, one mid, one past S x T (so the packed launch runs S), in a
// random order around the target. Alone, the target's launch runs its own
// split count; packed, S. A split sized from the launch's split count, or
// trailing empty splits adding anything, changes bytes here.
TEST(CudaBatchInvarianceTest, DecodeSplitsFollowTheSequenceAlone) {
  AttentionBackend* backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device";
  std::mt19937 rng(21);
  const int t_keys = cuda::InvariantMinTiles() * 64;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 128}) {
      for (auto [hq, hkv] : {std::pair<int, int>{32, 8}, std::pair<int, int>{32, 32}}) {
        const int s = cuda::InvariantDecodeSplits(hkv);
        const int st_keys = s * t_keys;
        for (int sk : {t_keys / 2 + 7, 3 * t_keys - 5, st_keys, st_keys + 64, 2 * st_keys + 100}) {
          SCOPED_TRACE(absl::StrCat("dtype ", static_cast<int>(t), " d ", d, " hq ", hq, " hkv ",
                                    hkv, " sk ", sk));
          HostBuffers target(Decode(t, d, hq, hkv, sk, 7 + sk + d + hkv));
          if (!Runs(backend, target)) continue;
          std::vector<std::unique_ptr<HostBuffers>> mates;
          const int lengths[] = {
              std::uniform_int_distribution<int>(1, t_keys - 1)(rng),
              std::uniform_int_distribution<int>(t_keys, st_keys - 1)(rng),
              std::uniform_int_distribution<int>(st_keys + 1, 2 * st_keys)(rng),
          };
          for (int i = 0; i < 3; ++i) {
            mates.push_back(
                std::make_unique<HostBuffers>(Decode(t, d, hq, hkv, lengths[i], 900 + sk + i)));
          }
          std::shuffle(mates.begin(), mates.end(), rng);
          const int at = std::uniform_int_distribution<int>(0, 3)(rng);
          const Outcome on = AloneAndPacked(backend, &target, mates, at, /*invariant=*/true);
          ASSERT_TRUE(on.ok);
          EXPECT_TRUE(SamePlanned(on.alone_plan, on.packed_plan));
          EXPECT_EQ(on.alone_plan.num_splits, s);
          const int own = cuda::InvariantDecodeGrid((sk + 63) / 64, s, cuda::InvariantMinTiles());
          EXPECT_EQ(on.alone_splits, own);
          EXPECT_EQ(on.packed_splits, s);
          EXPECT_EQ(Differing(on.alone, on.packed), 0)
              << "splits alone " << on.alone_splits << ", packed " << on.packed_splits;
        }
      }
    }
  }
}

// More (KV head, sequence) groups than the fused combine's ticket counters
// (kMaxSplitGroups): the packed launch combines in the combine kernel, the
// single one in the decode kernel; same bits.
TEST(CudaBatchInvarianceTest, FusedAndKernelCombinesGiveTheSameBits) {
  AttentionBackend* backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device";
  std::mt19937 rng(9);
  for (int hkv : {32, 64}) {
    SCOPED_TRACE(absl::StrCat("hkv ", hkv));
    const int b = static_cast<int>(cuda::kMaxSplitGroups / hkv) + 3;
    HostBuffers target(Decode(DType::kBF16, 64, 2 * hkv, hkv, 700, 7));
    if (!Runs(backend, target)) continue;
    std::vector<std::unique_ptr<HostBuffers>> mates;
    for (int i = 0; i < b - 1; ++i) {
      const int sk = std::uniform_int_distribution<int>(1, 200)(rng);
      mates.push_back(
          std::make_unique<HostBuffers>(Decode(DType::kBF16, 64, 2 * hkv, hkv, sk, 300 + i)));
    }
    const Outcome on = AloneAndPacked(backend, &target, mates, b / 2, /*invariant=*/true);
    ASSERT_TRUE(on.ok);
    EXPECT_GT(on.alone_plan.num_splits, 1);
    EXPECT_TRUE(SamePlanned(on.alone_plan, on.packed_plan));
    EXPECT_EQ(Differing(on.alone, on.packed), 0);
  }
}

// Prefill alone against packed varlen with random mates planned alike.
TEST(CudaBatchInvarianceTest, PrefillAloneEqualsPackedVarlen) {
  AttentionBackend* backend = Backend();
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device";
  std::mt19937 rng(11);
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP8E4M3}) {
    for (int d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE(absl::StrCat("dtype ", static_cast<int>(t), " d ", d, " causal ", causal));
        TestCase tc;
        tc.dtype = t;
        tc.head_dim = d;
        tc.num_heads_q = tc.num_heads_kv = 8;
        tc.causal = causal;
        tc.seqlens_q = {777, 130};
        tc.seqlens_k = {777, 1000};
        if (t == DType::kFP8E4M3) tc.k_descale = 0.5f;
        tc.seed = 17 + d;
        HostBuffers target(tc);
        if (!Runs(backend, target)) continue;
        AttnParams alone = target.params();
        alone.batch_invariant = true;
        absl::StatusOr<Plan> alone_plan = backend->CanImplement(alone);
        ASSERT_TRUE(alone_plan.ok()) << alone_plan.status();
        // Mates the executor would pack with it (planned alike alone).
        std::vector<std::unique_ptr<HostBuffers>> mates;
        for (int tries = 0; tries < 40 && mates.size() < 5; ++tries) {
          TestCase m = tc;
          m.seed = 500 + tries;
          const int sq = std::uniform_int_distribution<int>(64, 1500)(rng);
          m.seqlens_q = {sq};
          m.seqlens_k = {sq + std::uniform_int_distribution<int>(0, 1500)(rng)};
          auto buf = std::make_unique<HostBuffers>(m);
          AttnParams mp = buf->params();
          mp.batch_invariant = true;
          absl::StatusOr<Plan> mate_plan = backend->CanImplement(mp);
          if (mate_plan.ok() && SamePlanned(*mate_plan, *alone_plan))
            mates.push_back(std::move(buf));
        }
        ASSERT_GE(mates.size(), 2u);
        const Outcome on = AloneAndPacked(backend, &target, mates, 1, /*invariant=*/true);
        ASSERT_TRUE(on.ok);
        EXPECT_TRUE(SamePlanned(on.alone_plan, on.packed_plan));
        EXPECT_EQ(Differing(on.alone, on.packed), 0);
      }
    }
  }
}

}  // namespace
}  // namespace attnserve
