// CudaBackend's score modifiers and masks (params.h: ALiBi, sinks, additive
// bias, element mask, CSR block mask) against the float64 reference with the
// tolerance policy, through the backend's staging path (the mod arrays are
// copied to the device with Q, K and V): each mod alone (every bias dtype
// and broadcast shape), all together with causal, windows and softcap,
// FP16/BF16 on the portable kernel's mods instantiation and FP32 on the SIMT
// kernel, GQA, dense and varlen (zero-length sequences), decode tiles with
// GQA packing (and unpacked under a per-head block mask), split-KV (the
// sink joins once, in the fused combine or the combine kernel), fully masked
// rows and block rows, block densities 0..1; and a check that block-masked
// key blocks are never read (NaN planted in them after the reference).
// Inputs are fresh random numbers per case, outputs NaN-poisoned before
// every run. Without a GPU each test calls GTEST_SKIP with the reason.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/params.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/common/score_mods_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::Bias;
using testing_util::Blocks;
using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::Mask;
using testing_util::ModsSpec;
using testing_util::TestCase;

TestCase Make(DType t, int b, int sq, int sk, int hq, int hkv, int d, ModsSpec mods) {
  TestCase tc;
  tc.dtype = t;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.mods = std::move(mods);
  return tc;
}

TestCase Varlen(DType t, std::vector<int> sq, std::vector<int> sk, int hq, int hkv, int d,
                ModsSpec mods) {
  TestCase tc = Make(t, 0, 0, 0, hq, hkv, d, std::move(mods));
  tc.seqlens_q = std::move(sq);
  tc.seqlens_k = std::move(sk);
  return tc;
}

ModsSpec Alibi() {
  ModsSpec m;
  m.alibi = true;
  return m;
}
ModsSpec Sinks() {
  ModsSpec m;
  m.sinks = true;
  return m;
}
// Every mod at once (a per-head BF16 bias, a mask, a per-head block mask).
ModsSpec All(float block_density = 0.6f) {
  ModsSpec m = Blocks(128, 128, block_density, true, true);
  m.alibi = true;
  m.sinks = true;
  m.bias = true;
  m.bias_dtype = DType::kBF16;
  m.mask_density = 0.7f;
  return m;
}

std::string CaseName(const ::testing::TestParamInfo<TestCase>& info) {
  return info.param.Name() + "_" + std::to_string(info.index);
}

class CudaModsTest : public ::testing::TestWithParam<TestCase> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing_util::SharedCudaBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  // Plans (UNIMPLEMENTED only for a head dim this build has no kernel for),
  // then runs twice on re-poisoned outputs and checks both.
  void RunAndCheck(HostBuffers* buf, int min_splits = 1) {
    const absl::StatusOr<Plan> plan = backend_->CanImplement(buf->params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    // The Hopper prefill kernel (sm90 and the mods it takes) never splits:
    // such a case checks that kernel instead (ATTNSERVE_CUDA_PORTABLE=1 runs
    // the split).
    if (min_splits > 1 && plan->kernel_family == KernelFamily::kPortable) {
      ASSERT_GE(plan->num_splits, min_splits) << GetParam().Name();
    }
    for (int run = 0; run < 2; ++run) {
      buf->Poison();
      BackendTimings t;
      const absl::Status st = backend_->Forward(*plan, buf->params(), &t);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(CheckOutput(*buf)) << GetParam().Name() << " run " << run;
    }
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaModsTest, MatchesReference) {
  HostBuffers buf(GetParam());
  RunAndCheck(&buf);
}

// Each mod alone on a GQA prefill, FP16 and BF16: every bias dtype and
// broadcast shape, -inf biases, masks with fully masked rows, block masks of
// several block sizes and densities.
std::vector<TestCase> SingleModGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    auto add = [&](ModsSpec m) { g.push_back(Make(t, 2, 300, 333, 4, 2, 128, std::move(m))); };
    add(Alibi());
    add(Sinks());
    add(Bias(DType::kFP32, true, true));
    add(Bias(DType::kBF16, false, true));
    add(Bias(DType::kFP16, true, false));
    add(Bias(DType::kFP32, false, false, 0.2f));
    add(Mask(0.5f, true, true));
    add(Mask(0.3f, false, false, 0.2f));
    add(Mask(0.9f, true, false));
    add(Blocks(128, 128, 0.5f, true, true));
    add(Blocks(256, 128, 0.3f, false, false));
    add(Blocks(128, 256, 0.7f, true, false, 0.3f));
  }
  return g;
}
INSTANTIATE_TEST_SUITE_P(Single, CudaModsTest, ::testing::ValuesIn(SingleModGrid()), CaseName);

