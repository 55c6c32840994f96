// The Hopper prefill kernel's additive bias and element mask, through the
// CUDA backend (its plan must pick the Hopper kernel, so the planner's
// routing is checked too) against the float64 reference with the tolerance
// policy: both 16-bit bias dtypes (an FP32 bias runs on the portable kernel,
// cuda_score_mods_test) and every broadcast shape ([B or 1,
// Hq or 1]), -inf entries, element masks with fully masked rows with and
// without sinks, bias and mask together (a 16-bit bias folds the mask in),
// with ALiBi, softcap and block masks, causal or not, dense and varlen, D 64
// and 128, odd key counts (rows that miss the prefetch's word alignment)
// and key counts of multiples of 8 (a bias alone read in whole rows).
// Inputs are fresh random numbers per case, outputs NaN-poisoned before
// every run. Cases whose head dim this build or device has no Hopper kernel
// for skip, saying why; without a GPU every test skips.
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

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::ModsSpec;
using testing_util::TestCase;

TestCase Dense(DType t, int b, int sq, int sk, int hq, int hkv, int d, bool causal, ModsSpec mods) {
  TestCase tc;
  tc.dtype = t;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.causal = causal;
  tc.mods = std::move(mods);
  return tc;
}

TestCase Varlen(DType t, std::vector<int> sq, std::vector<int> sk, int hq, int hkv, int d,
                bool causal, ModsSpec mods) {
  TestCase tc = Dense(t, 0, 0, 0, hq, hkv, d, causal, std::move(mods));
  tc.seqlens_q = std::move(sq);
  tc.seqlens_k = std::move(sk);
  return tc;
}

ModsSpec Bias(DType t, bool per_batch, bool per_head, float neg_inf = 0.05f) {
  ModsSpec m;
  m.bias = true;
  m.bias_dtype = t;
  m.bias_per_batch = per_batch;
  m.bias_per_head = per_head;
  m.bias_neg_inf = neg_inf;
  return m;
}
ModsSpec Mask(float density, bool per_batch, bool per_head, float empty_rows = 0.f) {
  ModsSpec m;
  m.mask_density = density;
  m.mask_per_batch = per_batch;
  m.mask_per_head = per_head;
  m.mask_empty_rows = empty_rows;
  return m;
}

std::vector<TestCase> Cases() {
  std::vector<TestCase> v;
  const DType kBiasTypes[] = {DType::kFP16, DType::kBF16};
  for (const int d : {64, 128}) {
    for (const bool causal : {false, true}) {
      // Every bias dtype x broadcast shape, dense (even and odd Sk) and varlen.
      for (const DType bt : kBiasTypes) {
        for (int shape = 0; shape < 4; ++shape) {
          const bool pb = shape & 1, ph = shape & 2;
          v.push_back(Dense(DType::kBF16, 2, 300, 300, 4, 2, d, causal, Bias(bt, pb, ph)));
          v.push_back(Dense(DType::kFP16, 2, 200, 257, 4, 4, d, causal, Bias(bt, pb, ph)));
          // Sk a multiple of 8: whole bias rows by 16-byte copies (a partial
          // last key tile, rows past Sq in the last query tile).
          v.push_back(Dense(DType::kBF16, 2, 300, 328, 4, 2, d, causal, Bias(bt, pb, ph)));
        }
        v.push_back(Varlen(DType::kBF16, {130, 0, 257, 64}, {129, 17, 300, 255}, 4, 2, d, causal,
                           Bias(bt, true, true)));
        v.push_back(
            Varlen(DType::kFP16, {75, 300}, {301, 300}, 4, 4, d, causal, Bias(bt, true, false)));
      }
      // Element masks: densities, broadcast shapes, fully masked rows with
      // and without sinks.
      for (int shape = 0; shape < 4; ++shape) {
        v.push_back(Dense(DType::kBF16, 2, 300, 300, 4, 2, d, causal,
                          Mask(0.5f, shape & 1, shape & 2, 0.1f)));
      }
      ModsSpec ms = Mask(0.3f, true, true, 0.2f);
      ms.sinks = true;
      v.push_back(Dense(DType::kFP16, 2, 200, 257, 4, 4, d, causal, ms));
      v.push_back(Varlen(DType::kBF16, {130, 0, 257}, {129, 17, 301}, 4, 2, d, causal,
                         Mask(0.6f, true, true, 0.1f)));
      v.push_back(Varlen(DType::kBF16, {130, 257}, {131, 300}, 4, 2, d, causal, ms));
      // A bias with fully masked rows (mask) and sinks; bias and mask together
      // for each bias dtype (16-bit: the mask folded into the prefetched bias).
      for (const DType bt : kBiasTypes) {
        ModsSpec both = Bias(bt, false, true);
        both.mask_density = 0.7f;
        both.mask_empty_rows = 0.1f;
        v.push_back(Dense(DType::kBF16, 2, 300, 300, 4, 2, d, causal, both));
        both.sinks = true;
        both.mask_per_head = false;
        v.push_back(Varlen(DType::kBF16, {130, 64}, {257, 200}, 4, 2, d, causal, both));
      }
      // With ALiBi, softcap and a block mask.
      ModsSpec all = Bias(DType::kBF16, true, true);
      all.alibi = true;
      all.mask_density = 0.8f;
      all.block_q = all.block_k = 128;
      all.block_density = 0.6f;
      TestCase tc = Dense(DType::kBF16, 2, 400, 512, 4, 2, d, causal, all);
      tc.softcap = 30.f;
      v.push_back(tc);
      // The same without the element mask: whole bias rows beside ALiBi,
      // softcap and the block mask.
      all.mask_density = -1.f;
      tc = Dense(DType::kBF16, 2, 400, 520, 4, 2, d, causal, all);
      tc.softcap = 30.f;
      v.push_back(tc);
    }
  }
  // A bias of -inf everywhere in a row's band: the row sees no key.
  ModsSpec inf = Bias(DType::kBF16, true, true, 1.f);
  v.push_back(Dense(DType::kBF16, 1, 200, 200, 2, 2, 128, false, inf));
  inf.sinks = true;
  v.push_back(Dense(DType::kBF16, 1, 200, 200, 2, 2, 128, true, inf));
  return v;
}

std::string CaseName(const ::testing::TestParamInfo<TestCase>& info) {
  return info.param.Name() + "_" + std::to_string(info.index);
}

class Sm90BiasTest : public ::testing::TestWithParam<TestCase> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing_util::SharedCudaBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(Sm90BiasTest, MatchesReference) {
  HostBuffers buf(GetParam());
  const absl::StatusOr<Plan> plan = backend_->CanImplement(buf.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (plan->kernel_family != KernelFamily::kSm90) {
    GTEST_SKIP() << "the plan is not the Hopper kernel here (no sm90 device, or D "
                 << GetParam().head_dim << " not in this build's kernel set)";
  }
  for (int run = 0; run < 2; ++run) {
    buf.Poison();
    BackendTimings t;
    const absl::Status st = backend_->Forward(*plan, buf.params(), &t);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(CheckOutput(buf)) << GetParam().Name() << " run " << run;
  }
}

INSTANTIATE_TEST_SUITE_P(Sm90, Sm90BiasTest, ::testing::ValuesIn(Cases()), CaseName);

}  // namespace
}  // namespace attnserve
