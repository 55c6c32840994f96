// The paged K/V path on the CPU backend (paged_kv.h): page copies, append and
// attend through deliberately fragmented, shuffled block tables must give the
// contiguous kernel's output bit for bit and pass the float64 reference over
// the whole context; PagedBatch packing (the default StartPagedForward) must
// give what one launch gives; CheckPagedParams refuses bad tables. ALiBi and
// sinks (the per-head score modifiers) and element masks and biases (rows
// over each sequence's whole history) go through the same grid.
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/check_paged_params.h"
#include "backend/paged_batch.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

AttentionBackend& Backend() {
  static AttentionBackend* backend = MakeCpuBackend(0).release();
  return *backend;
}

// One paged launch built from a varlen TestCase: sequence b's context is its
// k/v rows in `buf`; the last new[b] of them arrive as new rows (appended by
// the launch), the rest are written into pages beforehand. Pages are spread
// over several slabs in a shuffled order; with `cow`, a sequence whose prefix
// ends inside a page gets that page as a copy source and a fresh page in its
// table (the launch must copy it before appending).
class PagedCase {
 public:
  PagedCase(const HostBuffers& buf, int page_size, const std::vector<int>& new_rows, bool cow,
            uint32_t seed)
      : buf_(buf), rng_(seed) {
    const AttnParams& a = buf.params();
    const int64_t elem = DTypeSize(a.dtype);
    row_bytes_ = int64_t{a.num_heads_kv} * a.head_dim * elem;
    int page_shift = 0;
    while ((1 << page_shift) < page_size) ++page_shift;
    const int batch = a.batch;
    int stride = 1;
    int64_t pages_needed = 0;
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      stride = std::max(stride, (len + page_size - 1) / page_size);
      pages_needed += (len + page_size - 1) / page_size + 1;  // +1: a COW source
    }
    // Small slabs so the pages are spread over several of them.
    int slab_shift = 0;
    while ((int64_t{kMaxKvSlabs} << slab_shift) < pages_needed + 8) ++slab_shift;
    const int64_t pages_per_slab = int64_t{1} << slab_shift;
    const int num_slabs =
        static_cast<int>((pages_needed + 8 + pages_per_slab - 1) / pages_per_slab);
    KvPages& kv = params_.pages;
    kv = KvPages{};
    kv.num_slabs = num_slabs;
    kv.slab_shift = slab_shift;
    kv.page_size = page_size;
    kv.page_shift = page_shift;
    const int64_t slab_bytes = pages_per_slab * page_size * row_bytes_;
    for (int s = 0; s < num_slabs; ++s) {
      k_slabs_.emplace_back(size_t(slab_bytes), uint8_t{0xFF});  // poison: NaN in every dtype
      v_slabs_.emplace_back(size_t(slab_bytes), uint8_t{0xFF});
      kv.k_slabs[s] = k_slabs_.back().data();
      kv.v_slabs[s] = v_slabs_.back().data();
    }
    // Shuffled page ids: consecutive tokens of a sequence land far apart.
    std::vector<int32_t> free_pages(size_t(int64_t{num_slabs} * pages_per_slab));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng_);

    table_.assign(size_t(batch) * stride, -1);
    seqlens_.resize(batch);
    cu_new_.push_back(0);
    cu_q_.assign(a.cu_seqlens_q, a.cu_seqlens_q + batch + 1);
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      const int added = std::min(new_rows[b % new_rows.size()], len);
      const int prefix = len - added;
      seqlens_[b] = len;
      const int pages = (len + page_size - 1) / page_size;
      for (int i = 0; i < pages; ++i) {
        table_[size_t(b) * stride + i] = free_pages.back();
        free_pages.pop_back();
      }
      // The prefix rows, written in place as if appended by earlier launches.
      for (int r = 0; r < prefix; ++r)
        WriteRow(b, r, table_[size_t(b) * stride + r / page_size], r);
      if (cow && prefix % page_size != 0) {
        // The page holding the prefix's tail is a shared one: the table names
        // a fresh page, filled only by the copy.
        const int i = prefix / page_size;
        const int32_t shared = free_pages.back();
        free_pages.pop_back();
        for (int r = i * page_size; r < prefix; ++r) WriteRow(b, r, shared, r);
        const int32_t fresh = table_[size_t(b) * stride + i];
        PoisonPage(fresh);
        copy_src_.push_back(shared);
        copy_dst_.push_back(fresh);
      }
      // The new rows, packed [Tnew, Hkv, D].
      const char* k = static_cast<const char*>(a.k);
      const char* v = static_cast<const char*>(a.v);
      const int64_t first = (SeqStartK(a, b) + prefix) * row_bytes_;
      k_new_.insert(k_new_.end(), k + first, k + first + added * row_bytes_);
      v_new_.insert(v_new_.end(), v + first, v + first + added * row_bytes_);
      cu_new_.push_back(cu_new_.back() + added);
    }
    o_.assign(size_t(buf.o_bytes()), 0xFF);
    lse_.assign(size_t(std::max<int64_t>(buf.lse_elements(), 1)), std::nanf(""));

    params_.attn = a;
    params_.attn.k = k_new_.data();
    params_.attn.v = v_new_.data();
    params_.attn.o = o_.data();
    params_.attn.lse = a.lse != nullptr ? lse_.data() : nullptr;
    params_.attn.cu_seqlens_q = cu_q_.data();
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

  const PagedAttnParams& params() const { return params_; }
  PagedAttnParams& mutable_params() { return params_; }
  const void* o() const { return o_.data(); }
  const float* lse() const { return params_.attn.lse; }

  // Member m of `parts`: sequences [first, last) as a call of their own, with
  // their own table rows, lengths, copies and q/new rows (pointers into this).
  struct Member {
    PagedAttnParams p;
    std::vector<int32_t> cu_q, cu_k;
    std::vector<uint8_t> o;
    std::vector<float> lse;
    std::vector<int32_t> copy_src, copy_dst;
  };
  std::unique_ptr<Member> Slice(int first, int last) const {
    auto m = std::make_unique<Member>();
    const AttnParams& a = params_.attn;
    const int64_t q_row = int64_t{a.num_heads_q} * a.head_dim * DTypeSize(a.dtype);
    const int32_t q0 = cu_q_[first], k0 = cu_new_[first];
    for (int b = first; b <= last; ++b) {
      m->cu_q.push_back(cu_q_[b] - q0);
      m->cu_k.push_back(cu_new_[b] - k0);
    }
    m->p = params_;
    m->p.attn.batch = last - first;
    m->p.attn.total_q = m->cu_q.back();
    m->p.attn.total_k = m->cu_k.back();
    m->p.attn.cu_seqlens_q = m->cu_q.data();
    m->p.attn.cu_seqlens_k = m->cu_k.data();
    m->p.attn.q = static_cast<const char*>(a.q) + q0 * q_row;
    m->p.attn.k = k_new_.data() + k0 * row_bytes_;
    m->p.attn.v = v_new_.data() + k0 * row_bytes_;
    m->o.assign(size_t(m->p.attn.total_q * q_row), 0xFF);
    m->lse.assign(size_t(std::max<int64_t>(m->p.attn.total_q * a.num_heads_q, 1)), std::nanf(""));
    m->p.attn.o = m->o.data();
    m->p.attn.lse = a.lse != nullptr ? m->lse.data() : nullptr;
    m->p.block_table = table_.data() + int64_t{first} * params_.block_table_stride;
    m->p.seqlens_k = seqlens_.data() + first;
    int32_t longest = 0;
    for (int b = first; b < last; ++b) longest = std::max(longest, seqlens_[b]);
    m->p.attn.seqlen_k = longest;
    // Copies belong to the members whose table names their destination.
    for (size_t i = 0; i < copy_dst_.size(); ++i) {
      const int32_t* begin = m->p.block_table;
      const int32_t* end = begin + int64_t{last - first} * params_.block_table_stride;
      if (std::find(begin, end, copy_dst_[i]) != end) {
        m->copy_src.push_back(copy_src_[i]);
        m->copy_dst.push_back(copy_dst_[i]);
      }
    }
    m->p.copy_src = m->copy_src.data();
    m->p.copy_dst = m->copy_dst.data();
    m->p.num_page_copies = static_cast<int32_t>(m->copy_src.size());
    return m;
  }

 private:
  char* PageRow(std::vector<std::vector<uint8_t>>& slabs, int32_t page, int token) {
    const KvPages& kv = params_.pages;
    const int64_t elem = DTypeSize(buf_.params().dtype);
    return reinterpret_cast<char*>(slabs[size_t(PageSlab(kv, page))].data()) +
           PageRowOffset(kv, page, token, buf_.params().num_heads_kv, buf_.params().head_dim, 0) *
               elem;
  }
  void WriteRow(int b, int r, int32_t page, int pos) {
    const AttnParams& a = buf_.params();
    const int64_t src = (SeqStartK(a, b) + r) * row_bytes_;
    const int token = pos & (params_.pages.page_size - 1);
    std::memcpy(PageRow(k_slabs_, page, token), static_cast<const char*>(a.k) + src,
                size_t(row_bytes_));
    std::memcpy(PageRow(v_slabs_, page, token), static_cast<const char*>(a.v) + src,
                size_t(row_bytes_));
  }
  void PoisonPage(int32_t page) {
    const size_t bytes = size_t(params_.pages.page_size * row_bytes_);
    std::memset(PageRow(k_slabs_, page, 0), 0xFF, bytes);
    std::memset(PageRow(v_slabs_, page, 0), 0xFF, bytes);
  }

  const HostBuffers& buf_;
  std::mt19937 rng_;
  int64_t row_bytes_ = 0;
  std::vector<std::vector<uint8_t>> k_slabs_, v_slabs_;
  std::vector<int32_t> table_, seqlens_, cu_new_, cu_q_, copy_src_, copy_dst_;
  std::vector<uint8_t> k_new_, v_new_, o_;
  std::vector<float> lse_;
  PagedAttnParams params_{};
};

