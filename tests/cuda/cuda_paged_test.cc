// CudaBackend's paged K/V path (paged_kv.h) against the contiguous kernel and
// the float64 reference. Each case scatters every sequence's K/V over a cache
// whose page ids are shuffled across several slabs (fragmented tables), in
// two launches started back to back: the prefix alone (an append with no
// queries), then the new rows with the queries (append, then attend over
// prefix + new rows). The paged output must equal the contiguous kernel's
// on the same full K/V (same plan, same arithmetic: bit for bit; on sm90 a
// prefill's contiguous run takes the Hopper prefill kernel, which pages do
// not, and meets the reference instead) and pass DESIGN §4's tolerance
// against the reference. Copy-on-write: sequence 0's
// partial last page is copied to a fresh page before the append, and the
// source page must stay untouched. ALiBi and sinks (the paged kernels' only
// mods) run on the same grid. FP8 caches (CudaPagedFp8): the same cases as the
// CPU's paged_fp8_test (quantised and given new rows, copies, decode, chunked
// prefill, windows, softcap, ALiBi, sinks) through the CUDA append and the FP8
// paged kernel: pages bit for bit the contract's quantisation, O and LSE
// against the float64 reference over the dequantised cache. Without a GPU
// every test is SKIPPED.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/paged_batch.h"
#include "backend/paged_kv.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/backend/paged_fp8_case.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/device_slabs.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::Fp8Case;
using testing_util::HostBuffers;
using testing_util::TestCase;
constexpr auto SharedBackend = testing_util::SharedCudaBackend;

// One paged case: tc is the whole problem as a varlen call (seqlens_k = each
// sequence's length after the append, seqlens_q = its new queries);
// new_rows[b] of those keys are appended by the attending launch, the rest
// are the prefix already in the cache.
struct PagedCase {
  TestCase tc;
  std::vector<int> new_rows;
  int page_size = 16;
  bool cow = false;          // copy sequence 0's partial last prefix page first
  bool two_members = false;  // the attending launch packs two calls (PagedBatch)
  int min_splits = 1;        // the attending launch's plan must split at least this much
  std::string Name() const {
    std::string s = tc.Name() + "_new";
    for (int n : new_rows) s += "_" + std::to_string(n);
    s += "_ps" + std::to_string(page_size);
    if (cow) s += "_cow";
    if (two_members) s += "_2calls";
    return s;
  }
};
void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.Name(); }

// Device slabs of one cache, freed through the backend. Every byte starts
// as 0xff (NaN in every dtype), written and waited for on the cache's own
// stream: the backend's streams are non-blocking, so a poison left queued on
// the legacy default stream (a plain cudaMemset) could land after a launch's
// append (CachePoisonIsInPlaceBeforeTheAppend).
class DeviceCache {
 public:
  DeviceCache(AttentionBackend* backend, int num_slabs, int slab_shift, int page_size,
              int64_t row_bytes)
      : backend_(backend) {
    pages_ = KvPages{};
    pages_.num_slabs = num_slabs;
    pages_.slab_shift = slab_shift;
    pages_.page_size = page_size;
    pages_.page_shift = 0;
    while ((1 << pages_.page_shift) < page_size) ++pages_.page_shift;
    slab_bytes_ = (int64_t{1} << slab_shift) * page_size * row_bytes;
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      status_ = absl::InternalError("cuda: the cache's stream");
      return;
    }
    for (int s = 0; s < num_slabs; ++s) {
      for (void** slot : {&pages_.k_slabs[s], &pages_.v_slabs[s]}) {
        absl::StatusOr<void*> m = backend->AllocateKvMemory(slab_bytes_);
        status_.Update(m.status());
        if (m.ok()) *slot = *m;
      }
    }
    Poison();
  }
  ~DeviceCache() {
    for (int s = 0; s < kMaxKvSlabs; ++s) {
      backend_->FreeKvMemory(pages_.k_slabs[s]);
      backend_->FreeKvMemory(pages_.v_slabs[s]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  const absl::Status& status() const { return status_; }
  const KvPages& pages() const { return pages_; }
  int64_t num_pages() const { return int64_t{pages_.num_slabs} << pages_.slab_shift; }
  // Every slab back to 0xff; done when this returns. With
  // ATTNSERVE_TEST_LEGACY_POISON=1, the old poison instead (a cudaMemset on
  // the legacy stream, not waited for): scripts/device/paged-contention.sh
  // runs the grid both ways under GPU contention.
  void Poison() {
    if (stream_ == nullptr) return;
    const char* legacy = std::getenv("ATTNSERVE_TEST_LEGACY_POISON");
    const bool old_poison = legacy != nullptr && std::strcmp(legacy, "1") == 0;
    for (int s = 0; s < pages_.num_slabs; ++s) {
      for (void* slab : {pages_.k_slabs[s], pages_.v_slabs[s]}) {
        if (slab == nullptr) continue;
        const size_t bytes = static_cast<size_t>(slab_bytes_);
        Check(old_poison ? cudaMemset(slab, 0xff, bytes)
                         : cudaMemsetAsync(slab, 0xff, bytes, stream_),
              "poison");
      }
    }
    if (!old_poison) Check(cudaStreamSynchronize(stream_), "poison");
  }
  // Bytes of K page `page` (row_bytes per token).
  std::vector<uint8_t> ReadKPage(int32_t page, int64_t row_bytes) {
    std::vector<uint8_t> out(static_cast<size_t>(row_bytes * pages_.page_size));
    const int64_t off = (page & ((1 << pages_.slab_shift) - 1)) * pages_.page_size * row_bytes;
    Check(cudaMemcpyAsync(out.data(),
                          static_cast<char*>(pages_.k_slabs[PageSlab(pages_, page)]) + off,
                          out.size(), cudaMemcpyDeviceToHost, stream_),
          "read a K page");
    Check(cudaStreamSynchronize(stream_), "read a K page");
    return out;
  }

 private:
  void Check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
      status_.Update(
          absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(err))));
    }
  }

  AttentionBackend* backend_;
  KvPages pages_;
  int64_t slab_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  absl::Status status_;
};

