// ALiBi slopes and attention sinks on K/V calls (docs/kv-cache.md): a real
// AttnServer with the CPU backend, an FP32 cache in pages of 16 tokens. The
// client keeps every sequence's tokens and checks O and LSE of each query row
// against the float64 reference over all the K/V appended so far (ALiBi's
// distances count positions in the whole sequence, bottom-right aligned),
// over the native unary call, the native stream (calls with different sinks
// in flight at once) and the KServe v2 model attention_kv. A bias, element
// mask or block mask, ALiBi with attend_pages and malformed slopes or sinks
// are refused naming the field and change no length.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"

namespace attnserve {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kPage = 16;
constexpr int64_t kKvRow = kHkv * kD, kQRow = kHq * kD;

std::vector<float> Random(std::mt19937* rng, int64_t n) {
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& f : x) f = dist(*rng);
  return x;
}

// One sequence's tokens at one layer, as the client appended them.
struct Context {
  std::vector<float> k, v;  // [len, Hkv, D]
  int32_t length() const { return int32_t(k.size() / kKvRow); }
};

// One sequence's part of a call.
struct Part {
  uint64_t id = 0;
  int32_t expected = 0;
  std::vector<float> k, v, q;
  std::vector<int32_t> attend_pages;
};

// The per-head modifiers of a call; empty = unset.
struct Mods {
  std::vector<float> slopes, sinks;
};

void SetTensor(v1::Tensor* t, int64_t rows, int64_t heads, std::string data) {
  t->set_dtype(v1::FP32);
  t->add_shape(rows);
  t->add_shape(heads);
  t->add_shape(kD);
  t->set_data(std::move(data));
}

v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 const Mods& mods, bool causal = true) {
  v1::AppendAttendRequest r;
  r.set_cache_id(cache);
  std::string q, k, v;
  int64_t tq = 0, tk = 0;
  for (const Part& p : parts) {
    v1::SequenceStep* s = r.add_sequences();
    s->set_sequence_id(p.id);
    s->set_expected_length(p.expected);
    s->set_num_new_tokens(int32_t(p.k.size() / kKvRow));
    s->set_num_queries(int32_t(p.q.size() / kQRow));
    for (int32_t page : p.attend_pages) s->add_attend_pages(page);
    tq += s->num_queries();
    tk += s->num_new_tokens();
    q.append(reinterpret_cast<const char*>(p.q.data()), p.q.size() * 4);
    k.append(reinterpret_cast<const char*>(p.k.data()), p.k.size() * 4);
    v.append(reinterpret_cast<const char*>(p.v.data()), p.v.size() * 4);
  }
  SetTensor(r.mutable_q(), tq, kHq, q);
  SetTensor(r.mutable_k(), tk, kHkv, k);
  SetTensor(r.mutable_v(), tk, kHkv, v);
  v1::AttentionOptions* o = r.mutable_options();
  o->set_causal(causal);
  o->set_return_lse(true);
  for (float s : mods.slopes) o->add_alibi_slopes(s);
  for (float s : mods.sinks) o->add_sinks(s);
  return r;
}

