// Fair share of a device between tenants, over the wire: two bearer tokens
// (two tenants) on a real server whose CPU backend is gated. One tenant's
// flood of large requests is queued first, then the other's few small ones;
// the launch log shows the small ones run right after the launch that was
// running, not after the flood (FCFS would run them last). The order is
// decided by the queue's state when the gate opens, so the test does not
// depend on timing; every wait is for evidence (a held launch, a queue count).
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/server.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

constexpr char kFloodToken[] = "token-of-the-flood-tenant-0123";
constexpr char kSmallToken[] = "token-of-the-small-tenant-0123";
constexpr int kFlood = 12;
constexpr int kSmall = 3;
// A flood request's q rows (it runs alone: its tokens exceed the batch budget).
constexpr int kFloodRows = 512;

// Waits up to a minute (a loaded CI machine) for `done`; false if it never held.
template <typename F>
bool Eventually(F done) {
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(2));  // polling for evidence, not a fixed wait
  }
  return true;
}

std::unique_ptr<AttentionClient> ClientWithToken(int port, const std::string& token) {
  ClientOptions options;
  options.security.token = token;
  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(absl::StrCat("127.0.0.1:", port), options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Collects async answers.
class Answers {
 public:
  std::function<void(absl::StatusOr<v1::ForwardResponse>)> Slot(int index) {
    return [this, index](absl::StatusOr<v1::ForwardResponse> response) {
      absl::MutexLock lock(&mu_);
      answers_[index] = std::move(response);
    };
  }
  std::map<int, absl::StatusOr<v1::ForwardResponse>> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return answers_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
    return answers_;
  }

 private:
  absl::Mutex mu_;
  std::map<int, absl::StatusOr<v1::ForwardResponse>> answers_ ABSL_GUARDED_BY(mu_);
};

TEST(FairShareTest, SmallTenantIsServedBetweenAnotherTenantsFlood) {
  const std::string tokens = ::testing::TempDir() + "/fair_share_tokens";
  {
    std::ofstream out(tokens);
    out << kFloodToken << " flood\n" << kSmallToken << " small\n";
  }
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  options.auth.tokens_file = tokens;
  options.batch_max_tokens = 2 * kFloodRows;  // a flood request fills a launch alone
  auto owned = std::make_unique<GatedCpuBackend>();
  GatedCpuBackend* backend = owned.get();
  absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Create(options, std::move(owned));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  const int warm_calls = backend->calls();  // the start-up warm-up, if any
  std::unique_ptr<AttentionClient> flood = ClientWithToken((*server)->port(), kFloodToken);
  std::unique_ptr<AttentionClient> small = ClientWithToken((*server)->port(), kSmallToken);
  ASSERT_NE(flood, nullptr);
  ASSERT_NE(small, nullptr);

  absl::StatusOr<AttentionInputs> large_inputs =
      MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, kFloodRows, kFloodRows, 4, 4, 64), 1);
  absl::StatusOr<AttentionInputs> small_inputs =
      MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, 4, 4, 1, 1, 8), 2);
  ASSERT_TRUE(large_inputs.ok() && small_inputs.ok());
  const v1::ForwardRequest large_request = MakeForwardRequest(*large_inputs);
  const v1::ForwardRequest small_request = MakeForwardRequest(*small_inputs);

  backend->Close();
  Answers answers;
  // The first flood request is taken at once and held in the backend ...
  flood->ForwardAsync(large_request, CallOptions(), answers.Slot(0));
  backend->AwaitCalls(warm_calls + 1);
  // ... the rest of the flood queues behind it, then the small tenant's calls.
  for (int i = 1; i < kFlood; ++i)
    flood->ForwardAsync(large_request, CallOptions(), answers.Slot(i));
  ASSERT_TRUE(Eventually([&] { return (*server)->queued_requests() == kFlood - 1; }));
  for (int i = 0; i < kSmall; ++i) {
    small->ForwardAsync(small_request, CallOptions(), answers.Slot(kFlood + i));
  }
  ASSERT_TRUE(Eventually([&] { return (*server)->queued_requests() == kFlood - 1 + kSmall; }));

  // /metrics shows each tenant's queue on the device.
  httplib::Client http("127.0.0.1", (*server)->metrics_port());
  httplib::Result scrape = http.Get("/metrics");
  ASSERT_TRUE(scrape) << httplib::to_string(scrape.error());
  EXPECT_NE(scrape->body.find(absl::StrCat(
                "attnserve_tenant_queue_depth{tenant=\"flood\",device=\"0\"} ", kFlood - 1, "\n")),
            std::string::npos)
      << scrape->body;
  EXPECT_NE(scrape->body.find(absl::StrCat(
                "attnserve_tenant_queue_depth{tenant=\"small\",device=\"0\"} ", kSmall, "\n")),
            std::string::npos);

  backend->Open();
  std::map<int, absl::StatusOr<v1::ForwardResponse>> done = answers.Await(kFlood + kSmall);
  for (auto& [index, response] : done) {
    ASSERT_TRUE(response.ok()) << index << ": " << response.status();
    const AttentionInputs& inputs = index < kFlood ? *large_inputs : *small_inputs;
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(std::move(*response));
    ASSERT_TRUE(result.ok()) << result.status();
    absl::StatusOr<VerifyReport> report = VerifyForward(inputs, *result);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->passed) << index << ": max_abs_err " << report->max_abs_err;
  }

  // The launch log after the warm-up: the held flood launch, then the small
  // tenant's calls (together or apart), and only then the rest of the flood.
  std::vector<int64_t> rows = backend->launch_rows();
  rows.erase(rows.begin(), rows.begin() + warm_calls);
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.front(), kFloodRows);
  int64_t small_rows = 0;
  size_t i = 1;
  while (i < rows.size() && rows[i] != kFloodRows) small_rows += rows[i++];
  EXPECT_EQ(small_rows, 4 * kSmall) << "the small tenant's calls did not all run before the "
                                       "flood's second launch";
  for (; i < rows.size(); ++i) EXPECT_EQ(rows[i], kFloodRows) << "launch " << i;
  (*server)->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace attnserve
