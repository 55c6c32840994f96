// KvClient against the real KvCache service of an in-process AttnServer (CPU
// backend): prefill and decode held to the float64 reference over the whole
// context the client keeps, forks, truncate and re-append, a stale expected
// length, free, drop and NOT_FOUND, and many requests in flight on one stream.
// Skipped (with the reason) when the server build has no KvCache service.
#include "client/kv_client.h"

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 32;
constexpr DType kDType = DType::kFP16;

// What the server should hold: each sequence's K and V rows per layer.
struct Rows {
  std::string k, v;
  int length = 0;
};

class KvClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start();
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
    auto info = client_->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    const auto& f = info->features();
    if (std::find(f.begin(), f.end(), "kv_cache") == f.end()) {
      GTEST_SKIP() << "this server build has no KvCache service (no kv_cache feature)";
    }
    kv_ = std::make_unique<KvClient>(*client_);
    CacheSpec spec;
    spec.geometry = {kLayers, kHkv, kD, kDType};
    spec.page_size = 16;
    spec.capacity_tokens = 4096;
    auto stats = kv_->CreateCache(spec);
    ASSERT_TRUE(stats.ok()) << stats.status();
    cache_ = stats->cache_id();
    EXPECT_EQ(stats->page_size(), 16);
  }
  void TearDown() override {
    if (kv_ != nullptr && !cache_.empty()) kv_->DropCache(cache_).IgnoreError();
  }

  HostTensor Random(int rows, int heads) { return RandomTensor(kDType, {rows, heads, kD}, &rng_); }

  // One call at `layer`: for each (sequence, new tokens, queries) its random
  // rows, appended to the client's copy; returns the result and checks O
  // against the reference over each sequence's whole context (causal).
  absl::StatusOr<AppendAttendResult> Step(int layer,
                                          const std::vector<std::tuple<uint64_t, int, int>>& parts,
                                          AppendAttendStream* stream = nullptr) {
    AppendAttendInputs in = Build(layer, parts);
    absl::StatusOr<AppendAttendResult> r =
        stream != nullptr ? stream->Call(in) : kv_->AppendAttend(in);
    if (r.ok()) Verify(in, *r);
    return r;
  }

  AppendAttendInputs Build(int layer, const std::vector<std::tuple<uint64_t, int, int>>& parts) {
    AppendAttendInputs in;
    in.cache_id = cache_;
    in.layer = layer;
    in.options.causal = true;
    std::vector<HostTensor> q, k, v;
    for (const auto& [id, n, nq] : parts) {
      in.sequences.push_back({id, rows_[id][layer].length, n, nq});
      q.push_back(Random(nq, kHq));
      k.push_back(Random(n, kHkv));
      v.push_back(Random(n, kHkv));
    }
    in.q = *ConcatRows(q, kDType, {0, kHq, kD});
    in.k = *ConcatRows(k, kDType, {0, kHkv, kD});
    in.v = *ConcatRows(v, kDType, {0, kHkv, kD});
    return in;
  }

  // Appends the call's new rows to the copies, then checks each sequence's
  // slice of O against the reference over its whole context.
  void Verify(const AppendAttendInputs& in, const AppendAttendResult& r) {
    int64_t q_row = 0, k_row = 0;
    for (size_t i = 0; i < in.sequences.size(); ++i) {
      const KvClientStep& s = in.sequences[i];
      Rows& rows = rows_[s.sequence_id][in.layer];
      rows.k += in.k.SliceRows(k_row, s.num_new_tokens)->bytes();
      rows.v += in.v.SliceRows(k_row, s.num_new_tokens)->bytes();
      rows.length += s.num_new_tokens;
      k_row += s.num_new_tokens;
      EXPECT_EQ(r.lengths[i], rows.length) << "sequence " << s.sequence_id;
      if (s.num_queries == 0) continue;
      AttentionInputs ref;
      ref.q = *in.q.SliceRows(q_row, s.num_queries);
      ref.k = *HostTensor::FromBytes(kDType, {rows.length, kHkv, kD}, rows.k);
      ref.v = *HostTensor::FromBytes(kDType, {rows.length, kHkv, kD}, rows.v);
      ref.cu_seqlens_q = {0, s.num_queries};
      ref.cu_seqlens_k = {0, rows.length};
      ref.options = in.options;
      ForwardResult out;
      out.o = *r.o.SliceRows(q_row, s.num_queries);
      q_row += s.num_queries;
      auto report = VerifyForward(ref, out);
      ASSERT_TRUE(report.ok()) << report.status();
      EXPECT_TRUE(report->passed) << "sequence " << s.sequence_id << " layer " << in.layer << ": "
                                  << report->failure;
    }
  }

  static LoopbackServer* server_;
  std::unique_ptr<AttentionClient> client_;
  std::unique_ptr<KvClient> kv_;
  std::string cache_;
  std::mt19937_64 rng_{7};
  std::map<uint64_t, std::vector<Rows>> rows_;  // [sequence][layer]

  void Track(uint64_t id) { rows_[id].assign(kLayers, Rows()); }
};

LoopbackServer* KvClientTest::server_ = nullptr;