struct PagedTestCase {
  TestCase tc;
  int page_size;
  std::vector<int> new_rows;  // per sequence (cycled)
  bool cow;
};

std::vector<PagedTestCase> Grid() {
  std::vector<PagedTestCase> grid;
  std::mt19937 rng(1234);
  const int page_sizes[] = {16, 32, 64, 128, 256};
  auto add = [&](TestCase tc, std::vector<int> new_rows, bool cow) {
    const int page_size = page_sizes[rng() % 5];
    grid.push_back({tc, page_size, new_rows, cow});
  };
  TestCase decode;  // decode: one new token per sequence, GQA 4:1
  decode.dtype = DType::kBF16;
  decode.num_heads_q = 8;
  decode.num_heads_kv = 2;
  decode.seqlens_q = {1, 1, 1, 1};
  decode.seqlens_k = {1, 97, 300, 17};
  decode.causal = true;
  add(decode, {1}, true);
  TestCase prefill;  // chunked prefill: Sq > 1 over cache + new rows
  prefill.dtype = DType::kFP16;
  prefill.num_heads_q = 4;
  prefill.num_heads_kv = 1;
  prefill.seqlens_q = {33, 0, 64};
  prefill.seqlens_k = {150, 20, 64};
  prefill.causal = true;
  add(prefill, {33, 5, 64}, true);
  TestCase window = prefill;  // windows and softcap, fp32
  window.dtype = DType::kFP32;
  window.causal = false;
  window.window_left = 40;
  window.window_right = 3;
  window.softcap = 20.0f;
  add(window, {33, 0, 10}, false);
  TestCase attend_only = decode;  // no new rows, no LSE
  attend_only.return_lse = false;
  attend_only.head_dim = 128;
  add(attend_only, {0}, false);
  TestCase append_only = decode;  // empty q everywhere
  append_only.seqlens_q = {0, 0, 0, 0};
  add(append_only, {1, 7, 40, 17}, true);
  // The per-head score modifiers (gpt-oss: sinks; ALiBi models): ALiBi's
  // distance counts the cached keys, so a wrong sk shows at once.
  TestCase decode_mods = decode;
  decode_mods.mods.alibi = true;
  decode_mods.mods.sinks = true;
  add(decode_mods, {1}, true);
  TestCase prefill_mods = prefill;
  prefill_mods.mods.alibi = true;
  prefill_mods.mods.sinks = true;
  add(prefill_mods, {33, 5, 64}, true);
  TestCase window_mods = window;  // sinks alone, with windows and softcap
  window_mods.mods.sinks = true;
  add(window_mods, {33, 0, 10}, false);
  TestCase alibi_only = attend_only;  // ALiBi alone, no new rows
  alibi_only.mods.alibi = true;
  alibi_only.mods.alibi_max_slope = 1.0f;
  add(alibi_only, {0}, false);
  // Element masks and biases: each sequence's rows span its whole history,
  // so a layout counted over the new rows alone reads the wrong bytes.
  TestCase decode_masks = decode;  // a per-head mask with empty rows, a shared bias
  decode_masks.mods.mask_density = 0.5f;
  decode_masks.mods.mask_empty_rows = 0.25f;
  decode_masks.mods.bias = true;
  decode_masks.mods.bias_per_head = false;
  add(decode_masks, {1}, true);
  TestCase prefill_masks = prefill;  // a shared mask, a BF16 bias with -inf, sinks
  prefill_masks.mods.mask_density = 0.3f;
  prefill_masks.mods.mask_empty_rows = 0.1f;
  prefill_masks.mods.mask_per_head = false;
  prefill_masks.mods.bias = true;
  prefill_masks.mods.bias_dtype = DType::kBF16;
  prefill_masks.mods.bias_neg_inf = 0.1f;
  prefill_masks.mods.sinks = true;
  add(prefill_masks, {33, 5, 64}, true);
  TestCase window_masks = window;  // windows, softcap, ALiBi, an FP16 bias alone
  window_masks.mods.bias = true;
  window_masks.mods.bias_dtype = DType::kFP16;
  window_masks.mods.alibi = true;
  add(window_masks, {33, 0, 10}, false);
  return grid;
}

