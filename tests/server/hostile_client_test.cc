// Hostile-client findings, over the wire on a real AttnServer
// (127.0.0.1:0, CPU backend): options that used to give an all-NaN O with OK
// and an 8 MiB request_id are refused by Forward, ForwardStream and Echo alike;
// and a ForwardStream whose client sends many large requests and never reads
// is held to its flow-control bound (stream_flow_control.h), measured by the
// server's own /metrics gauges, and gives everything back when it cancels. The
// bound lives in the one streaming reactor (stream_reactor.h), so KServe's
// ModelStreamInfer is checked against it too. Per tenant: what a tenant's
// never-reading streams hold together stops at its bytes_in_flight quota
// (plus one request and answer per stream), a stream beyond
// max_streams_per_tenant is refused before the server reads it, and without
// tokens never-reading streams keep the process within --max_buffered_bytes
// plus a stated constant.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "common/malloc_tuning.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/core/validate.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/common/own_allocator.h"
#include "tests/server/random_tensor.h"

namespace attnserve {
namespace {

// FP32 dense, q [1, sq, 4, 64], k/v [1, sk, 4, 64].
v1::ForwardRequest Request(int sq, int sk, const std::string& id) {
  std::mt19937 rng(static_cast<uint32_t>(sq * 131 + sk));
  v1::ForwardRequest r;
  r.set_request_id(id);
  SetRandomTensor(r.mutable_q(), {1, sq, 4, 64}, &rng);
  SetRandomTensor(r.mutable_k(), {1, sk, 4, 64}, &rng);
  SetRandomTensor(r.mutable_v(), {1, sk, 4, 64}, &rng);
  return r;
}

class HostileClientTest : public ::testing::Test {
 protected:
  // `tokens_file`: authentication on with that file; `max_buffered_bytes` 0:
  // the machine's default.
  void Start(const StreamLimits& limits, const std::string& tokens_file = "",
             int64_t max_buffered_bytes = 0) {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.auth.tokens_file = tokens_file;
    options.max_buffered_bytes = max_buffered_bytes;
    options.host = "127.0.0.1";
    options.port = 0;
    options.backend.kind = "cpu";
    options.backend.cpu_threads = 2;
    options.metrics_enabled = true;
    options.metrics_host = "127.0.0.1";
    options.metrics_port = 0;
    options.stream = limits;
    auto server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->metrics_port(), 0) << "this test reads the server's /metrics gauges";
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                             grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Attention::NewStub(channel);
    kv_ = v1::KvCache::NewStub(channel);
    v2_ = inference::GRPCInferenceService::NewStub(channel);
  }

  // The value of an attnserve_* gauge from a /metrics scrape; `labels` picks
  // one sample of a labelled family (e.g. tenant="a").
  int64_t Gauge(const std::string& name, const std::string& labels = "") {
    httplib::Client http("127.0.0.1", server_->metrics_port());
    httplib::Result res = http.Get("/metrics");
    if (!res || res->status != 200) {
      ADD_FAILURE() << "scrape failed";
      return -1;
    }
    for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
      if (!absl::StartsWith(line, absl::StrCat(name, "{", labels))) continue;
      int64_t value = 0;
      const size_t space = line.rfind(' ');
      if (absl::SimpleAtoi(line.substr(space + 1), &value)) return value;
    }
    // A labelled sample (a tenant's) appears once that tenant opened a stream.
    if (!labels.empty()) return 0;
    ADD_FAILURE() << name << " is not in /metrics";
    return -1;
  }

  // Polls until `done` holds (evidence, not a fixed sleep); false after 60 s.
  template <typename F>
  bool WaitFor(F done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return done();
  }

  grpc::Status Call(bool echo, const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return echo ? stub_->Echo(&ctx, request, response) : stub_->Forward(&ctx, request, response);
  }

