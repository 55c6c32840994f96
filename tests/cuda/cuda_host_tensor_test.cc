// CudaBackend::AllocateHostTensor hands out page-locked memory (small
// tensors: heap memory), and a paged launch whose q, k, v and o lie there
// (the staged launch copies them to and from the device where they lie,
// without the pinned staging buffer) gives bit for bit the O of the same
// launch over heap memory, which passes the float64 reference. Without a
// GPU every test is SKIPPED.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/paged_batch.h"
#include "backend/paged_kv.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;
constexpr auto SharedBackend = testing_util::SharedCudaBackend;

bool PageLocked(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

TEST(CudaHostTensor, LargeBlocksArePageLockedAndReused) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  std::shared_ptr<char> big = backend->AllocateHostTensor(512 << 10);
  ASSERT_NE(big, nullptr);
  EXPECT_TRUE(PageLocked(big.get()));
  std::memset(big.get(), 1, 512 << 10);  // all of it is there
  std::shared_ptr<char> small = backend->AllocateHostTensor(100);
  ASSERT_NE(small, nullptr);
  EXPECT_FALSE(PageLocked(small.get()));
  const char* at = big.get();
  big.reset();
  // The block went back to the pool: the next one of its size is it.
  std::shared_ptr<char> again = backend->AllocateHostTensor(300 << 10);
  EXPECT_EQ(again.get(), at);
}

// One append-and-attend launch of 16 sequences (all rows new, one query
// each) into a fresh cache, its q, k, v and o in `memory`'s buffers.
std::vector<uint8_t> RunStep(AttentionBackend* backend, const HostBuffers& buf,
                             const std::function<std::shared_ptr<char>(int64_t)>& memory,
                             std::vector<float>* lse_out) {
  const AttnParams& full = buf.params();
  const int B = full.batch;
  const int ps = 16;
  const int64_t row_bytes = int64_t{full.num_heads_kv} * full.head_dim * DTypeSize(full.dtype);
  std::vector<int32_t> len(B);
  int stride = 1;
  for (int b = 0; b < B; ++b) {
    len[b] = full.cu_seqlens_k[b + 1] - full.cu_seqlens_k[b];
    stride = std::max(stride, (len[b] + ps - 1) / ps);
  }
  const int64_t pages = int64_t{B} * stride;
  int slab_shift = 0;
  while ((int64_t{1} << slab_shift) < pages) ++slab_shift;
  const int64_t slab_bytes = (int64_t{1} << slab_shift) * ps * row_bytes;
  KvPages kv{};
  kv.num_slabs = 1;
  kv.slab_shift = slab_shift;
  kv.page_size = ps;
  kv.page_shift = 4;
  absl::StatusOr<void*> k_slab = backend->AllocateKvMemory(slab_bytes);
  absl::StatusOr<void*> v_slab = backend->AllocateKvMemory(slab_bytes);
  EXPECT_TRUE(k_slab.ok() && v_slab.ok());
  if (!k_slab.ok() || !v_slab.ok()) return {};
  kv.k_slabs[0] = *k_slab;
  kv.v_slabs[0] = *v_slab;
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);

  auto place = [&](const void* src, int64_t bytes) {
    std::shared_ptr<char> p = memory(bytes);
    std::memcpy(p.get(), src, static_cast<size_t>(bytes));
    return p;
  };
  const int64_t q_bytes = int64_t{full.total_q} * full.num_heads_q * full.head_dim * 2;
  const int64_t kv_bytes = int64_t{full.total_k} * row_bytes;
  std::shared_ptr<char> q = place(full.q, q_bytes);
  std::shared_ptr<char> k = place(full.k, kv_bytes);
  std::shared_ptr<char> v = place(full.v, kv_bytes);
  std::shared_ptr<char> o = memory(buf.o_bytes());
  std::memset(o.get(), 0xff, static_cast<size_t>(buf.o_bytes()));  // NaN
  lse_out->assign(static_cast<size_t>(buf.lse_elements()), std::nanf(""));

  PagedAttnParams p;
  std::memset(&p, 0, sizeof(p));
  p.attn = full;
  p.attn.q = q.get();
  p.attn.k = k.get();
  p.attn.v = v.get();
  p.attn.o = o.get();
  p.attn.lse = full.lse != nullptr ? lse_out->data() : nullptr;
  p.pages = kv;
  p.block_table = table.data();
  p.block_table_stride = stride;
  p.seqlens_k = len.data();
  const absl::Status st = PlanAndPagedForward(*backend, p, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  backend->FreeKvMemory(kv.k_slabs[0]);
  backend->FreeKvMemory(kv.v_slabs[0]);
  const char* out = o.get();
  return std::vector<uint8_t>(out, out + buf.o_bytes());
}

TEST(CudaHostTensor, PagedStepFromPageLockedTensorsMatchesHeap) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.num_heads_q = 16;  // q and o: 16 rows of 4 KiB, over the direct-copy size
  tc.num_heads_kv = 2;
  tc.head_dim = 128;
  tc.seqlens_q.assign(16, 1);
  tc.seqlens_k = {20, 1, 33, 64, 7, 16, 17, 40, 5, 31, 32, 9, 48, 2, 60, 25};
  HostBuffers buf(tc);
  auto heap = [](int64_t n) {
    return std::shared_ptr<char>(new char[size_t(n)], std::default_delete<char[]>());
  };
  auto pinned = [backend](int64_t n) {
    std::shared_ptr<char> p = backend->AllocateHostTensor(n);
    EXPECT_TRUE(PageLocked(p.get())) << n << " bytes";
    return p;
  };
  std::vector<float> lse_heap, lse_pinned;
  const std::vector<uint8_t> o_heap = RunStep(backend, buf, heap, &lse_heap);
  const std::vector<uint8_t> o_pinned = RunStep(backend, buf, pinned, &lse_pinned);
  ASSERT_EQ(o_heap.size(), size_t(buf.o_bytes()));
  ASSERT_EQ(o_pinned.size(), o_heap.size());
  EXPECT_TRUE(
      CheckOutput(buf, o_heap.data(), buf.params().lse != nullptr ? lse_heap.data() : nullptr));
  EXPECT_EQ(std::memcmp(o_pinned.data(), o_heap.data(), o_heap.size()), 0)
      << "O written straight into page-locked memory differs from the staged one";
  EXPECT_EQ(std::memcmp(lse_pinned.data(), lse_heap.data(), lse_heap.size() * 4), 0);
}

}  // namespace
}  // namespace attnserve
