// AttentionClient against a real AttnServer (CPU backend, 2 threads) started
// in-process on 127.0.0.1:0: every RPC, every dtype and layout, deadlines,
// error passthrough, several channels and load-balanced targets, and Echo.
#include "client/attention_client.h"

#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class AttentionClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    target_ = server_->target();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  std::unique_ptr<AttentionClient> Client(const ClientOptions& options = ClientOptions()) {
    auto client = AttentionClient::Create(target_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // Runs `shape` with `options` and checks the result against the reference.
  void RunAndVerify(const AttentionShape& shape, const ForwardOptions& options, uint64_t seed) {
    auto inputs = MakeRandomInputs(shape, seed);
    ASSERT_TRUE(inputs.ok()) << inputs.status();
    inputs->options = options;
    auto result = Client()->Forward(*inputs);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->backend, "cpu");
    EXPECT_EQ(result->o.dtype(), OutputDType(shape.dtype));  // BF16 for FP8
    EXPECT_EQ(result->o.shape(), inputs->q.shape());
    EXPECT_EQ(result->lse.has_value(), options.return_lse);
    auto report = VerifyForward(*inputs, *result);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->passed) << report->failure;
    EXPECT_EQ(report->lse_checked, options.return_lse);
  }

  static LoopbackServer* server_;
  static std::string target_;
};

LoopbackServer* AttentionClientTest::server_ = nullptr;
std::string AttentionClientTest::target_;

TEST_F(AttentionClientTest, ForwardEveryDtypeCausalAndNot) {
  uint64_t seed = 100;
  for (DType dtype : {DType::kFP16, DType::kBF16, DType::kFP32}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(absl::StrCat(std::string(DTypeName(dtype)), causal ? " causal" : ""));
      ForwardOptions o;
      o.causal = causal;
      RunAndVerify(DenseAttentionShape(dtype, 2, 17, 33, 4, 4, 64), o, ++seed);
    }
  }
}

TEST_F(AttentionClientTest, ForwardGqaWithLseWindowAndSoftcap) {
  ForwardOptions o;
  o.return_lse = true;
  RunAndVerify(DenseAttentionShape(DType::kBF16, 1, 40, 40, 8, 2, 32), o, 1);  // GQA 4:1
  RunAndVerify(DenseAttentionShape(DType::kFP16, 1, 9, 20, 4, 1, 16), o, 2);   // MQA
  o.causal = true;
  o.window_left = 5;
  o.softcap = 30.0f;
  o.softmax_scale = 0.2f;
  RunAndVerify(DenseAttentionShape(DType::kFP32, 2, 24, 24, 4, 2, 8), o, 3);
}

// FP8 codes with descales through the C++ client: O comes back BF16 and the
// verifier checks it against the float64 reference on the dequantised inputs.
TEST_F(AttentionClientTest, ForwardFp8WithDescales) {
  ForwardOptions o;
  o.return_lse = true;
  o.q_descale = 0.5f;
  o.k_descale = 2.5f;
  o.v_descale = 0.07f;
  RunAndVerify(DenseAttentionShape(DType::kFP8E4M3, 2, 17, 33, 4, 2, 64), o, 11);
  o.causal = true;
  RunAndVerify(DenseAttentionShape(DType::kFP8E4M3, 1, 40, 40, 8, 2, 32), o, 12);
}

TEST_F(AttentionClientTest, ForwardVarlenWithZeroLengthSequence) {
  AttentionShape s;
  s.dtype = DType::kFP16;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 32;
  s.seqlens_q = {3, 0, 17, 5};
  s.seqlens_k = {3, 6, 17, 0};  // the last sequence sees no key: O = 0, LSE = -inf
  ForwardOptions o;
  o.return_lse = true;
  RunAndVerify(s, o, 4);
  o.causal = true;
  RunAndVerify(s, o, 5);
}

