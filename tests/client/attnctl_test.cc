// The attnctl binary end to end: each case runs the built executable against
// an AttnServer started in-process on 127.0.0.1:0 and checks its output and
// exit code (0 success, 1 failure, 2 bad usage).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/inputs.h"
#include "client/npy.h"
#include "client/verify.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class AttnctlTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    target_flag_ = absl::StrCat("--target=", server_->target());
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  // attnctl <args> --target=<the test server>.
  static CliResult Run(std::vector<std::string> args) {
    args.push_back(target_flag_);
    return RunCli(args);
  }

  static LoopbackServer* server_;
  static std::string target_flag_;
};

LoopbackServer* AttnctlTest::server_ = nullptr;
std::string AttnctlTest::target_flag_;

TEST_F(AttnctlTest, Help) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--help"}, {"help"}, {"-h"}}) {
    const CliResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 0) << Describe(r);
    EXPECT_THAT(r.out, HasSubstr("Usage: attnctl"));
    EXPECT_THAT(r.out, HasSubstr("forward"));
    EXPECT_THAT(r.out, HasSubstr("--target"));
  }
  const CliResult forward = RunCli({"help", "forward"});
  EXPECT_EQ(forward.exit_code, 0) << Describe(forward);
  EXPECT_THAT(forward.out, HasSubstr("--varlen_q"));
  EXPECT_THAT(forward.out, HasSubstr("--verify"));
  const CliResult forward_help = RunCli({"forward", "--help"});
  EXPECT_EQ(forward_help.out, forward.out);
  const CliResult none = RunCli({});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.out, HasSubstr("Commands:"));
}

