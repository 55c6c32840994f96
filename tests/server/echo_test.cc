// Echo over the wire: a real AttnServer on 127.0.0.1:0 (CPU backend behind a
// counting, closable wrapper). Echo must answer with q's bytes and an LSE of
// Forward's shape, refuse exactly what Forward refuses with the same status
// and message (limits included), never reach the backend, and leave the
// server serving.
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/backend_factory.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/server/gated_cpu_backend.h"
#include "tests/server/random_tensor.h"

namespace attnserve {
namespace {

// Dense: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D].
v1::ForwardRequest Dense(int b, int sq, int sk, int hq, int hkv, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  v1::ForwardRequest r;
  r.set_request_id(absl::StrCat("dense-", seed));
  SetRandomTensor(r.mutable_q(), {b, sq, hq, d}, &rng);
  SetRandomTensor(r.mutable_k(), {b, sk, hkv, d}, &rng);
  SetRandomTensor(r.mutable_v(), {b, sk, hkv, d}, &rng);
  return r;
}

// Varlen with a zero-length sequence: q [Tq, Hq, D], k/v [Tk, Hkv, D].
v1::ForwardRequest Varlen(uint32_t seed) {
  std::mt19937 rng(seed);
  v1::ForwardRequest r;
  r.set_request_id(absl::StrCat("varlen-", seed));
  SetRandomTensor(r.mutable_q(), {8, 4, 16}, &rng);   // Tq = 3 + 0 + 5
  SetRandomTensor(r.mutable_k(), {10, 2, 16}, &rng);  // Tk = 4 + 2 + 4
  SetRandomTensor(r.mutable_v(), {10, 2, 16}, &rng);
  for (int x : {0, 3, 3, 8}) r.add_cu_seqlens_q(x);
  for (int x : {0, 4, 6, 10}) r.add_cu_seqlens_k(x);
  return r;
}

std::vector<int64_t> Shape(const v1::Tensor& t) { return {t.shape().begin(), t.shape().end()}; }

class EchoTest : public ::testing::Test {
 protected:
  void StartServer(const ServerOptions& options) {
    spdlog::set_level(spdlog::level::warn);
    auto backend = std::make_unique<GatedCpuBackend>();
    backend_ = backend.get();
    auto server = AttnServer::Create(options, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub_ = v1::Attention::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
  }
  void SetUp() override {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.max_request_bytes = 64 * 1024;
    options.max_tokens = 256;
    StartServer(options);
  }

  grpc::Status Echo(const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Echo(&ctx, request, response);
  }
  grpc::Status Forward(const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Forward(&ctx, request, response);
  }

  // Echo and Forward refuse `request` with the same code and message, which
  // names `field`; then both still answer a valid request.
  void ExpectRefusedLikeForward(const v1::ForwardRequest& request, grpc::StatusCode code,
                                const std::string& field) {
    v1::ForwardResponse echo_response, forward_response;
    const grpc::Status echo = Echo(request, &echo_response);
    const grpc::Status forward = Forward(request, &forward_response);
    EXPECT_EQ(echo.error_code(), code) << echo.error_message();
    EXPECT_EQ(forward.error_code(), code) << forward.error_message();
    EXPECT_EQ(echo.error_message(), forward.error_message());
    EXPECT_NE(echo.error_message().find(field), std::string::npos) << echo.error_message();
    ExpectStillServing();
  }

  void ExpectStillServing() {
    const v1::ForwardRequest request = Dense(1, 3, 5, 2, 1, 8, 99);
    v1::ForwardResponse response;
    grpc::Status s = Echo(request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    s = Forward(request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  GatedCpuBackend* backend_ = nullptr;  // owned by server_
  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

TEST_F(EchoTest, ReturnsQBytesAndForwardShapedLse) {
  for (v1::ForwardRequest request : {Dense(2, 5, 7, 4, 2, 8, 1), Varlen(2)}) {
    SCOPED_TRACE(request.request_id());
    for (bool lse : {false, true}) {
      request.mutable_options()->set_return_lse(lse);
      v1::ForwardResponse echo;
      const grpc::Status s = Echo(request, &echo);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(echo.request_id(), request.request_id());
      EXPECT_EQ(echo.backend(), "cpu");
      EXPECT_EQ(echo.o().dtype(), request.q().dtype());
      EXPECT_EQ(Shape(echo.o()), Shape(request.q()));
      EXPECT_EQ(echo.o().data(), request.q().data());
      EXPECT_GE(echo.timing().total_us(), 0);
      EXPECT_EQ(echo.timing().compute_us(), 0);
      EXPECT_EQ(echo.error_code(), 0);

      // The LSE Forward would send: same dtype and shape; Echo's is zeros.
      v1::ForwardResponse forward;
      ASSERT_TRUE(Forward(request, &forward).ok());
      EXPECT_EQ(echo.has_lse(), lse);
      EXPECT_EQ(forward.has_lse(), lse);
      if (!lse) continue;
      EXPECT_EQ(echo.lse().dtype(), forward.lse().dtype());
      EXPECT_EQ(Shape(echo.lse()), Shape(forward.lse()));
      ASSERT_EQ(echo.lse().data().size(), forward.lse().data().size());
      EXPECT_EQ(echo.lse().data(), std::string(forward.lse().data().size(), '\0'));
    }
  }
}

TEST_F(EchoTest, InvalidRequestsAreRefusedLikeForward) {
  v1::ForwardRequest bad_dim = Dense(1, 4, 4, 2, 2, 12, 3);  // D = 12: not a multiple of 8
  ExpectRefusedLikeForward(bad_dim, grpc::StatusCode::INVALID_ARGUMENT, "q.shape[3]");

  v1::ForwardRequest short_k = Dense(1, 4, 4, 2, 2, 8, 4);
  short_k.mutable_k()->mutable_data()->resize(10);
  ExpectRefusedLikeForward(short_k, grpc::StatusCode::INVALID_ARGUMENT, "k.data");

  v1::ForwardRequest gqa = Dense(1, 4, 4, 3, 2, 8, 5);  // Hq % Hkv != 0
  ExpectRefusedLikeForward(gqa, grpc::StatusCode::INVALID_ARGUMENT, "shape");

  v1::ForwardRequest scale = Dense(1, 4, 4, 2, 2, 8, 6);
  scale.mutable_options()->set_softmax_scale(-1.0f);
  ExpectRefusedLikeForward(scale, grpc::StatusCode::INVALID_ARGUMENT, "softmax_scale");

  v1::ForwardRequest seqlens = Varlen(7);
  seqlens.set_cu_seqlens_q(3, 9);  // last must be Tq = 8
  ExpectRefusedLikeForward(seqlens, grpc::StatusCode::INVALID_ARGUMENT, "cu_seqlens_q");
}

TEST_F(EchoTest, HonoursForwardLimits) {
  // 128 + 128 tokens fit max_tokens = 256; 200 + 200 do not.
  ExpectRefusedLikeForward(Dense(1, 200, 200, 1, 1, 8, 8), grpc::StatusCode::RESOURCE_EXHAUSTED,
                           "max_tokens");
  // 3 * 100 * 64 * 4 B = 75 KiB of tensors, over max_request_bytes = 64 KiB
  // (and under gRPC's receive limit, so validation gives the message).
  ExpectRefusedLikeForward(Dense(1, 100, 100, 1, 1, 64, 9), grpc::StatusCode::RESOURCE_EXHAUSTED,
                           "max_request_bytes");
}

TEST_F(EchoTest, NeverReachesTheBackend) {
  const int before = backend_->calls();  // the server's warm-up ran one
  v1::ForwardResponse response;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Echo(Dense(1, 8, 8, 2, 2, 16, 10 + i), &response).ok());
  EXPECT_EQ(backend_->calls(), before);

  // A Forward held inside the backend does not hold Echo up.
  backend_->Close();
  grpc::ClientContext ctx;
  const v1::ForwardRequest held = Dense(1, 8, 8, 2, 2, 16, 20);
  v1::ForwardResponse held_response;
  grpc::Status held_status;
  absl::Notification held_done;
  stub_->async()->Forward(&ctx, &held, &held_response, [&](grpc::Status s) {
    held_status = std::move(s);
    held_done.Notify();
  });
  backend_->AwaitCalls(before + 1);
  EXPECT_TRUE(Echo(Dense(1, 8, 8, 2, 2, 16, 21), &response).ok());
  EXPECT_FALSE(held_done.HasBeenNotified());
  backend_->Open();
  held_done.WaitForNotification();
  EXPECT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_EQ(backend_->calls(), before + 1);
}

TEST_F(EchoTest, GetServerInfoListsEcho) {
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  bool found = false;
  for (const std::string& f : info.features()) found |= f == "echo";
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace attnserve
