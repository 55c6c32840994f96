// K/V caches over the wire: a real AttnServer on 127.0.0.1:0 with the CPU
// backend, called through the generated KvCache stub. The client keeps every
// sequence's whole context and checks each output against the float64
// reference over it; forks, truncation, retries, every error, expiry,
// concurrent clients, the stream form and a drain are exercised.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "server/core/validate.h"
#include "server/native/kv_service.h"
#include "server/server.h"
#include "tests/server/gated_cpu_backend.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

// One call at `layer` (the shared MakeCall's request is layer 0's).
v1::AppendAttendRequest MakeCall(const std::string& cache, int layer,
                                 const std::vector<Part>& parts, bool causal = true) {
  v1::AppendAttendRequest r = attnserve::MakeCall(cache, parts, causal);
  r.set_layer(layer);
  return r;
}

// The reference output of `q` rows over `ctx` (bottom-right causal).
std::vector<double> Reference(const std::vector<float>& q, const Context& ctx, bool causal) {
  AttnOptions options;
  options.causal = causal;
  AttnPointers pointers;
  pointers.q = q.data();
  pointers.k = ctx.k.data();
  pointers.v = ctx.v.data();
  const AttnParams p = MakeAttnParams(
      DenseShape(DType::kFP32, 1, int32_t(q.size() / (kHq * kD)), ctx.length(), kHq, kHkv, kD),
      options, pointers);
  return ReferenceAttention(p).o;
}