TEST_F(AttnctlTest, Health) {
  const CliResult r = Run({"health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");
  // Global flags may also come first.
  const CliResult before = RunCli({target_flag_, "health"});
  EXPECT_EQ(before.exit_code, 0) << Describe(before);
}

TEST_F(AttnctlTest, HealthFailsWhenNothingListens) {
  const CliResult r = RunCli({"health", "--target=127.0.0.1:1", "--timeout=10s"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
}

TEST_F(AttnctlTest, Info) {
  const CliResult r = Run({"info"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("backend:    cpu"));
  EXPECT_THAT(r.out, HasSubstr("FP16, BF16, FP32, FP8_E4M3"));
  EXPECT_THAT(r.out, HasSubstr("with V's own (MLA): Q/K up to 576, V up to 512"));
  const CliResult json = Run({"info", "--json"});
  EXPECT_EQ(json.exit_code, 0) << Describe(json);
  EXPECT_THAT(json.out, HasSubstr("\"backend\": \"cpu\""));
  EXPECT_THAT(json.out, HasSubstr("\"max_head_dim\": 256"));
  EXPECT_THAT(json.out, HasSubstr("\"max_head_dim_qk\": 576"));
}

// Every dtype, causal and not, dense GQA, plus windows and softcap.
TEST_F(AttnctlTest, ForwardVerifyPasses) {
  const std::vector<std::vector<std::string>> cases = {
      {"--dtype=fp16", "--seqlen_q=33", "--heads_q=4"},
      {"--dtype=fp16", "--seqlen_q=33", "--heads_q=4", "--causal"},
      {"--dtype=bf16", "--batch=2", "--seqlen_q=17", "--seqlen_k=40", "--heads_q=2"},
      {"--dtype=bf16", "--batch=2", "--seqlen_q=17", "--seqlen_k=40", "--heads_q=2", "--causal"},
      {"--dtype=fp32", "--seqlen_q=20", "--head_dim=32", "--return_lse"},
      {"--dtype=fp32", "--seqlen_q=20", "--head_dim=32", "--causal", "--return_lse"},
      {"--dtype=bf16", "--seqlen_q=24", "--heads_q=8", "--heads_kv=2", "--causal", "--return_lse"},
      {"--dtype=fp16", "--seqlen_q=24", "--heads_q=4", "--heads_kv=1", "--window_left=4",
       "--window_right=2", "--softcap=20", "--softmax_scale=0.3"},
      // FP8 codes: O is BF16, checked on the dequantised inputs.
      {"--dtype=fp8_e4m3", "--seqlen_q=33", "--heads_q=4", "--heads_kv=2", "--causal",
       "--return_lse", "--q_descale=0.5", "--k_descale=1.5", "--v_descale=0.25"},
      {"--dtype=fp8_e4m3", "--varlen_q=3,0,17", "--varlen_k=5,4,17", "--heads_q=2"},
  };
  for (std::vector<std::string> args : cases) {
    args.insert(args.begin(), "forward");
    args.push_back("--verify");
    args.push_back("--seed=11");
    const CliResult r = Run(args);
    SCOPED_TRACE(Describe(r));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.out, HasSubstr("PASS"));
    EXPECT_THAT(r.out, HasSubstr("backend:  cpu"));
    EXPECT_THAT(r.out, HasSubstr("latency:  client"));
    EXPECT_THAT(r.out, HasSubstr("compute"));
    EXPECT_THAT(r.out, HasSubstr("max abs err"));
    EXPECT_THAT(r.out, HasSubstr("max rel err"));
    EXPECT_THAT(r.out, HasSubstr("tolerance"));
  }
}

TEST_F(AttnctlTest, ForwardVarlenWithZeroLengthSequence) {
  const CliResult r = Run({"forward", "--varlen_q=3,0,17,4", "--varlen_k=5,4,17,0", "--heads_q=4",
                           "--heads_kv=2", "--dtype=bf16", "--causal", "--return_lse", "--verify"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("varlen B=4 Tq=24 Tk=26"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
}

TEST_F(AttnctlTest, ForwardNpyInAndOut) {
  AttentionShape s;
  s.dtype = DType::kFP32;
  s.seqlen_q = 9;
  s.seqlen_k = 13;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 16;
  auto inputs = MakeRandomInputs(s, 21);
  ASSERT_TRUE(inputs.ok());
  const std::string dir = ::testing::TempDir();
  const std::string q = dir + "/attnctl_q.npy", k = dir + "/attnctl_k.npy",
                    v = dir + "/attnctl_v.npy", o = dir + "/attnctl_o.npy",
                    lse = dir + "/attnctl_lse.npy";
  ASSERT_TRUE(WriteNpy(q, inputs->q).ok());
  ASSERT_TRUE(WriteNpy(k, inputs->k).ok());
  ASSERT_TRUE(WriteNpy(v, inputs->v).ok());

  // FP32 files sent as FP16 (--dtype converts), outputs written back.
  const CliResult r = Run({"forward", "--q=" + q, "--k=" + k, "--v=" + v, "--dtype=fp16",
                           "--causal", "--out=" + o, "--out_lse=" + lse, "--verify"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("dense B=1 Sq=9 Sk=13 Hq=4 Hkv=2 D=16 FP16"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));

  // The written O and LSE are the reference's answer for the converted inputs.
  AttentionInputs sent = *inputs;
  sent.q = inputs->q.ConvertTo(DType::kFP16);
  sent.k = inputs->k.ConvertTo(DType::kFP16);
  sent.v = inputs->v.ConvertTo(DType::kFP16);
  sent.options.causal = true;
  sent.options.return_lse = true;
  ForwardResult result;
  auto o_back = ReadNpy(o);
  ASSERT_TRUE(o_back.ok()) << o_back.status();
  EXPECT_EQ(o_back->dtype(), DType::kFP16);
  result.o = *o_back;
  auto lse_back = ReadNpy(lse);
  ASSERT_TRUE(lse_back.ok()) << lse_back.status();
  EXPECT_EQ(lse_back->shape(), (std::vector<int64_t>{1, 4, 9}));
  result.lse = *lse_back;
  auto report = VerifyForward(sent, result);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->passed) << report->failure;

  // Packed files need the lengths.
  auto packed = MakeRandomInputs(
      [] {
        AttentionShape p;
        p.dtype = DType::kBF16;
        p.heads_q = p.heads_kv = 2;
        p.head_dim = 8;
        p.seqlens_q = {2, 0, 5};
        p.seqlens_k = {2, 3, 5};
        return p;
      }(),
      22);
  ASSERT_TRUE(packed.ok());
  ASSERT_TRUE(WriteNpy(q, packed->q).ok());
  ASSERT_TRUE(WriteNpy(k, packed->k).ok());
  ASSERT_TRUE(WriteNpy(v, packed->v).ok());
  const CliResult missing = Run({"forward", "--q=" + q, "--k=" + k, "--v=" + v});
  EXPECT_EQ(missing.exit_code, 2) << Describe(missing);
  EXPECT_THAT(missing.err, HasSubstr("need --varlen_q"));
  const CliResult varlen = Run({"forward", "--q=" + q, "--k=" + k, "--v=" + v, "--varlen_q=2,0,5",
                                "--varlen_k=2,3,5", "--dtype=bf16", "--verify"});
  EXPECT_EQ(varlen.exit_code, 0) << Describe(varlen);
  EXPECT_THAT(varlen.out, HasSubstr("PASS"));
}

// FP8 from .npy: uint8 codes ('|u1'), descales from flags; O comes back BF16
// and is written as float32 ('<f4', exact).
TEST_F(AttnctlTest, ForwardFp8NpyIn) {
  AttentionShape s;
  s.dtype = DType::kFP8E4M3;
  s.seqlen_q = 9;
  s.seqlen_k = 13;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 16;
  auto inputs = MakeRandomInputs(s, 31);
  ASSERT_TRUE(inputs.ok());
  const std::string dir = ::testing::TempDir();
  const std::string q = dir + "/attnctl_fp8_q.npy", k = dir + "/attnctl_fp8_k.npy",
                    v = dir + "/attnctl_fp8_v.npy", o = dir + "/attnctl_fp8_o.npy";
  ASSERT_TRUE(WriteNpy(q, inputs->q).ok());
  ASSERT_TRUE(WriteNpy(k, inputs->k).ok());
  ASSERT_TRUE(WriteNpy(v, inputs->v).ok());
  auto q_back = ReadNpy(q);
  ASSERT_TRUE(q_back.ok()) << q_back.status();
  EXPECT_EQ(q_back->dtype(), DType::kFP8E4M3);  // '|u1' reads back as codes
  EXPECT_EQ(q_back->bytes(), inputs->q.bytes());

  const CliResult r = Run({"forward", "--q=" + q, "--k=" + k, "--v=" + v, "--q_descale=0.25",
                           "--k_descale=3", "--v_descale=0.5", "--out=" + o, "--verify"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("dense B=1 Sq=9 Sk=13 Hq=4 Hkv=2 D=16 FP8_E4M3"));
  EXPECT_THAT(r.out, HasSubstr("q_descale=0.25 k_descale=3 v_descale=0.5"));
  EXPECT_THAT(r.out, HasSubstr("PASS"));

  // The written O is the BF16 answer for the dequantised inputs.
  AttentionInputs sent = *inputs;
  sent.options.q_descale = 0.25f;
  sent.options.k_descale = 3.0f;
  sent.options.v_descale = 0.5f;
  auto o_back = ReadNpy(o);
  ASSERT_TRUE(o_back.ok()) << o_back.status();
  ForwardResult result;
  result.o = o_back->ConvertTo(DType::kBF16);  // exact: the file holds widened BF16
  auto report = VerifyForward(sent, result);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->passed) << report->failure;
  // Without the descales the same codes mean other values: the check must fail.
  sent.options.v_descale = 1.0f;
  report = VerifyForward(sent, result);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->passed);
}

// Descale rules are the server's: its INVALID_ARGUMENT names the field.
TEST_F(AttnctlTest, Fp8DescaleErrorsNameTheField) {
  CliResult r = Run({"forward", "--dtype=fp16", "--seqlen_q=4", "--q_descale=2"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: options.q_descale"));
  EXPECT_THAT(r.err, HasSubstr("FP8_E4M3 inputs only"));
  r = Run({"forward", "--dtype=fp8_e4m3", "--seqlen_q=4", "--v_descale=0"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("options.v_descale: expected finite and in (0, 128]"));
}

TEST_F(AttnctlTest, ServerErrorsAreNamedAndNonzero) {
  // D = 12: the server's INVALID_ARGUMENT, code name and message.
  const CliResult r = Run({"forward", "--head_dim=12", "--seqlen_q=4"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("Forward failed: INVALID_ARGUMENT: "));
  EXPECT_THAT(r.err, HasSubstr("12"));
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return lines;
}

// A short closed-loop sweep with every response checked: no errors, real
// throughput, and one CSV row and one JSON line per step.
TEST_F(AttnctlTest, LoadClosedLoopChecksEveryResponse) {
  const std::string base = absl::StrCat(::testing::TempDir(), "/load_", getpid());
  const std::string csv = base + ".csv", jsonl = base + ".jsonl";
  std::remove(csv.c_str());
  std::remove(jsonl.c_str());
  const CliResult r =
      Run({"load", "--concurrency=1,2", "--warmup=200ms", "--duration=1s", "--seqlen_q=32",
           "--heads_q=2", "--head_dim=32", "--causal", "--return_lse", "--check", "--csv=" + csv,
           "--jsonl=" + jsonl, "--label=say \"hi\""});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("concurrency=2"));
  EXPECT_THAT(r.err, HasSubstr("req/s"));  // the progress line

  const std::vector<std::string> rows = Lines(ReadFile(csv));
  ASSERT_EQ(rows.size(), 3u) << ReadFile(csv);
  const std::vector<std::string> header = absl::StrSplit(rows[0], ',');
  auto column = [&](const std::string& row, const std::string& name) {
    const std::vector<std::string> cells = absl::StrSplit(row, ',');
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    EXPECT_EQ(cells.size(), header.size()) << row;
    return it == header.end() ? std::string() : cells[it - header.begin()];
  };
  for (int i = 1; i <= 2; ++i) {
    EXPECT_EQ(column(rows[i], "concurrency"), absl::StrCat(i));
    EXPECT_EQ(column(rows[i], "errors"), "0");
    double rps = 0;
    ASSERT_TRUE(absl::SimpleAtod(column(rows[i], "req_per_s"), &rps));
    EXPECT_GT(rps, 0);
    EXPECT_EQ(column(rows[i], "check"), "true");
    EXPECT_EQ(column(rows[i], "label"), "\"say 'hi'\"");
  }

  const std::vector<std::string> objects = Lines(ReadFile(jsonl));
  ASSERT_EQ(objects.size(), 2u);
  for (const std::string& line : objects) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["mode"], "closed");
    EXPECT_EQ(j["label"], "say \"hi\"");
    EXPECT_EQ(j["errors"], 0);
    EXPECT_GT(j["requests"].get<int64_t>(), 0);
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["tflops"].get<double>(), 0);
    EXPECT_LE(j["p50_ms"].get<double>(), j["p99_ms"].get<double>());
    EXPECT_TRUE(j["errors_by_code"].empty());
  }
  std::remove(csv.c_str());
  std::remove(jsonl.c_str());
}

// Open loop over ForwardStream, varlen inputs with a zero-length sequence.
TEST_F(AttnctlTest, LoadFp8ChecksEveryResponse) {
  const CliResult r = Run({"load", "--concurrency=2", "--warmup=100ms", "--duration=500ms",
                           "--seqlen_q=16", "--heads_q=2", "--head_dim=32", "--dtype=fp8_e4m3",
                           "--k_descale=0.5", "--v_descale=2", "--causal", "--check"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, Not(HasSubstr("errors by code")));
}

TEST_F(AttnctlTest, LoadOpenLoopStreamChecksEveryResponse) {
  const CliResult r = Run({"load", "--rate=200", "--stream", "--channels=2", "--warmup=200ms",
                           "--duration=1s", "--varlen_q=5,0,17", "--heads_q=4", "--heads_kv=2",
                           "--head_dim=16", "--dtype=bf16", "--check"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("rate=200"));
  EXPECT_THAT(r.out, Not(HasSubstr("errors by code")));
}

// Server errors are reported by code, and a run where nothing succeeds fails.
TEST_F(AttnctlTest, LoadReportsErrorsByCode) {
  const CliResult r =
      Run({"load", "--warmup=0s", "--duration=300ms", "--head_dim=12", "--seqlen_q=4"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("errors by code: INVALID_ARGUMENT:"));
  EXPECT_THAT(r.out, HasSubstr("first error: INVALID_ARGUMENT:"));
}

// --rpc=echo: the same report from Echo, with no compute claimed.
TEST_F(AttnctlTest, LoadEchoClosedAndOpenLoop) {
  const std::string jsonl = absl::StrCat(::testing::TempDir(), "/load_echo_", getpid(), ".jsonl");
  std::remove(jsonl.c_str());
  const CliResult closed = Run({"load", "--rpc=echo", "--concurrency=2", "--warmup=100ms",
                                "--duration=500ms", "--seqlen_q=32", "--heads_q=2", "--head_dim=32",
                                "--return_lse", "--jsonl=" + jsonl, "--label=echo"});
  ASSERT_EQ(closed.exit_code, 0) << Describe(closed);
  EXPECT_THAT(closed.out, HasSubstr("unary Echo"));
  EXPECT_THAT(closed.out, HasSubstr("concurrency=2"));
  EXPECT_THAT(closed.out, Not(HasSubstr("errors by code")));
  const std::vector<std::string> objects = Lines(ReadFile(jsonl));
  ASSERT_EQ(objects.size(), 1u);
  const nlohmann::json j = nlohmann::json::parse(objects[0]);
  EXPECT_EQ(j["label"], "echo");
  EXPECT_EQ(j["errors"], 0);
  EXPECT_GT(j["req_per_s"].get<double>(), 0);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["tflops"].get<double>(), 0);
  EXPECT_EQ(j["compute_ms"].get<double>(), 0);
  std::remove(jsonl.c_str());

  const CliResult open =
      Run({"load", "--rpc=echo", "--rate=100", "--warmup=100ms", "--duration=500ms",
           "--varlen_q=5,0,17", "--heads_q=4", "--heads_kv=2", "--head_dim=16"});
  ASSERT_EQ(open.exit_code, 0) << Describe(open);
  EXPECT_THAT(open.out, HasSubstr("rate=100"));
  EXPECT_THAT(open.out, Not(HasSubstr("errors by code")));

  // The server's validation reaches Echo's report like Forward's.
  const CliResult bad =
      Run({"load", "--rpc=echo", "--warmup=0s", "--duration=300ms", "--head_dim=12"});
  EXPECT_EQ(bad.exit_code, 1) << Describe(bad);
  EXPECT_THAT(bad.out, HasSubstr("first error: INVALID_ARGUMENT: q.shape[3]"));
}

TEST_F(AttnctlTest, BadArgumentsNameTheFlag) {
  const struct {
    std::vector<std::string> args;
    const char* expected;
  } cases[] = {
      {{"forward", "--dtype=fp8"}, "--dtype: unknown dtype 'fp8'"},
      {{"forward", "--heads_q=6", "--heads_kv=4"},
       "--heads_q (6) must be a multiple of --heads_kv (4)"},
      {{"forward", "--seqlen_q=-3"}, "--seqlen_q must be >= 0"},
      {{"forward", "--batch=abc"}, "--batch: invalid value 'abc'"},
      {{"forward", "--varlen_q=3,x"}, "--varlen_q: 'x' is not a non-negative integer"},
      {{"forward", "--varlen_q=3,4", "--varlen_k=1"}, "--varlen_k lists 1 sequences"},
      {{"forward", "--varlen_q=3", "--seqlen_q=8"},
       "--seqlen_q cannot be combined with --varlen_q"},
      {{"forward", "--window_left=-2"}, "--window_left must be >= 0"},
      {{"forward", "--softmax_scale=0"}, "--softmax_scale must be finite and > 0"},
      {{"forward", "--q=/nonexistent/q.npy", "--k=x", "--v=y"},
       "--q: cannot open /nonexistent/q.npy"},
      {{"forward", "--q=a.npy"}, "--q, --k and --v must be given together"},
      {{"forward", "--bogus=1"}, "unknown flag --bogus"},
      {{"info", "--causal"}, "flag --causal does not apply to 'info'"},
      {{"frobnicate"}, "unknown command 'frobnicate'"},
      {{"forward", "--lb_policy=random"}, "--target/--lb_policy"},
      {{"forward", "--timeout"}, "flag --timeout needs a value"},
      {{"forward", "--q=/nonexistent/q.npy", "--k=/nonexistent/k.npy", "--v=/nonexistent/v.npy",
        "--seqlen_q=3"},
       "--seqlen_q applies to random inputs"},
      {{"load", "--concurrency=1,x"}, "--concurrency: 'x' is not a non-negative integer"},
      {{"load", "--concurrency=0"}, "--concurrency: each value must be >= 1"},
      {{"load", "--rate=-5"}, "--rate: '-5' is not a positive number"},
      {{"load", "--rate=10", "--concurrency=2"}, "--concurrency (closed loop) and --rate"},
      {{"load", "--duration=0s"}, "--duration must be a finite duration > 0"},
      {{"load", "--channels=0"}, "--channels must be >= 1"},
      {{"load", "--heads_q=6", "--heads_kv=4"}, "--heads_q (6) must be a multiple of --heads_kv"},
      {{"load", "--dtype=int8"}, "--dtype: unknown dtype 'int8'"},
      {{"load", "--verify"}, "flag --verify does not apply to 'load'"},
      {{"forward", "--check"}, "flag --check does not apply to 'forward'"},
      {{"load", "--rpc=ping"}, "--rpc: expected forward or echo, got 'ping'"},
      {{"load", "--rpc=echo", "--check"},
       "--check does not apply to --rpc=echo: Echo returns q's bytes, not attention"},
      {{"load", "--rpc=echo", "--stream"}, "--stream does not apply to --rpc=echo"},
      {{"forward", "--rpc=echo"}, "flag --rpc does not apply to 'forward'"},
  };
  for (const auto& c : cases) {
    const CliResult r = Run(c.args);
    SCOPED_TRACE(Describe(r));
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_THAT(r.err, HasSubstr(c.expected));
    EXPECT_THAT(r.out, Not(HasSubstr("PASS")));
  }
}

}  // namespace
}  // namespace attnserve
