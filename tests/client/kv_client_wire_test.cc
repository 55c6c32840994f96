// KvClient's side of the wire, against a recording KvCache service in this
// process: every call carries the x-attnserve-cache-id header, a server error
// arrives with its code and message intact, the stream matches out-of-order
// responses by request_id and fails what a broken stream leaves unanswered,
// and a response that breaks the contract is INTERNAL. (The real service's
// behaviour is kv_client_test.cc's subject.)
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/inputs.h"
#include "client/kv_client.h"
#include "common/tensor_wire_slices.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records each call's method and cache-id header; answers with `fail` when
// set, else with stats naming the cache, and AppendAttend with o = q (the
// shape the contract asks for) unless `wrong_o` is set.
class RecordingKvService final : public v1::KvCache::Service {
 public:
  grpc::Status fail = grpc::Status::OK;
  bool wrong_o = false;
  // Stream: answer after this many requests, in reverse order.
  int stream_batch = 3;
  // Stream: after reading this many requests, end with UNAVAILABLE unanswered.
  int stream_break_after = -1;

  std::vector<std::pair<std::string, std::string>> Calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // The last unary AppendAttend as this (generated, typed) service parsed it.
  v1::AppendAttendRequest LastAppend() {
    absl::MutexLock lock(&mu_);
    return last_append_;
  }

  grpc::Status CreateCache(grpc::ServerContext* ctx, const v1::CreateCacheRequest* req,
                           v1::CreateCacheResponse* resp) override {
    Record("CreateCache", ctx);
    resp->mutable_stats()->set_cache_id(req->cache_id().empty() ? "chosen" : req->cache_id());
    return fail;
  }
  grpc::Status DropCache(grpc::ServerContext* ctx, const v1::DropCacheRequest*,
                         v1::DropCacheResponse*) override {
    Record("DropCache", ctx);
    return fail;
  }
  grpc::Status CreateSequences(grpc::ServerContext* ctx, const v1::CreateSequencesRequest* req,
                               v1::CreateSequencesResponse* resp) override {
    Record("CreateSequences", ctx);
    resp->mutable_stats()->set_sequences(req->sequences_size());
    return fail;
  }
  grpc::Status Truncate(grpc::ServerContext* ctx, const v1::TruncateRequest* req,
                        v1::TruncateResponse* resp) override {
    Record("Truncate", ctx);
    resp->mutable_stats()->set_tokens(req->length() + (req->has_layer() ? 1000 : 0));
    return fail;
  }
  grpc::Status FreeSequences(grpc::ServerContext* ctx, const v1::FreeSequencesRequest* req,
                             v1::FreeSequencesResponse* resp) override {
    Record("FreeSequences", ctx);
    resp->mutable_stats()->set_sequences(req->sequence_ids_size());
    return fail;
  }
  grpc::Status GetCacheStats(grpc::ServerContext* ctx, const v1::GetCacheStatsRequest* req,
                             v1::GetCacheStatsResponse* resp) override {
    Record("GetCacheStats", ctx);
    resp->mutable_stats()->set_cache_id(req->cache_id());
    for (uint64_t id : req->sequence_ids()) resp->add_sequences()->set_sequence_id(id);
    return fail;
  }
  grpc::Status AppendAttend(grpc::ServerContext* ctx, const v1::AppendAttendRequest* req,
                            v1::AppendAttendResponse* resp) override {
    Record("AppendAttend", ctx);
    {
      absl::MutexLock lock(&mu_);
      last_append_ = *req;
    }
    Answer(*req, resp);
    return fail;
  }
  grpc::Status AppendAttendStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::AppendAttendResponse, v1::AppendAttendRequest>* stream)
      override {
    Record("AppendAttendStream", ctx);
    std::vector<v1::AppendAttendRequest> batch;
    v1::AppendAttendRequest req;
    int read = 0;
    auto flush = [&] {
      std::reverse(batch.begin(), batch.end());
      for (const v1::AppendAttendRequest& r : batch) {
        v1::AppendAttendResponse resp;
        if (r.layer() == 99) {
          resp.set_request_id(r.request_id());
          resp.set_error_code(grpc::StatusCode::INVALID_ARGUMENT);
          resp.set_error_message("layer must be in [0, 2), got 99");
        } else {
          Answer(r, &resp);
        }
        stream->Write(resp);
      }
      batch.clear();
    };
    while (stream->Read(&req)) {
      if (++read == stream_break_after) return grpc::Status(grpc::UNAVAILABLE, "draining");
      batch.push_back(req);
      if (static_cast<int>(batch.size()) == stream_batch) flush();
    }
    flush();
    return grpc::Status::OK;
  }

 private:
  void Record(const std::string& method, grpc::ServerContext* ctx) {
    const auto& md = ctx->client_metadata();
    auto it = md.find(kCacheIdHeader);
    absl::MutexLock lock(&mu_);
    calls_.emplace_back(
        method, it == md.end() ? "<none>" : std::string(it->second.data(), it->second.size()));
  }
  void Answer(const v1::AppendAttendRequest& req, v1::AppendAttendResponse* resp) {
    resp->set_request_id(req.request_id());
    *resp->mutable_o() = req.q();
    if (req.q().shape_size() == 0) {
      // As the real service answers a call without queries: O of no rows.
      resp->mutable_o()->set_dtype(req.k().dtype());
      for (int64_t d : {int64_t{0}, req.k().shape(1), req.k().shape(2)}) {
        resp->mutable_o()->add_shape(d);
      }
    }
    if (wrong_o) resp->mutable_o()->mutable_shape()->Set(0, req.q().shape(0) + 1);
    for (const v1::SequenceStep& s : req.sequences()) {
      resp->add_lengths(s.expected_length() + s.num_new_tokens());
    }
    resp->set_backend("recording");
  }

  absl::Mutex mu_;
  std::vector<std::pair<std::string, std::string>> calls_ ABSL_GUARDED_BY(mu_);
  v1::AppendAttendRequest last_append_ ABSL_GUARDED_BY(mu_);
};

class KvClientWireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", port));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    kv_ = std::make_unique<KvClient>(*client_);
  }
  void TearDown() override {
    kv_.reset();
    client_.reset();
    server_->Shutdown();
  }

  // One decode step for sequences 1 and 2 at `layer`: q [2, 4, 8], k/v [2, 2, 8].
  AppendAttendInputs Step(int layer, uint64_t seed) {
    std::mt19937_64 rng(seed);
    AppendAttendInputs in;
    in.cache_id = "c1";
    in.layer = layer;
    in.sequences = {{1, 5, 1, 1}, {2, 7, 1, 1}};
    in.q = RandomTensor(DType::kFP16, {2, 4, 8}, &rng);
    in.k = RandomTensor(DType::kFP16, {2, 2, 8}, &rng);
    in.v = RandomTensor(DType::kFP16, {2, 2, 8}, &rng);
    return in;
  }

  RecordingKvService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<AttentionClient> client_;
  std::unique_ptr<KvClient> kv_;
};

TEST_F(KvClientWireTest, EveryCallCarriesTheCacheIdHeader) {
  CacheSpec spec;
  spec.cache_id = "c1";
  spec.capacity_tokens = 64;
  ASSERT_TRUE(kv_->CreateCache(spec).ok());
  EXPECT_EQ(kv_->CreateSequences("c1", {{1}, {2, 1, 3}})->sequences(), 2);
  ASSERT_TRUE(kv_->AppendAttend(Step(0, 1)).ok());
  EXPECT_EQ(kv_->Truncate("c1", 1, 4, std::nullopt)->tokens(), 4);
  EXPECT_EQ(kv_->Truncate("c1", 1, 4, 1)->tokens(), 1004);  // the layer travels
  EXPECT_EQ(kv_->FreeSequences("c1", {1, 2})->sequences(), 2);
  EXPECT_EQ(kv_->GetCacheStats("c1", {7})->sequences(0).sequence_id(), 7u);
  std::promise<absl::StatusOr<v1::AppendAttendResponse>> async;
  kv_->AppendAttendAsync(MakeAppendAttendRequest(Step(1, 2)), CallOptions(),
                         [&](absl::StatusOr<v1::AppendAttendResponse> r) { async.set_value(r); });
  ASSERT_TRUE(async.get_future().get().ok());
  {
    auto stream = kv_->OpenStream("c1");
    ASSERT_TRUE(stream.ok()) << stream.status();
    EXPECT_TRUE((*stream)->Finish().ok());
  }
  EXPECT_TRUE(kv_->DropCache("c1").ok());
  // Without an id, the typed call picks one so even CreateCache routes; the
  // raw call leaves the choice to the server and has nothing to route by.
  CacheSpec unnamed;
  unnamed.capacity_tokens = 64;
  const auto picked = kv_->CreateCache(unnamed);
  ASSERT_TRUE(picked.ok());
  EXPECT_THAT(picked->cache_id(), ::testing::MatchesRegex("c-[0-9a-f]{16}"));
  EXPECT_EQ(kv_->CreateCache(MakeCreateCacheRequest(unnamed))->cache_id(), "chosen");

  const auto calls = service_.Calls();
  ASSERT_EQ(calls.size(), 12u);
  for (size_t i = 0; i + 2 < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, "c1") << calls[i].first;
  }
  EXPECT_EQ(calls[10].second, picked->cache_id());
  EXPECT_EQ(calls[11].second, "<none>");
}

