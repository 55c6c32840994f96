// The CUDA absorbed-MLA paged path (backend/cuda/paged_mla.h): one 576-wide
// K/V head whose first 512 dims are V (pages.v_in_k), 16..128 query heads,
// decode and short causal query runs, BF16 and FP16, page sizes 16 and 64,
// splits of long contexts, softcap, windows, ALiBi, sinks, empty sequences
// and fully masked rows, batch-invariant launches, copy-on-write of partial
// pages; each through the backend's append-and-attend (the K-only page
// copies and append, then the kernel) against the float64 reference over
// the whole context. MLA shapes the kernel does
// not take stay UNIMPLEMENTED naming head_dim_v. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/backend/paged_mla_case.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/device_slabs.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::DeviceSlabs;
using testing_util::HostBuffers;
using testing_util::MlaPagedCase;
using testing_util::TestCase;

struct Spec {
  std::string name;
  DType dtype;
  int hq;
  std::vector<int> q, k;  // per sequence: new queries, keys after the append
  int new_rows;
  int page_size;
  bool causal = false;
  int window_left = kNoWindow;
  float softcap = 0.0f;
  bool alibi = false;
  bool sinks = false;
  bool invariant = false;
  bool cow = false;
};

void PrintTo(const Spec& s, std::ostream* os) { *os << s.name; }

std::vector<Spec> Grid() {
  std::vector<Spec> g;
  for (int hq : {16, 32, 64, 128}) {
    // 2100 keys: enough tiles that the planner splits (few CTAs).
    g.push_back({"decode_bf16_h" + std::to_string(hq),
                 DType::kBF16,
                 hq,
                 {1, 1, 1, 1},
                 {300, 17, 64, 2100},
                 1,
                 64});
  }
  g.push_back({"decode_fp16_h32", DType::kFP16, 32, {1, 2}, {1, 1500}, 1, 16});
  g.push_back({"decode_bf16_h40_page16", DType::kBF16, 40, {1, 1, 1}, {33, 1000, 5}, 1, 16});
  // Short causal runs (speculative / chunked): rows = tokens x heads over
  // several row blocks; a sequence with no queries, one with no keys.
  g.push_back({"chunk_causal_h16", DType::kBF16, 16, {9, 0, 40, 3}, {90, 7, 40, 700}, 9, 16, true});
  g.push_back({"chunk_causal_h128", DType::kBF16, 128, {2, 4}, {129, 1000}, 4, 64, true});
  g.push_back({"empty_sequences", DType::kBF16, 16, {1, 0, 1}, {0, 0, 50}, 1, 16});
  // More queries than keys, causal: the first rows see no key (O 0, LSE -inf).
  g.push_back({"fully_masked_rows", DType::kBF16, 16, {5, 1}, {3, 40}, 3, 16, true});
  g.push_back({"window_softcap", DType::kBF16, 64, {1, 3}, {3000, 500}, 3, 64, true, 700, 30.0f});
  g.push_back({"alibi_sinks",
               DType::kBF16,
               32,
               {1, 1},
               {2500, 70},
               1,
               64,
               false,
               kNoWindow,
               0.0f,
               true,
               true});
  g.push_back({"sinks_no_split",
               DType::kFP16,
               16,
               {1, 0},
               {40, 0},
               1,
               16,
               false,
               kNoWindow,
               0.0f,
               false,
               true});
  g.push_back({"batch_invariant",
               DType::kBF16,
               64,
               {1, 1, 2},
               {9000, 100, 4000},
               2,
               64,
               true,
               kNoWindow,
               0.0f,
               false,
               true,
               true});
  // Copy-on-write of each sequence's partial last page (K slabs alone).
  g.push_back({"cow_decode_bf16_h16",
               DType::kBF16,
               16,
               {1, 2, 1},
               {70, 1000, 16},
               2,
               16,
               false,
               kNoWindow,
               0.0f,
               false,
               false,
               false,
               true});
  return g;
}

TestCase CaseOf(const Spec& s) {
  TestCase tc;
  tc.dtype = s.dtype;
  tc.head_dim = 576;
  tc.head_dim_v = 512;
  tc.num_heads_q = s.hq;
  tc.num_heads_kv = 1;
  tc.seqlens_q = s.q;
  tc.seqlens_k = s.k;
  tc.causal = s.causal;
  tc.window_left = s.window_left;
  tc.softcap = s.softcap;
  tc.softmax_scale = 1.0f / std::sqrt(192.0f);  // the absorbed form's usual scale
  tc.mods.alibi = s.alibi;
  tc.mods.sinks = s.sinks;
  return tc;
}

