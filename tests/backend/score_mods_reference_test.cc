// The float64 reference's score modifiers and masks on hand-computed cases:
// one query, two keys, every mod alone, so each term of the contract's order
// (scale, softcap, ALiBi, bias, masks, sinks) is checked against arithmetic
// done here, not against another implementation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kD = 8;

// One sequence, one head, Sq = 1 and Sk = 2, FP32, scale 1: q = e0,
// k0 = 2·e0 (score 2), k1 = 0 (score 0), v0 = e0, v1 = e1. So O = (w0, w1, 0..)
// with w the softmax weights and LSE = log of the denominator.
struct Tiny {
  std::vector<float> q, k, v;
  AttnParams p;
  explicit Tiny(const AttnMods& mods = AttnMods()) : q(kD, 0.0f), k(2 * kD, 0.0f), v(2 * kD, 0.0f) {
    q[0] = 1.0f;
    k[0] = 2.0f;
    v[0] = 1.0f;
    v[kD + 1] = 1.0f;
    AttnOptions options;
    options.softmax_scale = 1.0f;
    AttnPointers ptr;
    ptr.q = q.data();
    ptr.k = k.data();
    ptr.v = v.data();
    ptr.mods = mods;
    p = MakeAttnParams(DenseShape(DType::kFP32, 1, 1, 2, 1, 1, kD), options, ptr);
  }
};

// Expects O = (e^s0, e^s1) / den and LSE = log(den), den = e^s0 + e^s1 (+ e^sink);
// a key given -inf is absent.
void ExpectRow(const AttnParams& p, double s0, double s1, double sink = -kInf) {
  const ReferenceOutput ref = ReferenceAttention(p);
  const double den = std::exp(s0) + std::exp(s1) + std::exp(sink);
  EXPECT_NEAR(ref.o[0], std::exp(s0) / den, 1e-14);
  EXPECT_NEAR(ref.o[1], std::exp(s1) / den, 1e-14);
  for (int c = 2; c < kD; ++c) EXPECT_EQ(ref.o[c], 0.0);
  EXPECT_NEAR(ref.lse[0], std::log(den), 1e-14);
}

TEST(ScoreModsReferenceTest, Plain) { ExpectRow(Tiny().p, 2.0, 0.0); }

TEST(ScoreModsReferenceTest, SinkJoinsTheDenominator) {
  const float sink = 0.5f;
  AttnMods m;
  m.sinks = &sink;
  // den = e^2 + 1 + e^0.5
  ExpectRow(Tiny(m).p, 2.0, 0.0, 0.5);
}

TEST(ScoreModsReferenceTest, LargeSinkDoesNotOverflow) {
  const float sink = 1000.0f;
  AttnMods m;
  m.sinks = &sink;
  const ReferenceOutput ref = ReferenceAttention(Tiny(m).p);
  EXPECT_NEAR(ref.lse[0], 1000.0, 1e-12);
  EXPECT_NEAR(ref.o[0], std::exp(2.0 - 1000.0), 1e-300);
  EXPECT_TRUE(std::isfinite(ref.o[0]));
}

TEST(ScoreModsReferenceTest, AlibiIsBottomRightAligned) {
  // Sq = 1, Sk = 2: the diagonal is key 1, so key 0 is 1 away: 2 - 0.75.
  const float slope = 0.75f;
  AttnMods m;
  m.alibi_slopes = &slope;
  ExpectRow(Tiny(m).p, 2.0 - 0.75, 0.0);
}

TEST(ScoreModsReferenceTest, BiasOfEachDtype) {
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    std::vector<uint16_t> storage(4, 0);  // room for two FP32 values
    StoreFromFloat(storage.data(), t, 0, -1.5f);
    StoreFromFloat(storage.data(), t, 1, 0.25f);
    AttnMods m;
    m.bias = storage.data();
    m.bias_dtype = t;
    ExpectRow(Tiny(m).p, 2.0 - 1.5, 0.25);
  }
}

TEST(ScoreModsReferenceTest, AlibiThenBiasAfterSoftcap) {
  const float slope = 0.5f;
  const float bias[2] = {0.125f, -0.5f};
  AttnMods m;
  m.alibi_slopes = &slope;
  m.bias = bias;
  Tiny t(m);
  t.p.softcap = 1.0f;  // the cap bends the raw score only: tanh(2) - 0.5 + 0.125
  ExpectRow(t.p, std::tanh(2.0) - 0.5 + 0.125, 0.0 - 0.5);
}

