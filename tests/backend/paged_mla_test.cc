// Paged K/V with a value head dim (paged_kv.h): V pages of Dv != D, and the
// absorbed MLA decode form, where one 576-wide K/V head holds V as the first
// 512 elements of each K row (pages.v_in_k: K pages alone). The CPU backend's
// append-and-attend through shuffled block tables against the float64
// reference over the whole context; packed launches (PagedBatch); the checks
// that refuse what a backend cannot run.
#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/check_paged_params.h"
#include "backend/paged_batch.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/backend/paged_mla_case.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::MlaPagedCase;
using testing_util::TestCase;

AttentionBackend& Backend() {
  static AttentionBackend* backend = MakeCpuBackend(0).release();
  return *backend;
}

struct MlaPagedSpec {
  DType dtype;
  int d, dv;
  int hq, hkv;
  std::vector<int> q, k;  // per sequence: queries, total keys
  int new_rows;
  int page_size;
  bool v_in_k;
  bool causal;
  std::string name;
};

std::vector<MlaPagedSpec> Grid() {
  std::vector<MlaPagedSpec> g;
  // Absorbed decode: 576-wide latent head, V its first 512, 16..128 query heads.
  for (int hq : {16, 64, 128}) {
    g.push_back({DType::kBF16,
                 576,
                 512,
                 hq,
                 1,
                 {1, 1, 1},
                 {300, 17, 64},
                 1,
                 64,
                 true,
                 false,
                 "absorbed_decode_h" + std::to_string(hq)});
  }
  g.push_back({DType::kFP32,
               576,
               512,
               16,
               1,
               {1, 1},
               {100, 33},
               1,
               16,
               true,
               false,
               "absorbed_decode_fp32"});
  g.push_back(
      {DType::kFP16, 576, 512, 32, 1, {1, 2}, {1, 50}, 1, 32, true, false, "absorbed_decode_fp16"});
  // Chunked prefill into the absorbed cache: several new tokens, causal.
  g.push_back({DType::kBF16,
               576,
               512,
               16,
               1,
               {9, 0, 40},
               {90, 7, 40},
               9,
               16,
               true,
               true,
               "absorbed_chunk_causal"});
  // V pages of their own at Dv != D (192 / 128), GQA, appends of several rows.
  g.push_back({DType::kBF16,
               192,
               128,
               8,
               2,
               {1, 5, 3},
               {70, 20, 3},
               5,
               16,
               false,
               true,
               "separate_v_192_128"});
  g.push_back(
      {DType::kFP32, 64, 128, 4, 4, {2, 1}, {40, 65}, 2, 32, false, false, "separate_v_wider"});
  // V in K with Dv < D at small dims.
  g.push_back({DType::kFP32, 64, 32, 4, 2, {3, 1}, {33, 80}, 3, 16, true, true, "v_in_k_small"});
  return g;
}

void PrintTo(const MlaPagedSpec& s, std::ostream* os) { *os << s.name; }

TestCase CaseOf(const MlaPagedSpec& s) {
  TestCase tc;
  tc.dtype = s.dtype;
  tc.head_dim = s.d;
  tc.head_dim_v = s.dv;
  tc.num_heads_q = s.hq;
  tc.num_heads_kv = s.hkv;
  tc.seqlens_q = s.q;
  tc.seqlens_k = s.k;
  tc.causal = s.causal;
  return tc;
}

class PagedMlaTest : public ::testing::TestWithParam<MlaPagedSpec> {};

TEST_P(PagedMlaTest, MatchesReference) {
  const MlaPagedSpec& s = GetParam();
  HostBuffers buf(CaseOf(s));
  MlaPagedCase paged(buf, s.page_size, s.new_rows, s.v_in_k, 7);
  const absl::StatusOr<Plan> plan = Backend().CanImplementPaged(paged.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(Backend().PagedForward(*plan, paged.params(), nullptr).ok());
  EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse()));
  EXPECT_EQ(int(paged.v_slabs().size()), s.v_in_k ? 0 : paged.params().pages.num_slabs);
}