TEST_F(KvClientTest, PrefillThenDecodeMatchesTheReference) {
  ASSERT_TRUE(kv_->CreateSequences(cache_, {{1}, {2}}).ok());
  Track(1);
  Track(2);
  for (int layer = 0; layer < kLayers; ++layer) {
    // Two prompts of different lengths in one call (the varlen layout).
    auto r = Step(layer, {{1, 20, 20}, {2, 37, 37}});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->o.shape(), (std::vector<int64_t>{57, kHq, kD}));
  }
  for (int t = 0; t < 3; ++t) {
    for (int layer = 0; layer < kLayers; ++layer) {
      auto r = Step(layer, {{1, 1, 1}, {2, 1, 1}});
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_THAT(r->lengths, ElementsAre(21 + t, 38 + t));
    }
  }
  auto stats = kv_->GetCacheStats(cache_, {1, 2});
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->stats().sequences(), 2);
  EXPECT_EQ(stats->stats().tokens(), (23 + 40) * kLayers);
  ASSERT_EQ(stats->sequences_size(), 2);
  EXPECT_THAT(stats->sequences(0).lengths(), ElementsAre(23, 23));
  EXPECT_THAT(stats->sequences(1).lengths(), ElementsAre(40, 40));
}

TEST_F(KvClientTest, ForkTruncateStaleLengthFree) {
  ASSERT_TRUE(kv_->CreateSequences(cache_, {{1}}).ok());
  Track(1);
  for (int layer = 0; layer < kLayers; ++layer) ASSERT_TRUE(Step(layer, {{1, 20, 0}}).ok());
  // Sequence 3 starts as the first 10 tokens of sequence 1.
  ASSERT_TRUE(kv_->CreateSequences(cache_, {{3, 1, 10}}).ok());
  Track(3);
  for (int layer = 0; layer < kLayers; ++layer) {
    rows_[3][layer].k = rows_[1][layer].k.substr(0, rows_[1][layer].k.size() / 2);
    rows_[3][layer].v = rows_[1][layer].v.substr(0, rows_[1][layer].v.size() / 2);
    rows_[3][layer].length = 10;
    auto r = Step(layer, {{3, 2, 2}, {1, 1, 1}});  // both diverge
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Truncate rolls back; re-appending at the new length works, the old one
  // is refused and names the actual length.
  ASSERT_TRUE(kv_->Truncate(cache_, 1, 5, 0).ok());
  rows_[1][0].k.resize(rows_[1][0].k.size() * 5 / 21);
  rows_[1][0].v.resize(rows_[1][0].v.size() * 5 / 21);
  rows_[1][0].length = 5;
  AppendAttendInputs stale = Build(0, {{1, 1, 1}});
  stale.sequences[0].expected_length = 21;
  const auto refused = kv_->AppendAttend(stale);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("5"));
  ASSERT_TRUE(Step(0, {{1, 1, 1}}).ok());
  auto lengths = kv_->GetCacheStats(cache_, {1, 3});
  ASSERT_TRUE(lengths.ok()) << lengths.status();
  EXPECT_THAT(lengths->sequences(0).lengths(), ElementsAre(6, 21));
  EXPECT_THAT(lengths->sequences(1).lengths(), ElementsAre(12, 12));

  auto freed = kv_->FreeSequences(cache_, {1, 3});
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(freed->sequences(), 0);
  EXPECT_EQ(freed->pages_used(), 0);
  EXPECT_EQ(kv_->GetCacheStats(cache_, {1}).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KvClientTest, ErrorsArriveWithTheServersCode) {
  EXPECT_EQ(kv_->GetCacheStats("no-such-cache").status().code(), absl::StatusCode::kNotFound);
  CacheSpec bad;
  bad.geometry = {1, kHkv, 12, kDType};
  bad.capacity_tokens = 64;
  const auto refused = kv_->CreateCache(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("head_dim"));
  ASSERT_TRUE(kv_->DropCache(cache_).ok());
  EXPECT_EQ(kv_->GetCacheStats(cache_).status().code(), absl::StatusCode::kNotFound);
  cache_.clear();
}

TEST_F(KvClientTest, ManyRequestsInFlightOnOneStream) {
  std::vector<SequenceSpec> specs;
  for (uint64_t id = 1; id <= 4; ++id) {
    specs.push_back({id});
    Track(id);
  }
  ASSERT_TRUE(kv_->CreateSequences(cache_, specs).ok());
  auto stream = kv_->OpenStream(cache_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int t = 0; t < 3; ++t) {
    // One request per sequence, all sent before any answer is read.
    std::vector<AppendAttendInputs> inputs;
    std::vector<v1::AppendAttendRequest> requests;
    std::vector<std::promise<absl::StatusOr<v1::AppendAttendResponse>>> done(4);
    for (uint64_t id = 1; id <= 4; ++id) {
      inputs.push_back(Build(0, {{id, t == 0 ? 9 : 1, 1}}));
      requests.push_back(MakeAppendAttendRequest(inputs.back()));
    }
    for (size_t i = 0; i < 4; ++i) {
      ASSERT_TRUE((*stream)
                      ->Send(requests[i],
                             [&, i](absl::StatusOr<v1::AppendAttendResponse> r) {
                               done[i].set_value(std::move(r));
                             })
                      .ok());
    }
    for (size_t i = 0; i < 4; ++i) {
      auto response = done[i].get_future().get();
      ASSERT_TRUE(response.ok()) << response.status();
      auto result = AppendAttendResultFromProto(requests[i], *std::move(response));
      ASSERT_TRUE(result.ok()) << result.status();
      Verify(inputs[i], *result);
    }
  }
  EXPECT_TRUE((*stream)->Finish().ok());
}

}  // namespace
}  // namespace attnserve
