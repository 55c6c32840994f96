// MergeAttentionPartials (client/lse_merge.h): the merge's own rules without a
// server (rows no partial saw, a partial that saw nothing, refusals), then
// context parallelism across replicas end to end: a sequence's keys split
// over two in-process CPU servers (Forward, and K/V caches), each attended
// with return_lse, merged, and held to the float64 reference over all the keys
// with the tolerance policy (tests/common CheckOutput, tolerance.h).
#include "client/lse_merge.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/attention_client.h"
#include "client/kv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/two_loopback_servers.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

HostTensor Floats(DType t, std::vector<int64_t> shape, std::vector<float> values) {
  absl::StatusOr<HostTensor> x = HostTensor::FromFloats(t, std::move(shape), values);
  EXPECT_TRUE(x.ok()) << x.status();
  return *std::move(x);
}

TEST(LseMergeTest, WeightsByExpLse) {
  // One row, one head, D = 2: partial 0 has LSE log 1, partial 1 log 3, so
  // weights 1/4 and 3/4 and LSE log 4.
  const HostTensor o0 = Floats(DType::kFP32, {1, 1, 2}, {1.0f, 0.0f});
  const HostTensor o1 = Floats(DType::kFP32, {1, 1, 2}, {0.0f, 2.0f});
  const HostTensor l0 = Floats(DType::kFP32, {1, 1}, {0.0f});
  const HostTensor l1 = Floats(DType::kFP32, {1, 1}, {std::log(3.0f)});
  absl::StatusOr<MergedAttention> m = MergeAttentionPartials({&o0, &o1}, {&l0, &l1});
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<float> o = m->o.ToFloats();
  EXPECT_NEAR(o[0], 0.25f, 1e-6);
  EXPECT_NEAR(o[1], 1.5f, 1e-6);
  EXPECT_NEAR(m->lse.ToFloats()[0], std::log(4.0f), 1e-6);
}

TEST(LseMergeTest, EmptyPartialsContributeNothingAndEmptyRowsStayEmpty) {
  // Two rows: row 0 only partial 1 saw keys (partial 0's O there is NaN, to
  // show it is never read); row 1 no partial saw a key.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const HostTensor o0 = Floats(DType::kFP16, {2, 1, 2}, {nan, nan, 0.0f, 0.0f});
  const HostTensor o1 = Floats(DType::kFP16, {2, 1, 2}, {0.5f, -1.0f, 0.0f, 0.0f});
  const HostTensor l0 = Floats(DType::kFP32, {1, 2}, {kNegInf, kNegInf});
  const HostTensor l1 = Floats(DType::kFP32, {1, 2}, {1.25f, kNegInf});
  absl::StatusOr<MergedAttention> m = MergeAttentionPartials({&o0, &o1}, {&l0, &l1});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->o.dtype(), DType::kFP16);
  EXPECT_THAT(m->o.ToFloats(), ::testing::ElementsAre(0.5f, -1.0f, 0.0f, 0.0f));
  const std::vector<float> lse = m->lse.ToFloats();
  EXPECT_EQ(lse[0], 1.25f);
  EXPECT_EQ(lse[1], kNegInf);
  // Every partial empty: O 0, LSE -inf, in the dtype asked for.
  m = MergeAttentionPartials({&o0}, {&l0}, DType::kBF16);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->o.dtype(), DType::kBF16);
  EXPECT_THAT(m->o.ToFloats(), ::testing::Each(0.0f));
  EXPECT_THAT(m->lse.ToFloats(), ::testing::Each(kNegInf));
}

