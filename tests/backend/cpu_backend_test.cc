// CpuBackend against the float64 reference over the standard grid (docs/design.md
// §4), plus the backend's own behaviour: description, invalid params, thread
// counts, repeated calls on one instance, concurrent callers.
#include "backend/cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "backend/backend_factory.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::StandardGrid;
using testing_util::TestCase;

// One backend for the whole suite: the pool is created once, as in the server.
AttentionBackend& Backend() {
  static AttentionBackend* backend = MakeCpuBackend(0).release();
  return *backend;
}

class CpuBackendGridTest : public ::testing::TestWithParam<TestCase> {};

TEST_P(CpuBackendGridTest, MatchesReference) {
  HostBuffers buf(GetParam());
  const absl::StatusOr<Plan> plan = Backend().CanImplement(buf.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  BackendTimings timings;
  const absl::Status status = Backend().Forward(*plan, buf.params(), &timings);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_GE(timings.compute_us, 0);
  EXPECT_TRUE(CheckOutput(buf));
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuBackendGridTest, ::testing::ValuesIn(StandardGrid()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name();
                         });
// FP8 inputs: O (BF16) within the BF16 rule of the float64 reference on the
// dequantised inputs (code x descale), tolerance.h.
INSTANTIATE_TEST_SUITE_P(Fp8, CpuBackendGridTest, ::testing::ValuesIn(testing_util::Fp8Grid()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name();
                         });

// FP8 is dequantise-then-compute: with power-of-two descales every
// code x descale is exact in BF16, so the FP8 call must give bit for bit the
// output of the BF16 call on those values (same algorithm, same inputs).
TEST(CpuBackendTest, Fp8EqualsBf16OnDequantisedValues) {
  TestCase tc;
  tc.dtype = DType::kFP8E4M3;
  tc.batch = 2;
  tc.seqlen_q = 37;
  tc.seqlen_k = 70;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  tc.head_dim = 64;
  tc.causal = true;
  tc.q_descale = 0.5f;
  tc.k_descale = 4.0f;
  tc.v_descale = 0.125f;
  HostBuffers fp8(tc);
  const AttnParams& p = fp8.params();
  auto widen = [](const void* codes, int64_t n, float descale) {
    std::vector<uint16_t> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float x = LoadAsFloat(codes, DType::kFP8E4M3, i) * descale;
      out[i] = FloatToBf16(x);
      EXPECT_EQ(Bf16ToFloat(out[i]), x) << "not exact in BF16: " << x;
    }
    return out;
  };
  const int64_t nq = p.total_q * p.num_heads_q * p.head_dim;
  const int64_t nkv = p.total_k * p.num_heads_kv * p.head_dim;
  const std::vector<uint16_t> q = widen(p.q, nq, p.q_descale);
  const std::vector<uint16_t> k = widen(p.k, nkv, p.k_descale);
  const std::vector<uint16_t> v = widen(p.v, nkv, p.v_descale);
  std::vector<uint16_t> o_bf16(static_cast<size_t>(nq));
  std::vector<float> lse_bf16(static_cast<size_t>(p.total_q * p.num_heads_q));
  AttnParams bf16 = p;
  bf16.dtype = DType::kBF16;
  bf16.q_descale = bf16.k_descale = bf16.v_descale = 1.0f;
  bf16.q = q.data();
  bf16.k = k.data();
  bf16.v = v.data();
  bf16.o = o_bf16.data();
  bf16.lse = lse_bf16.data();
  ASSERT_TRUE(PlanAndForward(Backend(), p, nullptr).ok());
  ASSERT_TRUE(PlanAndForward(Backend(), bf16, nullptr).ok());
  ASSERT_EQ(std::memcmp(fp8.o(), o_bf16.data(), o_bf16.size() * 2), 0);
  ASSERT_EQ(std::memcmp(fp8.lse(), lse_bf16.data(), lse_bf16.size() * 4), 0);
  EXPECT_TRUE(CheckOutput(fp8));
}

TEST(CpuBackendTest, GridNamesAreUnique) {
  std::set<std::string> names;
  for (const TestCase& tc : testing_util::Fp8Grid()) EXPECT_TRUE(names.insert(tc.Name()).second);
  for (const TestCase& tc : StandardGrid())
    EXPECT_TRUE(names.insert(tc.Name()).second) << tc.Name();
}

TEST(CpuBackendTest, Describe) {
  auto backend = MakeCpuBackend(3);
  const BackendDescription& d = backend->Describe();
  EXPECT_EQ(d.name, "cpu");
  EXPECT_EQ(d.cpu_threads, 3);
  EXPECT_EQ(d.dtypes,
            (std::vector<DType>{DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP8E4M3}));
  EXPECT_EQ(d.min_head_dim, 8);
  EXPECT_EQ(d.max_head_dim, 256);
  EXPECT_GE(MakeCpuBackend(0)->Describe().cpu_threads, 1);
}

