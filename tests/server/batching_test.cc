// Dynamic ragged batching: PackedBatch gives each member exactly what its own
// launch gives (dense and varlen members, a zero-length sequence, LSE in both
// layouts), and a real server packs concurrent compatible requests into fewer
// launches than requests, each result correct and reporting its batch size; a
// failed packed launch fails only the request that fails alone;
// --batching=false runs one launch per request.
#include "backend/ragged_batch.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend_factory.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

// One member's inputs and outputs, FP32 so packed and single launches can be
// compared exactly.
struct Member {
  std::vector<float> q, k, v, o, lse;
  std::vector<int32_t> cu_q, cu_k;
  AttnParams p{};
};

std::unique_ptr<Member> MakeMember(int hq, int hkv, int d, const std::vector<int>& lq,
                                   const std::vector<int>& lk, bool varlen, unsigned seed) {
  auto m = std::make_unique<Member>();
  int64_t tq = 0, tk = 0;
  m->cu_q = {0};
  m->cu_k = {0};
  for (size_t b = 0; b < lq.size(); ++b) {
    tq += lq[b];
    tk += lk[b];
    m->cu_q.push_back(static_cast<int32_t>(tq));
    m->cu_k.push_back(static_cast<int32_t>(tk));
  }
  auto fill = [&](std::vector<float>* t, int64_t n) {
    t->resize(n);
    for (int64_t i = 0; i < n; ++i) (*t)[i] = std::sin(0.37f * (i + 1) * (seed + 1));
  };
  fill(&m->q, tq * hq * d);
  fill(&m->k, tk * hkv * d);
  fill(&m->v, tk * hkv * d);
  m->o.assign(tq * hq * d, NAN);
  m->lse.assign(tq * hq, NAN);
  AttnParams& p = m->p;
  p.dtype = DType::kFP32;
  p.q = m->q.data();
  p.k = m->k.data();
  p.v = m->v.data();
  p.o = m->o.data();
  p.lse = m->lse.data();
  p.batch = static_cast<int32_t>(lq.size());
  p.num_heads_q = hq;
  p.num_heads_kv = hkv;
  p.head_dim = d;
  p.seqlen_q = *std::max_element(lq.begin(), lq.end());
  p.seqlen_k = *std::max_element(lk.begin(), lk.end());
  p.total_q = tq;
  p.total_k = tk;
  p.cu_seqlens_q = varlen ? m->cu_q.data() : nullptr;
  p.cu_seqlens_k = varlen ? m->cu_k.data() : nullptr;
  p.softmax_scale = 1.0f / std::sqrt(float(d));
  p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.is_causal = true;
  p.window_left = kNoWindow;
  p.window_right = 0;
  return m;
}

TEST(PackedBatchTest, EachMemberGetsWhatItsOwnLaunchGives) {
  std::vector<std::unique_ptr<Member>> members;
  members.push_back(MakeMember(4, 2, 16, {5, 5}, {7, 7}, /*varlen=*/false, 1));  // dense
  members.push_back(MakeMember(4, 2, 16, {3, 0, 9}, {4, 2, 9}, /*varlen=*/true, 2));
  members.push_back(MakeMember(4, 2, 16, {1}, {12}, /*varlen=*/false, 3));  // decode-like
  std::unique_ptr<AttentionBackend> cpu = MakeCpuBackend(1);
  // Each alone: the expected outputs.
  std::vector<std::vector<float>> want_o, want_lse;
  for (auto& m : members) {
    BackendTimings t;
    ASSERT_TRUE(cpu->Forward(m->p, &t).ok());
    want_o.push_back(m->o);
    want_lse.push_back(m->lse);
    std::fill(m->o.begin(), m->o.end(), NAN);
    std::fill(m->lse.begin(), m->lse.end(), NAN);
  }
  std::vector<const AttnParams*> ptrs;
  for (auto& m : members) {
    ASSERT_TRUE(CanShareLaunch(members[0]->p, m->p));
    ptrs.push_back(&m->p);
  }
  HostPackedBatch packed(ptrs);
  EXPECT_EQ(packed.params().batch, 6);
  EXPECT_EQ(packed.params().total_q, 10 + 12 + 1);
  ASSERT_TRUE(cpu->CanImplement(packed.params()).ok());
  BackendTimings t;
  ASSERT_TRUE(cpu->Forward(packed.params(), &t).ok());
  packed.Scatter();
  for (size_t i = 0; i < members.size(); ++i) {
    SCOPED_TRACE(i);
    for (size_t j = 0; j < want_o[i].size(); ++j) {
      ASSERT_NEAR(members[i]->o[j], want_o[i][j], 1e-6) << "o " << j;
    }
    for (size_t j = 0; j < want_lse[i].size(); ++j) {
      if (std::isinf(want_lse[i][j])) {
        EXPECT_TRUE(std::isinf(members[i]->lse[j])) << "lse " << j;
      } else {
        ASSERT_NEAR(members[i]->lse[j], want_lse[i][j], 1e-5) << "lse " << j;
      }
    }
  }
}

