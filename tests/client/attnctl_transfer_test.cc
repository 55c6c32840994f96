// `attnctl move-kv`, `export-kv` and `import-kv` end to end: the built binary
// against two AttnServers (CPU backend) in this process. A cache made on one
// with known K/V is moved to the other, and written to a file and loaded again;
// the copy must attend exactly as the original (same O and LSE bytes for the
// same queries). A damaged or cut file is refused naming the chunk, before
// anything reaches the server; usage errors name the flag.
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/kv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/attnctl_runner.h"
#include "tests/client/two_loopback_servers.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2, kHeadsQ = 4, kHeadsKv = 2, kHeadDim = 32, kPage = 16;
// Sequence id -> tokens at every layer: three pages and a part, one full page, a few.
const std::vector<std::pair<uint64_t, int>> kSequences = {{1, 40}, {2, 16}, {5, 3}};

HostTensor Random(std::mt19937& rng, DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(rng);
  return *HostTensor::FromFloats(dtype, std::move(shape), values);
}

class AttnctlTransferTest : public TwoLoopbackServersTest {
 protected:
  static std::string Target(int i) { return servers_[i]->target(); }

  // A cache `id` on server `i` holding kSequences, random K/V at every layer.
  static void MakeSource(int i, const std::string& id, DType dtype) {
    KvClient kv(*clients_[i]);
    CacheSpec spec;
    spec.geometry = {kLayers, kHeadsKv, kHeadDim, dtype};
    spec.page_size = kPage;
    spec.capacity_tokens = 4096;
    spec.cache_id = id;
    ASSERT_TRUE(kv.CreateCache(spec).ok());
    std::vector<SequenceSpec> specs;
    for (const auto& [seq, n] : kSequences) specs.push_back({seq});
    ASSERT_TRUE(kv.CreateSequences(id, specs).ok());
    std::mt19937 rng(7);
    for (const auto& [seq, n] : kSequences) {
      for (int layer = 0; layer < kLayers; ++layer) {
        AppendAttendInputs in;
        in.cache_id = id;
        in.layer = layer;
        in.sequences = {{seq, 0, n, 0}};
        in.q = *HostTensor::FromFloats(dtype, {0, kHeadsQ, kHeadDim}, {});
        in.k = Random(rng, dtype, {n, kHeadsKv, kHeadDim});
        in.v = Random(rng, dtype, {n, kHeadsKv, kHeadDim});
        const auto r = kv.AppendAttend(in);
        ASSERT_TRUE(r.ok()) << r.status();
      }
    }
  }

  // O and LSE bytes of the same queries attending (only) every sequence and
  // layer of cache `id` on server `i`.
  static std::vector<std::string> Attend(int i, const std::string& id, DType dtype) {
    KvClient kv(*clients_[i]);
    std::mt19937 rng(11);
    std::vector<std::string> out;
    for (const auto& [seq, n] : kSequences) {
      for (int layer = 0; layer < kLayers; ++layer) {
        AppendAttendInputs in;
        in.cache_id = id;
        in.layer = layer;
        in.sequences = {{seq, n, 0, 1}};
        in.q = Random(rng, dtype, {1, kHeadsQ, kHeadDim});
        in.options.return_lse = true;
        const auto r = kv.AppendAttend(in);
        EXPECT_TRUE(r.ok()) << "server " << i << " cache " << id << " sequence " << seq << " layer "
                            << layer << ": " << r.status();
        if (!r.ok()) return out;
        out.push_back(r->o.bytes());
        out.push_back(r->lse->bytes());
      }
    }
    return out;
  }
};

TEST_F(AttnctlTransferTest, HelpDescribesEachCommand) {
  for (const char* command : {"move-kv", "export-kv", "import-kv"}) {
    const CliResult r = RunCli({"help", command});
    EXPECT_EQ(r.exit_code, 0) << Describe(r);
    EXPECT_THAT(r.out, HasSubstr("--cache")) << command;
  }
  const CliResult move = RunCli({"move-kv", "--help"});
  EXPECT_EQ(move.exit_code, 0);
  for (const char* s : {"--from", "--to", "--seq", "--token_begin", "--token_end",
                        "--capacity_tokens", "--transfer_id", "--tls", "--token"}) {
    EXPECT_THAT(move.out, HasSubstr(s));
  }
  EXPECT_THAT(RunCli({"help", "export-kv"}).out, HasSubstr("--out"));
  EXPECT_THAT(RunCli({"help", "import-kv"}).out, HasSubstr("--in"));
}

