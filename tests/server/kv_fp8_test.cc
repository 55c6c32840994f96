// FP8 K/V caches over the wire (native API, CPU backend): CreateCache with
// geometry.cache_dtype FP8_E4M3 (pages of codes and scales, GetCacheStats'
// page_bytes), BF16 steps quantised by the server and FP8 steps with
// k_scale/v_scale given by the client, each step's O against the float64
// reference over the dequantised cache (the client's own quantisation of
// every row it sent, by the contract's rule); bad scales, shapes and pairings
// refused naming the field, with nothing appended.
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/kv_quantize.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"
#include "server/kv/startup_cache.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

// One sequence as the client sent it: BF16 values, and the codes and scales
// the cache must hold for them.
struct Fp8Context {
  std::vector<uint16_t> k, v;  // [len, Hkv, D] BF16
  std::vector<uint8_t> ck, cv;
  std::vector<float> sk, sv;  // [len, Hkv]
  int32_t length() const { return int32_t(k.size() / kKvRow); }
};

struct Fp8Part {
  uint64_t id = 0;
  int32_t expected = 0;
  std::vector<uint16_t> q, k, v;  // BF16
  std::vector<uint8_t> ck, cv;    // the new rows' codes and scales
  std::vector<float> sk, sv;
};

std::vector<uint16_t> RandomBf16(std::mt19937* rng, int64_t n, float scale) {
  std::vector<uint16_t> out;
  for (float x : Random(rng, n)) out.push_back(FloatToBf16(x * scale));
  return out;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, std::string data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

class KvFp8Test : public KvStepTest {
 protected:
  KvFp8Test() : KvStepTest(2026) {}

  // An FP8 cache of BF16 steps (the fixture's cache_ stays the FP32 one).
  std::string CreateFp8Cache(v1::CreateCacheResponse* resp) {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::BF16);
    r.mutable_geometry()->set_cache_dtype(v1::FP8_E4M3);
    r.set_capacity_tokens(1024);
    const grpc::Status s = stub_->CreateCache(&ctx, r, resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp->stats().cache_id();
  }
  grpc::Status CreateCache(v1::DType dtype, v1::DType cache_dtype) {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(dtype);
    r.mutable_geometry()->set_cache_dtype(cache_dtype);
    r.set_capacity_tokens(1024);
    v1::CreateCacheResponse resp;
    return stub_->CreateCache(&ctx, r, &resp);
  }
  void CreateIn(const std::string& cache, std::vector<uint64_t> ids) {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    for (uint64_t id : ids) r.add_sequences()->set_sequence_id(id);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(stub_->CreateSequences(&ctx, r, &resp).ok());
  }
  int32_t LengthIn(const std::string& cache, uint64_t id) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache);
    r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    const grpc::Status s = stub_->GetCacheStats(&ctx, r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (resp.sequences_size() != 1 || resp.sequences(0).lengths_size() < 1) return -1;
    return resp.sequences(0).lengths(0);
  }

  // A part appending `n` tokens with `nq` queries; `ctx` gains the tokens and
  // their quantisation.
  Fp8Part Step(uint64_t id, Fp8Context* ctx, int n, int nq) {
    Fp8Part p;
    p.id = id;
    p.expected = ctx->length();
    p.k = RandomBf16(&rng_, int64_t{n} * kKvRow, 2.0f);
    p.v = RandomBf16(&rng_, int64_t{n} * kKvRow, 1.0f);
    p.q = RandomBf16(&rng_, int64_t{nq} * kQRow, 1.0f);
    p.ck.resize(p.k.size());
    p.cv.resize(p.v.size());
    for (int64_t r = 0; r < int64_t{n} * kHkv; ++r) {
      p.sk.push_back(QuantiseFp8Row(p.k.data(), DType::kBF16, r * kD, kD, &p.ck[size_t(r * kD)]));
      p.sv.push_back(QuantiseFp8Row(p.v.data(), DType::kBF16, r * kD, kD, &p.cv[size_t(r * kD)]));
    }
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    ctx->ck.insert(ctx->ck.end(), p.ck.begin(), p.ck.end());
    ctx->cv.insert(ctx->cv.end(), p.cv.begin(), p.cv.end());
    ctx->sk.insert(ctx->sk.end(), p.sk.begin(), p.sk.end());
    ctx->sv.insert(ctx->sv.end(), p.sv.begin(), p.sv.end());
    return p;
  }

  // One call of `parts`: BF16 k/v, or (`given`) their codes with scales.
  static v1::AppendAttendRequest MakeFp8Call(const std::string& cache,
                                             const std::vector<Fp8Part>& parts, bool given) {
    v1::AppendAttendRequest r;
    r.set_cache_id(cache);
    std::string q, k, v, sk, sv;
    int64_t tq = 0, tk = 0;
    for (const Fp8Part& p : parts) {
      v1::SequenceStep* s = r.add_sequences();
      s->set_sequence_id(p.id);
      s->set_expected_length(p.expected);
      s->set_num_new_tokens(int32_t(p.k.size() / kKvRow));
      s->set_num_queries(int32_t(p.q.size() / kQRow));
      tq += s->num_queries();
      tk += s->num_new_tokens();
      q += Bytes(p.q);
      k += given ? Bytes(p.ck) : Bytes(p.k);
      v += given ? Bytes(p.cv) : Bytes(p.v);
      sk += Bytes(p.sk);
      sv += Bytes(p.sv);
    }
    SetTensor(r.mutable_q(), v1::BF16, {tq, kHq, kD}, q);
    const v1::DType kv = given ? v1::FP8_E4M3 : v1::BF16;
    SetTensor(r.mutable_k(), kv, {tk, kHkv, kD}, k);
    SetTensor(r.mutable_v(), kv, {tk, kHkv, kD}, v);
    if (given) {
      SetTensor(r.mutable_k_scale(), v1::FP32, {tk, kHkv}, sk);
      SetTensor(r.mutable_v_scale(), v1::FP32, {tk, kHkv}, sv);
    }
    r.mutable_options()->set_causal(true);
    r.mutable_options()->set_return_lse(true);
    return r;
  }

  // Each part's O rows against the float64 reference over its dequantised
  // context (tolerance.h's FP8 cache rule: BF16's, on those values).
  static void CheckFp8Response(const v1::AppendAttendResponse& resp,
                               const std::vector<Fp8Part>& parts,
                               const std::vector<Fp8Context*>& ctxs) {
    ASSERT_EQ(resp.lengths_size(), int(parts.size()));
    int64_t row0 = 0;
    for (size_t j = 0; j < parts.size(); ++j) {
      const Fp8Context& c = *ctxs[j];
      EXPECT_EQ(resp.lengths(int(j)), c.length());
      const int nq = int(parts[j].q.size() / kQRow);
      AttnPointers ptr;
      ptr.q = parts[j].q.data();
      ptr.k = c.ck.data();
      ptr.v = c.cv.data();
      AttnOptions options;
      options.causal = true;
      const AttnParams p =
          MakeAttnParams(DenseShape(DType::kBF16, 1, nq, c.length(), kHq, kHkv, kD), options, ptr);
      const KvRowScales scales{c.sk.data(), c.sv.data()};
      const ReferenceOutput ref = ReferenceAttention(p, scales);
      const ReferenceOutput lowp = ReferenceAttentionLowPrecision(p, scales);
      double lowp_err = 0;
      for (size_t i = 0; i < ref.o.size(); ++i)
        lowp_err = std::max(lowp_err, std::fabs(lowp.o[i] - ref.o[i]));
      const double tol = 2 * lowp_err + tolerance::OutputFloor(DType::kBF16);
      const uint16_t* o = reinterpret_cast<const uint16_t*>(resp.o().data().data());
      ASSERT_EQ(resp.o().dtype(), v1::BF16);
      for (int64_t e = 0; e < int64_t{nq} * kQRow; ++e) {
        const double got = Bf16ToFloat(o[row0 * kQRow + e]);
        ASSERT_LE(std::fabs(got - ref.o[size_t(e)]), tol)
            << "sequence " << parts[j].id << " element " << e << ": " << got << " vs "
            << ref.o[size_t(e)];
      }
      // The row-wise dequantised values are what the cache holds: quantising
      // on the server gave the client's codes (or a changed rule shows here).
      row0 += nq;
    }
  }
};