class CudaPagedTest : public ::testing::TestWithParam<PagedCase> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = SharedBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaPagedTest, MatchesContiguousAndReference) {
  const PagedCase& pc = GetParam();
  HostBuffers buf(pc.tc);
  const AttnParams& full = buf.params();
  const absl::StatusOr<Plan> can = backend_->CanImplement(full);
  if (can.status().code() == absl::StatusCode::kUnimplemented)
    GTEST_SKIP() << can.status().message();
  ASSERT_TRUE(can.ok()) << can.status();
  const int B = full.batch;
  const int64_t row_bytes = int64_t{full.num_heads_kv} * full.head_dim * DTypeSize(full.dtype);
  const int ps = pc.page_size;

  // Geometry: each sequence's pages (+1 for the copy-on-write target), spread
  // over >= 3 slabs, page ids shuffled so tables are fragmented.
  std::vector<int> len(B), prefix(B);
  int64_t pages_needed = 1;
  for (int b = 0; b < B; ++b) {
    len[b] = full.cu_seqlens_k[b + 1] - full.cu_seqlens_k[b];
    prefix[b] = len[b] - pc.new_rows[b];
    pages_needed += (len[b] + ps - 1) / ps;
  }
  int slab_shift = 0;
  while ((int64_t{1} << slab_shift) * 3 < pages_needed) ++slab_shift;
  const int num_slabs = static_cast<int>((pages_needed + (1 << slab_shift) - 1) >> slab_shift) + 1;
  ASSERT_LE(num_slabs, kMaxKvSlabs);
  DeviceCache cache(backend_, num_slabs, slab_shift, ps, row_bytes);
  ASSERT_TRUE(cache.status().ok()) << cache.status();
  std::vector<int32_t> ids(static_cast<size_t>(cache.num_pages()));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(pc.Name())));
  std::shuffle(ids.begin(), ids.end(), rng);
  int stride = 1;
  for (int b = 0; b < B; ++b) stride = std::max(stride, (len[b] + ps - 1) / ps);
  std::vector<int32_t> table(static_cast<size_t>(B) * stride, 0);
  size_t next = 0;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < (len[b] + ps - 1) / ps; ++i) table[size_t(b) * stride + i] = ids[next++];
  }
  const int32_t cow_dst = ids[next++];

  // Host K/V rows of the prefix and of the new part, packed varlen.
  auto pack = [&](const void* src, bool new_part, std::vector<uint8_t>* out,
                  std::vector<int32_t>* cu) {
    cu->assign(1, 0);
    for (int b = 0; b < B; ++b) {
      const int first = new_part ? prefix[b] : 0;
      const int count = new_part ? pc.new_rows[b] : prefix[b];
      const uint8_t* from =
          static_cast<const uint8_t*>(src) + (full.cu_seqlens_k[b] + first) * row_bytes;
      out->insert(out->end(), from, from + count * row_bytes);
      cu->push_back(cu->back() + count);
    }
  };
  std::vector<uint8_t> k_pre, v_pre, k_new, v_new;
  std::vector<int32_t> cu_pre, cu_new;
  pack(buf.k(), false, &k_pre, &cu_pre);
  pack(buf.v(), false, &v_pre, &cu_pre);
  pack(buf.k(), true, &k_new, &cu_new);
  pack(buf.v(), true, &v_new, &cu_new);

  // Launch 1: the prefixes, no queries.
  std::vector<int32_t> cu_q0(B + 1, 0);
  PagedAttnParams pre;
  std::memset(&pre, 0, sizeof(pre));
  pre.attn = full;
  pre.attn.q = nullptr;
  pre.attn.o = nullptr;
  pre.attn.lse = nullptr;
  pre.attn.k = k_pre.data();
  pre.attn.v = v_pre.data();
  pre.attn.seqlen_q = 0;
  pre.attn.total_q = 0;
  pre.attn.cu_seqlens_q = cu_q0.data();
  pre.attn.cu_seqlens_k = cu_pre.data();
  pre.attn.total_k = cu_pre.back();
  pre.attn.seqlen_k = *std::max_element(prefix.begin(), prefix.end());
  pre.pages = cache.pages();
  pre.block_table = table.data();
  pre.block_table_stride = stride;
  pre.seqlens_k = prefix.data();

  // Launch 2: copy-on-write of sequence 0's partial page, the new rows, the queries.
  std::vector<int32_t> table2 = table;
  std::vector<int32_t> copy_src, copy_dst;
  const bool cow = pc.cow && prefix[0] % ps != 0;
  if (pc.cow) {
    ASSERT_TRUE(cow) << "the case must give sequence 0 a partial prefix page";
  }
  if (cow) {
    copy_src.push_back(table[prefix[0] / ps]);
    copy_dst.push_back(cow_dst);
    table2[prefix[0] / ps] = cow_dst;
  }
  std::vector<uint8_t> o(static_cast<size_t>(buf.o_bytes()), 0xff);
  std::vector<float> lse(static_cast<size_t>(buf.lse_elements()), std::nanf(""));
  PagedAttnParams step = pre;
  step.attn = full;
  step.attn.k = k_new.data();
  step.attn.v = v_new.data();
  step.attn.cu_seqlens_k = cu_new.data();
  step.attn.total_k = cu_new.back();
  step.attn.o = o.data();
  step.attn.lse = full.lse != nullptr ? lse.data() : nullptr;
  step.block_table = table2.data();
  step.seqlens_k = len.data();
  step.copy_src = copy_src.data();
  step.copy_dst = copy_dst.data();
  step.num_page_copies = static_cast<int32_t>(copy_src.size());

  // Both launches started before either is finished: the second reads rows
  // the first appends (paged launches run in start order).
  absl::StatusOr<Plan> plan1 = backend_->CanImplementPaged(pre);
  ASSERT_TRUE(plan1.ok()) << plan1.status();
  absl::StatusOr<std::unique_ptr<PendingLaunch>> l1 =
      backend_->StartPagedForward(*plan1, PagedBatch({&pre}));
  ASSERT_TRUE(l1.ok()) << l1.status();
  std::unique_ptr<PendingLaunch> l2;
  // The two-member form: sequences [0, B/2) and [B/2, B) as separate calls.
  std::vector<PagedAttnParams> halves;
  std::vector<std::vector<int32_t>> keep;
  if (pc.two_members && B >= 2) {
    const int split = B / 2;
    for (int part = 0; part < 2; ++part) {
      const int b0 = part == 0 ? 0 : split, b1 = part == 0 ? split : B;
      PagedAttnParams h = step;
      const int32_t q0 = full.cu_seqlens_q[b0], k0 = cu_new[b0];
      std::vector<int32_t> cq, ck;
      for (int b = b0; b <= b1; ++b) {
        cq.push_back(full.cu_seqlens_q[b] - q0);
        ck.push_back(cu_new[b] - k0);
      }
      keep.push_back(cq);
      keep.push_back(ck);
      h.attn.batch = b1 - b0;
      h.attn.cu_seqlens_q = keep[keep.size() - 2].data();
      h.attn.cu_seqlens_k = keep.back().data();
      h.attn.total_q = cq.back();
      h.attn.total_k = ck.back();
      h.attn.seqlen_q = 0;
      h.attn.seqlen_k = 0;
      for (int b = b0; b < b1; ++b) {
        h.attn.seqlen_q =
            std::max(h.attn.seqlen_q, full.cu_seqlens_q[b + 1] - full.cu_seqlens_q[b]);
        h.attn.seqlen_k = std::max(h.attn.seqlen_k, len[b]);
      }
      h.attn.q = static_cast<const uint8_t*>(full.q) +
                 int64_t{q0} * full.num_heads_q * full.head_dim * DTypeSize(full.dtype);
      h.block_table = table2.data() + int64_t{b0} * stride;
      h.seqlens_k = len.data() + b0;
      h.attn.k = k_new.data() + k0 * row_bytes;
      h.attn.v = v_new.data() + k0 * row_bytes;
      halves.push_back(h);
    }
    // Member outputs: separate buffers, merged into o/lse below.
    ASSERT_EQ(halves.size(), 2u);
  }
  std::vector<std::vector<uint8_t>> part_o(2);
  std::vector<std::vector<float>> part_lse(2);
  if (!halves.empty()) {
    for (int part = 0; part < 2; ++part) {
      PagedAttnParams& h = halves[part];
      part_o[part].assign(static_cast<size_t>(h.attn.total_q * full.num_heads_q * full.head_dim *
                                              DTypeSize(full.dtype)),
                          0xff);
      part_lse[part].assign(static_cast<size_t>(h.attn.total_q * full.num_heads_q), std::nanf(""));
      h.attn.o = part_o[part].data();
      h.attn.lse = full.lse != nullptr ? part_lse[part].data() : nullptr;
      // Only the first member carries the copy (its sequence 0 is the case's).
      if (part == 1) h.num_page_copies = 0;
    }
    // Planned one by one, as the executor does; the launch runs the first's.
    absl::StatusOr<Plan> plan = backend_->CanImplementPaged(halves[0]);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(backend_->CanImplementPaged(halves[1]).ok());
    absl::StatusOr<std::unique_ptr<PendingLaunch>> l =
        backend_->StartPagedForward(*plan, PagedBatch({&halves[0], &halves[1]}));
    ASSERT_TRUE(l.ok()) << l.status();
    l2 = std::move(*l);
  } else {
    absl::StatusOr<Plan> plan = backend_->CanImplementPaged(step);
    ASSERT_TRUE(plan.ok()) << plan.status();
    // Mods run on the portable kernel (the Hopper decode kernel has none).
    if (full.alibi_slopes != nullptr || full.sinks != nullptr) {
      EXPECT_EQ(plan->kernel_family, KernelFamily::kPortable);
    }
    ASSERT_GE(plan->num_splits, pc.min_splits) << "the case must split its keys";
    absl::StatusOr<std::unique_ptr<PendingLaunch>> l =
        backend_->StartPagedForward(*plan, PagedBatch({&step}));
    ASSERT_TRUE(l.ok()) << l.status();
    l2 = std::move(*l);
  }
  BackendTimings t;
  ASSERT_TRUE((*l1)->Finish(&t).ok());
  const absl::Status st2 = l2->Finish(&t);
  ASSERT_TRUE(st2.ok()) << st2;
  if (!halves.empty()) {
    const int64_t q_row = int64_t{full.num_heads_q} * full.head_dim * DTypeSize(full.dtype);
    std::memcpy(o.data(), part_o[0].data(), part_o[0].size());
    std::memcpy(o.data() + halves[0].attn.total_q * q_row, part_o[1].data(), part_o[1].size());
    if (full.lse != nullptr) {
      for (int h = 0; h < full.num_heads_q; ++h) {
        for (int part = 0; part < 2; ++part) {
          const int64_t tq = halves[part].attn.total_q;
          const int64_t off = part == 0 ? 0 : halves[0].attn.total_q;
          std::memcpy(lse.data() + int64_t{h} * full.total_q + off, part_lse[part].data() + h * tq,
                      tq * 4);
        }
      }
    }
  }

  EXPECT_TRUE(CheckOutput(buf, o.data(), full.lse != nullptr ? lse.data() : nullptr)) << pc.Name();

  // The contiguous kernel on the same full K/V: the same plan, so the same
  // bits. Except a prefill on sm90: the Hopper prefill kernel reads tensors
  // only (KvRows), so pages take the portable kernel and the tensors the
  // Hopper one; the contiguous result then meets the reference on its own.
  buf.Poison();
  const absl::Status fst = backend_->Forward(*can, full, &t);
  ASSERT_TRUE(fst.ok()) << fst;
  if (can->kernel_family == KernelFamily::kSm90 && can->tile_kind != TileKind::kDecode) {
    EXPECT_TRUE(CheckOutput(buf)) << pc.Name() << " (contiguous, Hopper prefill kernel)";
  } else {
    EXPECT_EQ(std::memcmp(buf.o(), o.data(), o.size()), 0)
        << "paged O differs from the contiguous kernel's";
    if (full.lse != nullptr) {
      EXPECT_EQ(std::memcmp(buf.lse(), lse.data(), lse.size() * 4), 0)
          << "paged LSE differs from the contiguous kernel's";
    }
  }

  if (cow) {
    // The source page still holds exactly the prefix rows it had (plus the
    // never-written tail): the append went to the copy.
    const std::vector<uint8_t> src = cache.ReadKPage(copy_src[0], row_bytes);
    const int first = prefix[0] / ps * ps;
    const uint8_t* want =
        static_cast<const uint8_t*>(buf.k()) + (full.cu_seqlens_k[0] + first) * row_bytes;
    EXPECT_EQ(std::memcmp(src.data(), want, static_cast<size_t>((prefix[0] - first) * row_bytes)),
              0);
    const std::vector<uint8_t> tail(static_cast<size_t>((ps - (prefix[0] - first)) * row_bytes),
                                    0xff);
    EXPECT_EQ(std::memcmp(src.data() + (prefix[0] - first) * row_bytes, tail.data(), tail.size()),
              0)
        << "the shared source page was written";
  }
}