// Rows [row0, row0 + n) of o (FP32 [Tq, Hq, D]) against the reference.
::testing::AssertionResult Matches(const v1::AppendAttendResponse& resp, int64_t row0,
                                   const std::vector<float>& q, const Context& ctx,
                                   bool causal = true) {
  const std::vector<double> ref = Reference(q, ctx, causal);
  const float* o = reinterpret_cast<const float*>(resp.o().data().data()) + row0 * kHq * kD;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!(std::abs(o[i] - ref[i]) <= 1e-4 * (1 + std::abs(ref[i])))) {
      return ::testing::AssertionFailure()
             << "element " << i << " of rows from " << row0 << ": " << o[i] << " vs " << ref[i]
             << " (context " << ctx.length() << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

class KvServerTest : public ::testing::Test {
 protected:
  void StartServer(absl::Duration idle = absl::ZeroDuration(),
                   std::unique_ptr<AttentionBackend> backend = MakeCpuBackend(2)) {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = 16;
    o.kv_idle_timeout = idle;
    auto server = AttnServer::Create(o, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  std::string CreateCache(int layers, int64_t tokens = 4096, const std::string& id = "") {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(layers);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(tokens);
    r.set_cache_id(id);
    v1::CreateCacheResponse resp;
    const grpc::Status s = stub_->CreateCache(&ctx, r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.stats().cache_id();
  }
  grpc::Status CreateSequences(const std::string& cache, std::vector<uint64_t> ids,
                               std::optional<uint64_t> fork = {}, std::optional<int> len = {}) {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    for (uint64_t id : ids) {
      v1::SequenceSpec* s = r.add_sequences();
      s->set_sequence_id(id);
      if (fork) s->set_fork_from(*fork);
      if (len) s->set_fork_length(*len);
    }
    v1::CreateSequencesResponse resp;
    return stub_->CreateSequences(&ctx, r, &resp);
  }
  grpc::Status Call(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kCacheIdHeader, r.cache_id());
    return stub_->AppendAttend(&ctx, r, resp);
  }
  v1::GetCacheStatsResponse Stats(const std::string& cache, std::vector<uint64_t> ids = {},
                                  grpc::Status* status = nullptr) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache);
    for (uint64_t id : ids) r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    grpc::Status s = stub_->GetCacheStats(&ctx, r, &resp);
    if (status != nullptr) *status = s;
    return resp;
  }

  // A step that appends `n` new tokens to `ctx` with `nq` queries: returns the
  // part and updates the client's context.
  Part Step(uint64_t id, Context* ctx, int n, int nq) {
    Part p{id,
           ctx->length(),
           Random(&rng_, int64_t{n} * kHkv * kD),
           Random(&rng_, int64_t{n} * kHkv * kD),
           Random(&rng_, int64_t{nq} * kHq * kD),
           {}};
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    return p;
  }

  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::mt19937 rng_{11};
};

TEST_F(KvServerTest, PrefillThenDecodeMatchesReference) {
  StartServer();
  auto info_stub = v1::Attention::NewStub(channel_);
  grpc::ClientContext info_ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(info_stub->GetServerInfo(&info_ctx, {}, &info).ok());
  EXPECT_NE(std::find(info.features().begin(), info.features().end(), "kv_cache"),
            info.features().end());
  EXPECT_EQ(info.kv().default_page_size(), 16);
  EXPECT_EQ(info.kv().page_sizes_size(), 5);

  const std::string cache = CreateCache(2);
  ASSERT_TRUE(CreateSequences(cache, {1, 2}).ok());
  Context ctx[2][2];  // [sequence][layer]
  for (int layer = 0; layer < 2; ++layer) {
    Part a = Step(1, &ctx[0][layer], 37, 37);
    Part b = Step(2, &ctx[1][layer], 20, 20);
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(MakeCall(cache, layer, {a, b}), &resp).ok());
    EXPECT_TRUE(Matches(resp, 0, a.q, ctx[0][layer]));
    EXPECT_TRUE(Matches(resp, 37, b.q, ctx[1][layer]));
    EXPECT_EQ(resp.lse().shape(1), 57);
    ASSERT_EQ(resp.lengths_size(), 2);
    EXPECT_EQ(resp.lengths(0), 37);
  }
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      Part a = Step(1, &ctx[0][layer], 1, 1);
      Part b = Step(2, &ctx[1][layer], 1, 1);
      v1::AppendAttendResponse resp;
      ASSERT_TRUE(Call(MakeCall(cache, layer, {a, b}), &resp).ok());
      EXPECT_TRUE(Matches(resp, 0, a.q, ctx[0][layer]));
      EXPECT_TRUE(Matches(resp, 1, b.q, ctx[1][layer]));
      EXPECT_EQ(resp.lengths(1), 21 + step);
    }
  }
  // Attend only (no new rows) and append only (no queries).
  Part look = Step(1, &ctx[0][0], 0, 2);
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache, 0, {look}, false), &resp).ok());
  EXPECT_TRUE(Matches(resp, 0, look.q, ctx[0][0], false));
  Part quiet = Step(2, &ctx[1][0], 5, 0);
  ASSERT_TRUE(Call(MakeCall(cache, 0, {quiet}), &resp).ok());
  EXPECT_EQ(resp.o().shape(0), 0);
  const auto stats = Stats(cache, {1, 2});
  EXPECT_EQ(stats.sequences(1).lengths(0), 28);
  EXPECT_EQ(stats.stats().sequences(), 2);
}

TEST_F(KvServerTest, ForkSharesPagesAndDiverges) {
  StartServer();
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  Context a;
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache, 0, {Step(1, &a, 40, 1)}), &resp).ok());
  EXPECT_EQ(Stats(cache).stats().pages_used(), 3);
  ASSERT_TRUE(CreateSequences(cache, {2}, 1).ok());
  EXPECT_EQ(Stats(cache).stats().pages_used(), 3);  // all three shared
  ASSERT_TRUE(CreateSequences(cache, {3}, 1, 16).ok());
  Context b = a, c;
  c.k.assign(a.k.begin(), a.k.begin() + 16 * kHkv * kD);
  c.v.assign(a.v.begin(), a.v.begin() + 16 * kHkv * kD);
  // The first to write the shared partial page copies it; the other writes in place.
  Part pa = Step(1, &a, 1, 1);
  Part pb = Step(2, &b, 1, 1);
  Part pc = Step(3, &c, 3, 2);
  ASSERT_TRUE(Call(MakeCall(cache, 0, {pa}), &resp).ok());
  EXPECT_TRUE(Matches(resp, 0, pa.q, a));
  EXPECT_EQ(Stats(cache).stats().pages_used(), 4);
  ASSERT_TRUE(Call(MakeCall(cache, 0, {pb, pc}), &resp).ok());
  EXPECT_TRUE(Matches(resp, 0, pb.q, b));
  EXPECT_TRUE(Matches(resp, 1, pc.q, c));
  EXPECT_EQ(Stats(cache).stats().pages_used(), 5);  // + sequence 3's own second page
  // Sequence 1 still sees its own token, not 2's.
  Part again = Step(1, &a, 0, 1);
  ASSERT_TRUE(Call(MakeCall(cache, 0, {again}), &resp).ok());
  EXPECT_TRUE(Matches(resp, 0, again.q, a));
}

