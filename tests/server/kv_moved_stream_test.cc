// Moved caches, past the unary calls (kv_handoff_test.cc): an
// AppendAttendStream open on a replica whose cache moves ends UNAVAILABLE
// with x-attnserve-moved-to, answering the requests it had started and
// applying none of the others; KvClient's stream reopens at the peer and sends
// those again, so every step of a pipelined loop is answered once (each O held
// to the float64 reference over the whole history: a lost or doubled token
// fails); GetCacheStats never fetches a cache from the peer; the gate's
// counters on /metrics.
#include <httplib.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/attention_client.h"
#include "client/kv_client.h"
#include "tests/server/kv_handoff_fixture.h"

namespace attnserve {
namespace {

// The value of a counter family's one sample in `text`; -1 when absent.
int64_t Sample(const std::string& text, const std::string& name) {
  const std::string line = "\n" + name + "{} ";
  const size_t at = text.find(line);
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + line.size()));
}

class KvMovedStreamTest : public KvHandoffTest {
 protected:
  // Sequence `id`'s length on server i (GetCacheStats); -1 when refused.
  int32_t LengthOn(int i, const std::string& cache, uint64_t id) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache);
    r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    if (!stub_[i]->GetCacheStats(&ctx, r, &resp).ok() || resp.sequences_size() != 1) return -1;
    return resp.sequences(0).lengths(0);
  }
  std::string Metrics(int i) {
    httplib::Client http("127.0.0.1", server_[i]->metrics_port());
    auto got = http.Get("/metrics");
    EXPECT_TRUE(got && got->status == 200);
    return got ? got->body : std::string();
  }
};

TEST_F(KvMovedStreamTest, StreamEndsMovedToAndAppliesNothingItDidNotAnswer) {
  CreateCache(0, "s", {1});
  Context c;
  std::vector<Part> parts = {Step(1, &c, 12, 12)};
  grpc::ClientContext ctx;
  ctx.AddMetadata(kCacheIdHeader, "s");
  auto stream = stub_[0]->AppendAttendStream(&ctx);
  v1::AppendAttendRequest first = MakeCall("s", parts);
  first.set_request_id("a");
  ASSERT_TRUE(stream->Write(first));
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  CheckResponse(resp, parts, {&c}, Mods());

  DrainInBackground(0);
  WaitMoved(0, "s");
  Context unused = c;
  v1::AppendAttendRequest second = MakeCall("s", {Step(1, &unused, 1, 1)});
  second.set_request_id("b");
  stream->Write(second);  // may fail: the server may have ended the stream already
  resp.Clear();
  EXPECT_FALSE(stream->Read(&resp)) << "answered in-band: " << resp.error_message();
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_EQ(status.error_message(), "cache s moved to " + Address(port_[1]));
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find(kMovedToHeader);
  ASSERT_NE(it, trailers.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), Address(port_[1]));
  // The unanswered step changed nothing: B holds the length before it.
  EXPECT_EQ(LengthOn(1, "s", 1), c.length());
  Joined();
}

TEST_F(KvMovedStreamTest, KvClientStreamFollowsTheMoveWithoutLosingOrRepeatingAStep) {
  CreateCache(0, "loop", {1, 2});
  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(Address(port_[0]));
  ASSERT_TRUE(client.ok());
  KvClient kv(**client);
  absl::StatusOr<std::unique_ptr<AppendAttendStream>> stream = kv.OpenStream("loop");
  ASSERT_TRUE(stream.ok());

  // Steps pipelined on the stream, before, during and after the drain; each
  // checked against the context as it stood after that step.
  Context c1, c2;
  struct Sent {
    std::vector<Part> parts;
    Context c1, c2;
  };
  std::map<std::string, Sent> sent;
  absl::Mutex mu;
  std::map<std::string, absl::StatusOr<v1::AppendAttendResponse>> answers;
  int step = 0;
  auto send = [&](int count) {
    for (int i = 0; i < count; ++i, ++step) {
      const std::string id = absl::StrCat("t", step);
      Sent s;
      s.parts = {Step(1, &c1, 1 + step % 3, 1), Step(2, &c2, 2, 2)};
      s.c1 = c1;
      s.c2 = c2;
      v1::AppendAttendRequest r = MakeCall("loop", s.parts);
      r.set_request_id(id);
      sent.emplace(id, std::move(s));
      ASSERT_TRUE((*stream)
                      ->Send(std::move(r),
                             [&, id](absl::StatusOr<v1::AppendAttendResponse> got) {
                               absl::MutexLock lock(&mu);
                               EXPECT_EQ(answers.count(id), 0u) << id << " answered twice";
                               answers.emplace(id, std::move(got));
                             })
                      .ok());
    }
  };
  send(20);
  DrainInBackground(0);
  send(40);
  WaitMoved(0, "loop");
  send(10);
  ASSERT_TRUE((*stream)->Finish().ok());
  Joined();

  ASSERT_EQ(answers.size(), sent.size());
  for (auto& [id, got] : answers) {
    ASSERT_TRUE(got.ok()) << id << ": " << got.status();
    ASSERT_EQ(got->error_code(), 0) << id << ": " << got->error_message();
    Sent& s = sent.at(id);
    CheckResponse(*got, s.parts, {&s.c1, &s.c2}, Mods());
  }
  EXPECT_GE((*stream)->reopened(), 1);
  EXPECT_EQ(LengthOn(1, "loop", 1), c1.length());
  EXPECT_EQ(LengthOn(1, "loop", 2), c2.length());
}

