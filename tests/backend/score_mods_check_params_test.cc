// CheckParams on score modifiers and masks: valid random mods pass, and every
// malformed one is refused naming its AttnParams field, the expected and the
// actual value. CheckPagedParams refuses any mod (no paged kernel has them).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/check_paged_params.h"
#include "backend/check_params.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::ModsSpec;
using testing_util::TestCase;

// Dense B = 2, Sq = 300 (3 query blocks of 128), Sk = 260 (3 key blocks), Hq = 2.
TestCase Dense(const ModsSpec& mods) {
  TestCase tc;
  tc.batch = 2;
  tc.seqlen_q = 300;
  tc.seqlen_k = 260;
  tc.num_heads_q = 2;
  tc.num_heads_kv = 1;
  tc.head_dim = 8;
  tc.mods = mods;
  return tc;
}

// Varlen: sequence 1 has 129 keys (2 key blocks), sequence 2 has none.
TestCase Varlen(const ModsSpec& mods) {
  TestCase tc = Dense(mods);
  tc.seqlens_q = {3, 200, 5};
  tc.seqlens_k = {7, 129, 0};
  return tc;
}

ModsSpec AllMods() {
  ModsSpec m;
  m.alibi = true;
  m.sinks = true;
  m.bias = true;
  m.bias_dtype = DType::kBF16;
  m.mask_density = 0.5f;
  m.block_q = 128;
  m.block_k = 256;
  m.block_density = 0.7f;
  return m;
}

void ExpectInvalid(const AttnParams& p, const std::vector<std::string>& parts) {
  const absl::Status s = CheckParams(p);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& part : parts) {
    EXPECT_NE(s.message().find(part), std::string::npos)
        << "message \"" << s.message() << "\" lacks \"" << part << "\"";
  }
}

TEST(ScoreModsCheckParamsTest, AcceptsRandomMods) {
  for (bool per_batch : {false, true}) {
    for (bool per_head : {false, true}) {
      ModsSpec m = AllMods();
      m.bias_per_batch = m.mask_per_batch = m.block_per_batch = per_batch;
      m.bias_per_head = m.mask_per_head = m.block_per_head = per_head;
      m.block_empty_rows = 0.3f;
      for (const TestCase& tc : {Dense(m), Varlen(m)}) {
        HostBuffers buf(tc);
        EXPECT_TRUE(CheckParams(buf.params()).ok())
            << tc.Name() << ": " << CheckParams(buf.params());
      }
    }
  }
  // Density 0: no column at all (block_col_idx may be null).
  ModsSpec m;
  m.block_q = m.block_k = 128;
  m.block_density = 0.0f;
  HostBuffers buf(Dense(m));
  EXPECT_EQ(buf.params().block_col_idx, nullptr);
  EXPECT_TRUE(CheckParams(buf.params()).ok()) << CheckParams(buf.params());
}

TEST(ScoreModsCheckParamsTest, PerHeadValuesFinite) {
  HostBuffers buf(Dense(AllMods()));
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> values = buf.mods()->alibi_slopes();
    values[1] = bad;
    AttnParams p = buf.params();
    p.alibi_slopes = values.data();
    ExpectInvalid(p, {"alibi_slopes[1]", "finite"});
    p = buf.params();
    p.sinks = values.data();
    ExpectInvalid(p, {"sinks[1]", "finite"});
  }
}

TEST(ScoreModsCheckParamsTest, BiasDtype) {
  HostBuffers buf(Dense(AllMods()));
  AttnParams p = buf.params();
  for (DType t : {DType::kFP8E4M3, static_cast<DType>(0), static_cast<DType>(9)}) {
    p.bias_dtype = t;
    ExpectInvalid(p, {"bias_dtype", "FP16 (1), BF16 (2), FP32 (3)",
                      "got " + std::to_string(static_cast<int>(t))});
  }
}

TEST(ScoreModsCheckParamsTest, VarlenNeedsPerBatch) {
  HostBuffers buf(Varlen(AllMods()));
  AttnParams p = buf.params();
  p.bias_per_batch = false;
  ExpectInvalid(p, {"bias_per_batch", "expected true", "got false"});
  p = buf.params();
  p.mask_per_batch = false;
  ExpectInvalid(p, {"mask_per_batch", "expected true", "got false"});
  p = buf.params();
  p.block_per_batch = false;
  ExpectInvalid(p, {"block_per_batch", "expected true", "got false"});
}

TEST(ScoreModsCheckParamsTest, TotalPairs) {
  HostBuffers buf(Varlen(AllMods()));
  AttnParams p = buf.params();
  p.total_pairs += 1;
  ExpectInvalid(p, {"total_pairs", "expected", std::to_string(3 * 7 + 200 * 129),
                    "got " + std::to_string(3 * 7 + 200 * 129 + 1)});
}

