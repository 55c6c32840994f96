// attnctl forward with score modifiers and masks, end to end against an
// in-process CPU server: --verify passes with each of --alibi, --sinks,
// --bias, --mask and --block_density (random and stripes), dense and varlen,
// over the native protocol and KServe v2 (also through shared memory); every
// bad value of those flags is a usage error (exit 2) naming the flag.
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/loopback_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class AttnctlMasksTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start(/*allow_client_shm=*/true);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    target_flag_ = absl::StrCat("--target=", server_->target());
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  static CliResult Run(std::vector<std::string> args) {
    args.insert(args.begin(), "forward");
    args.push_back(target_flag_);
    return RunCli(args);
  }

  // A .npy file in the test's temp dir.
  static std::string Path(const std::string& name) {
    return absl::StrCat(::testing::TempDir(), "/attnctl_masks_", name);
  }

  // A bias of `shape` with values in [-2, 2), as `dtype`.
  static std::string WriteBias(const std::string& name, DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>((i * 37) % 97) / 24.0f - 2.0f;
    const std::string path = Path(name);
    EXPECT_TRUE(WriteNpy(path, *HostTensor::FromFloats(dtype, std::move(shape), values)).ok());
    return path;
  }

  // A bool mask ('|b1') of `shape`, about 2 in 3 elements attended.
  static std::string WriteMask(const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string bytes(static_cast<size_t>(n), '\0');
    for (int64_t i = 0; i < n; ++i) bytes[i] = (i * 7919) % 3 != 0;
    std::string file = EncodeNpy(*HostTensor::FromBytes(DType::kFP8E4M3, std::move(shape), bytes));
    file.replace(file.find("|u1"), 3, "|b1");  // same length, so the header stays aligned
    const std::string path = Path(name);
    std::ofstream(path, std::ios::binary) << file;
    return path;
  }

  static LoopbackServer* server_;
  static std::string target_flag_;
};

LoopbackServer* AttnctlMasksTest::server_ = nullptr;
std::string AttnctlMasksTest::target_flag_;

void ExpectPass(const CliResult& r) {
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("PASS")) << Describe(r);
}

TEST_F(AttnctlMasksTest, EachFlagVerifies) {
  const std::string bias = WriteBias("bias.npy", DType::kFP32, {2, 4, 200, 300});
  const std::string bias_shared = WriteBias("bias_shared.npy", DType::kBF16, {1, 1, 200, 300});
  const std::string mask = WriteMask("mask.npy", {2, 1, 200, 300});
  const std::vector<std::string> shape = {"--batch=2",   "--seqlen_q=200", "--seqlen_k=300",
                                          "--heads_q=4", "--heads_kv=2",   "--head_dim=32",
                                          "--seed=3",    "--return_lse",   "--verify"};
  const std::vector<std::vector<std::string>> cases = {
      {"--alibi"},
      {"--sinks=0.5"},
      {"--sinks=1,-1,0.25,2", "--causal"},
      {"--bias=" + bias},
      {"--bias=" + bias_shared, "--softcap=5"},
      {"--mask=" + mask},
      {"--block_density=0.5"},
      {"--block_density=0.5", "--block_size=256,128", "--block_pattern=stripes"},
      {"--block-density=0", "--sinks=0.5"},  // every row sees no key: O = 0, LSE = the sink
      {"--alibi", "--sinks=0.5", "--bias=" + bias, "--mask=" + mask, "--block_density=0.75",
       "--causal", "--window_left=150"},
  };
  for (const char* dtype : {"--dtype=fp32", "--dtype=bf16"}) {
    for (std::vector<std::string> args : cases) {
      args.insert(args.end(), shape.begin(), shape.end());
      args.push_back(dtype);
      const CliResult r = Run(args);
      SCOPED_TRACE(absl::StrCat(dtype, " ", args[0]));
      ExpectPass(r);
      EXPECT_THAT(r.out, HasSubstr("mods:     "));
    }
  }
}