TEST_F(AttentionClientTest, RawForwardEchoesRequestIdAndReportsTiming) {
  auto inputs = MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 64, 64, 2, 2, 64), 6);
  ASSERT_TRUE(inputs.ok());
  inputs->request_id = "client-test-42";
  auto response = Client()->Forward(MakeForwardRequest(*inputs));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), "client-test-42");
  EXPECT_EQ(response->backend(), "cpu");
  EXPECT_GT(response->timing().total_us(), 0);
  EXPECT_GE(response->timing().total_us(), response->timing().compute_us());
}

TEST_F(AttentionClientTest, ForwardAsync) {
  auto inputs = MakeRandomInputs(DenseAttentionShape(DType::kBF16, 1, 16, 16, 2, 2, 64), 7);
  ASSERT_TRUE(inputs.ok());
  std::promise<absl::StatusOr<v1::ForwardResponse>> done;
  Client()->ForwardAsync(
      MakeForwardRequest(*inputs), CallOptions(),
      [&done](absl::StatusOr<v1::ForwardResponse> r) { done.set_value(std::move(r)); });
  auto response = done.get_future().get();
  ASSERT_TRUE(response.ok()) << response.status();
  auto result = ForwardResultFromProto(*std::move(response));
  ASSERT_TRUE(result.ok());
  auto report = VerifyForward(*inputs, *result);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->passed) << report->failure;
}

// Echo: q's bytes back as o, a zero LSE of Forward's shape, no compute.
TEST_F(AttentionClientTest, EchoReturnsQ) {
  auto inputs = MakeRandomInputs(DenseAttentionShape(DType::kBF16, 2, 9, 13, 4, 2, 16), 11);
  ASSERT_TRUE(inputs.ok());
  inputs->options.return_lse = true;
  inputs->request_id = "echo-1";
  auto result = Client()->Echo(*inputs);  // the typed call also checks o and lse shapes
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->request_id, "echo-1");
  EXPECT_EQ(result->backend, "cpu");
  EXPECT_EQ(result->o.dtype(), DType::kBF16);
  EXPECT_EQ(result->o.shape(), inputs->q.shape());
  EXPECT_EQ(result->o.bytes(), inputs->q.bytes());
  ASSERT_TRUE(result->lse.has_value());
  EXPECT_EQ(result->lse->shape(), (std::vector<int64_t>{2, 4, 9}));
  EXPECT_EQ(result->lse->ToFloats(), std::vector<float>(2 * 4 * 9, 0.0f));
  EXPECT_EQ(result->timing.compute_us, 0);

  std::promise<absl::StatusOr<v1::ForwardResponse>> done;
  Client()->EchoAsync(
      MakeForwardRequest(*inputs), CallOptions(),
      [&done](absl::StatusOr<v1::ForwardResponse> r) { done.set_value(std::move(r)); });
  auto response = done.get_future().get();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->o().data(), inputs->q.bytes());
}

TEST_F(AttentionClientTest, EchoRefusesWhatForwardRefuses) {
  auto inputs =
      MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 4, 4, 2, 2, 12), 12);  // D = 12
  ASSERT_TRUE(inputs.ok());
  const v1::ForwardRequest request = MakeForwardRequest(*inputs);
  auto echo = Client()->Echo(request);
  auto forward = Client()->Forward(request);
  ASSERT_EQ(echo.status().code(), absl::StatusCode::kInvalidArgument) << echo.status();
  EXPECT_EQ(echo.status(), forward.status());
  EXPECT_THAT(echo.status().message(), HasSubstr("q.shape[3]"));
  EXPECT_EQ(*Client()->HealthCheck(), HealthStatus::kServing);
}

TEST_F(AttentionClientTest, GetServerInfo) {
  auto info = Client()->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->dtypes_size(), 4);  // FP16, BF16, FP32, FP8_E4M3
  EXPECT_EQ(info->min_head_dim(), 8);
  EXPECT_EQ(info->max_head_dim(), 256);
  // V's head dim of its own (MLA): Q and K up to 576, V up to 512.
  EXPECT_EQ(info->max_head_dim_qk(), 576);
  EXPECT_EQ(info->max_head_dim_v(), 512);
  EXPECT_GT(info->limits().max_request_bytes(), 0);
}

