// The CPU backend with score modifiers and masks (ALiBi, sinks, bias, element
// mask, block mask) against the float64 reference under docs/design.md §4's
// tolerance policy: each mod alone, all of them with causal, windows and
// softcap, every dtype, GQA, dense and varlen, every bias dtype and broadcast
// shape, mask and block densities 0 to 1 with fully masked rows and empty CSR
// rows, sizes that are not multiples of the block sizes.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/cpu/cpu_attention_kernel.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/make_params.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::Bias;
using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::ModsSpec;
using testing_util::TestCase;

CpuBackend& Backend() {
  static CpuBackend* backend = new CpuBackend(2);
  return *backend;
}

absl::Status RunCpu(const AttnParams& p) {
  absl::StatusOr<Plan> plan = Backend().CanImplement(p);
  if (!plan.ok()) return plan.status();
  return Backend().Forward(*plan, p, nullptr);
}

// Dense, GQA 4:2, sizes off every block multiple (Sq = 300 spans three
// 128-row query blocks and five 64-row tasks).
TestCase DenseBase(DType t) {
  TestCase tc;
  tc.dtype = t;
  tc.batch = 2;
  tc.seqlen_q = 300;
  tc.seqlen_k = 333;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  tc.head_dim = 64;
  return tc;
}

// Varlen with an empty query sequence and a sequence without keys.
TestCase VarlenBase(DType t) {
  TestCase tc = DenseBase(t);
  tc.seqlens_q = {5, 0, 260, 130};
  tc.seqlens_k = {9, 3, 300, 0};
  return tc;
}

// This file's masks keep some rows empty unless told otherwise.
ModsSpec Mask(float density, bool per_batch = true, bool per_head = true) {
  return testing_util::Mask(density, per_batch, per_head, /*empty_rows=*/0.1f);
}

ModsSpec Blocks(float density, int bq = 128, int bk = 128, bool per_batch = true,
                bool per_head = true) {
  return testing_util::Blocks(bq, bk, density, per_batch, per_head, /*empty_rows=*/0.2f);
}

ModsSpec All() {
  ModsSpec m = Blocks(0.5f);
  m.alibi = true;
  m.sinks = true;
  m.bias = true;
  m.bias_dtype = DType::kBF16;
  m.bias_per_batch = false;
  m.bias_neg_inf = 0.05f;
  m.mask_density = 0.7f;
  m.mask_empty_rows = 0.05f;
  m.mask_per_head = false;
  return m;
}

std::vector<TestCase> Grid() {
  std::vector<TestCase> grid;
  auto add = [&grid](TestCase tc, const ModsSpec& m) -> TestCase& {
    tc.mods = m;
    grid.push_back(tc);
    return grid.back();
  };
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    for (bool varlen : {false, true}) {
      const TestCase base = varlen ? VarlenBase(t) : DenseBase(t);
      ModsSpec m;
      m.alibi = true;
      add(base, m);
      m = ModsSpec();
      m.sinks = true;
      add(base, m);
      m.sink_range = 30.0f;  // sinks far above and below the scores
      add(base, m).causal = true;
      add(base, Bias(DType::kFP32, true, true));
      add(base, Mask(0.5f));
      add(base, Blocks(0.5f));
      // Everything at once, with causal, a window and softcap.
      add(base, All()).causal = true;
      TestCase& w = add(base, All());
      w.window_left = 70;
      w.window_right = 90;
      w.softcap = 5.0f;
    }
  }
  // Bias dtypes and broadcast shapes (varlen: per_batch only).
  for (DType bt : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    for (bool per_batch : {false, true}) {
      for (bool per_head : {false, true}) {
        TestCase tc = DenseBase(DType::kFP16);
        tc.head_dim = 32;
        add(tc, Bias(bt, per_batch, per_head));
      }
    }
    add(VarlenBase(DType::kFP32), Bias(bt, true, false));
    ModsSpec m = Bias(bt, true, true);
    m.bias_neg_inf = 0.3f;  // -inf removes keys, some rows entirely
    m.bias_std = 4.0f;
    add(DenseBase(DType::kBF16), m).causal = true;
  }
  // Element masks: densities 0..1, broadcast shapes, fully masked rows.
  for (float density : {0.0f, 0.05f, 0.5f, 1.0f}) {
    add(DenseBase(DType::kFP32), Mask(density));
    add(VarlenBase(DType::kFP16), Mask(density));
  }
  add(DenseBase(DType::kFP32), Mask(0.3f, false, false));
  add(DenseBase(DType::kFP32), Mask(0.3f, true, false));
  add(DenseBase(DType::kFP32), Mask(0.3f, false, true)).causal = true;
  {
    ModsSpec m = Mask(0.5f);
    m.sinks = true;  // fully masked rows with a sink: O = 0, LSE = sink
    m.mask_empty_rows = 0.5f;
    add(DenseBase(DType::kFP32), m);
  }
  // Block masks: densities 0..1, block sizes, broadcast shapes, empty rows.
  for (float density : {0.0f, 0.05f, 0.5f, 1.0f}) {
    add(DenseBase(DType::kFP32), Blocks(density));
    add(VarlenBase(DType::kBF16), Blocks(density));
  }
  add(DenseBase(DType::kFP32), Blocks(0.5f, 256, 128, false, false));
  add(DenseBase(DType::kFP32), Blocks(0.5f, 128, 256, true, false)).causal = true;
  add(VarlenBase(DType::kFP32), Blocks(0.5f, 256, 384, true, false)).window_left = 100;
  {
    TestCase tc = DenseBase(DType::kFP16);
    tc.seqlen_q = 1;  // decode shape: one query, long context
    tc.seqlen_k = 1100;
    tc.num_heads_q = 8;
    ModsSpec m = Blocks(0.25f, 128, 128, true, true);
    m.sinks = true;
    add(tc, m).causal = true;
  }
  // FP8 with a block mask (and the other mods).
  {
    TestCase tc = DenseBase(DType::kFP8E4M3);
    tc.q_descale = 0.5f;
    tc.k_descale = 0.7f;
    tc.v_descale = 1.5f;
    add(tc, Blocks(0.3f));
    add(tc, All()).causal = true;
  }
  // Without LSE, head dim 128, MQA.
  {
    TestCase tc = DenseBase(DType::kBF16);
    tc.head_dim = 128;
    tc.num_heads_kv = 1;
    tc.return_lse = false;
    add(tc, All());
  }
  // Lists above overlap (the per-dtype list and the per-mod lists): keep one of each.
  std::vector<TestCase> unique;
  std::set<std::string> names;
  for (const TestCase& tc : grid) {
    if (names.insert(tc.Name()).second) unique.push_back(tc);
  }
  return unique;
}