TEST_F(KvClientWireTest, ServerErrorsKeepCodeAndMessage) {
  service_.fail = grpc::Status(grpc::NOT_FOUND, "cache 'c1' not found: create it and re-prefill");
  const std::vector<absl::Status> statuses = {
      kv_->CreateCache(CacheSpec{}).status(),     kv_->DropCache("c1"),
      kv_->CreateSequences("c1", {{1}}).status(), kv_->Truncate("c1", 1, 0, std::nullopt).status(),
      kv_->FreeSequences("c1", {1}).status(),     kv_->GetCacheStats("c1").status(),
      kv_->AppendAttend(Step(0, 1)).status(),
  };
  for (const absl::Status& st : statuses) {
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_EQ(st.message(), "cache 'c1' not found: create it and re-prefill");
  }
}

TEST_F(KvClientWireTest, StreamMatchesOutOfOrderResponsesByRequestId) {
  auto stream = kv_->OpenStream("c1");
  ASSERT_TRUE(stream.ok()) << stream.status();
  // Three requests in flight at once; the service answers them in reverse.
  std::vector<AppendAttendInputs> inputs = {Step(0, 1), Step(1, 2), Step(0, 3)};
  std::vector<std::promise<absl::StatusOr<v1::AppendAttendResponse>>> done(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*stream)
                    ->Send(MakeAppendAttendRequest(inputs[i]),
                           [&, i](absl::StatusOr<v1::AppendAttendResponse> r) {
                             done[i].set_value(std::move(r));
                           })
                    .ok());
  }
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::AppendAttendResponse> r = done[i].get_future().get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->o().data(), inputs[i].q.bytes()) << "request " << i;
    EXPECT_THAT(r->lengths(), ElementsAre(6, 8));
  }
  // A failed request fails alone; the typed Call decodes and checks.
  AppendAttendInputs bad = Step(99, 4);
  std::promise<absl::StatusOr<AppendAttendResult>> bad_result;
  std::thread bad_thread([&] { bad_result.set_value((*stream)->Call(bad)); });
  std::promise<absl::StatusOr<AppendAttendResult>> good_result;
  std::thread good_thread([&] { good_result.set_value((*stream)->Call(Step(1, 5))); });
  auto good = good_result.get_future();
  auto failed = bad_result.get_future();
  // The service answers once three are in: the third is this one.
  absl::StatusOr<AppendAttendResult> third = (*stream)->Call(Step(0, 6));
  bad_thread.join();
  good_thread.join();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_THAT(third->lengths, ElementsAre(6, 8));
  absl::StatusOr<AppendAttendResult> g = good.get();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->o.bytes(), Step(1, 5).q.bytes());
  absl::StatusOr<AppendAttendResult> f = failed.get();
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), HasSubstr("got 99"));
  EXPECT_TRUE((*stream)->Finish().ok());
}

TEST_F(KvClientWireTest, StreamRefusesForeignCacheAndDuplicateIds) {
  auto stream = kv_->OpenStream("c1");
  ASSERT_TRUE(stream.ok());
  v1::AppendAttendRequest other = MakeAppendAttendRequest(Step(0, 1));
  other.set_cache_id("c2");
  EXPECT_EQ((*stream)->Send(other, [](auto) {}).code(), absl::StatusCode::kInvalidArgument);
  v1::AppendAttendRequest named = MakeAppendAttendRequest(Step(0, 1));
  named.set_request_id("r1");
  std::promise<void> answered;
  ASSERT_TRUE((*stream)->Send(named, [&](auto) { answered.set_value(); }).ok());
  const absl::Status dup = (*stream)->Send(named, [](auto) {});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.message(), HasSubstr("'r1' is already in flight"));
  EXPECT_TRUE((*stream)->Finish().ok());  // flushes the one pending request
  answered.get_future().get();
}