TEST_F(KvServerTest, TruncateThenReappend) {
  StartServer();
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {5}).ok());
  Context ctx;
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache, 0, {Step(5, &ctx, 30, 0)}), &resp).ok());
  grpc::ClientContext tctx;
  v1::TruncateRequest t;
  t.set_cache_id(cache);
  t.set_sequence_id(5);
  t.set_length(20);
  v1::TruncateResponse tresp;
  ASSERT_TRUE(stub_->Truncate(&tctx, t, &tresp).ok());
  EXPECT_EQ(tresp.stats().pages_used(), 2);
  ctx.k.resize(20 * kHkv * kD);
  ctx.v.resize(20 * kHkv * kD);
  Part p = Step(5, &ctx, 5, 3);
  ASSERT_TRUE(Call(MakeCall(cache, 0, {p}), &resp).ok());
  EXPECT_TRUE(Matches(resp, 0, p.q, ctx));
  EXPECT_EQ(resp.lengths(0), 25);
}

// kv_ops_fuzzer's finding (crash-a88e91d5): a query-only call on the empty
// sequences of a cache that has never held a token (no slab allocated yet)
// was refused with INVALID_ARGUMENT "paged params: num_slabs expected in [1,
// 32], got 0". Rows that see no key: O exactly 0, LSE -inf; nothing appended.
TEST_F(KvServerTest, QueriesOnAFreshCacheSeeNoKeys) {
  StartServer();
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {1, 2}).ok());
  Context empty;
  v1::AppendAttendResponse resp;
  const grpc::Status s =
      Call(MakeCall(cache, 0, {Step(1, &empty, 0, 2), Step(2, &empty, 0, 1)}), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const float* o = reinterpret_cast<const float*>(resp.o().data().data());
  for (int64_t i = 0; i < 3 * kHq * kD; ++i) ASSERT_EQ(o[i], 0.0f) << i;
  const float* lse = reinterpret_cast<const float*>(resp.lse().data().data());
  for (int64_t i = 0; i < 3 * kHq; ++i) ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
  ASSERT_EQ(resp.lengths_size(), 2);
  EXPECT_EQ(resp.lengths(0), 0);
  EXPECT_EQ(resp.lengths(1), 0);
  EXPECT_EQ(Stats(cache).stats().pages_used(), 0);
}

TEST_F(KvServerTest, StaleLengthRetryChangesNothing) {
  StartServer();
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  Context ctx;
  const v1::AppendAttendRequest call = MakeCall(cache, 0, {Step(1, &ctx, 7, 1)});
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(call, &resp).ok());
  const grpc::Status retry = Call(call, &resp);  // the response was "lost"
  EXPECT_EQ(retry.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(retry.error_message().find("has 7 tokens"), std::string::npos) << retry.error_message();
  const auto stats = Stats(cache, {1});
  EXPECT_EQ(stats.sequences(0).lengths(0), 7);
  EXPECT_EQ(stats.stats().pages_used(), 1);
}

