// attnctl over native same-host shared memory (--shm=system) against an
// in-process CPU server with --allow_client_shm: `forward --verify` and
// `load-kv --check` (unary, stream, stateless) through registered regions,
// the transport named in the report and the CSV, and nothing left behind (no
// object in /dev/shm under the run's --shm_prefix, no region registered).
// Refusals: a server without --allow_client_shm (the error names the flag),
// bad flags, and --shm=cuda (a build without CUDA says so; a CUDA build runs
// it where a GPU is, and skips otherwise).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/shm_arena.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"
#include "tests/client/shm_leftovers.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Keys of this test process only, so parallel tests never see each other's.
std::string KeyPrefix() { return absl::StrCat("/attnserve.default.attnctlshm", getpid(), "-"); }

class AttnctlShmTest : public ::testing::Test {
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
  void TearDown() override { ExpectNothingLeft(server_->target()); }

  static void ExpectNothingLeft(const std::string& target, bool server_allows = true) {
    EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), IsEmpty());
    if (!server_allows) return;
    auto regions = RegisteredRegions(target);
    ASSERT_TRUE(regions.ok()) << regions.status();
    EXPECT_THAT(*regions, IsEmpty());
  }

  // attnctl with `args`, the server's target and this process's key prefix
  // (when shared memory is asked for).
  static CliResult Run(std::vector<std::string> args, const std::string& target = "") {
    args.push_back(absl::StrCat("--target=", target.empty() ? server_->target() : target));
    if (std::find(args.begin(), args.end(), "--shm=system") != args.end()) {
      args.push_back("--shm_prefix=" + KeyPrefix());
    }
    return RunCli(args);
  }

  static LoopbackServer* server_;
};

LoopbackServer* AttnctlShmTest::server_ = nullptr;

TEST_F(AttnctlShmTest, ForwardOverShmVerifies) {
  const CliResult dense =
      Run({"forward", "--shm=system", "--batch=2", "--seqlen_q=24", "--seqlen_k=40", "--heads_q=4",
           "--heads_kv=2", "--head_dim=32", "--causal", "--return_lse", "--verify"});
  ASSERT_EQ(dense.exit_code, 0) << Describe(dense);
  EXPECT_THAT(dense.out, HasSubstr("protocol: native (attnserve.v1.Attention, shm system)"));
  EXPECT_THAT(dense.out, HasSubstr("verify:   lse"));
  EXPECT_THAT(dense.out, HasSubstr("PASS"));
  const CliResult varlen =
      Run({"forward", "--shm=system", "--varlen_q=5,0,17", "--varlen_k=9,4,17", "--heads_q=4",
           "--heads_kv=2", "--head_dim=16", "--dtype=bf16", "--verify"});
  ASSERT_EQ(varlen.exit_code, 0) << Describe(varlen);
  EXPECT_THAT(varlen.out, HasSubstr("PASS"));
}

// The decode loop through one region per group, every output held to the
// reference; the report and the CSV's transport column name the path of
// each run (the progress line does too, but only runs longer than a second
// print one).
TEST_F(AttnctlShmTest, LoadKvOverShmChecks) {
  const std::string csv = absl::StrCat(::testing::TempDir(), "/load_kv_shm_", getpid(), ".csv");
  std::remove(csv.c_str());
  const std::vector<std::string> shape = {
      "load-kv",     "--sequences=4", "--prompt=20",   "--tokens=3", "--layers=2",
      "--heads_q=4", "--heads_kv=2",  "--head_dim=32", "--check",    "--csv=" + csv};
  const std::vector<std::vector<std::string>> runs = {
      {"--shm=system", "--page_size=16"},
      {"--shm=system", "--stream", "--concurrency=2", "--channels=2"},
      {"--shm=system", "--stateless", "--concurrency=2"},
      {"--shm=system", "--page_size=16", "--prefill_attend=false", "--attend_fraction=0.5"},
      {}};
  for (const auto& extra : runs) {
    std::vector<std::string> args = shape;
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << absl::StrJoin(extra, " ") << "\n" << Describe(r);
    EXPECT_THAT(r.out, HasSubstr("PASS: every output matched the float64 reference"));
    EXPECT_THAT(r.out, HasSubstr(extra.empty() ? " over grpc," : " over shm-system,"));
    EXPECT_THAT(r.out, HasSubstr(extra.empty() ? "(grpc): " : "(shm-system): "));
  }
  const std::vector<std::string> rows = absl::StrSplit(ReadFile(csv), '\n', absl::SkipEmpty());
  ASSERT_EQ(rows.size(), runs.size() + 1) << ReadFile(csv);
  const std::vector<std::string> header = absl::StrSplit(rows[0], ',');
  const auto transport = std::find(header.begin(), header.end(), "transport");
  const auto errors = std::find(header.begin(), header.end(), "errors");
  ASSERT_NE(transport, header.end()) << rows[0];
  ASSERT_NE(errors, header.end()) << rows[0];
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::vector<std::string> cells = absl::StrSplit(rows[i], ',');
    ASSERT_EQ(cells.size(), header.size()) << rows[i];
    EXPECT_EQ(cells[transport - header.begin()], i < rows.size() - 1 ? "shm-system" : "grpc");
    EXPECT_EQ(cells[errors - header.begin()], "0") << rows[i];
  }
  std::remove(csv.c_str());
}

TEST_F(AttnctlShmTest, ServerWithoutAllowClientShmNamesTheFlag) {
  auto plain = LoopbackServer::Start(/*allow_client_shm=*/false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::string target = (*plain)->target();
  const std::vector<std::vector<std::string>> commands = {
      {"forward", "--shm=system", "--seqlen_q=16", "--head_dim=16", "--verify"},
      {"load-kv", "--shm=system", "--sequences=2", "--prompt=8", "--tokens=2", "--head_dim=16",
       "--check"}};
  for (const auto& args : commands) {
    const CliResult r = Run(args, target);
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("FAILED_PRECONDITION")) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("--allow_client_shm")) << Describe(r);
    ExpectNothingLeft(target, /*server_allows=*/false);
  }
}

TEST_F(AttnctlShmTest, BadFlagsAreNamed) {
  struct Case {
    std::vector<std::string> args;
    std::string text;
  };
  const Case cases[] = {
      {{"forward", "--shm=disk"}, "--shm: expected none, system or cuda, got 'disk'"},
      {{"load-kv", "--shm=disk"}, "--shm: expected none, system or cuda, got 'disk'"},
      {{"forward", "--shm=system", "--shm_prefix=attnserve.default."}, "--shm_prefix"},
      {{"forward", "--shm_prefix=/attnserve.default."}, "--shm_prefix"},
      {{"load", "--shm=system"}, "--shm=system in load needs --protocol=v2"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    args.push_back(absl::StrCat("--target=", server_->target()));
    const CliResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.out + r.err, HasSubstr(c.text)) << Describe(r);
  }
}

TEST_F(AttnctlShmTest, CudaShm) {
  const CliResult r = Run({"forward", "--shm=cuda", "--seqlen_q=16", "--head_dim=16", "--verify"});
  if (!ShmCudaAvailable()) {
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("built without CUDA")) << Describe(r);
    return;
  }
  if (r.exit_code != 0 && absl::StrContains(r.err, "shm=cuda: cuda")) {
    GTEST_SKIP() << "no usable GPU for a CUDA IPC region:\n" << r.err;
  }
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("shm cuda"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
}

}  // namespace
}  // namespace attnserve