// KServe's attention_kv on an FP8 cache made with the native API: its BF16
// steps are quantised by the server like native ones.
TEST_F(KvFp8Test, AttentionKvOnAnFp8Cache) {
  v1::CreateCacheResponse created;
  const std::string cache = CreateFp8Cache(&created);
  CreateIn(cache, {7});
  Fp8Context ctx;
  for (const auto& [n, nq] : std::vector<std::pair<int, int>>{{19, 3}, {1, 1}, {1, 1}}) {
    const Fp8Part part = Step(7, &ctx, n, nq);
    inference::ModelInferRequest r;
    r.set_model_name("attention_kv");
    const std::vector<uint16_t>* data[] = {&part.q, &part.k, &part.v};
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      auto* in = r.add_inputs();
      in->set_name(names[i]);
      in->set_datatype("BF16");
      const int64_t heads = i == 0 ? kHq : kHkv;
      for (int64_t d : {int64_t(data[i]->size()) / (heads * kD), heads, int64_t{kD}})
        in->add_shape(d);
      r.add_raw_input_contents(Bytes(*data[i]));
    }
    auto& p = *r.mutable_parameters();
    p["cache_id"].set_string_param(cache);
    p["sequence_id"].set_uint64_param(7);
    p["causal"].set_bool_param(true);
    inference::ModelInferResponse out;
    const grpc::Status s = Infer(r, &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
    v1::AppendAttendResponse as_native;
    for (int i = 0; i < out.outputs_size(); ++i) {
      if (out.outputs(i).name() == "o") {
        as_native.mutable_o()->set_dtype(v1::BF16);
        as_native.mutable_o()->set_data(out.raw_output_contents(i));
      }
    }
    as_native.add_lengths(ctx.length());
    CheckFp8Response(as_native, {part}, {&ctx});
  }
  EXPECT_EQ(LengthIn(cache, 7), 21);
}