  // A stream whose client writes `count` copies of `request` from a thread and
  // never reads; returns once the server has paused reading it and the client
  // has stopped getting further (its Write blocks on HTTP/2 flow control). The
  // caller asserts on the gauges, then cancels.
  template <typename Req, typename Resp>
  struct NonReadingStream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<Req, Resp>> stream;
    std::atomic<int> written{0};
    std::thread writer;
  };
  using NonReadingForwardStream = NonReadingStream<v1::ForwardRequest, v1::ForwardResponse>;
  // `token`: sent as the bearer token; `paused`: how many streams the server
  // has paused once this one is (streams opened before it and still held), or
  // 0 when the server may stop reading it either way: paused by the stream's
  // flow control, or not read at all once gRPC's buffer quota is spent.
  std::unique_ptr<NonReadingForwardStream> OpenNonReading(const v1::ForwardRequest& request,
                                                          int count, const std::string& token = "",
                                                          int paused = 1) {
    return OpenNonReading<v1::ForwardRequest, v1::ForwardResponse>(
        [this, token](grpc::ClientContext* ctx) {
          if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
          return stub_->ForwardStream(ctx);
        },
        request, count, paused);
  }
  // The same for any streaming RPC: `open` starts it on a context.
  template <typename Req, typename Resp, typename Open>
  std::unique_ptr<NonReadingStream<Req, Resp>> OpenNonReading(Open open, const Req& request,
                                                              int count, int paused = 1) {
    auto s = std::make_unique<NonReadingStream<Req, Resp>>();
    s->stream = open(&s->ctx);
    NonReadingStream<Req, Resp>* raw = s.get();
    s->writer = std::thread([raw, request, count] {
      for (int i = 0; i < count; ++i) {
        if (!raw->stream->Write(request)) return;  // cancelled
        raw->written.fetch_add(1);
      }
      raw->stream->WritesDone();
    });
    if (paused > 0) {
      EXPECT_TRUE(WaitFor([&] { return Gauge("attnserve_stream_paused") == paused; }))
          << "the server never paused reading the stream";
    }
    // The client is blocked once its write count stops moving for a while
    // (there is no event for "the transport's window is full").
    int stable = 0, last = -1;
    EXPECT_TRUE(WaitFor([&] {
      const int now = raw->written.load();
      stable = now == last ? stable + 1 : 0;
      last = now;
      return stable >= 25;
    }));
    return s;
  }

  // Cancels, waits for the server to give back everything the stream held.
  template <typename Req, typename Resp>
  void CancelAndExpectReleased(NonReadingStream<Req, Resp>* s) {
    s->ctx.TryCancel();
    s->writer.join();
    s->stream->Finish();
    EXPECT_TRUE(WaitFor([&] {
      return Gauge("attnserve_stream_held_bytes") == 0 &&
             Gauge("attnserve_stream_held_requests") == 0 && Gauge("attnserve_stream_paused") == 0;
    })) << "held bytes "
        << Gauge("attnserve_stream_held_bytes") << ", requests "
        << Gauge("attnserve_stream_held_requests");
  }

  // The count bound (max_pending_requests = 4) on a stream of `count`
  // requests of `request_bytes` each whose ~1 MiB answers are never read:
  // the gauges stay within it, the client blocks, cancelling frees it all,
  // and a reading client is then served in full.
  template <typename Req, typename Resp>
  void ExpectHeldToFourRequests(NonReadingStream<Req, Resp>* s, int64_t request_bytes, int count) {
    EXPECT_LE(Gauge("attnserve_stream_held_requests"), 4);
    EXPECT_LT(s->written.load(), count) << "the client's writes should block";
    EXPECT_LE(Gauge("attnserve_stream_peak_bytes"), 4 * request_bytes + 4 * (1 << 20) + 4096);
    EXPECT_GE(Gauge("attnserve_stream_pauses_total"), 1);
    CancelAndExpectReleased(s);
    ExpectStreamServesAll(24);
  }

  // A reading client on a fresh stream gets every answer, in spite of the
  // limit being far below the number of requests (reading resumes).
  void ExpectStreamServesAll(int count) {
    grpc::ClientContext ctx;
    auto stream = stub_->ForwardStream(&ctx);
    std::thread writer([&] {
      for (int i = 0; i < count; ++i) {
        if (!stream->Write(Request(16, 32, absl::StrCat("ok-", i)))) return;
      }
      stream->WritesDone();
    });
    int answered = 0;
    v1::ForwardResponse response;
    while (stream->Read(&response)) {
      EXPECT_EQ(response.error_code(), 0) << response.error_message();
      EXPECT_TRUE(absl::StartsWith(response.request_id(), "ok-"));
      ++answered;
    }
    writer.join();
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(answered, count);
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<v1::KvCache::Stub> kv_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
};

