// Batch-invariant results (AttnParams::batch_invariant, docs/design.md §3).
//  - The CPU backend: a request's output bytes alone equal its bytes packed
//    into a ragged batch with random others (before, after, around it), at
//    any thread count, for every dtype. The CPU backend is invariant with or
//    without the option (its tasks are fixed by each sequence's own shape),
//    so both are checked.
//  - Through a real server with batching on: the same, with the request
//    queued behind a held launch so it really shares one (its batch_size
//    says so); --batch_invariant (ServerOptions) and the per-call option;
//    an invariant call never shares a launch with one that is not.
//  - The CUDA planner (plain C++, no GPU): under the option a decode launch's
//    split count does not depend on the batch, the lengths or the SM count,
//    and calls the executor packs together (SamePlanned) get, packed, the
//    plan each has alone. The GPU's bytes: tests/cuda/cuda_batch_invariance_test.cc.
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/ragged_batch.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/common/attn_test_util.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

// A request's output bytes (O, then LSE).
std::string Bytes(const HostBuffers& buf) {
  std::string s(static_cast<const char*>(buf.o()), static_cast<size_t>(buf.o_bytes()));
  if (buf.lse() != nullptr) {
    s.append(reinterpret_cast<const char*>(buf.lse()),
             static_cast<size_t>(buf.lse_elements()) * sizeof(float));
  }
  return s;
}

// Index of the first differing byte, or -1.
int64_t FirstDiff(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// A random varlen batch-mate of `target` (same dtype, heads, head dim and
// options, so CanShareLaunch holds): 1..3 sequences of random lengths.
TestCase RandomMate(const TestCase& target, std::mt19937* rng, uint32_t seed) {
  TestCase tc = target;
  tc.seed = seed;
  const int n = std::uniform_int_distribution<int>(1, 3)(*rng);
  tc.seqlens_q.clear();
  tc.seqlens_k.clear();
  for (int i = 0; i < n; ++i) {
    const int sq = std::uniform_int_distribution<int>(0, 150)(*rng);
    tc.seqlens_q.push_back(sq);
    tc.seqlens_k.push_back(sq + std::uniform_int_distribution<int>(0, 300)(*rng));
  }
  return tc;
}

// Targets: decode (GQA, one query), a dense prefill with a window, a varlen
// causal prefill with a zero-length sequence, softcap.
std::vector<TestCase> Targets() {
  std::vector<TestCase> out;
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3}) {
    TestCase decode;
    decode.dtype = t;
    decode.num_heads_q = 8;
    decode.num_heads_kv = 2;
    decode.head_dim = 64;
    decode.seqlen_q = 1;
    decode.seqlen_k = 333;
    if (t == DType::kFP8E4M3) decode.k_descale = 0.75f;
    out.push_back(decode);

    TestCase dense = decode;
    dense.batch = 2;
    dense.seqlen_q = 70;
    dense.seqlen_k = 150;
    dense.window_left = 40;
    dense.head_dim = 32;
    out.push_back(dense);

    TestCase varlen = decode;
    varlen.causal = true;
    varlen.seqlens_q = {65, 0, 129};
    varlen.seqlens_k = {200, 5, 129};
    varlen.softcap = 20.0f;
    out.push_back(varlen);
  }
  return out;
}

class CpuBatchInvarianceTest : public ::testing::TestWithParam<TestCase> {};

