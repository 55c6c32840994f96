// Integration tests: a real AttnServer on 127.0.0.1:0 with the CPU backend,
// called over the wire with the raw generated stubs. Results are checked
// against the float64 reference with docs/design.md §4's tolerances (tests/common);
// every error code the server can produce is provoked, and after each the
// server must still answer a valid request.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/backend_factory.h"
#include "common/dtype.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/common/attn_test_util.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;
using HealthStub = grpc::health::v1::Health::Stub;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// --- wire helpers ---------------------------------------------------------------

void SetTensor(v1::Tensor* t, DType dtype, std::vector<int64_t> shape, const void* data,
               int64_t bytes) {
  t->set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t->add_shape(d);
  t->mutable_data()->assign(static_cast<const char*>(data), static_cast<size_t>(bytes));
}

// The ForwardRequest that carries `buf`'s case and inputs.
v1::ForwardRequest MakeRequest(const HostBuffers& buf, const std::string& id) {
  const TestCase& tc = buf.test_case();
  const AttnParams& p = buf.params();
  v1::ForwardRequest r;
  r.set_request_id(id);
  if (tc.varlen()) {
    SetTensor(r.mutable_q(), tc.dtype, {p.total_q, p.num_heads_q, p.head_dim}, buf.q(),
              buf.q_bytes());
    SetTensor(r.mutable_k(), tc.dtype, {p.total_k, p.num_heads_kv, p.head_dim}, buf.k(),
              buf.kv_bytes());
    SetTensor(r.mutable_v(), tc.dtype, {p.total_k, p.num_heads_kv, p.head_dim}, buf.v(),
              buf.kv_bytes());
    for (int b = 0; b <= p.batch; ++b) {
      r.add_cu_seqlens_q(buf.cu_seqlens_q()[b]);
      r.add_cu_seqlens_k(buf.cu_seqlens_k()[b]);
    }
  } else {
    SetTensor(r.mutable_q(), tc.dtype, {p.batch, p.seqlen_q, p.num_heads_q, p.head_dim}, buf.q(),
              buf.q_bytes());
    SetTensor(r.mutable_k(), tc.dtype, {p.batch, p.seqlen_k, p.num_heads_kv, p.head_dim}, buf.k(),
              buf.kv_bytes());
    SetTensor(r.mutable_v(), tc.dtype, {p.batch, p.seqlen_k, p.num_heads_kv, p.head_dim}, buf.v(),
              buf.kv_bytes());
  }
  v1::AttentionOptions* o = r.mutable_options();
  o->set_causal(tc.causal);
  if (tc.window_left != kNoWindow) o->set_window_left(tc.window_left);
  if (tc.window_right != kNoWindow) o->set_window_right(tc.window_right);
  o->set_softcap(tc.softcap);
  if (tc.softmax_scale != 0.0f) o->set_softmax_scale(tc.softmax_scale);
  o->set_return_lse(tc.return_lse);
  if (tc.dtype == DType::kFP8E4M3) {
    o->set_q_descale(tc.q_descale);
    o->set_k_descale(tc.k_descale);
    o->set_v_descale(tc.v_descale);
  }
  return r;
}

// The response carries O (and LSE) of the right dtype and shape, within
// tolerance of the float64 reference.
void ExpectMatchesReference(const HostBuffers& buf, const v1::ForwardRequest& request,
                            const v1::ForwardResponse& response) {
  const TestCase& tc = buf.test_case();
  const AttnParams& p = buf.params();
  EXPECT_EQ(response.error_code(), 0) << response.error_message();
  EXPECT_EQ(response.request_id(), request.request_id());
  EXPECT_EQ(response.backend(), "cpu");
  // O has the inputs' dtype, except BF16 for FP8 inputs.
  EXPECT_EQ(response.o().dtype(),
            static_cast<v1::DType>(OutputDType(static_cast<DType>(request.q().dtype()))));
  EXPECT_EQ(std::vector<int64_t>(response.o().shape().begin(), response.o().shape().end()),
            std::vector<int64_t>(request.q().shape().begin(), request.q().shape().end()));
  ASSERT_EQ(static_cast<int64_t>(response.o().data().size()), buf.o_bytes());
  // Copies: the checker reads typed elements, and string storage promises no alignment.
  std::vector<uint8_t> o(response.o().data().begin(), response.o().data().end());
  std::vector<float> lse;
  if (tc.return_lse) {
    EXPECT_EQ(response.lse().dtype(), v1::FP32);
    const std::vector<int64_t> expected_shape =
        tc.varlen() ? std::vector<int64_t>{p.num_heads_q, p.total_q}
                    : std::vector<int64_t>{p.batch, p.num_heads_q, p.seqlen_q};
    EXPECT_EQ(std::vector<int64_t>(response.lse().shape().begin(), response.lse().shape().end()),
              expected_shape);
    ASSERT_EQ(static_cast<int64_t>(response.lse().data().size()),
              buf.lse_elements() * static_cast<int64_t>(sizeof(float)));
    lse.resize(buf.lse_elements());
    std::memcpy(lse.data(), response.lse().data().data(), response.lse().data().size());
  } else {
    EXPECT_FALSE(response.has_lse()) << "LSE sent without return_lse";
  }
  EXPECT_TRUE(CheckOutput(buf, o.data(), tc.return_lse ? lse.data() : nullptr)) << tc.Name();
}