// Resident memory of this process (server and client both live here).
int64_t RssBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long pages = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? int64_t{resident} * 4096 : -1;
}

TEST_F(HostileClientTest, OptionsThatGaveNaNAreRefusedOverTheWire) {
  Start(StreamLimits{});
  struct Bad {
    float scale;  // 0: unset
    float softcap;
    const char* field;
  };
  for (const Bad& b :
       {Bad{2e38f, 0.0f, "options.softmax_scale"}, Bad{0.0f, 1e-45f, "options.softcap"},
        Bad{0.0f, 1e-39f, "options.softcap"}, Bad{0.0f, 3e38f, "options.softcap"}}) {
    v1::ForwardRequest r = Request(4, 8, "nan");
    if (b.scale != 0.0f) r.mutable_options()->set_softmax_scale(b.scale);
    r.mutable_options()->set_softcap(b.softcap);
    for (bool echo : {false, true}) {
      SCOPED_TRACE(::testing::Message() << b.field << " " << b.scale << " " << b.softcap
                                        << (echo ? " echo" : " forward"));
      v1::ForwardResponse response;
      const grpc::Status s = Call(echo, r, &response);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_TRUE(absl::StrContains(s.error_message(), b.field)) << s.error_message();
    }
  }
  // The edges inside the range compute a finite O.
  v1::ForwardRequest edge = Request(4, 8, "edge");
  edge.mutable_options()->set_softmax_scale(1e26f);
  edge.mutable_options()->set_softcap(1e26f);
  v1::ForwardResponse response;
  ASSERT_TRUE(Call(false, edge, &response).ok());
  const float* o = reinterpret_cast<const float*>(response.o().data().data());
  for (int i = 0; i < 4 * 4 * 64; ++i) ASSERT_TRUE(std::isfinite(o[i])) << i;
}

