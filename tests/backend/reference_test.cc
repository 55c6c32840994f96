// The float64 reference itself: a hand-computed case, an independent naive
// softmax written from the contract's formulas (not through VisibleKeys), and
// the low-precision twin's relation to it.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/reference/reference_attention.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

constexpr double kInf = std::numeric_limits<double>::infinity();

AttnParams TinyParams(const float* q, const float* k, const float* v, int sq, int sk, int d) {
  AttnParams p{};
  p.dtype = DType::kFP32;
  p.q = q;
  p.k = k;
  p.v = v;
  p.batch = 1;
  p.num_heads_q = p.num_heads_kv = 1;
  p.head_dim = d;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.total_q = sq;
  p.total_k = sk;
  p.softmax_scale = 1.0f;
  p.softmax_scale_log2 = 1.4426950408889634f;
  p.window_left = p.window_right = kNoWindow;
  return p;
}

// One query, two keys, D = 8 (only the first lane non-zero), scale 1:
// scores 0 and ln 3, so weights 1/4 and 3/4 and LSE = ln 4.
TEST(ReferenceTest, HandComputed) {
  std::vector<float> q(8, 0.0f), k(16, 0.0f), v(16, 0.0f);
  q[0] = 1.0f;
  k[8] = static_cast<float>(std::log(3.0));
  for (int c = 0; c < 8; ++c) {
    v[c] = 4.0f;
    v[8 + c] = static_cast<float>(c);
  }
  const AttnParams p = TinyParams(q.data(), k.data(), v.data(), 1, 2, 8);
  const ReferenceOutput out = ReferenceAttention(p);
  for (int c = 0; c < 8; ++c) EXPECT_NEAR(out.o[c], 0.25 * 4.0 + 0.75 * c, 1e-7) << c;
  EXPECT_NEAR(out.lse[0], std::log(4.0), 1e-7);
}

// Causal with Sq = 2 > Sk = 1, bottom-right aligned: query 0 sees no key
// (O = 0, LSE = -inf), query 1 sees key 0 (O = v0, LSE = score).
TEST(ReferenceTest, BottomRightCausalAndEmptyRows) {
  std::vector<float> q(16, 0.5f), k(8, 1.0f), v(8);
  for (int c = 0; c < 8; ++c) v[c] = 1.0f + c;
  AttnParams p = TinyParams(q.data(), k.data(), v.data(), 2, 1, 8);
  p.is_causal = true;
  p.window_right = 0;
  const ReferenceOutput out = ReferenceAttention(p);
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(out.o[c], 0.0);
    EXPECT_NEAR(out.o[8 + c], 1.0 + c, 1e-12);
  }
  EXPECT_EQ(out.lse[0], -kInf);
  EXPECT_NEAR(out.lse[1], 4.0, 1e-12);  // q·k = 8 * 0.5
}

// Naive attention straight from DESIGN.md §2's formulas, one (b, h) at a time.
ReferenceOutput Naive(const AttnParams& p, bool causal, int wl, int wr) {
  ReferenceOutput out;
  const int d = p.head_dim;
  out.o.assign(p.total_q * p.num_heads_q * d, 0.0);
  out.lse.assign(p.total_q * p.num_heads_q, -kInf);
  const int group = p.num_heads_q / p.num_heads_kv;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t q0 = IsVarlen(p) ? p.cu_seqlens_q[b] : int64_t{b} * p.seqlen_q;
    const int64_t k0 = IsVarlen(p) ? p.cu_seqlens_k[b] : int64_t{b} * p.seqlen_k;
    const int sq = IsVarlen(p) ? p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] : p.seqlen_q;
    const int sk = IsVarlen(p) ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : p.seqlen_k;
    for (int h = 0; h < p.num_heads_q; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        std::vector<double> w(sk, 0.0);
        std::vector<bool> seen(sk, false);
        double mx = -kInf;
        for (int j = 0; j < sk; ++j) {
          const int shift = sk - sq;
          bool visible = true;
          if (causal && j > i + shift) visible = false;
          if (wl >= 0 && j < i + shift - wl) visible = false;
          if (wr >= 0 && j > i + shift + wr) visible = false;
          if (!visible) continue;
          double s = 0.0;
          for (int c = 0; c < d; ++c) {
            s += double{LoadAsFloat(p.q, p.dtype, ((q0 + i) * p.num_heads_q + h) * d + c)} *
                 LoadAsFloat(p.k, p.dtype, ((k0 + j) * p.num_heads_kv + hk) * d + c);
          }
          s *= p.softmax_scale;
          if (p.softcap > 0) s = p.softcap * std::tanh(s / p.softcap);
          w[j] = s;
          seen[j] = true;
          mx = std::max(mx, s);
        }
        double sum = 0.0;
        for (int j = 0; j < sk; ++j) sum += seen[j] ? std::exp(w[j] - mx) : 0.0;
        if (sum == 0.0) continue;
        const int64_t lse_at = IsVarlen(p) ? int64_t{h} * p.total_q + q0 + i
                                           : (int64_t{b} * p.num_heads_q + h) * sq + i;
        out.lse[lse_at] = mx + std::log(sum);
        for (int j = 0; j < sk; ++j) {
          if (!seen[j]) continue;
          const double pj = std::exp(w[j] - mx) / sum;
          for (int c = 0; c < d; ++c) {
            out.o[((q0 + i) * p.num_heads_q + h) * d + c] +=
                pj * LoadAsFloat(p.v, p.dtype, ((k0 + j) * p.num_heads_kv + hk) * d + c);
          }
        }
      }
    }
  }
  return out;
}

