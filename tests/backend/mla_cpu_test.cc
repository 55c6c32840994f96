// MLA shapes (V's head dim Dv differs from Q's and K's D, params.h
// head_dim_v): the CPU backend against the float64 reference with the
// tolerance policy at DeepSeek-V3's prefill (192 / 128) and absorbed decode
// (576 / 512) shapes and others, dense and varlen, causal or not, GQA/MQA;
// CheckParams' refusals of out-of-range head dims, naming the field.
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/check_params.h"
#include "backend/make_params.h"
#include "backend/ragged_batch.h"
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

TestCase Mla(DType dtype, int d, int dv, int sq, int sk, int hq, int hkv) {
  TestCase tc;
  tc.dtype = dtype;
  tc.head_dim = d;
  tc.head_dim_v = dv;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  return tc;
}

std::vector<TestCase> MlaGrid() {
  std::vector<TestCase> g;
  // Prefill shape: Dqk 192, Dv 128; queries and keys over more than one
  // 64-key tile, so the online softmax rescales O across tiles.
  for (DType t : {DType::kFP32, DType::kBF16, DType::kFP16, DType::kFP8E4M3}) {
    for (bool causal : {false, true}) {
      TestCase tc = Mla(t, 192, 128, 97, 150, 4, 2);
      tc.batch = 2;
      tc.causal = causal;
      g.push_back(tc);
    }
  }
  // Absorbed decode shape: one K/V head of 576, V of 512, 16..128 query heads.
  for (int hq : {16, 128}) {
    TestCase tc = Mla(DType::kBF16, 576, 512, 1, 130, hq, 1);
    tc.batch = 2;
    tc.softmax_scale = 0.0721688f;  // 1/sqrt(192), DeepSeek-V3's scale
    g.push_back(tc);
  }
  {
    TestCase tc = Mla(DType::kFP32, 576, 512, 5, 70, 16, 1);
    tc.causal = true;
    g.push_back(tc);
  }
  // Dv above and below D, small dims, MQA, windows and softcap.
  g.push_back(Mla(DType::kFP32, 64, 128, 33, 47, 2, 1));
  g.push_back(Mla(DType::kFP16, 128, 64, 33, 65, 8, 8));
  g.push_back(Mla(DType::kBF16, 8, 16, 17, 17, 1, 1));
  g.push_back(Mla(DType::kFP32, 16, 8, 17, 80, 4, 4));
  {
    TestCase tc = Mla(DType::kBF16, 192, 128, 70, 70, 4, 1);
    tc.window_left = 20;
    tc.window_right = 5;
    tc.softcap = 30.0f;
    g.push_back(tc);
  }
  // Varlen with zero-length sequences, GQA, causal.
  for (bool causal : {false, true}) {
    TestCase tc = Mla(DType::kBF16, 192, 128, 0, 0, 8, 2);
    tc.seqlens_q = {5, 0, 70, 1};
    tc.seqlens_k = {9, 3, 70, 0};
    tc.causal = causal;
    g.push_back(tc);
  }
  {
    TestCase tc = Mla(DType::kFP32, 576, 512, 0, 0, 16, 1);
    tc.seqlens_q = {1, 1, 2};
    tc.seqlens_k = {100, 0, 65};
    g.push_back(tc);
  }
  // Score modifiers ride along unchanged: ALiBi and sinks.
  {
    TestCase tc = Mla(DType::kFP32, 192, 128, 40, 90, 4, 2);
    tc.mods.alibi = true;
    tc.mods.sinks = true;
    g.push_back(tc);
  }
  return g;
}

class MlaCpuTest : public ::testing::TestWithParam<TestCase> {};

