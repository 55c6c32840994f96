// Dynamic ragged batching in a real server: it packs concurrent compatible
// requests into fewer launches than requests, each result correct and
// reporting its batch size; a failed packed launch fails only the request that
// fails alone; --batching=false runs one launch per request. (PackedBatch
// itself: tests/backend/packed_batch_test.cc.)
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

struct Outcome {
  int launches = 0;                     // backend calls for the requests (warm-up excluded)
  std::vector<int> batch_sizes;         // of the successful requests
  std::vector<absl::StatusCode> codes;  // of every request
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
