// AppendAttend steps over UCX against a real in-process server (CPU backend,
// UCX on loopback with whatever UCX_TLS the environment gives; ctest runs
// this binary with tcp and with shared memory): outputs held to the float64
// reference, refusals answered like gRPC's, hostile frames closing only
// their own connection, the bearer token checked at the hello, and the
// offer in GetServerInfo.
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "client/attention_client.h"
#include "client/ucx_transport.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "server/ucx/frame.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

constexpr char kTokenA[] = "ucx-test-token-aaaaaaaaaaaa";
constexpr char kTokenB[] = "ucx-test-token-bbbbbbbbbbbb";

class UcxStepTest : public KvStepTest {
 protected:
  UcxStepTest() : KvStepTest(20261128) {}

  // A server with UCX on a free port; `tokens`: authentication on.
  void StartServer(bool tokens) {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    o.ucx_port = -1;
    o.max_request_bytes = 4 << 20;
    if (tokens) {
      const std::string path = ::testing::TempDir() + "/ucx_tokens";
      std::ofstream out(path);
      out << kTokenA << " alice\n" << kTokenB << " bob\n";
      o.auth.tokens_file = path;
    }
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->ucx_port(), 0);
    ClientOptions co;
    if (tokens) co.security.token = kTokenA;
    auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", server_->port()), co);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    KvClient kv(*client_);
    CacheSpec spec;
    spec.geometry = {1, kHkv, kD, DType::kFP32};
    spec.page_size = kPage;
    spec.capacity_tokens = 4096;
    absl::StatusOr<v1::CacheStats> stats = kv.CreateCache(spec);
    ASSERT_TRUE(stats.ok()) << stats.status();
    cache_ = stats->cache_id();
    ASSERT_TRUE(kv.CreateSequences(cache_, {{1}, {2}}).ok());
  }

  void SetUp() override {}  // each test starts its own server

  std::unique_ptr<UcxStepConnection> Connect(const std::string& authorization = "") {
    auto c = UcxStepConnection::Connect("127.0.0.1", server_->ucx_port(), authorization,
                                        absl::Seconds(20));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // A prefill of 20 tokens with queries on both sequences, then three decode
  // steps, each over UCX and checked against the reference.
  void RunSteps(UcxStepConnection* ucx) {
    Context a, b;
    std::vector<Part> parts = {Step(1, &a, 20, 20), Step(2, &b, 7, 7)};
    v1::AppendAttendRequest r = MakeCall(cache_, parts);
    absl::StatusOr<v1::AppendAttendResponse> resp = ucx->AppendAttend(&r, absl::Seconds(20));
    ASSERT_TRUE(resp.ok()) << resp.status();
    CheckResponse(*resp, parts, {&a, &b}, Mods());
    for (int t = 0; t < 3; ++t) {
      parts = {Step(1, &a, 1, 1), Step(2, &b, 1, 1)};
      r = MakeCall(cache_, parts);
      resp = ucx->AppendAttend(&r, absl::Seconds(20));
      ASSERT_TRUE(resp.ok()) << resp.status();
      CheckResponse(*resp, parts, {&a, &b}, Mods());
    }
    EXPECT_EQ(Length(1, true), a.length());
  }

  void TearDown() override {
    client_.reset();
    KvStepTest::TearDown();
  }

  std::unique_ptr<AttentionClient> client_;
};

TEST_F(UcxStepTest, ServerOffersUcxAndStepsMatchTheReference) {
  StartServer(false);
  const UcxOffer offer = AskUcxOffer(*client_);
  EXPECT_EQ(offer.port, server_->ucx_port()) << offer.why_not;
  EXPECT_EQ(offer.host, "127.0.0.1");
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                     grpc::InsecureChannelCredentials());
  stub_ = v1::KvCache::NewStub(channel);
  std::unique_ptr<UcxStepConnection> ucx = Connect();
  ASSERT_NE(ucx, nullptr);
  RunSteps(ucx.get());
}

