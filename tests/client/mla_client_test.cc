// MLA shapes from the clients: the C++ client (over the message and through a
// shared-memory arena) and attnctl forward --head_dim_v send calls whose V
// head dim differs from Q's and K's, and the float64 verifier accepts what an
// in-process CPU server returns (O with V's head dim).
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/shm_arena.h"
#include "client/verify.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class MlaClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start(/*allow_client_shm=*/true);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = AttentionClient::Create(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  static LoopbackServer* server_;
  std::unique_ptr<AttentionClient> client_;
};

LoopbackServer* MlaClientTest::server_ = nullptr;

std::vector<AttentionShape> Shapes() {
  AttentionShape prefill = DenseAttentionShape(DType::kBF16, 2, 33, 70, 4, 2, 192);
  prefill.head_dim_v = 128;
  AttentionShape decode;
  decode.dtype = DType::kFP32;
  decode.heads_q = 16;
  decode.heads_kv = 1;
  decode.head_dim = 576;
  decode.head_dim_v = 512;
  decode.seqlens_q = {1, 1, 0};
  decode.seqlens_k = {40, 3, 9};
  return {prefill, decode};
}

TEST_F(MlaClientTest, ForwardOverTheMessageAndThroughAnArena) {
  ShmArenaOptions options;
  options.byte_size = 8 << 20;
  options.key_prefix = absl::StrCat("/attnserve.default.mlaclient", getpid(), "-");
  auto arena = ShmArena::Create(*client_, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  for (const AttentionShape& shape : Shapes()) {
    absl::StatusOr<AttentionInputs> in = MakeRandomInputs(shape, 3);
    ASSERT_TRUE(in.ok()) << in.status();
    in->options.causal = true;
    in->options.return_lse = true;
    absl::StatusOr<InputsSummary> summary = SummarizeInputs(*in);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_THAT(summary->ToString(), HasSubstr(absl::StrCat(" Dv=", shape.head_dim_v)));
    absl::StatusOr<ForwardResult> message = client_->Forward(*in);
    ASSERT_TRUE(message.ok()) << message.status();
    EXPECT_EQ(message->o.shape().back(), shape.head_dim_v);
    absl::StatusOr<VerifyReport> report = VerifyForward(*in, *message);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->passed) << report->failure;
    absl::StatusOr<ForwardResult> shm = client_->Forward(*in, **arena);
    ASSERT_TRUE(shm.ok()) << shm.status();
    EXPECT_EQ(shm->o.bytes(), message->o.bytes());
  }
  ASSERT_TRUE((*arena)->Close().ok());
}

TEST_F(MlaClientTest, AttnctlForwardHeadDimV) {
  const CliResult r =
      RunCli({"forward", "--target=" + server_->target(), "--dtype=bf16", "--batch=2",
              "--seqlen_q=17", "--seqlen_k=40", "--heads_q=4", "--heads_kv=2", "--head_dim=192",
              "--head_dim_v=128", "--causal", "--return_lse", "--verify"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("D=192 Dv=128"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  // Over KServe v2 too.
  const CliResult v2 = RunCli({"forward", "--target=" + server_->target(), "--protocol=v2",
                               "--dtype=fp32", "--seqlen_q=5", "--seqlen_k=9", "--heads_q=16",
                               "--heads_kv=1", "--head_dim=576", "--head_dim_v=512", "--verify"});
  EXPECT_EQ(v2.exit_code, 0) << Describe(v2);
  // A Dv the contract refuses comes back naming the field.
  const CliResult bad = RunCli({"forward", "--target=" + server_->target(), "--seqlen_q=4",
                                "--head_dim=192", "--head_dim_v=520"});
  EXPECT_NE(bad.exit_code, 0) << Describe(bad);
  EXPECT_THAT(bad.out + bad.err, HasSubstr("v.shape[3]"));
}

}  // namespace
}  // namespace attnserve
