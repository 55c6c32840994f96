// Transport security and tenants over the wire, with real certificates made
// in the test (test_certs.h): TLS, mutual TLS, certificate rotation without a
// restart (gRPC and HTTPS), bearer tokens (missing, wrong, reloaded), open
// health checks, tenant isolation of K/V caches and shared-memory regions
// (another tenant's id answers byte for byte as a never-existing one), the
// three quotas, and per-tenant counters on /metrics served over HTTPS.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#define CPPHTTPLIB_OPENSSL_SUPPORT
#include <httplib.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "client/channel_security.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"
#include "tests/security/test_certs.h"

namespace attnserve {
namespace {

using testing::Pem;
using testing::TestCa;

constexpr char kTokenA[] = "token-of-tenant-a-0123456789";
constexpr char kTokenB[] = "token-of-tenant-b-0123456789";
// Evidence-based waits give up after this (a loaded 2-core CI machine).
constexpr absl::Duration kPatience = absl::Seconds(60);

void WriteFile(const std::string& path, const std::string& text) {
  testing::WriteFileAtomically(path, text);
}

// Files of one test: a CA, a server certificate, a client certificate, and
// the tokens file.
struct Fixture {
  Fixture() : dir(testing::MakeTempDir("attnserve_security_")), ca("test CA") {
    server = ca.Issue("server-one", true);
    client = ca.Issue("client-one", false);
    WriteFile(path("ca.pem"), ca.cert_pem());
    WriteFile(path("server.pem"), server.cert);
    WriteFile(path("server.key"), server.key);
    WriteFile(path("client.pem"), client.cert);
    WriteFile(path("client.key"), client.key);
  }
  std::string path(const std::string& name) const { return dir + "/" + name; }

  std::string dir;
  TestCa ca;
  Pem server;
  Pem client;
};

ServerOptions BaseOptions() {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.backend.kind = "cpu";
  options.backend.cpu_threads = 2;
  return options;
}

std::unique_ptr<AttnServer> StartServer(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  const absl::Status started = (*server)->Start();
  EXPECT_TRUE(started.ok()) << started;
  return *std::move(server);
}

std::shared_ptr<grpc::Channel> Channel(int port, const ChannelSecurity& security) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeSecureChannel(absl::StrCat("localhost:", port), security, grpc::ChannelArguments());
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *channel : nullptr;
}

// A small valid Forward request: q, k, v FP32 [1, 4, 1, 8].
v1::ForwardRequest SmallRequest() {
  v1::ForwardRequest request;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::FP32);
    for (int d : {1, 4, 1, 8}) t->add_shape(d);
    std::string data(4 * 8 * sizeof(float), '\0');
    for (size_t i = 0; i < data.size(); i += 4) data[i + 3] = 0x3f;  // ~0.5
    t->set_data(data);
  }
  return request;
}

grpc::Status CallForward(const std::shared_ptr<grpc::Channel>& channel,
                         const v1::ForwardRequest& request = SmallRequest()) {
  auto stub = v1::Attention::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::ForwardResponse response;
  return stub->Forward(&context, request, &response);
}

grpc::Status CallHealth(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (status.ok() && response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "not SERVING");
  }
  return status;
}

// What a client sees of a status, as bytes: two answers are the same iff these are.
std::string Answer(const grpc::Status& status) {
  return absl::StrCat(status.error_code(), "\n", status.error_message(), "\n",
                      status.error_details());
}

// ---- TLS and mutual TLS ----