TEST_F(HostileClientTest, OverlongRequestIdIsRefusedEverywhere) {
  Start(StreamLimits{});
  v1::ForwardRequest r = Request(4, 8, std::string(8 << 20, 'x'));  // the finding's 8 MiB
  for (bool echo : {false, true}) {
    v1::ForwardResponse response;
    const grpc::Status s = Call(echo, r, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "request_id")) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "1024")) << s.error_message();
  }
  // On a stream the error travels in the response, whose id is cut to the limit.
  grpc::ClientContext ctx;
  auto stream = stub_->ForwardStream(&ctx);
  ASSERT_TRUE(stream->Write(r));
  ASSERT_TRUE(stream->Write(Request(4, 8, "fine")));
  stream->WritesDone();
  v1::ForwardResponse response;
  int refused = 0, served = 0;
  while (stream->Read(&response)) {
    if (response.request_id() == "fine") {
      EXPECT_EQ(response.error_code(), 0);
      ++served;
    } else {
      EXPECT_EQ(response.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_TRUE(absl::StrContains(response.error_message(), "request_id"));
      EXPECT_EQ(response.request_id().size(), kMaxRequestIdBytes);
      ++refused;
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(served, 1);
}

// The count bound: 4 held requests at most, however many the client sends.
TEST_F(HostileClientTest, NonReadingStreamHeldToRequestLimit) {
  StreamLimits limits;
  limits.max_pending_requests = 4;
  limits.max_pending_bytes = int64_t{1} << 30;
  Start(limits);
  // ~1.1 MiB requests (q 1 MiB, k/v 64 KiB each) with ~1 MiB responses.
  const v1::ForwardRequest request = Request(1024, 64, "big");
  const int kCount = 200;  // 220 MiB if the server read them all
  auto s = OpenNonReading(request, kCount);
  ExpectHeldToFourRequests(s.get(), static_cast<int64_t>(request.ByteSizeLong()), kCount);
}

// The byte bound: held bytes never pass the budget by more than one request
// and its response, with a request limit that never binds.
TEST_F(HostileClientTest, NonReadingStreamHeldToByteBudget) {
  StreamLimits limits;
  limits.max_pending_requests = 100000;
  limits.max_pending_bytes = int64_t{3} << 20;
  Start(limits);
  const v1::ForwardRequest request = Request(1024, 64, "big");
  const int64_t per_request = static_cast<int64_t>(request.ByteSizeLong());
  const int kCount = 200;
  auto s = OpenNonReading(request, kCount);
  const int64_t bound = limits.max_pending_bytes + per_request + (int64_t{1} << 20) + 4096;
  EXPECT_LE(Gauge("attnserve_stream_held_bytes"), bound);
  EXPECT_LE(Gauge("attnserve_stream_peak_bytes"), bound);
  EXPECT_LT(s->written.load(), kCount) << "the client's writes should block";
  CancelAndExpectReleased(s.get());
  ExpectStreamServesAll(24);
}

// KServe's ModelStreamInfer runs the same reactor, so the same bound holds
// there: 4 held requests at most from a client that never reads.
TEST_F(HostileClientTest, NonReadingKserveStreamHeldToRequestLimit) {
  StreamLimits limits;
  limits.max_pending_requests = 4;
  limits.max_pending_bytes = int64_t{1} << 30;
  Start(limits);
  const v1::ForwardRequest native = Request(1024, 64, "big");
  inference::ModelInferRequest request;
  request.set_model_name("attention");
  request.set_id("big");
  for (const auto& [name, t] : {std::pair<const char*, const v1::Tensor*>{"q", &native.q()},
                                {"k", &native.k()},
                                {"v", &native.v()}}) {
    inference::ModelInferRequest::InferInputTensor* in = request.add_inputs();
    in->set_name(name);
    in->set_datatype("FP32");
    *in->mutable_shape() = t->shape();
    *request.add_raw_input_contents() = t->data();
  }
  const int kCount = 200;
  auto s = OpenNonReading<inference::ModelInferRequest, inference::ModelStreamInferResponse>(
      [this](grpc::ClientContext* ctx) { return v2_->ModelStreamInfer(ctx); }, request, kCount);
  ExpectHeldToFourRequests(s.get(), static_cast<int64_t>(request.ByteSizeLong()), kCount);
}

// With generous limits a stream may hold a lot; once its client cancels, the
// server gives it all back, to the system too (malloc_tuning.h, as main.cc
// sets it): RSS falls by most of what the stream held.
TEST_F(HostileClientTest, CancelledStreamGivesMemoryBack) {
#ifdef ATTNSERVE_OWN_ALLOCATOR
  GTEST_SKIP() << "a sanitizer's allocator replaces glibc's here";
#endif
  TuneMallocForTensors();
  StreamLimits limits;
  limits.max_pending_requests = 1000;
  limits.max_pending_bytes = int64_t{160} << 20;
  Start(limits);
  const v1::ForwardRequest request = Request(4096, 64, "big");  // ~4.1 MiB, 4 MiB answers
  ExpectStreamServesAll(4);  // the server's threads and pools exist before the baseline
  const int64_t rss_before = RssBytes();
  auto s = OpenNonReading(request, 200);
  const int64_t held = Gauge("attnserve_stream_held_bytes");
  const int64_t rss_held = RssBytes();
  EXPECT_GE(held, limits.max_pending_bytes);
  CancelAndExpectReleased(s.get());
  const int64_t rss_after = RssBytes();
  std::printf("stream held %lld bytes; RSS %lld before, %lld while held, %lld after cancel\n",
              static_cast<long long>(held), static_cast<long long>(rss_before),
              static_cast<long long>(rss_held), static_cast<long long>(rss_after));
  // Without the fixed mmap threshold about 300 MB (more than the stream held)
  // stayed resident here; with it, 10-80 MB of small transport buffers do.
  EXPECT_LT(rss_after - rss_before, held) << "the freed tensors should leave the process";
}

// A tokens file with one tenant "a" of the given bytes_in_flight quota.
std::string TokensFile(const std::string& name, int64_t bytes_in_flight) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream out(path);
  out << "tok-a-0123456789abcdef a bytes_in_flight=" << bytes_in_flight << "\n";
  return path;
}

// Per tenant: four never-reading streams of one tenant hold together at most
// its bytes_in_flight quota plus one request and its answer each, though each
// stream alone may hold 32 MiB (before, each held its own 32 MiB).
TEST_F(HostileClientTest, TenantStreamsHeldToTheTenantQuota) {
  StreamLimits limits;
  limits.max_pending_requests = 100000;
  limits.max_pending_bytes = int64_t{32} << 20;
  const int64_t quota = int64_t{4} << 20;
  Start(limits, TokensFile("tenant_streams_tokens", quota));
  const v1::ForwardRequest request = Request(1024, 64, "big");  // ~1.1 MiB, ~1 MiB answers
  const int64_t per_request = static_cast<int64_t>(request.ByteSizeLong());
  constexpr int kStreams = 4;
  std::vector<std::unique_ptr<NonReadingForwardStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(OpenNonReading(request, 100, "tok-a-0123456789abcdef", i + 1));
  }
  const int64_t bound = quota + kStreams * (per_request + (int64_t{1} << 20) + 4096);
  const int64_t held = Gauge("attnserve_stream_held_bytes");
  std::printf("%d streams of tenant a (quota %lld) hold %lld bytes; bound %lld\n", kStreams,
              static_cast<long long>(quota), static_cast<long long>(held),
              static_cast<long long>(bound));
  EXPECT_LE(held, bound);
  EXPECT_EQ(Gauge("attnserve_tenant_stream_held_bytes", "tenant=\"a\""), held);
  // Streams whose requests were all refused in band may have finished already.
  EXPECT_LE(Gauge("attnserve_tenant_streams", "tenant=\"a\""), kStreams);
  // A stream whose requests are refused in band (over bytes_in_flight) holds
  // only small answers and may keep writing; what matters is what is held.
  for (auto& s : streams) s->ctx.TryCancel();
  for (auto& s : streams) {
    s->writer.join();
    s->stream->Finish();
  }
  EXPECT_TRUE(WaitFor([&] {
    return Gauge("attnserve_stream_held_bytes") == 0 &&
           Gauge("attnserve_tenant_stream_held_bytes", "tenant=\"a\"") == 0 &&
           Gauge("attnserve_tenant_streams", "tenant=\"a\"") == 0;
  }));
}