class PagedGridTest : public ::testing::TestWithParam<PagedTestCase> {};

TEST_P(PagedGridTest, EqualsContiguousAndReference) {
  const PagedTestCase& c = GetParam();
  HostBuffers buf(c.tc);
  // The contiguous kernel over the whole context.
  BackendTimings t;
  ASSERT_TRUE(PlanAndForward(Backend(), buf.params(), &t).ok());
  ASSERT_TRUE(CheckOutput(buf));
  PagedCase paged(buf, c.page_size, c.new_rows, c.cow, 7);
  const absl::Status status = PlanAndPagedForward(Backend(), paged.params(), &t);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse()));
  // Same tiles, same rows, same order: the same bits.
  EXPECT_EQ(std::memcmp(buf.o(), paged.o(), size_t(buf.o_bytes())), 0);
  if (buf.lse() != nullptr) {
    EXPECT_EQ(std::memcmp(buf.lse(), paged.lse(), size_t(buf.lse_elements()) * 4), 0);
  }
}

TEST_P(PagedGridTest, PackedMembersEqualOneLaunch) {
  const PagedTestCase& c = GetParam();
  HostBuffers buf(c.tc);
  const int batch = buf.params().batch;
  if (batch < 2) GTEST_SKIP() << "needs two sequences to split";
  PagedCase paged(buf, c.page_size, c.new_rows, c.cow, 9);
  auto first = paged.Slice(0, 1);
  auto rest = paged.Slice(1, batch);
  if (c.tc.mods.bias || c.tc.mods.mask_density >= 0.0f) {
    // Laid out over their own call's sequences: such calls run alone.
    EXPECT_FALSE(CanSharePagedLaunch(first->p, rest->p));
    return;
  }
  ASSERT_TRUE(CanSharePagedLaunch(first->p, rest->p));
  PagedBatch packed({&first->p, &rest->p});
  EXPECT_EQ(packed.batch(), batch);
  EXPECT_EQ(packed.num_page_copies(), paged.params().num_page_copies);
  absl::StatusOr<Plan> plan = Backend().CanImplementPaged(first->p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(Backend().CanImplementPaged(rest->p).ok());
  auto launch = Backend().StartPagedForward(*plan, packed);
  ASSERT_TRUE(launch.ok()) << launch.status();
  BackendTimings t;
  ASSERT_TRUE((*launch)->Finish(&t).ok());
  // Concatenated, the members' outputs are the single launch's.
  std::vector<uint8_t> o(first->o);
  o.insert(o.end(), rest->o.begin(), rest->o.end());
  o.resize(size_t(buf.o_bytes()));
  if (buf.lse() == nullptr) {
    EXPECT_TRUE(CheckOutput(buf, o.data(), nullptr));
  } else {
    const AttnParams& a = buf.params();
    std::vector<float> lse(size_t(buf.lse_elements()));
    for (int h = 0; h < a.num_heads_q; ++h) {
      for (int64_t r = 0; r < a.total_q; ++r) {
        lse[size_t(h * a.total_q + r)] =
            r < first->p.attn.total_q
                ? first->lse[size_t(h * first->p.attn.total_q + r)]
                : rest->lse[size_t(h * rest->p.attn.total_q + r - first->p.attn.total_q)];
      }
    }
    EXPECT_TRUE(CheckOutput(buf, o.data(), lse.data()));
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, PagedGridTest, ::testing::ValuesIn(Grid()),
                         [](const ::testing::TestParamInfo<PagedTestCase>& info) {
                           return info.param.tc.Name() + "_page" +
                                  std::to_string(info.param.page_size) +
                                  (info.param.cow ? "_cow" : "");
                         });

// `iters` random shapes, page sizes and splits drawn from `rng_seed` (the
// cases seeded from `case_seed`, fewer than `query_span` queries a sequence),
// with `per_head_mods` ALiBi, sinks or both, with `element_masks` a random
// mask (some rows fully masked) and/or bias, each per head or shared: the
// reference over the whole context.
void CheckRandomCases(uint32_t rng_seed, int iters, int case_seed, int query_span,
                      bool per_head_mods, bool element_masks = false) {
  std::mt19937 rng(rng_seed);
  for (int iter = 0; iter < iters; ++iter) {
    TestCase tc;
    const DType dtypes[] = {DType::kFP16, DType::kBF16, DType::kFP32};
    tc.dtype = dtypes[rng() % 3];
    tc.num_heads_kv = 1 + int(rng() % 2);
    tc.num_heads_q = tc.num_heads_kv * (1 + int(rng() % 3));
    tc.head_dim = 8 * (1 + int(rng() % 8));
    tc.causal = rng() % 2 == 0;
    if (per_head_mods) {
      tc.mods.alibi = iter % 3 != 1;
      tc.mods.sinks = iter % 3 != 0;
    }
    if (element_masks) {
      if (iter % 3 != 1) {
        tc.mods.mask_density = 0.1f + 0.2f * float(rng() % 5);
        tc.mods.mask_empty_rows = 0.2f;
        tc.mods.mask_per_head = rng() % 2 == 0;
      }
      if (iter % 3 != 0) {
        const DType bias_dtypes[] = {DType::kFP32, DType::kFP16, DType::kBF16};
        tc.mods.bias = true;
        tc.mods.bias_dtype = bias_dtypes[rng() % 3];
        tc.mods.bias_per_head = rng() % 2 == 0;
        tc.mods.bias_neg_inf = 0.05f;
      }
    }
    tc.seed = case_seed + iter;
    const int batch = 1 + int(rng() % 4);
    std::vector<int> new_rows;
    for (int b = 0; b < batch; ++b) {
      const int len = int(rng() % 400);
      const int added = len == 0 ? 0 : int(rng() % (len + 1));
      tc.seqlens_k.push_back(len);
      tc.seqlens_q.push_back(std::min(added, int(rng() % query_span)));
      new_rows.push_back(added);
    }
    HostBuffers buf(tc);
    PagedCase paged(buf, 16 << (rng() % 5), new_rows, rng() % 2 == 0, rng());
    BackendTimings t;
    const absl::Status status = PlanAndPagedForward(Backend(), paged.params(), &t);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(CheckOutput(buf, paged.o(), paged.lse())) << tc.Name();
  }
}

TEST(PagedTest, RandomCases) {
  CheckRandomCases(/*rng_seed=*/42, /*iters=*/12, /*case_seed=*/100, /*query_span=*/3,
                   /*per_head_mods=*/false);
}

TEST(PagedTest, RandomCasesWithPerHeadMods) {
  CheckRandomCases(/*rng_seed=*/7, /*iters=*/8, /*case_seed=*/300, /*query_span=*/5,
                   /*per_head_mods=*/true);
}

// The check fails without the mods: a launch that dropped them is caught.
TEST(PagedTest, ModsChangeTheOutput) {
  TestCase tc;
  tc.num_heads_q = 2;
  tc.seqlens_q = {3};
  tc.seqlens_k = {90};
  tc.causal = true;
  tc.mods.alibi = true;
  tc.mods.sinks = true;
  HostBuffers buf(tc);
  PagedCase paged(buf, 16, {3}, false, 5);
  PagedAttnParams p = paged.params();
  p.attn.alibi_slopes = nullptr;
  p.attn.sinks = nullptr;
  ASSERT_TRUE(PlanAndPagedForward(Backend(), p, nullptr).ok());
  EXPECT_FALSE(CheckOutput(buf, paged.o(), paged.lse()));
}

// Calls with different slopes or sinks never share a launch; equal values
// (or both absent) may.
TEST(PagedTest, PackingNeedsEqualPerHeadMods) {
  TestCase tc;
  tc.num_heads_q = 2;
  tc.seqlens_q = {1, 1};
  tc.seqlens_k = {20, 30};
  tc.mods.sinks = true;
  HostBuffers buf(tc);
  PagedCase paged(buf, 16, {1}, false, 11);
  auto a = paged.Slice(0, 1);
  auto b = paged.Slice(1, 2);
  EXPECT_TRUE(CanSharePagedLaunch(a->p, b->p));
  std::vector<float> same(buf.params().sinks, buf.params().sinks + 2);
  b->p.attn.sinks = same.data();
  EXPECT_TRUE(CanSharePagedLaunch(a->p, b->p));
  same[1] += 0.5f;
  EXPECT_FALSE(CanSharePagedLaunch(a->p, b->p));
  b->p.attn.sinks = nullptr;
  EXPECT_FALSE(CanSharePagedLaunch(a->p, b->p));
  a->p.attn.sinks = nullptr;
  EXPECT_TRUE(CanSharePagedLaunch(a->p, b->p));
  const std::vector<float> slopes = {0.5f, 0.25f}, other = {0.5f, 0.125f};
  a->p.attn.alibi_slopes = slopes.data();
  EXPECT_FALSE(CanSharePagedLaunch(a->p, b->p));
  b->p.attn.alibi_slopes = other.data();
  EXPECT_FALSE(CanSharePagedLaunch(a->p, b->p));
  b->p.attn.alibi_slopes = slopes.data();
  EXPECT_TRUE(CanSharePagedLaunch(a->p, b->p));
}

TEST(PagedTest, RandomCasesWithElementMasks) {
  CheckRandomCases(/*rng_seed=*/77, /*iters=*/12, /*case_seed=*/300, /*query_span=*/70,
                   /*per_head_mods=*/false, /*element_masks=*/true);
}

// A paged bias or mask covers each sequence's whole history: total_pairs
// counted over the new rows alone (the contiguous rule) is refused.
TEST(PagedTest, ElementMaskPairsSpanTheHistory) {
  TestCase tc;
  tc.num_heads_q = 2;
  tc.seqlens_q = {2, 1};
  tc.seqlens_k = {20, 9};
  tc.mods.mask_density = 0.5f;
  HostBuffers buf(tc);
  PagedCase paged(buf, 16, {2, 1}, false, 5);
  PagedAttnParams p = paged.params();
  EXPECT_EQ(p.attn.total_pairs, 2 * 20 + 1 * 9);
  EXPECT_TRUE(Backend().CanImplementPaged(p).ok());
  p.attn.total_pairs = 2 * 2 + 1 * 1;
  const absl::Status s = Backend().CanImplementPaged(p).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("attn.total_pairs expected the sum of seqlen_q * seqlens_k[b]"),
            std::string::npos)
      << s;
}

// A backend opts in to the per-head mods and the element masks (the CPU
// backend does); without PagedModSupport they stay UNIMPLEMENTED, and a
// block mask is refused on every paged call.
TEST(PagedTest, ModSupportIsOptIn) {
  TestCase tc;
  tc.num_heads_q = 2;
  tc.seqlens_q = {1};
  tc.seqlens_k = {20};
  tc.mods.alibi = true;
  tc.mods.sinks = true;
  HostBuffers buf(tc);
  PagedCase paged(buf, 16, {1}, false, 13);
  PagedAttnParams p = paged.params();
  absl::Status s = CheckPagedParams(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("got alibi_slopes sinks"), std::string::npos) << s;
  PagedModSupport sinks_only;
  sinks_only.sinks = true;
  s = CheckPagedParams(p, sinks_only);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("got alibi_slopes"), std::string::npos) << s;
  PagedModSupport both;
  both.alibi_slopes = both.sinks = true;
  EXPECT_TRUE(CheckPagedParams(p, both).ok());
  EXPECT_TRUE(Backend().CanImplementPaged(p).ok());
  const float bias = 0.0f;
  const uint8_t mask = 1;
  p.attn.bias = &bias;
  s = CheckPagedParams(p, both);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("got bias"), std::string::npos) << s;
  p.attn.bias = nullptr;
  p.attn.mask = &mask;
  s = CheckPagedParams(p, both);
  EXPECT_NE(s.message().find("got mask"), std::string::npos) << s;
  p.attn.mask = nullptr;
  p.attn.block_q = 128;
  s = Backend().CanImplementPaged(p).status();
  EXPECT_NE(s.message().find("got block_q 128"), std::string::npos) << s;
  // Checked before anything else: the pages are never touched.
  EXPECT_EQ(PlanAndPagedForward(Backend(), p, nullptr).code(), absl::StatusCode::kUnimplemented);
}