TEST(TlsTest, ServesOverTlsAndRefusesPlainTextCleanly) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("server.key"), "", absl::Seconds(1)};
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);

  ChannelSecurity tls;
  tls.tls_ca_file = f.path("ca.pem");
  EXPECT_TRUE(CallForward(Channel(server->port(), tls)).ok());
  EXPECT_TRUE(CallHealth(Channel(server->port(), tls)).ok());

  // A plain-text client fails with UNAVAILABLE within its deadline (no hang),
  // and the server goes on serving TLS clients.
  grpc::Status plain = CallForward(Channel(server->port(), ChannelSecurity()));
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();

  // A client that trusts another CA refuses the server.
  TestCa other("other CA");
  WriteFile(f.path("other-ca.pem"), other.cert_pem());
  ChannelSecurity wrong_ca;
  wrong_ca.tls_ca_file = f.path("other-ca.pem");
  EXPECT_EQ(CallForward(Channel(server->port(), wrong_ca)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(CallForward(Channel(server->port(), tls)).ok());
  server->Shutdown(absl::Seconds(5));
}

TEST(TlsTest, MutualTlsRefusesClientsWithoutACertificateFromTheClientCa) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("server.key"), f.path("ca.pem"), absl::Seconds(1)};
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);

  ChannelSecurity no_cert;
  no_cert.tls_ca_file = f.path("ca.pem");
  EXPECT_EQ(CallForward(Channel(server->port(), no_cert)).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  TestCa other("rogue CA");
  const Pem rogue = other.Issue("rogue-client", false);
  WriteFile(f.path("rogue.pem"), rogue.cert);
  WriteFile(f.path("rogue.key"), rogue.key);
  ChannelSecurity rogue_cert = no_cert;
  rogue_cert.tls_cert_file = f.path("rogue.pem");
  rogue_cert.tls_key_file = f.path("rogue.key");
  EXPECT_EQ(CallForward(Channel(server->port(), rogue_cert)).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  ChannelSecurity mtls = no_cert;
  mtls.tls_cert_file = f.path("client.pem");
  mtls.tls_key_file = f.path("client.key");
  EXPECT_TRUE(CallForward(Channel(server->port(), mtls)).ok());
  server->Shutdown(absl::Seconds(5));
}

TEST(TlsTest, BadTlsFilesFailTheStartNamingTheFlag) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("client.key"), "", absl::Seconds(1)};
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::StrContains(server.status().message(), "tls_key")) << server.status();
  options.tls = {f.path("missing.pem"), f.path("server.key"), "", absl::Seconds(1)};
  server = AttnServer::Create(options);
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::StrContains(server.status().message(), "tls_cert")) << server.status();
}

// Rotation: new files in place, and the next handshakes present the new
// certificate (gRPC port and /metrics over HTTPS) without a restart.
TEST(TlsTest, RotatedCertificateIsServedWithoutARestart) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("server.key"), "", absl::Seconds(1)};
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(testing::PresentedCommonName(server->port()), "server-one");
  ASSERT_EQ(testing::PresentedCommonName(server->metrics_port()), "server-one");

  const Pem rotated = f.ca.Issue("server-two", true);
  // Key first: for a moment the pair does not match, which both reloaders
  // must ride out (keeping the old pair) rather than serve.
  WriteFile(f.path("server.key"), rotated.key);
  WriteFile(f.path("server.pem"), rotated.cert);

  const absl::Time give_up = absl::Now() + kPatience;
  std::string grpc_cn, http_cn;
  while (absl::Now() < give_up) {
    grpc_cn = testing::PresentedCommonName(server->port());
    http_cn = testing::PresentedCommonName(server->metrics_port());
    if (grpc_cn == "server-two" && http_cn == "server-two") break;
    absl::SleepFor(absl::Milliseconds(100));  // poll interval, not the wait itself
  }
  EXPECT_EQ(grpc_cn, "server-two");
  EXPECT_EQ(http_cn, "server-two");
  ChannelSecurity tls;
  tls.tls_ca_file = f.path("ca.pem");
  EXPECT_TRUE(CallForward(Channel(server->port(), tls)).ok());
  server->Shutdown(absl::Seconds(5));
}

// The server's log lines, for tests that wait on what the server says it did.
class LogLines final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  bool Contains(const std::string& text) {
    std::lock_guard<std::mutex> lock(base_sink<std::mutex>::mutex_);
    for (const std::string& line : lines_) {
      if (absl::StrContains(line, text)) return true;
    }
    return false;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> lines_;
};

