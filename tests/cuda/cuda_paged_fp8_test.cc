// The FP8 cache's decode kernel (backend/cuda/paged_attn_fp8_decode.cuh)
// through the backend: contexts long enough to split (the combine, with and
// without sinks), packed rows of 4, 8 and 16 (both row tiles), short query
// runs with causal and window masks, softcap and ALiBi, D 64 and 128, pages
// poisoned past every sequence (NaN codes and scales), each output against the
// float64 reference over the dequantised cache (Fp8PagedCase::CheckOutput).
// And batch invariance: each sequence alone gives the bytes it got packed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/paged_kv.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/backend/paged_fp8_case.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/device_slabs.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

struct Case {
  TestCase tc;
  int page_size;
  int new_rows;
  bool expect_split;  // the plan splits on any GPU of >= 16 SMs
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.tc.Name() << " page " << c.page_size << " new " << c.new_rows;
}

TestCase Decode(DType t, int hq, int hkv, int d, std::vector<int> seqlens_k) {
  TestCase tc;
  tc.dtype = t;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.seqlens_k = std::move(seqlens_k);
  tc.seqlens_q.assign(tc.seqlens_k.size(), 1);
  tc.causal = true;
  return tc;
}

std::vector<Case> Grid() {
  std::vector<Case> grid;
  // Long contexts over few CTAs: splits and their combine; a 1-token one.
  grid.push_back({Decode(DType::kBF16, 8, 2, 128, {3000, 1, 1500, 2049}), 64, 1, true});
  TestCase sinks = Decode(DType::kFP16, 8, 2, 128, {2500, 700});
  sinks.mods.sinks = true;
  grid.push_back({sinks, 16, 1, true});
  // 16 packed rows (two row tiles), D 64, pages of 256.
  grid.push_back({Decode(DType::kFP16, 16, 1, 64, {900, 33, 257}), 256, 1, false});
  // 16 rows at D 128 (a GQA group of 16), pages of 16, split.
  grid.push_back({Decode(DType::kBF16, 32, 2, 128, {2600, 40}), 16, 1, true});
  // 8 rows: 2 queries x 4 heads, causal, a window, 2 new tokens each.
  TestCase spec = Decode(DType::kBF16, 8, 2, 128, {1200, 130, 2});
  spec.seqlens_q = {2, 2, 2};
  spec.window_left = 300;
  grid.push_back({spec, 32, 2, false});
  // Softcap and ALiBi (the per-element path), one query row per KV head.
  TestCase mods = Decode(DType::kBF16, 4, 4, 128, {1000, 77});
  mods.softcap = 15.0f;
  mods.mods.alibi = true;
  grid.push_back({mods, 64, 1, false});
  // No LSE asked for, attend only.
  TestCase plain = Decode(DType::kBF16, 32, 8, 128, {640, 64});
  plain.return_lse = false;
  grid.push_back({plain, 64, 0, false});
  // D 64 split: the combine's 64-column form.
  grid.push_back({Decode(DType::kFP16, 8, 2, 64, {3000, 1700}), 64, 1, true});
  return grid;
}

class CudaPagedFp8DecodeTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing_util::SharedCudaBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaPagedFp8DecodeTest, DecodeKernelPassesTheReference) {
  const Case& c = GetParam();
  HostBuffers buf(c.tc);
  testing_util::Fp8PagedCase paged(buf, c.page_size, c.new_rows, false, false, 5);
  testing_util::DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(),
                                  &paged.v_slabs());
  ASSERT_TRUE(slabs.status().ok()) << slabs.status();
  PagedAttnParams p = paged.params();
  p.pages = slabs.pages();
  absl::StatusOr<Plan> plan = backend_->CanImplementPaged(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The decode kernel, not the SIMT one, and split where the case says.
  EXPECT_EQ(plan->kernel_head_dim, c.tc.head_dim);
  EXPECT_EQ(plan->tile_kind, TileKind::kDecode);
  if (c.expect_split) {
    EXPECT_GT(plan->num_splits, 1);
  }
  BackendTimings t;
  const absl::Status run = backend_->PagedForward(*plan, p, &t);
  ASSERT_TRUE(run.ok()) << run;
  slabs.CopyBack();
  EXPECT_EQ(paged.CheckPages(), "");
  EXPECT_EQ(paged.CheckOutput(paged.o(), paged.lse()), "");
}

