// MakeAttnParams (backend/make_params.h): sizes and totals for dense, varlen
// and paged shapes, the default scale and the log2(e) factor, causal folded into
// window_right = 0, unset windows kNoWindow, pointers passed through.
#include "backend/make_params.h"

#include <cmath>
#include <vector>

#include "backend/check_params.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

AttnShape Dense(int b, int sq, int sk, int hq, int hkv, int d) {
  return DenseShape(DType::kBF16, b, sq, sk, hq, hkv, d);
}

TEST(MakeAttnParamsTest, DenseSizesAndDefaults) {
  int q = 0, k = 0, v = 0, o = 0;
  float lse = 0;
  const AttnParams p =
      MakeAttnParams(Dense(3, 5, 7, 8, 2, 64), AttnOptions(), {&q, &k, &v, &o, &lse});
  EXPECT_EQ(p.dtype, DType::kBF16);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.num_heads_q, 8);
  EXPECT_EQ(p.num_heads_kv, 2);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.seqlen_q, 5);
  EXPECT_EQ(p.seqlen_k, 7);
  EXPECT_EQ(p.total_q, 15);
  EXPECT_EQ(p.total_k, 21);
  EXPECT_EQ(p.cu_seqlens_q, nullptr);
  EXPECT_EQ(p.cu_seqlens_k, nullptr);
  EXPECT_EQ(p.q, &q);
  EXPECT_EQ(p.k, &k);
  EXPECT_EQ(p.v, &v);
  EXPECT_EQ(p.o, &o);
  EXPECT_EQ(p.lse, &lse);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.125f);  // 1/sqrt(64)
  EXPECT_FLOAT_EQ(p.softmax_scale_log2, 0.125f * static_cast<float>(M_LOG2E));
  EXPECT_EQ(p.softcap, 0.0f);
  EXPECT_FALSE(p.is_causal);
  EXPECT_EQ(p.window_left, kNoWindow);
  EXPECT_EQ(p.window_right, kNoWindow);
  EXPECT_TRUE(CheckParams(p).ok()) << CheckParams(p);
}

TEST(MakeAttnParamsTest, VarlenTotalsAndLongestSequences) {
  const std::vector<int32_t> cu_q = {0, 3, 3, 10};
  const std::vector<int32_t> cu_k = {0, 4, 6, 15};
  AttnShape s = Dense(3, 0, 0, 4, 4, 32);
  s.cu_seqlens_q = cu_q.data();
  s.cu_seqlens_k = cu_k.data();
  s.seqlen_q = 99;  // ignored for varlen
  const AttnParams p = MakeAttnParams(s, AttnOptions(), AttnPointers());
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.total_q, 10);
  EXPECT_EQ(p.total_k, 15);
  EXPECT_EQ(p.seqlen_q, 7);
  EXPECT_EQ(p.seqlen_k, 9);
  EXPECT_EQ(p.cu_seqlens_q, cu_q.data());
  EXPECT_EQ(p.cu_seqlens_k, cu_k.data());
  EXPECT_EQ(p.q, nullptr);
  EXPECT_EQ(p.o, nullptr);
}

TEST(MakeAttnParamsTest, PagedKeysAreTheWholeSequences) {
  // New rows per sequence: queries {1, 0, 2}, K/V {1, 3, 2}; lengths after
  // the append {40, 3, 17}: total_k counts the new rows, seqlen_k the longest.
  const std::vector<int32_t> cu_q = {0, 1, 1, 3};
  const std::vector<int32_t> cu_k = {0, 1, 4, 6};
  const std::vector<int32_t> lengths = {40, 3, 17};
  const AttnParams p = MakeAttnParams(
      PagedShape(DType::kFP16, 3, 8, 2, 64, cu_q.data(), cu_k.data(), lengths.data()),
      AttnOptions(), AttnPointers());
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.num_heads_q, 8);
  EXPECT_EQ(p.num_heads_kv, 2);
  EXPECT_EQ(p.total_q, 3);
  EXPECT_EQ(p.total_k, 6);
  EXPECT_EQ(p.seqlen_q, 2);
  EXPECT_EQ(p.seqlen_k, 40);
  EXPECT_EQ(p.cu_seqlens_q, cu_q.data());
  EXPECT_EQ(p.cu_seqlens_k, cu_k.data());
}

TEST(MakeAttnParamsTest, EmptyVarlenBatch) {
  const std::vector<int32_t> cu = {0};
  AttnShape s = Dense(0, 0, 0, 1, 1, 8);
  s.cu_seqlens_q = cu.data();
  s.cu_seqlens_k = cu.data();
  const AttnParams p = MakeAttnParams(s, AttnOptions(), AttnPointers());
  EXPECT_EQ(p.total_q, 0);
  EXPECT_EQ(p.seqlen_q, 0);
  EXPECT_EQ(p.seqlen_k, 0);
}

TEST(MakeAttnParamsTest, ExplicitScaleAndSoftcap) {
  AttnOptions o;
  o.softmax_scale = 0.3f;
  o.softcap = 30.0f;
  const AttnParams p = MakeAttnParams(Dense(1, 2, 2, 1, 1, 16), o, AttnPointers());
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.3f);
  EXPECT_FLOAT_EQ(p.softmax_scale_log2, 0.3f * kLog2e);
  EXPECT_FLOAT_EQ(p.softcap, 30.0f);
}

TEST(MakeAttnParamsTest, CausalIsTheRightWindowBoundWhateverWindowRightSays) {
  AttnOptions o;
  o.causal = true;
  o.window_right = 5;
  o.window_left = 3;
  const AttnParams p = MakeAttnParams(Dense(1, 4, 4, 1, 1, 16), o, AttnPointers());
  EXPECT_TRUE(p.is_causal);
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 0);
  EXPECT_TRUE(IsBanded(p));
}

TEST(MakeAttnParamsTest, WindowsWithoutCausal) {
  AttnOptions o;
  o.window_right = 0;  // set to 0 explicitly: a band, though not causal
  const AttnParams p = MakeAttnParams(Dense(1, 4, 4, 1, 1, 16), o, AttnPointers());
  EXPECT_FALSE(p.is_causal);
  EXPECT_EQ(p.window_left, kNoWindow);
  EXPECT_EQ(p.window_right, 0);
  EXPECT_TRUE(IsBanded(p));
  EXPECT_FALSE(IsBanded(MakeAttnParams(Dense(1, 4, 4, 1, 1, 16), AttnOptions(), AttnPointers())));
}

}  // namespace
}  // namespace attnserve
