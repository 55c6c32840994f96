// attnctl over both protocols: `forward` and `load` with --protocol=v2 (KServe
// v2 ModelInfer of the model `attention`) and --shm=system, against an
// in-process CPU server that allows client shared memory. The load test runs
// the same short closed loop over each path and checks each reports results
// (requests, no errors, the protocol named), not timings.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class AttnctlV2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start(/*allow_client_shm=*/true);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  static CliResult Run(std::vector<std::string> args) {
    args.push_back(absl::StrCat("--target=", server_->target()));
    return RunCli(args);
  }

  static LoopbackServer* server_;
};

LoopbackServer* AttnctlV2Test::server_ = nullptr;

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST_F(AttnctlV2Test, ForwardOverV2Verifies) {
  for (const char* shm : {"none", "system"}) {
    const CliResult r = Run({"forward", "--protocol=v2", absl::StrCat("--shm=", shm), "--batch=2",
                             "--seqlen_q=24", "--seqlen_k=40", "--heads_q=4", "--heads_kv=2",
                             "--head_dim=32", "--causal", "--return_lse", "--verify"});
    ASSERT_EQ(r.exit_code, 0) << shm << "\n" << Describe(r);
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("protocol: v2 (KServe ModelInfer, model attention, "
                                              "shm ",
                                              shm, ")")));
    EXPECT_THAT(r.out, HasSubstr("backend:  cpu"));
    EXPECT_THAT(r.out, HasSubstr("PASS"));
  }
  // Varlen through shared memory too (cu_seqlens travel in the region).
  const CliResult r =
      Run({"forward", "--protocol=v2", "--shm=system", "--varlen_q=5,0,17", "--heads_q=4",
           "--heads_kv=2", "--head_dim=16", "--dtype=bf16", "--verify"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("PASS"));
}

// The same load over each path: every run reports requests and no errors,
// and its rows name the protocol and shared memory used.
TEST_F(AttnctlV2Test, LoadRunsOverBothProtocols) {
  const std::string csv = absl::StrCat(::testing::TempDir(), "/load_v2_", getpid(), ".csv");
  std::remove(csv.c_str());
  const std::vector<std::vector<std::string>> paths = {
      {"--protocol=native"}, {"--protocol=v2"}, {"--protocol=v2", "--shm=system"}};
  for (const auto& path : paths) {
    std::vector<std::string> args = {"load",          "--concurrency=2", "--warmup=100ms",
                                     "--duration=1s", "--seqlen_q=32",   "--heads_q=2",
                                     "--head_dim=32", "--causal",        "--return_lse",
                                     "--check",       "--csv=" + csv};
    args.insert(args.end(), path.begin(), path.end());
    const CliResult r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
    EXPECT_THAT(r.out, HasSubstr(path.size() == 1 && path[0] == "--protocol=native"
                                     ? "protocol native"
                                     : "protocol v2 (KServe ModelInfer"));
  }
  const std::vector<std::string> rows = Lines(ReadFile(csv));
  ASSERT_EQ(rows.size(), 4u) << ReadFile(csv);
  const std::vector<std::string> header = absl::StrSplit(rows[0], ',');
  auto column = [&](const std::string& row, const std::string& name) {
    const std::vector<std::string> cells = absl::StrSplit(row, ',');
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    return it == header.end() ? std::string() : cells[it - header.begin()];
  };
  const char* protocols[] = {"\"native\"", "\"v2\"", "\"v2\""};
  const char* shms[] = {"\"none\"", "\"none\"", "\"system\""};
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(column(rows[i], "protocol"), protocols[i - 1]) << rows[i];
    EXPECT_EQ(column(rows[i], "shm"), shms[i - 1]) << rows[i];
    EXPECT_EQ(column(rows[i], "errors"), "0") << rows[i];
    int64_t requests = 0;
    ASSERT_TRUE(absl::SimpleAtoi(column(rows[i], "requests"), &requests));
    EXPECT_GT(requests, 0) << rows[i];
  }
  std::remove(csv.c_str());
}

TEST_F(AttnctlV2Test, OpenLoopOverV2) {
  const CliResult r = Run({"load", "--protocol=v2", "--rate=100", "--warmup=100ms",
                           "--duration=500ms", "--seqlen_q=16", "--head_dim=16", "--check"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("rate=100"));
}

TEST_F(AttnctlV2Test, BadCombinationsAreNamed) {
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string text;
  };
  const Case cases[] = {
      {{"forward", "--protocol=v3"}, 2, "--protocol: expected native or v2, got 'v3'"},
      {{"load", "--shm=system"}, 2, "--shm=system in load needs --protocol=v2"},
      {{"forward", "--protocol=v2", "--shm_prefix=/attnserve.default."},
       2,
       "--shm_prefix names the objects of --shm=system"},
      {{"forward", "--protocol=v2", "--shm=disk"}, 2, "--shm: expected none, system or cuda"},
      {{"forward", "--protocol=v2", "--shm=cuda"}, 1, "--shm=cuda"},
      {{"load", "--protocol=v2", "--stream"}, 2, "--stream does not apply to --protocol=v2"},
      {{"load", "--protocol=v2", "--rpc=echo"}, 2, "--rpc=echo does not apply to --protocol=v2"},
      {{"load", "--protocol=v2", "--shm=system", "--rate=10"}, 2, "--shm needs the closed loop"},
  };
  for (const Case& c : cases) {
    const CliResult r = Run(c.args);
    EXPECT_EQ(r.exit_code, c.exit_code) << Describe(r);
    EXPECT_THAT(r.out + r.err, HasSubstr(c.text)) << Describe(r);
  }
}

}  // namespace
}  // namespace attnserve