TEST_F(KvMovedStreamTest, GetCacheStatsNeverFetchesAndReportsAMovedCache) {
  CreateCache(1, "on-b", {4});
  Context c;
  std::vector<Part> parts = {Step(4, &c, 30, 30)};
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(1, MakeCall("on-b", parts), &resp).ok());

  // A lacks it: NOT_FOUND from A, and B keeps it.
  v1::GetCacheStatsResponse stats;
  EXPECT_EQ(Stats(0, "on-b", &stats).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Holds(1, "on-b"));
  EXPECT_EQ(LengthOn(1, "on-b", 4), c.length());

  // An append on A fetches it (B gives it); B's statistics then say where it went.
  parts = {Step(4, &c, 1, 1)};
  resp.Clear();
  ASSERT_TRUE(Call(0, MakeCall("on-b", parts), &resp).ok());
  grpc::ClientContext ctx;
  v1::GetCacheStatsRequest r;
  r.set_cache_id("on-b");
  const grpc::Status moved = stub_[1]->GetCacheStats(&ctx, r, &stats);
  EXPECT_EQ(moved.error_code(), grpc::StatusCode::UNAVAILABLE) << moved.error_message();
  auto it = ctx.GetServerTrailingMetadata().find(kMovedToHeader);
  ASSERT_NE(it, ctx.GetServerTrailingMetadata().end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), Address(port_[0]));
  EXPECT_TRUE(Holds(0, "on-b"));
  EXPECT_FALSE(Holds(1, "on-b"));
}

class KvHandoffMetricsTest : public KvMovedStreamTest {
 protected:
  void SetUp() override {
    metrics_ = true;
    KvMovedStreamTest::SetUp();
  }
};

TEST_F(KvHandoffMetricsTest, GateCountersOnMetrics) {
  const std::string before = Metrics(1);
  EXPECT_EQ(Sample(before, "attnserve_handoff_pushed_caches_total"), 0) << before;
  EXPECT_EQ(Sample(before, "attnserve_handoff_fetches_total"), 0);

  CreateCache(1, "m", {1});
  Context c;
  std::vector<Part> parts = {Step(1, &c, 40, 1)};
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(1, MakeCall("m", parts), &resp).ok());
  // A fetches it from B: one fetch on A, one push of 40 tokens' K and V on B.
  parts = {Step(1, &c, 1, 1)};
  ASSERT_TRUE(Call(0, MakeCall("m", parts), &resp).ok());
  // B then answers moved-to for its statistics.
  v1::GetCacheStatsResponse stats;
  EXPECT_EQ(Stats(1, "m", &stats).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A call on a cache neither holds: a fetch that finds nothing (no failure).
  parts = {Step(1, &c, 1, 1)};
  EXPECT_EQ(Call(0, MakeCall("nowhere", parts), &resp).error_code(), grpc::StatusCode::NOT_FOUND);

  const std::string a = Metrics(0), b = Metrics(1);
  EXPECT_EQ(Sample(a, "attnserve_handoff_fetches_total"), 2) << a;
  EXPECT_EQ(Sample(a, "attnserve_handoff_fetched_caches_total"), 1);
  EXPECT_EQ(Sample(a, "attnserve_handoff_failures_total"), 0);
  EXPECT_EQ(Sample(b, "attnserve_handoff_pushed_caches_total"), 1) << b;
  EXPECT_EQ(Sample(b, "attnserve_handoff_pushed_bytes_total"), 2 * 40 * kKvRow * 4);
  EXPECT_EQ(Sample(b, "attnserve_handoff_refused_moved_total"), 1);
}

}  // namespace
}  // namespace attnserve