TEST(ScoreModsReferenceTest, MaskAndMinusInfBiasRemoveKeys) {
  const uint8_t mask[2] = {1, 0};
  AttnMods m;
  m.mask = mask;
  ExpectRow(Tiny(m).p, 2.0, -kInf);
  const float bias[2] = {-std::numeric_limits<float>::infinity(), 0.0f};
  AttnMods mb;
  mb.bias = bias;
  ExpectRow(Tiny(mb).p, -kInf, 0.0);
}

TEST(ScoreModsReferenceTest, FullyMaskedRow) {
  const uint8_t mask[2] = {0, 0};
  AttnMods m;
  m.mask = mask;
  ReferenceOutput ref = ReferenceAttention(Tiny(m).p);
  for (double x : ref.o) EXPECT_EQ(x, 0.0);
  EXPECT_EQ(ref.lse[0], -kInf);
  // With a sink the row's LSE is the sink itself; O stays 0.
  const float sink = -0.75f;
  m.sinks = &sink;
  ref = ReferenceAttention(Tiny(m).p);
  for (double x : ref.o) EXPECT_EQ(x, 0.0);
  EXPECT_EQ(ref.lse[0], -0.75);
}

TEST(ScoreModsReferenceTest, BlockMask) {
  // One query block, one key block: kept, then an empty CSR row.
  const int32_t row_ptr_kept[2] = {0, 1};
  const int32_t col = 0;
  AttnMods m;
  m.block_q = m.block_k = kBlockMaskGrain;
  m.block_row_ptr = row_ptr_kept;
  m.block_col_idx = &col;
  ExpectRow(Tiny(m).p, 2.0, 0.0);
  const int32_t row_ptr_empty[2] = {0, 0};
  m.block_row_ptr = row_ptr_empty;
  const ReferenceOutput ref = ReferenceAttention(Tiny(m).p);
  EXPECT_EQ(ref.o[0], 0.0);
  EXPECT_EQ(ref.lse[0], -kInf);
}

// A block mask over several blocks keeps exactly the keys of its kept blocks:
// equal to the same call with the element mask those blocks spell out.
TEST(ScoreModsReferenceTest, BlockMaskEqualsItsElementMask) {
  const int sq = 300, sk = 400, bq = 128, bk = 128;
  std::vector<float> q(sq * kD), k(sk * kD), v(sk * kD);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37 * i);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.11 * i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.05 * i + 1.0);
  // Query blocks 0..2, key blocks 0..3: row 0 keeps {1, 3}, row 1 none, row 2 {0, 1, 2, 3}.
  const std::vector<int32_t> row_ptr = {0, 2, 2, 6};
  const std::vector<int32_t> cols = {1, 3, 0, 1, 2, 3};
  std::vector<uint8_t> mask(sq * sk, 0);
  for (int i = 0; i < sq; ++i) {
    const int r = i / bq;
    for (int e = row_ptr[r]; e < row_ptr[r + 1]; ++e) {
      for (int j = cols[e] * bk; j < std::min(sk, (cols[e] + 1) * bk); ++j) mask[i * sk + j] = 1;
    }
  }
  AttnPointers ptr;
  ptr.q = q.data();
  ptr.k = k.data();
  ptr.v = v.data();
  ptr.mods.block_q = bq;
  ptr.mods.block_k = bk;
  ptr.mods.block_row_ptr = row_ptr.data();
  ptr.mods.block_col_idx = cols.data();
  const AttnShape shape = DenseShape(DType::kFP32, 1, sq, sk, 1, 1, kD);
  const ReferenceOutput a = ReferenceAttention(MakeAttnParams(shape, AttnOptions(), ptr));
  ptr.mods = AttnMods();
  ptr.mods.mask = mask.data();
  const ReferenceOutput b = ReferenceAttention(MakeAttnParams(shape, AttnOptions(), ptr));
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.lse[128], -kInf);  // query block 1 keeps nothing
}

// The low-precision twin applies the same mods: on FP32 it is the exact
// result rounded to float.
TEST(ScoreModsReferenceTest, LowPrecisionTwinAppliesMods) {
  const float sink = 0.5f;
  const float slope = 0.25f;
  const uint8_t mask[2] = {1, 0};
  AttnMods m;
  m.sinks = &sink;
  m.alibi_slopes = &slope;
  m.mask = mask;
  const Tiny t(m);
  const ReferenceOutput exact = ReferenceAttention(t.p);
  const ReferenceOutput low = ReferenceAttentionLowPrecision(t.p);
  EXPECT_EQ(low.o[0], static_cast<double>(static_cast<float>(exact.o[0])));
  EXPECT_EQ(low.lse[0], static_cast<double>(static_cast<float>(exact.lse[0])));
  EXPECT_NEAR(exact.lse[0], std::log(std::exp(1.75) + std::exp(0.5)), 1e-14);
}

}  // namespace
}  // namespace attnserve