PagedCase Case(DType t, std::vector<int> q, std::vector<int> k, std::vector<int> fresh, int hq,
               int hkv, int d, int page_size, bool causal = false) {
  PagedCase c;
  c.tc.dtype = t;
  c.tc.seqlens_q = std::move(q);
  c.tc.seqlens_k = std::move(k);
  c.tc.num_heads_q = hq;
  c.tc.num_heads_kv = hkv;
  c.tc.head_dim = d;
  c.tc.causal = causal;
  c.new_rows = std::move(fresh);
  c.page_size = page_size;
  return c;
}

std::vector<PagedCase> PagedGrid() {
  std::vector<PagedCase> g;
  const int kPageSizes[] = {16, 32, 64, 128, 256};
  int ps_i = 0;
  auto ps = [&]() { return kPageSizes[(ps_i++) % 5]; };
  for (DType t : {DType::kBF16, DType::kFP16}) {
    // Decode, GQA 4:1, split-KV (B=1 long), ragged lengths incl. a 1-token sequence.
    g.push_back(Case(t, {1}, {8192}, {1}, 32, 8, 128, 16));
    g.push_back(Case(t, {1}, {8192}, {1}, 32, 8, 128, 64));
    g.push_back(Case(t, {1, 1, 1}, {4097, 300, 1}, {1, 1, 1}, 32, 8, 128, ps()));
    // B = 16 decode, GQA 4:1, ragged contexts: split-KV over several waves.
    {
      std::vector<int> q(16, 1), k(16);
      for (int b = 0; b < 16; ++b) k[b] = 1200 + 97 * b;
      g.push_back(Case(t, q, k, q, 32, 8, 128, ps()));
    }
    // MQA decode; speculative decode (4 new tokens, causal).
    g.push_back(Case(t, {1, 1}, {3000, 77}, {1, 1}, 8, 1, 128, ps()));
    g.push_back(Case(t, {4, 4}, {3000, 900}, {4, 4}, 16, 4, 128, ps(), true));
    // Chunked prefill: Sq > 1 against cache + new tokens, causal (bottom-right).
    g.push_back(Case(t, {100, 37, 250}, {600, 37, 250}, {100, 37, 250}, 8, 2, 128, ps(), true));
    g.push_back(Case(t, {129, 64}, {1000, 64}, {129, 64}, 4, 4, 128, ps(), false));
    // Empty q for one sequence (append only), empty append for another (attend only).
    g.push_back(Case(t, {0, 1, 3}, {500, 400, 77}, {5, 0, 3}, 8, 2, 128, ps(), true));
    // Windows and softcap.
    {
      PagedCase c = Case(t, {1, 50}, {6000, 700}, {1, 50}, 16, 4, 128, ps(), true);
      c.tc.window_left = 200;
      g.push_back(c);
    }
    {
      PagedCase c = Case(t, {1, 1}, {3000, 100}, {1, 1}, 8, 2, 128, ps());
      c.tc.softcap = 5.0f;
      c.tc.return_lse = false;
      g.push_back(c);
    }
    // Copy-on-write of sequence 0's partial page; two calls packed in one launch.
    {
      PagedCase c = Case(t, {1, 1, 1, 1}, {1000, 37, 2000, 5}, {1, 1, 1, 1}, 32, 8, 128, 32);
      c.cow = true;
      c.two_members = true;
      g.push_back(c);
    }
    {
      PagedCase c = Case(t, {20, 3}, {260, 40}, {20, 3}, 8, 2, 128, 256, true);
      c.cow = true;
      g.push_back(c);
    }
    // Other head dims (skipped where this build has no kernel for them).
    g.push_back(Case(t, {1, 9}, {2000, 300}, {1, 9}, 8, 2, 64, ps(), true));
    g.push_back(Case(t, {1, 9}, {2000, 300}, {1, 9}, 8, 8, 256, ps()));
    g.push_back(Case(t, {1, 30}, {700, 90}, {1, 30}, 4, 2, 96, ps(), true));
  }
  // ALiBi and sinks over pages: query i of sq at position sk - sq + i of the
  // sequence's attended length (cache + new rows); sinks join split rows once
  // (the decode tile's fused combine, the prefill tile's combine kernel).
  auto mods = [](PagedCase c, bool alibi, bool sinks, int min_splits = 1) {
    c.tc.mods.alibi = alibi;
    c.tc.mods.sinks = sinks;
    c.min_splits = min_splits;
    return c;
  };
  for (DType t : {DType::kBF16, DType::kFP16}) {
    g.push_back(mods(Case(t, {1}, {8192}, {1}, 32, 8, 128, 16), true, true, 2));
    g.push_back(mods(Case(t, {1, 1, 1}, {4097, 300, 1}, {1, 1, 1}, 32, 8, 128, 64), false, true));
    g.push_back(mods(Case(t, {4, 4}, {3000, 900}, {4, 4}, 16, 4, 128, 32, true), true, false));
    g.push_back(mods(Case(t, {100, 37, 250}, {600, 37, 250}, {100, 37, 250}, 8, 2, 128, 128, true),
                     true, true));
    // Prefill tile over a long cache: split, combined by the combine kernel.
    g.push_back(mods(Case(t, {64}, {8192}, {64}, 8, 8, 128, 256), true, true, 2));
    // A sequence with no keys at all (LSE = its sink), and causal rows that
    // see no key (sq > sk).
    g.push_back(mods(Case(t, {3, 5}, {0, 300}, {0, 5}, 8, 2, 128, 16), true, true));
    g.push_back(mods(Case(t, {20, 2}, {10, 40}, {10, 2}, 4, 4, 128, 16, true), true, true));
    {
      PagedCase c = mods(Case(t, {1, 50}, {6000, 700}, {1, 50}, 16, 4, 128, 64, true), true, true);
      c.tc.window_left = 200;
      c.tc.softcap = 5.0f;
      g.push_back(c);
    }
    {
      PagedCase c = mods(Case(t, {1, 1, 1, 1}, {1000, 37, 2000, 5}, {1, 1, 1, 1}, 32, 8, 128, 32),
                         true, true);
      c.cow = true;
      c.two_members = true;
      g.push_back(c);
    }
  }
  // FP32 (the SIMT path).
  g.push_back(Case(DType::kFP32, {1, 1}, {3000, 17}, {1, 1}, 8, 2, 128, 16));
  g.push_back(
      mods(Case(DType::kFP32, {1, 7}, {3000, 17}, {1, 7}, 8, 2, 128, 16, true), true, true));
  {
    PagedCase c = Case(DType::kFP32, {40, 0}, {300, 33}, {40, 2}, 4, 1, 64, 64, true);
    c.cow = true;
    g.push_back(c);
  }
  return g;
}

