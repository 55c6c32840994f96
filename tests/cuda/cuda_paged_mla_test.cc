// The CUDA absorbed-MLA paged path (backend/cuda/paged_mla.h): one 576-wide
// K/V head whose first 512 dims are V (pages.v_in_k), 16..128 query heads,
// decode and short causal query runs, BF16 and FP16, page sizes 16 and 64,
// splits of long contexts, softcap, windows, ALiBi, sinks, empty sequences
// and fully masked rows, batch-invariant launches, copy-on-write of partial
// pages; each through the backend's append-and-attend (the K-only page
// copies and append, then the kernel) against the float64 reference over
// the whole context. MLA shapes the kernel does
// not take stay UNIMPLEMENTED naming head_dim_v. Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

// A case's varlen inputs as a paged launch over device slabs: each
// sequence's last `new_rows` K rows arrive with the launch (the append
// writes them), the rest are copied into shuffled pages beforehand. buf's V
// is first made the first Dv elements of its K, what the cache reads. cow: a
// sequence's partial last page of old rows lies in a page outside its table
// (a shared one), which the launch copies (copy-on-write) to the table's,
// left poisoned, before the append.
class MlaDeviceCase {
 public:
  MlaDeviceCase(AttentionBackend* backend, HostBuffers& buf, int page_size, int new_rows,
                uint32_t seed, bool cow = false)
      : backend_(backend) {
    const AttnParams& a = buf.params();
    const int d = a.head_dim;
    const int dv = HeadDimV(a);
    const int64_t elem = DTypeSize(a.dtype);
    const int64_t k_row = int64_t{a.num_heads_kv} * d * elem;
    for (int64_t r = 0; r < a.total_k * a.num_heads_kv; ++r) {
      std::memcpy(static_cast<char*>(buf.v()) + r * dv * elem,
                  static_cast<const char*>(buf.k()) + r * d * elem, size_t(dv * elem));
    }
    int page_shift = 0;
    while ((1 << page_shift) < page_size) ++page_shift;
    const int batch = a.batch;
    int stride = 1;
    int64_t pages_needed = 0;
    for (int b = 0; b < batch; ++b) {
      const int pages = (SeqLenK(a, b) + page_size - 1) / page_size;
      stride = std::max(stride, pages);
      pages_needed += pages;
    }
    // Slabs of 2^slab_shift pages, so a sequence spans several slabs.
    int slab_shift = 2;
    while ((pages_needed + (int64_t{1} << slab_shift) - 1) / (int64_t{1} << slab_shift) + 1 >
           kMaxKvSlabs) {
      ++slab_shift;
    }
    const int per_slab = 1 << slab_shift;
    const int num_slabs = static_cast<int>((pages_needed + per_slab - 1) / per_slab) + 1;
    KvPages& kv = params_.pages;
    kv = KvPages{};
    kv.num_slabs = num_slabs;
    kv.slab_shift = slab_shift;
    kv.page_size = page_size;
    kv.page_shift = page_shift;
    kv.v_in_k = true;
    const int64_t slab_bytes = int64_t{per_slab} * page_size * k_row;
    // Poisoned: NaN in every dtype, so a read of an unwritten row shows.
    std::vector<std::vector<uint8_t>> host(num_slabs,
                                           std::vector<uint8_t>(size_t(slab_bytes), 0xFF));
    std::mt19937 rng(seed);
    std::vector<int32_t> free_pages(size_t(num_slabs) * per_slab);
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    table_.assign(size_t(batch) * stride, -1);
    cu_new_.push_back(0);
    const char* k = static_cast<const char*>(a.k);
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      const int added = std::min(new_rows, len);
      seqlens_.push_back(len);
      for (int i = 0; i < (len + page_size - 1) / page_size; ++i) {
        table_[size_t(b) * stride + i] = free_pages.back();
        free_pages.pop_back();
      }
      const int64_t k0 = SeqStartK(a, b);
      const int old_rows = len - added;
      int32_t shared = -1;
      if (cow && old_rows % page_size != 0) {
        shared = free_pages.back();
        free_pages.pop_back();
        copy_src_.push_back(shared);
        copy_dst_.push_back(table_[size_t(b) * stride + old_rows / page_size]);
      }
      for (int r = 0; r < old_rows; ++r) {
        const int32_t page = shared >= 0 && r / page_size == old_rows / page_size
                                 ? shared
                                 : table_[size_t(b) * stride + r / page_size];
        std::memcpy(host[PageSlab(kv, page)].data() +
                        PageRowOffset(kv, page, r % page_size, a.num_heads_kv, d, 0) * elem,
                    k + (k0 + r) * k_row, size_t(k_row));
      }
      const int64_t first = k0 + len - added;
      k_new_.insert(k_new_.end(), k + first * k_row, k + (first + added) * k_row);
      cu_new_.push_back(cu_new_.back() + added);
    }
    for (int s = 0; s < num_slabs; ++s) {
      absl::StatusOr<void*> m = backend->AllocateKvMemory(slab_bytes);
      status_.Update(m.status());
      if (!m.ok()) return;
      kv.k_slabs[s] = *m;
      status_.Update(backend->CopyToKvMemory(*m, host[s].data(), slab_bytes));
    }
    o_.assign(size_t(buf.o_bytes()), 0xFF);
    lse_.assign(size_t(std::max<int64_t>(buf.lse_elements(), 1)), std::nanf(""));
    params_.attn = a;
    params_.attn.k = k_new_.data();
    params_.attn.v = nullptr;  // V lives in K's pages
    params_.attn.o = o_.data();
    params_.attn.lse = a.lse != nullptr ? lse_.data() : nullptr;
    params_.attn.cu_seqlens_k = cu_new_.data();
    params_.attn.total_k = cu_new_.back();
    params_.attn.seqlen_k = batch > 0 ? *std::max_element(seqlens_.begin(), seqlens_.end()) : 0;
    params_.block_table = table_.data();
    params_.block_table_stride = stride;
    params_.seqlens_k = seqlens_.data();
    params_.copy_src = copy_src_.data();
    params_.copy_dst = copy_dst_.data();
    params_.num_page_copies = static_cast<int32_t>(copy_src_.size());
  }
  ~MlaDeviceCase() {
    for (int s = 0; s < kMaxKvSlabs; ++s) backend_->FreeKvMemory(params_.pages.k_slabs[s]);
  }
  MlaDeviceCase(const MlaDeviceCase&) = delete;
  MlaDeviceCase& operator=(const MlaDeviceCase&) = delete;

  const absl::Status& status() const { return status_; }
  PagedAttnParams& params() { return params_; }
  const void* o() const { return o_.data(); }
  const float* lse() const { return params_.attn.lse; }
  void Poison() {
    std::fill(o_.begin(), o_.end(), uint8_t{0xFF});
    std::fill(lse_.begin(), lse_.end(), std::nanf(""));
  }

 private:
  AttentionBackend* backend_;
  absl::Status status_;
  PagedAttnParams params_{};
  std::vector<int32_t> table_, seqlens_, cu_new_, copy_src_, copy_dst_;
  std::vector<uint8_t> k_new_, o_;
  std::vector<float> lse_;
};

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
  MlaDeviceCase paged(backend_, buf, s.page_size, s.new_rows, 7, s.cow);
  ASSERT_TRUE(paged.status().ok()) << paged.status();
  ASSERT_EQ(paged.params().num_page_copies > 0, s.cow);
  paged.params().attn.batch_invariant = s.invariant;
  const absl::StatusOr<Plan> plan = backend_->CanImplementPaged(paged.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const absl::Status st = backend_->PagedForward(*plan, paged.params(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse())) << "splits " << plan->num_splits;
  // Attend again over the same pages (nothing new): same answer, so the
  // append wrote every row the kernel reads and nothing else.
  PagedAttnParams again = paged.params();
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
    MlaDeviceCase paged(backend_, *bufs[i], 64, 1, 5);
    ASSERT_TRUE(paged.status().ok()) << paged.status();
    paged.params().attn.batch_invariant = true;
    const absl::StatusOr<Plan> plan = backend_->CanImplementPaged(paged.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(backend_->PagedForward(*plan, paged.params(), nullptr).ok());
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