// O rows [row0, row0 + nq) of a response (LSE [Hq, total_q]) against the
// float64 reference of those queries over `keys` of `ctx` (all of them when
// empty) with `mods`: a dense call of one sequence, so ALiBi and causal are
// bottom-right against the keys it attends.
::testing::AssertionResult RowsMatch(const std::string& o_bytes, const std::string& lse_bytes,
                                     int64_t total_q, int64_t row0, const float* q, int nq,
                                     const Context& ctx, const Mods& mods, bool causal,
                                     std::vector<int32_t> keys = {}) {
  if (keys.empty()) {
    for (int32_t t = 0; t < ctx.length(); ++t) keys.push_back(t);
  }
  std::vector<float> k, v;
  for (int32_t t : keys) {
    k.insert(k.end(), ctx.k.begin() + t * kKvRow, ctx.k.begin() + (t + 1) * kKvRow);
    v.insert(v.end(), ctx.v.begin() + t * kKvRow, ctx.v.begin() + (t + 1) * kKvRow);
  }
  AttnPointers ptr;
  ptr.q = q;
  ptr.k = k.data();
  ptr.v = v.data();
  if (!mods.slopes.empty()) ptr.mods.alibi_slopes = mods.slopes.data();
  if (!mods.sinks.empty()) ptr.mods.sinks = mods.sinks.data();
  AttnOptions options;
  options.causal = causal;
  const AttnParams p = MakeAttnParams(
      DenseShape(DType::kFP32, 1, nq, int32_t(keys.size()), kHq, kHkv, kD), options, ptr);
  const ReferenceOutput ref = ReferenceAttention(p);
  if (int64_t(o_bytes.size()) != total_q * kQRow * 4 ||
      int64_t(lse_bytes.size()) != total_q * kHq * 4) {
    return ::testing::AssertionFailure() << "o " << o_bytes.size() << " bytes, lse "
                                         << lse_bytes.size() << " bytes for " << total_q << " rows";
  }
  const float* o = reinterpret_cast<const float*>(o_bytes.data());
  const float* lse = reinterpret_cast<const float*>(lse_bytes.data());
  for (int i = 0; i < nq; ++i) {
    for (int h = 0; h < kHq; ++h) {
      const double* want_o = ref.o.data() + (int64_t{i} * kHq + h) * kD;
      double scale = 0;
      for (int d = 0; d < kD; ++d) scale = std::max(scale, std::abs(want_o[d]));
      for (int d = 0; d < kD; ++d) {
        const double got = o[(row0 + i) * kQRow + h * kD + d];
        if (!(std::abs(got - want_o[d]) <= tolerance::kFp32Rtol * scale + tolerance::kFp32Atol)) {
          return ::testing::AssertionFailure() << "o row " << row0 + i << " head " << h << " [" << d
                                               << "]: " << got << " vs " << want_o[d];
        }
      }
      const double want = ref.lse[size_t(h * nq + i)], got = lse[h * total_q + row0 + i];
      if (!(std::abs(got - want) <=
            tolerance::kFp32Rtol * std::abs(want) + tolerance::kFp32LseAtol)) {
        return ::testing::AssertionFailure()
               << "lse row " << row0 + i << " head " << h << ": " << got << " vs " << want;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

class KvModsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel);
    v2_ = inference::GRPCInferenceService::NewStub(channel);
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub_->CreateCache(&ctx, r, &resp).ok());
    cache_ = resp.stats().cache_id();
    // Slopes as ALiBi's geometric series; sinks of both signs.
    alibi_sinks_.slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
    alibi_sinks_.sinks = {1.5f, -0.5f, 0.0f, 2.5f};
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  grpc::Status Call(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->AppendAttend(&ctx, r, resp);
  }
  void CreateSequences(std::vector<uint64_t> ids) {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache_);
    for (uint64_t id : ids) r.add_sequences()->set_sequence_id(id);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(stub_->CreateSequences(&ctx, r, &resp).ok());
  }
  // -1 for a sequence the cache does not hold.
  int32_t Length(uint64_t id) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache_);
    r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    if (!stub_->GetCacheStats(&ctx, r, &resp).ok()) return -1;
    return resp.sequences_size() == 1 && resp.sequences(0).lengths_size() == 1
               ? resp.sequences(0).lengths(0)
               : -1;
  }
  // A part appending `n` tokens with `nq` queries; `ctx` gains the tokens.
  Part Step(uint64_t id, Context* ctx, int n, int nq, std::vector<int32_t> pages = {}) {
    Part p{id,
           ctx->length(),
           Random(&rng_, n * kKvRow),
           Random(&rng_, n * kKvRow),
           Random(&rng_, nq * kQRow),
           std::move(pages)};
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    return p;
  }
  // Checks a response to `parts` (made by Step on `ctxs`) against the reference.
  void Check(const v1::AppendAttendResponse& resp, const std::vector<Part>& parts,
             const std::vector<Context*>& ctxs, const Mods& mods, bool causal = true) {
    int64_t total_q = 0;
    for (const Part& p : parts) total_q += int64_t(p.q.size() / kQRow);
    ASSERT_EQ(resp.lengths_size(), int(parts.size()));
    int64_t row0 = 0;
    for (size_t j = 0; j < parts.size(); ++j) {
      EXPECT_EQ(resp.lengths(int(j)), ctxs[j]->length());
      const int nq = int(parts[j].q.size() / kQRow);
      EXPECT_TRUE(RowsMatch(resp.o().data(), resp.lse().data(), total_q, row0, parts[j].q.data(),
                            nq, *ctxs[j], mods, causal))
          << "sequence " << parts[j].id;
      row0 += nq;
    }
  }
  void RunAndCheck(const std::vector<Part>& parts, const std::vector<Context*>& ctxs,
                   const Mods& mods, bool causal = true) {
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeCall(cache_, parts, mods, causal), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    Check(resp, parts, ctxs, mods, causal);
  }
  // `r` is refused with INVALID_ARGUMENT whose message holds every one of
  // `words`; sequence `id` keeps length `length`.
  void ExpectRefused(const v1::AppendAttendRequest& r, const std::vector<std::string>& words,
                     uint64_t id, int32_t length) {
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    for (const std::string& w : words) {
      EXPECT_NE(s.error_message().find(w), std::string::npos) << s.error_message();
    }
    EXPECT_EQ(Length(id), length) << s.error_message();
  }

  // One attention_kv request for `part` (q, k, v FP32) with `mods` as the
  // alibi_slopes and sinks inputs, plus `extra` inputs by name.
  grpc::Status Infer(const Part& part, const Mods& mods, inference::ModelInferResponse* out,
                     bool start = false,
                     const std::vector<std::pair<std::string, std::vector<float>>>& extra = {},
                     bool block_q = false) {
    inference::ModelInferRequest r;
    r.set_model_name("attention_kv");
    const std::vector<float>* data[] = {&part.q, &part.k, &part.v};
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      auto* in = r.add_inputs();
      in->set_name(names[i]);
      in->set_datatype("FP32");
      const int64_t heads = i == 0 ? kHq : kHkv;
      for (int64_t d : {int64_t(data[i]->size()) / (heads * kD), heads, int64_t{kD}}) {
        in->add_shape(d);
      }
      r.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(data[i]->data()), data[i]->size() * 4));
    }
    std::vector<std::pair<std::string, std::vector<float>>> lists = extra;
    if (!mods.slopes.empty()) lists.push_back({"alibi_slopes", mods.slopes});
    if (!mods.sinks.empty()) lists.push_back({"sinks", mods.sinks});
    for (const auto& [name, values] : lists) {
      auto* in = r.add_inputs();
      in->set_name(name);
      in->set_datatype("FP32");
      in->add_shape(int64_t(values.size()));
      r.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
    }
    auto& p = *r.mutable_parameters();
    p["cache_id"].set_string_param(cache_);
    p["sequence_id"].set_uint64_param(part.id);
    if (start) p["sequence_start"].set_bool_param(true);
    if (block_q) p["block_q"].set_int64_param(128);
    p["causal"].set_bool_param(true);
    p["return_lse"].set_bool_param(true);
    grpc::ClientContext ctx;
    return v2_->ModelInfer(&ctx, r, out);
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
  std::string cache_;
  Mods alibi_sinks_;
  std::mt19937 rng_{11};
};