TEST(ScoreModsCheckParamsTest, BlockSizes) {
  HostBuffers buf(Dense(AllMods()));
  for (int bad : {64, 100, 129, -128}) {
    AttnParams p = buf.params();
    p.block_q = bad;
    ExpectInvalid(p,
                  {"block_q", "multiple of kBlockMaskGrain (128)", "got " + std::to_string(bad)});
    p = buf.params();
    p.block_k = bad;
    ExpectInvalid(p,
                  {"block_k", "multiple of kBlockMaskGrain (128)", "got " + std::to_string(bad)});
  }
  AttnParams p = buf.params();
  p.block_k = 0;
  ExpectInvalid(p, {"block_k", "got 0"});
  p = buf.params();
  p.block_q = 0;  // the arrays and block_k say a mask was meant
  ExpectInvalid(p, {"block_q", "got 0", "block_k 256"});
}

TEST(ScoreModsCheckParamsTest, RowPointers) {
  HostBuffers buf(Dense(AllMods()));
  const std::vector<int32_t>& good = buf.mods()->block_row_ptr();
  AttnParams p = buf.params();
  p.block_row_ptr = nullptr;
  // 3 query blocks x 2 sequences x 2 heads = 12 rows.
  ExpectInvalid(p, {"block_row_ptr", "expected 13 row offsets", "got null"});
  std::vector<int32_t> rows = good;
  rows[0] = 1;
  p.block_row_ptr = rows.data();
  ExpectInvalid(p, {"block_row_ptr[0]", "expected 0", "got 1"});
  rows = good;
  ASSERT_GT(rows[12], 0);
  rows[5] = rows[4] - 1;  // decreasing
  ExpectInvalid(
      p, {"block_row_ptr[5]", "expected >= block_row_ptr[4]", "got " + std::to_string(rows[5])});
  p = buf.params();
  p.block_col_idx = nullptr;
  ExpectInvalid(p, {"block_col_idx", "got null"});
}

TEST(ScoreModsCheckParamsTest, ColumnIndices) {
  ModsSpec m;
  m.block_q = m.block_k = 128;
  m.block_per_batch = m.block_per_head = false;
  m.block_density = 1.0f;  // every row {0, 1, 2}: Sk = 260 has 3 key blocks
  HostBuffers buf(Dense(m));
  ASSERT_EQ(buf.mods()->block_col_idx(), (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
  std::vector<int32_t> cols = buf.mods()->block_col_idx();
  AttnParams p = buf.params();
  p.block_col_idx = cols.data();
  cols[4] = 3;
  ExpectInvalid(p, {"block_col_idx[4]", "[0, 3)", "got 3"});
  cols[4] = -1;
  ExpectInvalid(p, {"block_col_idx[4]", "[0, 3)", "got -1"});
  cols[4] = 0;  // row 1 reads {0, 0, 2}
  ExpectInvalid(p, {"block_col_idx[4]", "strictly increasing", "got 0"});
  cols = {0, 2, 1, 0, 1, 2, 0, 1, 2};
  ExpectInvalid(p, {"block_col_idx[2]", "strictly increasing", "got 1"});
}

TEST(ScoreModsCheckParamsTest, ColumnIndicesBoundPerSequence) {
  // Varlen rows: sequence 0 (7 keys) has 1 key block, sequence 1 (129) has 2,
  // sequence 2 (no keys) none.
  ModsSpec m;
  m.block_q = m.block_k = 128;
  m.block_per_head = false;
  m.block_density = 1.0f;
  HostBuffers buf(Varlen(m));
  // Rows: seq 0 one query block, seq 1 two, seq 2 one.
  ASSERT_EQ(buf.mods()->block_row_ptr(), (std::vector<int32_t>{0, 1, 3, 5, 5}));
  std::vector<int32_t> cols = buf.mods()->block_col_idx();
  AttnParams p = buf.params();
  p.block_col_idx = cols.data();
  cols[0] = 1;
  ExpectInvalid(p, {"block_col_idx[0]", "[0, 1)", "sequence 0", "got 1"});
  cols = buf.mods()->block_col_idx();
  std::vector<int32_t> rows = {0, 1, 3, 5, 6};  // a column for sequence 2, which has no keys
  cols.push_back(0);
  p.block_col_idx = cols.data();
  p.block_row_ptr = rows.data();
  ExpectInvalid(p, {"block_col_idx[5]", "[0, 0)", "sequence 2", "got 0"});
}

TEST(ScoreModsCheckParamsTest, PagedRefusesMods) {
  const float sink = 0.0f;
  PagedAttnParams p{};
  p.attn.sinks = &sink;
  absl::Status s = CheckPagedParams(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("got sinks"), std::string::npos) << s;
  p.attn.sinks = nullptr;
  p.attn.block_q = 128;
  s = CheckPagedParams(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("block_q 128"), std::string::npos) << s;
}

}  // namespace
}  // namespace attnserve
