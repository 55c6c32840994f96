// The edges of the accepted softmax_scale/softcap range (backend/score_range.h):
// CheckParams refuses what lies outside (values that once gave an
// all-NaN O), and at the edges inside, the CPU backend stays finite and agrees
// with the float64 reference, including with the largest FP16 inputs at the
// largest head dim, the case the bounds were derived from.
#include "backend/score_range.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/check_params.h"
#include "backend/reference/reference_attention.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

AttentionBackend& Backend() {
  static AttentionBackend* backend = MakeCpuBackend(0).release();
  return *backend;
}

TestCase Edge(DType dtype, float scale, float softcap) {
  TestCase tc;
  tc.dtype = dtype;
  tc.seqlen_q = 17;
  tc.seqlen_k = 97;
  tc.num_heads_q = 2;
  tc.head_dim = 64;
  tc.softmax_scale = scale;
  tc.softcap = softcap;
  return tc;
}

TEST(ScoreRangeTest, CheckParamsRefusesTheFindings) {
  TestCase tc = Edge(DType::kFP16, 0.0f, 0.0f);
  HostBuffers buf(tc);
  AttnParams p = buf.params();
  p.softmax_scale = 2e38f;
  p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
  EXPECT_EQ(CheckParams(p).code(), absl::StatusCode::kInvalidArgument);
  p = buf.params();
  for (float cap : {1e-45f, 1e-39f, 3e38f}) {
    p.softcap = cap;
    const absl::Status s = CheckParams(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << cap;
    EXPECT_NE(std::string(s.message()).find("softcap"), std::string::npos) << s;
  }
}

TEST(ScoreRangeTest, Predicates) {
  EXPECT_TRUE(SoftmaxScaleInRange(kMaxSoftmaxScale));
  EXPECT_FALSE(SoftmaxScaleInRange(std::nextafter(kMaxSoftmaxScale, 1e30f)));
  EXPECT_TRUE(SoftmaxScaleInRange(std::numeric_limits<float>::denorm_min()));
  EXPECT_FALSE(SoftmaxScaleInRange(0.0f));
  EXPECT_TRUE(SoftcapInRange(0.0f, 0.125f));
  EXPECT_TRUE(SoftcapInRange(MinSoftcap(0.125f), 0.125f));
  EXPECT_FALSE(SoftcapInRange(std::nextafter(MinSoftcap(0.125f), 0.0f), 0.125f));
  EXPECT_TRUE(SoftcapInRange(kMaxSoftcap, 0.125f));
  EXPECT_FALSE(SoftcapInRange(std::nextafter(kMaxSoftcap, 1e30f), 0.125f));
  EXPECT_FALSE(SoftcapInRange(-1.0f, 0.125f));
}

// Random inputs at the edges of the range, every dtype: finite and within the
// reference's tolerance. At scale 1e26 the softmax is an exact argmax and LSE
// is about 1e27: it is compared relatively (float32 resolution, ~1e-7 of it),
// since the tolerance policy's absolute LSE floor assumes ordinary magnitudes.
// Not here: softcap 1e26 with random scores; float32 tanh is exactly 1 from
// |x| ~ 9 (float64 from ~19), so keys float32 cannot tell apart tie at the cap
// and the weights follow float32, as in any float32 kernel (score_range.h).
// The worst-case test below covers that edge with inputs whose answer float32
// can represent.
TEST(ScoreRangeTest, CpuMatchesReferenceAtTheEdges) {
  const float default_scale = DefaultSoftmaxScale(64);
  struct Edge2 {
    float scale;
    float softcap;
  };
  const Edge2 edges[] = {
      {kMaxSoftmaxScale, 0.0f},                          // largest scale, no cap
      {kMaxSoftmaxScale, MinSoftcap(kMaxSoftmaxScale)},  // largest pre-tanh factor
      {0.0f, MinSoftcap(default_scale)},                 // smallest cap: uniform weights
      {0.0f, kMaxSoftcap},                               // largest cap: capping is the identity
      {std::numeric_limits<float>::denorm_min(), 0.0f},  // smallest scale: uniform weights
      {std::numeric_limits<float>::denorm_min(), MinSoftcap(1e-45f)},
  };
  for (DType t : {DType::kFP16, DType::kBF16, DType::kFP32}) {
    for (const Edge2& e : edges) {
      TestCase tc = Edge(t, e.scale, e.softcap);
      const bool huge = tc.softmax_scale > 1e20f;
      tc.return_lse = !huge;
      SCOPED_TRACE(tc.Name());
      HostBuffers buf(tc);
      ASSERT_TRUE(CheckParams(buf.params()).ok()) << CheckParams(buf.params());
      AttnParams p = buf.params();
      std::vector<float> lse(static_cast<size_t>(p.total_q * p.num_heads_q));
      if (huge) p.lse = lse.data();
      ASSERT_TRUE(PlanAndForward(Backend(), p, nullptr).ok());
      EXPECT_TRUE(CheckOutput(buf));
      if (!huge) continue;
      const ReferenceOutput& ref = buf.Reference();
      for (size_t i = 0; i < lse.size(); ++i) {
        ASSERT_TRUE(std::isfinite(lse[i])) << i;
        EXPECT_NEAR(lse[i], ref.lse[i], 1e-6 * std::fabs(ref.lse[i])) << "lse " << i;
      }
    }
  }
}

// The worst case of the derivation: FP16 inputs of the largest magnitude
// (+-65504) at D = 256 with the largest scale, so scores reach
// 1e26 * log2(e) * 256 * 65504^2 ~ 1.6e38 and must not overflow. Key j has
// 3j + 1 components of the opposite sign to the query, except key 7, which
// equals it: scores are distinct multiples of 2 * 65504^2 and key 7 wins by a
// margin no rounding can close. So: no cap, O = V[7]; the smallest cap for this
// scale (factor 1e26) and the largest cap both saturate tanh at +1 for every
// key (q.k >= 20 * 65504^2), so O = the mean of V in float32 and float64 alike.
TEST(ScoreRangeTest, LargestFp16InputsAtLargestScaleStayFinite) {
  const int d = 256, sk = 40;
  std::vector<uint16_t> q(d), k(static_cast<size_t>(sk) * d), v(static_cast<size_t>(sk) * d);
  std::mt19937 rng(15);
  std::bernoulli_distribution sign(0.5);
  for (uint16_t& x : q) x = FloatToFp16(sign(rng) ? 65504.0f : -65504.0f);
  for (int j = 0; j < sk; ++j) {
    const int flipped = j == 7 ? 0 : 3 * j + 1;
    for (int c = 0; c < d; ++c) {
      const float qc = Fp16ToFloat(q[c]);
      k[static_cast<size_t>(j) * d + c] = FloatToFp16(c < flipped ? -qc : qc);
      v[static_cast<size_t>(j) * d + c] = FloatToFp16(static_cast<float>((j * 7 + c) % 97) - 48.0f);
    }
  }
  for (float softcap : {0.0f, MinSoftcap(kMaxSoftmaxScale), kMaxSoftcap}) {
    std::vector<uint16_t> o(d);
    float lse = 0.0f;
    AttnParams p{};
    p.dtype = DType::kFP16;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.o = o.data();
    p.lse = &lse;
    p.batch = 1;
    p.seqlen_q = 1;
    p.seqlen_k = sk;
    p.total_q = 1;
    p.total_k = sk;
    p.num_heads_q = 1;
    p.num_heads_kv = 1;
    p.head_dim = d;
    p.softmax_scale = kMaxSoftmaxScale;
    p.softmax_scale_log2 = kMaxSoftmaxScale * 1.4426950408889634f;
    p.softcap = softcap;
    p.window_left = kNoWindow;
    p.window_right = kNoWindow;
    SCOPED_TRACE(softcap);
    ASSERT_TRUE(CheckParams(p).ok()) << CheckParams(p);
    ASSERT_TRUE(PlanAndForward(Backend(), p, nullptr).ok());
    const ReferenceOutput ref = ReferenceAttention(p);
    for (int c = 0; c < d; ++c) {
      const double expected =
          softcap == 0.0f ? Fp16ToFloat(v[static_cast<size_t>(7) * d + c]) : ref.o[c];
      if (softcap == 0.0f) {
        ASSERT_EQ(ref.o[c], expected) << c;  // the reference agrees
      }
      const float got = Fp16ToFloat(o[c]);
      ASSERT_TRUE(std::isfinite(got)) << "o[" << c << "] = " << got;
      // FP16 rounding of a mean of values in [-48, 48] is the only error.
      EXPECT_NEAR(got, expected, 0.02) << "o[" << c << "]";
    }
    // LSE ~1.1e38 after a 256-term float32 dot product and two changes of
    // base: a few ulps of float32.
    ASSERT_TRUE(std::isfinite(lse));
    EXPECT_NEAR(lse, ref.lse[0], 1e-5 * std::fabs(ref.lse[0]) + 1e-5);
  }
}

}  // namespace
}  // namespace attnserve
