// CheckParams: every invariant of the contract is enforced, and each message
// names the field, the expected and the actual value.
#include "backend/check_params.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

TestCase Dense() {
  TestCase tc;
  tc.batch = 2;
  tc.seqlen_q = 5;
  tc.seqlen_k = 7;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  tc.head_dim = 16;
  return tc;
}

TestCase Varlen() {
  TestCase tc = Dense();
  tc.seqlens_q = {3, 0, 4};
  tc.seqlens_k = {2, 5, 0};
  return tc;
}

// Expects INVALID_ARGUMENT whose message contains every one of `parts`.
void ExpectInvalid(const AttnParams& p, const std::vector<std::string>& parts) {
  const absl::Status s = CheckParams(p);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& part : parts) {
    EXPECT_NE(s.message().find(part), std::string::npos)
        << "message \"" << s.message() << "\" lacks \"" << part << "\"";
  }
}

TEST(CheckParamsTest, AcceptsValidParams) {
  for (const TestCase& tc : testing_util::StandardGrid()) {
    HostBuffers buf(tc);
    EXPECT_TRUE(CheckParams(buf.params()).ok()) << tc.Name() << ": " << CheckParams(buf.params());
  }
}

TEST(CheckParamsTest, AcceptsEdgeValues) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  for (int d : {8, 256}) {
    p.head_dim = d;
    EXPECT_TRUE(CheckParams(p).ok()) << d;
  }
  p = buf.params();
  p.window_left = 0;
  p.window_right = 0;
  EXPECT_TRUE(CheckParams(p).ok());
  p.num_heads_kv = 1;  // MQA
  EXPECT_TRUE(CheckParams(p).ok());
}

TEST(CheckParamsTest, Dtype) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.dtype = static_cast<DType>(0);
  ExpectInvalid(p, {"dtype", "got 0"});
  p.dtype = static_cast<DType>(5);
  ExpectInvalid(p, {"dtype", "FP8_E4M3 (4)", "got 5"});
}

TEST(CheckParamsTest, Descales) {
  TestCase tc = Dense();
  tc.dtype = DType::kFP8E4M3;
  tc.q_descale = 0.5f;
  tc.k_descale = 128.0f;  // the largest accepted
  tc.v_descale = 1e-30f;  // tiny is fine
  HostBuffers buf(tc);
  ASSERT_TRUE(CheckParams(buf.params()).ok()) << CheckParams(buf.params());
  AttnParams p = buf.params();
  for (float bad : {0.0f, -1.0f, 128.5f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    p = buf.params();
    p.q_descale = bad;
    ExpectInvalid(p, {"q_descale", "(0, 128]"});
    p = buf.params();
    p.k_descale = bad;
    ExpectInvalid(p, {"k_descale", "(0, 128]"});
    p = buf.params();
    p.v_descale = bad;
    ExpectInvalid(p, {"v_descale", "(0, 128]"});
  }
  // Any other dtype: exactly 1 (params built field by field default to it).
  HostBuffers bf16(Dense());
  p = bf16.params();
  EXPECT_EQ(p.q_descale, 1.0f);
  p.v_descale = 2.0f;
  ExpectInvalid(p, {"v_descale", "FP8_E4M3 inputs only", "got 2"});
  AttnParams fresh{};
  EXPECT_EQ(fresh.q_descale, 1.0f);
  EXPECT_EQ(fresh.k_descale, 1.0f);
  EXPECT_EQ(fresh.v_descale, 1.0f);
}

TEST(CheckParamsTest, BatchAndHeads) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.batch = -1;
  ExpectInvalid(p, {"batch", ">= 0", "-1"});
  p = buf.params();
  p.num_heads_q = 0;
  ExpectInvalid(p, {"num_heads_q", "> 0", "got 0"});
  p = buf.params();
  p.num_heads_kv = 0;
  ExpectInvalid(p, {"num_heads_kv", "> 0", "got 0"});
  p = buf.params();
  p.num_heads_kv = 3;  // 4 % 3 != 0
  ExpectInvalid(p, {"num_heads_q", "multiple of num_heads_kv (3)", "got 4"});
}

TEST(CheckParamsTest, HeadDim) {
  HostBuffers buf(Dense());
  for (int d : {0, 4, 12, 260, 264, -8}) {
    AttnParams p = buf.params();
    p.head_dim = d;
    ExpectInvalid(p, {"head_dim", "multiple of 8 in [8, 256]", "got " + std::to_string(d)});
  }
}