TEST(LseMergeTest, RefusalsNameThePartialAndField) {
  const HostTensor o = Floats(DType::kFP32, {2, 3, 4}, std::vector<float>(24, 0.0f));
  const HostTensor lse = Floats(DType::kFP32, {3, 2}, std::vector<float>(6, 0.0f));
  const HostTensor o_dense = Floats(DType::kFP32, {1, 2, 3, 4}, std::vector<float>(24, 0.0f));
  const HostTensor lse_dense = Floats(DType::kFP32, {1, 3, 2}, std::vector<float>(6, 0.0f));
  const HostTensor lse_wrong = Floats(DType::kFP32, {2, 3}, std::vector<float>(6, 0.0f));
  const HostTensor lse_fp16 = Floats(DType::kFP16, {3, 2}, std::vector<float>(6, 0.0f));
  const HostTensor o_fp8 = Floats(DType::kFP8E4M3, {2, 3, 4}, std::vector<float>(24, 0.0f));
  std::vector<float> with_nan(6, 0.0f);
  with_nan[4] = std::numeric_limits<float>::quiet_NaN();
  const HostTensor lse_nan = Floats(DType::kFP32, {3, 2}, with_nan);
  const struct {
    std::vector<const HostTensor*> outs, lses;
    std::optional<DType> out_dtype;
    std::string message;
  } cases[] = {
      {{}, {}, {}, "partials: expected at least one, got 0"},
      {{&o, &o}, {&lse}, {}, "expected one lse per o, got 2 o and 1 lse"},
      {{&o, &o_dense}, {&lse, &lse_dense}, {}, "partials[1].o.shape: expected [2, 3, 4]"},
      {{&o},
       {&lse_wrong},
       {},
       "partials[0].lse.shape: expected [3, 2] (o is [2, 3, 4]), got [2, 3]"},
      {{&o}, {&lse_fp16}, {}, "partials[0].lse.dtype: expected FP32, got FP16"},
      {{&o_fp8}, {&lse}, {}, "partials[0].o.dtype: expected FP16, BF16 or FP32, got FP8_E4M3"},
      {{&o}, {&lse}, DType::kFP8E4M3, "out_dtype: expected FP16, BF16 or FP32"},
      {{&o, &o}, {&lse, &lse_nan}, {}, "partials[1].lse.data[4]: expected a finite value or -inf"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<MergedAttention> m = MergeAttentionPartials(c.outs, c.lses, c.out_dtype);
    ASSERT_FALSE(m.ok()) << c.message;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr(c.message));
  }
  // Dense [B, S, H, D] with LSE [B, H, S] is accepted.
  EXPECT_TRUE(MergeAttentionPartials({&o_dense}, {&lse_dense}).ok());
  // A result without LSE names the partial.
  ForwardResult no_lse;
  absl::StatusOr<MergedAttention> m = MergeAttentionPartials({&no_lse});
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("partials[0].lse: missing (call with return_lse)"));
}

// Two CPU servers, each holding part of every sequence's keys.
class ContextParallelTest : public TwoLoopbackServersTest {};