TEST_P(MlaCpuTest, MatchesReference) {
  HostBuffers buf(GetParam());
  ASSERT_EQ(HeadDimV(buf.params()), GetParam().head_dim_v);
  const absl::StatusOr<Plan> plan = Backend().CanImplement(buf.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(Backend().Forward(*plan, buf.params(), nullptr).ok());
  EXPECT_TRUE(CheckOutput(buf));
}

INSTANTIATE_TEST_SUITE_P(Grid, MlaCpuTest, ::testing::ValuesIn(MlaGrid()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name();
                         });

// Dv == D through head_dim_v (set equal, or 0) is the ordinary call: the
// same bits either way.
TEST(MlaCpuTest, EqualHeadDimVIsTheOrdinaryCall) {
  TestCase tc = Mla(DType::kBF16, 64, 0, 33, 70, 4, 2);
  HostBuffers plain(tc);
  AttnParams same = plain.params();
  same.head_dim_v = 64;
  std::vector<uint8_t> o(static_cast<size_t>(plain.o_bytes()));
  same.o = o.data();
  same.lse = nullptr;
  ASSERT_TRUE(Backend().Forward(Plan(), plain.params(), nullptr).ok());
  ASSERT_TRUE(Backend().Forward(Plan(), same, nullptr).ok());
  EXPECT_EQ(0, std::memcmp(o.data(), plain.o(), o.size()));
}

// Packed launches (the server's batching): MLA calls with the same dims share
// one and each gets the reference's answer; different Dv never share.
TEST(MlaCpuTest, PackedLaunch) {
  TestCase dense = Mla(DType::kBF16, 192, 128, 20, 33, 4, 2);
  dense.batch = 2;
  dense.causal = true;
  TestCase varlen = Mla(DType::kBF16, 192, 128, 0, 0, 4, 2);
  varlen.seqlens_q = {1, 0, 70};
  varlen.seqlens_k = {40, 5, 70};
  varlen.causal = true;
  HostBuffers a(dense), b(varlen);
  ASSERT_TRUE(CanShareLaunch(a.params(), b.params()));
  HostPackedBatch packed({&a.params(), &b.params()});
  ASSERT_TRUE(Backend().Forward(Plan(), packed.params(), nullptr).ok());
  packed.Scatter();
  EXPECT_TRUE(CheckOutput(a));
  EXPECT_TRUE(CheckOutput(b));
  TestCase other = dense;
  other.head_dim_v = 64;
  HostBuffers c(other);
  EXPECT_FALSE(CanShareLaunch(a.params(), c.params()));
  other.head_dim_v = 0;
  HostBuffers d(other);
  EXPECT_FALSE(CanShareLaunch(a.params(), d.params()));
}

// Backends without MLA kernels (CUDA) refuse Dv != D as UNIMPLEMENTED naming
// head_dim_v; equal dims pass.
TEST(MlaCheckParamsTest, RefuseDistinctHeadDimV) {
  HostBuffers mla(Mla(DType::kBF16, 192, 128, 1, 1, 1, 1));
  const absl::Status s = RefuseDistinctHeadDimV(mla.params(), "cuda");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_EQ(std::string(s.message()).rfind("cuda: head_dim_v expected 0 or head_dim 192", 0), 0u)
      << s;
  EXPECT_NE(std::string(s.message()).find("got 128"), std::string::npos) << s;
  HostBuffers plain(Mla(DType::kBF16, 192, 0, 1, 1, 1, 1));
  EXPECT_TRUE(RefuseDistinctHeadDimV(plain.params(), "cuda").ok());
}

// CheckParams: the field, the expected range and the actual value.
void ExpectRefused(int d, int dv, const std::string& field, const std::string& expected) {
  TestCase tc = Mla(DType::kFP32, 64, 0, 1, 1, 1, 1);
  HostBuffers buf(tc);
  AttnParams p = buf.params();
  p.head_dim = d;
  p.head_dim_v = dv;
  const absl::Status s = CheckParams(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << d << "/" << dv << ": " << s;
  const std::string m(s.message());
  EXPECT_EQ(m.rfind(field + ": expected", 0), 0u) << m;
  EXPECT_NE(m.find(expected), std::string::npos) << m;
  EXPECT_NE(m.find("got " + std::to_string(field == "head_dim" ? d : dv)), std::string::npos) << m;
  EXPECT_EQ(Backend().CanImplement(p).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MlaCheckParamsTest, RefusesOutOfRangeHeadDims) {
  for (int dv : {-8, 4, 12, 520, 1024}) ExpectRefused(192, dv, "head_dim_v", "[8, 512]");
  for (int d : {0, 12, 584}) ExpectRefused(d, 128, "head_dim", "[8, 576]");
  // Equal dims keep the ordinary bound, also when spelled out.
  ExpectRefused(512, 512, "head_dim", "[8, 256]");
  ExpectRefused(264, 0, "head_dim", "[8, 256]");
}

TEST(MlaCheckParamsTest, AcceptsTheBounds) {
  for (auto [d, dv] : std::vector<std::pair<int, int>>{
           {576, 512}, {192, 128}, {8, 512}, {576, 8}, {264, 256}, {256, 0}, {8, 8}}) {
    TestCase tc = Mla(DType::kFP32, 64, 0, 1, 1, 1, 1);
    HostBuffers buf(tc);
    AttnParams p = buf.params();
    p.head_dim = d;
    p.head_dim_v = dv;
    EXPECT_TRUE(CheckParams(p).ok()) << d << "/" << dv << ": " << CheckParams(p);
  }
}

// MakeAttnParams keeps head_dim_v 0 for equal dims and scales by 1/sqrt(Dqk).
TEST(MlaMakeParamsTest, HeadDimV) {
  AttnShape s = DenseShape(DType::kBF16, 1, 1, 1, 16, 1, 576);
  s.head_dim_v = 512;
  AttnParams p = MakeAttnParams(s, AttnOptions(), AttnPointers());
  EXPECT_EQ(p.head_dim_v, 512);
  EXPECT_EQ(HeadDimV(p), 512);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / 24.0f);
  s.head_dim_v = 576;
  EXPECT_EQ(MakeAttnParams(s, AttnOptions(), AttnPointers()).head_dim_v, 0);
  EXPECT_EQ(OOffset(p, 2, 3), (2 * 16 + 3) * 512);
  EXPECT_EQ(VOffset(p, 2, 0), 2 * 512);
  EXPECT_EQ(KVOffset(p, 2, 0), 2 * 576);
}

}  // namespace
}  // namespace attnserve