// A mismatched pair written in place (a new key, the old certificate) is
// never served: every handshake on the gRPC port and on HTTPS goes on with
// the old pair until a matching certificate arrives. Before the fix the gRPC
// port's provider served the mismatched pair and its handshakes failed.
TEST(TlsTest, MismatchedPairIsNeverServed) {
  Fixture f;
  auto log = std::make_shared<LogLines>();
  spdlog::default_logger()->sinks().push_back(log);
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("server.key"), "", absl::Seconds(1)};
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(testing::PresentedCommonName(server->port()), "server-one");

  const Pem rotated = f.ca.Issue("server-two", true);
  {
    std::ofstream key(f.path("server.key"), std::ios::trunc);  // in place, not renamed
    key << rotated.key;
  }
  // Handshakes while both reloaders look at the mismatched pair; the
  // evidence that they have is their log lines.
  const absl::Time give_up = absl::Now() + kPatience;
  bool grpc_kept = false, https_kept = false;
  while (absl::Now() < give_up && !(grpc_kept && https_kept)) {
    grpc_kept = log->Contains("grpc tls: keeping the previous certificate");
    https_kept = log->Contains("https: keeping the previous certificate");
    ASSERT_EQ(testing::PresentedCommonName(server->port()), "server-one");
    ASSERT_EQ(testing::PresentedCommonName(server->metrics_port()), "server-one");
  }
  ASSERT_TRUE(grpc_kept && https_kept);
  ChannelSecurity tls;
  tls.tls_ca_file = f.path("ca.pem");
  EXPECT_TRUE(CallForward(Channel(server->port(), tls)).ok());

  // The matching certificate completes the pair: it is served on both.
  WriteFile(f.path("server.pem"), rotated.cert);
  std::string grpc_cn, http_cn;
  while (absl::Now() < give_up + kPatience) {
    grpc_cn = testing::PresentedCommonName(server->port());
    http_cn = testing::PresentedCommonName(server->metrics_port());
    if (grpc_cn == "server-two" && http_cn == "server-two") break;
    absl::SleepFor(absl::Milliseconds(100));  // poll interval, not the wait itself
  }
  EXPECT_EQ(grpc_cn, "server-two");
  EXPECT_EQ(http_cn, "server-two");
  EXPECT_TRUE(CallForward(Channel(server->port(), tls)).ok());
  server->Shutdown(absl::Seconds(5));
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), log), sinks.end());
}

// ---- Bearer tokens ----

std::string TokensFile(const Fixture& f, const std::string& text) {
  WriteFile(f.path("tokens"), text);
  return f.path("tokens");
}

ChannelSecurity WithToken(const std::string& token) {
  ChannelSecurity s;
  s.token = token;
  return s;
}

