// ALiBi slopes and attention sinks on K/V calls (docs/kv-cache.md): a real
// AttnServer with the CPU backend, an FP32 cache in pages of 16 tokens. The
// client keeps every sequence's tokens and checks O and LSE of each query row
// against the float64 reference over all the K/V appended so far (ALiBi's
// distances count positions in the whole sequence, bottom-right aligned),
// over the native unary call, the native stream (calls with different sinks
// in flight at once) and the KServe v2 model attention_kv; an element mask
// over each sequence's whole history. A malformed bias or mask, a mask with
// attend_pages, a block mask, ALiBi with attend_pages and malformed slopes or
// sinks are refused naming the field and change no length.
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

class KvModsTest : public KvStepTest {
 protected:
  KvModsTest() : KvStepTest(11) {}

  void RunAndCheck(const std::vector<Part>& parts, const std::vector<Context*>& ctxs,
                   const Mods& mods, bool causal = true) {
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(MakeCall(cache_, parts, mods, causal), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    CheckResponse(resp, parts, ctxs, mods, causal);
  }
  // One attention_kv request for `part` (q, k, v FP32) with `mods` as the
  // alibi_slopes and sinks inputs, plus `extra` inputs by name.
  grpc::Status Infer(const Part& part, const Mods& mods, inference::ModelInferResponse* out,
                     bool start = false,
                     const std::vector<std::pair<std::string, std::vector<float>>>& extra = {},
                     bool block_q = false) {
    inference::ModelInferRequest r = AttentionKv(part);
    std::vector<std::pair<std::string, std::vector<float>>> lists = extra;
    if (!mods.slopes.empty()) lists.push_back({"alibi_slopes", mods.slopes});
    if (!mods.sinks.empty()) lists.push_back({"sinks", mods.sinks});
    for (const auto& [name, values] : lists) {
      auto* in = r.add_inputs();
      in->set_name(name);
      in->set_datatype("FP32");
      in->add_shape(int64_t(values.size()));
      r.add_raw_input_contents(
          std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
    }
    auto& p = *r.mutable_parameters();
    if (start) p["sequence_start"].set_bool_param(true);
    if (block_q) p["block_q"].set_int64_param(128);
    return KvStepTest::Infer(r, out);
  }

  // Slopes as ALiBi's geometric series; sinks of both signs.
  Mods alibi_sinks_{{0.5f, 0.25f, 0.125f, 0.0625f}, {1.5f, -0.5f, 0.0f, 2.5f}};
};

// Prefill (causal, every prompt token a query), decode and a speculative
// step over several calls: each step's rows match the reference over all the
// K/V appended so far, so ALiBi counts the cached keys, not the call's.
TEST_F(KvModsTest, UnaryStepsMatchReference) {
  CreateSequences({1, 2});
  Context a, b;
  const Mods& mods = alibi_sinks_;
  RunAndCheck({Step(1, &a, 40, 40), Step(2, &b, 23, 23)}, {&a, &b}, mods);
  for (int t = 0; t < 3; ++t) RunAndCheck({Step(1, &a, 1, 1), Step(2, &b, 1, 1)}, {&a, &b}, mods);
  // Speculative verification: 3 new tokens, 3 queries; and attend only.
  RunAndCheck({Step(1, &a, 3, 3), Step(2, &b, 0, 2)}, {&a, &b}, mods);
  // Each modifier alone, and non-causal (ALiBi's distance both ways).
  Mods sinks_only{{}, mods.sinks}, alibi_only{mods.slopes, {}};
  RunAndCheck({Step(1, &a, 1, 1)}, {&a}, sinks_only);
  RunAndCheck({Step(2, &b, 2, 2)}, {&b}, alibi_only);
  RunAndCheck({Step(1, &a, 2, 3), Step(2, &b, 1, 2)}, {&a, &b}, mods, /*causal=*/false);
  EXPECT_EQ(Length(1), 49);
  EXPECT_EQ(Length(2), 29);
}

// A call with modifiers is not the call without them: the check above
// would catch a server that dropped them.
TEST_F(KvModsTest, ModsChangeTheAnswer) {
  CreateSequences({1});
  Context a;
  Part p = Step(1, &a, 30, 2);
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(MakeCall(cache_, {p}, alibi_sinks_), &resp).ok());
  EXPECT_TRUE(
      RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a, alibi_sinks_, true));
  EXPECT_FALSE(RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a, Mods(), true));
  EXPECT_FALSE(RowsMatch(resp.o().data(), resp.lse().data(), 2, 0, p.q.data(), 2, a,
                         Mods{{}, alibi_sinks_.sinks}, true));
}

