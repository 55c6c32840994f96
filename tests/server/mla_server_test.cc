// MLA shapes on the server: a Forward whose V head dim differs from Q's and
// K's (validation names the wire field, O takes V's head dim), and K/V caches
// with a value head dim (geometry.head_dim_v), including the absorbed decode
// form whose pages hold K alone (geometry.v_in_k): steps over the wire
// against the float64 reference, a refused step changing nothing, and the
// cache charged for the bytes its pages hold.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/core/validate.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"
#include "server/server.h"

namespace attnserve {
namespace {

v1::Tensor Fp32Tensor(std::vector<int64_t> shape, std::mt19937* rng) {
  v1::Tensor t;
  t.set_dtype(v1::FP32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = dist(*rng);
  t.set_data(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  return t;
}

// --- Forward validation ----------------------------------------------------

// Dense FP32 q [2, 5, 4, dq], k [2, 7, 2, dq], v [2, 7, 2, dv].
v1::ForwardRequest Dense(int64_t dq, int64_t dv) {
  std::mt19937 rng(1);
  v1::ForwardRequest r;
  *r.mutable_q() = Fp32Tensor({2, 5, 4, dq}, &rng);
  *r.mutable_k() = Fp32Tensor({2, 7, 2, dq}, &rng);
  *r.mutable_v() = Fp32Tensor({2, 7, 2, dv}, &rng);
  return r;
}

absl::StatusOr<AttnParams> Validate(const v1::ForwardRequest& r) {
  v1::ForwardResponse unused;
  return ValidateAttentionCall(ForwardCallOf(r, &unused, CallMeta{}), RequestLimits{},
                               NativeFieldNames());
}

void ExpectRefused(const v1::ForwardRequest& r, const std::string& field,
                   const std::string& expected, int64_t got) {
  const absl::Status s = Validate(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const std::string m(s.message());
  EXPECT_EQ(m.rfind(field + ": expected", 0), 0u) << m;
  EXPECT_NE(m.find(expected), std::string::npos) << m;
  EXPECT_NE(m.find(absl::StrCat("got ", got)), std::string::npos) << m;
}

TEST(MlaForwardValidationTest, AcceptsDistinctValueHeadDim) {
  for (auto [dq, dv] : std::vector<std::pair<int, int>>{{192, 128}, {576, 512}, {64, 128}}) {
    const v1::ForwardRequest r = Dense(dq, dv);
    const absl::StatusOr<AttnParams> p = Validate(r);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->head_dim, dq);
    EXPECT_EQ(HeadDimV(*p), dv);
    const OutputLayout out = OutputLayoutOf(*p, r.q().shape(), true, true);
    EXPECT_EQ(out.o_shape, (std::vector<int64_t>{2, 5, 4, dv}));
    EXPECT_EQ(out.o_bytes, 2 * 5 * 4 * dv * 4);
  }
}

TEST(MlaForwardValidationTest, RefusesOutOfRangeHeadDims) {
  for (int64_t dv : {4, 12, 520, 1024}) ExpectRefused(Dense(192, dv), "v.shape[3]", "[8, 512]", dv);
  ExpectRefused(Dense(584, 128), "q.shape[3]", "[8, 576]", 584);
  // Equal dims keep the ordinary bound.
  ExpectRefused(Dense(512, 512), "q.shape[3]", "[8, 256]", 512);
  // V differs from K in another dim: named with the shape V needs.
  v1::ForwardRequest r = Dense(192, 128);
  std::mt19937 rng(2);
  *r.mutable_v() = Fp32Tensor({2, 6, 2, 128}, &rng);
  const absl::Status s = Validate(r).status();
  EXPECT_NE(std::string(s.message()).find("v.shape: expected [2, 7, 2, 128]"), std::string::npos)
      << s;
}

// --- K/V caches with a value head dim --------------------------------------

// A served CPU backend with a cache of one layer of `geometry`.
class MlaKvTest : public ::testing::Test {
 protected:
  void Start(int hkv, int d, int dv, bool v_in_k) {
    hkv_ = hkv;
    d_ = d;
    dv_ = dv;
    v_in_k_ = v_in_k;
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{256} << 20;
    o.kv_page_size = 16;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                     grpc::InsecureChannelCredentials()));
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(hkv);
    r.mutable_geometry()->set_head_dim(d);
    r.mutable_geometry()->set_head_dim_v(dv);
    r.mutable_geometry()->set_v_in_k(v_in_k);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(2048);
    grpc::ClientContext ctx;
    v1::CreateCacheResponse resp;
    const grpc::Status st = stub_->CreateCache(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    cache_ = resp.stats().cache_id();
    stats_ = resp.stats();
    grpc::ClientContext ctx2;
    v1::CreateSequencesRequest seqs;
    seqs.set_cache_id(cache_);
    seqs.add_sequences()->set_sequence_id(1);
    seqs.add_sequences()->set_sequence_id(2);
    v1::CreateSequencesResponse unused;
    ASSERT_TRUE(stub_->CreateSequences(&ctx2, seqs, &unused).ok());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  // The client's copy of a sequence: K rows [len, Hkv, D] and V rows
  // [len, Hkv, Dv] (with v_in_k, the first Dv of each K row).
  struct Seq {
    std::vector<float> k, v;
    int32_t len = 0;
  };

  // One step: `n` new tokens and `nq` queries for each of sequences 1 and 2.
  v1::AppendAttendRequest Step(int hq, int n, int nq, std::vector<float>* q_out,
                               std::vector<std::vector<float>>* k_new) {
    v1::AppendAttendRequest r;
    r.set_cache_id(cache_);
    r.set_layer(0);
    r.mutable_options()->set_causal(true);
    r.mutable_options()->set_return_lse(true);
    std::normal_distribution<float> dist;
    std::vector<float> q, k, v;
    k_new->clear();
    for (int s = 0; s < 2; ++s) {
      v1::SequenceStep* st = r.add_sequences();
      st->set_sequence_id(uint64_t(s + 1));
      st->set_expected_length(seqs_[s].len);
      st->set_num_new_tokens(n);
      st->set_num_queries(nq);
      for (int i = 0; i < nq * hq * d_; ++i) q.push_back(dist(rng_));
      std::vector<float> ks;
      for (int i = 0; i < n * hkv_ * d_; ++i) ks.push_back(dist(rng_));
      k.insert(k.end(), ks.begin(), ks.end());
      k_new->push_back(ks);
    }
    for (int i = 0; i < 2 * n * hkv_ * dv_ && !v_in_k_; ++i) v.push_back(dist(rng_));
    auto set = [](v1::Tensor* t, int64_t rows, int64_t heads, int64_t dim,
                  const std::vector<float>& x) {
      t->set_dtype(v1::FP32);
      for (int64_t e : {rows, heads, dim}) t->add_shape(e);
      t->set_data(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
    };
    set(r.mutable_q(), 2 * nq, hq, d_, q);
    set(r.mutable_k(), 2 * n, hkv_, d_, k);
    if (!v_in_k_) set(r.mutable_v(), 2 * n, hkv_, dv_, v);
    *q_out = q;
    v_sent_ = v;
    return r;
  }

  // The client's copies take the step's rows (after the server took them).
  void Commit(int n, const std::vector<std::vector<float>>& k_new) {
    for (int s = 0; s < 2; ++s) {
      Seq& seq = seqs_[s];
      seq.k.insert(seq.k.end(), k_new[s].begin(), k_new[s].end());
      for (int t = 0; t < n; ++t) {
        for (int h = 0; h < hkv_; ++h) {
          const float* src = v_in_k_ ? k_new[s].data() + (int64_t{t} * hkv_ + h) * d_
                                     : v_sent_.data() + ((int64_t{s} * n + t) * hkv_ + h) * dv_;
          seq.v.insert(seq.v.end(), src, src + dv_);
        }
      }
      seq.len += n;
    }
  }

  // O and LSE of the step against the float64 reference over each sequence.
  void CheckStep(const v1::AppendAttendResponse& resp, const std::vector<float>& q, int hq,
                 int nq) {
    ASSERT_EQ(resp.o().shape_size(), 3);
    EXPECT_EQ(resp.o().shape(2), dv_);
    const float* o = reinterpret_cast<const float*>(resp.o().data().data());
    const float* lse = reinterpret_cast<const float*>(resp.lse().data().data());
    ASSERT_EQ(int64_t(resp.o().data().size()), int64_t{2} * nq * hq * dv_ * 4);
    for (int s = 0; s < 2; ++s) {
      AttnShape shape = DenseShape(DType::kFP32, 1, nq, seqs_[s].len, hq, hkv_, d_);
      shape.head_dim_v = dv_;
      AttnOptions options;
      options.causal = true;
      AttnPointers ptr;
      ptr.q = q.data() + int64_t{s} * nq * hq * d_;
      ptr.k = seqs_[s].k.data();
      ptr.v = seqs_[s].v.data();
      const ReferenceOutput ref = ReferenceAttention(MakeAttnParams(shape, options, ptr));
      for (int i = 0; i < nq; ++i) {
        for (int h = 0; h < hq; ++h) {
          const double* want = ref.o.data() + (int64_t{i} * hq + h) * dv_;
          double scale = 0;
          for (int c = 0; c < dv_; ++c) scale = std::max(scale, std::fabs(want[c]));
          for (int c = 0; c < dv_; ++c) {
            const double got = o[((int64_t{s} * nq + i) * hq + h) * dv_ + c];
            ASSERT_LE(std::fabs(got - want[c]), tolerance::kFp32Rtol * scale + tolerance::kFp32Atol)
                << "sequence " << s + 1 << " query " << i << " head " << h << " dim " << c;
          }
          const double want_lse = ref.lse[size_t(h) * nq + i];
          const double got_lse = lse[int64_t{h} * 2 * nq + int64_t{s} * nq + i];
          ASSERT_LE(std::fabs(got_lse - want_lse),
                    tolerance::kFp32Rtol * std::fabs(want_lse) + tolerance::kFp32LseAtol);
        }
      }
    }
  }

  v1::CacheStats Stats() {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache_);
    v1::GetCacheStatsResponse resp;
    EXPECT_TRUE(stub_->GetCacheStats(&ctx, r, &resp).ok());
    return resp.stats();
  }

  void RunSteps(int hq) {
    std::vector<float> q;
    std::vector<std::vector<float>> k_new;
    for (auto [n, nq] : std::vector<std::pair<int, int>>{{20, 3}, {1, 1}, {17, 2}, {1, 1}}) {
      v1::AppendAttendRequest r = Step(hq, n, nq, &q, &k_new);
      grpc::ClientContext ctx;
      v1::AppendAttendResponse resp;
      const grpc::Status st = stub_->AppendAttend(&ctx, r, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      Commit(n, k_new);
      CheckStep(resp, q, hq, nq);
    }
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::string cache_;
  v1::CacheStats stats_;
  int hkv_ = 1, d_ = 0, dv_ = 0;
  bool v_in_k_ = false;
  Seq seqs_[2];
  std::vector<float> v_sent_;
  std::mt19937 rng_{5};
};

TEST_F(MlaKvTest, AbsorbedDecodeCacheHoldsKAlone) {
  Start(/*hkv=*/1, 576, 512, /*v_in_k=*/true);
  EXPECT_EQ(stats_.geometry().head_dim_v(), 512);
  EXPECT_TRUE(stats_.geometry().v_in_k());
  // Charged for K's pages alone: 16 tokens x 576 FP32 values.
  EXPECT_EQ(stats_.page_bytes(), 16 * 576 * 4);
  RunSteps(/*hq=*/16);
  const v1::CacheStats after = Stats();
  EXPECT_EQ(after.tokens(), 2 * 39);
  EXPECT_EQ(after.pages_used(), 2 * 3);
}

TEST_F(MlaKvTest, AbsorbedDecodeAt128QueryHeads) {
  Start(1, 576, 512, true);
  RunSteps(128);
}

TEST_F(MlaKvTest, SeparateValuePagesOfTheirOwnWidth) {
  Start(/*hkv=*/2, 192, 128, /*v_in_k=*/false);
  EXPECT_EQ(stats_.page_bytes(), 16 * 2 * (192 + 128) * 4);
  RunSteps(/*hq=*/8);
}

// A refused step changes nothing: lengths, pages and the next step's result.
TEST_F(MlaKvTest, RefusedStepChangesNothing) {
  Start(1, 576, 512, true);
  std::vector<float> q;
  std::vector<std::vector<float>> k_new;
  v1::AppendAttendRequest ok = Step(16, 20, 1, &q, &k_new);
  {
    grpc::ClientContext ctx;
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(stub_->AppendAttend(&ctx, ok, &resp).ok());
    Commit(20, k_new);
  }
  const v1::CacheStats before = Stats();
  // A v on a v_in_k cache: refused naming the field.
  v1::AppendAttendRequest with_v = Step(16, 5, 1, &q, &k_new);
  *with_v.mutable_v() = with_v.k();
  with_v.mutable_v()->set_shape(2, 512);
  with_v.mutable_v()->mutable_data()->resize(size_t(10 * 512 * 4));
  // k of the wrong head dim, and a stale expected length.
  v1::AppendAttendRequest wrong_k = Step(16, 5, 1, &q, &k_new);
  wrong_k.mutable_k()->set_shape(2, 512);
  wrong_k.mutable_k()->mutable_data()->resize(size_t(10 * 512 * 4));
  v1::AppendAttendRequest stale = Step(16, 5, 1, &q, &k_new);
  stale.mutable_sequences(1)->set_expected_length(3);
  struct Bad {
    v1::AppendAttendRequest* r;
    grpc::StatusCode code;
    std::string words;
  } bad[] = {{&with_v, grpc::StatusCode::INVALID_ARGUMENT, "v: expected none"},
             {&wrong_k, grpc::StatusCode::INVALID_ARGUMENT, "k.shape: expected [10, 1, 576]"},
             {&stale, grpc::StatusCode::FAILED_PRECONDITION, ""}};
  for (const Bad& b : bad) {
    grpc::ClientContext ctx;
    v1::AppendAttendResponse resp;
    const grpc::Status st = stub_->AppendAttend(&ctx, *b.r, &resp);
    EXPECT_EQ(st.error_code(), b.code) << st.error_message();
    EXPECT_NE(st.error_message().find(b.words), std::string::npos) << st.error_message();
    const v1::CacheStats now = Stats();
    EXPECT_EQ(now.tokens(), before.tokens());
    EXPECT_EQ(now.pages_used(), before.pages_used());
  }
  // The next step sees exactly the 20 tokens the accepted call appended.
  v1::AppendAttendRequest next = Step(16, 1, 1, &q, &k_new);
  grpc::ClientContext ctx;
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(stub_->AppendAttend(&ctx, next, &resp).ok());
  Commit(1, k_new);
  CheckStep(resp, q, 16, 1);
}

// Geometry refusals name the field.
TEST_F(MlaKvTest, GeometryRefusals) {
  Start(1, 64, 0, false);
  struct Bad {
    int d, dv;
    bool v_in_k;
    std::string words;
  } bad[] = {{576, 0, false, "geometry.head_dim: expected a multiple of 8 in [8, 256]"},
             {584, 512, true, "geometry.head_dim: expected a multiple of 8 in [8, 576]"},
             {192, 520, false, "geometry.head_dim_v: expected 0 (head_dim) or a multiple of 8"},
             {256, 512, true, "geometry.head_dim_v: expected <= head_dim 256"}};
  for (const Bad& b : bad) {
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(1);
    r.mutable_geometry()->set_head_dim(b.d);
    r.mutable_geometry()->set_head_dim_v(b.dv);
    r.mutable_geometry()->set_v_in_k(b.v_in_k);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(64);
    grpc::ClientContext ctx;
    v1::CreateCacheResponse resp;
    const grpc::Status st = stub_->CreateCache(&ctx, r, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(b.words), std::string::npos) << st.error_message();
  }
}

}  // namespace
}  // namespace attnserve