TEST(PagedTest, RejectsBadTables) {
  TestCase tc;
  tc.seqlens_q = {1, 1};
  tc.seqlens_k = {40, 9};
  HostBuffers buf(tc);
  PagedCase paged(buf, 16, {1}, false, 3);
  PagedAttnParams p = paged.params();
  std::vector<int32_t> table(p.block_table, p.block_table + 2 * p.block_table_stride);
  table[1] = 1 << 30;
  p.block_table = table.data();
  absl::Status s = PlanAndPagedForward(Backend(), p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block_table[1]"), std::string::npos) << s;
  p = paged.params();
  std::vector<int32_t> lens = {40, 1000};
  p.seqlens_k = lens.data();
  p.attn.seqlen_k = 1000;
  s = PlanAndPagedForward(Backend(), p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("seqlens_k[1]"), std::string::npos) << s;
  p = paged.params();
  p.pages.page_size = 24;
  EXPECT_EQ(CheckPagedParams(p).code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagedTest, DefaultBackendSaysUnimplemented) {
  // A backend that did not override the paged path names itself.
  class NoPaged : public AttentionBackend {
   public:
    const BackendDescription& Describe() const override { return d_; }
    absl::StatusOr<Plan> CanImplement(const AttnParams&) const override { return Plan(); }
    absl::Status Forward(const Plan&, const AttnParams&, BackendTimings*) override {
      return absl::OkStatus();
    }
    BackendDescription d_;
  } backend;
  backend.d_.name = "nopaged";
  const absl::Status s = backend.AllocateKvMemory(64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("nopaged"), std::string::npos) << s;
  PagedAttnParams p{};
  EXPECT_EQ(backend.CanImplementPaged(p).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(backend.PagedForward(Plan(), p, nullptr).code(), absl::StatusCode::kUnimplemented);
}

TEST(PagedTest, AllocatesHostMemory) {
  auto memory = Backend().AllocateKvMemory(4096);
  ASSERT_TRUE(memory.ok());
  std::memset(*memory, 1, 4096);
  Backend().FreeKvMemory(*memory);
  EXPECT_EQ(Backend().AllocateKvMemory(int64_t{1} << 62).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attnserve
