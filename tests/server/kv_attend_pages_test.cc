// Page-level sparsity of K/V steps (SequenceStep.attend_pages): a real
// AttnServer with the CPU backend, FP32 caches in pages of 16 tokens. The
// client keeps every sequence's tokens and checks O and LSE of each query row
// against the float64 reference over exactly the keys it may see: the named
// history pages' tokens and the new ones, causal by original position. Every
// malformed list is refused naming the field and the sequence, and changes no
// length. The cache's compacted block tables are checked directly as well.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/kv/kv_cache.h"
#include "server/native/kv_service.h"
#include "server/server.h"

namespace attnserve {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kPage = 16;
constexpr int64_t kKvRow = kHkv * kD, kQRow = kHq * kD;

std::vector<float> Random(std::mt19937* rng, int64_t n) {
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& f : x) f = dist(*rng);
  return x;
}

// One sequence's tokens at one layer, as the client appended them.
struct Context {
  std::vector<float> k, v;  // [len, Hkv, D]
  int32_t length() const { return int32_t(k.size() / kKvRow); }
};

// One sequence's part of a call.
struct Part {
  uint64_t id = 0;
  int32_t expected = 0;
  std::vector<float> k, v, q;
  std::vector<int32_t> attend_pages;
};

v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 bool causal = true) {
  v1::AppendAttendRequest r;
  r.set_cache_id(cache);
  std::string q, k, v;
  int64_t tq = 0, tk = 0;
  for (const Part& p : parts) {
    v1::SequenceStep* s = r.add_sequences();
    s->set_sequence_id(p.id);
    s->set_expected_length(p.expected);
    s->set_num_new_tokens(int32_t(p.k.size() / kKvRow));
    s->set_num_queries(int32_t(p.q.size() / kQRow));
    for (int32_t page : p.attend_pages) s->add_attend_pages(page);
    tq += s->num_queries();
    tk += s->num_new_tokens();
    q.append(reinterpret_cast<const char*>(p.q.data()), p.q.size() * 4);
    k.append(reinterpret_cast<const char*>(p.k.data()), p.k.size() * 4);
    v.append(reinterpret_cast<const char*>(p.v.data()), p.v.size() * 4);
  }
  auto set = [](v1::Tensor* t, int64_t rows, int64_t heads, std::string data) {
    t->set_dtype(v1::FP32);
    t->add_shape(rows);
    t->add_shape(heads);
    t->add_shape(kD);
    t->set_data(std::move(data));
  };
  set(r.mutable_q(), tq, kHq, q);
  set(r.mutable_k(), tk, kHkv, k);
  set(r.mutable_v(), tk, kHkv, v);
  r.mutable_options()->set_causal(causal);
  r.mutable_options()->set_return_lse(true);
  return r;
}

// The keys query row `i` of `nq` may see after a step on `ctx` (already
// holding the new tokens) that attended `pages` of a history of `history`
// tokens: the named pages' tokens, then the pages holding the new ones; with causal only those
// at or before the row's own position (bottom-right, on original positions).
std::vector<int32_t> VisibleKeys(const Context& ctx, int32_t history, std::vector<int32_t> pages,
                                 int i, int nq, bool causal) {
  const int32_t len = ctx.length();
  std::vector<int32_t> keys;
  for (int32_t t = 0; t < len; ++t) {
    // The pages holding new tokens, the partial last history page included.
    const bool fresh = len > history && t / kPage >= history / kPage;
    const bool named =
        pages.empty() || fresh || std::find(pages.begin(), pages.end(), t / kPage) != pages.end();
    if (named && (!causal || t <= len - nq + i)) keys.push_back(t);
  }
  return keys;
}

