#include "tests/server/kv_step_test_util.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "grpcpp/create_channel.h"

namespace attnserve {

std::vector<float> Random(std::mt19937* rng, int64_t n) {
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& f : x) f = dist(*rng);
  return x;
}

void SetFp32Tensor(v1::Tensor* t, int64_t rows, int64_t heads, std::string data) {
  t->set_dtype(v1::FP32);
  t->add_shape(rows);
  t->add_shape(heads);
  t->add_shape(kD);
  t->set_data(std::move(data));
}

v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 const Mods& mods, bool causal) {
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
  SetFp32Tensor(r.mutable_q(), tq, kHq, q);
  SetFp32Tensor(r.mutable_k(), tk, kHkv, k);
  SetFp32Tensor(r.mutable_v(), tk, kHkv, v);
  v1::AttentionOptions* o = r.mutable_options();
  o->set_causal(causal);
  o->set_return_lse(true);
  for (float s : mods.slopes) o->add_alibi_slopes(s);
  for (float s : mods.sinks) o->add_sinks(s);
  return r;
}

v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 bool causal) {
  return MakeCall(cache, parts, Mods(), causal);
}

::testing::AssertionResult RowsMatch(const std::string& o_bytes, const std::string& lse_bytes,
                                     int64_t total_q, int64_t row0, const float* q, int nq,
                                     const Context& ctx, const Mods& mods, bool causal,
                                     const std::optional<std::vector<int32_t>>& keys_or_all) {
  std::vector<int32_t> keys;
  if (keys_or_all.has_value()) {
    keys = *keys_or_all;
  } else {
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
          return ::testing::AssertionFailure()
                 << "o row " << row0 + i << " head " << h << " [" << d << "]: " << got << " vs "
                 << want_o[d] << " over " << keys.size() << " keys";
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

void CheckResponse(const v1::AppendAttendResponse& resp, const std::vector<Part>& parts,
                   const std::vector<Context*>& ctxs, const Mods& mods, bool causal,
                   const VisibleKeysFn& visible) {
  int64_t total_q = 0;
  for (const Part& p : parts) total_q += int64_t(p.q.size() / kQRow);
  ASSERT_EQ(resp.lengths_size(), int(parts.size()));
  int64_t row0 = 0;
  for (size_t j = 0; j < parts.size(); ++j) {
    EXPECT_EQ(resp.lengths(int(j)), ctxs[j]->length());
    const int nq = int(parts[j].q.size() / kQRow);
    if (visible == nullptr) {
      EXPECT_TRUE(RowsMatch(resp.o().data(), resp.lse().data(), total_q, row0, parts[j].q.data(),
                            nq, *ctxs[j], mods, causal))
          << "sequence " << parts[j].id;
    } else {
      for (int i = 0; i < nq; ++i) {
        // One row over exactly its visible keys: no causal cut left to make.
        EXPECT_TRUE(RowsMatch(resp.o().data(), resp.lse().data(), total_q, row0 + i,
                              parts[j].q.data() + i * kQRow, 1, *ctxs[j], mods, /*causal=*/false,
                              visible(j, i, nq)))
            << "sequence " << parts[j].id << " query " << i;
      }
    }
    row0 += nq;
  }
}

void KvStepTest::SetUp() {
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
  r.set_capacity_tokens(4096);  // 256 pages
  v1::CreateCacheResponse resp;
  ASSERT_TRUE(stub_->CreateCache(&ctx, r, &resp).ok());
  cache_ = resp.stats().cache_id();
}

void KvStepTest::TearDown() {
  if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
}

grpc::Status KvStepTest::Call(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp) {
  grpc::ClientContext ctx;
  return stub_->AppendAttend(&ctx, r, resp);
}

void KvStepTest::CreateSequences(std::vector<uint64_t> ids) {
  grpc::ClientContext ctx;
  v1::CreateSequencesRequest r;
  r.set_cache_id(cache_);
  for (uint64_t id : ids) r.add_sequences()->set_sequence_id(id);
  v1::CreateSequencesResponse resp;
  ASSERT_TRUE(stub_->CreateSequences(&ctx, r, &resp).ok());
}

int32_t KvStepTest::Length(uint64_t id, bool may_be_missing) {
  grpc::ClientContext ctx;
  v1::GetCacheStatsRequest r;
  r.set_cache_id(cache_);
  r.add_sequence_ids(id);
  v1::GetCacheStatsResponse resp;
  const grpc::Status s = stub_->GetCacheStats(&ctx, r, &resp);
  if (!s.ok()) {
    EXPECT_TRUE(may_be_missing) << "sequence " << id << ": " << s.error_message();
    return -1;
  }
  return resp.sequences_size() == 1 && resp.sequences(0).lengths_size() == 1
             ? resp.sequences(0).lengths(0)
             : -1;
}

Part KvStepTest::Step(uint64_t id, Context* ctx, int n, int nq, std::vector<int32_t> pages) {
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

void KvStepTest::ExpectRefused(const v1::AppendAttendRequest& r,
                               const std::vector<std::string>& words, uint64_t id, int32_t length) {
  v1::AppendAttendResponse resp;
  const grpc::Status s = Call(r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  for (const std::string& w : words) {
    EXPECT_NE(s.error_message().find(w), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(Length(id), length) << s.error_message();
}

inference::ModelInferRequest KvStepTest::AttentionKv(const Part& part) const {
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
  auto& p = *r.mutable_parameters();
  p["cache_id"].set_string_param(cache_);
  p["sequence_id"].set_uint64_param(part.id);
  p["causal"].set_bool_param(true);
  p["return_lse"].set_bool_param(true);
  return r;
}

grpc::Status KvStepTest::Infer(const inference::ModelInferRequest& r,
                               inference::ModelInferResponse* out) {
  grpc::ClientContext ctx;
  return v2_->ModelInfer(&ctx, r, out);
}

}  // namespace attnserve
