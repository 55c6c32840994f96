// Issue 27 finding 5 over the wire: a call whose handling throws is answered
// with a clear error and gives its in-flight count back, so the drain that a
// SIGTERM starts finishes at once instead of waiting the whole grace. The
// throw comes from the backend (planning run inline on the receiving thread,
// and the host memory a unary AppendAttend's tensors are parsed into), on a
// real AttnServer: native unary Forward and AppendAttend, KServe ModelInfer
// over gRPC and the v2 HTTP infer route. Before the boundary, gRPC answered
// UNIMPLEMENTED with an empty message, httplib 500 with an EXCEPTION_WHAT
// header, and Shutdown waited its grace.
#include <httplib.h>

#include <atomic>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/cpu/cpu_backend.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"

namespace attnserve {
namespace {

constexpr char kInjected[] = "injected backend failure";

// The CPU backend, throwing from its planning or its host allocations while
// told to (never with a Status: the throw is the fault under test).
class ThrowingCpuBackend final : public CpuBackend {
 public:
  ThrowingCpuBackend() : CpuBackend(1) {}
  absl::StatusOr<Plan> CanImplement(const AttnParams& p) const override {
    if (throw_plans) throw std::runtime_error(kInjected);
    return CpuBackend::CanImplement(p);
  }
  absl::Status Forward(const Plan& plan, const AttnParams& p, BackendTimings* timings) override {
    if (throw_forwards) throw std::runtime_error(kInjected);
    return CpuBackend::Forward(plan, p, timings);
  }
  std::shared_ptr<char> AllocateHostTensor(int64_t bytes) override {
    if (host_allocations_to_throw_.load() > 0 && host_allocations_to_throw_.fetch_sub(1) == 1) {
      throw std::runtime_error(kInjected);
    }
    return CpuBackend::AllocateHostTensor(bytes);
  }
  // The n-th host allocation from now throws (a unary AppendAttend's q, k and
  // v are the first three, its o the fourth).
  void ThrowAtHostAllocation(int n) { host_allocations_to_throw_ = n; }
  std::atomic<bool> throw_plans{false};
  std::atomic<bool> throw_forwards{false};

 private:
  std::atomic<int> host_allocations_to_throw_{0};
};

// Four query rows of one head of dimension 8, FP32 zeros: [B, S, H, D].
v1::ForwardRequest SmallForward() {
  v1::ForwardRequest request;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::FP32);
    for (int d : {1, 4, 1, 8}) t->add_shape(d);
    t->set_data(std::string(4 * 8 * sizeof(float), '\0'));
  }
  return request;
}

inference::ModelInferRequest SmallModelInfer() {
  inference::ModelInferRequest request;
  request.set_model_name("attention");
  for (const char* name : {"q", "k", "v"}) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int d : {1, 4, 1, 8}) input->add_shape(d);
    request.add_raw_input_contents(std::string(4 * 8 * sizeof(float), '\0'));
  }
  return request;
}

std::string SmallJsonInfer() {
  std::string data = "[";
  for (int i = 0; i < 32; ++i) data += i == 0 ? "0.5" : ",0.5";
  data += "]";
  std::string inputs;
  for (const char* name : {"q", "k", "v"}) {
    if (!inputs.empty()) inputs += ",";
    inputs += absl::StrCat(R"({"name":")", name, R"(","datatype":"FP32","shape":[1,4,1,8],"data":)",
                           data, "}");
  }
  return absl::StrCat(R"({"inputs":[)", inputs, "]}");
}

// One decode step of sequence 1 of `cache` at `length` (FP32, one head of 8).
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

class ThrowingHandlerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = std::make_unique<ThrowingCpuBackend>();
    backend_ = backend.get();
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    // Every call here finds its device idle and is planned and launched on
    // the thread that received it, inside the handler (unless a test says).
    options.inline_max_cost = Inline() ? int64_t{1} << 40 : 0;
    options.kserve.http_enabled = true;
    options.kserve.http_host = "127.0.0.1";
    options.kserve.http_port = 0;
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Create(options, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
  }
  virtual bool Inline() const { return true; }

  static void ExpectClearError(const grpc::Status& status, const std::string& what) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL)
        << what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(kInjected), std::string::npos)
        << what << ": '" << status.error_message() << "'";
  }

  grpc::Status Forward() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ForwardResponse response;
    return v1::Attention::NewStub(channel_)->Forward(&context, SmallForward(), &response);
  }
  grpc::Status ModelInfer() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    inference::ModelInferResponse response;
    return inference::GRPCInferenceService::NewStub(channel_)->ModelInfer(
        &context, SmallModelInfer(), &response);
  }
  httplib::Result HttpInfer() {
    httplib::Client client("127.0.0.1", server_->http_port());
    client.set_read_timeout(30, 0);
    return client.Post("/v2/models/attention/infer", SmallJsonInfer(), "application/json");
  }

  // The evidence that no call is still counted in flight: a drain with a
  // long grace ends at once (a leaked count made it wait the whole grace).
  void ExpectPromptShutdown() {
    const absl::Time start = absl::Now();
    server_->Shutdown(absl::Seconds(20));
    server_->Wait();
    const absl::Duration took = absl::Now() - start;
    EXPECT_LT(took, absl::Seconds(8)) << "the drain waited for a call that was never answered";
    server_.reset();
  }

  ThrowingCpuBackend* backend_ = nullptr;
  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ThrowingHandlerTest, UnaryForwardAnswersTheExceptionAndServesOn) {
  backend_->throw_plans = true;
  ExpectClearError(Forward(), "Forward");
  backend_->throw_plans = false;
  // The executor is not left believing a call is still running on the
  // thread that threw: the next call is served.
  const grpc::Status next = Forward();
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

TEST_F(ThrowingHandlerTest, KserveModelInferAnswersTheExceptionAndServesOn) {
  backend_->throw_plans = true;
  ExpectClearError(ModelInfer(), "ModelInfer");
  backend_->throw_plans = false;
  const grpc::Status next = ModelInfer();
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

TEST_F(ThrowingHandlerTest, HttpInferAnswersAV2ErrorAndServesOn) {
  backend_->throw_plans = true;
  httplib::Result res = HttpInfer();
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 500) << res->body;
  EXPECT_FALSE(res->has_header("EXCEPTION_WHAT")) << res->get_header_value("EXCEPTION_WHAT");
  // A v2 error body: {"error": "<what happened>"}.
  EXPECT_EQ(res->body.rfind(R"({"error":")", 0), 0u) << res->body;
  EXPECT_NE(res->body.find(kInjected), std::string::npos) << res->body;
  backend_->throw_plans = false;
  res = HttpInfer();
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200) << res->body;
  ExpectPromptShutdown();
}

TEST_F(ThrowingHandlerTest, UnaryForwardAnswersALaunchThatThrowsAndServesOn) {
  backend_->throw_forwards = true;
  ExpectClearError(Forward(), "Forward (launch)");
  backend_->throw_forwards = false;
  const grpc::Status next = Forward();
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

// The same throws on the executor's own threads (the calls are handed to its
// launcher): nothing above them catches, so before the executor did, the
// process terminated.
class ThrowingLauncherTest : public ThrowingHandlerTest {
 protected:
  bool Inline() const override { return false; }
};

TEST_F(ThrowingLauncherTest, APlanThatThrowsIsAnsweredAndTheServerServesOn) {
  backend_->throw_plans = true;
  ExpectClearError(Forward(), "Forward (plan on the launcher)");
  backend_->throw_plans = false;
  const grpc::Status next = Forward();
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

TEST_F(ThrowingLauncherTest, ALaunchThatThrowsIsAnsweredAndTheServerServesOn) {
  backend_->throw_forwards = true;
  ExpectClearError(ModelInfer(), "ModelInfer (launch on the launcher)");
  backend_->throw_forwards = false;
  const grpc::Status next = ModelInfer();
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

// A cache "c" with sequence 1, and its unary AppendAttend of one decode step.
class ThrowingKvHandlerTest : public ThrowingHandlerTest {
 protected:
  void SetUp() override {
    ThrowingHandlerTest::SetUp();
    stub_ = v1::KvCache::NewStub(channel_);
    v1::CreateCacheRequest create;
    create.mutable_geometry()->set_num_layers(1);
    create.mutable_geometry()->set_num_heads_kv(1);
    create.mutable_geometry()->set_head_dim(8);
    create.mutable_geometry()->set_dtype(v1::FP32);
    create.set_capacity_tokens(64);
    create.set_cache_id("c");
    grpc::ClientContext c1;
    v1::CreateCacheResponse created;
    ASSERT_TRUE(stub_->CreateCache(&c1, create, &created).ok());
    v1::CreateSequencesRequest sequences;
    sequences.set_cache_id("c");
    sequences.add_sequences()->set_sequence_id(1);
    grpc::ClientContext c2;
    v1::CreateSequencesResponse made;
    ASSERT_TRUE(stub_->CreateSequences(&c2, sequences, &made).ok());
  }
  grpc::Status Append(int32_t length) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::AppendAttendResponse response;
    return stub_->AppendAttend(&context, DecodeStep("c", length), &response);
  }
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// q, k and v are parsed into the backend's host memory in the handler
// itself, before any runner: its throw is answered there.
TEST_F(ThrowingKvHandlerTest, UnaryAppendAttendParseAnswersTheExceptionAndServesOn) {
  backend_->ThrowAtHostAllocation(1);
  ExpectClearError(Append(0), "AppendAttend (parse)");
  // Nothing was appended: the step at length 0 is still the next one.
  const grpc::Status next = Append(0);
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

// o's host memory is taken by the K/V runner: its throw is answered there,
// and o's charge and the step's place are given back.
TEST_F(ThrowingKvHandlerTest, UnaryAppendAttendOutputAnswersTheExceptionAndServesOn) {
  backend_->ThrowAtHostAllocation(4);
  ExpectClearError(Append(0), "AppendAttend (o)");
  const grpc::Status next = Append(0);
  EXPECT_TRUE(next.ok()) << next.error_message();
  ExpectPromptShutdown();
}

}  // namespace
}  // namespace attnserve