TEST(PackedBatchTest, OneMemberKeepsItsLayoutThroughGatherAndScatter) {
  // The path every unbatched CUDA request takes: one dense member with LSE.
  auto m = MakeMember(4, 2, 16, {5, 5}, {7, 7}, /*varlen=*/false, 7);
  std::unique_ptr<AttentionBackend> cpu = MakeCpuBackend(1);
  BackendTimings t;
  ASSERT_TRUE(cpu->Forward(m->p, &t).ok());
  const std::vector<float> want_o = m->o, want_lse = m->lse;
  std::fill(m->o.begin(), m->o.end(), NAN);
  std::fill(m->lse.begin(), m->lse.end(), NAN);
  HostPackedBatch packed({&m->p});
  EXPECT_EQ(packed.params().cu_seqlens_q, nullptr);  // dense stays dense
  EXPECT_EQ(packed.params().batch, 2);
  EXPECT_NE(packed.params().q, m->p.q);  // gathered into the batch's own memory
  ASSERT_TRUE(cpu->Forward(packed.params(), &t).ok());
  packed.Scatter();
  EXPECT_EQ(m->o, want_o);
  for (size_t j = 0; j < want_lse.size(); ++j) {
    if (std::isinf(want_lse[j])) {
      EXPECT_TRUE(std::isinf(m->lse[j])) << j;
    } else {
      EXPECT_EQ(m->lse[j], want_lse[j]) << j;
    }
  }
}

TEST(PackedBatchTest, OnlyMatchingOptionsShareALaunch) {
  auto a = MakeMember(4, 2, 16, {5}, {5}, false, 1);
  auto b = MakeMember(4, 2, 16, {9}, {3}, true, 2);
  EXPECT_TRUE(CanShareLaunch(a->p, b->p));
  b->p.is_causal = false;
  b->p.window_right = kNoWindow;
  EXPECT_FALSE(CanShareLaunch(a->p, b->p));
  auto c = MakeMember(4, 4, 16, {5}, {5}, false, 3);  // other Hkv
  EXPECT_FALSE(CanShareLaunch(a->p, c->p));
  auto d = MakeMember(4, 2, 16, {5}, {5}, false, 4);
  d->p.lse = nullptr;
  EXPECT_FALSE(CanShareLaunch(a->p, d->p));
}

struct Outcome {
  int launches = 0;  // backend calls for the requests (warm-up excluded)
  std::vector<int> batch_sizes;                  // of the successful requests
  std::vector<absl::StatusCode> codes;           // of every request
};

