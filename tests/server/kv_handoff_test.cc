// --handoff_peer over the wire: two CPU servers on 127.0.0.1, each the
// other's peer. A drained server moves its caches to the peer and answers
// later calls UNAVAILABLE "cache <id> moved to <peer>" with the trailing
// metadata x-attnserve-moved-to; a server asked for a cache it lacks fetches
// it from the peer (which then drops its copy); KvClient follows a moved-to
// answer. Every step's O and LSE are held to the float64 reference over the
// whole history, so a lost or doubled token fails.
#include <memory>
#include <string>
#include <vector>

#include "client/attention_client.h"
#include "client/kv_client.h"
#include "tests/server/kv_handoff_fixture.h"

namespace attnserve {
namespace {

TEST_F(KvHandoffTest, DrainMovesCachesAnswersMovedToAndARestartFetchesThemBack) {
  CreateCache(0, "moving", {1, 2});
  Context c1, c2;
  {
    std::vector<Part> parts = {Step(1, &c1, 20, 20), Step(2, &c2, 37, 37)};
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(0, MakeCall("moving", parts), &resp).ok());
    CheckResponse(resp, parts, {&c1, &c2}, Mods());
  }
  DrainInBackground(0);
  WaitMoved(0, "moving");

  // A's answer names B; the step changed nothing on A and is retried on B.
  std::vector<Part> parts = {Step(1, &c1, 1, 1), Step(2, &c2, 1, 1)};
  const v1::AppendAttendRequest step = MakeCall("moving", parts);
  v1::AppendAttendResponse resp;
  std::string moved_to;
  const grpc::Status refused = Call(0, step, &resp, &moved_to);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(), "cache moving moved to " + Address(port_[1]));
  EXPECT_EQ(moved_to, Address(port_[1]));
  {
    // A cache A never held goes to the peer too (a client creates it there).
    grpc::ClientContext ctx;
    v1::CreateCacheRequest create;
    create.set_cache_id("new");
    v1::CreateCacheResponse created;
    EXPECT_EQ(stub_[0]->CreateCache(&ctx, create, &created).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  resp.Clear();
  ASSERT_TRUE(Call(1, step, &resp).ok());
  CheckResponse(resp, parts, {&c1, &c2}, Mods());
  Joined();

  // A restarted A fetches the cache back on its next call; B drops its copy.
  server_[0].reset();
  Start(0);
  parts = {Step(1, &c1, 3, 3), Step(2, &c2, 1, 1)};
  resp.Clear();
  ASSERT_TRUE(Call(0, MakeCall("moving", parts), &resp).ok());
  CheckResponse(resp, parts, {&c1, &c2}, Mods());
  EXPECT_FALSE(Holds(1, "moving"));
  v1::GetCacheStatsResponse stats;
  ASSERT_TRUE(Stats(0, "moving", &stats).ok());
  EXPECT_EQ(stats.stats().sequences(), 2);
  EXPECT_EQ(stats.stats().tokens(), c1.length() + c2.length());
}

// A drain hands an absorbed-form MLA cache (K pages alone) over like any
// other: the peer holds it with the same geometry and the same rows.
TEST_F(KvHandoffTest, DrainMovesAnMlaCache) {
  constexpr int kMlaD = 24, kMlaDv = 16, kTokens = 37;
  {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(1);
    r.mutable_geometry()->set_head_dim(kMlaD);
    r.mutable_geometry()->set_head_dim_v(kMlaDv);
    r.mutable_geometry()->set_v_in_k(true);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(1024);
    r.set_cache_id("mla");
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub_[0]->CreateCache(&ctx, r, &resp).ok());
    grpc::ClientContext seq_ctx;
    v1::CreateSequencesRequest sr;
    sr.set_cache_id("mla");
    sr.add_sequences()->set_sequence_id(4);
    v1::CreateSequencesResponse s_resp;
    ASSERT_TRUE(stub_[0]->CreateSequences(&seq_ctx, sr, &s_resp).ok());
  }
  // Attend-only query after an append: O rows of V's width, the same bytes on both.
  auto step = [&](int i, int new_tokens, int before) {
    v1::AppendAttendRequest r;
    r.set_cache_id("mla");
    v1::SequenceStep* st = r.add_sequences();
    st->set_sequence_id(4);
    st->set_expected_length(before);
    st->set_num_new_tokens(new_tokens);
    st->set_num_queries(1);
    std::vector<float> q(size_t(kHq) * kMlaD), k(size_t(new_tokens) * kMlaD);
    for (size_t j = 0; j < q.size(); ++j) q[j] = float((j * 7) % 13) / 13.0f - 0.5f;
    for (size_t j = 0; j < k.size(); ++j) k[j] = float((j * 5) % 11) / 11.0f - 0.5f;
    v1::Tensor* tq = r.mutable_q();
    tq->set_dtype(v1::FP32);
    for (int64_t d : {int64_t{1}, int64_t{kHq}, int64_t{kMlaD}}) tq->add_shape(d);
    tq->set_data(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
    if (new_tokens > 0) {
      v1::Tensor* tk = r.mutable_k();
      tk->set_dtype(v1::FP32);
      for (int64_t d : {int64_t{new_tokens}, int64_t{1}, int64_t{kMlaD}}) tk->add_shape(d);
      tk->set_data(std::string(reinterpret_cast<const char*>(k.data()), k.size() * 4));
    }
    v1::AppendAttendResponse resp;
    const grpc::Status st_call = Call(i, r, &resp);
    EXPECT_TRUE(st_call.ok()) << st_call.error_message();
    EXPECT_EQ(resp.o().data().size(), size_t(kHq) * kMlaDv * 4);
    return resp.o().data();
  };
  step(0, kTokens, 0);
  const std::string before = step(0, 0, kTokens);
  DrainInBackground(0);
  WaitMoved(0, "mla");
  v1::GetCacheStatsResponse stats;
  ASSERT_TRUE(Stats(1, "mla", &stats).ok());
  EXPECT_EQ(stats.stats().geometry().head_dim_v(), kMlaDv);
  EXPECT_TRUE(stats.stats().geometry().v_in_k());
  EXPECT_EQ(stats.stats().tokens(), kTokens);
  EXPECT_EQ(step(1, 0, kTokens), before);
  Joined();
}

TEST_F(KvHandoffTest, MissingCacheIsFetchedFromThePeerOrNotFound) {
  CreateCache(1, "on-b", {5});
  Context c;
  std::vector<Part> parts = {Step(5, &c, 70, 70)};
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(1, MakeCall("on-b", parts), &resp).ok());

  parts = {Step(5, &c, 1, 1)};
  resp.Clear();
  ASSERT_TRUE(Call(0, MakeCall("on-b", parts), &resp).ok());
  CheckResponse(resp, parts, {&c}, Mods());
  EXPECT_FALSE(Holds(1, "on-b"));
  EXPECT_TRUE(Holds(0, "on-b"));
  // A call on B now asks A to give it back (each move consistent), and B serves it.
  parts = {Step(5, &c, 1, 1)};
  resp.Clear();
  ASSERT_TRUE(Call(1, MakeCall("on-b", parts), &resp).ok());
  CheckResponse(resp, parts, {&c}, Mods());
  EXPECT_FALSE(Holds(0, "on-b"));
  v1::GetCacheStatsResponse stats;

  // Neither server holds it: NOT_FOUND, as without a peer.
  EXPECT_EQ(Stats(0, "nowhere", &stats).error_code(), grpc::StatusCode::NOT_FOUND);
  Context none;
  parts = {Step(1, &none, 1, 1)};
  EXPECT_EQ(Call(0, MakeCall("nowhere", parts), &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvHandoffTest, KvClientFollowsMovedTo) {
  CreateCache(0, "followed", {3});
  Context c;
  std::vector<Part> parts = {Step(3, &c, 9, 9)};
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(0, MakeCall("followed", parts), &resp).ok());

  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(Address(port_[0]));
  ASSERT_TRUE(client.ok());
  KvClient kv(**client);
  DrainInBackground(0);
  WaitMoved(0, "followed");
  for (int t = 0; t < 3; ++t) {
    parts = {Step(3, &c, 1, 1)};
    absl::StatusOr<v1::AppendAttendResponse> out = kv.AppendAttend(MakeCall("followed", parts));
    ASSERT_TRUE(out.ok()) << out.status();
    CheckResponse(*out, parts, {&c}, Mods());
  }
  // The first call followed the answer; the cache's later calls went to B.
  EXPECT_EQ(kv.moved_retries(), 1);
  Joined();
}

// The peer's side of a failed push: an import that created its cache and
// kept no row leaves no cache behind; one that kept rows of a sequence that
// never went live takes the cache with it when it expires (R1-F5).
class KvHandoffImportTest : public KvHandoffTest {
 protected:
  void SetUp() override {
    tune_ = [](int i, ServerOptions* o) {
      if (i == 1) o->kv_import_idle_timeout = absl::Seconds(2);
    };
    KvHandoffTest::SetUp();
    transfer_ = v1::KvTransfer::NewStub(
        grpc::CreateChannel(Address(port_[1]), grpc::InsecureChannelCredentials()));
  }

  // Server 0's cache "src", one sequence of 40 tokens, exported a page per chunk.
  std::vector<v1::KvChunk> SourceChunks() {
    CreateCache(0, "src", {1});
    Context c;
    std::vector<Part> parts = {Step(1, &c, 40, 1)};
    v1::AppendAttendResponse resp;
    EXPECT_TRUE(Call(0, MakeCall("src", parts), &resp).ok());
    auto transfer = v1::KvTransfer::NewStub(
        grpc::CreateChannel(Address(port_[0]), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::ExportSequencesRequest r;
    r.set_cache_id("src");
    r.set_transfer_id("t-1");
    r.set_max_chunk_bytes(1);
    auto reader = transfer->ExportSequences(&ctx, r);
    std::vector<v1::KvChunk> chunks;
    v1::KvChunk chunk;
    while (reader->Read(&chunk)) chunks.push_back(chunk);
    EXPECT_TRUE(reader->Finish().ok());
    return chunks;
  }

  // Opens an import into server 1's "dst" with `create`, sends `send` of
  // `chunks`, then half-closes; the stream's status.
  grpc::Status Import(const std::vector<v1::KvChunk>& chunks, size_t send,
                      int64_t capacity_tokens = 4096) {
    grpc::ClientContext ctx;
    auto stream = transfer_->ImportSequences(&ctx);
    v1::ImportSequencesRequest first;
    first.set_cache_id("dst");
    first.mutable_create()->set_capacity_tokens(capacity_tokens);
    *first.mutable_header() = chunks[0].header();
    stream->Write(first);
    for (size_t i = 0; i < send; ++i) {
      v1::ImportSequencesRequest next;
      *next.mutable_chunk() = chunks[i];
      stream->Write(next);
    }
    stream->WritesDone();
    v1::ImportSequencesResponse answer;
    while (stream->Read(&answer)) {
    }
    return stream->Finish();
  }

  bool DstExists() {
    v1::GetCacheStatsResponse stats;
    const grpc::Status status = Stats(1, "dst", &stats);
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::NOT_FOUND)
        << status.error_message();
    return status.ok();
  }

  std::unique_ptr<v1::KvTransfer::Stub> transfer_;
};

TEST_F(KvHandoffImportTest, AnImportThatKeptNoRowLeavesNoCache) {
  const std::vector<v1::KvChunk> chunks = SourceChunks();
  ASSERT_EQ(chunks.size(), 3u);
  // Ended before any chunk (as a push that wanted UCX and was refused it).
  EXPECT_EQ(Import(chunks, 0).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_FALSE(DstExists());
  // The header refused after the create (40 tokens in a 16-token cache).
  const grpc::Status refused = Import(chunks, 0, /*capacity_tokens=*/16);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_NE(refused.error_message().find("header.sequences[0].lengths"), std::string::npos)
      << refused.error_message();
  EXPECT_FALSE(DstExists());
  // A whole import creates it and keeps it.
  EXPECT_TRUE(Import(chunks, chunks.size()).ok());
  EXPECT_TRUE(DstExists());
}

TEST_F(KvHandoffImportTest, ACutImportsCreatedCacheGoesWhenItExpires) {
  const std::vector<v1::KvChunk> chunks = SourceChunks();
  ASSERT_EQ(chunks.size(), 3u);
  // One page of the sequence kept: the cache waits for a resume ...
  EXPECT_EQ(Import(chunks, 1).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(DstExists());
  // ... and goes with the session at the idle timeout (2 s).
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (DstExists() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(DstExists());
}

// Issue 28: a drain moves every cache the pool holds, not only those a call
// has named: server 1's "dst" was made by an import alone (no KvCache call
// ever named it there), and after server 1's drain server 0 holds it, its
// sequence whole (40 tokens).
TEST_F(KvHandoffImportTest, ADrainMovesACacheOnlyAnImportMade) {
  const std::vector<v1::KvChunk> chunks = SourceChunks();
  ASSERT_EQ(chunks.size(), 3u);
  ASSERT_TRUE(Import(chunks, chunks.size()).ok());
  ASSERT_TRUE(Holds(1, "dst"));
  ASSERT_FALSE(Holds(0, "dst"));
  DrainInBackground(1);
  WaitMoved(1, "dst");
  EXPECT_TRUE(Holds(0, "dst")) << "the drain lost a cache no call had named";
  v1::GetCacheStatsResponse stats;
  const grpc::Status status = Stats(0, "dst", &stats);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(stats.stats().sequences(), 1);
  EXPECT_EQ(stats.stats().tokens(), 40);
  Joined();
}

}  // namespace
}  // namespace attnserve