// Checks query row `i` (of the call's `total_q` rows, the sequence's rows
// start at `row0`) against the float64 reference over `keys` of `ctx`.
::testing::AssertionResult RowMatches(const v1::AppendAttendResponse& resp, int64_t total_q,
                                      int64_t row, const float* q, const Context& ctx,
                                      const std::vector<int32_t>& keys) {
  std::vector<float> k, v;
  for (int32_t t : keys) {
    k.insert(k.end(), ctx.k.begin() + t * kKvRow, ctx.k.begin() + (t + 1) * kKvRow);
    v.insert(v.end(), ctx.v.begin() + t * kKvRow, ctx.v.begin() + (t + 1) * kKvRow);
  }
  AttnPointers ptr;
  ptr.q = q;
  ptr.k = k.data();
  ptr.v = v.data();
  const AttnParams p = MakeAttnParams(
      DenseShape(DType::kFP32, 1, 1, int32_t(keys.size()), kHq, kHkv, kD), AttnOptions(), ptr);
  const ReferenceOutput ref = ReferenceAttention(p);
  const float* o = reinterpret_cast<const float*>(resp.o().data().data()) + row * kQRow;
  const float* lse = reinterpret_cast<const float*>(resp.lse().data().data());
  for (int h = 0; h < kHq; ++h) {
    double scale = 0;
    for (int d = 0; d < kD; ++d) scale = std::max(scale, std::abs(ref.o[h * kD + d]));
    for (int d = 0; d < kD; ++d) {
      const double want = ref.o[h * kD + d], got = o[h * kD + d];
      if (!(std::abs(got - want) <= tolerance::kFp32Rtol * scale + tolerance::kFp32Atol)) {
        return ::testing::AssertionFailure()
               << "o row " << row << " head " << h << " [" << d << "]: " << got << " vs " << want
               << " over " << keys.size() << " keys";
      }
    }
    const double want = ref.lse[h], got = lse[h * total_q + row];
    if (!(std::abs(got - want) <=
          tolerance::kFp32Rtol * std::abs(want) + tolerance::kFp32LseAtol)) {
      return ::testing::AssertionFailure()
             << "lse row " << row << " head " << h << ": " << got << " vs " << want;
    }
  }
  return ::testing::AssertionSuccess();
}

class KvAttendPagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    stub_ = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                     grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);  // 256 pages
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub_->CreateCache(&ctx, r, &resp).ok());
    cache_ = resp.stats().cache_id();
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  grpc::Status Call(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->AppendAttend(&ctx, r, resp);
  }
  void CreateSequences(std::vector<uint64_t> ids) {
    grpc::ClientContext ctx;
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache_);
    for (uint64_t id : ids) r.add_sequences()->set_sequence_id(id);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(stub_->CreateSequences(&ctx, r, &resp).ok());
  }
  int32_t Length(uint64_t id) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache_);
    r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    EXPECT_TRUE(stub_->GetCacheStats(&ctx, r, &resp).ok());
    return resp.sequences_size() == 1 && resp.sequences(0).lengths_size() == 1
               ? resp.sequences(0).lengths(0)
               : -1;
  }
  // A part appending `n` tokens with `nq` queries; `ctx` gains the tokens.
  Part Step(uint64_t id, Context* ctx, int n, int nq, std::vector<int32_t> pages = {}) {
    Part p{id,
           ctx->length(),
           Random(&rng_, n * kKvRow),
           Random(&rng_, n * kKvRow),
           Random(&rng_, nq * kQRow),
           std::move(pages)};
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    return p;
  }
  // Prefills `id` with `n` tokens (no queries).
  Context Prefill(uint64_t id, int n) {
    Context ctx;
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeCall(cache_, {Step(id, &ctx, n, 0)}), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return ctx;
  }
  // Runs `parts` (steps made by Step on `ctxs`, which hold the histories
  // `histories`) and checks every query row against the reference.
  void RunAndCheck(const std::vector<Part>& parts, const std::vector<Context*>& ctxs,
                   const std::vector<int32_t>& histories, bool causal = true) {
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeCall(cache_, parts, causal), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    int64_t total_q = 0;
    for (const Part& p : parts) total_q += int64_t(p.q.size() / kQRow);
    ASSERT_EQ(resp.lengths_size(), int(parts.size()));
    int64_t row0 = 0;
    for (size_t j = 0; j < parts.size(); ++j) {
      EXPECT_EQ(resp.lengths(int(j)), ctxs[j]->length());
      const int nq = int(parts[j].q.size() / kQRow);
      for (int i = 0; i < nq; ++i) {
        const std::vector<int32_t> keys =
            VisibleKeys(*ctxs[j], histories[j], parts[j].attend_pages, i, nq, causal);
        EXPECT_TRUE(
            RowMatches(resp, total_q, row0 + i, parts[j].q.data() + i * kQRow, *ctxs[j], keys))
            << "sequence " << parts[j].id << " query " << i;
      }
      row0 += nq;
    }
  }
  // `part` alone is refused with INVALID_ARGUMENT naming `field` and the
  // sequence; its length is unchanged.
  void ExpectRefused(const Part& part, const std::string& field, const std::string& words,
                     bool causal = true, int32_t window_left = -1) {
    v1::AppendAttendRequest r = MakeCall(cache_, {part}, causal);
    if (window_left >= 0) r.mutable_options()->set_window_left(window_left);
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(field), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat("sequence ", part.id)), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find(words), std::string::npos) << s.error_message();
    EXPECT_EQ(Length(part.id), part.expected) << s.error_message();
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::string cache_;
  std::mt19937 rng_{7};
};