// Sends `n` compatible requests of different lengths at once while the
// backend is held on the first, then lets everything run; checks every result
// against the reference.
// With `oom_over_rows` >= 0 the backend fails launches of more query rows,
// and the last request is made that large, so it fails even alone.
Outcome RunConcurrent(bool batching, int n, bool mixed_lse = false, int64_t oom_over_rows = -1) {
  Outcome outcome;
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* gate = backend.get();
  gate->oom_over_rows = oom_over_rows;
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.batching = batching;
  absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Create(options, std::move(backend));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok() || !(*server)->Start().ok()) return outcome;
  const int warm = gate->calls();
  auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", (*server)->port()));
  EXPECT_TRUE(client.ok());

  std::vector<AttentionInputs> inputs;
  for (int i = 0; i < n; ++i) {
    AttentionShape s;
    s.dtype = DType::kBF16;
    s.heads_q = 4;
    s.heads_kv = 2;
    s.head_dim = 32;
    if (oom_over_rows >= 0 && i == n - 1) {
      s.batch = 1;
      s.seqlen_q = s.seqlen_k = static_cast<int>(oom_over_rows) + 1;
    } else if (i % 2 == 0) {
      s.batch = 1;
      s.seqlen_q = 3 + i;
      s.seqlen_k = 5 + 2 * i;
    } else {
      s.seqlens_q = {i, 0, 2};
      s.seqlens_k = {i + 1, 3, 2};
    }
    absl::StatusOr<AttentionInputs> in = MakeRandomInputs(s, 100 + i);
    EXPECT_TRUE(in.ok());
    in->options.causal = true;
    // Mixed: some want LSE and some do not, which only binding reveals.
    in->options.return_lse = !mixed_lse || i % 3 != 1;
    inputs.push_back(*std::move(in));
  }
  gate->Close();
  absl::Mutex mu;
  int done = 0;
  std::vector<absl::StatusOr<v1::ForwardResponse>> responses(n, absl::UnknownError("none"));
  auto send = [&](int i) {
    (*client)->ForwardAsync(MakeForwardRequest(inputs[i]), CallOptions(),
                            [&, i](absl::StatusOr<v1::ForwardResponse> r) {
                              absl::MutexLock lock(&mu);
                              responses[i] = std::move(r);
                              ++done;
                            });
  };
  send(0);
  while (gate->calls() < warm + 1) absl::SleepFor(absl::Milliseconds(1));
  for (int i = 1; i < n; ++i) send(i);
  for (int i = 0; i < 2000 && (*server)->queued_requests() < n - 1; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ((*server)->queued_requests(), n - 1);
  gate->Open();
  {
    absl::MutexLock lock(&mu);
    auto all = [&]() { return done == n; };
    mu.Await(absl::Condition(&all));
  }
  outcome.launches = gate->calls() - warm;
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    outcome.codes.push_back(responses[i].status().code());
    if (!responses[i].ok()) continue;
    outcome.batch_sizes.push_back(responses[i]->timing().batch_size());
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(*std::move(responses[i]));
    EXPECT_TRUE(result.ok()) << result.status();
    absl::StatusOr<VerifyReport> report = VerifyForward(inputs[i], *result);
    EXPECT_TRUE(report.ok() && report->passed) << (report.ok() ? report->failure : "");
  }
  (*server)->Shutdown(absl::Seconds(5));
  return outcome;
}

TEST(DynamicBatchingTest, ConcurrentRequestsShareLaunchesAndStayCorrect) {
  constexpr int kRequests = 8;
  const Outcome on = RunConcurrent(/*batching=*/true, kRequests);
  for (absl::StatusCode c : on.codes) EXPECT_EQ(c, absl::StatusCode::kOk);
  // The first runs alone while the rest queue; the rest share one launch.
  EXPECT_EQ(on.launches, 2);
  ASSERT_EQ(on.batch_sizes.size(), size_t{kRequests});
  EXPECT_EQ(on.batch_sizes[0], 1);
  for (int i = 1; i < kRequests; ++i) EXPECT_EQ(on.batch_sizes[i], kRequests - 1) << i;
}

TEST(DynamicBatchingTest, RequestsWithAndWithoutLseStayCorrect) {
  constexpr int kRequests = 8;
  const Outcome mixed = RunConcurrent(/*batching=*/true, kRequests, /*mixed_lse=*/true);
  for (absl::StatusCode c : mixed.codes) EXPECT_EQ(c, absl::StatusCode::kOk);
  // The first alone; the rest form two launches: without LSE (i = 1, 4, 7)
  // and with it.
  EXPECT_EQ(mixed.launches, 3);
}

// Device out-of-memory fails that request only: the packed launch fails, its
// members rerun one by one, and only the one too large on its own fails.
TEST(DynamicBatchingTest, FailedPackedLaunchFailsOnlyTheRequestThatFailsAlone) {
  constexpr int kRequests = 5;
  const Outcome o = RunConcurrent(/*batching=*/true, kRequests, /*mixed_lse=*/false,
                                  /*oom_over_rows=*/40);
  ASSERT_EQ(o.codes.size(), size_t{kRequests});
  for (int i = 0; i + 1 < kRequests; ++i) EXPECT_EQ(o.codes[i], absl::StatusCode::kOk) << i;
  EXPECT_EQ(o.codes.back(), absl::StatusCode::kResourceExhausted);
  // First alone, the failed packed launch of the other four, then four alone.
  EXPECT_EQ(o.launches, 1 + 1 + (kRequests - 1));
  for (int b : o.batch_sizes) EXPECT_EQ(b, 1);
}

TEST(DynamicBatchingTest, OffRunsOneLaunchPerRequest) {
  constexpr int kRequests = 4;
  const Outcome off = RunConcurrent(/*batching=*/false, kRequests);
  for (absl::StatusCode c : off.codes) EXPECT_EQ(c, absl::StatusCode::kOk);
  EXPECT_EQ(off.launches, kRequests);
  for (int b : off.batch_sizes) EXPECT_EQ(b, 1);
}

}  // namespace
}  // namespace attnserve
