// The client's score modifiers and masks without a server: ALiBi slopes, the
// block-mask patterns, CheckScoreMods' refusals, the proto they become, .npy
// masks, and a verifier that tells a result computed without the mods apart.
#include "client/score_mods.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "client/inputs.h"
#include "client/npy.h"
#include "client/verify.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

TEST(AlibiSlopesTest, PaperFormula) {
  const std::vector<float> eight = AlibiSlopes(8);
  ASSERT_EQ(eight.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(eight[i], std::exp2(-(i + 1.0f)));
  // 12 heads: the 8 slopes of 8 heads, then slopes 0, 2, 4, 6 of 16 heads
  // (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5).
  const std::vector<float> twelve = AlibiSlopes(12);
  ASSERT_EQ(twelve.size(), 12u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(twelve[i], eight[i]);
  for (int i = 0; i < 4; ++i) {
    EXPECT_FLOAT_EQ(twelve[8 + i], std::exp2(-0.5f - i)) << i;
  }
  EXPECT_EQ(AlibiSlopes(1), std::vector<float>{std::exp2(-8.0f)});
}

InputsSummary Dense(int b, int sq, int sk, int hq) {
  InputsSummary s;
  s.batch = b;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = hq;
  s.heads_kv = 1;
  s.head_dim = 8;
  return s;
}

TEST(MakeBlockMaskTest, RandomKeepsRoundedFractionPerRow) {
  std::mt19937_64 rng(1);
  const InputsSummary s = Dense(2, 300, 1000, 3);  // 3 query blocks, 8 key blocks
  auto m = MakeBlockMask(BlockPattern::kRandom, 0.3, 128, 128, s, {}, {}, &rng);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->row_ptr.size(), 2u * 3 * 3 + 1);
  for (size_t r = 0; r + 1 < m->row_ptr.size(); ++r) {
    EXPECT_EQ(m->row_ptr[r + 1] - m->row_ptr[r], 2);  // round(0.3 * 8)
  }
  ScoreMods mods;
  mods.block_mask = *m;
  EXPECT_TRUE(CheckScoreMods(mods, s, {}, {}).ok());
}

TEST(MakeBlockMaskTest, StripesHaveGlobalColumnsAndTheDiagonal) {
  std::mt19937_64 rng(1);
  const InputsSummary s = Dense(1, 1024, 1024, 1);
  auto m = MakeBlockMask(BlockPattern::kStripes, 0.5, 128, 128, s, {}, {}, &rng);
  ASSERT_TRUE(m.ok()) << m.status();
  for (int r = 0; r < 8; ++r) {
    const std::vector<int32_t> row(m->col_idx.begin() + m->row_ptr[r],
                                   m->col_idx.begin() + m->row_ptr[r + 1]);
    ASSERT_EQ(row.size(), 4u) << r;
    EXPECT_EQ(row[0], 0) << r;                                        // global column
    EXPECT_NE(std::find(row.begin(), row.end(), r), row.end()) << r;  // diagonal
  }
}

TEST(MakeBlockMaskTest, VarlenRowsAreHeadMajorPerSequence) {
  std::mt19937_64 rng(2);
  InputsSummary s = Dense(3, 0, 0, 2);
  s.varlen = true;
  const std::vector<int32_t> cu_q = {0, 200, 200, 500}, cu_k = {0, 300, 400, 410};
  auto m = MakeBlockMask(BlockPattern::kRandom, 1.0, 128, 128, s, cu_q, cu_k, &rng);
  ASSERT_TRUE(m.ok()) << m.status();
  // Per head: sequence 0 has 2 query blocks of 3 key blocks, 1 none, 2 three of 1.
  EXPECT_EQ(m->row_ptr, (std::vector<int32_t>{0, 3, 6, 7, 8, 9, 12, 15, 16, 17, 18}));
  ScoreMods mods;
  mods.block_mask = *m;
  EXPECT_TRUE(CheckScoreMods(mods, s, cu_q, cu_k).ok());
}

TEST(MakeBlockMaskTest, RefusesBadDensityAndSizes) {
  std::mt19937_64 rng(1);
  const InputsSummary s = Dense(1, 128, 128, 1);
  EXPECT_THAT(
      MakeBlockMask(BlockPattern::kRandom, 1.5, 128, 128, s, {}, {}, &rng).status().message(),
      HasSubstr("[0, 1]"));
  EXPECT_THAT(
      MakeBlockMask(BlockPattern::kRandom, 0.5, 64, 128, s, {}, {}, &rng).status().message(),
      HasSubstr("block_q must be a positive multiple of 128, got 64"));
}

TEST(CheckScoreModsTest, NamesTheFieldOfEachRefusal) {
  const InputsSummary s = Dense(2, 130, 260, 4);
  auto refuse = [&](const ScoreMods& mods) {
    return std::string(CheckScoreMods(mods, s, {}, {}).message());
  };
  ScoreMods m;
  m.alibi_slopes = {1, 2};
  EXPECT_THAT(refuse(m), HasSubstr("alibi_slopes: expected 4 values"));
  m = {};
  m.sinks = {0, 0, NAN, 0};
  EXPECT_THAT(refuse(m), HasSubstr("sinks[2] must be finite"));
  m = {};
  m.bias = *HostTensor::FromFloats(DType::kFP32, {2, 3, 130, 260},
                                   std::vector<float>(2 * 3 * 130 * 260, 0.0f));
  EXPECT_THAT(refuse(m), HasSubstr("bias: dense calls take [B or 1, Hq or 1, Sq, Sk]"));
  std::vector<float> values(130 * 260, 0.0f);
  values[7] = INFINITY;
  m.bias = *HostTensor::FromFloats(DType::kBF16, {1, 1, 130, 260}, values);
  EXPECT_THAT(refuse(m), HasSubstr("bias[flat 7] = inf"));
  m = {};
  m.mask = ElementMaskData{{1, 4, 130, 260}, std::vector<uint8_t>(10, 1)};
  EXPECT_THAT(refuse(m), HasSubstr("mask.data"));
  BlockMaskData b;
  b.num_batch = 1;
  b.num_heads = 1;
  b.row_ptr = {0, 2};  // 2 query blocks of 128: 3 entries
  b.col_idx = {0, 1};
  m = {};
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("block_mask.row_ptr: expected 3 entries"));
  b.row_ptr = {0, 2, 3};
  b.col_idx = {1, 1, 0};
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("increase strictly"));
  b.col_idx = {0, 1, 3};  // 3 key blocks of 128
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("block_mask.col_idx[2] = 3 (row 1) must be in [0, 3)"));
  b.row_ptr = {0, 2, 1};
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("row_ptr[2] must equal the 3 entries of col_idx, got 1"));
  b.col_idx = {0, 1, 2};
  b.block_k = 192;
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("block_mask.block_k"));
  b.block_k = 128;
  b.num_batch = 3;
  m.block_mask = b;
  EXPECT_THAT(refuse(m), HasSubstr("block_mask.num_batch: expected 2 or 1, got 3"));
}