TEST(CpuBackendTest, RejectsInvalidParams) {
  TestCase tc;
  tc.seqlen_q = tc.seqlen_k = 5;
  HostBuffers buf(tc);
  AttnParams p = buf.params();
  p.head_dim = 12;
  auto backend = MakeCpuBackend(2);
  EXPECT_EQ(backend->CanImplement(p).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAndForward(*backend, p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// Thread counts that do not divide the task count, more threads than tasks,
// and one thread must all produce the same (correct) result.
TEST(CpuBackendTest, AnyThreadCount) {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.batch = 3;
  tc.seqlen_q = 130;
  tc.seqlen_k = 200;
  tc.num_heads_q = 3;
  tc.num_heads_kv = 1;
  tc.causal = true;
  HostBuffers buf(tc);
  for (int threads : {1, 2, 5, 16}) {
    auto backend = MakeCpuBackend(threads);
    buf.Poison();
    ASSERT_TRUE(PlanAndForward(*backend, buf.params(), nullptr).ok());
    EXPECT_TRUE(CheckOutput(buf)) << "threads=" << threads;
  }
}

// The same instance serves many calls with changing shapes and head dims.
TEST(CpuBackendTest, RepeatedCallsOnOneInstance) {
  auto backend = MakeCpuBackend(2);
  for (int round = 0; round < 3; ++round) {
    for (int d : {256, 8, 64}) {
      TestCase tc;
      tc.dtype = DType::kFP16;
      tc.seqlen_q = 40 + round;
      tc.seqlen_k = 70;
      tc.num_heads_q = 2;
      tc.head_dim = d;
      tc.seed = 100 + round;
      HostBuffers buf(tc);
      ASSERT_TRUE(PlanAndForward(*backend, buf.params(), nullptr).ok());
      EXPECT_TRUE(CheckOutput(buf));
    }
  }
}

// Several threads calling one instance at once (as the executor's device
// thread and a K/V paged launch may): forward_mu_ serialises them over the one
// pool, and each caller gets its own correct output. This is the test the TSan
// subset (scripts/sanitize.sh thread) relies on to see the pool's hand-offs
// between callers, not just within one Run.
TEST(CpuBackendTest, ConcurrentCallersOnOneInstance) {
  auto backend = MakeCpuBackend(3);
  constexpr int kCallers = 3;
  constexpr int kRounds = 4;
  std::vector<std::unique_ptr<HostBuffers>> buffers;
  for (int c = 0; c < kCallers; ++c) {
    TestCase tc;
    tc.dtype = c == 0 ? DType::kFP16 : DType::kBF16;
    tc.seqlen_q = 33 + 7 * c;
    tc.seqlen_k = 61 + 5 * c;
    tc.num_heads_q = 2;
    tc.causal = c == 1;
    tc.seed = 500 + c;
    buffers.push_back(std::make_unique<HostBuffers>(tc));
  }
  std::vector<int> failures(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < kRounds; ++round) {
        buffers[c]->Poison();
        if (!PlanAndForward(*backend, buffers[c]->params(), nullptr).ok() ||
            !CheckOutput(*buffers[c])) {
          ++failures[c];
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(failures[c], 0) << "caller " << c;
}

// Rows that see no key: exactly zero output and -inf LSE, not just "close".
TEST(CpuBackendTest, FullyMaskedRowsAreExactlyZero) {
  TestCase tc;
  tc.seqlen_q = 80;
  tc.seqlen_k = 16;
  tc.num_heads_q = 2;
  tc.causal = true;  // rows i < 64 see no key (i + 16 - 80 < 0)
  HostBuffers buf(tc);
  ASSERT_TRUE(PlanAndForward(Backend(), buf.params(), nullptr).ok());
  const float* o = static_cast<const float*>(buf.o());
  for (int i = 0; i < 64; ++i) {
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < tc.head_dim; ++c) ASSERT_EQ(o[(i * 2 + h) * tc.head_dim + c], 0.0f);
      ASSERT_EQ(buf.lse()[h * 80 + i], -std::numeric_limits<float>::infinity());
    }
  }
  EXPECT_TRUE(CheckOutput(buf));
}

// Large score magnitudes (|s| ~ 300): the online max must keep exp2 in range
// (a naive sum of exp would overflow to inf here).
TEST(CpuBackendTest, LargeScoresStayFinite) {
  for (DType t : {DType::kFP32, DType::kFP16}) {
    TestCase tc;
    tc.dtype = t;
    tc.seqlen_q = 70;
    tc.seqlen_k = 300;
    tc.softmax_scale = 40.0f;
    tc.seed = 7;
    HostBuffers buf(tc);
    ASSERT_TRUE(PlanAndForward(Backend(), buf.params(), nullptr).ok());
    EXPECT_TRUE(CheckOutput(buf));
  }
}

}  // namespace
}  // namespace attnserve