// AppendAttendStream is admitted and counted per tenant like ForwardStream
// (the interceptor sees every bidirectional call; the stream's ledger, built
// by the same reactor, charges the tenant's share).
TEST_F(HostileClientTest, KvStreamCountsAgainstItsTenant) {
  Start(StreamLimits{}, TokensFile("kv_stream_tokens", int64_t{1} << 30));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer tok-a-0123456789abcdef");
  auto stream = kv_->AppendAttendStream(&ctx);
  EXPECT_TRUE(WaitFor([&] { return Gauge("attnserve_tenant_streams", "tenant=\"a\"") == 1; }));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(WaitFor([&] { return Gauge("attnserve_tenant_streams", "tenant=\"a\"") == 0; }));
}

// A tenant's stream beyond max_streams_per_tenant is refused with
// RESOURCE_EXHAUSTED naming the limit, and the server reads none of it (its
// requests never reach the ledgers); once one closes, a new one is served.
TEST_F(HostileClientTest, StreamsBeyondTheTenantCapAreRefusedBeforeReading) {
  StreamLimits limits;
  limits.max_streams_per_tenant = 2;
  Start(limits);
  grpc::ClientContext open_ctx[2];
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> open[2];
  for (int i = 0; i < 2; ++i) open[i] = stub_->ForwardStream(&open_ctx[i]);
  ASSERT_TRUE(
      WaitFor([&] { return Gauge("attnserve_tenant_streams", "tenant=\"default\"") == 2; }));
  {
    grpc::ClientContext ctx;
    auto third = stub_->ForwardStream(&ctx);
    // Its messages may or may not leave the client before the refusal lands.
    for (int i = 0; i < 4; ++i) {
      if (!third->Write(Request(1024, 64, "refused"))) break;
    }
    third->WritesDone();
    v1::ForwardResponse response;
    EXPECT_FALSE(third->Read(&response)) << "a refused stream answers nothing";
    const grpc::Status status = third->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "max_streams_per_tenant"))
        << status.error_message();
  }
  EXPECT_EQ(Gauge("attnserve_tenant_streams_refused_total", "tenant=\"default\""), 1);
  EXPECT_EQ(Gauge("attnserve_stream_pauses_total"), 0);
  EXPECT_EQ(Gauge("attnserve_stream_held_requests"), 0);
  open[0]->WritesDone();
  EXPECT_TRUE(open[0]->Finish().ok());
  ASSERT_TRUE(
      WaitFor([&] { return Gauge("attnserve_tenant_streams", "tenant=\"default\"") == 1; }));
  ExpectStreamServesAll(4);
  open[1]->WritesDone();
  EXPECT_TRUE(open[1]->Finish().ok());
}