class ScoreModsCpuTest : public ::testing::TestWithParam<TestCase> {};

TEST_P(ScoreModsCpuTest, MatchesReference) {
  HostBuffers buf(GetParam());
  const absl::Status status = RunCpu(buf.params());
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(CheckOutput(buf));
}

INSTANTIATE_TEST_SUITE_P(Grid, ScoreModsCpuTest, ::testing::ValuesIn(Grid()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name();
                         });

// Rows with no key: O exactly 0 and LSE exactly -inf, or the sink.
TEST(ScoreModsCpuEdgeTest, FullyMaskedRowsExact) {
  for (bool sinks : {false, true}) {
    TestCase tc = DenseBase(DType::kFP32);
    tc.mods = Mask(0.0f);  // every key of every row masked
    tc.mods.sinks = sinks;
    HostBuffers buf(tc);
    ASSERT_TRUE(RunCpu(buf.params()).ok());
    const float* o = static_cast<const float*>(buf.o());
    for (int64_t i = 0; i < buf.o_elements(); ++i) ASSERT_EQ(o[i], 0.0f) << i;
    const AttnParams& p = buf.params();
    for (int b = 0; b < p.batch; ++b) {
      for (int h = 0; h < p.num_heads_q; ++h) {
        const float lse = buf.lse()[LseOffset(p, b, h, 0)];
        if (sinks) {
          EXPECT_NEAR(lse, p.sinks[h], 1e-6f * std::fabs(p.sinks[h]) + 1e-6f);
        } else {
          EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
        }
      }
    }
  }
}

// Keys of blocks that no row keeps are never loaded: NaN planted in their K
// and V rows would otherwise reach O (NaN * 0 is NaN).
TEST(ScoreModsCpuEdgeTest, SkippedBlocksAreNotRead) {
  TestCase tc = DenseBase(DType::kFP32);
  tc.seqlen_q = 256;
  tc.seqlen_k = 1100;  // 9 key blocks
  tc.mods = Blocks(0.3f, 128, 128, false, false);
  tc.mods.block_empty_rows = 0.0f;
  HostBuffers buf(tc);
  const std::vector<int32_t>& cols = buf.mods()->block_col_idx();
  std::vector<bool> used(9, false);
  for (int32_t c : cols) used[c] = true;
  const AttnParams& p = buf.params();
  int planted = 0;
  float* k = static_cast<float*>(buf.k());
  float* v = static_cast<float*>(buf.v());
  for (int c = 0; c < 9; ++c) {
    if (used[c]) continue;
    ++planted;
    for (int b = 0; b < p.batch; ++b) {
      for (int j = c * 128; j < std::min(1100, (c + 1) * 128); ++j) {
        for (int hk = 0; hk < p.num_heads_kv; ++hk) {
          const int64_t off = KVOffset(p, SeqStartK(p, b) + j, hk);
          for (int x = 0; x < p.head_dim; ++x) {
            k[off + x] = std::numeric_limits<float>::quiet_NaN();
            v[off + x] = std::numeric_limits<float>::quiet_NaN();
          }
        }
      }
    }
  }
  ASSERT_GT(planted, 0) << "the seed left no key block unused; pick another density";
  ASSERT_TRUE(RunCpu(p).ok());
  EXPECT_TRUE(CheckOutput(buf));
}