// Prefill (causal, every prompt token a query), decode and a speculative
// step over several calls: each step's rows match the reference over all the
// K/V appended so far, so ALiBi counts the cached keys, not the call's.
TEST_F(KvModsTest, UnaryStepsMatchReference) {
  CreateSequences({1, 2});
  Context a, b;
  const Mods& mods = alibi_sinks_;
  RunAndCheck({Step(1, &a, 40, 40), Step(2, &b, 23, 23)}, {&a, &b}, mods);
  for (int t = 0; t < 3; ++t) RunAndCheck({Step(1, &a, 1, 1), Step(2, &b, 1, 1)}, {&a, &b}, mods);
  // Speculative verification: 3 new tokens, 3 queries; and attend only.
  RunAndCheck({Step(1, &a, 3, 3), Step(2, &b, 0, 2)}, {&a, &b}, mods);
  // Each modifier alone, and non-causal (ALiBi's distance both ways).
  Mods sinks_only{{}, mods.sinks}, alibi_only{mods.slopes, {}};
  RunAndCheck({Step(1, &a, 1, 1)}, {&a}, sinks_only);
  RunAndCheck({Step(2, &b, 2, 2)}, {&b}, alibi_only);
  RunAndCheck({Step(1, &a, 2, 3), Step(2, &b, 1, 2)}, {&a, &b}, mods, /*causal=*/false);
  EXPECT_EQ(Length(1), 49);
  EXPECT_EQ(Length(2), 29);
}