TEST(CheckParamsTest, SeqLens) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.seqlen_q = -1;
  ExpectInvalid(p, {"seqlen_q", ">= 0", "-1"});
  p = buf.params();
  p.seqlen_k = -2;
  ExpectInvalid(p, {"seqlen_k", ">= 0", "-2"});
}

TEST(CheckParamsTest, Scale) {
  HostBuffers buf(Dense());
  for (float bad : {0.0f, -0.5f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    AttnParams p = buf.params();
    p.softmax_scale = bad;
    ExpectInvalid(p, {"softmax_scale", "finite and in (0, 1e+26]"});
  }
  AttnParams p = buf.params();
  p.softmax_scale_log2 = p.softmax_scale;  // forgot the log2(e) factor
  ExpectInvalid(p, {"softmax_scale_log2", "log2(e)"});
}

TEST(CheckParamsTest, Softcap) {
  HostBuffers buf(Dense());
  for (float bad :
       {-1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    AttnParams p = buf.params();
    p.softcap = bad;
    ExpectInvalid(p, {"softcap", "0 (off) or in [softmax_scale / 1e+26, 1e+26]"});
  }
}

TEST(CheckParamsTest, Windows) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.window_left = -2;
  ExpectInvalid(p, {"window_left", ">= -1", "-2"});
  p = buf.params();
  p.window_right = -5;
  ExpectInvalid(p, {"window_right", ">= -1", "-5"});
  p = buf.params();
  p.is_causal = true;
  p.window_right = kNoWindow;  // not normalised
  ExpectInvalid(p, {"window_right", "0 when is_causal", "-1"});
}

TEST(CheckParamsTest, DenseTotals) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.total_q = 9;
  ExpectInvalid(p, {"total_q", "batch * seqlen_q = 10", "got 9"});
  p = buf.params();
  p.total_k = 15;
  ExpectInvalid(p, {"total_k", "batch * seqlen_k = 14", "got 15"});
}

TEST(CheckParamsTest, CuSeqlens) {
  HostBuffers buf(Varlen());
  ASSERT_TRUE(CheckParams(buf.params()).ok()) << CheckParams(buf.params());
  // Copies of the offsets ({0, 3, 3, 7} and {0, 2, 7, 7}) to break one at a time.
  std::vector<int32_t> cu_q(buf.cu_seqlens_q(), buf.cu_seqlens_q() + 4);
  std::vector<int32_t> cu_k(buf.cu_seqlens_k(), buf.cu_seqlens_k() + 4);
  auto with = [&](std::vector<int32_t> q, std::vector<int32_t> k) {
    cu_q = std::move(q);
    cu_k = std::move(k);
    AttnParams p = buf.params();
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
    return p;
  };
  ExpectInvalid(with({1, 3, 3, 7}, {0, 2, 7, 7}), {"cu_seqlens_q[0]", "expected 0", "got 1"});
  ExpectInvalid(with({0, 3, 3, 7}, {0, 2, 1, 7}),
                {"cu_seqlens_k[2]", ">= cu_seqlens_k[1] = 2", "got 1"});
  ExpectInvalid(with({0, 3, 3, 6}, {0, 2, 7, 7}), {"cu_seqlens_q[3]", "total rows 7", "got 6"});
  ExpectInvalid(with({0, 3, 3, 7}, {0, 2, 7, 8}), {"cu_seqlens_k[3]", "total rows 7", "got 8"});
  // A sequence longer than the declared maximum (seqlen_q = 4).
  ExpectInvalid(with({0, 1, 1, 7}, {0, 2, 7, 7}),
                {"cu_seqlens_q", "length 6", "<= the max sequence length 4"});
  AttnParams p = buf.params();
  p.cu_seqlens_k = nullptr;
  ExpectInvalid(p, {"cu_seqlens_k", "got null"});
  p = buf.params();
  p.cu_seqlens_q = nullptr;
  ExpectInvalid(p, {"cu_seqlens_q", "got null"});
}

TEST(CheckParamsTest, NullData) {
  HostBuffers buf(Dense());
  AttnParams p = buf.params();
  p.o = nullptr;
  ExpectInvalid(p, {"q/o", "non-null", "got null"});
  p = buf.params();
  p.v = nullptr;
  ExpectInvalid(p, {"k/v", "non-null", "got null"});
  // Empty problems need no data.
  TestCase empty = Dense();
  empty.batch = 0;
  HostBuffers none(empty);
  p = none.params();
  p.q = p.k = p.v = nullptr;
  p.o = nullptr;
  EXPECT_TRUE(CheckParams(p).ok());
}

}  // namespace
}  // namespace attnserve