std::shared_ptr<grpc::Channel> Connect(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

ServerOptions LoopbackOptions() {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  return options;
}

// A server and stubs for one test (or one suite).
struct Harness {
  std::unique_ptr<AttnServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Attention::Stub> stub;
  std::unique_ptr<HealthStub> health;

  static std::unique_ptr<Harness> Start(const ServerOptions& options,
                                        std::unique_ptr<AttentionBackend> backend) {
    auto h = std::make_unique<Harness>();
    auto server = AttnServer::Create(options, std::move(backend));
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    h->server = *std::move(server);
    const absl::Status started = h->server->Start();
    EXPECT_TRUE(started.ok()) << started;
    if (!started.ok()) return nullptr;
    h->channel = Connect(h->server->port());
    h->stub = v1::Attention::NewStub(h->channel);
    h->health = grpc::health::v1::Health::NewStub(h->channel);
    return h;
  }

  grpc::Status Forward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                       absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoSeconds(timeout));
    return stub->Forward(&ctx, request, response);
  }

  HealthCheckResponse::ServingStatus Health(const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    const grpc::Status s = health->Check(&ctx, request, &response);
    return s.ok() ? response.status() : HealthCheckResponse::UNKNOWN;
  }

  // A small valid request succeeds: the server is still serving.
  void ExpectStillServing() {
    TestCase tc;
    tc.dtype = DType::kFP16;
    tc.seqlen_q = 3;
    tc.seqlen_k = 5;
    tc.head_dim = 16;
    HostBuffers buf(tc);
    const v1::ForwardRequest request = MakeRequest(buf, "still-serving");
    v1::ForwardResponse response;
    const grpc::Status s = Forward(request, &response);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    ExpectMatchesReference(buf, request, response);
  }
};

// An asynchronous unary Forward (the generated callback client), for requests
// that must be in flight while the test does something else.
struct AsyncForward {
  grpc::ClientContext ctx;
  v1::ForwardRequest request;
  v1::ForwardResponse response;
  grpc::Status status;
  absl::Notification done;

  void Start(v1::Attention::Stub* stub, absl::Duration timeout = absl::Seconds(60)) {
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    stub->async()->Forward(&ctx, &request, &response, [this](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
  }
  bool Wait(absl::Duration timeout = absl::Seconds(30)) {
    return done.WaitForNotificationWithTimeout(timeout);
  }
};

// --- the shared server -----------------------------------------------------------

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    spdlog::set_level(spdlog::level::warn);
    harness_ = Harness::Start(LoopbackOptions(), MakeCpuBackend(2)).release();
  }
  static void TearDownTestSuite() {
    delete harness_;
    harness_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(harness_, nullptr); }

  static Harness* harness_;
};
Harness* ServerTest::harness_ = nullptr;

// Every dtype and layout, causal, windows, softcap, GQA/MQA, LSE, Sq != Sk.
std::vector<TestCase> WireCases() {
  std::vector<TestCase> cases;
  for (DType t : {DType::kFP16, DType::kBF16, DType::kFP32}) {
    TestCase dense;
    dense.dtype = t;
    dense.batch = 2;
    dense.seqlen_q = 17;
    dense.seqlen_k = 17;
    dense.num_heads_q = 4;
    dense.num_heads_kv = 4;
    dense.head_dim = 64;
    cases.push_back(dense);

    TestCase causal_gqa = dense;
    causal_gqa.causal = true;
    causal_gqa.num_heads_kv = 1;  // MQA
    causal_gqa.seqlen_k = 40;     // Sq != Sk: bottom-right aligned
    cases.push_back(causal_gqa);

    TestCase varlen;
    varlen.dtype = t;
    varlen.seqlens_q = {5, 0, 17, 1};
    varlen.seqlens_k = {9, 3, 17, 0};
    varlen.num_heads_q = 8;
    varlen.num_heads_kv = 2;  // GQA 4:1
    varlen.head_dim = 32;
    varlen.causal = t == DType::kBF16;
    cases.push_back(varlen);
  }
  TestCase window;
  window.dtype = DType::kBF16;
  window.seqlen_q = 33;
  window.seqlen_k = 33;
  window.num_heads_q = 2;
  window.num_heads_kv = 1;
  window.head_dim = 128;
  window.window_left = 5;
  window.window_right = 2;
  window.softcap = 15.0f;
  window.softmax_scale = 0.2f;
  cases.push_back(window);

  // FP8 inputs with descales: O comes back BF16, checked against the float64
  // reference on the dequantised inputs.
  TestCase fp8 = cases.front();
  fp8.dtype = DType::kFP8E4M3;
  fp8.q_descale = 0.5f;
  fp8.k_descale = 1.75f;
  fp8.v_descale = 0.3f;
  cases.push_back(fp8);
  TestCase fp8_varlen = cases[2];
  fp8_varlen.dtype = DType::kFP8E4M3;
  fp8_varlen.causal = true;
  fp8_varlen.v_descale = 4.0f;  // q/k descales left at 1
  cases.push_back(fp8_varlen);

  TestCase no_lse;
  no_lse.dtype = DType::kFP16;
  no_lse.seqlen_q = 7;
  no_lse.seqlen_k = 1;
  no_lse.head_dim = 256;
  no_lse.return_lse = false;
  cases.push_back(no_lse);
  return cases;
}