TEST_F(AttentionClientTest, HealthCheck) {
  auto status = Client()->HealthCheck();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, HealthStatus::kServing);
  EXPECT_STREQ(HealthStatusName(*status), "SERVING");
}

TEST_F(AttentionClientTest, DeadlineExceeded) {
  // Work the CPU server needs milliseconds for, so a 1 us deadline has
  // passed before any answer can arrive (a health check can come back first).
  auto inputs = MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, 1024, 1024, 8, 8, 64), 8);
  ASSERT_TRUE(inputs.ok());
  CallOptions call;
  call.timeout = absl::Microseconds(1);
  auto result = Client()->Forward(*inputs, call);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();

  // The same deadline as the client default, overridden per call.
  ClientOptions tight;
  tight.default_timeout = absl::Microseconds(1);
  auto client = Client(tight);
  EXPECT_EQ(client->Forward(*inputs).status().code(), absl::StatusCode::kDeadlineExceeded);
  call.timeout = absl::Seconds(30);
  EXPECT_TRUE(client->HealthCheck("", call).ok());
}

TEST_F(AttentionClientTest, InvalidArgumentMessageArrivesIntact) {
  // D = 12 is not a multiple of 8: the server names the value.
  auto inputs = MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 4, 4, 2, 2, 12), 9);
  ASSERT_TRUE(inputs.ok());
  auto result = Client()->Forward(*inputs);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("12"));

  // A byte length that disagrees with the shape: the message is the server's,
  // not a client-side rewrite.
  auto good = MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 4, 4, 2, 2, 8), 10);
  v1::ForwardRequest request = MakeForwardRequest(*good);
  request.mutable_k()->mutable_data()->resize(10);
  auto raw = Client()->Forward(request);
  ASSERT_EQ(raw.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(raw.status().message(), HasSubstr("10"));
  EXPECT_THAT(raw.status().message(), HasSubstr("k.data"));

  // The server keeps serving.
  EXPECT_EQ(*Client()->HealthCheck(), HealthStatus::kServing);
}

TEST_F(AttentionClientTest, UnavailableWhenNothingListens) {
  // Port 1 on loopback: nothing listens there, the connection is refused.
  auto client = AttentionClient::Create("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  CallOptions call;
  call.timeout = absl::Seconds(10);
  EXPECT_EQ((*client)->HealthCheck("", call).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->Connect(absl::Seconds(10)).code(), absl::StatusCode::kUnavailable);
}

TEST_F(AttentionClientTest, ConnectOpensEveryChannel) {
  ClientOptions options;
  options.num_channels = 2;
  auto client = Client(options);
  ASSERT_TRUE(client->Connect(absl::Seconds(10)).ok());
  for (int i = 0; i < client->num_channels(); ++i) {
    EXPECT_EQ(client->channel(i)->GetState(false), GRPC_CHANNEL_READY);
  }
}

TEST_F(AttentionClientTest, SeveralChannelsAndRoundRobinTargets) {
  ClientOptions options;
  options.num_channels = 3;
  options.load_balancing_policy = "round_robin";
  for (const std::string& target :
       {target_, absl::StrCat("ipv4:", target_), absl::StrCat("dns:///", target_),
        absl::StrCat("dns:///localhost:", server_->port())}) {
    SCOPED_TRACE(target);
    auto client = AttentionClient::Create(target, options);
    ASSERT_TRUE(client.ok()) << client.status();
    for (int i = 0; i < 4; ++i) {
      auto status = (*client)->HealthCheck();
      ASSERT_TRUE(status.ok()) << status.status();
      EXPECT_EQ(*status, HealthStatus::kServing);
    }
  }
}

}  // namespace
}  // namespace attnserve
