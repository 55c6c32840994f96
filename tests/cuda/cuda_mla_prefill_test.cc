// MLA-shape prefill on the CUDA backend (V's and O's head dim Dv differing
// from Q's and K's D, params.h head_dim_v): the 192/128 pair (DeepSeek-V3's
// prefill shape) against the float64 reference with the tolerance policy,
// through the backend's staging path, on the kernel the plan picks (the
// Hopper kernel on sm90 where it covers the call; ATTNSERVE_CUDA_PORTABLE=1
// runs every case on the portable kernel). Dense and varlen
// (zero-length sequences on both sides), causal or not, windows, softcap,
// GQA 4:1 and MQA (packed into M for short query runs), Sq != Sk both ways,
// Sk = 0, split-KV (the combine reads partial rows of Dv), every score
// modifier (ALiBi, sinks, bias, element and block masks), and dims the pair
// serves zero-padded (176/112, 128/64, 64/128), and two calls packed into
// one launch. LSE is checked too; outputs
// are NaN-poisoned before each of two runs. Without a GPU each test calls
// GTEST_SKIP with the reason.
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/params.h"
#include "backend/ragged_batch.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/common/score_mods_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::Blocks;
using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::ModsSpec;
using testing_util::TestCase;

TestCase Mla(DType t, int b, int sq, int sk, int hq, int hkv, int d = 192, int dv = 128) {
  TestCase tc;
  tc.dtype = t;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.head_dim_v = dv;
  return tc;
}

TestCase Varlen(DType t, std::vector<int> sq, std::vector<int> sk, int hq, int hkv) {
  TestCase tc = Mla(t, 0, 0, 0, hq, hkv);
  tc.seqlens_q = std::move(sq);
  tc.seqlens_k = std::move(sk);
  return tc;
}

// Every mod at once: ALiBi, sinks, a per-head BF16 bias, an element mask and
// a per-head block mask.
ModsSpec All() {
  ModsSpec m = Blocks(128, 128, 0.6f, true, true);
  m.alibi = true;
  m.sinks = true;
  m.bias = true;
  m.bias_dtype = DType::kBF16;
  m.mask_density = 0.7f;
  return m;
}

std::vector<TestCase> Grid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (bool causal : {false, true}) {
      auto add = [&](TestCase tc) {
        tc.causal = causal;
        g.push_back(std::move(tc));
      };
      add(Mla(t, 2, 97, 150, 4, 2));             // GQA 2:1, Sq < Sk
      add(Mla(t, 1, 1025, 1025, 2, 1));          // many key tiles, MQA
      add(Mla(t, 2, 300, 129, 8, 8));            // Sq > Sk (causal: fully masked rows)
      add(Mla(t, 1, 17, 700, 16, 4));            // a short run over a long context
      add(Mla(t, 3, 1, 300, 16, 1));             // decode-sized: MQA packed into M
      add(Mla(t, 1, 200, 257, 4, 4, 176, 112));  // both dims zero-padded
      add(Mla(t, 1, 130, 130, 4, 2, 128, 64));   // served by the 192/128 pair
      add(Mla(t, 1, 130, 190, 2, 1, 64, 128));   // Dv > D
      add(Varlen(t, {0, 200, 129, 1}, {50, 300, 0, 257}, 4, 2));
      add(Varlen(t, {130, 1, 256}, {130, 700, 300}, 8, 2));
    }
    TestCase w = Mla(t, 1, 400, 400, 2, 2);
    w.window_left = 100;
    w.window_right = 20;
    g.push_back(w);
    TestCase sc = Mla(t, 2, 200, 300, 4, 2);
    sc.softcap = 30.f;
    sc.causal = true;
    sc.softmax_scale = 0.0721688f;  // 1/sqrt(192), DeepSeek-V3's scale
    g.push_back(sc);
    g.push_back(Mla(t, 2, 5, 0, 4, 2));  // Sk = 0: O = 0, LSE = -inf
  }
  return g;
}