TEST_F(KvAttendPagesTest, DecodeOverNamedPagesMatchesReference) {
  CreateSequences({1, 2, 3});
  // 1: 100 tokens (pages 0..6, page 6 partial); 2: 64 (4 whole pages);
  // 3: 40 (pages 0..2, page 2 partial).
  Context a = Prefill(1, 100), b = Prefill(2, 64), c = Prefill(3, 40);
  // 1 decodes into its partial page 6, which is attended though unnamed;
  // 2 appends two tokens with two causal queries into a fresh page;
  // 3 names its partial page and appends three tokens, four queries (the
  // first sees only history).
  std::vector<Part> parts = {Step(1, &a, 1, 1, {0, 3, 5}), Step(2, &b, 2, 2, {1, 2}),
                             Step(3, &c, 3, 4, {0, 2})};
  RunAndCheck(parts, {&a, &b, &c}, {100, 64, 40});
  // The next steps: every page named for 1, the last for 2, attend only for 3.
  parts = {Step(1, &a, 1, 1, {0, 1, 2, 3, 4, 5, 6}), Step(2, &b, 1, 1, {4}),
           Step(3, &c, 0, 1, {1, 2})};
  RunAndCheck(parts, {&a, &b, &c}, {101, 66, 43});
  // Non-causal, several queries over a page in the middle and the new tokens.
  parts = {Step(1, &a, 2, 3, {2})};
  RunAndCheck(parts, {&a}, {102}, /*causal=*/false);
  EXPECT_EQ(Length(1), 104);
}

TEST_F(KvAttendPagesTest, EmptyListAttendsEverything) {
  CreateSequences({1, 2});
  Context a = Prefill(1, 70), b = Prefill(2, 33);
  // One sequence sparse, one dense in the same call.
  std::vector<Part> parts = {Step(1, &a, 1, 1), Step(2, &b, 2, 2, {0})};
  RunAndCheck(parts, {&a, &b}, {70, 33});
  parts = {Step(1, &a, 3, 3), Step(2, &b, 1, 1)};
  RunAndCheck(parts, {&a, &b}, {71, 35});
}