// A call with modifiers is not the call without them: the check above
// would catch a server that dropped them.
TEST_F(KvModsTest, ModsChangeTheAnswer) {
  CreateSequences({1});
  Context a;
  Part p = Step(1, &a, 30, 2);
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache_, {p}, alibi_sinks_), &resp).ok());
  EXPECT_TRUE(
      RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a, alibi_sinks_, true));
  EXPECT_FALSE(RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a, Mods(), true));
  EXPECT_FALSE(RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a,
                         Mods{{}, alibi_sinks_.sinks}, true));
}

// The stream: calls of two sequences with different sinks and slopes in
// flight at once (the batcher may pack K/V calls of one layer; it must not
// pack these), several steps each, every response against the reference.
TEST_F(KvModsTest, StreamWithDifferentModsInFlight) {
  CreateSequences({1, 2});
  Context ctx[2];
  const Mods mods[2] = {alibi_sinks_, Mods{{0.3f, 0.2f, 0.1f, 0.05f}, {-1.0f, 0.5f, 3.0f, 0.0f}}};
  grpc::ClientContext sctx;
  sctx.AddMetadata("x-attnserve-cache-id", cache_);
  auto stream = stub_->AppendAttendStream(&sctx);
  for (int step = 0; step < 5; ++step) {
    std::map<std::string, std::pair<Part, int>> sent;
    for (int s = 0; s < 2; ++s) {
      const int n = step == 0 ? 20 + 7 * s : 1;
      Part p = Step(uint64_t(s + 1), &ctx[s], n, step == 0 ? n : 1);
      v1::AppendAttendRequest r = MakeCall(cache_, {p}, mods[s]);
      r.set_request_id(absl::StrCat("s", step, "q", s));
      sent.emplace(r.request_id(), std::make_pair(p, s));
      ASSERT_TRUE(stream->Write(r));
    }
    for (int i = 0; i < 2; ++i) {
      v1::AppendAttendResponse resp;
      ASSERT_TRUE(stream->Read(&resp));
      ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
      const auto& [p, s] = sent.at(resp.request_id());
      Check(resp, {p}, {&ctx[s]}, mods[s]);
    }
  }
  // A refused request on the stream answers in-band and appends nothing.
  v1::AppendAttendRequest bad = MakeCall(cache_, {Step(1, &ctx[0], 1, 1)}, Mods{{1.0f}, {}});
  bad.set_request_id("bad");
  ASSERT_TRUE(stream->Write(bad));
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.error_code(), int(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(resp.error_message().find("options.alibi_slopes: expected Hq = 4"), std::string::npos)
      << resp.error_message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Length(1), 24);
  EXPECT_EQ(Length(2), 31);
}