INSTANTIATE_TEST_SUITE_P(Grid, PagedMlaTest, ::testing::ValuesIn(Grid()),
                         [](const ::testing::TestParamInfo<MlaPagedSpec>& info) {
                           return info.param.name;
                         });

// Two calls on one cache layer packed into one launch (the executor's
// batching) give each its reference answer: V rows Dv wide, none with v_in_k.
TEST(PagedMlaPackTest, PackedMembers) {
  for (bool v_in_k : {true, false}) {
    SCOPED_TRACE(v_in_k ? "v_in_k" : "separate V");
    MlaPagedSpec s{DType::kBF16,    576, 512, 16,     1,    {1, 2, 1, 3},
                   {40, 70, 1, 20}, 2,   16,  v_in_k, true, ""};
    if (!v_in_k) s.d = 192, s.dv = 128;
    HostBuffers buf(CaseOf(s));
    MlaPagedCase whole(buf, s.page_size, s.new_rows, v_in_k, 11);
    // Members: sequences {0, 1} and {2, 3} of the same pages.
    const PagedAttnParams& p = whole.params();
    const AttnParams& a = p.attn;
    const int64_t elem = DTypeSize(a.dtype);
    const int64_t q_row = int64_t{a.num_heads_q} * a.head_dim * elem;
    const int64_t o_row = int64_t{a.num_heads_q} * HeadDimV(a) * elem;
    const int64_t k_row = int64_t{a.num_heads_kv} * a.head_dim * elem;
    const int64_t v_row = int64_t{a.num_heads_kv} * HeadDimV(a) * elem;
    struct Member {
      PagedAttnParams p;
      std::vector<int32_t> cu_q, cu_k;
      std::vector<uint8_t> o;
      std::vector<float> lse;
    };
    std::vector<Member> members(2);
    for (int m = 0; m < 2; ++m) {
      Member& x = members[m];
      const int first = 2 * m;
      const int32_t q0 = a.cu_seqlens_q[first], k0 = a.cu_seqlens_k[first];
      for (int b = first; b <= first + 2; ++b) {
        x.cu_q.push_back(a.cu_seqlens_q[b] - q0);
        x.cu_k.push_back(a.cu_seqlens_k[b] - k0);
      }
      x.p = p;
      x.p.attn.batch = 2;
      x.p.attn.total_q = x.cu_q.back();
      x.p.attn.total_k = x.cu_k.back();
      x.p.attn.cu_seqlens_q = x.cu_q.data();
      x.p.attn.cu_seqlens_k = x.cu_k.data();
      x.p.attn.q = static_cast<const char*>(a.q) + q0 * q_row;
      x.p.attn.k = static_cast<const char*>(a.k) + k0 * k_row;
      x.p.attn.v = v_in_k ? nullptr : static_cast<const char*>(a.v) + k0 * v_row;
      x.o.assign(size_t(x.p.attn.total_q * o_row), 0xFF);
      x.lse.assign(size_t(x.p.attn.total_q * a.num_heads_q), std::nanf(""));
      x.p.attn.o = x.o.data();
      x.p.attn.lse = x.lse.data();
      x.p.block_table = p.block_table + int64_t{first} * p.block_table_stride;
      x.p.seqlens_k = p.seqlens_k + first;
      x.p.attn.seqlen_k = std::max(p.seqlens_k[first], p.seqlens_k[first + 1]);
    }
    ASSERT_TRUE(CanSharePagedLaunch(members[0].p, members[1].p));
    const PagedBatch batch({&members[0].p, &members[1].p});
    EXPECT_EQ(batch.v_new_bytes(), v_in_k ? 0 : a.total_k * v_row);
    EXPECT_EQ(batch.o_bytes(), a.total_q * o_row);
    const absl::StatusOr<Plan> plan = Backend().CanImplementPaged(members[0].p);
    ASSERT_TRUE(plan.ok()) << plan.status();
    absl::StatusOr<std::unique_ptr<PendingLaunch>> launch =
        Backend().StartPagedForward(*plan, batch);
    ASSERT_TRUE(launch.ok()) << launch.status();
    BackendTimings timings;
    ASSERT_TRUE((*launch)->Finish(&timings).ok());
    // The members' outputs side by side are the whole call's layout.
    std::vector<uint8_t> o(members[0].o);
    o.insert(o.end(), members[1].o.begin(), members[1].o.end());
    // LSE: [Hq, Tq] per member; the whole call's is [Hq, Tq_total].
    std::vector<float> lse(size_t(a.total_q * a.num_heads_q));
    const int64_t tq0 = members[0].p.attn.total_q, tq1 = members[1].p.attn.total_q;
    for (int h = 0; h < a.num_heads_q; ++h) {
      std::copy_n(members[0].lse.data() + h * tq0, tq0, lse.data() + h * a.total_q);
      std::copy_n(members[1].lse.data() + h * tq1, tq1, lse.data() + h * a.total_q + tq0);
    }
    EXPECT_TRUE(CheckOutput(buf, o.data(), lse.data()));
  }
}

