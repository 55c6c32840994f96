// The test harness must catch what it exists to catch: unwritten (poisoned)
// elements, wrong values, wrong or missing -inf LSE; and its inputs must be
// fresh, non-zero and deterministic per case.
#include "tests/common/attn_test_util.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::CheckOutputError;
using testing_util::HostBuffers;
using testing_util::TestCase;

// Writes the exact reference into the buffers, as a perfect backend would.
void WriteReference(HostBuffers* buf) {
  const AttnParams& p = buf->params();
  const ReferenceOutput& ref = buf->Reference();
  for (int64_t i = 0; i < buf->o_elements(); ++i) {
    StoreFromFloat(buf->o(), p.dtype, i, static_cast<float>(ref.o[i]));
  }
  for (int64_t i = 0; i < buf->lse_elements(); ++i) buf->lse()[i] = static_cast<float>(ref.lse[i]);
}

TestCase Case(DType t) {
  TestCase tc;
  tc.dtype = t;
  tc.seqlen_q = 20;
  tc.seqlen_k = 10;
  tc.num_heads_q = 2;
  tc.head_dim = 16;
  tc.causal = true;  // rows 0..9 see no key
  return tc;
}

TEST(AttnTestUtilTest, AcceptsReferenceRejectsPoison) {
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    HostBuffers buf(Case(t));
    EXPECT_FALSE(CheckOutput(buf));  // freshly poisoned
    WriteReference(&buf);
    EXPECT_TRUE(CheckOutput(buf));
    // One O element left unwritten.
    std::memset(static_cast<char*>(buf.o()) + 5 * DTypeSize(t), 0xff, DTypeSize(t));
    const std::string err = CheckOutputError(buf, buf.o(), buf.lse());
    EXPECT_NE(err.find("poison"), std::string::npos) << err;
    WriteReference(&buf);
    // One LSE element left unwritten.
    buf.lse()[30] = BitsFloat(0xffffffffu);
    EXPECT_NE(CheckOutputError(buf, buf.o(), buf.lse()).find("poison"), std::string::npos);
  }
}

TEST(AttnTestUtilTest, RejectsWrongValues) {
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    HostBuffers buf(Case(t));
    WriteReference(&buf);
    // Row 15, head 1, lane 3: off by 0.05 (a plausible masking bug's size).
    const int64_t i = (15 * 2 + 1) * 16 + 3;
    StoreFromFloat(buf.o(), t, i, LoadAsFloat(buf.o(), t, i) + 0.05f);
    const std::string err = CheckOutputError(buf, buf.o(), buf.lse());
    EXPECT_NE(err.find("o[b=0, i=15, h=1, d=3]"), std::string::npos) << err;
    WriteReference(&buf);
    buf.lse()[1 * 20 + 12] += 0.01f;
    EXPECT_NE(CheckOutputError(buf, buf.o(), buf.lse()).find("lse[b=0, h=1, i=12]"),
              std::string::npos);
    WriteReference(&buf);
    buf.lse()[3] = 0.0f;  // a fully masked row must report -inf
    EXPECT_NE(CheckOutputError(buf, buf.o(), buf.lse()).find("expected -inf"), std::string::npos);
    EXPECT_FALSE(CheckOutput(buf, buf.o(), nullptr));  // LSE asked for but missing
  }
}

TEST(AttnTestUtilTest, Fp32ToleranceIsTight) {
  HostBuffers buf(Case(DType::kFP32));
  WriteReference(&buf);
  float* o = static_cast<float*>(buf.o());
  const int64_t i = (12 * 2) * 16;
  o[i] += 1e-4f;  // 1e-4 absolute on an O(1) vector: far above 1e-5 relative
  EXPECT_FALSE(CheckOutput(buf));
}

TEST(AttnTestUtilTest, InputsAreFreshNonZeroAndDeterministic) {
  TestCase a = Case(DType::kBF16);
  HostBuffers b1(a), b2(a);
  EXPECT_EQ(std::memcmp(b1.q(), b2.q(), b1.q_bytes()), 0);  // same case, same inputs
  TestCase other = a;
  other.seqlen_q = 21;
  HostBuffers b3(other);
  EXPECT_NE(std::memcmp(b1.k(), b3.k(), b1.kv_bytes()), 0);  // another case, other inputs
  for (int64_t i = 0; i < b1.kv_bytes() / 2; ++i) {
    ASSERT_NE(LoadAsFloat(b1.v(), DType::kBF16, i), 0.0f);
    ASSERT_NE(LoadAsFloat(b1.q(), DType::kBF16, i % (b1.q_bytes() / 2)), 0.0f);
  }
}

TEST(AttnTestUtilTest, ParamsLikeFillParams) {
  TestCase tc = Case(DType::kFP16);
  tc.window_right = 5;
  HostBuffers buf(tc);
  const AttnParams& p = buf.params();
  EXPECT_EQ(p.window_right, 0);  // causal folds into the right window
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.25f);
  EXPECT_FLOAT_EQ(p.softmax_scale_log2, 0.25f * 1.44269504f);
  EXPECT_EQ(p.total_q, 20);
  EXPECT_EQ(p.lse, buf.lse());
  TestCase varlen;
  varlen.seqlens_q = {2, 0, 5};
  varlen.seqlens_k = {1, 3, 0};
  HostBuffers vb(varlen);
  EXPECT_EQ(vb.params().batch, 3);
  EXPECT_EQ(vb.params().seqlen_q, 5);
  EXPECT_EQ(vb.params().seqlen_k, 3);
  EXPECT_EQ(vb.params().total_q, 7);
  EXPECT_EQ(vb.params().total_k, 4);
  EXPECT_EQ(vb.params().cu_seqlens_q[3], 7);
}

}  // namespace
}  // namespace attnserve