// Sinks count no positions: with attend_pages they apply over exactly the
// attended keys.
TEST_F(KvModsTest, SinksWithAttendPages) {
  CreateSequences({1});
  Context a;
  RunAndCheck({Step(1, &a, 40, 0)}, {&a}, Mods());
  const Mods sinks{{}, alibi_sinks_.sinks};
  Part p = Step(1, &a, 1, 1, {0});  // page 0, then page 2 (tokens 32..40, the new one last)
  v1::AppendAttendResponse resp;
  const grpc::Status s = Call(MakeCall(cache_, {p}, sinks), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<int32_t> keys;
  for (int32_t t = 0; t < 16; ++t) keys.push_back(t);
  for (int32_t t = 32; t <= 40; ++t) keys.push_back(t);
  EXPECT_TRUE(
      RowsMatch(resp.o().data(), resp.lse().data(), 1, 0, p.q.data(), 1, a, sinks, true, keys));
  EXPECT_EQ(Length(1), 41);
}

// Every refusal names the field and appends nothing, for any sequence of
// the call.
TEST_F(KvModsTest, RefusalsChangeNothing) {
  CreateSequences({1, 2});
  Context a, b;
  RunAndCheck({Step(1, &a, 40, 1), Step(2, &b, 5, 1)}, {&a, &b}, alibi_sinks_);
  auto next = [&](Context ctx, const Mods& mods, std::vector<int32_t> pages = {}) {
    Context b2 = b;
    return MakeCall(cache_, {Step(2, &b2, 1, 1), Step(1, &ctx, 1, 1, std::move(pages))}, mods);
  };
  const std::string unsupported =
      ": not supported on K/V calls; use attend_pages for page-level sparsity";

  v1::AppendAttendRequest r = next(a, alibi_sinks_);
  SetTensor(r.mutable_options()->mutable_bias(), 1, 1, std::string(4, '\0'));
  ExpectRefused(r, {"options.bias" + unsupported}, 1, 40);
  r = next(a, Mods());
  r.mutable_options()->mutable_mask()->add_shape(1);
  r.mutable_options()->mutable_mask()->set_data(std::string(1, '\1'));
  ExpectRefused(r, {"options.mask" + unsupported}, 1, 40);
  r = next(a, Mods());
  r.mutable_options()->mutable_block_mask()->set_block_q(128);
  ExpectRefused(r, {"options.block_mask" + unsupported}, 1, 40);

  ExpectRefused(next(a, alibi_sinks_, {0}),
                {"options.alibi_slopes: not supported together with attend_pages",
                 "sequences[1].attend_pages"},
                1, 40);
  ExpectRefused(next(a, Mods{{0.5f, 0.25f}, {}}),
                {"options.alibi_slopes: expected Hq = 4 values", "got 2"}, 1, 40);
  ExpectRefused(next(a, Mods{{}, {1, 2, 3, 4, 5}}), {"options.sinks: expected Hq = 4", "got 5"}, 1,
                40);
  ExpectRefused(next(a, Mods{{}, {1, std::nanf(""), 3, 4}}), {"options.sinks[1]: expected finite"},
                1, 40);
  ExpectRefused(next(a, Mods{{0, 0, INFINITY, 0}, {}}), {"options.alibi_slopes[2]"}, 1, 40);
  EXPECT_EQ(Length(2), 5);

  // Without q (append only), the lists say Hq: a multiple of Hkv.
  Context a2 = a;
  Part append = Step(1, &a2, 2, 0);
  r = MakeCall(cache_, {append}, Mods{{}, {1, 2, 3}});
  r.clear_q();
  ExpectRefused(r, {"options.sinks: expected Hq values, Hq a positive multiple of Hkv = 2"}, 1, 40);
  r = MakeCall(cache_, {append}, alibi_sinks_);
  r.clear_q();
  v1::AppendAttendResponse resp;
  const grpc::Status s = Call(r, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  a = a2;

  // The lengths the refusals left are the ones a correct step expects.
  RunAndCheck({Step(1, &a, 1, 1), Step(2, &b, 1, 1)}, {&a, &b}, alibi_sinks_);
  EXPECT_EQ(Length(1), 43);
}

// KServe v2's attention_kv: the alibi_slopes and sinks inputs give the
// native call's bytes (and the reference); a bias or mask input, a block
// mask parameter or a bad list is refused in v2 words with no length
// changed, and a refused sequence_start leaves no sequence.
TEST_F(KvModsTest, KserveInputsMatchNative) {
  CreateSequences({1, 2});
  Context a, b;
  // The same prompt in both sequences: 1 natively, 2 through attention_kv.
  Part prompt = Step(1, &a, 30, 30);
  b = a;
  v1::AppendAttendResponse want;
  ASSERT_TRUE(Call(MakeCall(cache_, {prompt}, alibi_sinks_), &want).ok());
  prompt.id = 2;
  inference::ModelInferResponse got;
  grpc::Status s = Infer(prompt, alibi_sinks_, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.raw_output_contents_size(), 2);
  EXPECT_EQ(got.raw_output_contents(0), want.o().data());
  EXPECT_EQ(got.raw_output_contents(1), want.lse().data());
  for (int t = 0; t < 3; ++t) {
    Part step = Step(1, &a, 1, 1);
    b = a;
    ASSERT_TRUE(Call(MakeCall(cache_, {step}, alibi_sinks_), &want).ok());
    step.id = 2;
    s = Infer(step, alibi_sinks_, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(got.raw_output_contents(0), want.o().data());
    EXPECT_TRUE(RowsMatch(got.raw_output_contents(0), got.raw_output_contents(1), 1, 0,
                          step.q.data(), 1, b, alibi_sinks_, true));
  }
  // Sinks alone (gpt-oss).
  const Mods sinks{{}, alibi_sinks_.sinks};
  Part step = Step(2, &b, 1, 1);
  s = Infer(step, sinks, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(RowsMatch(got.raw_output_contents(0), got.raw_output_contents(1), 1, 0, step.q.data(),
                        1, b, sinks, true));
  ASSERT_EQ(Length(2), 34);

  Context scratch = b;
  const Part more = Step(2, &scratch, 1, 1);
  const std::string unsupported =
      ": not supported on K/V calls; use attend_pages for page-level sparsity";
  const struct {
    Mods mods;
    std::vector<std::pair<std::string, std::vector<float>>> extra;
    std::string words;
  } bad[] = {
      {sinks, {{"bias", {0.0f}}}, "inputs['bias']" + unsupported},
      {sinks, {{"mask", {0.0f}}}, "inputs['mask']" + unsupported},
      {Mods{{}, {1, 2}}, {}, "inputs['sinks']: expected Hq = 4 values"},
      {Mods{{1, 2, 3}, {}}, {}, "inputs['alibi_slopes']: expected Hq = 4 values"},
  };
  for (const auto& c : bad) {
    inference::ModelInferResponse out;
    const grpc::Status refused = Infer(more, c.mods, &out, false, c.extra);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.words;
    EXPECT_NE(refused.error_message().find(c.words), std::string::npos) << refused.error_message();
    EXPECT_EQ(Length(2), 34) << c.words;
  }
  {
    inference::ModelInferResponse out;
    const grpc::Status refused = Infer(more, sinks, &out, false, {}, /*block_q=*/true);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(refused.error_message().find("parameters['block_q'] (the block mask)" + unsupported),
              std::string::npos)
        << refused.error_message();
    EXPECT_EQ(Length(2), 34);
  }
  // A refused call's sequence_start creates nothing.
  Context fresh;
  const Part first = Step(7, &fresh, 3, 3);
  inference::ModelInferResponse out;
  const grpc::Status refused = Infer(first, Mods{{}, {1}}, &out, /*start=*/true);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_EQ(Length(7), -1);
}

}  // namespace
}  // namespace attnserve