TEST_F(KvFp8Test, CacheStatsShowFp8Pages) {
  v1::CreateCacheResponse resp;
  CreateFp8Cache(&resp);
  EXPECT_EQ(resp.stats().geometry().cache_dtype(), v1::FP8_E4M3);
  EXPECT_EQ(resp.stats().geometry().dtype(), v1::BF16);
  // Codes (1 byte) plus a 4-byte scale per token and head, K and V: about
  // half a BF16 page at D 128; at this test's D 16, (16 + 4) / 32 of it.
  EXPECT_EQ(resp.stats().page_bytes(), 2 * kPage * kHkv * (kD + 4));
}

TEST_F(KvFp8Test, QuantisedAndGivenStepsPassTheReference) {
  v1::CreateCacheResponse created;
  const std::string cache = CreateFp8Cache(&created);
  CreateIn(cache, {1, 2});
  Fp8Context c1, c2;
  // Prefill: server-quantised BF16 for sequence 1, given codes for 2 (a
  // partial page each, so later steps append into it).
  {
    std::vector<Fp8Part> parts = {Step(1, &c1, 21, 5), Step(2, &c2, 7, 3)};
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeFp8Call(cache, {parts[0]}, false), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    CheckFp8Response(resp, {parts[0]}, {&c1});
    v1::AppendAttendResponse resp2;
    const grpc::Status s2 = Call(MakeFp8Call(cache, {parts[1]}, true), &resp2);
    ASSERT_TRUE(s2.ok()) << s2.error_message();
    CheckFp8Response(resp2, {parts[1]}, {&c2});
  }
  // Decode steps of both sequences in one call, alternating the two forms.
  for (int step = 0; step < 12; ++step) {
    std::vector<Fp8Part> parts = {Step(1, &c1, 1, 1), Step(2, &c2, 1, 1)};
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeFp8Call(cache, parts, step % 2 == 1), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    CheckFp8Response(resp, parts, {&c1, &c2});
  }
  EXPECT_EQ(LengthIn(cache, 1), 33);
  EXPECT_EQ(LengthIn(cache, 2), 19);
}