TEST_F(UcxStepTest, TaggedAndStreamStepsMatchTheReferenceOnOneConnection) {
  StartServer(false);
  stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                   grpc::InsecureChannelCredentials()));
  std::unique_ptr<UcxStepConnection> ucx = Connect();
  ASSERT_NE(ucx, nullptr);
  Context a, b;
  // A large prefill (160 KiB of q, k and v) tagged, then decode steps
  // alternating between tagged payloads (threshold 0) and the stream (-1).
  ucx->set_tagged_bytes(64 << 10);
  std::vector<Part> parts = {Step(1, &a, 300, 300), Step(2, &b, 100, 100)};
  v1::AppendAttendRequest r = MakeCall(cache_, parts);
  absl::StatusOr<v1::AppendAttendResponse> resp = ucx->AppendAttend(&r, absl::Seconds(20));
  ASSERT_TRUE(resp.ok()) << resp.status();
  CheckResponse(*resp, parts, {&a, &b}, Mods());
  EXPECT_EQ(ucx->tagged_steps(), 1);
  for (int t = 0; t < 6; ++t) {
    ucx->set_tagged_bytes(t % 2 == 0 ? 0 : -1);
    parts = {Step(1, &a, 1 + t, 1 + t), Step(2, &b, 2, 1)};
    r = MakeCall(cache_, parts);
    resp = ucx->AppendAttend(&r, absl::Seconds(20));
    ASSERT_TRUE(resp.ok()) << resp.status();
    CheckResponse(*resp, parts, {&a, &b}, Mods());
  }
  EXPECT_EQ(ucx->tagged_steps(), 4);
  // A small step under the threshold stays on the stream.
  ucx->set_tagged_bytes(64 << 10);
  parts = {Step(1, &a, 1, 1)};
  r = MakeCall(cache_, parts);
  resp = ucx->AppendAttend(&r, absl::Seconds(20));
  ASSERT_TRUE(resp.ok()) << resp.status();
  CheckResponse(*resp, parts, {&a}, Mods());
  EXPECT_EQ(ucx->tagged_steps(), 4);
  EXPECT_EQ(Length(1, true), a.length());
}

TEST_F(UcxStepTest, RefusalsCarryTheGrpcCodeAndMessageAndTheConnectionGoesOn) {
  StartServer(false);
  stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                   grpc::InsecureChannelCredentials()));
  std::unique_ptr<UcxStepConnection> ucx = Connect();
  ASSERT_NE(ucx, nullptr);
  Context a;
  std::vector<Part> parts = {Step(1, &a, 3, 1)};
  parts[0].expected = 5;  // the sequence is empty
  v1::AppendAttendRequest r = MakeCall(cache_, parts);
  v1::AppendAttendResponse grpc_resp;
  const grpc::Status grpc_status = Call(r, &grpc_resp);
  absl::StatusOr<v1::AppendAttendResponse> resp = ucx->AppendAttend(&r, absl::Seconds(20));
  ASSERT_FALSE(resp.ok());
  EXPECT_EQ(static_cast<int>(resp.status().code()), static_cast<int>(grpc_status.error_code()));
  EXPECT_EQ(std::string(resp.status().message()), grpc_status.error_message());
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kFailedPrecondition);
  // q's payload one row short of its shape: the core names q, as for gRPC.
  parts[0].expected = 0;
  r = MakeCall(cache_, parts);
  r.mutable_q()->mutable_data()->resize(r.q().data().size() - kQRow * 4);
  const grpc::Status grpc_short = Call(r, &grpc_resp);
  resp = ucx->AppendAttend(&r, absl::Seconds(20));
  ASSERT_FALSE(resp.ok());
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(resp.status().message()), grpc_short.error_message());
  EXPECT_NE(std::string(resp.status().message()).find("q"), std::string::npos);
  EXPECT_EQ(Length(1), 0);  // nothing appended
  EXPECT_FALSE(ucx->broken());
  RunSteps(ucx.get());
}