// The stream: calls of two sequences with different sinks and slopes in
// flight at once (the batcher may pack K/V calls of one layer; it must not
// pack these), several steps each, every response against the reference.
TEST_F(KvModsTest, StreamWithDifferentModsInFlight) {
  CreateSequences({1, 2});
  Context ctx[2];
  const Mods mods[2] = {alibi_sinks_, Mods{{0.3f, 0.2f, 0.1f, 0.05f}, {-1.0f, 0.5f, 3.0f, 0.0f}}};
  grpc::ClientContext sctx;
  sctx.AddMetadata("x-attnserve-cache-id", cache_);
  auto stream = stub_->AppendAttendStream(&sctx);
  for (int step = 0; step < 5; ++step) {
    std::map<std::string, std::pair<Part, int>> sent;
    for (int s = 0; s < 2; ++s) {
      const int n = step == 0 ? 20 + 7 * s : 1;
      Part p = Step(uint64_t(s + 1), &ctx[s], n, step == 0 ? n : 1);
      v1::AppendAttendRequest r = MakeCall(cache_, {p}, mods[s]);
      r.set_request_id(absl::StrCat("s", step, "q", s));
      sent.emplace(r.request_id(), std::make_pair(p, s));
      ASSERT_TRUE(stream->Write(r));
    }
    for (int i = 0; i < 2; ++i) {
      v1::AppendAttendResponse resp;
      ASSERT_TRUE(stream->Read(&resp));
      ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
      const auto& [p, s] = sent.at(resp.request_id());
      CheckResponse(resp, {p}, {&ctx[s]}, mods[s]);
    }
  }
  // A refused request on the stream answers in-band and appends nothing.
  v1::AppendAttendRequest bad = MakeCall(cache_, {Step(1, &ctx[0], 1, 1)}, Mods{{1.0f}, {}});
  bad.set_request_id("bad");
  ASSERT_TRUE(stream->Write(bad));
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.error_code(), int(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(resp.error_message().find("options.alibi_slopes: expected Hq = 4"), std::string::npos)
      << resp.error_message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Length(1), 24);
  EXPECT_EQ(Length(2), 31);
}