// Without tokens: six never-reading streams, each allowed 256 MiB, under a
// 256 MiB --max_buffered_bytes: the server's own account of what streams hold
// stays within half the budget plus one request and answer per stream, and
// this process's RSS (server and client together) rises by at most the
// budget, one request and answer per stream and 384 MiB (the stated
// constant: the client's copies of its requests and both sides' HTTP/2
// buffers, which BDP probing grows). Without the server-wide bound they
// would hold 1.5 GiB. scripts/soak.sh checks the server process alone.
TEST_F(HostileClientTest, NeverReadingStreamsKeepRssWithinTheBudget) {
#ifdef ATTNSERVE_OWN_ALLOCATOR
  GTEST_SKIP() << "a sanitizer's allocator keeps freed memory resident";
#endif
  TuneMallocForTensors();
  const int64_t budget = int64_t{256} << 20;
  StreamLimits limits;  // 64 requests and 256 MiB per stream
  Start(limits, "", budget);
  const v1::ForwardRequest request = Request(4096, 64, "big");  // ~4.1 MiB, 4 MiB answers
  const int64_t per_request = static_cast<int64_t>(request.ByteSizeLong());
  ExpectStreamServesAll(4);
  const int64_t rss_before = RssBytes();
  constexpr int kStreams = 6;
  std::vector<std::unique_ptr<NonReadingForwardStream>> streams;
  // Past the server-wide budget gRPC's quota may stop reading a stream before
  // its flow control pauses it: either way its client blocks, which is what
  // OpenNonReading waits for here.
  for (int i = 0; i < kStreams; ++i) streams.push_back(OpenNonReading(request, 64, "", 0));
  const int64_t rss_held = RssBytes();
  const int64_t held = Gauge("attnserve_stream_held_bytes");
  const int64_t per_stream = per_request + (int64_t{4} << 20);
  const int64_t held_bound = budget / 2 + kStreams * per_stream;
  const int64_t rss_bound = budget + kStreams * per_stream + (int64_t{384} << 20);
  std::printf("%d never-reading streams hold %lld bytes (bound %lld); RSS rose %lld (bound %lld)\n",
              kStreams, static_cast<long long>(held), static_cast<long long>(held_bound),
              static_cast<long long>(rss_held - rss_before), static_cast<long long>(rss_bound));
  EXPECT_LE(held, held_bound);
  EXPECT_LE(rss_held - rss_before, rss_bound);
  for (auto& s : streams) s->ctx.TryCancel();
  for (auto& s : streams) {
    s->writer.join();
    s->stream->Finish();
  }
  EXPECT_TRUE(WaitFor([&] { return Gauge("attnserve_stream_held_bytes") == 0; }));
}

}  // namespace
}  // namespace attnserve