TEST_F(AttnctlTransferTest, UsageErrorsNameTheFlagAndExit2) {
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"move-kv", "--cache=c", "--to=x:1"}, "move-kv needs --from and --to"},
      {{"move-kv", "--from=x:1", "--to=y:1"}, "move-kv needs --cache"},
      {{"move-kv", "--from=x:1", "--to=y:1", "--cache=c", "--seq=1,x"}, "--seq: 'x'"},
      {{"move-kv", "--from=x:1", "--to=y:1", "--cache=c", "--token_begin=5", "--token_end=2"},
       "--token_end: expected >= --token_begin (5), got 2"},
      {{"move-kv", "--from=x:1", "--to=y:1", "--cache=c", "--capacity_tokens=5",
        "--capacity_bytes=5"},
       "exactly one of --capacity_tokens and --capacity_bytes"},
      {{"move-kv", "--from=x:1", "--to=y:1", "--cache=c", "--reserve"},
       "give --capacity_tokens or --capacity_bytes too"},
      {{"move-kv", "--from=x:1", "--to=y:1", "--cache=c", "--in=f"},
       "flag --in does not apply to 'move-kv'"},
      {{"export-kv", "--cache=c"}, "export-kv needs --out"},
      {{"export-kv", "--out=/nonexistent-dir/f"}, "export-kv needs --cache"},
      {{"export-kv", "--cache=c", "--out=/nonexistent-dir/f"}, "--out: cannot create"},
      {{"export-kv", "--cache=c", "--out=f", "--to=x:1"}, "flag --to does not apply"},
      {{"import-kv", "--cache=c"}, "import-kv needs --in"},
      {{"import-kv", "--in=f"}, "import-kv needs --cache"},
      {{"import-kv", "--in=/nonexistent-file", "--cache=c"}, "--in: cannot open"},
      {{"import-kv", "--in=f", "--cache=c", "--seq=1"}, "flag --seq does not apply to 'import-kv'"},
      {{"move-kv", "extra"}, "move-kv takes no arguments"},
  };
  for (const auto& c : cases) {
    const CliResult r = RunCli(c.args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << Describe(r);
  }
}

TEST_F(AttnctlTransferTest, MoveKvCopiesACacheThatAttendsIdentically) {
  for (DType dtype : {DType::kFP16, DType::kFP32}) {
    const std::string id = absl::StrCat("move-", static_cast<int>(dtype));
    MakeSource(0, id, dtype);
    // Small chunks (one page), so each sequence takes several.
    const CliResult r =
        RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=" + id,
                "--capacity_tokens=4096",
                absl::StrCat("--max_chunk_bytes=",
                             kPage * kHeadsKv * kHeadDim * (dtype == DType::kFP32 ? 4 : 2))});
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("moved cache ", id, " from ", Target(0))));
    EXPECT_THAT(r.out, HasSubstr("3 sequences"));
    EXPECT_THAT(r.out, HasSubstr("0 resumed"));
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("receiver:   cache ", id)));
    const std::vector<std::string> source = Attend(0, id, dtype);
    const std::vector<std::string> moved = Attend(1, id, dtype);
    ASSERT_EQ(source.size(), 2u * kLayers * kSequences.size());
    EXPECT_TRUE(source == moved) << "the moved cache attends differently";
    // Moving again into the same cache: its sequences exist there now.
    const CliResult again =
        RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=" + id});
    EXPECT_EQ(again.exit_code, 1) << Describe(again);
    EXPECT_THAT(again.err, HasSubstr("ALREADY_EXISTS"));
  }
}

TEST_F(AttnctlTransferTest, MoveKvOfSomeSequencesAndTokensToAnotherId) {
  MakeSource(0, "part", DType::kFP16);
  CliResult r =
      RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=part",
              "--to_cache=part-copy", "--seq=1", "--token_end=20", "--capacity_tokens=4096"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("as part-copy"));
  EXPECT_THAT(r.out, HasSubstr("1 sequences"));
  // The rest of sequence 1, appended to what the receiver holds.
  r = RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=part",
              "--to_cache=part-copy", "--seq=1", "--token_begin=20"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  KvClient kv(*clients_[1]);
  const auto stats = kv.GetCacheStats("part-copy", {1});
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->sequences_size(), 1);
  EXPECT_THAT(stats->sequences(0).lengths(), ::testing::ElementsAre(40, 40));
  // Unknown source cache: the server's NOT_FOUND, exit 1.
  r = RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=nope",
              "--capacity_tokens=4096"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("move-kv failed: NOT_FOUND"));
}

