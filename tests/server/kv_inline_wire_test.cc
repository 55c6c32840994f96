// K/V steps over the wire on a server whose idle device runs small calls on
// the receiving gRPC thread (ServerOptions::inline_max_cost, as the binary
// runs): unary and pipelined stream steps are answered from inside the
// front-end's start and still match the float64 reference, in order.
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "common/cache_id_header.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

class KvInlineWireTest : public KvStepTest {
 protected:
  KvInlineWireTest() : KvStepTest(29) {}

  // KvStepTest's server and cache, with calls run inline.
  void SetUp() override {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    o.inline_max_cost = int64_t{1} << 22;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel);
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
  }
};

TEST_F(KvInlineWireTest, UnaryStepsMatchTheReference) {
  CreateSequences({1, 2});
  Context a, b;
  int waited = 0;
  for (int step = 0; step < 12; ++step) {
    const int n = step == 0 ? 20 : 1;  // a prefill, then decode steps
    std::vector<Part> parts = {Step(1, &a, n, n), Step(2, &b, n + 3, 2)};
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(MakeCall(cache_, parts), &resp).ok());
    CheckResponse(resp, parts, {&a, &b}, {});
    // A call handed to the launcher waits at least for its wake-up.
    if (resp.timing().queue_us() > 0) ++waited;
  }
  EXPECT_LE(waited, 6) << "most steps start where they were received";
  EXPECT_EQ(Length(1), a.length());
  EXPECT_EQ(Length(2), b.length());
}

TEST_F(KvInlineWireTest, PipelinedStreamStepsApplyInOrderAndMatchTheReference) {
  constexpr int kCalls = 40;
  CreateSequences({1});
  grpc::ClientContext sctx;
  sctx.AddMetadata(kCacheIdHeader, cache_);
  auto stream = stub_->AppendAttendStream(&sctx);
  std::vector<v1::AppendAttendResponse> responses;
  std::thread reader([&] {
    v1::AppendAttendResponse resp;
    while (stream->Read(&resp)) responses.push_back(resp);
  });
  Context ctx;
  std::vector<Part> parts;
  std::vector<Context> seen;  // the context each call attends
  for (int i = 0; i < kCalls; ++i) {
    parts.push_back(Step(1, &ctx, 1, 1));
    seen.push_back(ctx);
    v1::AppendAttendRequest r = MakeCall(cache_, {parts.back()});
    r.set_request_id(absl::StrCat(i));
    if (!stream->Write(r)) break;
  }
  stream->WritesDone();
  reader.join();
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(responses.size(), size_t{kCalls});
  for (const v1::AppendAttendResponse& resp : responses) {
    ASSERT_EQ(resp.error_code(), 0) << resp.request_id() << ": " << resp.error_message();
    const int i = std::stoi(resp.request_id());
    ASSERT_EQ(resp.lengths_size(), 1);
    EXPECT_EQ(resp.lengths(0), i + 1);
    CheckResponse(resp, {parts[size_t(i)]}, {&seen[size_t(i)]}, {});
  }
}

}  // namespace
}  // namespace attnserve
