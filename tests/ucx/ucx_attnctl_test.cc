// `attnctl load-kv --transport=ucx --check` against a real server with a UCX
// listener (the transports UCX_TLS names; ctest runs tcp and sm), and the
// fallback to gRPC bytes against a server without one; `attnctl move-kv
// --data_plane=ucx` between two such servers, and its fallback.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "backend/backend_factory.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace attnserve {
namespace {

struct CommandRun {
  int exit_code = -1;
  std::string output;
};

CommandRun Attnctl(const std::string& args) {
  CommandRun run;
  FILE* pipe = popen(absl::StrCat(ATTNCTL_BINARY, " ", args, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.output.append(buffer, n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::unique_ptr<AttnServer> StartServer(bool ucx) {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.kv_cache_bytes = int64_t{64} << 20;
  o.ucx_port = ucx ? -1 : 0;
  auto server = AttnServer::Create(o, MakeCpuBackend(2));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  EXPECT_TRUE((*server)->Start().ok());
  return *std::move(server);
}

constexpr char kLoop[] =
    "load-kv --sequences=4 --prompt=40 --tokens=4 --layers=2 --heads_q=4 --heads_kv=2 "
    "--head_dim=32 --page_size=16 --concurrency=1,2 --check";

TEST(UcxAttnctlTest, LoadKvOverUcxPassesTheCheck) {
  std::unique_ptr<AttnServer> server = StartServer(true);
  ASSERT_NE(server, nullptr);
  const std::string csv = ::testing::TempDir() + "/ucx_attnctl.csv";
  std::remove(csv.c_str());
  const CommandRun run = Attnctl(absl::StrCat("--target=127.0.0.1:", server->port(), " ", kLoop,
                                              " --transport=ucx --csv=", csv));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(absl::StrCat("over UCX 127.0.0.1:", server->ucx_port())),
            std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("PASS"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("fallback"), std::string::npos) << run.output;
  FILE* f = std::fopen(csv.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char line[4096];
  int ucx_rows = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    const std::string row(line);
    if (row.size() > 5 && row.substr(row.size() - 5) == ",ucx\n") ++ucx_rows;
  }
  std::fclose(f);
  EXPECT_EQ(ucx_rows, 2);  // one row per --concurrency value
  server->Shutdown(absl::Seconds(5));
}

TEST(UcxAttnctlTest, FallsBackToGrpcWhenTheServerHasNoUcx) {
  std::unique_ptr<AttnServer> server = StartServer(false);
  ASSERT_NE(server, nullptr);
  const CommandRun run =
      Attnctl(absl::StrCat("--target=127.0.0.1:", server->port(), " ", kLoop, " --transport=ucx"));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("grpc (fallback from UCX: the server offers no UCX"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("PASS"), std::string::npos) << run.output;
  server->Shutdown(absl::Seconds(5));
}

// A cache filled with load-kv --keep_cache on `from`, moved to `to` with
// move-kv --data_plane=ucx --lanes=2; the output says what carried it.
CommandRun FillAndMove(AttnServer& from, AttnServer& to) {
  const CommandRun fill = Attnctl(absl::StrCat(
      "--target=127.0.0.1:", from.port(),
      " load-kv --sequences=5 --prompt=300 --tokens=1 --layers=2 --heads_q=4 --heads_kv=2 "
      "--head_dim=32 --page_size=16 --prefill_attend=false --keep_cache"));
  EXPECT_EQ(fill.exit_code, 0) << fill.output;
  const size_t at = fill.output.find("; cache ");
  EXPECT_NE(at, std::string::npos) << fill.output;
  if (at == std::string::npos) return fill;
  const size_t end = fill.output.find(',', at);
  const std::string cache = fill.output.substr(at + 8, end - at - 8);
  return Attnctl(absl::StrCat("move-kv --from=127.0.0.1:", from.port(),
                              " --to=127.0.0.1:", to.port(), " --cache=", cache,
                              " --to_cache=moved --capacity_tokens=8192 --data_plane=ucx "
                              "--lanes=2"));
}

TEST(UcxAttnctlTest, MoveKvOverUcxMovesEverySequence) {
  std::unique_ptr<AttnServer> a = StartServer(true), b = StartServer(true);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const CommandRun run = FillAndMove(*a, *b);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(": 5 sequences,"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("data plane: ucx, 2 lanes"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("cache moved (device 0): 5 sequences, 3010 tokens"), std::string::npos)
      << run.output;
  b->Shutdown(absl::Seconds(5));
  a->Shutdown(absl::Seconds(5));
}

TEST(UcxAttnctlTest, MoveKvFallsBackToGrpcWhenTheReceiverHasNoUcx) {
  std::unique_ptr<AttnServer> a = StartServer(true), b = StartServer(false);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const CommandRun run = FillAndMove(*a, *b);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("data plane: grpc (fallback from UCX: the receiver offers no UCX"),
            std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("cache moved (device 0): 5 sequences, 3010 tokens"), std::string::npos)
      << run.output;
  b->Shutdown(absl::Seconds(5));
  a->Shutdown(absl::Seconds(5));
}

TEST(UcxAttnctlTest, UcxWithStreamIsAUsageError) {
  const CommandRun run =
      Attnctl(absl::StrCat("--target=127.0.0.1:1 ", kLoop, " --transport=ucx --stream"));
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("--transport"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace attnserve
