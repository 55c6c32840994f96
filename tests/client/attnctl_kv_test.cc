// `attnctl kv` and `attnctl load-kv` end to end: the built binary against an
// AttnServer (CPU backend) in this process. The decode loop runs with --check
// (every output held to the float64 reference over the whole context), as CI
// runs it; the stateless variant needs no cache and always runs; the cases
// that need the KvCache service skip with the reason when the build has none.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class AttnctlKvTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    target_flag_ = absl::StrCat("--target=", server_->target());
    auto client = AttentionClient::Create(server_->target());
    ASSERT_TRUE(client.ok());
    auto info = (*client)->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    const auto& f = info->features();
    has_kv_ = std::find(f.begin(), f.end(), "kv_cache") != f.end();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  static CliResult Run(std::vector<std::string> args) {
    args.push_back(target_flag_);
    return RunCli(args);
  }

  static LoopbackServer* server_;
  static std::string target_flag_;
  static bool has_kv_;
};

LoopbackServer* AttnctlKvTest::server_ = nullptr;
std::string AttnctlKvTest::target_flag_;
bool AttnctlKvTest::has_kv_ = false;

#define SKIP_WITHOUT_KV()                                                  \
  if (!has_kv_)                                                            \
  GTEST_SKIP() << "this server build has no KvCache service (no kv_cache " \
                  "feature in GetServerInfo)"

// The small decode shape CI runs: 2 layers, GQA 4:2, pages of 16 so the
// 40-token prompts and the generated tokens cross page boundaries.
const std::vector<std::string> kLoopShape = {"--sequences=4", "--prompt=40",  "--tokens=4",
                                             "--layers=2",    "--heads_q=4",  "--heads_kv=2",
                                             "--head_dim=32", "--dtype=fp16", "--seed=5"};

std::vector<std::string> LoadKv(std::vector<std::string> extra) {
  std::vector<std::string> args = {"load-kv"};
  args.insert(args.end(), kLoopShape.begin(), kLoopShape.end());
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST_F(AttnctlKvTest, HelpListsTheOperationsAndFlags) {
  const CliResult kv = RunCli({"help", "kv"});
  EXPECT_EQ(kv.exit_code, 0) << Describe(kv);
  for (const char* s : {"create-seq", "free-seq", "truncate", "--capacity_tokens", "--heads_kv",
                        "x-attnserve-cache-id", "NOT_FOUND"}) {
    EXPECT_THAT(kv.out, HasSubstr(s));
  }
  const CliResult load = RunCli({"help", "load-kv"});
  EXPECT_EQ(load.exit_code, 0) << Describe(load);
  for (const char* s : {"--sequences", "--prompt", "--tokens", "--stateless", "--concurrency",
                        "--check", "--page_size", "--prefill_attend"}) {
    EXPECT_THAT(load.out, HasSubstr(s));
  }
}

TEST_F(AttnctlKvTest, UsageErrorsNameTheFlagAndExit2) {
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"kv"}, "kv needs an operation"},
      {{"kv", "explode"}, "unknown kv operation 'explode'"},
      {{"kv", "drop"}, "kv drop needs --cache"},
      {{"kv", "drop", "--cache=c", "--seq=1"}, "--seq does not apply to 'kv drop'"},
      {{"kv", "create", "--capacity_tokens=64"}, "needs --heads_kv"},
      {{"kv", "create", "--heads_kv=2"}, "exactly one of --capacity_tokens"},
      {{"kv", "free-seq", "--cache=c", "--seq=1,x"}, "--seq: 'x' is not a sequence id"},
      {{"kv", "truncate", "--cache=c", "--seq=1"}, "needs --length"},
      {{"kv", "create-seq", "--cache=c", "--seq=2", "--fork_length=3"}, "needs --fork_from"},
      {{"kv", "info", "--cache=c", "--batch=2"}, "--batch does not apply to 'kv'"},
      {LoadKv({"--concurrency=5"}), "--concurrency (5 groups) must be <= --sequences (4)"},
      {LoadKv({"--warmup_tokens=4"}), "--warmup_tokens (4) must be < --tokens (4)"},
      {LoadKv({"--heads_kv=3"}), "--heads_q (4) must be a multiple of --heads_kv (3)"},
      {LoadKv({"--stateless", "--stream"}), "--stream applies to the K/V loop only"},
      {LoadKv({"--rate=5"}), "--rate does not apply to 'load-kv'"},
  };
  for (const auto& c : cases) {
    const CliResult r = Run(c.args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << Describe(r);
  }
}