// Every mod at once with the band and softcap, head dims 128 and 64 (the
// 64 is served zero-padded by the 128 kernel in dev builds), Sq != Sk both
// ways, and FP32 (the SIMT kernel).
std::vector<TestCase> CombinedGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    g.push_back(Make(t, 2, 257, 300, 4, 2, 128, All()));
    TestCase c = Make(t, 2, 300, 257, 4, 1, 128, All());
    c.causal = true;
    g.push_back(c);
    TestCase w = Make(t, 1, 400, 400, 2, 2, 64, All());
    w.window_left = 100;
    w.window_right = 20;
    g.push_back(w);
    TestCase s = Make(t, 1, 200, 450, 4, 2, 128, All());
    s.softcap = 30.f;
    s.causal = true;
    g.push_back(s);
  }
  // Shared arrays (no batch or head dimension) with everything else.
  ModsSpec shared = All(0.5f);
  shared.bias_per_batch = shared.bias_per_head = false;
  shared.mask_per_batch = shared.mask_per_head = false;
  shared.block_per_batch = shared.block_per_head = false;
  TestCase c = Make(DType::kBF16, 3, 260, 260, 4, 2, 128, shared);
  c.causal = true;
  g.push_back(c);
  return g;
}
INSTANTIATE_TEST_SUITE_P(Combined, CudaModsTest, ::testing::ValuesIn(CombinedGrid()), CaseName);

// Varlen (mods per sequence, zero-length sequences on both sides), decode
// (Sq = 1 and a 4-query speculative step; GQA packed into the decode tile,
// or unpacked under a per-head block mask), fully masked rows and block
// rows with and without sinks, block densities 0..1.
std::vector<TestCase> ShapeGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    g.push_back(Varlen(t, {0, 200, 129, 1}, {50, 300, 0, 257}, 4, 2, 128, All()));
    TestCase c = Varlen(t, {130, 1, 256}, {130, 700, 300}, 4, 4, 128, All(0.4f));
    c.causal = true;
    g.push_back(c);
  }
  for (DType t : {DType::kBF16, DType::kFP16}) {
    g.push_back(Make(t, 3, 1, 700, 32, 8, 128, All()));  // per-head blocks: unpacked
    ModsSpec packed = Blocks(128, 128, 0.5f, true, false);
    packed.sinks = packed.alibi = true;
    packed.bias = true;
    packed.mask_density = 0.8f;
    g.push_back(Make(t, 3, 1, 700, 32, 8, 128, packed));
    TestCase spec = Make(t, 2, 4, 900, 8, 2, 128, packed);
    spec.causal = true;
    g.push_back(spec);
    g.push_back(Varlen(t, {1, 1, 1}, {0, 513, 128}, 16, 4, 128, packed));
  }
  for (float d : {0.f, 0.1f, 1.f}) {
    g.push_back(Make(DType::kBF16, 1, 384, 512, 2, 2, 128, Blocks(128, 128, d, true, true)));
    ModsSpec s = Blocks(128, 128, d, true, true);
    s.sinks = true;
    g.push_back(Make(DType::kFP16, 1, 300, 512, 2, 1, 128, s));
  }
  for (float d : {0.f, 1.f})
    g.push_back(Make(DType::kBF16, 1, 200, 200, 2, 2, 128, Mask(d, true, true)));
  for (bool sinks : {false, true}) {
    ModsSpec m = Mask(0.6f, true, true, 0.3f);
    m.block_q = m.block_k = 128;
    m.block_density = 0.6f;
    m.block_empty_rows = 0.5f;
    m.sinks = sinks;
    for (DType t : {DType::kBF16, DType::kFP32}) {
      g.push_back(Make(t, 2, 300, 400, 4, 2, 128, m));
    }
  }
  return g;
}
INSTANTIATE_TEST_SUITE_P(Shapes, CudaModsTest, ::testing::ValuesIn(ShapeGrid()), CaseName);

// Many short varlen sequences: a bias, mask and block mask find each
// sequence's offsets in the launch's staged arrays (mods_prefix.cuh; with
// more sequences than the staging scan's 1024 threads, each thread sums
// several). Short queries run on the decode tile; one long query run takes
// the prefill kernels (Hopper where it has them). Named by index: the
// lengths would make a name of thousands of characters.
class CudaModsManySequencesTest : public CudaModsTest {};

TEST_P(CudaModsManySequencesTest, MatchesReference) {
  HostBuffers buf(GetParam());
  RunAndCheck(&buf);
}

std::vector<TestCase> ManySequencesGrid() {
  std::vector<TestCase> g;
  constexpr int kB = 2100;
  std::vector<int> sq(kB), sk(kB);
  for (int b = 0; b < kB; ++b) {
    sq[b] = b % 4;
    sk[b] = (b * 7) % 11;
  }
  std::vector<int> sq_long = sq, sk_long = sk;
  sq_long[1200] = 300;
  sk_long[1200] = 400;
  sq_long[kB - 1] = 130;
  sk_long[kB - 1] = 257;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    g.push_back(Varlen(t, sq, sk, 2, 1, 128, All()));
    g.push_back(Varlen(t, sq_long, sk_long, 2, 1, 128, All(0.5f)));
    ModsSpec blocks = Blocks(128, 128, 0.5f, true, true);
    blocks.alibi = true;
    g.push_back(Varlen(t, sq_long, sk_long, 2, 2, 128, blocks));
  }
  return g;
}
INSTANTIATE_TEST_SUITE_P(Many, CudaModsManySequencesTest, ::testing::ValuesIn(ManySequencesGrid()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return "many_sequences_" + std::to_string(info.index);
                         });