TEST_F(ServerTest, ForwardMatchesReference) {
  for (const TestCase& tc : WireCases()) {
    SCOPED_TRACE(tc.Name());
    HostBuffers buf(tc);
    const v1::ForwardRequest request = MakeRequest(buf, tc.Name());
    v1::ForwardResponse response;
    const grpc::Status s = harness_->Forward(request, &response);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    ExpectMatchesReference(buf, request, response);
    const v1::ServerTiming& t = response.timing();
    EXPECT_GE(t.queue_us(), 0);
    EXPECT_GE(t.compute_us(), 0);
    EXPECT_EQ(t.host_to_device_us(), 0);
    EXPECT_EQ(t.device_to_host_us(), 0);
    EXPECT_GE(t.total_us(), t.compute_us());
    EXPECT_GT(t.total_us(), 0);
  }
}

// 32 MiB, well over gRPC's default 4 MiB receive limit, which the server raises.
TEST_F(ServerTest, LargeRequestOverGrpcDefaultLimit) {
  TestCase decode;
  decode.dtype = DType::kFP32;
  decode.seqlen_q = 1;
  decode.seqlen_k = 8192;
  decode.num_heads_q = 8;
  decode.num_heads_kv = 8;
  decode.head_dim = 64;
  HostBuffers buf(decode);
  const v1::ForwardRequest request = MakeRequest(buf, "large");
  ASSERT_GT(request.ByteSizeLong(), 32u << 20);
  v1::ForwardResponse response;
  const grpc::Status s = harness_->Forward(request, &response);
  ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  ExpectMatchesReference(buf, request, response);
}

// --- INVALID_ARGUMENT, one per class of bad field -------------------------------

struct BadRequest {
  std::string what;
  std::string field;  // the message must name it
  std::function<void(v1::ForwardRequest*)> spoil;
};

v1::ForwardRequest ValidDense() {
  TestCase tc;
  tc.dtype = DType::kFP16;
  tc.batch = 2;
  tc.seqlen_q = 5;
  tc.seqlen_k = 6;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  tc.head_dim = 16;
  HostBuffers buf(tc);
  return MakeRequest(buf, "dense");
}

v1::ForwardRequest ValidVarlen() {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.seqlens_q = {3, 4};
  tc.seqlens_k = {2, 5};
  tc.num_heads_q = 2;
  tc.num_heads_kv = 2;
  tc.head_dim = 16;
  HostBuffers buf(tc);
  return MakeRequest(buf, "varlen");
}