TEST(ScoreModsToProtoTest, FillsFieldsTenToFourteen) {
  ScoreMods m;
  m.alibi_slopes = {0.5f, 0.25f};
  m.sinks = {1.0f, -1.0f};
  m.bias = *HostTensor::FromFloats(DType::kFP16, {1, 1, 2, 3}, {1, 2, 3, 4, 5, 6});
  m.mask = ElementMaskData{{1, 2, 2, 3}, {1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1}};
  BlockMaskData b;
  b.block_k = 256;
  b.row_ptr = {0, 1};
  b.col_idx = {0};
  m.block_mask = b;
  v1::AttentionOptions o;
  ScoreModsToProto(m, &o);
  EXPECT_THAT(o.alibi_slopes(), ::testing::ElementsAre(0.5f, 0.25f));
  EXPECT_THAT(o.sinks(), ::testing::ElementsAre(1.0f, -1.0f));
  EXPECT_EQ(o.bias().dtype(), v1::FP16);
  EXPECT_EQ(o.bias().data(), m.bias->bytes());
  EXPECT_THAT(o.mask().shape(), ::testing::ElementsAre(1, 2, 2, 3));
  EXPECT_EQ(o.mask().data().size(), 12u);
  EXPECT_EQ(o.block_mask().block_q(), 128);
  EXPECT_EQ(o.block_mask().block_k(), 256);
  EXPECT_THAT(o.block_mask().row_ptr(), ::testing::ElementsAre(0, 1));
  EXPECT_EQ(ScoreModsString(m),
            "alibi sinks bias=FP16[1, 1, 2, 3] mask=BOOL[1, 2, 2, 3] block_mask=128x256 rows 1 "
            "kept 1");
}

