// FP8 K/V caches on the CPU backend (paged_kv.h): the append quantises 16-bit
// rows or copies given codes and scales, page copies carry the scales, and
// attention over the pages passes the float64 reference over the dequantised
// cache (and the stated quantisation bound against the 16-bit inputs);
// CheckPagedParams refuses bad scales and combinations.
#include <cmath>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/check_paged_params.h"
#include "backend/paged_batch.h"
#include "gtest/gtest.h"
#include "tests/backend/paged_fp8_case.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::Fp8Case;
using testing_util::Fp8CaseGrid;
using testing_util::Fp8PagedCase;
using testing_util::HostBuffers;
using testing_util::TestCase;

AttentionBackend& Backend() {
  static AttentionBackend* backend = MakeCpuBackend(0).release();
  return *backend;
}

class PagedFp8Test : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(PagedFp8Test, PagesAndOutputPassTheReference) {
  const Fp8Case& c = GetParam();
  HostBuffers buf(c.tc);
  Fp8PagedCase paged(buf, c.page_size, c.new_rows, c.given_scales, c.cow, 7);
  absl::StatusOr<Plan> plan = Backend().CanImplementPaged(paged.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  BackendTimings t;
  ASSERT_TRUE(Backend().PagedForward(*plan, paged.params(), &t).ok());
  EXPECT_EQ(paged.CheckPages(), "");
  EXPECT_EQ(paged.CheckOutput(paged.o(), paged.lse()), "");
}

INSTANTIATE_TEST_SUITE_P(Grid, PagedFp8Test, ::testing::ValuesIn(Fp8CaseGrid()));

// Packed launches (the default StartPagedForward through PagedBatch) of FP8
// rows with scales: the same call twice packs both members' rows and scales
// (appending the same codes to the same places twice) and each gets its O.
TEST(PagedFp8Batch, PackedMembersWithScalesPass) {
  TestCase tc = Fp8CaseGrid()[1].tc;
  HostBuffers buf(tc);
  Fp8PagedCase paged(buf, 64, 1, /*given_scales=*/true, /*cow=*/true, 11);
  PagedBatch batch({&paged.params(), &paged.params()});
  EXPECT_TRUE(batch.has_new_scales());
  EXPECT_EQ(batch.kv_scale_bytes(), 2 * paged.params().attn.total_k * tc.num_heads_kv * 4);
  EXPECT_EQ(batch.kv_new_bytes(), 2 * paged.params().attn.total_k * tc.num_heads_kv * tc.head_dim);
  absl::StatusOr<Plan> plan = Backend().CanImplementPaged(paged.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<std::unique_ptr<PendingLaunch>> launch = Backend().StartPagedForward(*plan, batch);
  ASSERT_TRUE(launch.ok()) << launch.status();
  ASSERT_TRUE((*launch)->Finish(nullptr).ok());
  EXPECT_EQ(paged.CheckPages(), "");
  EXPECT_EQ(paged.CheckOutput(paged.o(), paged.lse()), "");
}

TEST(PagedFp8Batch, QuantisedAndGivenRowsNeverShareALaunch) {
  TestCase tc = Fp8CaseGrid()[0].tc;
  HostBuffers buf(tc);
  Fp8PagedCase quantised(buf, 16, 1, false, false, 1);
  PagedAttnParams given = quantised.params();
  const float scale = 1.0f;
  given.k_new_scale = &scale;
  given.v_new_scale = &scale;
  EXPECT_TRUE(CanSharePagedLaunch(quantised.params(), quantised.params()));
  EXPECT_FALSE(CanSharePagedLaunch(quantised.params(), given));
}

TEST(PagedFp8Check, RefusesBadScalesAndCombinations) {
  TestCase tc = Fp8CaseGrid()[1].tc;
  HostBuffers buf(tc);
  Fp8PagedCase paged(buf, 64, 1, true, false, 3);
  ASSERT_TRUE(CheckPagedParams(paged.params()).ok());
  std::vector<float> scales(size_t(paged.new_scale_count()), 1.0f);
  for (float bad : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    PagedAttnParams p = paged.params();
    scales[1] = bad;
    p.v_new_scale = scales.data();
    const absl::Status s = CheckPagedParams(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("v_new_scale[1]"), std::string::npos) << s;
  }
  PagedAttnParams one = paged.params();
  one.v_new_scale = nullptr;
  EXPECT_NE(CheckPagedParams(one).message().find("k_new_scale and v_new_scale"), std::string::npos);
  PagedAttnParams not_fp8 = paged.params();
  not_fp8.pages.fp8_e4m3 = false;
  EXPECT_NE(CheckPagedParams(not_fp8).message().find("16/32-bit cache"), std::string::npos);
  PagedAttnParams fp32 = paged.params();
  fp32.attn.dtype = DType::kFP32;
  EXPECT_NE(CheckPagedParams(fp32).message().find("FP16 or BF16 with an FP8 cache"),
            std::string::npos);
}

// The quantisation rule on its own: scale max|x| / 448, a zero row scale 1,
// the largest element's code 448, ties to even.
TEST(Fp8Quantise, ContractRule) {
  std::vector<uint16_t> row(8);
  const float values[8] = {1.0f, -2.0f, 0.5f, 0.0f, 3.5f, -7.0f, 0.25f, 1.5f};
  for (int i = 0; i < 8; ++i) row[size_t(i)] = FloatToBf16(values[i]);
  uint8_t codes[8];
  const float scale = QuantiseFp8Row(row.data(), DType::kBF16, 0, 8, codes);
  EXPECT_EQ(scale, 7.0f / 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(codes[5]), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(codes[0]), 64.0f);
  std::vector<uint16_t> zeros(8, 0);
  EXPECT_EQ(QuantiseFp8Row(zeros.data(), DType::kBF16, 0, 8, codes), 1.0f);
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
}

}  // namespace
}  // namespace attnserve