std::vector<BadRequest> BadRequests() {
  auto resize = [](v1::Tensor* t, int axis, int64_t size) {
    t->set_shape(axis, size);
    int64_t n = 1;
    for (int64_t d : t->shape()) n *= d;
    t->mutable_data()->resize(static_cast<size_t>(n * DTypeSize(static_cast<DType>(t->dtype()))));
  };
  return {
      {"byte length", "q.data",
       [](v1::ForwardRequest* r) { r->mutable_q()->mutable_data()->pop_back(); }},
      {"unknown dtype", "k.dtype",
       [](v1::ForwardRequest* r) { r->mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"mixed dtype", "v.dtype",
       [](v1::ForwardRequest* r) {
         r->mutable_v()->set_dtype(v1::FP32);
         r->mutable_v()->mutable_data()->append(r->v().data());
       }},
      {"rank", "q.shape",
       [](v1::ForwardRequest* r) {
         r->mutable_q()->mutable_shape()->RemoveLast();
         r->mutable_q()->mutable_shape()->RemoveLast();
       }},
      {"shape mismatch", "v.shape",
       [resize](v1::ForwardRequest* r) { resize(r->mutable_v(), 1, 3); }},
      {"batch mismatch", "k.shape[0]",
       [resize](v1::ForwardRequest* r) {
         resize(r->mutable_k(), 0, 1);
         resize(r->mutable_v(), 0, 1);
       }},
      {"Hq % Hkv", "k.shape[2]",
       [resize](v1::ForwardRequest* r) {
         resize(r->mutable_k(), 2, 3);
         resize(r->mutable_v(), 2, 3);
       }},
      {"D out of range", "q.shape[3]",
       [resize](v1::ForwardRequest* r) {
         resize(r->mutable_q(), 3, 512);
         resize(r->mutable_k(), 3, 512);
         resize(r->mutable_v(), 3, 512);
       }},
      {"D not a multiple of 8", "q.shape[3]",
       [resize](v1::ForwardRequest* r) {
         resize(r->mutable_q(), 3, 20);
         resize(r->mutable_k(), 3, 20);
         resize(r->mutable_v(), 3, 20);
       }},
      {"cu_seqlens on dense", "cu_seqlens_q",
       [](v1::ForwardRequest* r) {
         r->add_cu_seqlens_q(0);
         r->add_cu_seqlens_q(5);
       }},
      {"negative window", "options.window_left",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_window_left(-3); }},
      {"non-positive scale", "options.softmax_scale",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_softmax_scale(0.0f); }},
      {"non-finite scale", "options.softmax_scale",
       [](v1::ForwardRequest* r) {
         r->mutable_options()->set_softmax_scale(std::numeric_limits<float>::infinity());
       }},
      {"negative softcap", "options.softcap",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_softcap(-2.0f); }},
      {"descale on FP16 inputs", "options.k_descale",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_k_descale(1.0f); }},
  };
}

// ValidDense as FP8: the same shapes with one-byte codes.
v1::ForwardRequest ValidDenseFp8() {
  v1::ForwardRequest r = ValidDense();
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(v1::FP8_E4M3);
    t->mutable_data()->resize(t->data().size() / 2);
  }
  return r;
}

std::vector<BadRequest> BadFp8Requests() {
  return {
      {"zero descale", "options.q_descale",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_q_descale(0.0f); }},
      {"negative descale", "options.k_descale",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_k_descale(-1.0f); }},
      {"descale over 128", "options.v_descale",
       [](v1::ForwardRequest* r) { r->mutable_options()->set_v_descale(200.0f); }},
      {"NaN descale", "options.v_descale",
       [](v1::ForwardRequest* r) {
         r->mutable_options()->set_v_descale(std::numeric_limits<float>::quiet_NaN());
       }},
      {"FP8 byte length", "q.data",
       [](v1::ForwardRequest* r) { r->mutable_q()->mutable_data()->append(1, '\0'); }},
  };
}

std::vector<BadRequest> BadVarlenRequests() {
  return {
      {"varlen without cu_seqlens", "cu_seqlens_q",
       [](v1::ForwardRequest* r) {
         r->clear_cu_seqlens_q();
         r->clear_cu_seqlens_k();
       }},
      {"only one cu_seqlens", "cu_seqlens_k",
       [](v1::ForwardRequest* r) { r->clear_cu_seqlens_k(); }},
      {"cu_seqlens length", "cu_seqlens_k", [](v1::ForwardRequest* r) { r->add_cu_seqlens_k(7); }},
      {"cu_seqlens start", "cu_seqlens_q[0]",
       [](v1::ForwardRequest* r) { r->set_cu_seqlens_q(0, 1); }},
      {"cu_seqlens decreasing", "cu_seqlens_k[2]",
       [](v1::ForwardRequest* r) { r->set_cu_seqlens_k(1, 8); }},  // {0, 8, 7}
      {"cu_seqlens last", "cu_seqlens_q[2]",
       [](v1::ForwardRequest* r) { r->set_cu_seqlens_q(2, 6); }},
  };
}

TEST_F(ServerTest, EveryInvalidFieldIsInvalidArgumentAndServerKeepsServing) {
  auto run = [&](const v1::ForwardRequest& valid, const std::vector<BadRequest>& bad) {
    for (const BadRequest& b : bad) {
      SCOPED_TRACE(b.what);
      v1::ForwardRequest request = valid;
      b.spoil(&request);
      v1::ForwardResponse response;
      const grpc::Status s = harness_->Forward(request, &response);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_NE(s.error_message().find(b.field), std::string::npos)
          << "message should name " << b.field << ": " << s.error_message();
      EXPECT_NE(s.error_message().find("expected"), std::string::npos) << s.error_message();
      harness_->ExpectStillServing();
    }
  };
  run(ValidDense(), BadRequests());
  run(ValidVarlen(), BadVarlenRequests());
  run(ValidDenseFp8(), BadFp8Requests());
}

TEST_F(ServerTest, EmptyRequestIsInvalidArgument) {
  v1::ForwardResponse response;
  const grpc::Status s = harness_->Forward(v1::ForwardRequest(), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("q.dtype"), std::string::npos) << s.error_message();
  harness_->ExpectStillServing();
}