std::string PagedName(const ::testing::TestParamInfo<PagedCase>& info) {
  return info.param.Name() + "_" + std::to_string(info.index);
}
INSTANTIATE_TEST_SUITE_P(Paged, CudaPagedTest, ::testing::ValuesIn(PagedGrid()), PagedName);

TEST(CudaPaged, AllocationFailureIsResourceExhausted) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  absl::StatusOr<void*> huge = backend->AllocateKvMemory(int64_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // The error was cleared: the next allocation and launch work.
  absl::StatusOr<void*> small = backend->AllocateKvMemory(1 << 20);
  ASSERT_TRUE(small.ok()) << small.status();
  backend->FreeKvMemory(*small);
}

// One BF16 decode row (D 128) over a sequence of 20 tokens: two pages of 16.
TestCase DecodeOverTwoPages() {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.seqlens_q = {1};
  tc.seqlens_k = {20};
  tc.head_dim = 128;
  return tc;
}

// Paged params of `attn`'s one sequence, `len[0]` tokens all cached, over
// `cache` through the page ids `table`.
PagedAttnParams OneSequence(const AttnParams& attn, const DeviceCache& cache,
                            const std::vector<int32_t>& table, const std::vector<int32_t>& len) {
  PagedAttnParams p;
  std::memset(&p, 0, sizeof(p));
  p.attn = attn;
  p.pages = cache.pages();
  p.block_table = table.data();
  p.block_table_stride = int32_t(table.size());
  p.seqlens_k = len.data();
  return p;
}