// Score modifiers on the MLA kernel (the banded instantiation's mods kernel).
std::vector<TestCase> ModsGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    TestCase a = Mla(t, 2, 257, 300, 4, 2);
    a.mods = All();
    g.push_back(a);
    TestCase c = Mla(t, 2, 300, 257, 4, 1);
    c.mods = All();
    c.causal = true;
    c.softcap = 20.f;
    g.push_back(c);
    TestCase v = Varlen(t, {0, 200, 129, 1}, {50, 300, 0, 257}, 4, 2);
    v.mods = All();
    g.push_back(v);
    ModsSpec alibi;
    alibi.alibi = true;
    g.push_back(Mla(t, 1, 256, 256, 4, 4));
    g.back().mods = alibi;
    ModsSpec sinks;
    sinks.sinks = true;
    TestCase s = Mla(t, 2, 200, 250, 4, 2);
    s.mods = sinks;
    s.causal = true;
    g.push_back(s);
  }
  return g;
}

// Runs too short to fill the GPU: the planner splits the key range, and the
// combine (or a split's empty epilogue) writes Dv-wide rows.
std::vector<TestCase> SplitGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    g.push_back(Mla(t, 1, 64, 4096, 2, 1));
    TestCase c = Mla(t, 1, 100, 3000, 2, 2);
    c.causal = true;  // the first rows' splits past the diagonal are empty
    g.push_back(c);
    TestCase s = Mla(t, 1, 16, 2048, 2, 2);
    s.mods.sinks = true;  // the sink joins once, in the combine
    g.push_back(s);
  }
  return g;
}

std::string CaseName(const ::testing::TestParamInfo<TestCase>& info) {
  return info.param.Name() + "_" + std::to_string(info.index);
}

class CudaMlaPrefillTest : public ::testing::TestWithParam<TestCase> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing_util::SharedCudaBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  // Plans (the 192/128 pair, either family), then runs twice on re-poisoned
  // outputs and checks both against the reference. min_splits: the portable
  // plan's (the Hopper kernel never splits).
  void RunAndCheck(const TestCase& tc, int min_splits = 1) {
    HostBuffers buf(tc);
    ASSERT_EQ(HeadDimV(buf.params()), tc.head_dim_v);
    const absl::StatusOr<Plan> plan = backend_->CanImplement(buf.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel_head_dim, 192);
    if (plan->kernel_family == KernelFamily::kPortable) {
      EXPECT_GE(plan->num_splits, min_splits) << tc.Name();
    }
    for (int run = 0; run < 2; ++run) {
      buf.Poison();
      BackendTimings t;
      const absl::Status st = backend_->Forward(*plan, buf.params(), &t);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(CheckOutput(buf)) << tc.Name() << " run " << run;
    }
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaMlaPrefillTest, MatchesReference) { RunAndCheck(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Shapes, CudaMlaPrefillTest, ::testing::ValuesIn(Grid()), CaseName);
INSTANTIATE_TEST_SUITE_P(Mods, CudaMlaPrefillTest, ::testing::ValuesIn(ModsGrid()), CaseName);

// Two MLA calls packed into one launch (dense and varlen with a zero-length
// query run, as the executor packs them): one plan over the packed rows, and
// each member gets the reference's answer back in its own layout.
TEST(CudaMlaPackedTest, PackedLaunch) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    TestCase dense = Mla(t, 2, 120, 133, 4, 2);
    dense.causal = true;
    TestCase varlen = Varlen(t, {1, 0, 170}, {40, 5, 170}, 4, 2);
    varlen.causal = true;
    HostBuffers a(dense), b(varlen);
    ASSERT_TRUE(CanShareLaunch(a.params(), b.params()));
    HostPackedBatch packed({&a.params(), &b.params()});
    const absl::StatusOr<Plan> plan = backend->CanImplement(packed.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    a.Poison();
    b.Poison();
    BackendTimings timings;
    const absl::Status st = backend->Forward(*plan, packed.params(), &timings);
    ASSERT_TRUE(st.ok()) << st;
    packed.Scatter();
    EXPECT_TRUE(CheckOutput(a)) << dense.Name();
    EXPECT_TRUE(CheckOutput(b)) << varlen.Name();
  }
}

class CudaMlaSplitTest : public CudaMlaPrefillTest {};
TEST_P(CudaMlaSplitTest, SplitsMatchReference) { RunAndCheck(GetParam(), 2); }
INSTANTIATE_TEST_SUITE_P(Split, CudaMlaSplitTest, ::testing::ValuesIn(SplitGrid()), CaseName);

}  // namespace
}  // namespace attnserve