class ReferenceVsNaiveTest : public ::testing::TestWithParam<TestCase> {};

TEST_P(ReferenceVsNaiveTest, Agree) {
  const TestCase& tc = GetParam();
  HostBuffers buf(tc);
  const ReferenceOutput ref = ReferenceAttention(buf.params());
  const ReferenceOutput naive = Naive(buf.params(), tc.causal, tc.window_left, tc.window_right);
  ASSERT_EQ(ref.o.size(), naive.o.size());
  ASSERT_EQ(ref.lse.size(), naive.lse.size());
  for (size_t i = 0; i < ref.o.size(); ++i) ASSERT_NEAR(ref.o[i], naive.o[i], 1e-12) << i;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(naive.lse[i])) {
      ASSERT_EQ(ref.lse[i], -kInf) << i;
    } else {
      ASSERT_NEAR(ref.lse[i], naive.lse[i], 1e-12) << i;
    }
  }
}

std::vector<TestCase> NaiveCases() {
  std::vector<TestCase> cases;
  auto add = [&cases](int sq, int sk, int hq, int hkv) -> TestCase& {
    TestCase tc;
    tc.batch = 2;
    tc.seqlen_q = sq;
    tc.seqlen_k = sk;
    tc.num_heads_q = hq;
    tc.num_heads_kv = hkv;
    tc.head_dim = 16;
    cases.push_back(tc);
    return cases.back();
  };
  add(9, 9, 2, 2);
  add(5, 13, 4, 1).causal = true;
  add(13, 5, 4, 2).causal = true;
  add(12, 12, 2, 1).window_left = 3;
  add(12, 15, 2, 1).window_right = 2;
  {
    TestCase& tc = add(15, 12, 2, 2);
    tc.window_left = 2;
    tc.window_right = 1;
  }
  {
    TestCase& tc = add(12, 12, 2, 2);
    tc.causal = true;
    tc.window_left = 4;
  }
  add(7, 7, 2, 2).softcap = 1.5f;
  add(7, 7, 2, 2).softmax_scale = 0.7f;
  {
    TestCase tc;
    tc.seqlens_q = {3, 0, 5};
    tc.seqlens_k = {4, 2, 0};
    tc.num_heads_q = 2;
    tc.head_dim = 8;
    tc.causal = true;
    cases.push_back(tc);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceVsNaiveTest, ::testing::ValuesIn(NaiveCases()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name();
                         });

// The low-precision twin: equal to the exact one rounded for FP32, close to
// it (but not equal) for FP16/BF16, with BF16 the further off.
TEST(ReferenceTest, LowPrecisionTwin) {
  double err[3] = {};
  int n = 0;
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    TestCase tc;
    tc.dtype = t;
    tc.seqlen_q = 33;
    tc.seqlen_k = 40;
    tc.num_heads_q = 2;
    tc.seed = 11;
    HostBuffers buf(tc);
    const ReferenceOutput& exact = buf.Reference();
    const ReferenceOutput& lowp = buf.ReferenceLowPrecision();
    for (size_t i = 0; i < exact.o.size(); ++i) {
      err[n] = std::max(err[n], std::fabs(exact.o[i] - lowp.o[i]));
      if (t == DType::kFP32) {
        ASSERT_EQ(lowp.o[i], static_cast<float>(exact.o[i]));
      } else {
        ASSERT_EQ(lowp.o[i], RoundTo(t, static_cast<float>(lowp.o[i])));
      }
    }
    ++n;
  }
  EXPECT_LT(err[0], 1e-6);
  EXPECT_GT(err[1], 0.0);
  EXPECT_LT(err[1], 1e-2);
  EXPECT_GT(err[2], err[1]);
  EXPECT_LT(err[2], 1e-1);
}

}  // namespace
}  // namespace attnserve