// Holds the legacy default stream (where cudaMemset and cudaMemcpy queue)
// at a host function until Open(), as a GPU time-sliced with other processes
// can hold this process's work: what is queued there behind it lands when
// the test says. It opens by itself after kLimit (timed_out()), so a call
// that waits for the legacy stream fails the test instead of hanging it.
class LegacyStreamGate {
 public:
  static constexpr std::chrono::seconds kLimit{20};
  LegacyStreamGate() { ok_ = cudaLaunchHostFunc(cudaStreamLegacy, &Hold, &state_) == cudaSuccess; }
  ~LegacyStreamGate() {
    Open();
    if (ok_) cudaStreamSynchronize(cudaStreamLegacy);  // the host function returned
  }
  bool ok() const { return ok_; }
  bool timed_out() const { return state_.timed_out.load(); }
  // Lets the held work run and waits until the legacy stream has done it.
  bool OpenAndDrain() {
    Open();
    return cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess;
  }

 private:
  struct State {
    std::atomic<bool> open{false};
    std::atomic<bool> timed_out{false};
  };
  void Open() { state_.open.store(true); }
  static void CUDART_CB Hold(void* arg) {
    State* s = static_cast<State*>(arg);
    const auto deadline = std::chrono::steady_clock::now() + kLimit;
    while (!s->open.load()) {
      if (std::chrono::steady_clock::now() > deadline) {
        s->timed_out.store(true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  State state_;
  bool ok_ = false;
};

// The 18:05 failure of the grid under GPU contention (NaN or 0 outputs): the
// backend's streams are non-blocking, so they never wait for the legacy
// stream, and the cache's poison, then a cudaMemset there, could land after
// a launch had appended its rows. With the legacy stream held, the old poison
// (control) overwrites the appended rows; DeviceCache's poison, on its own
// stream and waited for, is in place before the launch, which keeps its rows.
TEST(CudaPaged, CachePoisonIsInPlaceBeforeTheAppend) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  HostBuffers buf(DecodeOverTwoPages());
  const int64_t row_bytes = int64_t{128} * 2;
  DeviceCache cache(backend, 1, 1, 16, row_bytes);  // 2 pages of 16
  ASSERT_TRUE(cache.status().ok()) << cache.status();
  const std::vector<int32_t> table = {0, 1}, len = {20};
  // All 20 keys are new rows: the launch appends them, then attends.
  const PagedAttnParams p = OneSequence(buf.params(), cache, table, len);
  const auto* k = static_cast<const uint8_t*>(buf.k());
  const std::vector<uint8_t> appended(k, k + 16 * row_bytes);  // page 0's rows
  // Once ungated, so the slot's buffers exist: growing them frees memory,
  // which waits for the whole device (the held legacy stream too).
  ASSERT_TRUE(PlanAndPagedForward(*backend, p, nullptr).ok());

  {  // Control: the poison the harness used before, queued behind the gate.
    cache.Poison();
    LegacyStreamGate gate;
    ASSERT_TRUE(gate.ok());
    for (void* slab : {cache.pages().k_slabs[0], cache.pages().v_slabs[0]}) {
      ASSERT_EQ(cudaMemset(slab, 0xff, static_cast<size_t>(32 * row_bytes)), cudaSuccess);
    }
    ASSERT_FALSE(gate.timed_out()) << "cudaMemset waited for the legacy stream";
    buf.Poison();
    const absl::Status st = PlanAndPagedForward(*backend, p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_FALSE(gate.timed_out()) << "the paged launch waited for the legacy stream";
    EXPECT_TRUE(CheckOutput(buf)) << "before the held poison lands";
    ASSERT_TRUE(gate.OpenAndDrain());
    EXPECT_NE(cache.ReadKPage(0, row_bytes), appended)
        << "a poison queued on the legacy stream landed before the append: the control no "
           "longer shows the hazard this test guards against";
  }
  {  // DeviceCache's poison with the same gate: in place before the launch.
    LegacyStreamGate gate;
    ASSERT_TRUE(gate.ok());
    cache.Poison();
    ASSERT_TRUE(cache.status().ok()) << cache.status();
    ASSERT_FALSE(gate.timed_out()) << "the cache's poison waited for the legacy stream";
    buf.Poison();
    const absl::Status st = PlanAndPagedForward(*backend, p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(CheckOutput(buf));
    ASSERT_TRUE(gate.OpenAndDrain());
    EXPECT_EQ(cache.ReadKPage(0, row_bytes), appended) << "the poison overwrote the appended rows";
  }
  ASSERT_TRUE(cache.status().ok()) << cache.status();
}

TEST(CudaPaged, PageIdOutsideTheCacheIsRejected) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  HostBuffers buf(DecodeOverTwoPages());
  const int64_t row_bytes = int64_t{128} * 2;
  DeviceCache cache(backend, 1, 1, 16, row_bytes);  // 2 pages
  ASSERT_TRUE(cache.status().ok());
  const std::vector<int32_t> table = {0, 2}, len = {20};  // page 2 does not exist
  const PagedAttnParams p = OneSequence(buf.params(), cache, table, len);
  const absl::Status st = PlanAndPagedForward(*backend, p, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // CheckPagedParams names the flat index b * block_table_stride + i.
  EXPECT_NE(st.message().find("block_table[1]"), std::string::npos) << st;
}

// The paged kernels take ALiBi slopes and sinks only: a bias, an element
// mask or a block mask is UNIMPLEMENTED naming the field; non-finite slopes
// are INVALID_ARGUMENT (CheckParams), as on a contiguous call.
TEST(CudaPaged, PagedModsAreAlibiAndSinksOnly) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  TestCase tc = DecodeOverTwoPages();
  tc.num_heads_q = 2;
  tc.num_heads_kv = 1;
  tc.mods.alibi = true;
  tc.mods.sinks = true;
  HostBuffers buf(tc);
  DeviceCache cache(backend, 1, 1, 16, int64_t{128} * 2);
  ASSERT_TRUE(cache.status().ok());
  const std::vector<int32_t> table = {0, 1}, len = {20};
  const PagedAttnParams p = OneSequence(buf.params(), cache, table, len);
  const absl::StatusOr<Plan> ok = backend->CanImplementPaged(p);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->kernel_family, KernelFamily::kPortable);

  const float bias[20] = {};
  const uint8_t mask[20] = {};
  const int32_t row_ptr[2] = {0, 1}, col_idx[1] = {0};
  for (int which = 0; which < 3; ++which) {
    PagedAttnParams m = p;
    const char* field = "bias";
    if (which == 0) {
      m.attn.bias = bias;
    } else if (which == 1) {
      m.attn.mask = mask;
      field = "mask";
    } else {
      m.attn.block_q = m.attn.block_k = 128;
      m.attn.block_row_ptr = row_ptr;
      m.attn.block_col_idx = col_idx;
      field = "block_q";
    }
    const absl::StatusOr<Plan> st = backend->CanImplementPaged(m);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kUnimplemented) << st.status();
    EXPECT_NE(st.status().message().find(field), std::string::npos) << st.status();
  }
  const float bad[2] = {0.5f, std::nanf("")};
  PagedAttnParams nan_slopes = p;
  nan_slopes.attn.alibi_slopes = bad;
  const absl::StatusOr<Plan> st = backend->CanImplementPaged(nan_slopes);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
  EXPECT_NE(st.status().message().find("alibi_slopes"), std::string::npos) << st.status();
}

// FP8 caches: Fp8PagedCase's host pages copied to device slabs, the launch
// through the backend (staging as in serving), the pages copied back and
// checked with the output.
// Fp8CaseGrid's cases, and what the CUDA kernels take apart: 8 query heads
// of one kv head per CTA (FP16, D 64), and D 72 (below its padded tile).
std::vector<Fp8Case> Fp8Grid() {
  std::vector<Fp8Case> grid = testing_util::Fp8CaseGrid();
  TestCase mqa = grid[0].tc;
  mqa.dtype = DType::kFP16;
  mqa.num_heads_q = 16;
  mqa.num_heads_kv = 1;
  mqa.head_dim = 64;
  grid.push_back({mqa, 32, 1, false, false});
  TestCase odd = grid[0].tc;
  odd.head_dim = 72;
  odd.num_heads_q = 6;
  grid.push_back({odd, 16, 1, false, true});
  return grid;
}

class CudaPagedFp8Test : public ::testing::TestWithParam<Fp8Case> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = SharedBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  AttentionBackend* backend_ = nullptr;
};

TEST_P(CudaPagedFp8Test, PagesAndOutputPassTheReference) {
  const Fp8Case& c = GetParam();
  HostBuffers buf(c.tc);
  testing_util::Fp8PagedCase paged(buf, c.page_size, c.new_rows, c.given_scales, c.cow, 7);
  testing_util::DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(),
                                  &paged.v_slabs());
  ASSERT_TRUE(slabs.status().ok()) << slabs.status();
  PagedAttnParams p = paged.params();
  p.pages = slabs.pages();
  absl::StatusOr<Plan> plan = backend_->CanImplementPaged(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  BackendTimings t;
  const absl::Status run = backend_->PagedForward(*plan, p, &t);
  ASSERT_TRUE(run.ok()) << run;
  slabs.CopyBack();
  EXPECT_EQ(paged.CheckPages(), "");
  EXPECT_EQ(paged.CheckOutput(paged.o(), paged.lse()), "");
}

INSTANTIATE_TEST_SUITE_P(Fp8, CudaPagedFp8Test, ::testing::ValuesIn(Fp8Grid()));

// Two calls packed into one launch (StartPagedForward's staging of the
// members' codes and scales): the same call twice, each member gets its O.
TEST_F(CudaPagedFp8Test, PackedMembersWithScales) {
  const Fp8Case c = Fp8Grid()[1];
  HostBuffers buf(c.tc);
  testing_util::Fp8PagedCase paged(buf, c.page_size, c.new_rows, true, true, 11);
  testing_util::DeviceSlabs slabs(backend_, paged.params().pages, &paged.k_slabs(),
                                  &paged.v_slabs());
  ASSERT_TRUE(slabs.status().ok()) << slabs.status();
  PagedAttnParams p = paged.params();
  p.pages = slabs.pages();
  absl::StatusOr<Plan> plan = backend_->CanImplementPaged(p);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const PagedBatch batch({&p, &p});
  absl::StatusOr<std::unique_ptr<PendingLaunch>> launch = backend_->StartPagedForward(*plan, batch);
  ASSERT_TRUE(launch.ok()) << launch.status();
  ASSERT_TRUE((*launch)->Finish(nullptr).ok());
  slabs.CopyBack();
  EXPECT_EQ(paged.CheckPages(), "");
  EXPECT_EQ(paged.CheckOutput(paged.o(), paged.lse()), "");
}

}  // namespace
}  // namespace attnserve