// Sinks count no positions: with attend_pages they apply over exactly the
// attended keys.
TEST_F(KvModsTest, SinksWithAttendPages) {
  CreateSequences({1});
  Context a;
  RunAndCheck({Step(1, &a, 40, 0)}, {&a}, Mods());
  const Mods sinks{{}, alibi_sinks_.sinks};
  Part p = Step(1, &a, 1, 1, {0});  // page 0, then page 2 (tokens 32..40, the new one last)
  v1::AppendAttendResponse resp;
  const grpc::Status s = Call(MakeCall(cache_, {p}, sinks), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<int32_t> keys;
  for (int32_t t = 0; t < 16; ++t) keys.push_back(t);
  for (int32_t t = 32; t <= 40; ++t) keys.push_back(t);
  EXPECT_TRUE(
      RowsMatch(resp.o().data(), resp.lse().data(), 1, 0, p.q.data(), 1, a, sinks, true, keys));
  EXPECT_EQ(Length(1), 41);
}

// An element mask on K/V steps: each sequence's query rows over its whole
// history after the append (packed one sequence after another, shared by the
// heads), non-causal so the mask is the whole pattern; each row against the
// reference over exactly its kept keys.
TEST_F(KvModsTest, ElementMaskOverTheWholeHistory) {
  CreateSequences({1, 2});
  Context a, b;
  RunAndCheck({Step(1, &a, 37, 0), Step(2, &b, 5, 0)}, {&a, &b}, Mods());
  std::bernoulli_distribution keep(0.4);
  for (int step = 0; step < 3; ++step) {
    const int nq[2] = {3, 1};
    std::vector<Part> parts = {Step(1, &a, 2, nq[0]), Step(2, &b, 1, nq[1])};
    const Context* ctxs[2] = {&a, &b};
    std::string mask;
    std::vector<std::vector<std::vector<int32_t>>> kept(2);
    for (int j = 0; j < 2; ++j) {
      for (int i = 0; i < nq[j]; ++i) {
        kept[j].emplace_back();
        for (int32_t t = 0; t < ctxs[j]->length(); ++t) {
          const bool on = keep(rng_) || t == ctxs[j]->length() - 1;  // no empty row
          mask.push_back(on ? '\1' : '\0');
          if (on) kept[j][i].push_back(t);
        }
      }
    }
    v1::AppendAttendRequest r = MakeCall(cache_, parts, Mods(), /*causal=*/false);
    r.mutable_options()->mutable_mask()->add_shape(1);
    r.mutable_options()->mutable_mask()->add_shape(int64_t(mask.size()));
    r.mutable_options()->mutable_mask()->set_data(mask);
    v1::AppendAttendResponse resp;
    const grpc::Status s = Call(r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    int64_t row0 = 0;
    for (int j = 0; j < 2; ++j) {
      for (int i = 0; i < nq[j]; ++i) {
        EXPECT_TRUE(RowsMatch(resp.o().data(), resp.lse().data(), 4, row0 + i,
                              parts[j].q.data() + i * kQRow, 1, *ctxs[j], Mods(), false,
                              kept[j][i]))
            << "step " << step << " sequence " << j << " query " << i;
      }
      // Without the mask the rows are not these (the check above can fail).
      EXPECT_FALSE(RowsMatch(resp.o().data(), resp.lse().data(), 4, row0, parts[j].q.data(), 1,
                             *ctxs[j], Mods(), false));
      row0 += nq[j];
    }
  }
  EXPECT_EQ(Length(1), 43);
  EXPECT_EQ(Length(2), 8);
}

// Every refusal names the field and appends nothing, for any sequence of
// the call.
TEST_F(KvModsTest, RefusalsChangeNothing) {
  CreateSequences({1, 2});
  Context a, b;
  RunAndCheck({Step(1, &a, 40, 1), Step(2, &b, 5, 1)}, {&a, &b}, alibi_sinks_);
  auto next = [&](Context ctx, const Mods& mods, std::vector<int32_t> pages = {}) {
    Context b2 = b;
    return MakeCall(cache_, {Step(2, &b2, 1, 1), Step(1, &ctx, 1, 1, std::move(pages))}, mods);
  };
  const std::string unsupported =
      ": not supported on K/V calls; use attend_pages for page-level sparsity";

  // A bias or mask spans each sequence's history after the append: P = 1 x 6
  // + 1 x 41 here.
  v1::AppendAttendRequest r = next(a, alibi_sinks_);
  SetFp32Tensor(r.mutable_options()->mutable_bias(), 1, 1, std::string(4, '\0'));
  ExpectRefused(r, {"options.bias.shape: expected [Hq or 1, P] = [4 or 1, 47]"}, 1, 40);
  r = next(a, Mods());
  r.mutable_options()->mutable_mask()->add_shape(1);
  r.mutable_options()->mutable_mask()->set_data(std::string(1, '\1'));
  ExpectRefused(r, {"options.mask.shape: expected [Hq or 1, P] = [4 or 1, 47]"}, 1, 40);
  r = next(a, Mods());
  r.mutable_options()->mutable_mask()->add_shape(1);
  r.mutable_options()->mutable_mask()->add_shape(47);
  r.mutable_options()->mutable_mask()->set_data(std::string(46, '\1'));
  ExpectRefused(r, {"options.mask.data: expected 47 bytes", "got 46"}, 1, 40);
  r = next(a, Mods(), {0});
  r.mutable_options()->mutable_mask()->add_shape(1);
  r.mutable_options()->mutable_mask()->add_shape(47);
  r.mutable_options()->mutable_mask()->set_data(std::string(47, '\1'));
  ExpectRefused(
      r, {"options.mask: not supported together with attend_pages", "sequences[1].attend_pages"}, 1,
      40);
  r = next(a, Mods());
  SetFp32Tensor(r.mutable_options()->mutable_bias(), 1, 1, std::string(47 * 4, '\0'));
  r.mutable_options()->mutable_bias()->clear_shape();
  r.mutable_options()->mutable_bias()->add_shape(1);
  r.mutable_options()->mutable_bias()->add_shape(47);
  r.mutable_options()->mutable_bias()->set_dtype(v1::FP8_E4M3);
  ExpectRefused(r, {"options.bias.dtype: expected FP32, FP16 or BF16"}, 1, 40);
  r = next(a, Mods());
  r.mutable_options()->mutable_block_mask()->set_block_q(128);
  ExpectRefused(r, {"options.block_mask" + unsupported}, 1, 40);

  ExpectRefused(next(a, alibi_sinks_, {0}),
                {"options.alibi_slopes: not supported together with attend_pages",
                 "sequences[1].attend_pages"},
                1, 40);
  ExpectRefused(next(a, Mods{{0.5f, 0.25f}, {}}),
                {"options.alibi_slopes: expected Hq = 4 values", "got 2"}, 1, 40);
  ExpectRefused(next(a, Mods{{}, {1, 2, 3, 4, 5}}), {"options.sinks: expected Hq = 4", "got 5"}, 1,
                40);
  ExpectRefused(next(a, Mods{{}, {1, std::nanf(""), 3, 4}}), {"options.sinks[1]: expected finite"},
                1, 40);
  ExpectRefused(next(a, Mods{{0, 0, INFINITY, 0}, {}}), {"options.alibi_slopes[2]"}, 1, 40);
  EXPECT_EQ(Length(2), 5);

  // Without q (append only), the lists say Hq: a multiple of Hkv.
  Context a2 = a;
  Part append = Step(1, &a2, 2, 0);
  r = MakeCall(cache_, {append}, Mods{{}, {1, 2, 3}});
  r.clear_q();
  ExpectRefused(r, {"options.sinks: expected Hq values, Hq a positive multiple of Hkv = 2"}, 1, 40);
  r = MakeCall(cache_, {append}, alibi_sinks_);
  r.clear_q();
  v1::AppendAttendResponse resp;
  const grpc::Status s = Call(r, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  a = a2;

  // The lengths the refusals left are the ones a correct step expects.
  RunAndCheck({Step(1, &a, 1, 1), Step(2, &b, 1, 1)}, {&a, &b}, alibi_sinks_);
  EXPECT_EQ(Length(1), 43);
}

// KServe v2's attention_kv: the alibi_slopes and sinks inputs give the
// native call's bytes (and the reference); a bias or mask input, a block
// mask parameter or a bad list is refused in v2 words with no length
// changed, and a refused sequence_start leaves no sequence.
TEST_F(KvModsTest, KserveInputsMatchNative) {
  CreateSequences({1, 2});
  Context a, b;
  // The same prompt in both sequences: 1 natively, 2 through attention_kv.
  Part prompt = Step(1, &a, 30, 30);
  b = a;
  v1::AppendAttendResponse want;
  ASSERT_TRUE(Call(MakeCall(cache_, {prompt}, alibi_sinks_), &want).ok());
  prompt.id = 2;
  inference::ModelInferResponse got;
  grpc::Status s = Infer(prompt, alibi_sinks_, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.raw_output_contents_size(), 2);
  EXPECT_EQ(got.raw_output_contents(0), want.o().data());
  EXPECT_EQ(got.raw_output_contents(1), want.lse().data());
  for (int t = 0; t < 3; ++t) {
    Part step = Step(1, &a, 1, 1);
    b = a;
    ASSERT_TRUE(Call(MakeCall(cache_, {step}, alibi_sinks_), &want).ok());
    step.id = 2;
    s = Infer(step, alibi_sinks_, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(got.raw_output_contents(0), want.o().data());
    EXPECT_TRUE(RowsMatch(got.raw_output_contents(0), got.raw_output_contents(1), 1, 0,
                          step.q.data(), 1, b, alibi_sinks_, true));
  }
  // Sinks alone (gpt-oss).
  const Mods sinks{{}, alibi_sinks_.sinks};
  Part step = Step(2, &b, 1, 1);
  s = Infer(step, sinks, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(RowsMatch(got.raw_output_contents(0), got.raw_output_contents(1), 1, 0, step.q.data(),
                        1, b, sinks, true));
  ASSERT_EQ(Length(2), 34);

  Context scratch = b;
  const Part more = Step(2, &scratch, 1, 1);
  const std::string unsupported =
      ": not supported on K/V calls; use attend_pages for page-level sparsity";
  const struct {
    Mods mods;
    std::vector<std::pair<std::string, std::vector<float>>> extra;
    std::string words;
  } bad[] = {
      {sinks, {{"bias", {0.0f}}}, "inputs['bias']" + unsupported},
      {sinks, {{"mask", {0.0f}}}, "inputs['mask']" + unsupported},
      {Mods{{}, {1, 2}}, {}, "inputs['sinks']: expected Hq = 4 values"},
      {Mods{{1, 2, 3}, {}}, {}, "inputs['alibi_slopes']: expected Hq = 4 values"},
  };
  for (const auto& c : bad) {
    inference::ModelInferResponse out;
    const grpc::Status refused = Infer(more, c.mods, &out, false, c.extra);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.words;
    EXPECT_NE(refused.error_message().find(c.words), std::string::npos) << refused.error_message();
    EXPECT_EQ(Length(2), 34) << c.words;
  }
  {
    inference::ModelInferResponse out;
    const grpc::Status refused = Infer(more, sinks, &out, false, {}, /*block_q=*/true);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(refused.error_message().find("parameters['block_q'] (the block mask)" + unsupported),
              std::string::npos)
        << refused.error_message();
    EXPECT_EQ(Length(2), 34);
  }
  // A refused call's sequence_start creates nothing.
  Context fresh;
  const Part first = Step(7, &fresh, 3, 3);
  inference::ModelInferResponse out;
  const grpc::Status refused = Infer(first, Mods{{}, {1}}, &out, /*start=*/true);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_EQ(Length(7, /*may_be_missing=*/true), -1);
}

}  // namespace
}  // namespace attnserve
