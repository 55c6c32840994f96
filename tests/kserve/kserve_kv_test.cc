// attention_kv over the wire on a real in-process AttnServer (CPU backend):
// a prefill-and-decode loop over two layers sent twice, once through the
// native KvCache.AppendAttend and once through KServe v2 ModelInfer (with
// sequence_start / sequence_end and the cache named by the
// x-attnserve-cache-id header), gives the same o and lse bytes at every step;
// sequence_end frees the sequence.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnserve/v1/kv.grpc.pb.h"
#include "common/dtype.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"

namespace attnserve {
namespace {

constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 32;
constexpr char kCache[] = "kv-v2-test";

// Deterministic FP32 rows [rows, heads, kD].
std::string Rows(int rows, int heads, int seed) {
  std::string bytes(size_t(rows) * heads * kD * 4, '\0');
  for (size_t i = 0; i < bytes.size() / 4; ++i) {
    const float f = static_cast<float>((i * 37 + seed * 11) % 29) / 14.0f - 1.0f;
    std::memcpy(&bytes[i * 4], &f, 4);
  }
  return bytes;
}

void SetRows(v1::Tensor* t, int rows, int heads, int seed) {
  t->set_dtype(v1::FP32);
  for (int64_t d : {int64_t{rows}, int64_t{heads}, int64_t{kD}}) t->add_shape(d);
  t->set_data(Rows(rows, heads, seed));
}

void AddInput(inference::ModelInferRequest* r, const char* name, int rows, int heads, int seed) {
  auto* in = r->add_inputs();
  in->set_name(name);
  in->set_datatype("FP32");
  for (int64_t d : {int64_t{rows}, int64_t{heads}, int64_t{kD}}) in->add_shape(d);
  r->add_raw_input_contents(Rows(rows, heads, seed));
}

class KserveKvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.backend.kind = "cpu";
    options.backend.cpu_threads = 2;
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    kv_ = v1::KvCache::NewStub(channel);
    v2_ = inference::GRPCInferenceService::NewStub(channel);
    grpc::ClientContext ctx;
    v1::CreateCacheRequest create;
    create.set_cache_id(kCache);
    create.mutable_geometry()->set_num_layers(kLayers);
    create.mutable_geometry()->set_num_heads_kv(kHkv);
    create.mutable_geometry()->set_head_dim(kD);
    create.mutable_geometry()->set_dtype(v1::FP32);
    create.set_page_size(16);
    create.set_capacity_tokens(4096);
    v1::CreateCacheResponse created;
    ASSERT_TRUE(kv_->CreateCache(&ctx, create, &created).ok());
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> kv_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
};

TEST_F(KserveKvTest, DecodeLoopMatchesTheNativeApiBitForBit) {
  {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(kCache);
    r.add_sequences()->set_sequence_id(1);
    v1::CreateSequencesResponse out;
    ASSERT_TRUE(kv_->CreateSequences(&ctx, r, &out).ok());
  }
  const int prompt = 21, steps = 3;
  for (int t = 0; t <= steps; ++t) {
    const int tokens = t == 0 ? prompt : 1;
    for (int layer = 0; layer < kLayers; ++layer) {
      const int seed = t * 10 + layer;
      // Native: sequence 1.
      v1::AppendAttendRequest native;
      native.set_cache_id(kCache);
      native.set_layer(layer);
      v1::SequenceStep* step = native.add_sequences();
      step->set_sequence_id(1);
      step->set_expected_length(t == 0 ? 0 : prompt + t - 1);
      step->set_num_new_tokens(tokens);
      step->set_num_queries(tokens);
      SetRows(native.mutable_q(), tokens, kHq, seed);
      SetRows(native.mutable_k(), tokens, kHkv, seed + 100);
      SetRows(native.mutable_v(), tokens, kHkv, seed + 200);
      native.mutable_options()->set_causal(true);
      native.mutable_options()->set_return_lse(true);
      v1::AppendAttendResponse want;
      grpc::ClientContext native_ctx;
      ASSERT_TRUE(kv_->AppendAttend(&native_ctx, native, &want).ok());

      // KServe v2: sequence 2, the same tensors; created by the first call
      // and freed by the last.
      inference::ModelInferRequest v2;
      v2.set_model_name("attention_kv");
      AddInput(&v2, "q", tokens, kHq, seed);
      AddInput(&v2, "k", tokens, kHkv, seed + 100);
      AddInput(&v2, "v", tokens, kHkv, seed + 200);
      auto& p = *v2.mutable_parameters();
      p["layer"].set_int64_param(layer);
      p["sequence_id"].set_uint64_param(2);
      p["sequence_start"].set_bool_param(t == 0 && layer == 0);
      p["sequence_end"].set_bool_param(t == steps && layer == kLayers - 1);
      p["causal"].set_bool_param(true);
      p["return_lse"].set_bool_param(true);
      inference::ModelInferResponse got;
      grpc::ClientContext v2_ctx;
      v2_ctx.AddMetadata("x-attnserve-cache-id", kCache);
      const grpc::Status st = v2_->ModelInfer(&v2_ctx, v2, &got);
      ASSERT_TRUE(st.ok()) << st.error_message();
      ASSERT_EQ(got.outputs_size(), 2);
      EXPECT_EQ(got.outputs(0).name(), "o");
      EXPECT_EQ(got.raw_output_contents(0), want.o().data()) << "step " << t << " layer " << layer;
      EXPECT_EQ(got.outputs(1).name(), "lse");
      EXPECT_EQ(got.raw_output_contents(1), want.lse().data());
      EXPECT_EQ(got.parameters().at("sequence_length").int64_param(), prompt + t);
      EXPECT_EQ(want.lengths(0), prompt + t);
    }
  }
  // sequence_end freed sequence 2; sequence 1 is still there.
  grpc::ClientContext ctx;
  v1::GetCacheStatsRequest stats;
  stats.set_cache_id(kCache);
  stats.add_sequence_ids(2);
  v1::GetCacheStatsResponse out;
  EXPECT_EQ(kv_->GetCacheStats(&ctx, stats, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx1;
  stats.clear_sequence_ids();
  stats.add_sequence_ids(1);
  ASSERT_TRUE(kv_->GetCacheStats(&ctx1, stats, &out).ok());
  EXPECT_EQ(out.stats().sequences(), 1);
}

}  // namespace
}  // namespace attnserve