TEST(TokenTest, MissingOrWrongTokensAreUnauthenticatedAndHealthStaysOpen) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.auth = {TokensFile(f, absl::StrCat("# test\n", kTokenA, " team-a\n")),
                  absl::Milliseconds(100)};
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);

  const grpc::Status missing = CallForward(Channel(server->port(), ChannelSecurity()));
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED) << missing.error_message();
  const grpc::Status wrong =
      CallForward(Channel(server->port(), WithToken("token-of-nobody-0123456789")));
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong.error_message();
  // A prefix of a real token is as wrong as any other guess.
  const grpc::Status prefix =
      CallForward(Channel(server->port(), WithToken(std::string(kTokenA).substr(0, 20))));
  EXPECT_EQ(Answer(prefix), Answer(wrong));
  EXPECT_TRUE(CallForward(Channel(server->port(), WithToken(kTokenA))).ok());

  // Open without a token: health (Kubernetes probes) and KServe ServerLive.
  EXPECT_TRUE(CallHealth(Channel(server->port(), ChannelSecurity())).ok());
  auto v2 = inference::GRPCInferenceService::NewStub(Channel(server->port(), ChannelSecurity()));
  {
    grpc::ClientContext context;
    inference::ServerLiveResponse live;
    EXPECT_TRUE(v2->ServerLive(&context, inference::ServerLiveRequest(), &live).ok());
  }
  {
    grpc::ClientContext context;
    inference::ServerMetadataResponse metadata;
    EXPECT_EQ(
        v2->ServerMetadata(&context, inference::ServerMetadataRequest(), &metadata).error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
  }
  // Every other service needs the token too.
  auto kv = v1::KvCache::NewStub(Channel(server->port(), ChannelSecurity()));
  grpc::ClientContext context;
  v1::GetCacheStatsRequest stats_request;
  stats_request.set_cache_id("x");
  v1::GetCacheStatsResponse stats;
  EXPECT_EQ(kv->GetCacheStats(&context, stats_request, &stats).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  server->Shutdown(absl::Seconds(5));
}

TEST(TokenTest, TokensFileIsReloadedWithoutARestart) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.auth = {TokensFile(f, absl::StrCat(kTokenA, " team-a\n")), absl::Milliseconds(100)};
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto channel_a = Channel(server->port(), WithToken(kTokenA));
  auto channel_b = Channel(server->port(), WithToken(kTokenB));
  ASSERT_EQ(CallForward(channel_b).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // A broken file keeps the old tokens in force; then B replaces A.
  TokensFile(f, "short team-a\n");
  TokensFile(f, absl::StrCat(kTokenB, " team-b\n"));
  const absl::Time give_up = absl::Now() + kPatience;
  while (absl::Now() < give_up && !CallForward(channel_b).ok()) {
    absl::SleepFor(absl::Milliseconds(50));  // poll interval
  }
  EXPECT_TRUE(CallForward(channel_b).ok());
  EXPECT_EQ(CallForward(channel_a).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  server->Shutdown(absl::Seconds(5));
}

// Two authorization headers, junk first: the door must not check one and the
// services use the other. Without the fix the call ran as a shared tenant
// with no quotas, whose caches a second such client could read and drop.
TEST(TokenTest, TwoAuthorizationHeadersAreRefused) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.auth = {TokensFile(f, absl::StrCat(kTokenA, " team-a\n")), absl::Seconds(10)};
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto stub = v1::KvCache::NewStub(Channel(server->port(), ChannelSecurity()));
  auto create = [&](const std::vector<std::string>& headers) {
    v1::CreateCacheRequest request;
    request.mutable_geometry()->set_num_layers(1);
    request.mutable_geometry()->set_num_heads_kv(1);
    request.mutable_geometry()->set_head_dim(8);
    request.mutable_geometry()->set_dtype(v1::FP32);
    request.set_capacity_tokens(64);
    grpc::ClientContext context;
    for (const std::string& h : headers) context.AddMetadata("authorization", h);
    v1::CreateCacheResponse response;
    return stub->CreateCache(&context, request, &response);
  };
  const std::string valid = absl::StrCat("Bearer ", kTokenA);
  const grpc::Status junk_first = create({"Bearer junk-junk-junk-junk-junk", valid});
  EXPECT_EQ(junk_first.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << junk_first.error_message();
  EXPECT_EQ(create({valid, "Bearer junk-junk-junk-junk-junk"}).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(create({valid, valid}).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(create({valid}).ok());
  // The same for the other services.
  auto attention = v1::Attention::NewStub(Channel(server->port(), ChannelSecurity()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer junk-junk-junk-junk-junk");
  context.AddMetadata("authorization", valid);
  v1::ForwardResponse response;
  EXPECT_EQ(attention->Forward(&context, SmallRequest(), &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  server->Shutdown(absl::Seconds(5));
}

// One decode step of sequence 1 (FP32, one head of dimension 8) at `length`.
v1::AppendAttendRequest DecodeStep(const std::string& cache, int32_t length) {
  v1::AppendAttendRequest r;
  r.set_request_id(absl::StrCat("step-", length));
  r.set_cache_id(cache);
  v1::SequenceStep* step = r.add_sequences();
  step->set_sequence_id(1);
  step->set_expected_length(length);
  step->set_num_new_tokens(1);
  step->set_num_queries(1);
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(v1::FP32);
    for (int d : {1, 1, 8}) t->add_shape(d);
    t->set_data(std::string(8 * sizeof(float), '\0'));
  }
  return r;
}

// Withdraws B's token from the tokens file (A stays) and waits for the
// evidence that the reload happened: a new call with B's token refused.
void WithdrawTokenB(const Fixture& f, const std::shared_ptr<grpc::Channel>& channel_b) {
  TokensFile(f, absl::StrCat(kTokenA, " team-a\n"));
  const absl::Time give_up = absl::Now() + kPatience;
  while (absl::Now() < give_up &&
         CallForward(channel_b).error_code() != grpc::StatusCode::UNAUTHENTICATED) {
    absl::SleepFor(absl::Milliseconds(50));  // poll interval
  }
  ASSERT_EQ(CallForward(channel_b).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// A server with tokens for A and B, reloaded every 100 ms.
std::unique_ptr<AttnServer> StartWithTwoTokens(const Fixture& f) {
  ServerOptions options = BaseOptions();
  options.auth = {TokensFile(f, absl::StrCat(kTokenA, " team-a\n", kTokenB, " team-b\n")),
                  absl::Milliseconds(100)};
  return StartServer(options);
}

// A token withdrawn by a reload stops the requests of a stream opened with
// it, not only new calls (before the fix, the stream went on serving).
TEST(TokenTest, WithdrawnTokenStopsAnOpenStream) {
  Fixture f;
  std::unique_ptr<AttnServer> server = StartWithTwoTokens(f);
  ASSERT_NE(server, nullptr);
  auto channel_b = Channel(server->port(), WithToken(kTokenB));
  auto stub = v1::KvCache::NewStub(channel_b);
  {
    v1::CreateCacheRequest request;
    request.mutable_geometry()->set_num_layers(1);
    request.mutable_geometry()->set_num_heads_kv(1);
    request.mutable_geometry()->set_head_dim(8);
    request.mutable_geometry()->set_dtype(v1::FP32);
    request.set_capacity_tokens(64);
    request.set_cache_id("b-cache");
    grpc::ClientContext context;
    v1::CreateCacheResponse response;
    ASSERT_TRUE(stub->CreateCache(&context, request, &response).ok());
  }
  {
    v1::CreateSequencesRequest request;
    request.set_cache_id("b-cache");
    request.add_sequences()->set_sequence_id(1);
    grpc::ClientContext context;
    v1::CreateSequencesResponse response;
    ASSERT_TRUE(stub->CreateSequences(&context, request, &response).ok());
  }
  grpc::ClientContext stream_context;
  auto stream = stub->AppendAttendStream(&stream_context);
  v1::AppendAttendResponse response;
  ASSERT_TRUE(stream->Write(DecodeStep("b-cache", 0)));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_EQ(response.error_code(), 0) << response.error_message();

  WithdrawTokenB(f, channel_b);
  ASSERT_TRUE(stream->Write(DecodeStep("b-cache", 1)));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_code(), int(grpc::StatusCode::UNAUTHENTICATED))
      << response.error_message();
  EXPECT_EQ(response.request_id(), "step-1");
  stream->WritesDone();
  stream->Finish();
  server->Shutdown(absl::Seconds(5));
}

// The same on the native ForwardStream: served before, refused after.
TEST(TokenTest, WithdrawnTokenStopsAnOpenForwardStream) {
  Fixture f;
  std::unique_ptr<AttnServer> server = StartWithTwoTokens(f);
  ASSERT_NE(server, nullptr);
  auto channel_b = Channel(server->port(), WithToken(kTokenB));
  auto stub = v1::Attention::NewStub(channel_b);
  grpc::ClientContext stream_context;
  auto stream = stub->ForwardStream(&stream_context);
  v1::ForwardRequest request = SmallRequest();
  v1::ForwardResponse response;
  request.set_request_id("before");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_EQ(response.error_code(), 0) << response.error_message();
  ASSERT_TRUE(response.has_o());

  WithdrawTokenB(f, channel_b);
  request.set_request_id("after");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_code(), int(grpc::StatusCode::UNAUTHENTICATED))
      << response.error_message();
  EXPECT_EQ(response.request_id(), "after");
  EXPECT_FALSE(response.has_o());
  stream->WritesDone();
  stream->Finish();
  server->Shutdown(absl::Seconds(5));
}

// The same on KServe's ModelStreamInfer (the `attention` model): an error
// message naming the refusal, no outputs.
TEST(TokenTest, WithdrawnTokenStopsAnOpenModelStreamInfer) {
  Fixture f;
  std::unique_ptr<AttnServer> server = StartWithTwoTokens(f);
  ASSERT_NE(server, nullptr);
  auto channel_b = Channel(server->port(), WithToken(kTokenB));
  auto stub = inference::GRPCInferenceService::NewStub(channel_b);
  inference::ModelInferRequest request;
  request.set_model_name("attention");
  const v1::ForwardRequest native = SmallRequest();
  for (const v1::Tensor* t : {&native.q(), &native.k(), &native.v()}) {
    auto* input = request.add_inputs();
    input->set_name(t == &native.q() ? "q" : t == &native.k() ? "k" : "v");
    input->set_datatype("FP32");
    for (int64_t d : t->shape()) input->add_shape(d);
    request.add_raw_input_contents(t->data());
  }
  grpc::ClientContext stream_context;
  auto stream = stub->ModelStreamInfer(&stream_context);
  inference::ModelStreamInferResponse response;
  request.set_id("before");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_EQ(response.error_message(), "");
  ASSERT_GT(response.infer_response().outputs_size(), 0);

  WithdrawTokenB(f, channel_b);
  request.set_id("after");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_NE(response.error_message(), "");
  EXPECT_TRUE(absl::StrContains(response.error_message(), "withdrawn")) << response.error_message();
  EXPECT_EQ(response.infer_response().outputs_size(), 0);
  stream->WritesDone();
  stream->Finish();
  server->Shutdown(absl::Seconds(5));
}

// ---- Tenants: K/V caches ----

class TenantTest : public ::testing::Test {
 protected:
  void Start(const std::string& tokens, bool shm = false) {
    ServerOptions options = BaseOptions();
    options.auth = {TokensFile(f_, tokens), absl::Seconds(10)};
    options.kserve.allow_client_shm = shm;
    options.metrics_enabled = true;
    options.metrics_host = "127.0.0.1";
    options.metrics_port = 0;
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
    a_ = Channel(server_->port(), WithToken(kTokenA));
    b_ = Channel(server_->port(), WithToken(kTokenB));
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  static grpc::Status CreateCache(const std::shared_ptr<grpc::Channel>& channel,
                                  const std::string& id, int64_t tokens) {
    v1::CreateCacheRequest request;
    request.mutable_geometry()->set_num_layers(1);
    request.mutable_geometry()->set_num_heads_kv(1);
    request.mutable_geometry()->set_head_dim(8);
    request.mutable_geometry()->set_dtype(v1::FP32);
    request.set_page_size(16);
    request.set_capacity_tokens(tokens);
    request.set_cache_id(id);
    grpc::ClientContext context;
    v1::CreateCacheResponse response;
    return v1::KvCache::NewStub(channel)->CreateCache(&context, request, &response);
  }

  // Every K/V call on `id` from `channel`, each answer as bytes.
  static std::vector<std::string> KvAnswers(const std::shared_ptr<grpc::Channel>& channel,
                                            const std::string& id) {
    auto stub = v1::KvCache::NewStub(channel);
    std::vector<std::string> answers;
    {
      grpc::ClientContext c;
      v1::GetCacheStatsRequest r;
      r.set_cache_id(id);
      v1::GetCacheStatsResponse out;
      answers.push_back(Answer(stub->GetCacheStats(&c, r, &out)));
    }
    {
      grpc::ClientContext c;
      v1::CreateSequencesRequest r;
      r.set_cache_id(id);
      r.add_sequences()->set_sequence_id(7);
      v1::CreateSequencesResponse out;
      answers.push_back(Answer(stub->CreateSequences(&c, r, &out)));
    }
    {
      grpc::ClientContext c;
      v1::TruncateRequest r;
      r.set_cache_id(id);
      r.set_sequence_id(1);
      v1::TruncateResponse out;
      answers.push_back(Answer(stub->Truncate(&c, r, &out)));
    }
    {
      grpc::ClientContext c;
      v1::FreeSequencesRequest r;
      r.set_cache_id(id);
      r.add_sequence_ids(1);
      v1::FreeSequencesResponse out;
      answers.push_back(Answer(stub->FreeSequences(&c, r, &out)));
    }
    {
      grpc::ClientContext c;
      v1::AppendAttendRequest r;
      r.set_cache_id(id);
      v1::AppendAttendResponse out;
      answers.push_back(Answer(stub->AppendAttend(&c, r, &out)));
    }
    {
      grpc::ClientContext c;
      v1::DropCacheRequest r;
      r.set_cache_id(id);
      v1::DropCacheResponse out;
      answers.push_back(Answer(stub->DropCache(&c, r, &out)));
    }
    return answers;
  }

  std::string Scrape() {
    httplib::Client http("127.0.0.1", server_->metrics_port());
    httplib::Result result = http.Get("/metrics");
    return result ? result->body : std::string();
  }

  Fixture f_;
  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> a_, b_;
};

const std::string kTwoTenants = absl::StrCat(
    kTokenA, " team-a kv_pages=4 shm_regions=1 bytes_in_flight=4096\n", kTokenB, " team-b\n");

// a_ and b_ have equal channel arguments, so gRPC's global subchannel pool
// gives them one TCP connection: calls with different tokens share it, which
// is what a per-connection identity would get wrong (it did, once: gRPC 1.51
// hands the auth processor the connection's auth context).
TEST_F(TenantTest, AnotherTenantsCacheAnswersExactlyAsANeverExistingOne) {
  Start(kTwoTenants);
  ASSERT_TRUE(CreateCache(a_, "shared-name", 32).ok());
  // B on A's cache, and B on a name nobody ever used: the same bytes.
  const std::vector<std::string> on_a_cache = KvAnswers(b_, "shared-name");
  const std::vector<std::string> never = KvAnswers(b_, "never-created");
  ASSERT_EQ(on_a_cache.size(), never.size());
  for (size_t i = 0; i < never.size(); ++i) {
    // The id is echoed in the message: compare with it swapped.
    std::string expected = never[i];
    for (size_t at; (at = expected.find("never-created")) != std::string::npos;) {
      expected.replace(at, std::string("never-created").size(), "shared-name");
    }
    EXPECT_EQ(on_a_cache[i], expected) << "call " << i;
  }
  EXPECT_TRUE(absl::StartsWith(on_a_cache[0], absl::StrCat(grpc::StatusCode::NOT_FOUND, "\n")))
      << on_a_cache[0];
  // And B's DropCache did not touch A's cache; after A drops it, B's answer
  // is unchanged (it never could tell).
  grpc::ClientContext c;
  v1::GetCacheStatsRequest r;
  r.set_cache_id("shared-name");
  v1::GetCacheStatsResponse out;
  EXPECT_TRUE(v1::KvCache::NewStub(a_)->GetCacheStats(&c, r, &out).ok());
  ASSERT_EQ(KvAnswers(a_, "shared-name").back(), Answer(grpc::Status::OK));  // A drops it
  EXPECT_EQ(KvAnswers(b_, "shared-name"), on_a_cache);
  // B may use the same name for a cache of its own.
  EXPECT_TRUE(CreateCache(b_, "shared-name", 32).ok());
}

TEST_F(TenantTest, QuotasAreEnforcedWithResourceExhaustedNamingTheQuota) {
  Start(kTwoTenants);
  // kv_pages=4 with 16-token pages: 64 tokens fit, one token more does not.
  ASSERT_TRUE(CreateCache(a_, "c1", 48).ok());
  const grpc::Status over = CreateCache(a_, "c2", 32);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(over.error_message(), "kv_pages")) << over.error_message();
  EXPECT_TRUE(CreateCache(a_, "c2", 16).ok());
  EXPECT_TRUE(CreateCache(b_, "big", 1024).ok());  // B has no quota

  // bytes_in_flight=4096: the small request fits, a 16 KiB one never can.
  EXPECT_TRUE(CallForward(a_).ok());
  v1::ForwardRequest big = SmallRequest();
  big.set_request_id(std::string(1000, 'x'));
  big.mutable_q()->set_data(std::string(4 * 8 * 4, '\0'));
  for (v1::Tensor* t : {big.mutable_k(), big.mutable_v()}) {
    t->set_shape(1, 128);
    t->set_data(std::string(128 * 8 * 4, '\0'));
  }
  const grpc::Status too_big = CallForward(a_, big);
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(too_big.error_message(), "bytes_in_flight"))
      << too_big.error_message();
  EXPECT_TRUE(CallForward(b_, big).ok());

  const std::string metrics = Scrape();
  EXPECT_TRUE(absl::StrContains(
      metrics, "attnserve_tenant_quota_refusals_total{tenant=\"team-a\",quota=\"kv_pages\"} 1"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics,
      "attnserve_tenant_quota_refusals_total{tenant=\"team-a\",quota=\"bytes_in_flight\"} 1"));
  EXPECT_TRUE(absl::StrContains(metrics, "attnserve_tenant_bytes_in_flight{tenant=\"team-a\"} 0"));
  EXPECT_TRUE(absl::StrContains(metrics, "attnserve_tenant_calls_total{tenant=\"team-b\"}"));
}

// ---- Tenants: KServe shared-memory regions ----

class ShmObject {
 public:
  // With tokens a tenant registers only keys under its own prefix (SECURITY.md).
  ShmObject(const std::string& tenant, const std::string& tag)
      : key_(absl::StrCat("/attnserve.", tenant, ".sec_", tag, getpid())) {
    shm_unlink(key_.c_str());
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ok_ = fd >= 0 && ftruncate(fd, 4096) == 0;
    if (fd >= 0) close(fd);
  }
  ~ShmObject() { shm_unlink(key_.c_str()); }
  bool ok() const { return ok_; }
  const std::string& key() const { return key_; }

 private:
  std::string key_;
  bool ok_ = false;
};

grpc::Status RegisterRegion(const std::shared_ptr<grpc::Channel>& channel, const std::string& name,
                            const std::string& key) {
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(4096);
  grpc::ClientContext context;
  inference::SystemSharedMemoryRegisterResponse response;
  return inference::GRPCInferenceService::NewStub(channel)->SystemSharedMemoryRegister(
      &context, request, &response);
}

std::string RegionStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& name) {
  inference::SystemSharedMemoryStatusRequest request;
  request.set_name(name);
  grpc::ClientContext context;
  inference::SystemSharedMemoryStatusResponse response;
  const grpc::Status status =
      inference::GRPCInferenceService::NewStub(channel)->SystemSharedMemoryStatus(&context, request,
                                                                                  &response);
  return Answer(status) + response.SerializeAsString();
}

TEST_F(TenantTest, AnotherTenantsRegionAnswersExactlyAsANeverExistingOne) {
  Start(kTwoTenants, /*shm=*/true);
  ShmObject object("team-a", "a");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(RegisterRegion(a_, "region", object.key()).ok());
  const std::string on_a_region = RegionStatus(b_, "region");
  // The same name, never registered by anyone, on a fresh server.
  server_->Shutdown(absl::Seconds(5));
  server_.reset();
  Start(kTwoTenants, /*shm=*/true);
  EXPECT_EQ(on_a_region, RegionStatus(b_, "region"));
  EXPECT_TRUE(absl::StartsWith(on_a_region, absl::StrCat(grpc::StatusCode::NOT_FOUND, "\n")))
      << on_a_region;
  // B listing everything sees none of A's regions.
  ASSERT_TRUE(RegisterRegion(a_, "region", object.key()).ok());
  EXPECT_EQ(RegionStatus(b_, ""), Answer(grpc::Status::OK));
  // shm_regions=1 for A: a second region is refused naming the quota.
  const grpc::Status second = RegisterRegion(a_, "second", object.key());
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(second.error_message(), "shm_regions")) << second.error_message();
  // Region names are per tenant: B may use the same name, for its own object;
  // A's key is not B's to register (SECURITY.md, client shared memory).
  ShmObject b_object("team-b", "b");
  ASSERT_TRUE(b_object.ok());
  EXPECT_TRUE(RegisterRegion(b_, "region", b_object.key()).ok());
  EXPECT_EQ(RegisterRegion(b_, "stolen", object.key()).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

// ---- HTTP side: HTTPS with the token ----

TEST(HttpsTest, KserveHttpAndMetricsOverHttpsWithTokens) {
  Fixture f;
  ServerOptions options = BaseOptions();
  options.tls = {f.path("server.pem"), f.path("server.key"), "", absl::Seconds(1)};
  options.auth = {TokensFile(f, absl::StrCat(kTokenA, " team-a\n")), absl::Seconds(10)};
  options.kserve.http_enabled = true;
  options.kserve.http_host = "127.0.0.1";
  options.kserve.http_port = 0;
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  std::unique_ptr<AttnServer> server = StartServer(options);
  ASSERT_NE(server, nullptr);

  httplib::SSLClient v2("localhost", server->http_port());
  v2.set_ca_cert_path(f.path("ca.pem"));
  v2.enable_server_certificate_verification(true);
  httplib::Result live = v2.Get("/v2/health/live");
  ASSERT_TRUE(live) << httplib::to_string(live.error());
  EXPECT_EQ(live->status, 200);
  httplib::Result anonymous = v2.Get("/v2");
  ASSERT_TRUE(anonymous);
  EXPECT_EQ(anonymous->status, 401);
  httplib::Result with_token = v2.Get("/v2", {{"Authorization", absl::StrCat("Bearer ", kTokenA)}});
  ASSERT_TRUE(with_token);
  EXPECT_EQ(with_token->status, 200) << with_token->body;
  // Two Authorization headers, junk then valid: refused whichever a check reads.
  httplib::Headers two = {{"Authorization", "Bearer junk-junk-junk-junk-junk"},
                          {"Authorization", absl::StrCat("Bearer ", kTokenA)}};
  httplib::Result doubled = v2.Get("/v2", two);
  ASSERT_TRUE(doubled);
  EXPECT_EQ(doubled->status, 401) << doubled->body;

  httplib::SSLClient metrics("localhost", server->metrics_port());
  metrics.set_ca_cert_path(f.path("ca.pem"));
  metrics.enable_server_certificate_verification(true);
  httplib::Result scrape = metrics.Get("/metrics");
  ASSERT_TRUE(scrape) << httplib::to_string(scrape.error());
  EXPECT_TRUE(absl::StrContains(scrape->body, "attnserve_unauthenticated_calls_total 2"))
      << scrape->body;
  // Plain HTTP to the HTTPS port gets no metrics.
  httplib::Client plain("127.0.0.1", server->metrics_port());
  httplib::Result refused = plain.Get("/metrics");
  EXPECT_TRUE(!refused || refused->status != 200);
  server->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace attnserve
