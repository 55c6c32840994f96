// Metrics: the registry's Prometheus text (Triton's names and labels, HELP and
// TYPE for every family, failure reasons, device gauges through the hook) and
// the /metrics endpoint of a real server scraped over HTTP after successful
// and failed requests.
#include "server/metrics.h"

#include <httplib.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/executor.h"
#include "server/native/kv_service.h"
#include "server/server.h"

namespace attnserve {
namespace {

WorkTimings Timings(int64_t queue_us, int64_t host_to_device_us, int64_t compute_us,
                    int64_t device_to_host_us, int64_t total_us) {
  WorkTimings t;
  t.queue_us = queue_us;
  t.host_to_device_us = host_to_device_us;
  t.compute_us = compute_us;
  t.device_to_host_us = device_to_host_us;
  t.total_us = total_us;
  return t;
}

constexpr char kModel[] = "{model=\"attention\",version=\"1\"}";

// Checks the exposition format and returns sample "name{labels}" -> value.
// Every sample's family must have been introduced by "# HELP" then "# TYPE"
// (counter or gauge).
std::map<std::string, double> ParseExposition(const std::string& text) {
  std::map<std::string, double> samples;
  std::set<std::string> helped, typed;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# HELP ")) {
      const std::string name(line.substr(0, line.find(' ')));
      EXPECT_NE(line.find(' '), absl::string_view::npos) << "HELP without text: " << line;
      helped.insert(name);
      continue;
    }
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      const std::vector<std::string> parts = absl::StrSplit(line, ' ');
      EXPECT_EQ(parts.size(), 2u) << line;
      EXPECT_TRUE(parts.back() == "counter" || parts.back() == "gauge") << line;
      EXPECT_TRUE(helped.count(parts[0])) << "TYPE before HELP: " << line;
      typed.insert(parts[0]);
      continue;
    }
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    EXPECT_NE(brace, absl::string_view::npos) << line;
    EXPECT_NE(space, absl::string_view::npos) << line;
    if (brace == absl::string_view::npos || space == absl::string_view::npos) continue;
    const std::string name(line.substr(0, brace));
    EXPECT_TRUE(typed.count(name)) << "sample without HELP/TYPE: " << line;
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

TEST(ServerMetricsTest, RendersTritonNamesAndFailureReasons) {
  ServerMetrics m;
  m.RecordRequest(absl::OkStatus(), Timings(10, 1, 100, 2, 120));
  m.RecordRequest(absl::OkStatus(), Timings(30, 3, 200, 4, 250));
  m.RecordExecution();
  m.RecordRequest(absl::ResourceExhaustedError("queue full"), Timings(0, 0, 0, 0, 5));
  m.RecordRequest(absl::UnavailableError("draining"), Timings(0, 0, 0, 0, 5));
  m.RecordRequest(absl::DeadlineExceededError("late"), Timings(0, 0, 0, 0, 5));
  m.RecordRequest(absl::InternalError("device"), Timings(0, 0, 0, 0, 5));
  m.RecordRequest(absl::InvalidArgumentError("bad"), Timings(0, 0, 0, 0, 5));
  m.SetPendingSource([] { return int64_t{3}; });

  const std::map<std::string, double> s = ParseExposition(m.RenderPrometheus());
  auto at = [&](const std::string& key) {
    EXPECT_TRUE(s.count(key)) << key;
    return s.count(key) ? s.at(key) : -1;
  };
  EXPECT_EQ(at(absl::StrCat("nv_inference_request_success", kModel)), 2);
  EXPECT_EQ(at(absl::StrCat("nv_inference_count", kModel)), 2);
  EXPECT_EQ(at(absl::StrCat("nv_inference_exec_count", kModel)), 1);
  EXPECT_EQ(at(absl::StrCat("nv_inference_request_duration_us", kModel)), 370);
  EXPECT_EQ(at(absl::StrCat("nv_inference_queue_duration_us", kModel)), 40);
  EXPECT_EQ(at(absl::StrCat("nv_inference_compute_input_duration_us", kModel)), 4);
  EXPECT_EQ(at(absl::StrCat("nv_inference_compute_infer_duration_us", kModel)), 300);
  EXPECT_EQ(at(absl::StrCat("nv_inference_compute_output_duration_us", kModel)), 6);
  EXPECT_EQ(at(absl::StrCat("nv_inference_pending_request_count", kModel)), 3);
  const std::string failure = "nv_inference_request_failure{model=\"attention\",version=\"1\",";
  EXPECT_EQ(at(failure + "reason=\"REJECTED\"}"), 2);
  EXPECT_EQ(at(failure + "reason=\"CANCELED\"}"), 1);
  EXPECT_EQ(at(failure + "reason=\"BACKEND\"}"), 1);
  EXPECT_EQ(at(failure + "reason=\"OTHER\"}"), 1);
  // No devices (the CPU backend): no GPU families at all.
  for (const auto& [key, value] : s) EXPECT_EQ(key.find("nv_gpu_"), std::string::npos) << key;
}

TEST(ServerMetricsTest, GpuGaugesFromDevicesAndUsageHook) {
  ServerMetrics m;
  DeviceDescription d;
  d.index = 0;
  d.name = "test GPU";
  d.total_memory_bytes = 80'000'000'000;
  m.SetDevices({d});
  std::map<std::string, double> s = ParseExposition(m.RenderPrometheus());
  EXPECT_EQ(s["nv_gpu_memory_total_bytes{gpu_uuid=\"GPU-0\"}"], 8e10);
  EXPECT_FALSE(s.count("nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-0\"}"));

  m.SetDeviceUsageSource([] { return std::vector<DeviceUsage>{{0, 1'000'000, 0.25}}; });
  s = ParseExposition(m.RenderPrometheus());
  EXPECT_EQ(s["nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-0\"}"], 1e6);
  EXPECT_EQ(s["nv_gpu_utilization{gpu_uuid=\"GPU-0\"}"], 0.25);
}

// A one-thread CPU server on loopback with /metrics on a free port.
ServerOptions LoopbackCpuServerWithMetrics() {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.backend.kind = "cpu";
  options.backend.cpu_threads = 1;
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  return options;
}

TEST(MetricsHttpTest, ScrapeAfterSuccessfulAndFailedRequests) {
  ServerOptions options = LoopbackCpuServerWithMetrics();
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_GT((*server)->metrics_port(), 0);

  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(absl::StrCat("127.0.0.1:", (*server)->port()));
  ASSERT_TRUE(client.ok());
  AttentionShape shape;
  shape.seqlen_q = shape.seqlen_k = 16;
  shape.heads_q = shape.heads_kv = 2;
  shape.head_dim = 32;
  absl::StatusOr<AttentionInputs> good = MakeRandomInputs(shape, 1);
  ASSERT_TRUE(good.ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*client)->Forward(*good).ok());
  shape.head_dim = 12;  // not a multiple of 8: INVALID_ARGUMENT
  absl::StatusOr<AttentionInputs> bad = MakeRandomInputs(shape, 2);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*client)->Forward(*bad).status().code(), absl::StatusCode::kInvalidArgument);

  httplib::Client http("127.0.0.1", (*server)->metrics_port());
  httplib::Result res = http.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  std::map<std::string, double> s = ParseExposition(res->body);
  EXPECT_EQ(s[absl::StrCat("nv_inference_request_success", kModel)], 3);
  EXPECT_EQ(s[absl::StrCat("nv_inference_count", kModel)], 3);
  // The start-up warm-up is the server's own and not counted.
  EXPECT_EQ(s[absl::StrCat("nv_inference_exec_count", kModel)], 3);
  EXPECT_GT(s[absl::StrCat("nv_inference_request_duration_us", kModel)], 0);
  EXPECT_GT(s[absl::StrCat("nv_inference_compute_infer_duration_us", kModel)], 0);
  EXPECT_EQ(s[absl::StrCat("nv_inference_pending_request_count", kModel)], 0);
  EXPECT_EQ(s["nv_inference_request_failure{model=\"attention\",version=\"1\",reason=\"OTHER\"}"],
            1);

  httplib::Result missing = http.Get("/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  (*server)->Shutdown(absl::Seconds(5));
}