// One log line per request (successful ones at debug, refused ones at info):
// id, shapes, dtype, status and microseconds; never tensor bytes (the line
// stays short whatever the tensor size).
TEST_F(ServerTest, OneShortLogLinePerRequest) {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  spdlog::default_logger()->sinks().push_back(sink);
  spdlog::set_level(spdlog::level::debug);

  TestCase tc;
  tc.dtype = DType::kFP32;
  tc.batch = 1;
  tc.seqlen_q = 300;
  tc.seqlen_k = 300;
  tc.num_heads_q = 2;
  tc.num_heads_kv = 2;
  tc.head_dim = 8;
  HostBuffers buf(tc);
  v1::ForwardResponse response;
  EXPECT_TRUE(harness_->Forward(MakeRequest(buf, "log-ok"), &response).ok());
  v1::ForwardRequest bad = MakeRequest(buf, "log-bad");
  bad.mutable_options()->set_softcap(-1.0f);
  EXPECT_FALSE(harness_->Forward(bad, &response).ok());
  // At the default level a successful call logs nothing.
  spdlog::set_level(spdlog::level::info);
  EXPECT_TRUE(harness_->Forward(MakeRequest(buf, "log-quiet"), &response).ok());

  spdlog::default_logger()->sinks().pop_back();
  spdlog::set_level(spdlog::level::warn);
  std::vector<std::string> ok_lines, bad_lines;
  std::istringstream lines(captured.str());
  for (std::string line; std::getline(lines, line);) {
    if (line.find("\"log-ok\"") != std::string::npos) ok_lines.push_back(line);
    if (line.find("\"log-bad\"") != std::string::npos) bad_lines.push_back(line);
  }
  ASSERT_EQ(ok_lines.size(), 1u) << captured.str();
  ASSERT_EQ(bad_lines.size(), 1u) << captured.str();
  EXPECT_EQ(captured.str().find("\"log-quiet\""), std::string::npos) << captured.str();
  for (const char* part :
       {"q=[1,300,2,8]", "k=[1,300,2,8]", "dtype=FP32", "status=OK", "total_us=", "compute_us="}) {
    EXPECT_NE(ok_lines[0].find(part), std::string::npos) << part << " in " << ok_lines[0];
  }
  EXPECT_NE(bad_lines[0].find("status=INVALID_ARGUMENT"), std::string::npos) << bad_lines[0];
  EXPECT_NE(bad_lines[0].find("options.softcap"), std::string::npos) << bad_lines[0];
  EXPECT_LT(ok_lines[0].size(), 400u) << "tensor bytes in the log? " << ok_lines[0];
}

// --- ForwardStream -------------------------------------------------------------------

TEST_F(ServerTest, StreamPipelinesAndReportsErrorsInBand) {
  std::vector<std::unique_ptr<HostBuffers>> buffers;
  std::vector<v1::ForwardRequest> requests;
  const std::vector<TestCase> cases = WireCases();
  for (size_t i = 0; i < cases.size(); ++i) {
    buffers.push_back(std::make_unique<HostBuffers>(cases[i]));
    requests.push_back(MakeRequest(*buffers.back(), absl::StrCat("s", i)));
  }
  // A bad request in the middle: wrong byte length.
  v1::ForwardRequest bad = ValidDense();
  bad.set_request_id("bad");
  bad.mutable_k()->mutable_data()->append("xx");
  requests.insert(requests.begin() + 3, bad);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = harness_->stub->ForwardStream(&ctx);
  for (const auto& r : requests) ASSERT_TRUE(stream->Write(r));
  ASSERT_TRUE(stream->WritesDone());

  std::map<std::string, v1::ForwardResponse> responses;
  v1::ForwardResponse response;
  while (stream->Read(&response)) {
    EXPECT_EQ(responses.count(response.request_id()), 0u) << "duplicate " << response.request_id();
    responses[response.request_id()] = response;
  }
  const grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  ASSERT_EQ(responses.size(), requests.size());

  const v1::ForwardResponse& err = responses["bad"];
  EXPECT_EQ(err.error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(err.error_message().find("k.data"), std::string::npos) << err.error_message();
  EXPECT_FALSE(err.has_o());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].Name());
    const std::string id = absl::StrCat("s", i);
    ASSERT_EQ(responses.count(id), 1u);
    const auto it = std::find_if(requests.begin(), requests.end(),
                                 [&](const v1::ForwardRequest& r) { return r.request_id() == id; });
    ExpectMatchesReference(*buffers[i], *it, responses[id]);
  }
}