// A frame whose sizes break the limits is answered naming the field and
// closes that connection only; others, and gRPC, go on.
TEST_F(UcxStepTest, BadFrameSizesCloseOnlyThatConnection) {
  StartServer(false);
  stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                   grpc::InsecureChannelCredentials()));
  std::unique_ptr<UcxStepConnection> good = Connect();
  std::unique_ptr<UcxStepConnection> bad = Connect();
  ASSERT_NE(good, nullptr);
  ASSERT_NE(bad, nullptr);
  ucx::FramePrefix p;
  p.type = ucx::FrameType::kStep;
  p.header_bytes = 16;
  p.payload_bytes = {uint64_t{8} << 20, 0, 0, 0};  // over --max_request_bytes (4 MiB)
  absl::StatusOr<v1::AppendAttendResponse> r =
      bad->SendRawAndRead(ucx::EncodePrefix(p), absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->error_code(), 3);  // INVALID_ARGUMENT
  EXPECT_NE(r->error_message().find("payload_bytes[0] (q): expected at most 4194304"),
            std::string::npos)
      << r->error_message();
  // The server closed that connection.
  v1::AppendAttendRequest step = MakeCall(cache_, {});
  absl::StatusOr<v1::AppendAttendResponse> after = bad->AppendAttend(&step, absl::Seconds(5));
  EXPECT_FALSE(after.ok());
  // Random garbage on a third connection: refused naming magic, closed too.
  std::unique_ptr<UcxStepConnection> garbage = Connect();
  ASSERT_NE(garbage, nullptr);
  std::mt19937_64 rng(5);
  std::string bytes(ucx::kPrefixBytes + 100, '\0');
  for (char& c : bytes) c = static_cast<char>(rng() & 0xff);
  r = garbage->SendRawAndRead(bytes, absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->error_message().find("magic"), std::string::npos) << r->error_message();
  RunSteps(good.get());
  EXPECT_EQ(Length(2), 10);  // gRPC serves as before
}

TEST_F(UcxStepTest, ASecondHelloIsRefused) {
  StartServer(false);
  std::unique_ptr<UcxStepConnection> c = Connect();
  ASSERT_NE(c, nullptr);
  ucx::FramePrefix hello;
  hello.type = ucx::FrameType::kHello;
  absl::StatusOr<v1::AppendAttendResponse> r =
      c->SendRawAndRead(ucx::EncodePrefix(hello), absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->error_message().find("type: expected 3 (step) after the connection's hello"),
            std::string::npos)
      << r->error_message();
}

TEST_F(UcxStepTest, BearerTokenIsCheckedAtTheHelloAndTenantsStayApart) {
  StartServer(true);
  auto refused = UcxStepConnection::Connect("127.0.0.1", server_->ucx_port(),
                                            "Bearer not-a-token-of-this-server", absl::Seconds(20));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  auto none = UcxStepConnection::Connect("127.0.0.1", server_->ucx_port(), "", absl::Seconds(20));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated) << none.status();
  // Bob cannot see Alice's cache: NOT_FOUND, as over gRPC.
  std::unique_ptr<UcxStepConnection> bob = Connect(absl::StrCat("Bearer ", kTokenB));
  ASSERT_NE(bob, nullptr);
  Context a;
  std::vector<Part> parts = {Step(1, &a, 2, 1)};
  v1::AppendAttendRequest r = MakeCall(cache_, parts);
  absl::StatusOr<v1::AppendAttendResponse> resp = bob->AppendAttend(&r, absl::Seconds(20));
  ASSERT_FALSE(resp.ok());
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kNotFound) << resp.status();
  std::unique_ptr<UcxStepConnection> alice = Connect(absl::StrCat("Bearer ", kTokenA));
  ASSERT_NE(alice, nullptr);
  resp = alice->AppendAttend(&r, absl::Seconds(20));
  ASSERT_TRUE(resp.ok()) << resp.status();
  CheckResponse(*resp, parts, {&a}, Mods());
}

TEST(UcxOfferTest, ServerWithoutUcxOffersNone) {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  auto server = AttnServer::Create(o, MakeCpuBackend(1));
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_EQ((*server)->ucx_port(), 0);
  auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", (*server)->port()));
  ASSERT_TRUE(client.ok());
  const UcxOffer offer = AskUcxOffer(**client);
  EXPECT_EQ(offer.port, 0);
  EXPECT_NE(offer.why_not.find("offers no UCX"), std::string::npos) << offer.why_not;
  (*server)->Shutdown(absl::Seconds(1));
}

TEST(UcxOfferTest, HostOfTarget) {
  EXPECT_EQ(HostOfTarget("localhost:50051"), "localhost");
  EXPECT_EQ(HostOfTarget("dns:///10.0.0.2:50051"), "10.0.0.2");
  EXPECT_EQ(HostOfTarget("ipv4:127.0.0.1:1,127.0.0.2:2"), "127.0.0.1");
  EXPECT_EQ(HostOfTarget("ipv6:[::1]:50051"), "::1");
  EXPECT_EQ(HostOfTarget("unix:///tmp/s"), "");
}

}  // namespace
}  // namespace attnserve
