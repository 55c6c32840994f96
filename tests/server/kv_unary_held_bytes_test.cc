// What a queued unary AppendAttend holds is what it is charged for: the raw
// request bytes are released as soon as they are parsed (not when the call is
// done), and the shared o the runner allocates at admission is charged to the
// tenant's bytes_in_flight beside the request.
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "server/native/kv_service.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

int g_released = 0;
void CountRelease(void* p) {
  ++g_released;
  std::free(p);
}

// The request's slice is freed by the parse itself, not by whoever holds the
// (emptied) buffer afterwards.
TEST(ParseAppendAttendTest, ReleasesTheRawBytesOnceParsed) {
  std::mt19937 rng(7);
  Part part{1, 0, Random(&rng, 8 * kKvRow), Random(&rng, 8 * kKvRow), Random(&rng, 8 * kQRow), {}};
  const std::string wire = MakeCall("c", {part}).SerializeAsString();
  for (bool valid : {true, false}) {
    const std::string bytes = valid ? wire : std::string("\xff\xff\xff", 3);
    void* raw = std::malloc(bytes.size());
    std::memcpy(raw, bytes.data(), bytes.size());
    g_released = 0;
    grpc::Slice slice(raw, bytes.size(), &CountRelease);
    grpc::ByteBuffer buffer(&slice, 1);
    slice = grpc::Slice();  // the buffer holds the only reference
    ASSERT_EQ(g_released, 0);
    v1::AppendAttendRequest request;
    const grpc::Status parsed = ParseAppendAttend(&buffer, &request);
    EXPECT_EQ(parsed.ok(), valid) << parsed.error_message();
    EXPECT_EQ(g_released, 1) << "the raw bytes should be released by the parse (valid=" << valid
                             << ")";
    EXPECT_EQ(buffer.Length(), 0u);
    if (valid) {
      EXPECT_EQ(request.SerializeAsString(), wire);
    }
  }
}

// A server whose one tenant "a" may hold `quota` bytes in flight, with an FP32
// cache of one layer.
class HeldBytesTest : public ::testing::Test {
 protected:
  void Start(int64_t quota) {
    spdlog::set_level(spdlog::level::warn);
    const std::string tokens = ::testing::TempDir() + "/kv_unary_held_bytes_tokens";
    {
      std::ofstream out(tokens);
      out << "tok-a-0123456789abcdef a bytes_in_flight=" << quota << "\n";
    }
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.auth.tokens_file = tokens;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub_ = v1::KvCache::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(
        Auth([&](grpc::ClientContext* ctx) { return stub_->CreateCache(ctx, r, &resp); }).ok());
    cache_ = resp.stats().cache_id();
    v1::CreateSequencesRequest s;
    s.set_cache_id(cache_);
    s.add_sequences()->set_sequence_id(1);
    s.add_sequences()->set_sequence_id(2);
    v1::CreateSequencesResponse sresp;
    ASSERT_TRUE(Auth([&](grpc::ClientContext* ctx) {
                  return stub_->CreateSequences(ctx, s, &sresp);
                }).ok());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }
  template <typename F>
  grpc::Status Auth(F call) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer tok-a-0123456789abcdef");
    return call(&ctx);
  }
  // Sequence `id` (empty) appends `n` tokens with `n` queries.
  v1::AppendAttendRequest Call(uint64_t id, int n) {
    Part part{id, 0, Random(&rng_, n * kKvRow), Random(&rng_, n * kKvRow), Random(&rng_, n * kQRow),
              {}};
    return MakeCall(cache_, {part});
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::string cache_;
  std::mt19937 rng_{11};
};

// o is held from admission until the answer is sent: a call whose request fits
// the quota but whose request and o together do not is refused naming
// bytes_in_flight (before, only the request was charged and it ran), and
// changes nothing; a smaller one within the quota runs.
TEST_F(HeldBytesTest, SharedOIsChargedWithTheRequest) {
  constexpr int kN = 64;
  const int64_t o_bytes = int64_t{kN} * kQRow * 4;
  // The cache id is not known before the server starts: size with one as long.
  const int64_t quota = static_cast<int64_t>(Call(1, kN).ByteSizeLong()) + 64 + o_bytes / 2;
  Start(quota);
  const v1::AppendAttendRequest big = Call(1, kN);
  ASSERT_LT(static_cast<int64_t>(big.ByteSizeLong()), quota);
  ASSERT_GT(static_cast<int64_t>(big.ByteSizeLong()) + o_bytes, quota);
  v1::AppendAttendResponse resp;
  const grpc::Status refused =
      Auth([&](grpc::ClientContext* ctx) { return stub_->AppendAttend(ctx, big, &resp); });
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "bytes_in_flight"))
      << refused.error_message();

  v1::GetCacheStatsRequest stats;
  stats.set_cache_id(cache_);
  stats.add_sequence_ids(1);
  v1::GetCacheStatsResponse stats_resp;
  ASSERT_TRUE(Auth([&](grpc::ClientContext* ctx) {
                return stub_->GetCacheStats(ctx, stats, &stats_resp);
              }).ok());
  ASSERT_EQ(stats_resp.sequences_size(), 1);
  ASSERT_EQ(stats_resp.sequences(0).lengths_size(), 1);
  EXPECT_EQ(stats_resp.sequences(0).lengths(0), 0) << "a refused call appends nothing";

  const v1::AppendAttendRequest small = Call(2, kN / 4);
  const grpc::Status ran =
      Auth([&](grpc::ClientContext* ctx) { return stub_->AppendAttend(ctx, small, &resp); });
  EXPECT_TRUE(ran.ok()) << ran.error_message();
  EXPECT_EQ(resp.o().data().size(), size_t(kN / 4) * kQRow * 4);
}

}  // namespace
}  // namespace attnserve