TEST_P(CpuBatchInvarianceTest, PackedWithRandomOthersGivesTheSameBytes) {
  const TestCase& tc = GetParam();
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(invariant ? "batch_invariant" : "default");
    HostBuffers target(tc);
    AttnParams alone = target.params();
    alone.batch_invariant = invariant;
    std::unique_ptr<AttentionBackend> one_thread = MakeCpuBackend(1);
    BackendTimings t;
    ASSERT_TRUE(PlanAndForward(*one_thread, alone, &t).ok());
    EXPECT_TRUE(CheckOutput(target));
    const std::string want = Bytes(target);

    std::mt19937 rng(7 + tc.seqlen_k + static_cast<int>(tc.dtype) * 31);
    for (int trial = 0; trial < 4; ++trial) {
      SCOPED_TRACE(absl::StrCat("trial ", trial));
      std::vector<std::unique_ptr<HostBuffers>> mates;
      const int n_mates = std::uniform_int_distribution<int>(1, 4)(rng);
      for (int i = 0; i < n_mates; ++i) {
        mates.push_back(std::make_unique<HostBuffers>(RandomMate(tc, &rng, 1000 + 10 * trial + i)));
      }
      std::vector<AttnParams> mate_params;
      for (const auto& m : mates) {
        mate_params.push_back(m->params());
        mate_params.back().batch_invariant = invariant;
      }
      // The target at a random place among its mates.
      std::vector<const AttnParams*> members;
      const int at = std::uniform_int_distribution<int>(0, n_mates)(rng);
      for (int i = 0; i <= n_mates; ++i) {
        if (i == at) members.push_back(&alone);
        if (i < n_mates) members.push_back(&mate_params[i]);
      }
      ASSERT_TRUE(CanShareLaunch(*members[0], *members[1]));
      HostPackedBatch packed(members);
      AttnParams launch = packed.params();
      launch.batch_invariant = invariant;
      for (int threads : {1, 2, 3, 8}) {
        SCOPED_TRACE(absl::StrCat(threads, " threads"));
        target.Poison();
        std::unique_ptr<AttentionBackend> cpu = MakeCpuBackend(threads);
        ASSERT_TRUE(PlanAndForward(*cpu, launch, &t).ok());
        packed.Scatter();
        EXPECT_EQ(FirstDiff(Bytes(target), want), -1) << "packed bytes differ from alone";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, CpuBatchInvarianceTest, ::testing::ValuesIn(Targets()),
                         [](const ::testing::TestParamInfo<TestCase>& i) {
                           return i.param.Name();
                         });

// --- Through a real server with batching on -------------------------------

struct ServerRun {
  std::string target_bytes;  // O then LSE of the target's response
  int target_batch_size = 0;
};

AttentionInputs Inputs(const AttentionShape& s, uint64_t seed) {
  absl::StatusOr<AttentionInputs> in = MakeRandomInputs(s, seed);
  EXPECT_TRUE(in.ok()) << in.status();
  in->options.causal = true;
  in->options.return_lse = true;
  return *std::move(in);
}

// The target request sent alone (mates empty), or queued with random mates
// behind a held launch so the server packs them. `server_flag`: ServerOptions
// batch_invariant; `option`: the target's AttentionOptions.batch_invariant;
// `mates_option`: the mates'.
ServerRun RunTarget(const AttentionInputs& target, const std::vector<AttentionInputs>& mates,
                    bool server_flag, bool option, bool mates_option) {
  ServerRun run;
  auto backend = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* gate = backend.get();
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.batching = true;
  options.batch_invariant = server_flag;
  absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Create(options, std::move(backend));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok() || !(*server)->Start().ok()) return run;
  const int warm = gate->calls();
  auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", (*server)->port()));
  EXPECT_TRUE(client.ok());

  const int n = static_cast<int>(mates.size()) + 1;
  absl::Mutex mu;
  int done = 0;
  std::vector<absl::StatusOr<v1::ForwardResponse>> responses(n, absl::UnknownError("none"));
  auto send = [&](int i) {
    v1::ForwardRequest request = MakeForwardRequest(i == 0 ? target : mates[i - 1]);
    request.mutable_options()->set_batch_invariant(i == 0 ? option : mates_option);
    (*client)->ForwardAsync(request, CallOptions(), [&, i](absl::StatusOr<v1::ForwardResponse> r) {
      absl::MutexLock lock(&mu);
      responses[i] = std::move(r);
      ++done;
    });
  };
  if (!mates.empty()) {
    // A blocker holds the backend so the target and its mates queue together.
    gate->Close();
    (*client)->ForwardAsync(MakeForwardRequest(mates[0]), CallOptions(),
                            [&](absl::StatusOr<v1::ForwardResponse>) {
                              absl::MutexLock lock(&mu);
                              ++done;
                            });
    while (gate->calls() < warm + 1) absl::SleepFor(absl::Milliseconds(1));
    // Mates first and last, the target in the middle of the packed rows.
    for (int i = 1; i < n; i += 2) send(i);
    send(0);
    for (int i = 2; i < n; i += 2) send(i);
    for (int i = 0; i < 2000 && (*server)->queued_requests() < n; ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ((*server)->queued_requests(), n);
    gate->Open();
  } else {
    send(0);
  }
  {
    absl::MutexLock lock(&mu);
    const int want = mates.empty() ? 1 : n + 1;
    auto all = [&]() { return done == want; };
    mu.Await(absl::Condition(&all));
  }
  EXPECT_TRUE(responses[0].ok()) << responses[0].status();
  if (responses[0].ok()) {
    run.target_bytes = responses[0]->o().data() + responses[0]->lse().data();
    run.target_batch_size = responses[0]->timing().batch_size();
  }
  (*server)->Shutdown(absl::Seconds(5));
  return run;
}

std::vector<AttentionInputs> RandomMates(const AttentionShape& like, int n, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<AttentionInputs> mates;
  for (int i = 0; i < n; ++i) {
    AttentionShape s = like;
    s.batch = 1;
    s.seqlens_q.clear();
    s.seqlens_k.clear();
    const int b = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int j = 0; j < b; ++j) {
      const int sq = std::uniform_int_distribution<int>(1, 90)(rng);
      s.seqlens_q.push_back(sq);
      s.seqlens_k.push_back(sq + std::uniform_int_distribution<int>(0, 200)(rng));
    }
    mates.push_back(Inputs(s, seed + 1 + i));
  }
  return mates;
}

AttentionShape TargetShape() {
  AttentionShape s;
  s.dtype = DType::kBF16;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 32;
  s.batch = 2;
  s.seqlen_q = 33;
  s.seqlen_k = 120;
  return s;
}

TEST(ServerBatchInvarianceTest, ServerFlagPackedRequestGivesItsBytesAlone) {
  const AttentionInputs target = Inputs(TargetShape(), 5);
  const ServerRun alone = RunTarget(target, {}, /*server_flag=*/true, false, false);
  ASSERT_FALSE(alone.target_bytes.empty());
  EXPECT_EQ(alone.target_batch_size, 1);
  for (uint64_t seed : {11, 23, 37}) {
    SCOPED_TRACE(seed);
    const ServerRun packed =
        RunTarget(target, RandomMates(TargetShape(), 5, seed), /*server_flag=*/true, false, false);
    EXPECT_EQ(packed.target_batch_size, 6) << "the target did not share a launch";
    EXPECT_EQ(FirstDiff(packed.target_bytes, alone.target_bytes), -1);
  }
}

TEST(ServerBatchInvarianceTest, OptionPackedRequestGivesItsBytesAlone) {
  const AttentionInputs target = Inputs(TargetShape(), 6);
  const ServerRun alone = RunTarget(target, {}, false, /*option=*/true, true);
  const ServerRun packed = RunTarget(target, RandomMates(TargetShape(), 4, 41), false,
                                     /*option=*/true, /*mates_option=*/true);
  EXPECT_EQ(packed.target_batch_size, 5);
  EXPECT_EQ(FirstDiff(packed.target_bytes, alone.target_bytes), -1);
}

TEST(ServerBatchInvarianceTest, InvariantCallSharesNoLaunchWithOthers) {
  const AttentionInputs target = Inputs(TargetShape(), 7);
  const ServerRun packed = RunTarget(target, RandomMates(TargetShape(), 4, 43), false,
                                     /*option=*/true, /*mates_option=*/false);
  EXPECT_EQ(packed.target_batch_size, 1);
}

// --- The CUDA planner ------------------------------------------------------

// Params of a varlen launch over sequences (sq, sk) (what PlanForward reads:
// sizes, heads, dtype, options), and its cu_seqlens.
struct PlanCase {
  std::vector<int32_t> cu_q{0}, cu_k{0};
  AttnParams p{};
  PlanCase(const std::vector<std::pair<int, int>>& seqs, int hq, int hkv, bool causal) {
    p.dtype = DType::kBF16;
    p.num_heads_q = hq;
    p.num_heads_kv = hkv;
    p.head_dim = 128;
    p.window_left = kNoWindow;
    p.window_right = causal ? 0 : kNoWindow;
    p.is_causal = causal;
    p.softmax_scale = 0.088f;
    p.softmax_scale_log2 = p.softmax_scale * kLog2e;
    p.batch_invariant = true;
    for (auto [sq, sk] : seqs) {
      cu_q.push_back(cu_q.back() + sq);
      cu_k.push_back(cu_k.back() + sk);
      p.seqlen_q = std::max(p.seqlen_q, sq);
      p.seqlen_k = std::max(p.seqlen_k, sk);
    }
    p.batch = static_cast<int32_t>(seqs.size());
    p.total_q = cu_q.back();
    p.total_k = cu_k.back();
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
  }
};

TEST(PlanBatchInvarianceTest, DecodeSplitsIgnoreBatchLengthsAndSms) {
  for (bool sm90 : {false, true}) {
    for (int hkv : {1, 2, 8, 32}) {
      Plan first;
      bool have = false;
      for (int b : {1, 16, 64, 3000}) {
        for (int sk : {1, 300, 8192, 65536}) {
          for (int sms : {20, 108, 132}) {
            PlanCase c(std::vector<std::pair<int, int>>(b, {1, sk}), 4 * hkv, hkv, false);
            const Plan plan = cuda::PlanForward(c.p, sms, sm90);
            if (plan.kernel_head_dim == 0) GTEST_SKIP() << "no D = 128 kernel in this build";
            ASSERT_EQ(plan.tile_kind, TileKind::kDecode);
            if (!have) first = plan;
            have = true;
            EXPECT_TRUE(SamePlanned(plan, first))
                << "hkv " << hkv << " b " << b << " sk " << sk << " sms " << sms << ": "
                << plan.num_splits << " splits, first " << first.num_splits;
          }
        }
      }
      EXPECT_GT(first.num_splits, 1) << hkv;
    }
  }
}

TEST(PlanBatchInvarianceTest, MembersPlannedAlikeKeepTheirPlanPacked) {
  std::mt19937 rng(3);
  const std::vector<int> qs = {1, 2, 4, 5, 16, 17, 63, 64, 200};
  const std::vector<int> ks = {0, 1, 64, 300, 4095, 4096, 9000};
  int packs = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const bool sm90 = trial % 2 == 0;
    const bool causal = trial % 3 == 0;
    const int hkv = trial % 5 == 0 ? 1 : 8;
    std::vector<std::pair<int, int>> seqs;
    const int n = std::uniform_int_distribution<int>(2, 5)(rng);
    for (int i = 0; i < n; ++i) {
      seqs.push_back({qs[rng() % qs.size()], ks[rng() % ks.size()]});
    }
    // Each member alone (one sequence each), then the pack of those planned
    // like the first, as the executor groups them.
    std::vector<std::pair<int, int>> group = {seqs[0]};
    const Plan first = cuda::PlanForward(PlanCase({seqs[0]}, 32, hkv, causal).p, 132, sm90);
    if (first.kernel_head_dim == 0) GTEST_SKIP() << "no D = 128 kernel in this build";
    for (int i = 1; i < n; ++i) {
      const Plan alone = cuda::PlanForward(PlanCase({seqs[i]}, 32, hkv, causal).p, 132, sm90);
      if (SamePlanned(alone, first)) group.push_back(seqs[i]);
    }
    if (group.size() < 2) continue;
    ++packs;
    const Plan packed = cuda::PlanForward(PlanCase(group, 32, hkv, causal).p, 132, sm90);
    std::string seq_list;
    for (auto [q, k] : group) absl::StrAppend(&seq_list, " (", q, ", ", k, ")");
    EXPECT_TRUE(SamePlanned(packed, first))
        << "sm90 " << sm90 << " causal " << causal << " hkv " << hkv << ":" << seq_list;
  }
  EXPECT_GT(packs, 1000);
}

}  // namespace
}  // namespace attnserve