// Keys [begin, end) of every batch of a dense [B, Sk, H, D] buffer.
HostTensor KeySlice(const void* data, const TestCase& tc, int begin, int end) {
  const int64_t row = static_cast<int64_t>(tc.num_heads_kv) * tc.head_dim * DTypeSize(tc.dtype);
  std::string bytes;
  for (int b = 0; b < tc.batch; ++b) {
    const char* base = static_cast<const char*>(data) + (int64_t{b} * tc.seqlen_k + begin) * row;
    bytes.append(base, (end - begin) * row);
  }
  absl::StatusOr<HostTensor> t = HostTensor::FromBytes(
      tc.dtype, {tc.batch, end - begin, tc.num_heads_kv, tc.head_dim}, std::move(bytes));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

HostTensor Whole(const void* data, DType dtype, std::vector<int64_t> shape, int64_t bytes) {
  absl::StatusOr<HostTensor> t = HostTensor::FromBytes(
      dtype, std::move(shape), std::string(static_cast<const char*>(data), bytes));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

struct SplitCase {
  TestCase tc;
  std::vector<int> cuts;  // key positions where one partial ends and the next begins
};

// Each partial attends keys [a, b) of the whole sequence; with causal
// (bottom-right over all Sk keys), query i may see key j <= Sk - Sq + i, which
// over the partial's own keys is window_right = Sk - b, and causal for the
// partial holding the last keys.
ForwardOptions PartialOptions(const TestCase& tc, int end) {
  ForwardOptions options;
  options.return_lse = true;
  if (tc.causal) {
    if (end == tc.seqlen_k) {
      options.causal = true;
    } else {
      options.window_right = tc.seqlen_k - end;
    }
  }
  return options;
}

TEST_F(ContextParallelTest, ForwardSplitAcrossTwoServersMatchesTheWhole) {
  std::vector<SplitCase> cases;
  auto add = [&](DType dtype, int batch, int sq, int sk, int hq, int hkv, int d, bool causal,
                 std::vector<int> cuts) {
    SplitCase c;
    c.tc.dtype = dtype;
    c.tc.batch = batch;
    c.tc.seqlen_q = sq;
    c.tc.seqlen_k = sk;
    c.tc.num_heads_q = hq;
    c.tc.num_heads_kv = hkv;
    c.tc.head_dim = d;
    c.tc.causal = causal;
    c.cuts = std::move(cuts);
    cases.push_back(std::move(c));
  };
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    add(t, 2, 17, 97, 4, 4, 64, false, {40});   // two halves, MHA
    add(t, 1, 33, 160, 8, 2, 64, false, {64});  // GQA 4:1
  }
  add(DType::kFP32, 1, 1, 200, 8, 2, 128, true, {130});   // decode, causal, GQA
  add(DType::kBF16, 2, 5, 70, 4, 1, 32, true, {20, 60});  // three partials, MQA
  add(DType::kFP16, 1, 64, 64, 4, 2, 64, true, {24});     // whole causal prefill:
                                                          // rows before 24 see no key of B
  add(DType::kFP32, 1, 40, 90, 4, 2, 32, true, {50});     // a query row's keys all in A
  add(DType::kFP16, 1, 9, 48, 4, 2, 64, false, {0});      // an empty partial (no keys)
  add(DType::kFP32, 1, 9, 48, 4, 2, 64, true, {48});      // empty last partial, causal

  for (const SplitCase& c : cases) {
    const TestCase& tc = c.tc;
    SCOPED_TRACE(absl::StrCat(tc.Name(), " cuts ", absl::StrJoin(c.cuts, ",")));
    HostBuffers buf(tc);
    const HostTensor q = Whole(buf.q(), tc.dtype,
                               {tc.batch, tc.seqlen_q, tc.num_heads_q, tc.head_dim}, buf.q_bytes());
    std::vector<int> bounds = {0};
    bounds.insert(bounds.end(), c.cuts.begin(), c.cuts.end());
    bounds.push_back(tc.seqlen_k);
    std::vector<ForwardResult> results;
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      AttentionInputs in;
      in.q = q;
      in.k = KeySlice(buf.k(), tc, bounds[i], bounds[i + 1]);
      in.v = KeySlice(buf.v(), tc, bounds[i], bounds[i + 1]);
      in.options = PartialOptions(tc, bounds[i + 1]);
      absl::StatusOr<ForwardResult> r = clients_[i % 2]->Forward(in);
      ASSERT_TRUE(r.ok()) << "partial " << i << ": " << r.status();
      results.push_back(*std::move(r));
    }
    std::vector<const ForwardResult*> parts;
    for (const ForwardResult& r : results) parts.push_back(&r);
    absl::StatusOr<MergedAttention> m =
        MergeAttentionPartials(absl::Span<const ForwardResult* const>(parts));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->o.dtype(), tc.dtype);
    EXPECT_TRUE(CheckOutput(buf, m->o.data(), static_cast<const float*>(m->lse.data())));
  }
}

// Any partial's output is what fails the check when the merge weights it
// wrongly: dropping one partial's weight (merging one partial alone) must not
// pass, so the test above can fail.
TEST_F(ContextParallelTest, OnePartialAloneIsNotTheWhole) {
  TestCase tc;
  tc.dtype = DType::kFP32;
  tc.seqlen_q = 4;
  tc.seqlen_k = 64;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  HostBuffers buf(tc);
  AttentionInputs in;
  in.q = Whole(buf.q(), tc.dtype, {1, 4, 4, 64}, buf.q_bytes());
  in.k = KeySlice(buf.k(), tc, 0, 32);
  in.v = KeySlice(buf.v(), tc, 0, 32);
  in.options.return_lse = true;
  absl::StatusOr<ForwardResult> r = clients_[0]->Forward(in);
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<MergedAttention> m = MergeAttentionPartials({&*r});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(CheckOutput(buf, m->o.data(), static_cast<const float*>(m->lse.data())));
}