// Sinks far above every score must not overflow the running max or sum.
TEST(ScoreModsCpuEdgeTest, HugeSinks) {
  TestCase tc = DenseBase(DType::kFP32);
  tc.mods.sinks = true;
  tc.mods.sink_range = 80.0f;
  HostBuffers buf(tc);
  ASSERT_TRUE(RunCpu(buf.params()).ok());
  EXPECT_TRUE(CheckOutput(buf));
}

// A varlen call's per-sequence offsets of a bias, element mask and block mask
// are summed once per call, not per task: 200k one-token sequences (one task
// each) walk the sequences B times in all, where a walk per task walked them
// B^2 / 2 times (2 x 10^10 steps here: minutes). Evidence by count
// (cpu::SeqPrefixSteps), not by time. Each one-key sequence's O is its V row
// when the mask, the bias and the block mask all keep the key, else 0.
TEST(ScoreModsCpuEdgeTest, VarlenOffsetsSummedOncePerCall) {
  constexpr int kB = 200000, kD = 8;
  std::vector<int32_t> cu(kB + 1);
  for (int b = 0; b <= kB; ++b) cu[b] = b;
  std::vector<float> q(int64_t{kB} * kD, 1.0f), k(q), v(q), o(q.size(), -1.0f);
  for (int b = 0; b < kB; ++b) {
    for (int x = 0; x < kD; ++x) v[int64_t{b} * kD + x] = static_cast<float>(b % 1000 + x);
  }
  // Sequence b: masked by the mask when b % 2, by the bias (-inf) when
  // b % 3 == 1, by the block mask (an empty CSR row) when b % 5 == 2.
  std::vector<uint8_t> mask(kB);
  std::vector<float> bias(kB);
  std::vector<int32_t> row_ptr(kB + 1), col_idx;
  for (int b = 0; b < kB; ++b) {
    mask[b] = b % 2 == 0 ? 1 : 0;
    bias[b] = b % 3 == 1 ? -std::numeric_limits<float>::infinity() : 0.25f;
    row_ptr[b] = static_cast<int32_t>(col_idx.size());
    if (b % 5 != 2) col_idx.push_back(0);
  }
  row_ptr[kB] = static_cast<int32_t>(col_idx.size());
  AttnShape shape = DenseShape(DType::kFP32, kB, 1, 1, 1, 1, kD);
  shape.cu_seqlens_q = cu.data();
  shape.cu_seqlens_k = cu.data();
  AttnPointers ptrs;
  ptrs.q = q.data();
  ptrs.k = k.data();
  ptrs.v = v.data();
  ptrs.o = o.data();
  ptrs.mods.bias = bias.data();
  ptrs.mods.bias_dtype = DType::kFP32;
  ptrs.mods.bias_per_batch = true;
  ptrs.mods.mask = mask.data();
  ptrs.mods.mask_per_batch = true;
  ptrs.mods.block_q = ptrs.mods.block_k = 128;
  ptrs.mods.block_row_ptr = row_ptr.data();
  ptrs.mods.block_col_idx = col_idx.data();
  ptrs.mods.block_per_batch = true;
  const AttnParams p = MakeAttnParams(shape, AttnOptions(), ptrs);
  const int64_t before = cpu::SeqPrefixSteps();
  ASSERT_TRUE(RunCpu(p).ok());
  EXPECT_EQ(cpu::SeqPrefixSteps() - before, kB);
  for (int b = 0; b < kB; ++b) {
    const bool kept = b % 2 == 0 && b % 3 != 1 && b % 5 != 2;
    for (int x = 0; x < kD; ++x) {
      ASSERT_EQ(o[int64_t{b} * kD + x], kept ? static_cast<float>(b % 1000 + x) : 0.0f)
          << "sequence " << b << " column " << x;
    }
  }
}

// Paged calls with a block mask are refused before anything runs; ALiBi,
// sinks, a bias and an element mask run there (paged_test).
TEST(ScoreModsCpuEdgeTest, PagedRefused) {
  PagedAttnParams p{};
  p.attn.block_q = 128;
  EXPECT_EQ(Backend().CanImplementPaged(p).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace attnserve
