// The CUDA backend has no kernel for MLA shapes yet: a call whose V head dim
// differs from Q's and K's (params.h head_dim_v), and a paged call over a
// cache with V pages of Dv or V inside K's pages (paged_kv.h v_in_k), are
// UNIMPLEMENTED naming head_dim_v, never launched; equal dims still plan.
// Without a GPU each test calls GTEST_SKIP with the reason.
#include <string>
#include <utility>

#include "backend/backend.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

TestCase Mla(int d, int dv) {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.head_dim = d;
  tc.head_dim_v = dv;
  tc.num_heads_q = 16;
  tc.num_heads_kv = 1;
  tc.seqlen_q = 1;
  tc.seqlen_k = 64;
  return tc;
}

TEST(CudaMlaRefusalTest, DistinctValueHeadDimIsUnimplemented) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (auto [d, dv] : {std::pair<int, int>{192, 128}, {576, 512}, {128, 64}}) {
    HostBuffers buf(Mla(d, dv));
    const absl::Status s = backend->CanImplement(buf.params()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_NE(std::string(s.message()).find("head_dim_v"), std::string::npos) << s;
  }
  HostBuffers plain(Mla(128, 0));
  // D 128 is in every kernel set (ATTNSERVE_CUDA_KERNELS=dev too).
  const absl::StatusOr<Plan> ok = backend->CanImplement(plain.params());
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(CudaMlaRefusalTest, PagedValueHeadDimIsUnimplemented) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  TestCase tc = Mla(576, 512);
  tc.seqlens_q = {1};
  tc.seqlens_k = {1};
  HostBuffers buf(tc);
  PagedAttnParams p{};
  p.attn = buf.params();
  p.pages.page_size = 16;
  p.pages.page_shift = 4;
  p.pages.v_in_k = true;
  const int32_t table[1] = {0};
  const int32_t seqlens[1] = {1};
  p.block_table = table;
  p.block_table_stride = 1;
  p.seqlens_k = seqlens;
  const absl::Status s = backend->CanImplementPaged(p).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(std::string(s.message()).find("head_dim_v"), std::string::npos) << s;
}

}  // namespace
}  // namespace attnserve