TEST_F(KvClientWireTest, BrokenStreamFailsWhatIsPending) {
  service_.stream_batch = 100;  // never answers before the break
  service_.stream_break_after = 3;
  auto stream = kv_->OpenStream("c1");
  ASSERT_TRUE(stream.ok());
  std::vector<std::promise<absl::Status>> done(2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*stream)
                    ->Send(MakeAppendAttendRequest(Step(0, i)),
                           [&, i](absl::StatusOr<v1::AppendAttendResponse> r) {
                             done[i].set_value(r.status());
                           })
                    .ok());
  }
  const absl::StatusOr<AppendAttendResult> third = (*stream)->Call(Step(0, 7));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kUnavailable);
  for (auto& d : done) EXPECT_EQ(d.get_future().get().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*stream)->Finish().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*stream)->in_flight(), 0);
}

TEST_F(KvClientWireTest, AppendOnlyCallLeavesQUnset) {
  AppendAttendInputs in = Step(0, 1);
  in.q = HostTensor();  // no queries: append only
  in.sequences = {{1, 5, 1, 0}, {2, 7, 1, 0}};
  EXPECT_FALSE(MakeAppendAttendRequest(in).has_q());
  const absl::StatusOr<AppendAttendResult> r = kv_->AppendAttend(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->o.num_elements(), 0);
  EXPECT_THAT(r->lengths, ElementsAre(6, 8));
}

TEST_F(KvClientWireTest, ResponseOfTheWrongShapeIsInternal) {
  service_.wrong_o = true;
  const absl::StatusOr<AppendAttendResult> r = kv_->AppendAttend(Step(0, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(r.status().message(), HasSubstr("FP16[3, 4, 8]"));
}

// The unary call sends q, k and v as slices after the message's encoding
// (common/tensor_wire_slices.h): a stock parser reads exactly the request the
// one-piece encoding carries, and the caller's request keeps its shapes.
TEST_F(KvClientWireTest, TensorBytesTravelAsSlicesAndParseAsOneMessage) {
  const AppendAttendInputs in = Step(3, 7);
  const v1::AppendAttendRequest want = MakeAppendAttendRequest(in);
  v1::AppendAttendRequest sent = want;
  const absl::StatusOr<v1::AppendAttendResponse> r = kv_->AppendAttend(&sent);
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::AppendAttendRequest got = service_.LastAppend();
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  EXPECT_EQ(got.k().data(), in.k.bytes());
  EXPECT_EQ(got.v().data(), in.v.bytes());
  EXPECT_EQ(r->o().data(), in.q.bytes());  // the recording service answers o = q
  // Moved onto the wire; everything else stays.
  EXPECT_TRUE(sent.q().data().empty());
  EXPECT_THAT(sent.q().shape(), ElementsAre(2, 4, 8));
  EXPECT_EQ(sent.sequences_size(), 2);
  // The typed call sends the same way and checks the answer's shapes.
  const absl::StatusOr<AppendAttendResult> typed = kv_->AppendAttend(in);
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(typed->o.bytes(), in.q.bytes());
  EXPECT_EQ(service_.LastAppend().SerializeAsString(), want.SerializeAsString());
}

// The encoding itself: a response with o and lse (the server's side), an
// empty tensor skipped, parsed back whole.
TEST(TensorWireSlicesTest, ParsesBackToTheSameMessage) {
  std::mt19937_64 rng(11);
  v1::AppendAttendResponse want;
  want.set_request_id("r1");
  RandomTensor(DType::kBF16, {3, 4, 16}, &rng).CopyToProto(want.mutable_o());
  RandomTensor(DType::kFP32, {4, 3}, &rng).CopyToProto(want.mutable_lse());
  want.add_lengths(9);
  want.set_backend("cpu");
  v1::AppendAttendResponse message = want;
  TensorWireSlices tensors;
  tensors.TakeData(v1::AppendAttendResponse::kOFieldNumber, message.mutable_o()->mutable_data());
  tensors.TakeData(v1::AppendAttendResponse::kLseFieldNumber,
                   message.mutable_lse()->mutable_data());
  EXPECT_TRUE(message.o().data().empty());
  grpc::ByteBuffer wire = tensors.Encode(message);
  v1::AppendAttendResponse got;
  ASSERT_TRUE(grpc::SerializationTraits<v1::AppendAttendResponse>::Deserialize(&wire, &got).ok());
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
}

}  // namespace
}  // namespace attnserve