// A small request cannot ask for a large answer: GetCacheStats answers each
// id once, and refuses more ids than kMaxKvIdsPerCall or more lengths than
// kMaxKvStatsLengths (before the bound, 200,000 copies of one id on a
// 1,000-layer cache drew a 201 MB answer); CreateSequences and
// FreeSequences take at most kMaxKvIdsPerCall ids.
TEST_F(KvServerTest, IdListsAndAnswersAreBounded) {
  StartServer();
  const std::string cache = CreateCache(kMaxKvLayers, 64);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  grpc::Status status;
  v1::GetCacheStatsResponse stats =
      Stats(cache, std::vector<uint64_t>(kMaxKvIdsPerCall, 1), &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(stats.sequences_size(), 1);
  EXPECT_EQ(stats.sequences(0).lengths_size(), kMaxKvLayers);
  Stats(cache, std::vector<uint64_t>(200000, 1), &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("sequence_ids"), std::string::npos)
      << status.error_message();
  std::vector<uint64_t> distinct(kMaxKvStatsLengths / kMaxKvLayers + 1);
  for (size_t i = 0; i < distinct.size(); ++i) distinct[i] = i + 1;
  Stats(cache, distinct, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("lengths"), std::string::npos) << status.error_message();

  std::vector<uint64_t> many(kMaxKvIdsPerCall + 1);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 1000 + i;
  EXPECT_EQ(CreateSequences(cache, many).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext ctx;
  v1::FreeSequencesRequest f;
  f.set_cache_id(cache);
  for (uint64_t id : many) f.add_sequence_ids(id);
  v1::FreeSequencesResponse fresp;
  EXPECT_EQ(stub_->FreeSequences(&ctx, f, &fresp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Nothing was created by the refused call.
  EXPECT_EQ(Stats(cache).stats().sequences(), 1);
}

TEST_F(KvServerTest, EveryErrorNamed) {
  StartServer();
  const std::string cache = CreateCache(1, 64, "small");
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  Context ctx;
  v1::AppendAttendResponse resp;
  auto expect = [&](const grpc::Status& s, grpc::StatusCode code, const std::string& text) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos) << s.error_message();
  };
  v1::AppendAttendRequest r = MakeCall("nope", 0, {Step(1, &ctx, 1, 1)});
  expect(Call(r, &resp), grpc::StatusCode::NOT_FOUND, "cache 'nope' not found");
  r = MakeCall(cache, 0, {Part{9, 0, {}, {}, {}, {}}});
  expect(Call(r, &resp), grpc::StatusCode::NOT_FOUND, "sequence 9");
  r = MakeCall(cache, 3, {Part{1, 0, {}, {}, {}, {}}});
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "layer");
  ctx = Context{};
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_k()->set_dtype(v1::BF16);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "k.");
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_q()->set_shape(1, 3);  // Hq not a multiple of Hkv
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "q.");
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_options()->set_softcap(-1);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "options.softcap");
  // The score ranges of backend/score_range.h hold here as for Forward: these
  // values made the kernels' scores overflow to NaN.
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_options()->set_softmax_scale(2e38f);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "options.softmax_scale");
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_options()->set_softcap(1e-39f);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "options.softcap");
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_options()->set_softcap(3e38f);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "options.softcap");
  // Descales are FP8-only, and a call's dtype is never FP8 (FP8 caches
  // have per-row scales instead).
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.mutable_options()->set_q_descale(0.5f);
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "options.q_descale");
  r = MakeCall(cache, 0, {Step(1, &ctx, 2, 1)});
  r.set_request_id(std::string(kMaxRequestIdBytes + 1, 'x'));
  expect(Call(r, &resp), grpc::StatusCode::INVALID_ARGUMENT, "request_id");
  ctx = Context{};
  r = MakeCall(cache, 0, {Step(1, &ctx, 65, 0)});  // capacity is 64 tokens (4 pages)
  expect(Call(r, &resp), grpc::StatusCode::RESOURCE_EXHAUSTED, "needs 5 pages, 4 are free");
  EXPECT_EQ(Stats(cache, {1}).sequences(0).lengths(0), 0);
  expect(CreateSequences(cache, {1}), grpc::StatusCode::ALREADY_EXISTS, "already exists");
  expect(CreateSequences(cache, {2}, 77), grpc::StatusCode::NOT_FOUND, "fork_from");
  grpc::ClientContext c1;
  v1::CreateCacheRequest cr;
  cr.mutable_geometry()->set_num_layers(1);
  cr.mutable_geometry()->set_num_heads_kv(1);
  cr.mutable_geometry()->set_head_dim(12);
  cr.mutable_geometry()->set_dtype(v1::FP32);
  cr.set_capacity_tokens(10);
  v1::CreateCacheResponse cresp;
  expect(stub_->CreateCache(&c1, cr, &cresp), grpc::StatusCode::INVALID_ARGUMENT,
         "geometry.head_dim");
  grpc::ClientContext c1b;
  cr.mutable_geometry()->set_head_dim(8);
  cr.mutable_geometry()->set_dtype(v1::FP8_E4M3);  // FP8 pages are cache_dtype's
  expect(stub_->CreateCache(&c1b, cr, &cresp), grpc::StatusCode::INVALID_ARGUMENT,
         "geometry.dtype: expected FP16, BF16 or FP32 (for FP8 pages set geometry.cache_dtype "
         "FP8_E4M3), got FP8_E4M3");
  cr.mutable_geometry()->set_dtype(v1::FP32);
  grpc::ClientContext c2;
  cr.set_page_size(100);
  expect(stub_->CreateCache(&c2, cr, &cresp), grpc::StatusCode::INVALID_ARGUMENT, "page_size");
  grpc::ClientContext c3;
  cr.set_page_size(0);
  cr.set_cache_id("small");
  expect(stub_->CreateCache(&c3, cr, &cresp), grpc::StatusCode::ALREADY_EXISTS, "small");
  grpc::ClientContext c4;
  v1::TruncateRequest t;
  t.set_cache_id(cache);
  t.set_sequence_id(1);
  t.set_length(3);
  v1::TruncateResponse tresp;
  expect(stub_->Truncate(&c4, t, &tresp), grpc::StatusCode::INVALID_ARGUMENT, "length");
  grpc::ClientContext c5;
  v1::FreeSequencesRequest f;
  f.set_cache_id(cache);
  f.add_sequence_ids(1);
  f.add_sequence_ids(42);
  v1::FreeSequencesResponse fresp;
  expect(stub_->FreeSequences(&c5, f, &fresp), grpc::StatusCode::NOT_FOUND, "sequence 42");
  EXPECT_EQ(Stats(cache).stats().sequences(), 1);  // all or nothing
  grpc::ClientContext c6;
  v1::DropCacheRequest d;
  d.set_cache_id(cache);
  v1::DropCacheResponse dresp;
  ASSERT_TRUE(stub_->DropCache(&c6, d, &dresp).ok());
  grpc::Status gone;
  Stats(cache, {}, &gone);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvServerTest, IdleSequencesThenCachesExpire) {
  StartServer(absl::Milliseconds(300));
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  v1::AppendAttendResponse resp;
  Context ctx;
  ASSERT_TRUE(Call(MakeCall(cache, 0, {Step(1, &ctx, 20, 1)}), &resp).ok());
  // Reading the statistics keeps the cache in use while the sequence idles.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  v1::GetCacheStatsResponse stats;
  do {
    stats = Stats(cache);
    ASSERT_LT(absl::Now(), give_up) << "the idle sequence never expired";
    absl::SleepFor(absl::Milliseconds(20));
  } while (stats.stats().expired_sequences() == 0);
  EXPECT_EQ(stats.stats().sequences(), 0);
  EXPECT_EQ(stats.stats().pages_used(), 0);
  // Left alone, the cache goes too: NOT_FOUND, and the client re-creates it.
  grpc::Status status;
  do {
    ASSERT_LT(absl::Now(), give_up) << "the idle cache never expired";
    absl::SleepFor(absl::Milliseconds(400));
    Stats(cache, {}, &status);
  } while (status.ok());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvServerTest, ConcurrentClientsOnSeparateAndSharedCaches) {
  StartServer();
  const std::string shared = CreateCache(1);
  std::vector<std::thread> clients;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(100 + c);
      auto stub = v1::KvCache::NewStub(channel_);
      const std::string cache = c % 2 == 0 ? shared : CreateCache(1);
      const uint64_t id = 10 + c;
      if (!CreateSequences(cache, {id}).ok()) ++failures;
      Context ctx;
      for (int step = 0; step < 6; ++step) {
        const int n = step == 0 ? 24 : 1;
        Part p{id,
               ctx.length(),
               Random(&rng, n * kHkv * kD),
               Random(&rng, n * kHkv * kD),
               Random(&rng, kHq * kD),
               {}};
        ctx.k.insert(ctx.k.end(), p.k.begin(), p.k.end());
        ctx.v.insert(ctx.v.end(), p.v.begin(), p.v.end());
        v1::AppendAttendResponse resp;
        grpc::ClientContext cctx;
        if (!stub->AppendAttend(&cctx, MakeCall(cache, 0, {p}), &resp).ok() ||
            !Matches(resp, 0, p.q, ctx)) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Stats(shared).stats().sequences(), 2);
}