TEST_F(ServerTest, StreamWithNoRequestsFinishesOk) {
  grpc::ClientContext ctx;
  auto stream = harness_->stub->ForwardStream(&ctx);
  ASSERT_TRUE(stream->WritesDone());
  v1::ForwardResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerTest, StreamCancelledByClientLeavesServerServing) {
  grpc::ClientContext ctx;
  auto stream = harness_->stub->ForwardStream(&ctx);
  TestCase tc;
  tc.seqlen_q = tc.seqlen_k = 97;
  tc.num_heads_q = tc.num_heads_kv = 4;
  HostBuffers buf(tc);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(stream->Write(MakeRequest(buf, absl::StrCat(i))));
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  harness_->ExpectStillServing();
}

// --- GetServerInfo, health, reflection ----------------------------------------------

TEST_F(ServerTest, GetServerInfo) {
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(harness_->stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.devices_size(), 0);
  const std::vector<int> dtypes(info.dtypes().begin(), info.dtypes().end());
  EXPECT_EQ(dtypes, (std::vector<int>{v1::FP16, v1::BF16, v1::FP32, v1::FP8_E4M3}));
  EXPECT_EQ(info.min_head_dim(), 8);
  EXPECT_EQ(info.max_head_dim(), 256);
  EXPECT_EQ(info.head_dim_multiple(), 8);
  const ServerOptions defaults;
  EXPECT_EQ(info.limits().max_request_bytes(), defaults.max_request_bytes);
  EXPECT_EQ(info.limits().max_tokens(), defaults.max_tokens);
  EXPECT_EQ(info.limits().max_queue_size(), defaults.max_queue_size);
  EXPECT_EQ(info.cpu_threads(), 2);
  const std::vector<std::string> features(info.features().begin(), info.features().end());
  for (const char* f :
       {"causal", "sliding_window", "softcap", "gqa", "varlen", "return_lse", "forward_stream"}) {
    EXPECT_NE(std::find(features.begin(), features.end(), f), features.end()) << f;
  }
}

