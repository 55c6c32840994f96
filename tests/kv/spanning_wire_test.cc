// A cache that spans devices over the wire: a server on two CPU devices
// (--cpu_devices=2), CreateCache with `devices`, a sequence longer than one
// device's pool prefilled and decoded through the native K/V service, every
// response against the float64 reference; what a spanning cache refuses
// comes back INVALID_ARGUMENT naming the field.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

constexpr int64_t kPageBytes = 2 * int64_t{kPage} * kKvRow * 4;  // FP32 K and V

class SpanningWireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = 11 * kPageBytes;  // 10 pages a device, and bookkeeping
    o.kv_page_size = kPage;
    o.backend.kind = "cpu";
    o.backend.cpu_devices = 2;
    o.backend.cpu_threads = 2;
    auto server = AttnServer::Create(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                     grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  grpc::Status CreateCache(const std::vector<int32_t>& devices, std::optional<int32_t> device,
                           v1::CreateCacheResponse* resp, int64_t pages = 16) {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_page_size(kPage);
    r.set_capacity_tokens(pages * kPage);  // split over the devices
    for (int32_t d : devices) r.add_devices(d);
    if (device.has_value()) r.set_device(*device);
    return stub_->CreateCache(&ctx, r, resp);
  }

  // A part appending `n` random tokens with `nq` queries; `ctx` gains them.
  Part MakePart(uint64_t id, Context* ctx, int n, int nq) {
    Part p;
    p.id = id;
    p.expected = ctx->length();
    p.k = Random(&rng_, n * kKvRow);
    p.v = Random(&rng_, n * kKvRow);
    p.q = Random(&rng_, nq * kQRow);
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    return p;
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::mt19937 rng_{5};
};

TEST_F(SpanningWireTest, LongerThanOneDevicesPoolOverTheWire) {
  v1::CreateCacheResponse created;
  ASSERT_TRUE(CreateCache({0, 1}, std::nullopt, &created).ok());
  const std::string cache = created.stats().cache_id();
  EXPECT_EQ(created.stats().capacity_pages(), 16);
  {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    r.add_sequences()->set_sequence_id(1);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(stub_->CreateSequences(&ctx, r, &resp).ok());
  }
  Context seq;
  auto call = [&](int n, int nq) {
    std::vector<Part> parts = {MakePart(1, &seq, n, nq)};
    grpc::ClientContext ctx;
    v1::AppendAttendResponse resp;
    const grpc::Status s = stub_->AppendAttend(&ctx, MakeCall(cache, parts), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    CheckResponse(resp, parts, {&seq}, Mods{});
  };
  call(96, 96);  // a causal prefill chunk
  for (int i = 0; i < 4; ++i) call(8, 8);
  while (seq.length() < 200) call(1, 1);  // past one device's 160 tokens
  grpc::ClientContext ctx;
  v1::GetCacheStatsRequest r;
  r.set_cache_id(cache);
  v1::GetCacheStatsResponse stats;
  ASSERT_TRUE(stub_->GetCacheStats(&ctx, r, &stats).ok());
  EXPECT_EQ(stats.stats().pages_used(), 13);  // 8 on device 0, 5 on device 1
  EXPECT_EQ(stats.stats().tokens(), 200);

  // A window is refused by name and appends nothing.
  std::vector<Part> parts = {MakePart(1, &seq, 1, 1)};
  v1::AppendAttendRequest windowed = MakeCall(cache, parts);
  windowed.mutable_options()->set_window_left(4);
  grpc::ClientContext wctx;
  v1::AppendAttendResponse resp;
  const grpc::Status refused = stub_->AppendAttend(&wctx, windowed, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("options.window_left"), std::string::npos)
      << refused.error_message();
}

TEST_F(SpanningWireTest, DeviceListsAreChecked) {
  v1::CreateCacheResponse resp;
  grpc::Status s = CreateCache({0, 1}, 0, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("device, devices"), std::string::npos) << s.error_message();
  s = CreateCache({1, 2}, std::nullopt, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("devices[1]"), std::string::npos) << s.error_message();
  // More than one device's budget holds needs two.
  s = CreateCache({1}, std::nullopt, &resp, 16);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  // One device listed: a cache on that device alone.
  s = CreateCache({1}, std::nullopt, &resp, 8);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.stats().device(), 1);
}

}  // namespace
}  // namespace attnserve