// Decode steps of different clients (separate connections, separate
// sequences) for one cache and layer that meet in the executor's queue run as
// one paged launch, and each client gets its own rows back.
TEST_F(KvServerTest, DifferentClientsCoalesceIntoOnePagedLaunch) {
  auto gated = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* backend = gated.get();
  StartServer(absl::ZeroDuration(), std::move(gated));
  const std::string cache = CreateCache(1);
  constexpr int kClients = 4;
  ASSERT_TRUE(CreateSequences(cache, {1, 2, 3, 4}).ok());
  Context ctx[kClients];
  for (int c = 0; c < kClients; ++c) {
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(MakeCall(cache, 0, {Step(1 + c, &ctx[c], 9 + c, 1)}), &resp).ok());
  }
  std::vector<Part> parts;
  for (int c = 0; c < kClients; ++c) parts.push_back(Step(1 + c, &ctx[c], 1, 1));

  backend->Close();
  const int before = backend->calls();
  std::vector<grpc::Status> status(kClients);
  std::vector<v1::AppendAttendResponse> resp(kClients);
  auto send = [&](int c) {
    // Its own connection: a local subchannel pool keeps channels apart.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = v1::KvCache::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext cctx;
    cctx.AddMetadata(kCacheIdHeader, cache);
    status[c] = stub->AppendAttend(&cctx, MakeCall(cache, 0, {parts[c]}), &resp[c]);
  };
  std::vector<std::thread> clients;
  clients.emplace_back(send, 0);
  backend->AwaitCalls(before + 1);  // the first client's launch is held
  for (int c = 1; c < kClients; ++c) clients.emplace_back(send, c);
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (server_->queued_requests() < kClients - 1) {
    ASSERT_LT(absl::Now(), give_up) << "the other clients' steps never queued";
    absl::SleepFor(absl::Milliseconds(1));
  }
  backend->Open();
  for (std::thread& t : clients) t.join();
  // One launch for the held step, one for the three that queued behind it.
  EXPECT_EQ(backend->calls() - before, 2);
  for (int c = 0; c < kClients; ++c) {
    SCOPED_TRACE(c);
    ASSERT_TRUE(status[c].ok()) << status[c].error_message();
    EXPECT_EQ(resp[c].timing().batch_size(), c == 0 ? 1 : kClients - 1);
    EXPECT_TRUE(Matches(resp[c], 0, parts[c].q, ctx[c]));
    EXPECT_EQ(resp[c].lengths(0), 10 + c);
  }
}

