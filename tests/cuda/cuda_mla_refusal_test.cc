// What the CUDA backend still refuses of MLA shapes (a V head dim differing
// from Q's and K's, params.h head_dim_v), as UNIMPLEMENTED naming head_dim_v,
// never launched: dims no compiled pair covers (576/512 on the request's
// own K/V, 256/128, 192/136), FP32 and FP8 inputs, and a paged call whose V
// pages have their own head dim (the portable pairs read the request's
// tensors only). FP16/BF16 192/128 plans on the portable kernel
// (cuda_mla_prefill_test runs it); equal dims still plan as before.
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
  for (auto [d, dv] : {std::pair<int, int>{576, 512}, {256, 128}, {192, 136}}) {
    HostBuffers buf(Mla(d, dv));
    const absl::Status s = backend->CanImplement(buf.params()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_NE(std::string(s.message()).find("head_dim_v"), std::string::npos) << s;
  }
  for (DType t : {DType::kFP32, DType::kFP8E4M3}) {
    TestCase tc = Mla(192, 128);
    tc.dtype = t;
    HostBuffers buf(tc);
    const absl::Status s = backend->CanImplement(buf.params()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_NE(std::string(s.message()).find("head_dim_v"), std::string::npos) << s;
  }
  // The pair the portable kernel compiles (the dev set too), FP16 and BF16.
  for (DType t : {DType::kBF16, DType::kFP16}) {
    TestCase tc = Mla(192, 128);
    tc.dtype = t;
    HostBuffers mla(tc);
    const absl::StatusOr<Plan> plan = backend->CanImplement(mla.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel_family, KernelFamily::kPortable);
    EXPECT_EQ(plan->kernel_head_dim, 192);
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
  // V pages of their own head dim (192/128): no paged kernel reads them.
  TestCase tc = Mla(192, 128);
  tc.seqlens_q = {1};
  tc.seqlens_k = {1};
  HostBuffers buf(tc);
  PagedAttnParams p{};
  p.attn = buf.params();
  p.pages.page_size = 16;
  p.pages.page_shift = 4;
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