TEST_F(ServerTest, HealthServing) {
  EXPECT_EQ(harness_->Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(harness_->Health("attnserve.v1.Attention"), HealthCheckResponse::SERVING);
}

// Calls grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo with
// list_services, hand-encoded (no reflection stubs are installed): field 7
// (list_services) = "" is the two bytes 0x3a 0x00.
TEST_F(ServerTest, ReflectionListsServices) {
  grpc::GenericStub generic(harness_->channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = generic.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&cq](intptr_t expected) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(step(1));
  const char request_bytes[] = {0x3a, 0x00};
  grpc::Slice slice(request_bytes, sizeof(request_bytes));
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(step(2));
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(3));
  ASSERT_TRUE(step(3));
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_NE(bytes.find("attnserve.v1.Attention"), std::string::npos);
  EXPECT_NE(bytes.find("grpc.health.v1.Health"), std::string::npos);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

// --- limits: RESOURCE_EXHAUSTED -------------------------------------------------------

TEST(ServerLimitsTest, TokenAndByteLimitsAreResourceExhausted) {
  ServerOptions options = LoopbackOptions();
  options.max_tokens = 64;
  options.max_request_bytes = 16 * 1024;
  auto h = Harness::Start(options, MakeCpuBackend(2));
  ASSERT_NE(h, nullptr);

  TestCase tokens;
  tokens.seqlen_q = 40;
  tokens.seqlen_k = 40;
  tokens.head_dim = 8;
  HostBuffers tokens_buf(tokens);
  v1::ForwardResponse response;
  grpc::Status s = h->Forward(MakeRequest(tokens_buf, "tokens"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_tokens"), std::string::npos) << s.error_message();
  h->ExpectStillServing();

  // Just over the limit: validation's message, naming the flag.
  TestCase bytes;
  bytes.dtype = DType::kFP32;
  bytes.seqlen_q = 20;
  bytes.seqlen_k = 20;
  bytes.head_dim = 72;  // 3 * 20 * 72 * 4 = 17280 bytes of tensors
  HostBuffers bytes_buf(bytes);
  s = h->Forward(MakeRequest(bytes_buf, "bytes"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_request_bytes"), std::string::npos) << s.error_message();
  h->ExpectStillServing();

  // Far over it: gRPC's receive limit refuses it before it is even parsed.
  TestCase huge;
  huge.dtype = DType::kFP32;
  huge.seqlen_q = 32;
  huge.seqlen_k = 32;
  huge.head_dim = 256;
  huge.num_heads_q = huge.num_heads_kv = 4;
  HostBuffers huge_buf(huge);
  s = h->Forward(MakeRequest(huge_buf, "huge"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  h->ExpectStillServing();

  // On the stream, the same errors come back in band.
  grpc::ClientContext ctx;
  auto stream = h->stub->ForwardStream(&ctx);
  ASSERT_TRUE(stream->Write(MakeRequest(tokens_buf, "tokens")));
  ASSERT_TRUE(stream->WritesDone());
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), "tokens");
  EXPECT_EQ(response.error_code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_TRUE(stream->Finish().ok());
}

// --- queue, deadline, cancellation, UNIMPLEMENTED, draining ---------------------------------

TestCase SmallCase() {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.seqlen_q = 9;
  tc.seqlen_k = 11;
  tc.num_heads_q = 2;
  tc.num_heads_kv = 1;
  tc.head_dim = 32;
  return tc;
}

TEST(ServerControlTest, QueueFullIsResourceExhausted) {
  ServerOptions options = LoopbackOptions();
  options.max_queue_size = 1;
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* control = backend.get();
  auto h = Harness::Start(options, std::move(backend));
  ASSERT_NE(h, nullptr);
  const int warm = control->calls();

  HostBuffers buf(SmallCase());
  control->Close();
  AsyncForward running, queued;
  running.request = MakeRequest(buf, "running");
  queued.request = MakeRequest(buf, "queued");
  running.Start(h->stub.get());
  control->AwaitCalls(warm + 1);  // started: holds the backend
  queued.Start(h->stub.get());

  // Once the server has admitted the second one, a third is refused.
  for (int i = 0; i < 1000 && h->server->queued_requests() < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(h->server->queued_requests(), 1);
  v1::ForwardResponse response;
  const grpc::Status s = h->Forward(MakeRequest(buf, "refused"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("queue full"), std::string::npos) << s.error_message();

  control->Open();
  ASSERT_TRUE(running.Wait());
  ASSERT_TRUE(queued.Wait());
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_TRUE(queued.status.ok()) << queued.status.error_message();
  ExpectMatchesReference(buf, queued.request, queued.response);
  h->ExpectStillServing();
}

TEST(ServerControlTest, DeadlineAndCancelHonouredBeforeCompute) {
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* control = backend.get();
  auto h = Harness::Start(LoopbackOptions(), std::move(backend));
  ASSERT_NE(h, nullptr);
  const int warm = control->calls();

  HostBuffers buf(SmallCase());
  control->Close();
  AsyncForward blocker, late, cancelled;
  blocker.request = MakeRequest(buf, "blocker");
  late.request = MakeRequest(buf, "late");
  cancelled.request = MakeRequest(buf, "cancelled");
  blocker.Start(h->stub.get());
  control->AwaitCalls(warm + 1);
  late.Start(h->stub.get(), absl::Seconds(1));
  cancelled.Start(h->stub.get());
  for (int i = 0; i < 1000 && h->server->queued_requests() < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(h->server->queued_requests(), 2) << "both admitted behind the blocker";
  cancelled.ctx.TryCancel();

  ASSERT_TRUE(late.Wait());
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(cancelled.Wait());
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  // The client learns of its cancel at once; the server when the RST_STREAM
  // arrives. Give it that moment before the backend frees up.
  absl::SleepFor(absl::Milliseconds(300));

  control->Open();
  ASSERT_TRUE(blocker.Wait());
  EXPECT_TRUE(blocker.status.ok());
  h->ExpectStillServing();
  // Neither the late nor the cancelled request reached the backend.
  EXPECT_EQ(control->calls(), warm + 2);  // the blocker and ExpectStillServing
}

TEST(ServerControlTest, ServerSideDeadlineExceededOnStream) {
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* control = backend.get();
  auto h = Harness::Start(LoopbackOptions(), std::move(backend));
  ASSERT_NE(h, nullptr);
  const int warm = control->calls();

  // The stream's deadline passes while its second request is queued: the
  // server reports DEADLINE_EXCEEDED without computing it.
  HostBuffers buf(SmallCase());
  control->Close();
  grpc::ClientContext ctx;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  auto stream = h->stub->ForwardStream(&ctx);
  ASSERT_TRUE(stream->Write(MakeRequest(buf, "first")));
  // "second" goes in once "first" is running, so dynamic batching cannot
  // pack the two into one launch.
  control->AwaitCalls(warm + 1);
  ASSERT_TRUE(stream->Write(MakeRequest(buf, "second")));
  for (int i = 0; i < 1000 && h->server->queued_requests() < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(h->server->queued_requests(), 1);
  absl::SleepFor(deadline - absl::Now() + absl::Milliseconds(100));
  control->Open();
  v1::ForwardResponse response;
  while (stream->Read(&response)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  h->ExpectStillServing();
  EXPECT_EQ(control->calls(), warm + 2);  // "first" and ExpectStillServing
}

TEST(ServerControlTest, UnsupportedCombinationIsUnimplemented) {
  auto h = Harness::Start(LoopbackOptions(),
                          std::make_unique<GatedCpuBackend>(/*softcap_unimplemented=*/true));
  ASSERT_NE(h, nullptr);
  TestCase tc = SmallCase();
  tc.softcap = 10.0f;
  HostBuffers buf(tc);
  v1::ForwardResponse response;
  const grpc::Status s = h->Forward(MakeRequest(buf, "softcap"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(s.error_message().find("softcap"), std::string::npos) << s.error_message();
  h->ExpectStillServing();
}

TEST(ServerControlTest, DrainingRefusesNewFinishesInFlightAndReportsNotServing) {
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* control = backend.get();
  auto h = Harness::Start(LoopbackOptions(), std::move(backend));
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->Health(""), HealthCheckResponse::SERVING);
  const int warm = control->calls();

  HostBuffers buf(SmallCase());
  control->Close();
  AsyncForward in_flight;
  in_flight.request = MakeRequest(buf, "in-flight");
  in_flight.Start(h->stub.get());
  control->AwaitCalls(warm + 1);

  std::thread stopper([&] { h->server->Shutdown(absl::Seconds(20)); });
  HealthCheckResponse::ServingStatus health = HealthCheckResponse::SERVING;
  for (int i = 0; i < 500 && health == HealthCheckResponse::SERVING; ++i) {
    health = h->Health("");
    if (health == HealthCheckResponse::SERVING) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(health, HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(h->Health("attnserve.v1.Attention"), HealthCheckResponse::NOT_SERVING);

  v1::ForwardResponse response;
  const grpc::Status s = h->Forward(MakeRequest(buf, "too-late"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("draining"), std::string::npos) << s.error_message();

  {
    grpc::ClientContext ctx;
    auto stream = h->stub->ForwardStream(&ctx);
    ASSERT_TRUE(stream->Write(MakeRequest(buf, "stream-too-late")));
    ASSERT_TRUE(stream->WritesDone());
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
    EXPECT_TRUE(stream->Finish().ok());
  }

  control->Open();
  ASSERT_TRUE(in_flight.Wait());
  EXPECT_TRUE(in_flight.status.ok()) << in_flight.status.error_message();
  ExpectMatchesReference(buf, in_flight.request, in_flight.response);
  stopper.join();
  h->server->Wait();
  h->server->Shutdown(absl::Seconds(1));  // a second call is harmless

  const grpc::Status after = h->Forward(MakeRequest(buf, "after"), &response, absl::Seconds(2));
  EXPECT_EQ(after.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// Health is NOT_SERVING while the backend warms up, SERVING once Start returns.
TEST(ServerLifecycleTest, NotServingUntilBackendIsReady) {
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* control = backend.get();
  control->Close();  // holds the warm-up run inside Start
  auto server = AttnServer::Create(LoopbackOptions(), std::move(backend));
  ASSERT_TRUE(server.ok());
  absl::Status started;
  std::thread starter([&] { started = (*server)->Start(); });
  control->AwaitCalls(1);
  ASSERT_NE((*server)->port(), 0) << "bound before the warm-up";
  auto health = grpc::health::v1::Health::NewStub(Connect((*server)->port()));
  auto check = [&health]() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckResponse response;
    const grpc::Status s = health->Check(&ctx, HealthCheckRequest(), &response);
    return s.ok() ? response.status() : HealthCheckResponse::UNKNOWN;
  };
  EXPECT_EQ(check(), HealthCheckResponse::NOT_SERVING);
  control->Open();
  starter.join();
  ASSERT_TRUE(started.ok()) << started;
  EXPECT_EQ(check(), HealthCheckResponse::SERVING);
}

TEST(ServerLifecycleTest, CreateRejectsBadOptions) {
  ServerOptions options = LoopbackOptions();
  options.max_queue_size = 0;
  EXPECT_EQ(AttnServer::Create(options, MakeCpuBackend(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = LoopbackOptions();
  options.port = 70000;
  EXPECT_EQ(AttnServer::Create(options, MakeCpuBackend(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = LoopbackOptions();
  options.backend.kind = "tpu";
  EXPECT_EQ(AttnServer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServerLifecycleTest, PortInUseFailsStart) {
  auto first = Harness::Start(LoopbackOptions(), MakeCpuBackend(1));
  ASSERT_NE(first, nullptr);
  ServerOptions options = LoopbackOptions();
  options.port = first->server->port();
  auto second = AttnServer::Create(options, MakeCpuBackend(1));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE((*second)->Start().ok());
  first->ExpectStillServing();
}

TEST(ServerLifecycleTest, ShutdownWithoutStartAndDestroyWhileServing) {
  auto never = AttnServer::Create(LoopbackOptions(), MakeCpuBackend(1));
  ASSERT_TRUE(never.ok());
  (*never)->Shutdown(absl::Seconds(1));
  (*never)->Wait();
  auto serving = Harness::Start(LoopbackOptions(), MakeCpuBackend(1));
  ASSERT_NE(serving, nullptr);
  serving->ExpectStillServing();
  serving.reset();  // the destructor drains and stops
}

}  // namespace
}  // namespace attnserve