INSTANTIATE_TEST_SUITE_P(Fp8Decode, CudaPagedFp8DecodeTest, ::testing::ValuesIn(Grid()));

// Batch-invariant mode: every sequence run alone gives the O bytes it got in
// the packed launch (lengths 1 to 5000, so the packed launch's split count
// is not any single sequence's), and the packed O passes the reference.
TEST_F(CudaPagedFp8DecodeTest, BatchInvariantAloneEqualsPacked) {
  TestCase tc = Decode(DType::kBF16, 16, 4, 128, {5000, 1, 700, 2300});
  tc.return_lse = false;
  HostBuffers buf(tc);
  testing_util::Fp8PagedCase paged(buf, 64, 0, false, false, 3);
  testing_util::DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(),
                                  &paged.v_slabs());
  ASSERT_TRUE(slabs.status().ok()) << slabs.status();
  PagedAttnParams all = paged.params();
  all.pages = slabs.pages();
  all.attn.batch_invariant = true;
  absl::StatusOr<Plan> plan = backend_->CanImplementPaged(all);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->kernel_head_dim, 128);
  BackendTimings t;
  ASSERT_TRUE(backend_->PagedForward(*plan, all, &t).ok());
  EXPECT_EQ(paged.CheckOutput(paged.o(), nullptr), "");
  const AttnParams& a = all.attn;
  const int64_t row_bytes = int64_t{a.num_heads_q} * a.head_dim * 2;
  const std::vector<uint8_t> packed(static_cast<const uint8_t*>(a.o),
                                    static_cast<const uint8_t*>(a.o) + a.total_q * row_bytes);
  int splits_seen = 0;
  for (int b = 0; b < a.batch; ++b) {
    PagedAttnParams one = all;
    std::vector<uint8_t> o(size_t(row_bytes), 0xFF);
    const int32_t q0 = a.cu_seqlens_q[b];
    const int32_t cu_q[2] = {0, a.cu_seqlens_q[b + 1] - q0};
    const int32_t cu_k[2] = {0, 0};
    one.attn.batch = 1;
    one.attn.q = static_cast<const uint8_t*>(a.q) + q0 * row_bytes;
    one.attn.o = o.data();
    one.attn.cu_seqlens_q = cu_q;
    one.attn.cu_seqlens_k = cu_k;
    one.attn.total_q = cu_q[1];
    one.attn.total_k = 0;
    one.attn.seqlen_q = cu_q[1];
    one.attn.seqlen_k = all.seqlens_k[b];
    one.block_table = all.block_table + int64_t{b} * all.block_table_stride;
    one.seqlens_k = all.seqlens_k + b;
    one.num_page_copies = 0;
    absl::StatusOr<Plan> p1 = backend_->CanImplementPaged(one);
    ASSERT_TRUE(p1.ok()) << p1.status();
    splits_seen = std::max(splits_seen, p1->num_splits);
    ASSERT_TRUE(backend_->PagedForward(*p1, one, &t).ok());
    EXPECT_EQ(std::memcmp(o.data(), packed.data() + q0 * row_bytes, size_t(row_bytes)), 0)
        << "sequence " << b << " (" << all.seqlens_k[b] << " keys) alone differs from packed";
  }
  // The packed launch split (the longest sequence's count), the alone ones fewer.
  EXPECT_GT(plan->num_splits, 1);
  EXPECT_LE(splits_seen, plan->num_splits);
}

}  // namespace
}  // namespace attnserve