TEST_F(KvAttendPagesTest, MalformedListsChangeNothing) {
  CreateSequences({1, 2, 9});
  Context a = Prefill(1, 100);  // pages 0..6
  const std::string field = "sequences[0].attend_pages";
  Context scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 1, {3, 1}), field, "strictly increasing");
  scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 1, {2, 2}), field, "strictly increasing");
  scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 1, {-1, 2}), field, "strictly increasing");
  scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 1, {0, 7}), field, "below 7");
  scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 1, {0, 1}), field, "window_left", true, /*window_left=*/8);
  scratch = a;
  ExpectRefused(Step(1, &scratch, 1, 3, {0, 1}), field, "num_queries");
  scratch = a;
  std::vector<int32_t> too_many(257);
  for (int i = 0; i < 257; ++i) too_many[size_t(i)] = i;
  ExpectRefused(Step(1, &scratch, 1, 1, too_many), field, "at most 256");
  Context empty;
  ExpectRefused(Step(9, &empty, 1, 1, {0}), field, "empty history");

  // A bad list in the second sequence refuses the whole call: the first's
  // append does not happen either.
  Context b = Prefill(2, 20);
  Context a2 = a, b2 = b;
  v1::AppendAttendResponse resp;
  const grpc::Status s =
      Call(MakeCall(cache_, {Step(1, &a2, 1, 1, {0}), Step(2, &b2, 1, 1, {1, 2})}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("sequences[1].attend_pages (sequence 2)"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Length(1), 100);
  EXPECT_EQ(Length(2), 20);

  // The lengths the refusals left are the ones a correct step expects.
  std::vector<Part> parts = {Step(1, &a, 1, 1, {6}), Step(2, &b, 1, 1, {0})};
  RunAndCheck(parts, {&a, &b}, {100, 20});
}

// KServe v2's attention_kv: the attend_pages parameter ("0,2") gives the
// native call's bytes; without expected_length the range is the cache's
// check at reserve, named in v2 words; a malformed string is refused.
TEST_F(KvAttendPagesTest, KserveParameterMatchesNative) {
  CreateSequences({1, 2});
  auto v2 = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  auto infer = [&](const Part& part, const std::string& pages, inference::ModelInferResponse* out) {
    inference::ModelInferRequest r;
    r.set_model_name("attention_kv");
    const std::vector<float>* data[] = {&part.q, &part.k, &part.v};
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      auto* in = r.add_inputs();
      in->set_name(names[i]);
      in->set_datatype("FP32");
      const int64_t heads = i == 0 ? kHq : kHkv;
      for (int64_t d : {int64_t(data[i]->size()) / (heads * kD), heads, int64_t{kD}}) {
        in->add_shape(d);
      }
      r.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(data[i]->data()), data[i]->size() * 4));
    }
    auto& p = *r.mutable_parameters();
    p["cache_id"].set_string_param(cache_);
    p["sequence_id"].set_uint64_param(part.id);
    p["causal"].set_bool_param(true);
    p["return_lse"].set_bool_param(true);
    if (!pages.empty()) p["attend_pages"].set_string_param(pages);
    grpc::ClientContext ctx;
    return v2->ModelInfer(&ctx, r, out);
  };
  Context a = Prefill(1, 50), b;
  b.k = a.k;
  b.v = a.v;
  {
    Part copy{2, 0, a.k, a.v, {}, {}};
    inference::ModelInferResponse out;
    const grpc::Status s = infer(copy, "", &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  Part step = Step(1, &a, 1, 1, {0, 2});
  v1::AppendAttendResponse want;
  ASSERT_TRUE(Call(MakeCall(cache_, {step}), &want).ok());
  step.id = 2;
  inference::ModelInferResponse got;
  const grpc::Status s = infer(step, "0, 2", &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.raw_output_contents_size(), 2);
  EXPECT_EQ(got.raw_output_contents(0), want.o().data());
  EXPECT_EQ(got.raw_output_contents(1), want.lse().data());
  EXPECT_EQ(Length(2), 51);

  const struct {
    std::string pages, words;
  } bad[] = {{"0,4", "in [0, 4) (sequence 2 has 51 tokens"},
             {"0,x", "comma-separated"},
             {"3,1", "strictly increasing"}};
  for (const auto& c : bad) {
    inference::ModelInferResponse out;
    const grpc::Status refused = infer(step, c.pages, &out);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.pages;
    EXPECT_NE(refused.error_message().find("parameters['attend_pages']"), std::string::npos)
        << refused.error_message();
    EXPECT_NE(refused.error_message().find(c.words), std::string::npos) << refused.error_message();
    EXPECT_EQ(Length(2), 51) << c.pages;
  }
}

// The cache's side: with kAnyLength (a protocol without the retry guard) the
// range is checked against the sequence itself, and the launch's block table
// holds the named pages then those of the new tokens.
TEST(KvCacheAttendPagesTest, CompactedTablesAndRangeAtReserve) {
  auto backend = MakeCpuBackend(1);
  auto budget = std::make_shared<DeviceBudget>(int64_t{1} << 24);
  KvCache cache("t", "c", KvGeometry{1, 1, 8, DType::kFP32}, kPage, 64, 0, backend.get(), budget);
  ASSERT_TRUE(cache.CreateSequences({{1, {}, {}}, {2, {}, {}}}).ok());
  KvReservation r;
  // 1 gets 100 tokens (7 pages), 2 gets 0.
  std::vector<KvStep> prefill = {{1, 0, 100, 0}};
  ASSERT_TRUE(cache.Reserve(0, prefill, &r).ok());
  const std::vector<int32_t> pages = r.tables[0];
  cache.Commit(0, prefill, &r);
  ASSERT_EQ(pages.size(), 7u);

  const std::vector<int32_t> named = {0, 3, 5};
  const std::vector<int32_t> with_last = {1, 6};
  std::vector<KvStep> steps = {{1, kAnyLength, 30, 1, named}};
  ASSERT_TRUE(cache.Reserve(0, steps, &r).ok());
  // Named 0, 3, 5 (48 tokens), then page 6 (4 old + 12 new) and fresh pages 7, 8 (18 new).
  EXPECT_EQ(r.seqlens[0], 3 * kPage + 130 - 6 * kPage);
  EXPECT_EQ(r.lengths[0], 130);
  ASSERT_EQ(r.tables[0].size(), 9u);
  const std::vector<int32_t> want = {pages[0], pages[3],       pages[5],
                                     pages[6], r.tables[0][7], r.tables[0][8]};
  EXPECT_EQ(std::vector<int32_t>(r.block_table.begin(), r.block_table.begin() + 6), want);
  EXPECT_EQ(r.stride, 6);
  cache.Rollback(&r);

  // Attend only, naming the partial last page: it comes last with its 4 tokens.
  steps = {{1, kAnyLength, 0, 1, with_last}};
  ASSERT_TRUE(cache.Reserve(0, steps, &r).ok());
  EXPECT_EQ(r.seqlens[0], kPage + 4);
  EXPECT_EQ(std::vector<int32_t>(r.block_table.begin(), r.block_table.begin() + 2),
            (std::vector<int32_t>{pages[1], pages[6]}));
  EXPECT_EQ(r.lengths[0], 100);
  cache.Rollback(&r);

  const int64_t used = cache.Stats().pages_used;
  const std::vector<int32_t> past = {2, 7};
  steps = {{1, kAnyLength, 1, 1, past}};
  absl::Status s = cache.Reserve(0, steps, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sequences[0].attend_pages: expected strictly increasing page "
                             "indices in [0, 7) (sequence 1 has 100 tokens"),
            std::string::npos)
      << s;
  const std::vector<int32_t> first = {0};
  steps = {{2, kAnyLength, 1, 1, first}};
  s = cache.Reserve(0, steps, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sequence 2 has no tokens"), std::string::npos) << s;
  EXPECT_EQ(cache.Stats().pages_used, used);
  EXPECT_EQ((*cache.Lengths(1))[0], 100);
}

}  // namespace
}  // namespace attnserve