// What a backend without MLA paged kernels refuses (UNIMPLEMENTED), and what
// no backend takes (INVALID_ARGUMENT), each naming the field.
TEST(PagedMlaCheckTest, Refusals) {
  MlaPagedSpec s{DType::kBF16, 576, 512, 16, 1, {1}, {40}, 1, 16, true, false, ""};
  HostBuffers buf(CaseOf(s));
  MlaPagedCase paged(buf, 16, 1, true, 3);
  PagedModSupport cpu;
  cpu.alibi_slopes = cpu.sinks = cpu.mla = true;
  EXPECT_TRUE(CheckPagedParams(paged.params(), cpu).ok());

  absl::Status st = CheckPagedParams(paged.params());  // CUDA's support: no MLA
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_NE(std::string(st.message()).find("head_dim_v expected 0 or head_dim 576"),
            std::string::npos)
      << st;
  EXPECT_NE(std::string(st.message()).find("got head_dim_v 512, v_in_k true"), std::string::npos)
      << st;

  PagedAttnParams wide = paged.params();  // V wider than the K row it lives in
  wide.attn.head_dim = 256;
  wide.attn.head_dim_v = 512;
  st = CheckPagedParams(wide, cpu);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("head_dim_v expected <= head_dim 256"),
            std::string::npos)
      << st;

  PagedAttnParams bad_dv = paged.params();
  bad_dv.attn.head_dim_v = 12;
  st = CheckPagedParams(bad_dv, cpu);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("head_dim_v: expected"), std::string::npos) << st;
}

// An FP8 absorbed cache: K codes with one scale per (token, head), V read from
// the same codes and scales; a V scale is refused (there is no V row).
TEST(PagedMlaCheckTest, Fp8VInKTakesKScalesAlone) {
  MlaPagedSpec s{DType::kBF16, 576, 512, 16, 1, {1}, {40}, 1, 16, true, false, ""};
  HostBuffers buf(CaseOf(s));
  MlaPagedCase paged(buf, 16, 1, true, 3);
  PagedModSupport cpu;
  cpu.mla = true;
  PagedAttnParams p = paged.params();
  p.pages.fp8_e4m3 = true;
  const std::vector<float> scales(size_t(p.attn.total_k * p.attn.num_heads_kv), 0.5f);
  p.k_new_scale = scales.data();
  EXPECT_TRUE(CheckPagedParams(p, cpu).ok()) << CheckPagedParams(p, cpu);
  p.v_new_scale = scales.data();
  const absl::Status st = CheckPagedParams(p, cpu);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("k_new_scale alone with pages.v_in_k"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace attnserve