TEST(NpyMaskTest, ReadsBoolAndUint8) {
  HostTensor codes =
      *HostTensor::FromBytes(DType::kFP8E4M3, {2, 3}, std::string("\1\0\2\0\0\1", 6));
  std::string file = EncodeNpy(codes);  // '|u1'
  auto mask = ParseNpyMask(file, "m.npy");
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(mask->data, (std::vector<uint8_t>{1, 0, 2, 0, 0, 1}));
  file.replace(file.find("|u1"), 3, "|b1");
  EXPECT_TRUE(ParseNpyMask(file, "m.npy").ok());
  const std::string floats = EncodeNpy(*HostTensor::FromFloats(DType::kFP32, {2}, {1, 0}));
  EXPECT_THAT(ParseNpyMask(floats, "m.npy").status().message(),
              HasSubstr("m.npy: a mask's element type must be '|b1' (bool) or '|u1'"));
}

// A result that ignores the mods must fail --verify: the verifier applies them.
TEST(VerifyWithModsTest, FailsAResultComputedWithoutThem) {
  AttentionShape shape = DenseAttentionShape(DType::kFP32, 1, 160, 300, 2, 2, 16);
  auto in = MakeRandomInputs(shape, 5);
  ASSERT_TRUE(in.ok());
  const InputsSummary s = *SummarizeInputs(*in);
  std::mt19937_64 rng(3);
  std::vector<ScoreMods> cases(5);
  cases[0].alibi_slopes = AlibiSlopes(2);
  cases[1].sinks = {1.0f, 2.0f};
  std::vector<float> ramp(160 * 300);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = static_cast<float>(i % 300) / 100.0f;
  cases[2].bias = *HostTensor::FromFloats(DType::kFP32, {1, 1, 160, 300}, ramp);
  std::vector<uint8_t> mask(160 * 300);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i % 7) != 0;
  cases[3].mask = ElementMaskData{{1, 1, 160, 300}, mask};
  cases[4].block_mask = *MakeBlockMask(BlockPattern::kRandom, 0.5, 128, 128, s, {}, {}, &rng);
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(c);
    AttentionInputs with = *in;
    with.mods = cases[c];
    // The plain result (no mods), and the one the reference gives with them.
    const AttnShape ashape = DenseShape(DType::kFP32, 1, 160, 300, 2, 2, 16);
    AttnPointers ptr;
    ptr.q = in->q.data();
    ptr.k = in->k.data();
    ptr.v = in->v.data();
    const ReferenceOutput plain = ReferenceAttention(MakeAttnParams(ashape, in->options, ptr));
    ptr.mods = AttnModsOf(with.mods, s);
    const ReferenceOutput modded = ReferenceAttention(MakeAttnParams(ashape, in->options, ptr));
    for (const auto* ref : {&plain, &modded}) {
      ForwardResult result;
      std::vector<float> o(ref->o.begin(), ref->o.end());
      result.o = *HostTensor::FromFloats(DType::kFP32, in->q.shape(), o);
      auto report = VerifyForward(with, result);
      ASSERT_TRUE(report.ok()) << report.status();
      EXPECT_EQ(report->passed, ref == &modded) << report->failure;
    }
  }
}

}  // namespace
}  // namespace attnserve