TEST_F(AttnctlKvTest, StatelessDecodeLoopChecksEveryStep) {
  const std::string csv = absl::StrCat(::testing::TempDir(), "/kv_stateless.csv");
  std::remove(csv.c_str());
  const CliResult r = Run(LoadKv({"--stateless", "--check", "--concurrency=1,2", "--csv=" + csv}));
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  // 4 tokens x 2 layers: 8 steps for one group, 16 for two.
  EXPECT_THAT(r.out, HasSubstr("check: 8 outputs held to the reference"));
  EXPECT_THAT(r.out, HasSubstr("check: 16 outputs held to the reference"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  const std::vector<std::string> lines = absl::StrSplit(ReadFile(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << ReadFile(csv);
  EXPECT_TRUE(absl::StartsWith(
      lines[0],
      "scenario,impl,sequences,context,layers,page_size,tokens_per_s,tbps,p50_ms,p99_ms,"))
      << lines[0];
  EXPECT_TRUE(absl::StartsWith(lines[1], "loop,attnserve_stateless,4,40,2,0,")) << lines[1];
}

TEST_F(AttnctlKvTest, DecodeLoopCheckUnaryAndStream) {
  SKIP_WITHOUT_KV();
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--page_size=16"},
        {"--page_size=16", "--stream", "--concurrency=1,2", "--channels=1"},
        {"--page_size=32", "--stream", "--concurrency=2", "--channels=2", "--warmup_tokens=1"}}) {
    std::vector<std::string> args = extra;
    args.push_back("--check");
    const CliResult r = Run(LoadKv(args));
    SCOPED_TRACE(Describe(r));
    ASSERT_EQ(r.exit_code, 0);
    // Every prefill output (4 sequences x 2 layers) and every decode step.
    EXPECT_THAT(r.out, HasSubstr("PASS"));
    EXPECT_THAT(r.out, HasSubstr("pages used after free 0"));
    EXPECT_THAT(r.out, HasSubstr("server means: queue"));
  }
}

// An append-only prefill (no Q on the wire) leaves the same cache behind: the
// decode steps that follow are still held to the reference over the whole
// context, and only they are checked.
TEST_F(AttnctlKvTest, AppendOnlyPrefillThenCheckedDecode) {
  SKIP_WITHOUT_KV();
  const CliResult r = Run(LoadKv({"--page_size=16", "--prefill_attend=false", "--check"}));
  SCOPED_TRACE(Describe(r));
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("check: 8 outputs held to the reference"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  EXPECT_THAT(r.out, HasSubstr("pages used after free 0"));
}

// MLA caches from the shell: V rows of their own width, and the absorbed form
// (V is the first head_dim_v elements of each K row, no v on the wire). The
// check holds every prefill and decode output to the reference with V taken
// the same way, over unary calls and a stream.
TEST_F(AttnctlKvTest, MlaCachesDecodeLoopChecked) {
  SKIP_WITHOUT_KV();
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--heads_kv=1", "--head_dim=48", "--head_dim_v=32"},
        {"--heads_kv=1", "--head_dim=72", "--head_dim_v=64", "--v_in_k"},
        {"--heads_kv=1", "--head_dim=72", "--head_dim_v=64", "--v_in_k", "--stream"},
        {"--heads_kv=2", "--head_dim=40", "--v_in_k"},
        {"--heads_kv=1", "--head_dim=72", "--head_dim_v=64", "--v_in_k", "--stateless"}}) {
    std::vector<std::string> args = extra;
    // Stateless: the decode steps only (4 tokens x 2 layers); with a cache
    // the prefill outputs (4 sequences x 2 layers) too.
    const bool stateless = std::find(args.begin(), args.end(), "--stateless") != args.end();
    if (!stateless) args.push_back("--page_size=16");
    args.push_back("--check");
    const CliResult r = Run(LoadKv(args));
    SCOPED_TRACE(Describe(r));
    ASSERT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("check: ", stateless ? 8 : 16,
                                              " outputs held to the reference")));
    EXPECT_THAT(r.out, HasSubstr("PASS"));
  }
  CliResult r = Run({"kv", "create", "--cache=mla", "--heads_kv=1", "--head_dim=576",
                     "--head_dim_v=512", "--v_in_k", "--capacity_tokens=64"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("D 576, Dv 512 (V in K)"));
  r = Run({"kv", "drop", "--cache=mla"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Run({"kv", "create", "--cache=mla2", "--heads_kv=1", "--head_dim=64", "--head_dim_v=128",
           "--v_in_k", "--capacity_tokens=64"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("geometry.head_dim_v"));
}

TEST_F(AttnctlKvTest, CacheLifecycleFromTheShell) {
  SKIP_WITHOUT_KV();
  CliResult r = Run({"kv", "create", "--cache=shell", "--layers=2", "--heads_kv=2", "--head_dim=32",
                     "--page_size=16", "--capacity_tokens=1024"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("cache:      shell"));
  EXPECT_THAT(r.out, HasSubstr("pages of 16 tokens"));
  r = Run({"kv", "create-seq", "--cache=shell", "--seq=1,2"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("2 live"));
  r = Run({"kv", "create-seq", "--cache=shell", "--seq=3", "--fork_from=1"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = Run({"kv", "stats", "--cache=shell", "--seq=1,3", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("\"sequences\": \"3\""));
  r = Run({"kv", "truncate", "--cache=shell", "--seq=1", "--length=0"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Run({"kv", "truncate", "--cache=shell", "--seq=1", "--length=5"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("Truncate failed: "));
  r = Run({"kv", "free-seq", "--cache=shell", "--seq=1,2,3"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("0 live"));
  r = Run({"kv", "drop", "--cache=shell"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Run({"kv", "info", "--cache=shell"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("GetCacheStats failed: NOT_FOUND"));
}

}  // namespace
}  // namespace attnserve