// A decode step over a sequence whose K/V live in two caches on two servers:
// the first `split` tokens in one, the rest in the other. Each cache attends
// the step's queries over its part (the one holding the newest tokens with
// bottom-right causal), and the merge is attention over the whole history.
TEST_F(ContextParallelTest, KvCachesOnTwoServersDecodeAsOne) {
  for (DType dtype : {DType::kFP16, DType::kFP32}) {
    TestCase tc;
    tc.dtype = dtype;
    tc.seqlen_q = 2;  // two queries (a speculative pair), bottom-right causal
    tc.seqlen_k = 150;
    tc.num_heads_q = 8;
    tc.num_heads_kv = 2;
    tc.head_dim = 64;
    tc.causal = true;
    SCOPED_TRACE(tc.Name());
    HostBuffers buf(tc);
    const int split = 96;
    std::vector<AppendAttendResult> results;
    for (int part = 0; part < 2; ++part) {
      KvClient kv(*clients_[part]);
      CacheSpec spec;
      spec.geometry = {1, tc.num_heads_kv, tc.head_dim, dtype};
      spec.page_size = 16;
      spec.capacity_tokens = 1024;
      absl::StatusOr<v1::CacheStats> cache = kv.CreateCache(spec);
      ASSERT_TRUE(cache.ok()) << cache.status();
      ASSERT_TRUE(kv.CreateSequences(cache->cache_id(), {{7}}).ok());
      const int begin = part == 0 ? 0 : split, end = part == 0 ? split : tc.seqlen_k;
      AppendAttendInputs append;
      append.cache_id = cache->cache_id();
      append.sequences = {{7, 0, end - begin, 0}};
      append.q = Whole(buf.q(), dtype, {0, tc.num_heads_q, tc.head_dim}, 0);
      append.k = KeySlice(buf.k(), tc, begin, end);
      append.v = KeySlice(buf.v(), tc, begin, end);
      // [1, n, H, D] -> [n, H, D]: the varlen layout of one sequence.
      append.k = *HostTensor::FromBytes(dtype, {end - begin, tc.num_heads_kv, tc.head_dim},
                                        append.k.bytes());
      append.v = *HostTensor::FromBytes(dtype, {end - begin, tc.num_heads_kv, tc.head_dim},
                                        append.v.bytes());
      absl::StatusOr<AppendAttendResult> appended = kv.AppendAttend(append);
      ASSERT_TRUE(appended.ok()) << appended.status();
      AppendAttendInputs attend;
      attend.cache_id = cache->cache_id();
      attend.sequences = {{7, end - begin, 0, tc.seqlen_q}};
      attend.q = Whole(buf.q(), dtype, {tc.seqlen_q, tc.num_heads_q, tc.head_dim}, buf.q_bytes());
      attend.options.return_lse = true;
      attend.options.causal = part == 1;
      absl::StatusOr<AppendAttendResult> r = kv.AppendAttend(attend);
      ASSERT_TRUE(r.ok()) << r.status();
      results.push_back(*std::move(r));
      ASSERT_TRUE(kv.DropCache(cache->cache_id()).ok());
    }
    absl::StatusOr<MergedAttention> m =
        MergeAttentionPartials<AppendAttendResult>({&results[0], &results[1]});
    ASSERT_TRUE(m.ok()) << m.status();
    // The K/V layout [T, Hq, D] / [Hq, T] is the dense one's with B = 1.
    EXPECT_TRUE(CheckOutput(buf, m->o.data(), static_cast<const float*>(m->lse.data())));
  }
}

}  // namespace
}  // namespace attnserve