class CudaPagedMlaTest : public ::testing::TestWithParam<Spec> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing_util::SharedCudaBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaPagedMlaTest, MatchesReference) {
  const Spec& s = GetParam();
  HostBuffers buf(CaseOf(s));
  MlaPagedCase paged(buf, s.page_size, s.new_rows, true, 7, s.cow);
  DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(), &paged.v_slabs());
  ASSERT_TRUE(slabs.status().ok()) << slabs.status();
  PagedAttnParams p = paged.params();
  p.pages = slabs.pages();
  ASSERT_EQ(p.num_page_copies > 0, s.cow);
  p.attn.batch_invariant = s.invariant;
  const absl::StatusOr<Plan> plan = backend_->CanImplementPaged(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const absl::Status st = backend_->PagedForward(*plan, p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse())) << "splits " << plan->num_splits;
  // Attend again over the same pages (nothing new): same answer, so the
  // append wrote every row the kernel reads and nothing else.
  PagedAttnParams again = p;
  std::vector<int32_t> cu_zero(size_t(again.attn.batch) + 1, 0);
  again.attn.cu_seqlens_k = cu_zero.data();
  again.attn.total_k = 0;
  again.num_page_copies = 0;
  paged.Poison();
  const absl::StatusOr<Plan> plan2 = backend_->CanImplementPaged(again);
  ASSERT_TRUE(plan2.ok()) << plan2.status();
  ASSERT_TRUE(backend_->PagedForward(*plan2, again, nullptr).ok());
  EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse()));
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaPagedMlaTest, ::testing::ValuesIn(Grid()),
                         [](const ::testing::TestParamInfo<Spec>& info) {
                           return info.param.name;
                         });

// Batch-invariant launches: a sequence's output bytes alone equal its bytes
// inside a batch with longer and shorter sequences.
TEST_F(CudaPagedMlaTest, BatchInvariantAloneEqualsPacked) {
  Spec whole{"", DType::kBF16, 32, {1, 1, 1}, {5000, 300, 12000}, 1, 64};
  Spec alone{"", DType::kBF16, 32, {1}, {5000}, 1, 64};
  std::vector<uint8_t> outs[2];
  HostBuffers buf_whole(CaseOf(whole));
  TestCase tc_alone = CaseOf(alone);
  HostBuffers buf_alone(tc_alone);
  // The lone sequence's q and K: the whole case's first sequence.
  const int64_t elem = 2;
  // (HostBuffers offers q read-only; its storage is not const.)
  std::memcpy(const_cast<void*>(buf_alone.q()), buf_whole.q(), size_t(32 * 576 * elem));
  std::memcpy(buf_alone.k(), buf_whole.k(), size_t(5000 * 576 * elem));
  HostBuffers* bufs[2] = {&buf_whole, &buf_alone};
  for (int i = 0; i < 2; ++i) {
    MlaPagedCase paged(*bufs[i], 64, 1, true, 5);
    DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(), &paged.v_slabs());
    ASSERT_TRUE(slabs.status().ok()) << slabs.status();
    PagedAttnParams p = paged.params();
    p.pages = slabs.pages();
    p.attn.batch_invariant = true;
    const absl::StatusOr<Plan> plan = backend_->CanImplementPaged(p);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(backend_->PagedForward(*plan, p, nullptr).ok());
    EXPECT_TRUE(CheckOutput(*bufs[i], paged.o(), paged.lse()));
    const uint8_t* o = static_cast<const uint8_t*>(paged.o());
    outs[i].assign(o, o + 32 * 512 * elem);  // the first sequence's row
  }
  EXPECT_EQ(outs[0], outs[1]);
}

// What the CUDA backend still refuses, naming the field: V pages of their
// own at Dv != D, V inside K at other dims, several K/V heads, FP32.
TEST_F(CudaPagedMlaTest, OtherMlaShapesAreUnimplemented) {
  struct Bad {
    int d, dv, hkv;
    DType dtype;
    bool v_in_k;
  };
  for (const Bad& bad :
       {Bad{192, 128, 1, DType::kBF16, false}, Bad{256, 128, 1, DType::kBF16, true},
        Bad{576, 512, 2, DType::kBF16, true}, Bad{576, 512, 1, DType::kFP32, true}}) {
    TestCase tc;
    tc.dtype = bad.dtype;
    tc.head_dim = bad.d;
    tc.head_dim_v = bad.dv;
    tc.num_heads_q = 16;
    tc.num_heads_kv = bad.hkv;
    tc.seqlens_q = {1};
    tc.seqlens_k = {1};
    HostBuffers buf(tc);
    PagedAttnParams p{};
    p.attn = buf.params();
    p.pages.page_size = 16;
    p.pages.page_shift = 4;
    p.pages.num_slabs = 1;
    p.pages.v_in_k = bad.v_in_k;
    const int32_t table[1] = {0};
    const int32_t seqlens[1] = {1};
    p.block_table = table;
    p.block_table_stride = 1;
    p.seqlens_k = seqlens;
    const absl::Status s = backend_->CanImplementPaged(p).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_NE(std::string(s.message()).find("head_dim_v"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace attnserve