TEST_F(KvServerTest, StreamRunsAGenerationLoop) {
  StartServer();
  const std::string cache = CreateCache(2);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  grpc::ClientContext sctx;
  sctx.AddMetadata(kCacheIdHeader, cache);
  auto stream = stub_->AppendAttendStream(&sctx);
  Context ctx[2];
  for (int step = 0; step < 4; ++step) {
    // Both layers of a step in flight at once (independent pairs), plus a bad one.
    std::map<std::string, std::pair<Part, int>> sent;
    for (int layer = 0; layer < 2; ++layer) {
      Part p = Step(1, &ctx[layer], step == 0 ? 18 : 1, 1);
      v1::AppendAttendRequest r = MakeCall(cache, layer, {p});
      r.set_request_id(absl::StrCat("s", step, "l", layer));
      sent.emplace(r.request_id(), std::make_pair(p, layer));
      ASSERT_TRUE(stream->Write(r));
    }
    v1::AppendAttendRequest bad = MakeCall(cache, 0, {Part{99, 0, {}, {}, {}, {}}});
    bad.set_request_id("bad");
    ASSERT_TRUE(stream->Write(bad));
    for (int i = 0; i < 3; ++i) {
      v1::AppendAttendResponse resp;
      ASSERT_TRUE(stream->Read(&resp));
      if (resp.request_id() == "bad") {
        EXPECT_EQ(resp.error_code(), int(grpc::StatusCode::NOT_FOUND));
        continue;
      }
      ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
      const auto& [p, layer] = sent.at(resp.request_id());
      // The context as of this step (later steps have not been added yet).
      EXPECT_TRUE(Matches(resp, 0, p.q, ctx[layer]));
    }
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Calls on one (sequence, layer) pipelined on a stream apply in the order
// sent: each expects the length the previous one leaves. The stream reactor
// used to start the next read before (or, resuming after a flow-control
// pause, while) the current request started, so a later call could be
// admitted first and fail its expected length (64 queries a call make the
// start slow enough for that to show).
TEST_F(KvServerTest, StreamAppliesPipelinedCallsOnOnePairInOrder) {
  StartServer();
  constexpr int kCalls = 300;
  const std::string cache = CreateCache(1, 2 * kCalls);
  ASSERT_TRUE(CreateSequences(cache, {1}).ok());
  grpc::ClientContext sctx;
  sctx.AddMetadata(kCacheIdHeader, cache);
  auto stream = stub_->AppendAttendStream(&sctx);
  std::vector<v1::AppendAttendResponse> responses;
  std::thread reader([&] {  // reads while the writes go on: the stream's flow control
    v1::AppendAttendResponse resp;
    while (stream->Read(&resp)) responses.push_back(resp);
  });
  Context ctx;
  for (int i = 0; i < kCalls; ++i) {
    v1::AppendAttendRequest r = MakeCall(cache, 0, {Step(1, &ctx, 1, 64)});
    r.set_request_id(absl::StrCat(i));
    if (!stream->Write(r)) break;
  }
  stream->WritesDone();
  reader.join();
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(responses.size(), size_t{kCalls});
  for (const v1::AppendAttendResponse& resp : responses) {
    ASSERT_EQ(resp.error_code(), 0) << resp.request_id() << ": " << resp.error_message();
    ASSERT_EQ(resp.lengths_size(), 1);
    EXPECT_EQ(resp.lengths(0), std::stoi(resp.request_id()) + 1) << resp.request_id();
  }
}

TEST_F(KvServerTest, DrainFinishesACallInFlight) {
  auto gated = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* backend = gated.get();
  StartServer(absl::ZeroDuration(), std::move(gated));
  const std::string cache = CreateCache(1);
  ASSERT_TRUE(CreateSequences(cache, {1, 2}).ok());
  Context ctx;
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache, 0, {Step(1, &ctx, 10, 1)}), &resp).ok());
  backend->Close();
  const int before = backend->calls();
  Part p = Step(1, &ctx, 1, 1);
  grpc::Status in_flight_status;
  v1::AppendAttendResponse in_flight;
  std::thread decode([&] { in_flight_status = Call(MakeCall(cache, 0, {p}), &in_flight); });
  backend->AwaitCalls(before + 1);  // the decode step is in the backend
  std::thread drain([&] { server_->Shutdown(absl::Seconds(30)); });
  // Evidence the drain began: bookkeeping calls (answered on the spot) are refused.
  grpc::Status probe;
  for (uint64_t id = 1000; probe.ok(); ++id) probe = CreateSequences(cache, {id});
  EXPECT_EQ(probe.error_code(), grpc::StatusCode::UNAVAILABLE) << probe.error_message();
  Context other;
  v1::AppendAttendResponse refused_resp;
  const grpc::Status refused = Call(MakeCall(cache, 0, {Step(2, &other, 1, 1)}), &refused_resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  backend->Open();
  decode.join();
  drain.join();
  ASSERT_TRUE(in_flight_status.ok()) << in_flight_status.error_message();
  EXPECT_TRUE(Matches(in_flight, 0, p.q, ctx));
  EXPECT_EQ(in_flight.lengths(0), 11);
}

}  // namespace
}  // namespace attnserve