TEST_F(AttnctlMasksTest, VarlenVerifies) {
  // Pairs: 130 * 200 + 0 * 50 + 260 * 129 = 59540.
  const std::string bias = WriteBias("varlen_bias.npy", DType::kFP16, {2, 59540});
  const std::string mask = WriteMask("varlen_mask.npy", {1, 59540});
  const CliResult r =
      Run({"--varlen_q=130,0,260", "--varlen_k=200,50,129", "--heads_q=2", "--heads_kv=1",
           "--head_dim=16", "--dtype=fp16", "--alibi", "--sinks=0.5,-0.5", "--bias=" + bias,
           "--mask=" + mask, "--block_density=0.5", "--return_lse", "--verify", "--seed=5"});
  ExpectPass(r);
}

TEST_F(AttnctlMasksTest, KServeV2Verifies) {
  const std::string bias = WriteBias("v2_bias.npy", DType::kBF16, {1, 4, 200, 300});
  const std::string mask = WriteMask("v2_mask.npy", {1, 4, 200, 300});
  for (const char* shm : {"--shm=none", "--shm=system"}) {
    const CliResult r =
        Run({"--protocol=v2", shm, "--batch=2", "--seqlen_q=200", "--seqlen_k=300", "--heads_q=4",
             "--head_dim=32", "--dtype=bf16", "--alibi", "--sinks=0.5", "--bias=" + bias,
             "--mask=" + mask, "--block_density=0.5", "--return_lse", "--verify", "--seed=7"});
    SCOPED_TRACE(shm);
    ExpectPass(r);
  }
}

TEST_F(AttnctlMasksTest, BadValuesAreUsageErrors) {
  const std::string bias = WriteBias("bad_bias.npy", DType::kFP32, {1, 3, 64, 64});
  const std::string mask_float = WriteBias("mask_float.npy", DType::kFP32, {1, 1, 64, 64});
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--block_density=1.5"}, "--block_density: expected a fraction in [0, 1], got 1.5"},
      {{"--block_density=-0.1"}, "--block_density: expected a fraction in [0, 1]"},
      {{"--block_density=0.5", "--block_size=100"}, "--block_size: '100' is not a positive"},
      {{"--block_density=0.5", "--block_size=128,128,128"}, "--block_size: expected Q or Q,K"},
      {{"--block_density=0.5", "--block_pattern=diagonal"},
       "--block_pattern: expected random or stripes, got 'diagonal'"},
      {{"--block_size=256"}, "need --block_density"},
      {{"--sinks=abc"}, "--sinks: 'abc' is not a number"},
      {{"--sinks=1,2,3"}, "--sinks lists 3 values, expected 1 or 4"},
      {{"--sinks=nan"}, "--sinks: the value of head 0 must be finite"},
      {{"--sinks=" + Path("missing.npy")}, "--sinks: cannot open"},
      {{"--bias=" + Path("missing.npy")}, "--bias: cannot open"},
      {{"--bias=" + bias},
       "--bias: bias: dense calls take [B or 1, Hq or 1, Sq, Sk] = [1 or 1, "
       "4 or 1, 64, 64], got [1, 3, 64, 64]"},
      {{"--mask=" + mask_float}, "--mask: " + mask_float + ": a mask's element type must be"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> args = {"--seqlen_q=64", "--heads_q=4", "--head_dim=16"};
    args.insert(args.end(), flags.begin(), flags.end());
    const CliResult r = Run(args);
    SCOPED_TRACE(flags[0]);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(message)) << Describe(r);
  }
}

TEST_F(AttnctlMasksTest, HelpDocumentsTheFlags) {
  const CliResult r = RunCli({"help", "forward"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  for (const char* flag : {"--alibi", "--sinks", "--bias", "--mask", "--block_density",
                           "--block_size", "--block_pattern", "docs/masks.md"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

}  // namespace
}  // namespace attnserve