// Split-KV: each case must plan more than one split on the portable kernel
// (a prefill the Hopper kernel takes runs unsplit there). Decode tiles combine
// in the forward kernel, prefill tiles in the combine kernel; the sink joins
// the LSE there, once. Block masks split by kept tiles.
class CudaModsSplitTest : public CudaModsTest {};

TEST_P(CudaModsSplitTest, SplitsAndMatchesReference) {
  HostBuffers buf(GetParam());
  RunAndCheck(&buf, 2);
}

std::vector<TestCase> SplitGrid() {
  std::vector<TestCase> g;
  ModsSpec shared_blocks = Blocks(128, 128, 0.25f, false, false);
  shared_blocks.sinks = true;
  ModsSpec sinks_bias = Bias(DType::kBF16, true, true);
  sinks_bias.sinks = sinks_bias.alibi = true;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    g.push_back(Make(t, 1, 1, 8192, 32, 8, 128, shared_blocks));  // packed decode tile
    g.push_back(Make(t, 1, 1, 5000, 32, 8, 128, sinks_bias));
    g.push_back(Make(t, 1, 1, 6000, 8, 8, 128, All(0.3f)));
    g.push_back(Make(t, 1, 128, 4096, 8, 2, 128, shared_blocks));  // prefill tile + combine kernel
    TestCase c = Make(t, 1, 128, 3000, 8, 2, 128, All(0.5f));
    c.causal = true;
    g.push_back(c);
  }
  g.push_back(Make(DType::kBF16, 1, 1, 8192, 32, 8, 128, Blocks(128, 128, 0.f, false, false)));
  ModsSpec empty_sinks = Blocks(128, 128, 0.f, false, false);
  empty_sinks.sinks = true;
  g.push_back(Make(DType::kBF16, 1, 1, 8192, 32, 8, 128, empty_sinks));
  return g;
}
INSTANTIATE_TEST_SUITE_P(Split, CudaModsSplitTest, ::testing::ValuesIn(SplitGrid()), CaseName);

// Key blocks the block mask removes are never loaded: NaN planted in their
// K and V rows (after the reference has read the clean inputs) must not
// reach the output. The mask is shared by every head and sequence and the
// query run fits one block row, so a removed key block is removed for every
// CTA that could read it.
class CudaModsSkipTest : public CudaModsTest {};

TEST_P(CudaModsSkipTest, MaskedBlocksAreNotRead) {
  const TestCase& tc = GetParam();
  HostBuffers buf(tc);
  buf.Reference();
  buf.ReferenceLowPrecision();
  const testing_util::HostMods& mods = *buf.mods();
  const std::vector<int32_t>& row_ptr = mods.block_row_ptr();
  const std::vector<int32_t>& cols = mods.block_col_idx();
  ASSERT_EQ(row_ptr.size(), 2u) << "one shared CSR row";
  const int block_k = tc.mods.block_k;
  const int key_blocks = (tc.seqlen_k + block_k - 1) / block_k;
  const int64_t row_bytes = int64_t{tc.num_heads_kv} * tc.head_dim * DTypeSize(tc.dtype);
  int removed = 0;
  for (int kb = 0, e = 0; kb < key_blocks; ++kb) {
    if (e < row_ptr[1] && cols[e] == kb) {
      ++e;
      continue;
    }
    ++removed;
    for (int b = 0; b < tc.batch; ++b) {
      for (int j = kb * block_k; j < std::min(tc.seqlen_k, (kb + 1) * block_k); ++j) {
        const int64_t at = (int64_t{b} * tc.seqlen_k + j) * row_bytes;
        std::memset(static_cast<char*>(buf.k()) + at, 0xff, row_bytes);
        std::memset(static_cast<char*>(buf.v()) + at, 0xff, row_bytes);
      }
    }
  }
  ASSERT_GT(removed, 0) << "the case must remove some key block";
  RunAndCheck(&buf);
}

std::vector<TestCase> SkipGrid() {
  std::vector<TestCase> g;
  g.push_back(Make(DType::kBF16, 2, 128, 1024, 4, 4, 128, Blocks(128, 128, 0.4f, false, false)));
  g.push_back(Make(DType::kFP16, 1, 100, 2000, 4, 2, 128, Blocks(128, 256, 0.4f, false, false)));
  // Decode: GQA packed, split over the kept tiles.
  g.push_back(Make(DType::kBF16, 1, 1, 8192, 32, 8, 128, Blocks(128, 128, 0.3f, false, false)));
  g.push_back(Make(DType::kFP32, 1, 64, 1024, 2, 2, 64, Blocks(128, 128, 0.4f, false, false)));
  return g;
}
INSTANTIATE_TEST_SUITE_P(Skip, CudaModsSkipTest, ::testing::ValuesIn(SkipGrid()), CaseName);

}  // namespace
}  // namespace attnserve