TEST_F(KvFp8Test, BadScalesAndPairingsAreRefusedAndChangeNothing) {
  v1::CreateCacheResponse created;
  const std::string cache = CreateFp8Cache(&created);
  CreateIn(cache, {5});
  Fp8Context ctx;
  {
    v1::AppendAttendResponse resp;
    const Fp8Part first = Step(5, &ctx, 3, 1);
    ASSERT_TRUE(Call(MakeFp8Call(cache, {first}, false), &resp).ok());
  }
  Fp8Context scratch = ctx;
  const Fp8Part p = Step(5, &scratch, 2, 1);
  auto refused = [&](const v1::AppendAttendRequest& r, const std::vector<std::string>& words) {
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    for (const std::string& w : words)
      EXPECT_NE(s.error_message().find(w), std::string::npos) << s.error_message();
    EXPECT_EQ(LengthIn(cache, 5), 3) << s.error_message();
  };
  v1::AppendAttendRequest r = MakeFp8Call(cache, {p}, true);
  r.clear_k_scale();
  refused(r, {"k_scale", "got none"});
  r = MakeFp8Call(cache, {p}, false);
  *r.mutable_v_scale() = MakeFp8Call(cache, {p}, true).v_scale();
  refused(r, {"v_scale", "expected unset"});
  r = MakeFp8Call(cache, {p}, true);
  r.mutable_k_scale()->set_shape(1, kHkv + 1);  // [2, 3] with its bytes: the shape is wrong
  r.mutable_k_scale()->mutable_data()->append(2 * 4, '\0');
  refused(r, {"k_scale.shape", "expected [2, 2]"});
  r = MakeFp8Call(cache, {p}, true);
  r.mutable_k_scale()->set_dtype(v1::FP16);
  refused(r, {"k_scale"});
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    r = MakeFp8Call(cache, {p}, true);
    std::string data = r.v_scale().data();
    std::memcpy(&data[4], &bad, 4);
    r.mutable_v_scale()->set_data(data);
    refused(r, {"v_scale.data[1]", "finite scale > 0"});
  }
  r = MakeFp8Call(cache, {p}, true);
  *r.mutable_v() = MakeFp8Call(cache, {p}, false).v();
  refused(r, {"v.dtype", "FP8_E4M3"});
  // The cache still works after the refusals: the same step, valid.
  v1::AppendAttendResponse resp;
  Fp8Part again = Step(5, &ctx, 2, 1);
  ASSERT_TRUE(Call(MakeFp8Call(cache, {again}, true), &resp).ok());
  CheckFp8Response(resp, {again}, {&ctx});
}

TEST_F(KvFp8Test, SixteenBitCachesRefuseScalesAndFp8Rows) {
  // The fixture's FP32 cache: k_scale is not for it, nor are FP8 rows.
  CreateSequences({9});
  v1::AppendAttendRequest r = MakeCall(cache_, {Part{9, 0, {}, {}, {}}});
  SetTensor(r.mutable_k_scale(), v1::FP32, {0, kHkv}, "");
  ExpectRefused(r, {"k_scale", "expected unset"}, 9, 0);
}

TEST_F(KvFp8Test, CreateCacheRefusesBadPairings) {
  grpc::Status s = CreateCache(v1::FP32, v1::FP8_E4M3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("geometry.cache_dtype"), std::string::npos) << s.error_message();
  s = CreateCache(v1::FP8_E4M3, v1::DTYPE_UNSPECIFIED);
  EXPECT_NE(s.error_message().find("geometry.dtype"), std::string::npos) << s.error_message();
  s = CreateCache(v1::BF16, v1::FP16);
  EXPECT_NE(s.error_message().find("geometry.cache_dtype"), std::string::npos) << s.error_message();
  EXPECT_TRUE(CreateCache(v1::FP16, v1::FP8_E4M3).ok());
  EXPECT_TRUE(CreateCache(v1::BF16, v1::BF16).ok());
}

// --kv_startup_cache (KServe's attention_kv has no CreateCache): cache_dtype
// makes an FP8 cache; a bad value names the key.
TEST(KvFp8StartupCache, CacheDtypeKey) {
  absl::StatusOr<std::vector<KvStartupCache>> c = ParseStartupCaches(
      "kv0:layers=2,hkv=8,d=128,dtype=BF16,cache_dtype=fp8_e4m3,capacity_tokens=4096");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->size(), 1u);
  EXPECT_EQ((*c)[0].create.geometry.cache_dtype, DType::kFP8E4M3);
  absl::StatusOr<std::vector<KvStartupCache>> bad =
      ParseStartupCaches("kv0:layers=1,hkv=1,d=64,dtype=BF16,cache_dtype=int8,capacity_tokens=64");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cache_dtype"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace attnserve