// An absorbed-form MLA cache (one K head whose first 16 elements are V, no V
// pages) through a chunk file and move-kv: the copies are created from the
// header with the same geometry and attend identically.
TEST_F(AttnctlTransferTest, MlaCacheThroughAFileAndMoveKv) {
  constexpr int kD = 24, kDv = 16;
  KvClient source(*clients_[0]);
  CacheSpec spec;
  spec.geometry = {kLayers, 1, kD, DType::kBF16};
  spec.geometry.head_dim_v = kDv;
  spec.geometry.v_in_k = true;
  spec.page_size = kPage;
  spec.capacity_tokens = 4096;
  spec.cache_id = "mla";
  ASSERT_TRUE(source.CreateCache(spec).ok());
  std::vector<SequenceSpec> specs;
  for (const auto& [seq, n] : kSequences) specs.push_back({seq});
  ASSERT_TRUE(source.CreateSequences("mla", specs).ok());
  std::mt19937 rng(3);
  for (const auto& [seq, n] : kSequences) {
    for (int layer = 0; layer < kLayers; ++layer) {
      AppendAttendInputs in;
      in.cache_id = "mla";
      in.layer = layer;
      in.sequences = {{seq, 0, n, 0}};
      in.k = Random(rng, DType::kBF16, {n, 1, kD});
      const auto r = source.AppendAttend(in);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  auto attend = [&](int i, const std::string& id) {
    KvClient kv(*clients_[i]);
    std::mt19937 q_rng(11);
    std::vector<std::string> out;
    for (const auto& [seq, n] : kSequences) {
      for (int layer = 0; layer < kLayers; ++layer) {
        AppendAttendInputs in;
        in.cache_id = id;
        in.layer = layer;
        in.sequences = {{seq, n, 0, 1}};
        in.q = Random(q_rng, DType::kBF16, {1, kHeadsQ, kD});
        const auto r = kv.AppendAttend(in);
        EXPECT_TRUE(r.ok()) << "server " << i << " cache " << id << ": " << r.status();
        if (!r.ok()) return out;
        EXPECT_EQ(r->o.dim(2), kDv);
        out.push_back(r->o.bytes());
      }
    }
    return out;
  };
  const std::string file = absl::StrCat(::testing::TempDir(), "/mla.chunks");
  std::remove(file.c_str());
  CliResult r = RunCli({"export-kv", "--target=" + Target(0), "--cache=mla", "--out=" + file});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"import-kv", "--target=" + Target(1), "--in=" + file, "--cache=mla-file",
              "--capacity_tokens=4096"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"move-kv", "--from=" + Target(0), "--to=" + Target(1), "--cache=mla",
              "--to_cache=mla-moved", "--capacity_tokens=4096"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"kv", "info", "--target=" + Target(1), "--cache=mla-moved"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("D 24, Dv 16 (V in K)"));
  const std::vector<std::string> want = attend(0, "mla");
  ASSERT_EQ(want.size(), kSequences.size() * kLayers);
  EXPECT_TRUE(want == attend(1, "mla-file"));
  EXPECT_TRUE(want == attend(1, "mla-moved"));
}

TEST_F(AttnctlTransferTest, ExportThenImportRoundTrip) {
  MakeSource(0, "snap", DType::kBF16);
  const std::string file = absl::StrCat(::testing::TempDir(), "/snap.chunks");
  std::remove(file.c_str());
  CliResult r = RunCli({"export-kv", "--target=" + Target(0), "--cache=snap", "--out=" + file,
                        absl::StrCat("--max_chunk_bytes=", kPage * kHeadsKv * kHeadDim * 2)});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("3 sequences"));
  std::ifstream partial(file + ".partial");
  EXPECT_FALSE(partial.good()) << "the partial file was left behind";
  r = RunCli({"import-kv", "--target=" + Target(1), "--in=" + file, "--cache=snap-copy",
              "--capacity_tokens=4096"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("imported " + file + " into cache snap-copy: 3 sequences"));
  EXPECT_TRUE(Attend(0, "snap", DType::kBF16) == Attend(1, "snap-copy", DType::kBF16));

  // A damaged byte inside a chunk, and a file cut short: refused before
  // anything is sent (no cache appears on the server), naming the chunk.
  const std::string bytes = ReadFile(file);
  const std::string flipped_path = file + ".flipped", cut_path = file + ".cut";
  std::string flipped = bytes;
  flipped[flipped.size() - 40] ^= 0x20;  // inside the last chunk's v
  std::ofstream(flipped_path, std::ios::binary) << flipped;
  std::ofstream(cut_path, std::ios::binary) << bytes.substr(0, bytes.size() - 9);
  for (const auto& [path, message] : std::vector<std::pair<std::string, std::string>>{
           {flipped_path, "crc32c mismatch"}, {cut_path, "bytes inside a"}}) {
    r = RunCli({"import-kv", "--target=" + Target(1), "--in=" + path, "--cache=bad-copy",
                "--capacity_tokens=4096"});
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(path + ": ")) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(message)) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("chunk ")) << Describe(r);
  }
  std::ofstream(cut_path, std::ios::binary) << "not a chunk file at all";
  r = RunCli({"import-kv", "--target=" + Target(1), "--in=" + cut_path, "--cache=bad-copy"});
  EXPECT_EQ(r.exit_code, 2) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("not a K/V chunk file")) << Describe(r);
  KvClient kv(*clients_[1]);
  EXPECT_EQ(kv.GetCacheStats("bad-copy").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attnserve