// The K/V pool's gauges follow what the caches hold: a cache with two
// sequences of 20 and 5 tokens in pages of 16 holds 3 pages; freeing the
// sequences gives them back, dropping the cache removes it.
TEST(MetricsHttpTest, KvGaugesFollowTheCaches) {
  ServerOptions options = LoopbackCpuServerWithMetrics();
  options.kv_cache_bytes = int64_t{8} << 20;
  options.kv_page_size = 16;
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  httplib::Client http("127.0.0.1", (*server)->metrics_port());
  auto scrape = [&] {
    httplib::Result res = http.Get("/metrics");
    EXPECT_TRUE(res && res->status == 200);
    return res ? ParseExposition(res->body) : std::map<std::string, double>{};
  };
  const std::string dev = "{device=\"0\"}";
  std::map<std::string, double> s = scrape();
  EXPECT_EQ(s["attnserve_kv_caches{}"], 0);
  EXPECT_EQ(s["attnserve_kv_pages_used" + dev], 0);
  EXPECT_EQ(s["attnserve_kv_bytes_limit" + dev], double(int64_t{8} << 20));
  EXPECT_EQ(s["nv_kv_cache_util" + dev], 0);

  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
  constexpr int kHkv = 2, kD = 32;
  {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.set_cache_id("metrics");
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(1024);
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub->CreateCache(&ctx, r, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id("metrics");
    r.add_sequences()->set_sequence_id(1);
    r.add_sequences()->set_sequence_id(2);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(stub->CreateSequences(&ctx, r, &resp).ok());
  }
  {
    // Append-only: 20 tokens to sequence 1, 5 to sequence 2.
    grpc::ClientContext ctx;
    ctx.AddMetadata(kCacheIdHeader, "metrics");
    v1::AppendAttendRequest r;
    r.set_cache_id("metrics");
    r.set_layer(0);
    for (auto [id, n] : {std::pair<uint64_t, int>{1, 20}, {2, 5}}) {
      v1::SequenceStep* step = r.add_sequences();
      step->set_sequence_id(id);
      step->set_num_new_tokens(n);
    }
    for (v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
      t->set_dtype(v1::FP32);
      for (int d : {25, kHkv, kD}) t->add_shape(d);
      t->set_data(std::string(size_t(25) * kHkv * kD * 4, '\0'));
    }
    v1::AppendAttendResponse resp;
    const grpc::Status st = stub->AppendAttend(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  s = scrape();
  EXPECT_EQ(s["attnserve_kv_caches{}"], 1);
  EXPECT_EQ(s["attnserve_kv_sequences{}"], 2);
  EXPECT_EQ(s["attnserve_kv_pages_used" + dev], 3);
  EXPECT_GT(s["nv_kv_cache_util" + dev], 0);
  EXPECT_GT(s["attnserve_kv_bytes_allocated" + dev], 0);
  EXPECT_EQ(s["attnserve_kv_expired_sequences_total{}"], 0);
  const double free_before = s["attnserve_kv_pages_free" + dev];

  {
    grpc::ClientContext ctx;
    v1::FreeSequencesRequest r;
    r.set_cache_id("metrics");
    r.add_sequence_ids(1);
    r.add_sequence_ids(2);
    v1::FreeSequencesResponse resp;
    ASSERT_TRUE(stub->FreeSequences(&ctx, r, &resp).ok());
  }
  s = scrape();
  EXPECT_EQ(s["attnserve_kv_sequences{}"], 0);
  EXPECT_EQ(s["attnserve_kv_pages_used" + dev], 0);
  EXPECT_EQ(s["attnserve_kv_pages_free" + dev], free_before + 3);
  {
    grpc::ClientContext ctx;
    v1::DropCacheRequest r;
    r.set_cache_id("metrics");
    v1::DropCacheResponse resp;
    ASSERT_TRUE(stub->DropCache(&ctx, r, &resp).ok());
  }
  EXPECT_EQ(scrape()["attnserve_kv_caches{}"], 0);
  (*server)->Shutdown(absl::Seconds(5));
}

TEST(MetricsHttpTest, OffByDefaultInServerOptions) {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.backend.kind = "cpu";
  options.backend.cpu_threads = 1;
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_EQ((*server)->metrics_port(), 0);
  (*server)->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace attnserve
