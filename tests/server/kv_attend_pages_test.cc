// Page-level sparsity of K/V steps (SequenceStep.attend_pages): a real
// AttnServer with the CPU backend, FP32 caches in pages of 16 tokens. The
// client keeps every sequence's tokens and checks O and LSE of each query row
// against the float64 reference over exactly the keys it may see: the named
// history pages' tokens and the new ones, causal by original position. Every
// malformed list is refused naming the field and the sequence, and changes no
// length. The cache's compacted block tables are checked directly as well.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend_factory.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/kv/kv_cache.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

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

class KvAttendPagesTest : public KvStepTest {
 protected:
  KvAttendPagesTest() : KvStepTest(7) {}

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
    CheckResponse(resp, parts, ctxs, Mods(), causal, [&](size_t j, int i, int nq) {
      return VisibleKeys(*ctxs[j], histories[j], parts[j].attend_pages, i, nq, causal);
    });
  }
  // `part` alone is refused with INVALID_ARGUMENT naming `field` and the
  // sequence; its length is unchanged.
  void ExpectRefused(const Part& part, const std::string& field, const std::string& words,
                     bool causal = true, int32_t window_left = -1) {
    v1::AppendAttendRequest r = MakeCall(cache_, {part}, causal);
    if (window_left >= 0) r.mutable_options()->set_window_left(window_left);
    KvStepTest::ExpectRefused(r, {field, absl::StrCat("sequence ", part.id), words}, part.id,
                              part.expected);
  }
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
  auto infer = [&](const Part& part, const std::string& pages, inference::ModelInferResponse* out) {
    inference::ModelInferRequest r = AttentionKv(part);
    if (!pages.empty()) (*r.mutable_parameters())["attend_pages"].set_string_param(pages);
    return Infer(r, out);
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
